package boxcore

import (
	"context"
	"encoding/hex"
	"fmt"
	"maps"
	"net"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"strings"
)

// Exposures: a port of a box made reachable from the host's loopback, and from nowhere else.
// Each is an Incus proxy device in the box's own config, named expose-PORT, listening on a
// loopback address of the host and connecting to 127.0.0.1:PORT inside the box. bind=host:
// Incus's forkproxy listens in the host's network namespace and connects from inside the
// box's, so the traffic never crosses the bridge and the box gains no route to the host.
// Two layers: the proxy's loopback listen, and the guard's rule (firewall.Spec.Exposed) that
// rejects (a TCP reset) a packet to the exposed host port unless it is addressed to a loopback address.
//
// The boundary knows exactly this shape (escape.go): it is the box's own, and a clone or an
// import drops it (a clone's would fight its source for the same host address).

const exposePrefix = "expose-"

// Exposure is one exposed port.
type Exposure struct {
	Device string         `json:"device" yaml:"device"`
	Port   uint16         `json:"port" yaml:"port"` // inside the box, on 127.0.0.1
	On     netip.AddrPort `json:"on" yaml:"on"`     // on the host: a loopback address
}

func (e Exposure) String() string { return fmt.Sprintf("%s -> box port %d", e.On, e.Port) }

func exposeDevice(port uint16, on netip.AddrPort) map[string]string {
	return map[string]string{"type": "proxy", "bind": "host",
		"listen": "tcp:" + on.String(), "connect": "tcp:127.0.0.1:" + strconv.Itoa(int(port))}
}

// AsExposure reads a device as an exposure: ok only for exactly the device Expose makes.
func AsExposure(name string, d map[string]string) (Exposure, bool) {
	p, found := strings.CutPrefix(name, exposePrefix)
	port, err := strconv.ParseUint(p, 10, 16)
	if !found || err != nil || port == 0 || strconv.FormatUint(port, 10) != p {
		return Exposure{}, false
	}
	lis, _ := strings.CutPrefix(d["listen"], "tcp:")
	on, err := netip.ParseAddrPort(lis)
	if err != nil || !on.Addr().IsLoopback() || on.Addr().Is4In6() || on.Port() == 0 {
		return Exposure{}, false
	}
	if !maps.Equal(d, exposeDevice(uint16(port), on)) {
		return Exposure{}, false
	}
	return Exposure{Device: name, Port: uint16(port), On: on}, true
}

// proxyHostPort is the host TCP port a proxy device listens on ("tcp:ADDR:PORT"), whatever
// its address.
func proxyHostPort(d map[string]string) (uint16, bool) {
	lis, ok := strings.CutPrefix(d["listen"], "tcp:")
	if !ok {
		return 0, false
	}
	_, p, err := net.SplitHostPort(lis)
	if err != nil {
		return 0, false
	}
	port, err := strconv.ParseUint(p, 10, 16)
	return uint16(port), err == nil && port > 0
}

// Exposures lists a box's exposures, by port.
func Exposures(devices map[string]map[string]string) []Exposure {
	var out []Exposure
	for name, d := range devices {
		if e, ok := AsExposure(name, d); ok {
			out = append(out, e)
		}
	}
	slices.SortFunc(out, func(a, b Exposure) int { return int(a.Port) - int(b.Port) })
	return out
}

// withoutExposures is devices less every exposure, and whether there was one.
func withoutExposures(devices map[string]map[string]string) (map[string]map[string]string, bool) {
	out := maps.Clone(devices)
	dropped := false
	for name, d := range devices {
		if _, ok := AsExposure(name, d); ok {
			delete(out, name)
			dropped = true
		}
	}
	return out, dropped
}

// ParsePort reads a box port (1-65535).
func ParsePort(s string) (uint16, error) {
	p, err := strconv.ParseUint(s, 10, 16)
	if err != nil || p == 0 {
		return 0, Usagef("%q is no port: want a number from 1 to 65535", s)
	}
	return uint16(p), nil
}

