package boxcore

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os/exec"
	"slices"
	"strings"
	"sync"

	"github.com/claudebox/claudebox/boxcore/incus"
	"github.com/claudebox/claudebox/firewall"
	"github.com/claudebox/claudebox/internal/netdump"
	"golang.org/x/sync/errgroup"
)

// StackState is the host stack as it is: the Incus objects, and the kernel state that holds
// the layers (bridge ports, sysctls, the running dnsmasq, nftables — claudebox's tables and
// Incus's ACL chains as the kernel has them). host check, host init's plan and the drill's
// layer lines all read this one value.
type StackState struct {
	Stack   Stack
	Network *incus.Network // nil: missing
	ACL     *incus.NetworkACL
	Profile *incus.Profile
	Gateway *net.IPNet // from the network's ipv4.address; nil when missing or unparsable
	// ETags are the Incus objects' ETags as read: a write planned from this state carries
	// them, so it fails (ChangedError) if someone wrote the object in between.
	ETags ETags
	// Member is the cluster member this daemon is ("" standalone), as readBindings read it;
	// MemberKeys the network's keys of that member's own (GET ?target=), which claudebox
	// never sets.
	Member     string
	MemberKeys map[string]string
	// Others are the other managed Incus networks with an IPv4 subnet: boxes must not reach them.
	Others []OtherNetwork

	Tables        TablesState
	FirewallDrift []firewall.Drift // claudebox's tables against the spec (nil without a gateway)
	BridgeMeta    bool             // the kernel has nft_meta_bridge
	// IncusACL holds the rules of Incus's ACL chains for the network in `table inet incus`
	// (acl.N, aclin.N, aclout.N, aclfwd.N) as nft prints them; a chain that is absent is absent.
	IncusACL map[string][]string
	Ports    []PortState
	// NICs are the running boxes' NICs on the network with the binding read for each;
	// KernelBound the ports claudebox's bridge table binds now; NoLLLearn the bridge's
	// no_linklocal_learn (see bindings.go).
	NICs        []NICBinding
	KernelBound []string
	NoLLLearn   bool
	// Unplugged are the ports of pending NICs (boxes `new` is starting: prebind.go) whose veth
	// is not on the bridge yet: bound, not pinned.
	Unplugged map[string]bool
	// Exposed are the host ports the exposures of this stack's boxes listen on, running or
	// not (expose.go): the guard answers them at a loopback address only.
	Exposed []uint16
	// OddProxies are the stack's boxes' proxy devices that are not exposures (made through
	// the escape hatch): drift, each named.
	OddProxies []string
	// FDBPins are the bindable NICs' FDB pins as the kernel holds them, FDBStale the pins no
	// bindable NIC wants, FDBErr why the bridge's FDB could not be read (see fdbpin.go).
	FDBPins  []FDBPin
	FDBStale []StalePin
	FDBErr   error

	BridgeNF4, BridgeNF6 Sysctl
	DNSMasq              DNSMasq
	DNSMasqRunning       bool
	LeaseNames           []string
	LeaseErr             error
	IPv6Disabled         bool
	IPv6Err              error
}

// ETags of the stack's Incus objects ("" for a missing one).
type ETags struct{ Network, ACL, Profile string }

// OtherNetwork is another managed Incus network's IPv4 subnet.
type OtherNetwork struct {
	Name   string
	Subnet *net.IPNet
}

// TablesState says which of claudebox's nft tables and chains the kernel holds.
type TablesState struct {
	Bridge, Guard, Wall string // table names
	BridgeOn            bool   // bridge table present with its chains
	GuardInput          bool   // guard table has its input chain
	WallOn              bool   // wall table present with chains
	PortsOn             bool   // bridge table has its prerouting chain (port binding)
	L2RangesOn          bool   // bridge table has its input and output chains (L2 ranges)
	LocalAnswersOn      bool   // guard table has its answers and dns_tcp chains (local answers)
}

// PortState is one bridge port: its isolation flag, whether Incus's per-NIC anti-spoofing
// chains for it are in the kernel, and the box it belongs to ("" if none we know).
type PortState struct {
	Name     string
	Box      string
	Isolated bool
	Filtered bool
	// GuestAPI: /dev/incus exists inside the running box (read through its init's root).
	GuestAPI bool
}

// Sysctl is one integer sysctl; Loaded is false when the file does not exist.
type Sysctl struct {
	Value  int
	Loaded bool
}

