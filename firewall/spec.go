// Package firewall declares claudebox's host nftables rules as data and
// converges the kernel to them over netlink (github.com/google/nftables; no
// nft subprocess).
//
// For a bridge B with gateway G it owns exactly three tables, named from B so
// that several stacks (and parallel tests) coexist:
//
//	table bridge claudebox_<B>        chain forward: hook forward, priority -200
//	                                  (nft's "filter" for bridge), policy accept
//	table inet   claudebox_<B>_guard  chain forward: hook forward, priority -1 ("filter - 1")
//	                                  chain input:   hook input,   priority -1 ("filter - 1")
//	                                  chain output:  hook output,  priority -1
//	                                  chain inbound: hook forward, priority -1
//	                                  chain egress:  hook postrouting, priority 200
//	                                  chain answers: hook output,  priority -1 (answers.go)
//	                                  chain dns_tcp: hook input,   priority -1 (answers.go)
//	                                  all policy accept
//	table inet   claudebox_<B>_wall   the wall: claudebox's own complete inet
//	                                  layer (see wall.go), holding every claim
//	                                  by itself while Incus re-applies its own
//
// Box→box, bridge table. The bridge forward hook fires only on frames
// switched port to port; traffic to the gateway is delivered locally and
// never passes it, so boxes lose nothing else, and this holds with
// br_netfilter off. Where the kernel has nft_meta_bridge the rule is
// `meta ibrname "B" meta obrname "B" drop` (every protocol). Kernels built
// without CONFIG_NFT_BRIDGE_META (our 6.18 test kernel) reject that rule, and
// nothing else in the bridge family names the bridge a frame crosses, so
// there the rules drop bridged IPv4 and ARP with a source or destination in
// B's subnet (see L2Mode; the kernel is probed once, Spec.L2 can pin it).
//
// Box→box, guard forward chain: `iifname "B" oifname "B" drop` catches boxes
// reaching each other by routing through the gateway (hairpin), and, while
// br_netfilter's call-iptables/ip6tables is on, bridged IPv4/IPv6 too
// (br_netfilter shows bridged packets to inet with B as in and out device).
//
// Box→host, guard input chain: drops everything that enters the host from B
// except what a box needs: replies (ct established,related), DNS (udp/tcp 53)
// to G, and DHCP (udp 67) to G or the limited broadcast. Incus's own
// "inet incus" table hooks input/forward/output at priority 0 ("filter") and
// accepts DHCP/DNS/ICMP errors for its bridges in chains in.B/fwd.B/out.B; an
// accept in one base chain does not stop a drop in another, so the guard
// accepts those itself, and runs just before Incus's chains (-1).
//
// Into a box, guard output and inbound chains: no new flow from the host (but
// dnsmasq's DHCP replies) and no new routed flow into B. The wall says the same;
// the guard's copy sits in another table, so a flow into a box is never created
// while either is there (the bridge table's L2 drops come after the IP stack
// confirmed the flow in conntrack).
//
// Un-NATed egress, guard egress chain: after every NAT chain, a packet that
// still has a box-subnet source and leaves by any interface but B (and lo)
// is dropped. Incus's masquerade and the wall's own NAT it; this is the
// layer that holds when both are gone (ipv4.nat=false during Incus's
// re-apply window, the wall removed), and the second one beside the wall
// for what no masquerade rewrites (invalid packets, a box's ICMP error about
// one of the host's own flows). The chain also drops a box's packet that
// carries IPv4 options (a router writes its own address into some).
//
// ICMP to the host (echo to the gateway included) is dropped: the contract is
// "box→host dropped", boxes need no ping to the gateway, and ICMP errors about
// flows the host started still pass as ct related. ARP is not IP and passes
// the input guard (boxes need it for the gateway). IPv6 from B is dropped like
// everything else (IPv6 is off by contract).
//
// Rules are rendered to canonical strings (Rule.Summary, valid nft syntax) by
// one renderer that serves both Desired and Read, so "converged" is string
// equality, and any expression or attribute the renderer does not recognise
// renders as an opaque token that can never equal a desired rule.
package firewall

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"regexp"
	"slices"

	"github.com/google/nftables"
	"github.com/google/nftables/binaryutil"
	"github.com/google/nftables/expr"
	"golang.org/x/sys/unix"
)

