package boxcore

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/claudebox/claudebox/boxcore/incus"
	"github.com/claudebox/claudebox/firewall"
)

// Port bindings: the port-binding layer (firewall.PartPorts) binds each running box's bridge
// port to the box NIC's MAC and IPv4 address, in claudebox's own bridge table, beside Incus's
// NIC filtering. A port without a binding is not checked (fail open: the bridge family cannot
// tell which bridge a port is on here), so every running box must be bound: host init and
// ApplyFirewall bind what runs, and the box verbs call BindPorts after a box starts.

// NICBinding is one running box NIC on the stack's network and what the binding is read from.
type NICBinding struct {
	Box, Device string
	Binding     firewall.PortBinding // Port, MAC and IPv4; IPv4 invalid when unknown
	IPFrom      string               // "dnsmasq.hosts", "nic ipv4.address", "instance state"
	Problem     string               // why the NIC cannot be bound ("" when it can)
	// RPFilter is the port's effective net.ipv4.conf rp_filter (the larger of the port's own,
	// RPFilterOwn, and conf.all's), -1 when unreadable: the port-rp-filter layer wants 1.
	RPFilter, RPFilterOwn int
	// Tagged: the instance is a box (TagKey). Started is its last start as this read saw it
	// (Incus's last_used_at), Acked its TagBound then: what the agent acknowledges.
	Tagged  bool
	Started time.Time
	Acked   string
}

// readBindings reads the running boxes' NICs on the stack's network: host-side veth
// (volatile.<dev>.host_name, else the instance state), MAC (volatile.<dev>.hwaddr) and IPv4
// (Incus's static DHCP allocation in dnsmasq.hosts, which ipv4_filtering pins; else the NIC's
// ipv4.address; else the address the instance state shows). Only ports the kernel has on the
// bridge are bound: a name on another bridge must never be matched.
func (h *Host) readBindings(ctx context.Context, st *StackState) error {
	insts, err := h.Client.Instances(ctx, nil, false)
	if err != nil {
		return err
	}
	ports, err := h.Kernel.BridgePorts(h.Stack.Network)
	if err != nil {
		return err
	}
	onBridge := map[string]bool{}
	for _, p := range ports {
		onBridge[p.Name] = true
	}
	local, err := localMember(ctx, h.Client)
	if err != nil {
		return err
	}
	st.Member = local
	hosts := readDNSMasqHosts(h.Stack.Network)
	for _, in := range insts {
		if !onMember(in, local) {
			continue // another cluster member's box: its port and proxies are that kernel's
		}
		if in.ExpandedDevices["eth0"]["network"] == h.Stack.Network {
			// Every proxy of a box keeps its host port guarded, an exposure or not: one the
			// escape hatch widened past loopback is exactly what the guard is for.
			for _, name := range slices.Sorted(maps.Keys(in.Devices)) {
				d := in.Devices[name]
				if d["type"] != "proxy" {
					continue
				}
				if port, ok := proxyHostPort(d); ok {
					st.Exposed = append(st.Exposed, port)
				}
				if _, ok := AsExposure(name, d); !ok {
					st.OddProxies = append(st.OddProxies, fmt.Sprintf("%s %s: listen %s connect %s", in.Name, name, d["listen"], d["connect"]))
				}
			}
		}
		if in.Status != "Running" {
			continue
		}
		for _, dev := range slices.Sorted(maps.Keys(in.ExpandedDevices)) {
			d := in.ExpandedDevices[dev]
			if d["type"] != "nic" || d["network"] != h.Stack.Network {
				continue
			}
			nb := NICBinding{Box: in.Name, Device: dev, Tagged: in.Config[TagKey] == "1", Started: in.LastUsedAt, Acked: in.Config[TagBound]}
			b := &nb.Binding
			b.Port = in.Config["volatile."+dev+".host_name"]
			b.MAC, _ = net.ParseMAC(in.Config["volatile."+dev+".hwaddr"])
			if a, ok := hosts[hostsKey(in.Project, in.Name, dev)]; ok && macEqual(a.mac, b.MAC) {
				b.IPv4, nb.IPFrom = a.ip, "dnsmasq.hosts"
			} else if a, err := netip.ParseAddr(d["ipv4.address"]); err == nil && a.Is4() {
				b.IPv4, nb.IPFrom = a, "nic ipv4.address"
			}
			if b.Port == "" || !b.IPv4.IsValid() {
				if s, err := h.Client.InstanceState(ctx, in.Name); err == nil {
					ns := s.Network[dev]
					if b.Port == "" {
						b.Port = ns.HostName
					}
					if !b.IPv4.IsValid() {
						for _, a := range ns.Addresses {
							if ip, err := netip.ParseAddr(a.Address); err == nil && a.Family == "inet" && ip.Is4() {
								b.IPv4, nb.IPFrom = ip, "instance state"
								break
							}
						}
					}
				}
			}
			switch {
			case b.Port == "":
				nb.Problem = "no host-side veth name"
			case !onBridge[b.Port]:
				nb.Problem = "port " + b.Port + " is not on bridge " + h.Stack.Network
			case len(b.MAC) != 6:
				nb.Problem = "no MAC (volatile." + dev + ".hwaddr)"
			case !b.IPv4.IsValid():
				nb.Problem = "no IPv4 address known (no dnsmasq.hosts entry, no lease)"
			case st.Gateway != nil && !st.Gateway.Contains(net.IP(b.IPv4.AsSlice())):
				nb.Problem = "address " + b.IPv4.String() + " is outside " + st.Gateway.String()
			}
			nb.RPFilter, nb.RPFilterOwn = -1, -1
			if b.Port != "" && onBridge[b.Port] {
				if eff, own, err := firewall.PortRPFilter(b.Port); err == nil {
					nb.RPFilter, nb.RPFilterOwn = eff, own
				}
			}
			st.NICs = append(st.NICs, nb)
		}
	}
	st.mergePending(readPendings(h.Stack.Network), onBridge)
	// Two NICs claiming one MAC or address cannot both be bound: neither is.
	for i := range st.NICs {
		for j := range st.NICs {
			a, b := &st.NICs[i], &st.NICs[j]
			if i != j && a.Problem == "" && b.Problem == "" && (a.Binding.IPv4 == b.Binding.IPv4 || macEqual(a.Binding.MAC, b.Binding.MAC)) {
				a.Problem = problemShared + b.Box
			}
		}
	}
	return nil
}