// Read reads the whole stack once. A missing object is recorded as nil, not an error.
func (h *Host) Read(ctx context.Context) (*StackState, error) {
	s := h.Stack
	st := &StackState{Stack: s, BridgeMeta: firewall.BridgeMetaSupported()}
	if err := h.readIncus(ctx, st, true); err != nil {
		return nil, err
	}
	if err := h.readBindings(ctx, st); err != nil {
		return nil, err
	}
	if err := h.readMember(ctx, st); err != nil {
		return nil, err
	}
	if st.Network != nil {
		// A pending NIC's veth is not there yet: its `new` pins it once it is.
		plugged := slices.DeleteFunc(slices.Clone(st.NICs), func(n NICBinding) bool { return st.Unplugged[n.Binding.Port] })
		st.FDBPins, st.FDBStale, st.FDBErr = h.Kernel.FDBPins(s.Network, plugged)
	}
	if err := h.readFirewall(st); err != nil {
		return nil, err
	}
	if err := h.readPorts(ctx, st); err != nil {
		return nil, err
	}
	st.IncusACL = incusACLChains(s.Network)
	st.BridgeNF4.Value, st.BridgeNF4.Loaded = h.Kernel.BridgeNFCallIPTables()
	st.BridgeNF6.Value, st.BridgeNF6.Loaded = h.Kernel.BridgeNFCallIP6Tables()
	st.DNSMasq, st.DNSMasqRunning = h.Kernel.FindDNSMasq(s.Network)
	if st.DNSMasqRunning {
		st.LeaseNames, st.LeaseErr = LeaseNames(st.DNSMasq.LeaseFile())
	}
	st.IPv6Disabled, st.IPv6Err = h.Kernel.IPv6Disabled(s.Network)
	return st, nil
}

// readIncus reads the stack's Incus objects into st. A bind round (whole false) reads only
// what the firewall spec is made of, the network and the other networks: the ACL and the
// profile are `host check`'s, and reading the ACL costs the daemon a used-by scan over every
// instance (40 ms with 30 boxes as one is created).
func (h *Host) readIncus(ctx context.Context, st *StackState, whole bool) error {
	s := h.Stack
	// Independent reads, side by side: each costs the daemon 2-14 ms, and every box start
	// pays for them (the port binding reads the stack).
	var (
		n, etag          = incus.Network{}, ""
		acl, aclTag      = incus.NetworkACL{}, ""
		prof, profTag    = incus.Profile{}, ""
		nets             []incus.Network
		nErr, aErr, pErr error
	)
	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error { n, etag, nErr = h.Client.Network(gctx, s.Network); return ignoreNotFound(nErr) })
	if whole {
		g.Go(func() error { acl, aclTag, aErr = h.Client.NetworkACL(gctx, s.ACL); return ignoreNotFound(aErr) })
		g.Go(func() error { prof, profTag, pErr = h.Client.Profile(gctx, s.Profile); return ignoreNotFound(pErr) })
	} else {
		aErr, pErr = errNotRead, errNotRead
	}
	g.Go(func() (err error) { nets, err = h.otherNetworks(gctx); return err })
	if err := g.Wait(); err != nil {
		return err
	}
	if nErr == nil {
		st.Network, st.ETags.Network = &n, etag
		if ip, sub, err := net.ParseCIDR(n.Config["ipv4.address"]); err == nil && ip.To4() != nil {
			st.Gateway = &net.IPNet{IP: ip.To4(), Mask: sub.Mask}
		}
	}
	if aErr == nil {
		st.ACL, st.ETags.ACL = &acl, aclTag
	}
	if pErr == nil {
		st.Profile, st.ETags.Profile = &prof, profTag
	}
	for _, o := range nets {
		if !o.Managed || o.Name == s.Network {
			continue
		}
		if _, sub, err := net.ParseCIDR(o.Config["ipv4.address"]); err == nil && sub.IP.To4() != nil {
			st.Others = append(st.Others, OtherNetwork{Name: o.Name, Subnet: sub})
		}
	}
	return nil
}