// Spec is what the host firewall is derived from.
type Spec struct {
	Bridge    string // Linux bridge name, e.g. "claudenet"
	Gateway   net.IP // the bridge's IPv4 address, e.g. 10.77.12.1
	PrefixLen int    // the bridge subnet's prefix length (L2Subnet only); 0 means 24
	L2        L2Mode // how box→box frames are recognised; "" = probe the kernel

	// Blocked are IPv4 ranges a box never reaches and from which nothing
	// reaches a box, established or not (the wall): RFC1918, CGNAT,
	// link-local and every other local network's subnet.
	Blocked []netip.Prefix
	// Uplinks are the interfaces box egress may leave by (the wall). Empty:
	// the interfaces of the kernel's IPv4 default routes (see Resolved); if
	// there are none, boxes have no egress at all.
	Uplinks []string

	// Ports bind bridge ports to the MAC and IPv4 address the box behind
	// each may send from (see ports.go). A port not listed is not checked.
	Ports []PortBinding

	// Exposed are the host TCP ports boxes are exposed on (an Incus proxy
	// listening on a loopback address): the guard rejects (TCP reset) a packet to one
	// unless it is addressed to a loopback address, from anywhere (the LAN,
	// a box, the host's own other addresses): the second layer beside the
	// proxy's own loopback listen.
	Exposed []uint16
}

// L2Mode selects the bridge-family match for box→box frames.
type L2Mode string

const (
	// L2Auto uses L2BridgeName when the kernel supports it, else L2Subnet.
	L2Auto L2Mode = ""
	// L2BridgeName drops frames whose ingress and egress ports are both on
	// the bridge (`meta ibrname/obrname`): every protocol, ARP and IPv6
	// included. Needs nft_meta_bridge (CONFIG_NFT_BRIDGE_META), which some
	// kernels lack (the 6.18 Firecracker kernel we test on does).
	L2BridgeName L2Mode = "bridge-name"
	// L2Subnet drops bridged IPv4 and ARP whose source or destination is in
	// the bridge's subnet. The bridge family cannot otherwise tell which
	// bridge a frame crosses; IPv4 in the subnet can only be on this bridge.
	// It does not see IPv6 (link-local) or other ethertypes between boxes;
	// the guard's forward chain catches bridged IPv6 while br_netfilter is on,
	// and port isolation catches everything.
	L2Subnet L2Mode = "subnet"
)

// Resolved returns s with L2Auto replaced by what the kernel supports (the
// probe runs once per process), PrefixLen defaulted, and empty Uplinks read
// from the calling thread's namespace's default routes (the bridge itself
// excluded; on error none, so the wall fails closed: no egress).
func (s Spec) Resolved() Spec {
	if len(s.Uplinks) == 0 {
		ups, _ := DefaultUplinks()
		s.Uplinks = nil
		for _, u := range ups {
			if u != s.Bridge && validateBridge(u) == nil {
				s.Uplinks = append(s.Uplinks, u)
			}
		}
	}
	if s.L2 == L2Auto {
		s.L2 = L2Subnet
		if BridgeMetaSupported() {
			s.L2 = L2BridgeName
		}
	}
	if s.PrefixLen == 0 {
		s.PrefixLen = 24
	}
	return s
}

// subnet is the bridge's IPv4 network.
// Subnet is the bridge's IPv4 network (nil without a gateway).
func (s Spec) Subnet() *net.IPNet {
	if s.Gateway.To4() == nil {
		return nil
	}
	return s.subnet()
}

func (s Spec) subnet() *net.IPNet {
	m := net.CIDRMask(s.PrefixLen, 32)
	return &net.IPNet{IP: s.Gateway.To4().Mask(m), Mask: m}
}

