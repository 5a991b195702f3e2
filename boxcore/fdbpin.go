package boxcore

import (
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/claudebox/claudebox/internal/netdump"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/claudebox/claudebox/firewall"
)

// FDB pinning: the fdb-pin layer. The bridge learns a frame's source MAC on the port it came
// in by (br_fdb_update) before the hooks Incus's NIC filtering runs at: a box sending with a
// sibling's MAC moves the sibling's FDB entry to its own port, and the host's frames for the
// sibling with it. The port binding drops such a frame in prerouting, before learning; this
// layer stands outside nftables and holds without it. Every bound box port has
//   - a static, sticky FDB entry for the box NIC's MAC on the port (`bridge fdb replace MAC
//     dev PORT master static sticky`): the kernel never moves a sticky entry to another port
//     (a static one it does: measured, TestFDBPin with the pin mutated to static only),
//   - and learning off (IFLA_BRPORT_LEARNING=0): the bridge learns nothing from a box port,
//     link-local frames included, so a forged source can teach it no other MAC either.
// Frames for a box reach its port through its static entry; nothing else needs learning. A
// stopped box's veth goes, and its entry with it.

// FDBPin is one bound box NIC's pin as the kernel holds it.
type FDBPin struct {
	Box, Device string
	Port        string
	MAC         net.HardwareAddr
	// Entry is the bridge's entry for MAC: "static sticky" when pinned; else "static",
	// "sticky", "dynamic", "local", or "none"; "on <port> (...)" when it is on another port.
	Entry string
	// Learning is the port's brport/learning ("on", "off", or "unreadable").
	Learning string
}

// Held: the MAC is pinned on its port and the port learns nothing.
func (p FDBPin) Held() bool { return p.Entry == pinnedEntry && p.Learning == "off" }

// Actual is the pin as host check shows it.
func (p FDBPin) Actual() string { return p.Entry + ", learning " + p.Learning }

const (
	pinnedEntry = "static sticky"
	pinWant     = pinnedEntry + ", learning off"
)

// StalePin is a static, sticky entry on a port of the bridge that no bound box NIC wants.
type StalePin struct {
	Port string
	MAC  string
}

// fdbEntry is one entry the bridge (master) holds for a port.
type fdbEntry struct {
	port  string
	index int
	n     netlink.Neigh
}

func (e fdbEntry) static() bool {
	return e.n.State&netlink.NUD_NOARP != 0 && e.n.State&netlink.NUD_PERMANENT == 0
}
func (e fdbEntry) sticky() bool { return e.n.Flags&netlink.NTF_STICKY != 0 }
func (e fdbEntry) local() bool  { return e.n.State&netlink.NUD_PERMANENT != 0 }

func (e fdbEntry) kind() string {
	switch {
	case e.local():
		return "local"
	case e.static() && e.sticky():
		return pinnedEntry
	case e.static():
		return "static"
	case e.sticky():
		return "sticky"
	}
	return "dynamic"
}

// bridgeFDB lists the entries the bridge holds for its ports (not the bridge device's own,
// not the ports' own address lists).
func bridgeFDB(bridge string) ([]fdbEntry, error) {
	br, err := netlink.LinkByName(bridge)
	if err != nil {
		return nil, err
	}
	ns, err := netdump.Neighs(0, unix.AF_BRIDGE)
	if err != nil {
		return nil, fmt.Errorf("fdb of %s: %w", bridge, err)
	}
	names := map[int]string{}
	var out []fdbEntry
	for _, n := range ns {
		if n.MasterIndex != br.Attrs().Index || n.LinkIndex == br.Attrs().Index || n.Flags&netlink.NTF_SELF != 0 {
			continue
		}
		name, ok := names[n.LinkIndex]
		if !ok {
			if l, err := netlink.LinkByIndex(n.LinkIndex); err == nil {
				name = l.Attrs().Name
			}
			names[n.LinkIndex] = name
		}
		out = append(out, fdbEntry{port: name, index: n.LinkIndex, n: n})
	}
	return out, nil
}

// PortLearning reads a bridge port's brport/learning and brport/unicast_flood: "off" when
// both are 0 (the port teaches the bridge nothing and gets no unknown-unicast flood: a frame
// for a box whose entry is gone — stopped, restarting — is not copied to its siblings),
// "on" when both are 1, else which is on, or "unreadable".
func (k Kernel) PortLearning(port string) string {
	read := func(f string) (string, error) {
		b, err := os.ReadFile(filepath.Join(k.Sys, "class/net", port, "brport", f))
		return strings.TrimSpace(string(b)), err
	}
	learn, err1 := read("learning")
	flood, err2 := read("unicast_flood")
	switch {
	case err1 != nil || err2 != nil:
		return "unreadable"
	case learn == "0" && flood == "0":
		return "off"
	case learn != "0" && flood != "0":
		return "on"
	case learn != "0":
		return "on (learning; unicast flood off)"
	}
	return "on (unicast flood; learning off)"
}