// otherNetworks lists the daemon's networks but the stack's own, for Others. Listing them
// with details (recursion) costs the daemon a used-by scan and an OVS lookup for every host
// interface — every box's veth included: 32 ms idle, 73–104 ms with 20 boxes while one
// starts, on every bind. Others are the managed networks with an IPv4 subnet: bridges
// (native or Open vSwitch: a kernel link of their name) and networks with no kernel link
// of their name (OVN). So on a local daemon (this kernel's) the names are listed and only
// those asked about, side by side; a host interface (a veth, lo, eth0: 13-29 ms each with
// 30 boxes as one is created) never is. An unmanaged bridge the daemon cannot describe
// answers 404, as the list skipped it.
func (h *Host) otherNetworks(ctx context.Context) ([]incus.Network, error) {
	if h.Client.Remote() != "local" {
		return h.Client.Networks(ctx)
	}
	names, err := h.Client.NetworkNames(ctx)
	if err != nil {
		return nil, err
	}
	links, err := netdump.Links()
	if err != nil {
		return nil, err
	}
	notBridge := map[string]bool{}
	for _, l := range links {
		if t := l.Type(); t != "bridge" && t != "openvswitch" {
			notBridge[l.Attrs().Name] = true
		}
	}
	var (
		mu  sync.Mutex
		out []incus.Network
	)
	g, gctx := errgroup.WithContext(ctx)
	for _, name := range names {
		if name == h.Stack.Network || notBridge[name] {
			continue
		}
		g.Go(func() error {
			n, _, err := h.Client.Network(gctx, name)
			if errors.Is(err, incus.ErrNotFound) {
				return nil
			}
			if err != nil {
				return err
			}
			mu.Lock()
			out = append(out, n)
			mu.Unlock()
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		return nil, err
	}
	slices.SortFunc(out, func(a, b incus.Network) int { return strings.Compare(a.Name, b.Name) })
	return out, nil
}

// errNotRead stands for an object a partial read (readIncus) left out: st keeps it nil.
var errNotRead = errors.New("not read")

// ignoreNotFound: a missing stack object is state to report, not an error.
func ignoreNotFound(err error) error {
	if errors.Is(err, incus.ErrNotFound) {
		return nil
	}
	return err
}

func (h *Host) readFirewall(st *StackState) error {
	s := h.Stack
	bt, gt := firewall.TableNames(s.Network)
	st.Tables = TablesState{Bridge: bt, Guard: gt, Wall: firewall.WallTableName(s.Network)}
	obs, err := firewall.Read(s.Network)
	if err != nil {
		return fmt.Errorf("reading nftables: %w", err)
	}
	st.Tables.BridgeOn = obs.PartPresent(firewall.PartBridge)
	st.Tables.GuardInput = obs.PartPresent(firewall.PartGuard)
	st.Tables.WallOn = obs.PartPresent(firewall.PartWall)
	st.Tables.PortsOn = obs.PartPresent(firewall.PartPorts)
	st.Tables.L2RangesOn = obs.PartPresent(firewall.PartL2Ranges)
	st.Tables.LocalAnswersOn = obs.PartPresent(firewall.PartLocalAnswers)
	st.KernelBound = obs.Bound()
	st.NoLLLearn, _ = firewall.NoLinkLocalLearn(s.Network)
	if st.Gateway != nil {
		if st.FirewallDrift, err = firewall.Check(h.FirewallSpec(st)); err != nil {
			return fmt.Errorf("reading nftables: %w", err)
		}
	}
	return nil
}

// readPorts lists the bridge's ports with their isolation flag, the box behind each, and
// whether Incus's NIC filter chains for the port are in `table bridge incus`.
func (h *Host) readPorts(ctx context.Context, st *StackState) error {
	ports, err := h.Kernel.BridgePorts(h.Stack.Network)
	if err != nil {
		return err
	}
	owner := map[string]string{}
	if len(ports) > 0 {
		insts, err := h.Client.Instances(ctx, nil, false)
		if err != nil {
			return err
		}
		for _, in := range insts {
			if v := in.Config["volatile.eth0.host_name"]; v != "" {
				owner[v] = in.Name
			}
		}
	}
	local := h.Client.Remote() == "local"
	bridgeIncus, _ := nftList("table", "bridge", "incus")
	for _, p := range ports {
		ps := PortState{Name: p.Name, Box: owner[p.Name], Isolated: p.Isolated, Filtered: nicFiltered(bridgeIncus, p.Name)}
		if ps.Box != "" && local {
			ps.GuestAPI = h.guestAPIIn(ctx, ps.Box)
		}
		st.Ports = append(st.Ports, ps)
	}
	return nil
}

// nicFiltered reports whether Incus's anti-spoofing rules for a port are in its bridge table,
// in both the input and the forward chain: source MAC, source IPv4 (and ARP sender), every
// IPv6 frame (the network has none), and every ethertype but IPv4/ARP/IPv6.
func nicFiltered(table, port string) bool {
	need := []string{"ether saddr != ", "ip saddr != ", "arp saddr ip != ", "ether type ip6 drop", "ether type != { ip, arp, ip6 } drop"}
	prefix := `iifname "` + port + `" `
	count := map[string]int{}
	for _, l := range strings.Split(table, "\n") {
		l = strings.TrimSpace(l)
		rest, ok := strings.CutPrefix(l, prefix)
		if !ok || !strings.HasSuffix(l, " drop") {
			continue
		}
		for _, n := range need {
			if strings.HasPrefix(rest, n) {
				count[n]++
			}
		}
	}
	for _, n := range need {
		if count[n] < 2 {
			return false
		}
	}
	return true
}

// incusACLChains reads Incus's ACL chains of a network from `table inet incus`.
func incusACLChains(network string) map[string][]string {
	out := map[string][]string{}
	for _, ch := range aclChainNames(network) {
		text, err := nftList("chain", "inet", "incus", ch)
		if err != nil {
			continue
		}
		var rules []string
		for _, l := range strings.Split(text, "\n") {
			l = strings.TrimSpace(l)
			if l == "" || l == "}" || strings.HasPrefix(l, "table ") || strings.HasPrefix(l, "chain ") || strings.HasPrefix(l, "type ") {
				continue
			}
			rules = append(rules, l)
		}
		out[ch] = rules
	}
	return out
}

func aclChainNames(network string) []string {
	return []string{"acl." + network, "aclin." + network, "aclout." + network, "aclfwd." + network}
}

// nftList runs `nft list ...` (Incus's own tables are read as nft prints them).
func nftList(args ...string) (string, error) {
	out, err := exec.Command("nft", append([]string{"list"}, args...)...).CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("nft list %s: %v: %s", strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return string(out), nil
}

// Blocked are the IPv4 ranges no box may reach: BlockedEgress, plus every other managed Incus
// network's subnet that those ranges do not already cover. (A covered subnet adds nothing but
// churn: every test stack's 10.x network would otherwise change claudenet's ACL and wall.)
func (st *StackState) Blocked() []string {
	out := slices.Clone(BlockedEgress)
	for _, o := range st.Others {
		if !coveredBy(o.Subnet, BlockedEgress) {
			out = append(out, o.Subnet.String())
		}
	}
	return out
}

func coveredBy(n *net.IPNet, cidrs []string) bool {
	ones, _ := n.Mask.Size()
	for _, c := range cidrs {
		_, b, err := net.ParseCIDR(c)
		if err != nil {
			continue
		}
		if bones, _ := b.Mask.Size(); bones <= ones && b.Contains(n.IP) {
			return true
		}
	}
	return false
}

// WantIncusACL is what the kernel must hold in Incus's ACL chains for the network.
func (st *StackState) WantIncusACL() map[string][]string {
	n := st.Stack.Network
	q := `"` + n + `"`
	acl := []string{"ct state established,related accept"}
	for _, c := range st.Blocked() {
		acl = append(acl, "iifname "+q+" ip daddr "+c+" drop")
	}
	acl = append(acl, "iifname "+q+" accept", "oifname "+q+" drop")
	return map[string][]string{
		"acl." + n:    acl,
		"aclin." + n:  {"iifname " + q + " jump acl." + n},
		"aclout." + n: {"oifname " + q + " jump acl." + n},
		"aclfwd." + n: {"iifname " + q + " jump acl." + n, "oifname " + q + " jump acl." + n},
	}
}

// ACLKernelDrift lists how Incus's ACL chains in the kernel differ from what they must hold.
func (st *StackState) ACLKernelDrift() []string {
	var out []string
	want := st.WantIncusACL()
	for _, ch := range aclChainNames(st.Stack.Network) {
		have, ok := st.IncusACL[ch]
		if !ok {
			out = append(out, "chain inet incus "+ch+" absent")
			continue
		}
		for _, r := range want[ch] {
			if !slices.Contains(have, r) {
				out = append(out, ch+" lacks: "+r)
			}
		}
		if ch == "acl."+st.Stack.Network {
			for _, r := range have {
				if !slices.Contains(want[ch], r) {
					out = append(out, ch+" has extra: "+r)
				}
			}
		}
	}
	return out
}

func (st *StackState) networkConfig() map[string]string {
	if st.Network == nil {
		return map[string]string{}
	}
	return st.Network.Config
}

func (st *StackState) portsOf(boxes []string) []PortState {
	if boxes == nil {
		return st.Ports
	}
	var out []PortState
	for _, p := range st.Ports {
		if slices.Contains(boxes, p.Box) {
			out = append(out, p)
		}
	}
	return out
}

// BlockedPrefixes is what the firewall's spec blocks: Blocked as prefixes, plus the on-link
// subnets of every uplink (the default routes' interfaces and the admitted ones; see
// uplinkSubnets), read from the host's routes now. The Incus ACL keeps Blocked only.
func (st *StackState) BlockedPrefixes() []netip.Prefix {
	var out []netip.Prefix
	for _, c := range st.Blocked() {
		if p, err := netip.ParsePrefix(c); err == nil {
			out = append(out, p.Masked())
		}
	}
	var bridgeNet *net.IPNet
	if st.Gateway != nil {
		bridgeNet = &net.IPNet{IP: st.Gateway.IP.Mask(st.Gateway.Mask), Mask: st.Gateway.Mask}
	}
	return append(out, uplinkSubnets(st.uplinks(), bridgeNet, out)...)
}