// problemShared begins the Problem of a NIC whose MAC or address another NIC has too: neither
// is bound, and the verbs of either box say so (ownBindError).
const problemShared = "shares its MAC or address with "

// rereadBindings replaces what readBindings read into st with a fresh read.
func (h *Host) rereadBindings(ctx context.Context, st *StackState) error {
	st.NICs, st.Exposed, st.OddProxies, st.Unplugged = nil, nil, nil, nil
	return h.readBindings(ctx, st)
}

// Bindings are the bindings of every NIC that can be bound, for the firewall spec.
//
// They are in port order, whatever order they were read in: a box `new` is starting is merged
// in last (pending), and a round that bound it so must leave the rules in the order the next
// read gives (host check compares rule by rule, in order).
func (st *StackState) Bindings() []firewall.PortBinding {
	var out []firewall.PortBinding
	for _, n := range st.NICs {
		if n.Problem == "" {
			out = append(out, n.Binding)
		}
	}
	slices.SortFunc(out, func(a, b firewall.PortBinding) int { return strings.Compare(a.Port, b.Port) })
	return out
}

// bindingsIn are the bindings inside subnet gw (init may be moving the network elsewhere).
func (st *StackState) bindingsIn(gw *net.IPNet) []firewall.PortBinding {
	var out []firewall.PortBinding
	for _, b := range st.Bindings() {
		if gw != nil && gw.Contains(net.IP(b.IPv4.AsSlice())) {
			out = append(out, b)
		}
	}
	return out
}

type hostsEntry struct {
	mac net.HardwareAddr
	ip  netip.Addr
}

func incusDir() string {
	if d := os.Getenv("INCUS_DIR"); d != "" {
		return d
	}
	return "/var/lib/incus"
}

// hostsKey is the file name Incus gives a NIC's dnsmasq.hosts entry.
func hostsKey(project, inst, dev string) string {
	if project != "" && project != "default" {
		return project + "_" + inst + "." + dev
	}
	return inst + "." + dev
}

// readDNSMasqHosts reads Incus's per-NIC static DHCP entries for a network
// (<INCUS_DIR>/networks/<net>/dnsmasq.hosts/<instance>.<dev>: "MAC,IPv4[,name]").
func readDNSMasqHosts(network string) map[string]hostsEntry {
	dir := filepath.Join(incusDir(), "networks", network, "dnsmasq.hosts")
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil
	}
	out := map[string]hostsEntry{}
	for _, e := range ents {
		f, err := os.Open(filepath.Join(dir, e.Name()))
		if err != nil {
			continue
		}
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			var he hostsEntry
			for _, tok := range strings.Split(strings.TrimSpace(sc.Text()), ",") {
				if m, err := net.ParseMAC(tok); err == nil && len(m) == 6 {
					he.mac = m
				} else if a, err := netip.ParseAddr(tok); err == nil && a.Is4() {
					he.ip = a
				}
			}
			if he.mac != nil && he.ip.IsValid() {
				out[e.Name()] = he
			}
		}
		f.Close()
	}
	return out
}