// FDBPins reads the pin of every NIC that can be bound (nics without a Problem), and the
// static, sticky entries on the bridge's ports that none of them wants (stale).
func (k Kernel) FDBPins(bridge string, nics []NICBinding) ([]FDBPin, []StalePin, error) {
	fdb, err := bridgeFDB(bridge)
	if err != nil {
		return nil, nil, err
	}
	var pins []FDBPin
	want := map[string]bool{}
	for _, n := range nics {
		if n.Problem != "" {
			continue
		}
		b := n.Binding
		want[b.Port+" "+b.MAC.String()] = true
		p := FDBPin{Box: n.Box, Device: n.Device, Port: b.Port, MAC: b.MAC, Entry: "none", Learning: k.PortLearning(b.Port)}
		var elsewhere []string
		for _, e := range fdb {
			if e.n.HardwareAddr.String() != b.MAC.String() {
				continue
			}
			if e.port == b.Port {
				p.Entry = e.kind()
				break
			}
			elsewhere = append(elsewhere, e.port+" ("+e.kind()+")")
		}
		if p.Entry == "none" && len(elsewhere) > 0 {
			p.Entry = "on " + strings.Join(elsewhere, ", ")
		}
		pins = append(pins, p)
	}
	var stale []StalePin
	for _, e := range fdb {
		if e.static() && e.sticky() && !want[e.port+" "+e.n.HardwareAddr.String()] {
			stale = append(stale, StalePin{Port: e.port, MAC: e.n.HardwareAddr.String()})
		}
	}
	return pins, stale, nil
}

// PinFDB pins each binding's MAC on its port (a static, sticky entry; one that is there
// already is left alone) and turns learning off on the port. It reports whether it wrote.
func (k Kernel) PinFDB(bridge string, bs []firewall.PortBinding) (changed bool, err error) {
	if len(bs) == 0 {
		return false, nil
	}
	fdb, err := bridgeFDB(bridge)
	if err != nil {
		return false, err
	}
	// Each port on its own: a port that moved or went (a box rebooting from inside, over and
	// over) is an error of its own, and every other port is still pinned.
	var errs []error
	for _, b := range bs {
		c, err := k.pinPort(bridge, fdb, b)
		changed = changed || c
		if err != nil {
			errs = append(errs, &PortPinError{Port: b.Port, Err: err})
		}
	}
	return changed, errors.Join(errs...)
}

// PortPinError: one port could not be pinned (the others were).
type PortPinError struct {
	Port string
	Err  error
}

func (e *PortPinError) Error() string { return e.Err.Error() }
func (e *PortPinError) Unwrap() error { return e.Err }

// unpinned is the ports err names as not pinned (PortPinError, also joined or wrapped).
func unpinned(err error) map[string]bool {
	out := map[string]bool{}
	var walk func(error)
	walk = func(err error) {
		var pe *PortPinError
		if errors.As(err, &pe) {
			out[pe.Port] = true
		}
		if j, ok := err.(interface{ Unwrap() []error }); ok {
			for _, e := range j.Unwrap() {
				walk(e)
			}
		} else if u := errors.Unwrap(err); u != nil {
			walk(u)
		}
	}
	walk(err)
	return out
}

// pinPort pins one port's MAC and switches its learning and unicast flood off.
func (k Kernel) pinPort(bridge string, fdb []fdbEntry, b firewall.PortBinding) (changed bool, err error) {
	l, err := netlink.LinkByName(b.Port)
	if err != nil && linkGone(err) {
		return false, nil // its box stopped meanwhile: nothing to pin
	}
	if err != nil {
		return false, fmt.Errorf("port %s: %w", b.Port, err)
	}
	if !onBridge(l, bridge) {
		return false, fmt.Errorf("port %s is not on bridge %s", b.Port, bridge)
	}
	pinned := slices.ContainsFunc(fdb, func(e fdbEntry) bool {
		return e.index == l.Attrs().Index && e.n.HardwareAddr.String() == b.MAC.String() && e.static() && e.sticky()
	})
	if !pinned {
		changed = true
		if err := netlink.NeighSet(pinNeigh(l.Attrs().Index, b.MAC)); err != nil && !linkMissing(b.Port) {
			return changed, fmt.Errorf("pinning %s on %s: %w", b.MAC, b.Port, err)
		}
	}
	if k.PortLearning(b.Port) != "off" {
		changed = true
		if err := netlink.LinkSetLearning(l, false); err != nil {
			return changed, fmt.Errorf("learning off on %s: %w", b.Port, err)
		}
		if err := netlink.LinkSetFlood(l, false); err != nil {
			return changed, fmt.Errorf("unicast flood off on %s: %w", b.Port, err)
		}
	}
	return changed, nil
}