// ParseExposeOn reads --on: "" is 127.0.0.1:PORT, a bare number is 127.0.0.1:NUMBER, else
// ADDR:PORT with a loopback ADDR ([::1]:PORT for IPv6). Any other address is refused: an
// exposure is for this host's own user, never for the LAN.
func ParseExposeOn(on string, port uint16) (netip.AddrPort, error) {
	loop := netip.MustParseAddr("127.0.0.1")
	switch {
	case on == "":
		return netip.AddrPortFrom(loop, port), nil
	case !strings.Contains(on, ":"):
		p, err := ParsePort(on)
		if err != nil {
			return netip.AddrPort{}, Usagef("expose: --on %s", err)
		}
		return netip.AddrPortFrom(loop, p), nil
	}
	ap, err := netip.ParseAddrPort(on)
	// [::ffff:127.0.0.1] is 127.0.0.1 (Incus listens there): one spelling per address, so
	// two boxes can never be given the same one.
	ap = netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
	switch {
	case err != nil:
		return netip.AddrPort{}, Usagef("expose: --on %q: want HOSTPORT or ADDR:HOSTPORT (e.g. 127.0.0.1:8080 or [::1]:8080)", on)
	case !ap.Addr().IsLoopback():
		return netip.AddrPort{}, Usagef("expose: --on %s: %s is not a loopback address; an exposure is reachable from this host only (127.0.0.0/8 or ::1). To reach it from elsewhere, forward it yourself (ssh -L)", on, ap.Addr())
	case ap.Port() == 0:
		return netip.AddrPort{}, Usagef("expose: --on %s: port 0 is no port", on)
	}
	return ap, nil
}

// Expose makes port of box b reachable on the host at on (a loopback address). The box may be
// running (the proxy starts at once) or stopped (it starts with the box).
func (bs *Boxes) Expose(ctx context.Context, b *Box, port uint16, on netip.AddrPort) (Exposure, error) {
	if b.Instance.Type == "virtual-machine" {
		return Exposure{}, Usagef("expose %s: %s is a VM; exposing a VM's port is not supported yet (use a container box, or forward it with ssh -L)", b.Name, b.Name)
	}
	on = netip.AddrPortFrom(on.Addr().Unmap(), on.Port())
	if !on.Addr().IsLoopback() {
		return Exposure{}, Usagef("expose %s: %s is not a loopback address", b.Name, on.Addr())
	}
	if err := bs.canGuard(); err != nil {
		return Exposure{}, err
	}
	if err := bs.requireHere(ctx, b, "expose"); err != nil {
		return Exposure{}, err
	}
	in, etag, err := bs.Client.Instance(ctx, b.Name)
	if err != nil {
		return Exposure{}, err
	}
	for _, e := range Exposures(in.Devices) {
		if e.Port == port {
			return Exposure{}, Usagef("expose %s: port %d is exposed already, on %s: 'claudebox unexpose %s %d' first", b.Name, port, e.On, b.Name, port)
		}
	}
	if other, err := bs.exposedOn(ctx, on); err != nil {
		return Exposure{}, err
	} else if other != "" {
		return Exposure{}, Usagef("expose %s: %s is taken by an exposure of %s: pick another with --on", b.Name, on, other)
	}
	if bs.Client.Remote() == "local" {
		// A host service on that port, at any address, running box or stopped: the guard's
		// rule would cut it off from everything but loopback (port 22: the LAN's SSH).
		if who := listenedPort(on.Port()); who != "" {
			return Exposure{}, Usagef("expose %s: port %d is in use on this host (%s): pick another with --on", b.Name, on.Port(), who)
		}
	}
	e := Exposure{Device: exposePrefix + strconv.Itoa(int(port)), Port: port, On: on}
	put := in.Writable()
	if put.Devices == nil {
		put.Devices = map[string]map[string]string{}
	}
	put.Devices[e.Device] = exposeDevice(port, on)
	if err := bs.Client.UpdateInstance(ctx, b.Name, put, etag); err != nil {
		return Exposure{}, fmt.Errorf("expose %s: %w", b.Name, err)
	}
	// The guard's second layer for it (the proxy listens on loopback itself already).
	if err := bs.bindPorts(ctx, b.Name); err != nil {
		return e, fmt.Errorf("expose %s: the guard's rule for %s: %w", b.Name, on, err)
	}
	return e, nil
}