func macEqual(a, b net.HardwareAddr) bool { return len(a) == 6 && a.String() == b.String() }

// applyL2 converges the firewall to spec, sets the bridge's no_linklocal_learn (part of the
// port-binding layer: see firewall.SetNoLinkLocalLearn), rp_filter=1 on every bound port
// (the port-rp-filter layer: see firewall.StrictRPFilter), and pins every bound port's MAC
// in the bridge's FDB with learning off on the port, dropping stale pins (the fdb-pin layer:
// see fdbpin.go).
//
// A pending port whose veth is not there yet (st.Unplugged: a box `new` is starting) gets its
// rules only; the `new` pins it once it runs.
func (h *Host) applyL2(spec firewall.Spec, unplugged map[string]bool) (bool, error) {
	return h.applyPorts(spec, unplugged, nil)
}

// applyPorts is applyL2, or, with fresh not nil (a quick round), its lighter form: the
// nftables apply goes without its read-back, and only the fresh ports get their rp_filter
// and FDB pins — every other port is on the veth the last round set them for (quickRound
// checks), and only a claudebox apply or a drill's hole, which void the round, change them.
func (h *Host) applyPorts(spec firewall.Spec, unplugged map[string]bool, fresh []firewall.PortBinding) (bool, error) {
	forgetFullBind(h.Stack.Network)
	t := time.Now()
	apply := firewall.Apply
	if fresh != nil {
		apply = firewall.ApplyUnchecked
	}
	changed, err := apply(spec)
	incus.TraceStep("kernel", "nftables apply", t)
	if err != nil {
		return changed, err
	}
	t = time.Now()
	defer func() { incus.TraceStep("kernel", "flap guard, sysctls, fdb pins", t) }()
	if sn := spec.Resolved().Subnet(); sn != nil && !flapGuardPresent(sn) {
		changed = true
		if err := ensureFlapGuard(sn); err != nil {
			return changed, err
		}
	}
	if on, err := firewall.NoLinkLocalLearn(h.Stack.Network); err == nil && !on {
		changed = true
		if err := firewall.SetNoLinkLocalLearn(h.Stack.Network, true); err != nil {
			return changed, err
		}
	} else if err != nil {
		return changed, err
	}
	ports, pruned := spec.Ports, false
	if fresh != nil {
		ports = fresh
	}
	rp, err := firewall.StrictRPFilter(firewall.Spec{Ports: ports})
	if err != nil {
		return changed || rp, fmt.Errorf("port rp_filter: %w", err)
	}
	changed = changed || rp
	if fresh == nil {
		if pruned, err = h.Kernel.PruneFDBPins(h.Stack.Network, spec.Ports); err != nil {
			return changed || pruned, fmt.Errorf("fdb pin: %w", err)
		}
	}
	pin := slices.DeleteFunc(slices.Clone(ports), func(b firewall.PortBinding) bool { return unplugged[b.Port] })
	pinned, err := h.Kernel.PinFDB(h.Stack.Network, pin)
	if err != nil {
		return changed || pruned || pinned, fmt.Errorf("fdb pin: %w", err)
	}
	return changed || pruned || pinned, nil
}

// BindPorts re-applies the firewall with the bindings of every box running now. The box
// verbs that start a box (new, start, restart, restore, clone) and the drill call it once the
// box runs: until then its port is unbound (Incus's NIC filtering still holds it). It needs
// root (nftables), like host init; a box verb run without root gets ErrBindNeedsRoot.
func (h *Host) BindPorts(ctx context.Context) error {
	_, err := h.bindPorts(ctx, time.Time{})
	return err
}

// bindPorts is BindPorts, returning what it read and bound. A round is skipped (nil state,
// nil error) when one that read Incus after since has bound every port since: a change made
// before since (a box started, removed or exposed) is in it. Eight boxes started at once then
// cost about one round after the first rather than eight in a row (a purged CI run had three
// of eight `new` give up after 30 s waiting behind the others). A zero since never skips.
func (h *Host) bindPorts(ctx context.Context, since time.Time) (*StackState, error) {
	st, _, err := h.round(ctx, since)
	return st, err
}