// ifnameRE is stricter than the kernel (which allows almost any byte) but
// covers Incus network names, and keeps table names valid nft identifiers.
var ifnameRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.-]*$`)

// ifnamsiz is IFNAMSIZ: names are at most 15 bytes plus the NUL.
const ifnamsiz = 16

func validateBridge(b string) error {
	switch {
	case b == "":
		return errors.New("firewall: bridge name is empty")
	case len(b) > ifnamsiz-1:
		return fmt.Errorf("firewall: bridge name %q is longer than %d bytes", b, ifnamsiz-1)
	case !ifnameRE.MatchString(b):
		return fmt.Errorf("firewall: bridge name %q: want letters, digits, '_', '.', '-'", b)
	}
	return nil
}

// Validate reports whether s can be turned into rules.
func (s Spec) Validate() error {
	if err := validateBridge(s.Bridge); err != nil {
		return err
	}
	if s.Gateway == nil {
		return errors.New("firewall: gateway is empty")
	}
	g := s.Gateway.To4()
	if g == nil {
		return fmt.Errorf("firewall: gateway %s is not IPv4", s.Gateway)
	}
	if g.IsUnspecified() || g.Equal(net.IPv4bcast) || g.IsMulticast() {
		return fmt.Errorf("firewall: gateway %s is not a unicast address", s.Gateway)
	}
	if s.PrefixLen != 0 && (s.PrefixLen < 8 || s.PrefixLen > 30) {
		return fmt.Errorf("firewall: prefix length %d: want 8..30", s.PrefixLen)
	}
	switch s.L2 {
	case L2Auto, L2BridgeName, L2Subnet:
	default:
		return fmt.Errorf("firewall: unknown L2 mode %q", s.L2)
	}
	if err := validateWall(s); err != nil {
		return err
	}
	return validatePorts(s)
}

// Family names as nft spells them.
const (
	FamilyBridge = "bridge"
	FamilyInet   = "inet"
)

// Chain names and priorities. The bridge family's "filter" priority is -200
// (NF_BR_PRI_FILTER_BRIDGED); Incus's inet input chains sit at 0.
const (
	ForwardChain   = "forward"
	InputChain     = "input"
	BridgeFwdPrio  = -200
	GuardInputPrio = -1
	GuardFwdPrio   = -1
	GuardOutPrio   = -1
	// InboundChain is the guard's second forward chain: no new flow into a box. A chain of
	// its own so the host-input-guard part switches off without the box→box forward drop.
	InboundChain = "inbound"
	// EgressChain is the guard's postrouting filter, after every NAT chain (Incus's srcnat
	// at 100, the wall's own masquerade at 110): a box-subnet source still there leaves
	// un-NATed, so it is dropped.
	EgressChain      = "egress"
	GuardEgressPrio  = 200
	guardTableSuffix = "_guard"
	tablePrefix      = "claudebox_"
)

// TableNames returns two of the tables owned for bridge: the bridge-family
// table holding the box→box drop and the inet-family table holding the input
// guard (the third is WallTableName). Families differ, and the inet names
// differ by suffix, so no two bridges' names can collide.
func TableNames(bridge string) (bridgeTable, guardTable string) {
	return tablePrefix + bridge, tablePrefix + bridge + guardTableSuffix
}

// Rule is one desired (or observed) rule, as data.
type Rule struct {
	Table   string // e.g. claudebox_claudenet
	Family  string // FamilyBridge or FamilyInet
	Chain   string // ForwardChain or InputChain
	Summary string // canonical rendering, equal to what Read renders when converged
	Why     string // one line: what the rule is for

	key   string // wall rules: which claim-holding rule this is (tests take rules out by key)
	exprs []expr.Any
}

// String renders the rule as "family table chain: summary".
func (r Rule) String() string {
	return fmt.Sprintf("%s %s %s: %s", r.Family, r.Table, r.Chain, r.Summary)
}

// Chain is a desired (or observed) base chain.
type Chain struct {
	Table    string
	Family   string
	Name     string
	Type     string // "filter"
	Hook     string // "forward", "input", ...
	Priority int32
	Policy   string // "accept" or "drop"
}

// Header renders the chain's properties the way Check compares them.
func (c Chain) Header() string {
	return fmt.Sprintf("type %s hook %s priority %d policy %s", c.Type, c.Hook, c.Priority, c.Policy)
}

// DesiredChains returns the base chains the spec needs, in table order.
func DesiredChains(s Spec) []Chain {
	bt, gt := TableNames(s.Bridge)
	out := []Chain{{Table: bt, Family: FamilyBridge, Name: ForwardChain, Type: "filter", Hook: "forward", Priority: BridgeFwdPrio, Policy: "accept"}}
	out = append(out, bridgeL2Chains(s)...)
	return append(append(out,
		Chain{Table: gt, Family: FamilyInet, Name: ForwardChain, Type: "filter", Hook: "forward", Priority: GuardFwdPrio, Policy: "accept"},
		Chain{Table: gt, Family: FamilyInet, Name: InputChain, Type: "filter", Hook: "input", Priority: GuardInputPrio, Policy: "accept"},
		Chain{Table: gt, Family: FamilyInet, Name: OutputChain, Type: "filter", Hook: "output", Priority: GuardOutPrio, Policy: "accept"},
		Chain{Table: gt, Family: FamilyInet, Name: InboundChain, Type: "filter", Hook: "forward", Priority: GuardFwdPrio, Policy: "accept"},
		Chain{Table: gt, Family: FamilyInet, Name: EgressChain, Type: "filter", Hook: "postrouting", Priority: GuardEgressPrio, Policy: "accept"},
	), append(localAnswersChains(s), wallChains(s)...)...)
}

// Desired returns the rules, in chain order, that Apply installs for s.
// s is assumed valid (see Validate); an invalid gateway yields no guard rules
// that could match, never a wider rule. With L2Auto the bridge rules depend
// on the running kernel, and with empty Uplinks the wall's egress rule on the
// calling namespace's default routes (see Resolved).
func Desired(s Spec) []Rule {
	s = s.Resolved()
	bt, gt := TableNames(s.Bridge)
	g := s.Gateway.To4()
	if g == nil {
		g = net.IPv4zero.To4()
	}
	br := func(why string, ex ...expr.Any) Rule {
		return Rule{Table: bt, Family: FamilyBridge, Chain: ForwardChain, Why: why, exprs: ex}
	}
	fwd := func(why string, ex ...expr.Any) Rule {
		return Rule{Table: gt, Family: FamilyInet, Chain: ForwardChain, Why: why, exprs: ex}
	}
	in := func(why string, ex ...expr.Any) Rule {
		ex = append(ifname(expr.MetaKeyIIFNAME, s.Bridge), ex...)
		return Rule{Table: gt, Family: FamilyInet, Chain: InputChain, Why: why, exprs: ex}
	}
	accept := []expr.Any{verdict(expr.VerdictAccept)}
	drop := []expr.Any{verdict(expr.VerdictDrop)}
	var rules []Rule
	if s.L2 == L2BridgeName {
		rules = append(rules, br("box→box: drop every frame switched between two ports of the bridge",
			cat(ifname(expr.MetaKeyBRIIIFNAME, s.Bridge), ifname(expr.MetaKeyBRIOIFNAME, s.Bridge), drop)...))
	} else {
		n := s.subnet()
		rules = append(rules,
			br("box→box IPv4 switched on the bridge, by source in its subnet", cat(bridgeIPv4(12, n), drop)...),
			br("box→box IPv4 switched on the bridge, by destination in its subnet", cat(bridgeIPv4(16, n), drop)...),
			br("box→box ARP switched on the bridge, by sender address", cat(bridgeARP(14, n), drop)...),
			br("box→box ARP switched on the bridge, by target address", cat(bridgeARP(24, n), drop)...),
		)
		// Without the bridge's name to match, the subnet rules miss what has no address of
		// it: IPv6, other ethertypes, tagged frames, ARP of other ranges. Between two boxes
		// port isolation holds those; between a box and a port that is no box's (a join to
		// another member's bridge, an external interface) nothing did (found by the
		// attacker). A box talks only to the host: nothing is switched to or from its port.
		for _, p := range s.Ports {
			rules = append(rules,
				br(p.Port+": nothing switched from a box port to another port", cat(ifnameOp(expr.MetaKeyIIFNAME, expr.CmpOpEq, p.Port), drop)...),
				br(p.Port+": nothing switched to a box port from another port", cat(ifnameOp(expr.MetaKeyOIFNAME, expr.CmpOpEq, p.Port), drop)...))
		}
	}
	rules = append(rules, portRules(s)...)
	rules = append(rules, l2RangeRules(s)...)
	rules = append(rules,
		fwd("box→box routed through the gateway (hairpin), and bridged box→box while br_netfilter hands bridged IP to inet",
			cat(ifname(expr.MetaKeyIIFNAME, s.Bridge), ifname(expr.MetaKeyOIFNAME, s.Bridge), drop)...),

		in("replies to connections the host or a box was allowed to open",
			cat(ctStateEstRel(), accept)...),
		in("DNS to the gateway's dnsmasq (udp)",
			cat(ip4Daddr(g), l4Dport(ipprotoUDP, 53), accept)...),
		in("DNS to the gateway's dnsmasq (tcp)",
			cat(ip4Daddr(g), l4Dport(ipprotoTCP, 53), accept)...),
		in("DHCP renew, unicast to the gateway",
			cat(ip4Daddr(g), l4Dport(ipprotoUDP, 67), accept)...),
		in("DHCP discover/request/rebind, limited broadcast",
			cat(ip4Daddr(net.IPv4bcast.To4()), l4Dport(ipprotoUDP, 67), accept)...),
		in("box→host: everything else from the bridge, every family and protocol (ICMP too)",
			verdict(expr.VerdictDrop)),
		guardInto(s.Bridge, OutputChain, "host→box: no new flow but dnsmasq's DHCP replies (udp from port 67)",
			ctStateNew(), l4proto(expr.CmpOpNeq, ipprotoUDP), drop),
		guardInto(s.Bridge, OutputChain, "host→box: no new udp flow but dnsmasq's DHCP replies",
			ctStateNew(), l4proto(expr.CmpOpEq, ipprotoUDP), thPort(0, expr.CmpOpNeq, 67), drop),
		guardInto(s.Bridge, OutputChain, "host→box: no DHCP relay reply (dnsmasq answers a relayed request at giaddr:67)",
			l4proto(expr.CmpOpEq, ipprotoUDP), relayPorts(), drop),
		guardInto(s.Bridge, InboundChain, "nothing routed opens a new flow into a box", ctStateNew(), drop),
		Rule{Table: gt, Family: FamilyInet, Chain: EgressChain,
			Why: "box egress never leaves un-NATed: a box-subnet source past every NAT chain, on any interface but the bridge and lo",
			exprs: cat(ifnameOp(expr.MetaKeyOIFNAME, expr.CmpOpNeq, s.Bridge), ifnameOp(expr.MetaKeyOIFNAME, expr.CmpOpNeq, "lo"),
				nfproto(unix.NFPROTO_IPV4), ip4Op(12, expr.CmpOpEq, s.subnet()), drop)},
		Rule{Table: gt, Family: FamilyInet, Chain: EgressChain,
			Why: "nothing routed from a box leaves with IPv4 options (a timestamp option would carry the gateway's address out)",
			exprs: cat(ifname(expr.MetaKeyIIFNAME, s.Bridge), ifnameOp(expr.MetaKeyOIFNAME, expr.CmpOpNeq, s.Bridge),
				nfproto(unix.NFPROTO_IPV4), ipOptions(), drop)},
	)
	rules = append(rules, exposureRules(s)...)
	rules = append(rules, localAnswersRules(s)...)
	rules = append(rules, wallRules(s)...)
	for i := range rules {
		rules[i].Summary = renderExprs(familyByte(rules[i].Family), rules[i].exprs)
	}
	return rules
}

// exposureRules: an exposed host port answers at a loopback address only. Each rejects every
// packet to the port not addressed to loopback, whatever its state or interface (the host's
// own other addresses arrive by lo), so their place in the chain does not matter.
func exposureRules(s Spec) []Rule {
	_, gt := TableNames(s.Bridge)
	// A TCP reset, not a drop: what the host says when nothing listens there, so with
	// either layer in place the port looks the same from outside (closed).
	reset := []expr.Any{&expr.Reject{Type: unix.NFT_REJECT_TCP_RST}}
	var out []Rule
	for _, p := range slices.Compact(slices.Sorted(slices.Values(s.Exposed))) {
		in := func(why string, ex ...expr.Any) Rule {
			return Rule{Table: gt, Family: FamilyInet, Chain: InputChain, Why: why, exprs: ex}
		}
		out = append(out,
			in(fmt.Sprintf("exposure on host port %d: IPv4 only to 127.0.0.0/8", p),
				cat(nfproto(unix.NFPROTO_IPV4), rawCmp(expr.PayloadBaseNetworkHeader, 16, expr.CmpOpNeq, []byte{127}),
					l4Dport(ipprotoTCP, p), reset)...),
			in(fmt.Sprintf("exposure on host port %d: IPv6 only to ::1", p),
				cat(nfproto(unix.NFPROTO_IPV6), rawCmp(expr.PayloadBaseNetworkHeader, 24, expr.CmpOpNeq, net.IPv6loopback),
					l4Dport(ipprotoTCP, p), reset)...),
		)
	}
	return out
}

// relayPorts is `th sport 67 th dport 67` the way nft compiles it: one 32-bit compare.
func relayPorts() []expr.Any {
	return rawCmp(expr.PayloadBaseTransportHeader, 0, expr.CmpOpEq, []byte{0, 67, 0, 67})
}

// guardInto is a guard rule on packets leaving by the bridge (oifname B).
func guardInto(bridge, chain, why string, ex ...[]expr.Any) Rule {
	_, gt := TableNames(bridge)
	return Rule{Table: gt, Family: FamilyInet, Chain: chain, Why: why,
		exprs: cat(append([][]expr.Any{ifname(expr.MetaKeyOIFNAME, bridge)}, ex...)...)}
}

const (
	ipprotoTCP  = 6
	ipprotoUDP  = 17
	nfprotoIPv4 = 2
)

func cat(parts ...[]expr.Any) []expr.Any {
	var out []expr.Any
	for _, p := range parts {
		out = append(out, p...)
	}
	return out
}

func ifnameBytes(name string) []byte {
	b := make([]byte, ifnamsiz)
	copy(b, name)
	return b
}

// ifname matches a whole interface name, the way nft compiles `iifname "x"`
// (IFNAMSIZ bytes, NUL padded; a shorter compare would be a prefix match).
func ifname(key expr.MetaKey, name string) []expr.Any {
	return []expr.Any{
		&expr.Meta{Key: key, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: ifnameBytes(name)},
	}
}

// prefixMatch compares the register loaded by load against n the way nft
// compiles a prefix: byte-aligned prefixes load only the prefix bytes,
// others load the address and mask it.
func prefixMatch(base expr.PayloadBase, off uint32, n *net.IPNet) []expr.Any {
	ones, _ := n.Mask.Size()
	if ones%8 == 0 {
		l := uint32(ones / 8)
		return []expr.Any{
			&expr.Payload{DestRegister: 1, Base: base, Offset: off, Len: l},
			&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: append([]byte(nil), n.IP.To4()[:l]...)},
		}
	}
	return []expr.Any{
		&expr.Payload{DestRegister: 1, Base: base, Offset: off, Len: 4},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4, Mask: append([]byte(nil), n.Mask...), Xor: make([]byte, 4)},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: append([]byte(nil), n.IP.To4()...)},
	}
}

// bridgeIPv4 is `ip saddr|daddr <n>` in the bridge family (off 12 or 16).
func bridgeIPv4(off uint32, n *net.IPNet) []expr.Any {
	return cat([]expr.Any{
		&expr.Meta{Key: expr.MetaKeyPROTOCOL, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{0x08, 0x00}},
	}, prefixMatch(expr.PayloadBaseNetworkHeader, off, n))
}

// bridgeARP is `arp saddr|daddr ip <n>` (off 14 or 24 in an Ethernet/IPv4 ARP).
func bridgeARP(off uint32, n *net.IPNet) []expr.Any {
	return cat([]expr.Any{
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseLLHeader, Offset: 12, Len: 2},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{0x08, 0x06}},
	}, prefixMatch(expr.PayloadBaseNetworkHeader, off, n))
}

func ip4Daddr(ip net.IP) []expr.Any {
	return []expr.Any{
		&expr.Meta{Key: expr.MetaKeyNFPROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{nfprotoIPv4}},
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: 16, Len: 4},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: append([]byte(nil), ip.To4()...)},
	}
}

func l4Dport(proto byte, port uint16) []expr.Any {
	return []expr.Any{
		&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{proto}},
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{byte(port >> 8), byte(port)}},
	}
}

// ctStateEstRel is `ct state established,related`: the state bitmask is in
// host byte order, as nft emits it.
func ctStateEstRel() []expr.Any {
	mask := binaryutil.NativeEndian.PutUint32(expr.CtStateBitESTABLISHED | expr.CtStateBitRELATED)
	return []expr.Any{
		&expr.Ct{Key: expr.CtKeySTATE, Register: 1},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4, Mask: mask, Xor: make([]byte, 4)},
		&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: make([]byte, 4)},
	}
}

func verdict(k expr.VerdictKind) expr.Any { return &expr.Verdict{Kind: k} }

func familyByte(f string) nftables.TableFamily {
	switch f {
	case FamilyBridge:
		return nftables.TableFamilyBridge
	case FamilyInet:
		return nftables.TableFamilyINet
	}
	return nftables.TableFamilyUnspecified
}