// Unexpose removes the exposure of port.
func (bs *Boxes) Unexpose(ctx context.Context, b *Box, port uint16) error {
	if err := bs.canGuard(); err != nil {
		return err
	}
	in, etag, err := bs.Client.Instance(ctx, b.Name)
	if err != nil {
		return err
	}
	put := in.Writable()
	for _, e := range Exposures(in.Devices) {
		if e.Port == port {
			delete(put.Devices, e.Device)
			if err := bs.Client.UpdateInstance(ctx, b.Name, put, etag); err != nil {
				return fmt.Errorf("unexpose %s: %w", b.Name, err)
			}
			return bs.bindPorts(ctx, b.Name)
		}
	}
	return Usagef("unexpose %s: port %d is not exposed (see 'claudebox info %s')", b.Name, port, b.Name)
}

// exposedOn names the box whose exposure listens on on, if any.
func (bs *Boxes) exposedOn(ctx context.Context, on netip.AddrPort) (string, error) {
	insts, err := bs.Client.Instances(ctx, nil, false)
	if err != nil {
		return "", err
	}
	// On a cluster each member's loopback is its own: only this member's boxes can take it.
	local, err := localMember(ctx, bs.Client)
	if err != nil {
		return "", err
	}
	for _, in := range insts {
		if !onMember(in, local) {
			continue
		}
		for _, e := range Exposures(in.Devices) {
			if e.On == on {
				return in.Name, nil
			}
		}
	}
	return "", nil
}

// canGuard: the guard's rule for an exposure is nftables, so on this host's daemon a change
// needs root, asked before anything changes (a remote host's claudebox keeps its own guard).
func (bs *Boxes) canGuard() error {
	if bs.Client.Remote() == "local" && os.Geteuid() != 0 {
		return ErrBindNeedsRoot
	}
	return nil
}

// listenedPort names a TCP socket listening on port on this host, at any address (from
// /proc/net/tcp and tcp6, the host's network namespace), or "".
func listenedPort(port uint16) string {
	for _, f := range []string{"/proc/net/tcp", "/proc/net/tcp6"} {
		b, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		for _, line := range strings.Split(string(b), "\n")[1:] {
			fs := strings.Fields(line)
			if len(fs) < 4 || fs[3] != "0A" { // 0A: TCP_LISTEN
				continue
			}
			addr, hexPort, ok := strings.Cut(fs[1], ":")
			if p, err := strconv.ParseUint(hexPort, 16, 16); ok && err == nil && uint16(p) == port {
				return "a listener at " + procAddr(addr) + ":" + strconv.Itoa(int(port))
			}
		}
	}
	return ""
}

// procAddr renders /proc/net/tcp's hex address (host byte order per 32-bit word).
func procAddr(h string) string {
	b, err := hex.DecodeString(h)
	if err != nil || (len(b) != 4 && len(b) != 16) {
		return h
	}
	for i := 0; i+4 <= len(b); i += 4 {
		b[i], b[i+1], b[i+2], b[i+3] = b[i+3], b[i+2], b[i+1], b[i]
	}
	a, _ := netip.AddrFromSlice(b)
	return a.Unmap().String()
}

// setExposures makes a stopped box's exposures exactly keep, whatever it holds now: none for
// a just-made clone or import (theirs would listen where the source's do), the ones it had
// before for a just-restored box (a snapshot's are not its to give back).
func (bs *Boxes) setExposures(ctx context.Context, name string, keep []Exposure) error {
	in, etag, err := bs.Client.Instance(ctx, name)
	if err != nil {
		return err
	}
	devices, _ := withoutExposures(in.Devices)
	if devices == nil {
		devices = map[string]map[string]string{}
	}
	for _, e := range keep {
		devices[e.Device] = exposeDevice(e.Port, e.On)
	}
	if maps.EqualFunc(devices, in.Devices, maps.Equal) {
		return nil
	}
	put := in.Writable()
	put.Devices = devices
	if err := bs.Client.UpdateInstance(ctx, name, put, etag); err != nil {
		return fmt.Errorf("%s's exposures: %w", name, err)
	}
	return nil
}