// round is one read-then-apply under the bind lock (bindPorts), the pending NICs of boxes
// being started by `new` bound too (prebind.go). It returns the token it wrote with its
// stamp: while the stamp still holds it, no other round has applied since (completeBind).
func (h *Host) round(ctx context.Context, since time.Time) (*StackState, string, error) {
	if os.Geteuid() != 0 {
		return nil, "", ErrBindNeedsRoot
	}
	// One read-then-apply at a time per stack: two boxes starting at once must not have the
	// later apply carry the earlier (staler) read and unbind the other's port. Everything it
	// applies is the stack's own (its bridge's tables, ports, pins, subnet), so other stacks
	// (parallel test stacks) bind undisturbed: one lock for all of them made a bind wait
	// behind theirs, and under load past HostLockWait (a purged CI run, twice).
	unlock, err := lockFile(ctx, bindLockPath(h.Stack.Network), HostLockWait)
	if err != nil {
		return nil, "", err
	}
	defer unlock()
	stamp := boundStampPath(h.Stack.Network)
	if !since.IsZero() {
		if at, _ := lastFullBind(stamp); at.After(since) {
			return nil, "", nil
		}
	}
	read := time.Now()
	st := &StackState{Stack: h.Stack}
	if err := h.readIncus(ctx, st, false); err != nil {
		return nil, "", err
	}
	if st.Network == nil || st.Gateway == nil {
		return nil, "", &StackMissingError{Object: "network " + h.Stack.Network, Detail: "is missing or has no IPv4 address"}
	}
	t := time.Now()
	if err := h.readBindings(ctx, st); err != nil {
		return nil, "", fmt.Errorf("reading port bindings: %w", err)
	}
	incus.TraceStep("bind", "read instances, bridge ports, leases", t)
	spec := h.FirewallSpec(st)
	if _, err := h.applyL2(spec, st.Unplugged); err != nil {
		return st, "", fmt.Errorf("binding ports: %w", err) // st: what a port pin that failed alone left bound
	}
	token := randomToken()
	onBridge, err := h.bridgeIndex()
	if err != nil {
		return st, "", err
	}
	saveRound(h.Stack.Network, savedRound{Token: token, Spec: spec, Index: boundIndex(spec, onBridge)})
	writeStamp(h.Stack.Network, read, token)
	return st, token, nil
}

// boundStampPath holds when the last round that bound every port read Incus (unix ns) and
// that round's token (see round). It is written and read under the bind lock, and lives in
// /run: a reboot forgets it with the tables.
func boundStampPath(network string) string {
	return perDaemon("/run/claudebox-bound-" + network + ".stamp")
}

// forgetFullBind: the stack's kernel state is about to change (an apply, a drill's hole, a
// teardown), so no earlier round vouches for it any more.
func forgetFullBind(network string) {
	_ = os.Remove(boundStampPath(network))
}

// lastFullBind is the read time stamp holds (zero when there is none) and the token of the
// round that wrote it.
func lastFullBind(stamp string) (time.Time, string) {
	b, err := os.ReadFile(stamp)
	if err != nil {
		return time.Time{}, ""
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return time.Time{}, ""
	}
	ns, err := strconv.ParseInt(f[0], 10, 64)
	if err != nil {
		return time.Time{}, ""
	}
	if len(f) < 2 {
		return time.Unix(0, ns), ""
	}
	return time.Unix(0, ns), f[1]
}

// ErrBindNeedsRoot: the port bindings are nftables rules; without root they cannot be applied.
var ErrBindNeedsRoot = errors.New("binding box ports needs root (nftables): run 'sudo claudebox host init' to bind running boxes")

// bindingDrift lists, per running box NIC, whether the kernel's prerouting chain binds its
// port, and ports bound in the kernel that no running box has (stale).
func (st *StackState) bindingDrift() (rows [][3]string) {
	bound := map[string]bool{}
	for _, p := range st.KernelBound {
		bound[p] = true
	}
	want := map[string]bool{}
	for _, n := range st.NICs {
		item := n.Box + " " + n.Device
		switch {
		case n.Problem != "":
			rows = append(rows, [3]string{item, "bound", "cannot bind: " + n.Problem})
		case !bound[n.Binding.Port]:
			rows = append(rows, [3]string{item, "bound " + n.Binding.String(), "port " + n.Binding.Port + " not bound"})
		default:
			rows = append(rows, [3]string{item, "bound " + n.Binding.String(), "bound " + n.Binding.String()})
		}
		want[n.Binding.Port] = true
	}
	for _, p := range st.KernelBound {
		if !want[p] {
			rows = append(rows, [3]string{"port " + p, "no binding (no running box)", "stale binding"})
		}
	}
	return rows
}