// PruneFDBPins removes the stale pins (no bound NIC of keep wants them) and gives their
// ports learning back: a port that learns nothing and has no pin would have its box's
// frames flooded.
func (k Kernel) PruneFDBPins(bridge string, keep []firewall.PortBinding) (changed bool, err error) {
	var nics []NICBinding
	for _, b := range keep {
		nics = append(nics, NICBinding{Binding: b})
	}
	_, stale, err := k.FDBPins(bridge, nics)
	if err != nil {
		return false, err
	}
	var errs []error
	for _, s := range stale {
		mac, _ := net.ParseMAC(s.MAC)
		changed = true
		errs = append(errs, k.UnpinFDB(bridge, firewall.PortBinding{Port: s.Port, MAC: mac}))
	}
	return changed, errors.Join(errs...)
}

// UnpinFDB deletes b's static entry from its port and turns learning back on there (the
// seeded hole; a stale pin). A port that is gone has nothing left to unpin.
func (k Kernel) UnpinFDB(bridge string, b firewall.PortBinding) error {
	l, err := netlink.LinkByName(b.Port)
	if err != nil {
		if linkGone(err) {
			return nil
		}
		return fmt.Errorf("port %s: %w", b.Port, err)
	}
	if !onBridge(l, bridge) {
		return fmt.Errorf("port %s is not on bridge %s", b.Port, bridge)
	}
	if err := netlink.NeighDel(pinNeigh(l.Attrs().Index, b.MAC)); err != nil && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("unpinning %s on %s: %w", b.MAC, b.Port, err)
	}
	if err := netlink.LinkSetLearning(l, true); err != nil {
		return fmt.Errorf("learning on on %s: %w", b.Port, err)
	}
	if err := netlink.LinkSetFlood(l, true); err != nil {
		return fmt.Errorf("unicast flood on on %s: %w", b.Port, err)
	}
	return nil
}

// pinNeigh is `bridge fdb replace MAC dev PORT master static sticky`.
func pinNeigh(port int, mac net.HardwareAddr) *netlink.Neigh {
	return &netlink.Neigh{Family: unix.AF_BRIDGE, LinkIndex: port, HardwareAddr: mac,
		State: netlink.NUD_NOARP, Flags: netlink.NTF_MASTER | netlink.NTF_STICKY}
}

func onBridge(l netlink.Link, bridge string) bool {
	br, err := netlink.LinkByName(bridge)
	return err == nil && l.Attrs().MasterIndex == br.Attrs().Index
}

// linkMissing: a port whose box stopped meanwhile has no pin left to restore.
func linkMissing(port string) bool {
	_, err := netlink.LinkByName(port)
	return err != nil && linkGone(err)
}

func linkGone(err error) bool {
	var nf netlink.LinkNotFoundError
	return errors.As(err, &nf) || errors.Is(err, unix.ENODEV)
}

// fdbPinOn: every bindable NIC (of boxes; nil: every box) is pinned on its port, which
// learns nothing; with boxes nil, no stale pin either. NICs that cannot be bound are the
// port-binding layer's drift, not this one's.
func (st *StackState) fdbPinOn(boxes []string) (bool, string) {
	var pinned, not []string
	for _, p := range st.FDBPins {
		if boxes != nil && !slices.Contains(boxes, p.Box) {
			continue
		}
		if p.Held() {
			pinned = append(pinned, p.Port)
		} else {
			not = append(not, p.Port+" "+p.MAC.String()+": "+p.Actual())
		}
	}
	if boxes == nil {
		for _, s := range st.FDBStale {
			not = append(not, "stale pin "+s.MAC+" on "+s.Port)
		}
	}
	if st.FDBErr != nil {
		not = append(not, "fdb unreadable: "+st.FDBErr.Error())
	}
	return len(not) == 0, fmt.Sprintf("static sticky MAC, learning off on [%s]; not on [%s]", strings.Join(pinned, " "), strings.Join(not, "; "))
}

// fdbPins: one check row per bindable NIC's pin, one per stale pin.
func (c *checker) fdbPins(st *StackState) {
	if st.Gateway == nil {
		return
	}
	if st.FDBErr != nil {
		c.add("fdb pin", st.Stack.Network+" fdb", "readable", st.FDBErr.Error())
		return
	}
	for _, p := range st.FDBPins {
		c.add("fdb pin", p.Box+" "+p.Device+" port "+p.Port+" "+p.MAC.String(), pinWant, p.Actual())
	}
	for _, s := range st.FDBStale {
		c.add("fdb pin", "port "+s.Port+" "+s.MAC, "no pin (no bound box)", "stale pin")
	}
}