// portBindingOn: the prerouting chain is there, every running box NIC is bound with no
// stale binding, and the bridge learns nothing from link-local frames.
func (st *StackState) portBindingOn() (bool, string) {
	var bad []string
	for _, r := range st.bindingDrift() {
		if r[1] != r[2] {
			bad = append(bad, r[0]+": "+r[2])
		}
	}
	ok := st.Tables.PortsOn && len(bad) == 0 && st.NoLLLearn
	return ok, fmt.Sprintf("table bridge %s chain prerouting %s; %d bound; no_linklocal_learn=%v; %s",
		st.Tables.Bridge, presence(st.Tables.PortsOn), len(st.Bindings()), st.NoLLLearn, driftSummary(bad))
}

// bindings: one row per running box NIC (bound in the kernel or not, and why it cannot be),
// one per stale binding, and the bridge's no_linklocal_learn.
func (c *checker) bindings(st *StackState) {
	if st.Gateway == nil {
		return
	}
	for _, r := range st.bindingDrift() {
		c.add("port binding", r[0], r[1], r[2])
	}
	c.add("port binding", st.Stack.Network+" no_linklocal_learn", "1", boolDigit(st.NoLLLearn))
	sn := &net.IPNet{IP: st.Gateway.IP.Mask(st.Gateway.Mask), Mask: st.Gateway.Mask}
	c.add("routes", "unreachable "+sn.String()+" (behind the bridge's route)", "present", presence(flapGuardPresent(sn)))
}

// boxIPv4 is the address the stack binds for box's eth0 (invalid when unknown).
func (st *StackState) boxIPv4(box string) netip.Addr {
	for _, n := range st.NICs {
		if n.Box == box && n.Device == "eth0" {
			return n.Binding.IPv4
		}
	}
	return netip.Addr{}
}

// bindLockPath is the lock BindPorts holds for network on this daemon.
func bindLockPath(network string) string {
	return perDaemon("/run/claudebox-bind-" + network + ".lock")
}

// Reverse-path filtering on the box ports (the port-rp-filter layer). A frame a box sends to a
// link-local group MAC (01:80:c2:00:00:0X) reaches the host's IP stack on the box's port itself,
// past every rule that names the bridge; with rp_filter=1 on the port the kernel drops it unless
// its source is routed back by that port, which no address is (see firewall/rpfilter.go). The
// wall's `iifname "<port>" drop` is the other layer; this one stands outside nftables.

// rpFilterActual is a bindable NIC's port's rp_filter as check shows it ("1" when it holds).
func rpFilterActual(n NICBinding) string {
	switch {
	case n.RPFilter < 0:
		return "unreadable"
	case n.RPFilter != n.RPFilterOwn:
		return fmt.Sprintf("%d (net.ipv4.conf.all.rp_filter overrides the port's %d)", n.RPFilter, n.RPFilterOwn)
	}
	return fmt.Sprint(n.RPFilter)
}

// portRPFilterOn: every bindable NIC (of boxes; nil: every box) has strict rp_filter on its
// port. NICs that cannot be bound are the port-binding layer's drift, not this one's.
func (st *StackState) portRPFilterOn(boxes []string) (bool, string) {
	var strict, not []string
	for _, n := range st.NICs {
		if n.Problem != "" || boxes != nil && !slices.Contains(boxes, n.Box) || st.Unplugged[n.Binding.Port] {
			continue
		}
		if a := rpFilterActual(n); a == "1" {
			strict = append(strict, n.Binding.Port)
		} else {
			not = append(not, n.Binding.Port+"="+a)
		}
	}
	return len(not) == 0, fmt.Sprintf("rp_filter=1 on [%s]; not on [%s]", strings.Join(strict, " "), strings.Join(not, " "))
}

// rpFilter: one check row per bindable NIC's port.
func (c *checker) rpFilter(st *StackState) {
	for _, n := range st.NICs {
		if n.Problem == "" && !st.Unplugged[n.Binding.Port] { // a pending NIC's veth is not there yet
			c.add("port rp_filter", n.Box+" "+n.Device+" port "+n.Binding.Port+" rp_filter", "1", rpFilterActual(n))
		}
	}
}
