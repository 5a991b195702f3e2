package firewall

// The wall: claudebox's own complete inet layer for bridge B, in table
// `inet claudebox_<B>_wall`. Incus deletes and re-adds its `inet incus`
// chains (NAT and the network ACL included) for about a second on every
// network re-apply; a box then reaches every private address un-NATed, and a
// flow opened then survives the ACL's `ct state established accept`. Incus
// never touches this table, so the wall holds alone through that window:
//
//	chain prerouting: filter, hook prerouting, priority -300 (before conntrack,
//	                  so spoofed packets create no conntrack entry)
//	chain forward:    filter, hook forward,    priority -1
//	chain output:     filter, hook output,     priority -1
//	chain postrouting: nat,   hook postrouting, priority 110 (srcnat + 10)
//
// Every filter rule is a drop; the only accepts are the box→host exceptions
// (DNS and DHCP to the gateway) just before the prerouting chain's final
// box→host drops, so an accept never skips any other rule. No rule has a
// `ct state established` exception for a blocked destination: applying the
// wall cuts a flow opened while it was absent.
//
// The prerouting chain begins with two rules that need no `iifname B`: a
// frame a box sends to an IEEE 802.1 link-local group MAC (01:80:c2:00:00:0X
// the bridge does not forward: 03, 0e, 0f, ...) is handed to the IP stack on
// the box's own port, not on the bridge, so it passes every rule that names B
// (this table's, the guard's, Incus's and its ACL's); for 0e (LLDP) even the
// bridge's input hook is skipped. So: `iifname "<port>" drop` for every bound
// port (IP never legitimately arrives on a port itself), and `iifname != B
// iifname != "lo" ip saddr <subnet> drop` (a box-subnet source arrives by the
// bridge or, for the host talking to its own gateway address, by loopback;
// the gateway's own packets are output, never prerouting). A second,
// independent layer outside nftables is rp_filter=1 on every bound port (see
// rpfilter.go).
//
// What no masquerade rewrites never leaves from a box: the forward chain
// drops invalid and untracked packets, packets related to a flow without
// source NAT (a box's ICMP error about one of the host's own flows) and
// packets with IPv4 options; the prerouting chain drops what arrives
// elsewhere than the bridge addressed to the box subnet (before NAT is
// undone, so replies to boxes, still addressed to the host, pass).
//
// Blocked ranges and uplinks are per-prefix and per-name rules, not sets, so
// the one renderer covers them and Check stays string equality.

import (
	"errors"
	"fmt"
	"net"
	"net/netip"

	"github.com/claudebox/claudebox/internal/netdump"
	"github.com/google/nftables"
	"github.com/google/nftables/binaryutil"
	"github.com/google/nftables/expr"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// Wall chain names and priorities.
const (
	PreroutingChain  = "prerouting"
	OutputChain      = "output"
	PostroutingChain = "postrouting"
	WallPrePrio      = -300
	WallFwdPrio      = -1
	WallOutPrio      = -1
	WallNATPrio      = 110
	wallTableSuffix  = "_wall"
)

// WallTableName is the inet table holding the wall for bridge.
func WallTableName(bridge string) string { return tablePrefix + bridge + wallTableSuffix }

// Part is one independently switchable layer of the firewall (the drill's
// seeded holes switch parts off through RemovePart; Apply restores them).
type Part string

const (
	PartBridge Part = "bridge" // table bridge claudebox_<B>: box→box frames
	PartGuard  Part = "guard"  // chains input, output, inbound, egress of inet claudebox_<B>_guard: box→host, nothing new into a box, nothing un-NATed out
	PartWall   Part = "wall"   // table inet claudebox_<B>_wall: the complete inet layer
)

// Parts lists every part, in table order.
func Parts() []Part {
	return []Part{PartBridge, PartPorts, PartL2Ranges, PartGuard, PartLocalAnswers, PartWall}
}

// RemovePart switches one part off. A part that is already absent is not an
// error. The bridge table's parts are its chains (forward; prerouting; input
// and output), so each goes alone.
func RemovePart(s Spec, p Part) error {
	if err := validateBridge(s.Bridge); err != nil {
		return err
	}
	bt, gt := TableNames(s.Bridge)
	switch p {
	case PartBridge:
		return removeChains(bt, FamilyBridge, ForwardChain)
	case PartPorts:
		return removeChains(bt, FamilyBridge, PreroutingChain)
	case PartL2Ranges:
		return removeChains(bt, FamilyBridge, InputChain, OutputChain)
	case PartGuard:
		return removeChains(gt, FamilyInet, InputChain, OutputChain, InboundChain, EgressChain)
	case PartLocalAnswers:
		return removeChains(gt, FamilyInet, AnswersChain, DNSTCPChain)
	case PartWall:
		cc, err := nftables.New()
		if err != nil {
			return err
		}
		cc.DelTable(&nftables.Table{Name: WallTableName(s.Bridge), Family: nftables.TableFamilyINet})
		if err := cc.Flush(); err != nil && !errors.Is(err, unix.ENOENT) {
			return fmt.Errorf("firewall: remove part %s of %s: %w", p, s.Bridge, err)
		}
		return nil
	}
	return fmt.Errorf("firewall: unknown part %q", p)
}

// delChain deletes one chain in its own batch; absent is not an error.
func delChain(table, fam, chain string) error {
	cc, err := nftables.New()
	if err != nil {
		return err
	}
	cc.DelChain(&nftables.Chain{Name: chain, Table: &nftables.Table{Name: table, Family: familyByte(fam)}})
	if err := cc.Flush(); err != nil && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("firewall: remove chain %s %s %s: %w", fam, table, chain, err)
	}
	return nil
}

// PartPresent tells whether the kernel holds part p at all (not whether it
// is converged; Check says that).
func (o Observed) PartPresent(p Part) bool {
	bt, gt := TableNames(o.Bridge)
	for _, t := range o.Tables {
		switch {
		case p == PartBridge && t.Name == bt && t.Family == FamilyBridge:
			return t.Present && findChain(t.Chains, ForwardChain) != nil
		case p == PartPorts && t.Name == bt && t.Family == FamilyBridge:
			return t.Present && findChain(t.Chains, PreroutingChain) != nil
		case p == PartL2Ranges && t.Name == bt && t.Family == FamilyBridge:
			return t.Present && findChain(t.Chains, InputChain) != nil && findChain(t.Chains, OutputChain) != nil
		case p == PartGuard && t.Name == gt && t.Family == FamilyInet:
			return t.Present && findChain(t.Chains, InputChain) != nil && findChain(t.Chains, OutputChain) != nil &&
				findChain(t.Chains, InboundChain) != nil && findChain(t.Chains, EgressChain) != nil
		case p == PartLocalAnswers && t.Name == gt && t.Family == FamilyInet:
			return t.Present && findChain(t.Chains, AnswersChain) != nil && findChain(t.Chains, DNSTCPChain) != nil
		case p == PartWall && t.Name == WallTableName(o.Bridge) && t.Family == FamilyInet:
			return t.Present && len(t.Chains) > 0
		}
	}
	return false
}

// Bound returns the port bindings the kernel's prerouting chain holds rules
// for (by the port names its rules match), for a reader that wants to know
// which ports are bound without the spec.
func (o Observed) Bound() []string {
	bt, _ := TableNames(o.Bridge)
	var out []string
	seen := map[string]bool{}
	for _, t := range o.Tables {
		if t.Name != bt || t.Family != FamilyBridge {
			continue
		}
		if c := findChain(t.Chains, PreroutingChain); c != nil {
			for _, r := range c.Rules {
				var name string
				if _, err := fmt.Sscanf(r, "iifname %q", &name); err == nil && !seen[name] {
					seen[name] = true
					out = append(out, name)
				}
			}
		}
	}
	return out
}

// DefaultUplinks returns the interfaces of the main table's IPv4 default
// routes (multipath hops included), in route order, in the calling thread's
// network namespace. Unreachable/blackhole defaults have no interface.
func DefaultUplinks() ([]string, error) {
	routes, err := netdump.RoutesFiltered(netlink.FAMILY_V4,
		&netlink.Route{Table: unix.RT_TABLE_MAIN}, netlink.RT_FILTER_TABLE)
	if err != nil {
		return nil, fmt.Errorf("firewall: list routes: %w", err)
	}
	var out []string
	add := func(idx int) error {
		if idx == 0 {
			return nil
		}
		l, err := netlink.LinkByIndex(idx)
		if err != nil {
			return fmt.Errorf("firewall: link %d: %w", idx, err)
		}
		for _, n := range out {
			if n == l.Attrs().Name {
				return nil
			}
		}
		out = append(out, l.Attrs().Name)
		return nil
	}
	for _, r := range routes {
		if r.Dst != nil && !isDefault(r.Dst) || r.Type != unix.RTN_UNICAST {
			continue
		}
		if err := add(r.LinkIndex); err != nil {
			return nil, err
		}
		for _, h := range r.MultiPath {
			if err := add(h.LinkIndex); err != nil {
				return nil, err
			}
		}
	}
	return out, nil
}

func isDefault(n *net.IPNet) bool {
	ones, _ := n.Mask.Size()
	return ones == 0
}

// validateWall checks the wall's inputs.
func validateWall(s Spec) error {
	for _, p := range s.Blocked {
		switch {
		case !p.IsValid():
			return fmt.Errorf("firewall: blocked range %v is not a prefix", p)
		case !p.Addr().Is4():
			return fmt.Errorf("firewall: blocked range %s is not IPv4", p)
		case p.Bits() < 1:
			return fmt.Errorf("firewall: blocked range %s would block every address, egress included", p)
		}
	}
	seen := map[string]bool{}
	for _, u := range s.Uplinks {
		if err := validateBridge(u); err != nil {
			return fmt.Errorf("firewall: uplink: %w", err)
		}
		if u == s.Bridge {
			return fmt.Errorf("firewall: uplink %q is the bridge itself", u)
		}
		if seen[u] {
			return fmt.Errorf("firewall: uplink %q listed twice", u)
		}
		seen[u] = true
	}
	return nil
}

// blocked returns the blocked ranges masked, without duplicates, in order.
func (s Spec) blocked() []*net.IPNet {
	var out []*net.IPNet
	seen := map[netip.Prefix]bool{}
	for _, p := range s.Blocked {
		p = p.Masked()
		if !p.IsValid() || !p.Addr().Is4() || p.Bits() < 1 || seen[p] {
			continue
		}
		seen[p] = true
		a := p.Addr().As4()
		out = append(out, &net.IPNet{IP: net.IP(a[:]), Mask: net.CIDRMask(p.Bits(), 32)})
	}
	return out
}

// wallChains are the wall's base chains, in table order.
func wallChains(s Spec) []Chain {
	wt := WallTableName(s.Bridge)
	return []Chain{
		{Table: wt, Family: FamilyInet, Name: PreroutingChain, Type: "filter", Hook: "prerouting", Priority: WallPrePrio, Policy: "accept"},
		{Table: wt, Family: FamilyInet, Name: ForwardChain, Type: "filter", Hook: "forward", Priority: WallFwdPrio, Policy: "accept"},
		{Table: wt, Family: FamilyInet, Name: OutputChain, Type: "filter", Hook: "output", Priority: WallOutPrio, Policy: "accept"},
		{Table: wt, Family: FamilyInet, Name: PostroutingChain, Type: "nat", Hook: "postrouting", Priority: WallNATPrio, Policy: "accept"},
	}
}

// Keys of wall rules, so tests can take out exactly the rules that hold a
// probe and watch it open.
const (
	wPrePort       = "pre-port"
	wPreSubnetElse = "pre-subnet-elsewhere"
	wPreIPv6       = "pre-ipv6"
	wPreSpoof      = "pre-spoof"
	wPreSubnetDst  = "pre-subnet-addressed-elsewhere"
	wPreZeroProto  = "pre-zero-proto"
	wPreZeroSport  = "pre-zero-sport"
	wPreZeroDport  = "pre-zero-dport"
	wPreAccept     = "pre-accept"
	wPreLocal      = "pre-local"
	wPreBroadcast  = "pre-broadcast"
	wPreMulticast  = "pre-multicast"
	wFwdIPv6In     = "fwd-ipv6-in"
	wFwdIPv6Out    = "fwd-ipv6-out"
	wFwdSpoof      = "fwd-spoof"
	wFwdInvalid    = "fwd-invalid"
	wFwdIPOptions  = "fwd-ip-options"
	wFwdRelatedRaw = "fwd-related-unnatted"
	wFwdBlockedDst = "fwd-blocked-daddr"
	wFwdBlockedSrc = "fwd-blocked-saddr"
	wFwdNewIn      = "fwd-new-in"
	wFwdSubnetElse = "fwd-subnet-elsewhere"
	wFwdUplinks    = "fwd-uplinks-only"
	wOutSubnetElse = "out-subnet-elsewhere"
	wOutIPv6       = "out-ipv6"
	wOutNewNotUDP  = "out-new-not-udp"
	wOutNewUDP     = "out-new-udp"
	wOutDHCPPort   = "out-dhcp-port"
	wNATMasq       = "nat-masquerade"
)

// wallRules returns the wall's rules, chain by chain; s must be Resolved. Long by design: it
// is the table itself, every rule a line of data in chain order, so it reads like the nft text.
func wallRules(s Spec) []Rule {
	wt := WallTableName(s.Bridge)
	b, n := s.Bridge, s.subnet()
	g := s.Gateway.To4()
	if g == nil {
		g = net.IPv4zero.To4()
	}
	zero := net.IPv4zero.To4()
	bcast := net.IPv4bcast.To4()
	mk := func(chain, key, why string, ex ...[]expr.Any) Rule {
		return Rule{Table: wt, Family: FamilyInet, Chain: chain, Why: why, key: key, exprs: cat(ex...)}
	}
	var (
		ipv4, ipv6    = nfproto(unix.NFPROTO_IPV4), nfproto(unix.NFPROTO_IPV6)
		inB           = ifnameOp(expr.MetaKeyIIFNAME, expr.CmpOpEq, b)
		outB, notOutB = ifnameOp(expr.MetaKeyOIFNAME, expr.CmpOpEq, b), ifnameOp(expr.MetaKeyOIFNAME, expr.CmpOpNeq, b)
		notOutLo      = ifnameOp(expr.MetaKeyOIFNAME, expr.CmpOpNeq, "lo")
		drop          = []expr.Any{verdict(expr.VerdictDrop)}
		accept        = []expr.Any{verdict(expr.VerdictAccept)}
		udp, tcp      = l4proto(expr.CmpOpEq, ipprotoUDP), l4proto(expr.CmpOpEq, ipprotoTCP)
	)
	pre := func(key, why string, ex ...[]expr.Any) Rule {
		return mk(PreroutingChain, key, why, append([][]expr.Any{inB}, ex...)...)
	}
	// Link-local group MACs (01:80:c2:00:00:0X, X not forwarded by the bridge) are handed to
	// the IP stack on the box's own port, not on the bridge: every `iifname B` rule misses
	// them, and for 0e (LLDP) even the bridge's input hook is skipped. IP never legitimately
	// arrives on a port itself, and a box-subnet source arrives only by the bridge (the
	// gateway's own packets are output, or loopback when the host talks to itself).
	var rules []Rule
	for _, p := range s.Ports {
		rules = append(rules, mk(PreroutingChain, wPrePort,
			"nothing is delivered on box port "+p.Port+" itself (a frame to a link-local group MAC is passed up on the port, past every bridge rule)",
			ifnameOp(expr.MetaKeyIIFNAME, expr.CmpOpEq, p.Port), drop))
	}
	rules = append(rules, mk(PreroutingChain, wPreSubnetElse,
		"a box-subnet source arrives only by the bridge (not on a box's port by a link-local group MAC, not on any other interface)",
		ifnameOp(expr.MetaKeyIIFNAME, expr.CmpOpNeq, b), ifnameOp(expr.MetaKeyIIFNAME, expr.CmpOpNeq, "lo"), ipv4, ip4Op(12, expr.CmpOpEq, n), drop))
	// Before NAT is undone (priority -300 < dstnat), a reply to a box is still addressed to
	// the host: what arrives elsewhere addressed to the box subnet was aimed at it from
	// outside (the host would answer for its gateway address, from that address).
	rules = append(rules, mk(PreroutingChain, wPreSubnetDst,
		"the box subnet is addressed only from the bridge (from the LAN or an uplink not even the gateway's address answers)",
		ifnameOp(expr.MetaKeyIIFNAME, expr.CmpOpNeq, b), ifnameOp(expr.MetaKeyIIFNAME, expr.CmpOpNeq, "lo"), ipv4, ip4Op(16, expr.CmpOpEq, n), drop))
	rules = append(rules, []Rule{
		pre(wPreIPv6, "no IPv6 from a box, to anywhere", ipv6, drop),
		pre(wPreSpoof, "a box sends only from its subnet (0.0.0.0 only for DHCP, below)",
			ipv4, ip4Op(12, expr.CmpOpNeq, n), ip4Op(12, expr.CmpOpNeq, host32(zero)), drop),
		pre(wPreZeroProto, "from 0.0.0.0 only DHCP: udp", ipv4, ip4Op(12, expr.CmpOpEq, host32(zero)), l4proto(expr.CmpOpNeq, ipprotoUDP), drop),
		pre(wPreZeroSport, "from 0.0.0.0 only DHCP: source port 68", ipv4, ip4Op(12, expr.CmpOpEq, host32(zero)), udp, thPort(0, expr.CmpOpNeq, 68), drop),
		pre(wPreZeroDport, "from 0.0.0.0 only DHCP: destination port 67", ipv4, ip4Op(12, expr.CmpOpEq, host32(zero)), udp, thPort(2, expr.CmpOpNeq, 67), drop),
		pre(wPreAccept, "DNS to the gateway (udp)", ipv4, ip4Op(16, expr.CmpOpEq, host32(g)), udp, thPort(2, expr.CmpOpEq, 53), accept),
		pre(wPreAccept, "DNS to the gateway (tcp)", ipv4, ip4Op(16, expr.CmpOpEq, host32(g)), tcp, thPort(2, expr.CmpOpEq, 53), accept),
		pre(wPreAccept, "DHCP to the gateway", ipv4, ip4Op(16, expr.CmpOpEq, host32(g)), udp, thPort(2, expr.CmpOpEq, 67), accept),
		pre(wPreAccept, "DHCP to the limited broadcast", ipv4, ip4Op(16, expr.CmpOpEq, host32(bcast)), udp, thPort(2, expr.CmpOpEq, 67), accept),
		pre(wPreLocal, "box→host: anything else to a host address", fibDaddrType(unix.RTN_LOCAL), drop),
		pre(wPreBroadcast, "box→host: anything else broadcast", fibDaddrType(unix.RTN_BROADCAST), drop),
		pre(wPreMulticast, "box→host: anything multicast", fibDaddrType(unix.RTN_MULTICAST), drop),

		mk(ForwardChain, wFwdIPv6In, "no IPv6 from a box", inB, ipv6, drop),
		mk(ForwardChain, wFwdIPv6Out, "no IPv6 to a box", outB, ipv6, drop),
		mk(ForwardChain, wFwdSpoof, "a box is routed only from its subnet", inB, ipv4, ip4Op(12, expr.CmpOpNeq, n), drop),
		// No NAT chain sees a packet conntrack calls invalid (a wrong checksum, a TCP flag
		// mix no state allows) or untracked: forwarded, it would leave with the box's address.
		mk(ForwardChain, wFwdInvalid, "nothing conntrack calls invalid or untracked is forwarded from a box (no NAT chain sees it: it would leave un-NATed)",
			inB, ctStateIn(expr.CtStateBitINVALID|expr.CtStateBitUNTRACKED), drop),
		// An ICMP error a box makes about one of the host's own flows is related to that
		// flow, which has no source NAT: no masquerade rewrites it, so it would leave with
		// the box's address. A box's errors about its own flows (NATed) still pass.
		mk(ForwardChain, wFwdRelatedRaw, "nothing related to a flow without source NAT is forwarded from a box (an ICMP error about the host's own flow would leave un-NATed)",
			inB, ctStateIn(expr.CtStateBitRELATED), ctStatusClear(natSrcBit), drop),
		// A router fills some IPv4 options with its own address (timestamp, flag 1: the
		// address of the interface it came in by — the gateway's): none leaves the host.
		mk(ForwardChain, wFwdIPOptions, "nothing with IPv4 options is forwarded from a box (a timestamp option would carry the gateway's address out)",
			inB, ipv4, ipOptions(), drop),
	}...)
	for _, p := range s.blocked() {
		rules = append(rules, mk(ForwardChain, wFwdBlockedDst, "a box never reaches "+p.String()+" (no ct exception)", inB, ipv4, ip4Op(16, expr.CmpOpEq, p), drop))
	}
	for _, p := range s.blocked() {
		rules = append(rules, mk(ForwardChain, wFwdBlockedSrc, "nothing from "+p.String()+" reaches a box, established or not", outB, ipv4, ip4Op(12, expr.CmpOpEq, p), drop))
	}
	uplinks := inB
	for _, u := range s.Uplinks {
		uplinks = cat(uplinks, ifnameOp(expr.MetaKeyOIFNAME, expr.CmpOpNeq, u))
	}
	rules = append(rules,
		mk(ForwardChain, wFwdNewIn, "no new connection into a box", outB, ctStateNew(), drop),
		mk(ForwardChain, wFwdSubnetElse, "the box subnet is reached only on the bridge", notOutB, ipv4, ip4Op(16, expr.CmpOpEq, n), drop),
		mk(ForwardChain, wFwdUplinks, fmt.Sprintf("box egress leaves only by the uplinks %v", s.Uplinks), uplinks, drop),

		mk(OutputChain, wOutSubnetElse, "the host's packets to the box subnet leave only by the bridge (not the default route while the bridge address flaps)",
			notOutB, notOutLo, ipv4, ip4Op(16, expr.CmpOpEq, n), drop),
		mk(OutputChain, wOutIPv6, "no IPv6 from the host to boxes (no RA)", outB, ipv6, drop),
		mk(OutputChain, wOutNewNotUDP, "host→box: no new connection", outB, ctStateNew(), l4proto(expr.CmpOpNeq, ipprotoUDP), drop),
		mk(OutputChain, wOutNewUDP, "host→box: no new udp flow but DHCP replies", outB, ctStateNew(), udp, thPort(0, expr.CmpOpNeq, 67), drop),
		mk(OutputChain, wOutDHCPPort, "host→box: no DHCP relay reply (dnsmasq answers a relayed request at giaddr:67)",
			outB, udp, relayPorts(), drop),

		mk(PostroutingChain, wNATMasq, "own masquerade: box egress is never un-NATed, even while Incus's is gone",
			ipv4, ip4Op(12, expr.CmpOpEq, n), notOutB, notOutLo, []expr.Any{&expr.Masq{}}),
	)
	return rules
}

func host32(ip net.IP) *net.IPNet { return &net.IPNet{IP: ip.To4(), Mask: net.CIDRMask(32, 32)} }

func ifnameOp(key expr.MetaKey, op expr.CmpOp, name string) []expr.Any {
	return []expr.Any{
		&expr.Meta{Key: key, Register: 1},
		&expr.Cmp{Op: op, Register: 1, Data: ifnameBytes(name)},
	}
}

func nfproto(p byte) []expr.Any {
	return []expr.Any{
		&expr.Meta{Key: expr.MetaKeyNFPROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{p}},
	}
}

func l4proto(op expr.CmpOp, p byte) []expr.Any {
	return []expr.Any{
		&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1},
		&expr.Cmp{Op: op, Register: 1, Data: []byte{p}},
	}
}

// thPort is `th sport|dport [!=] port` (off 0 or 2).
func thPort(off uint32, op expr.CmpOp, port uint16) []expr.Any {
	return []expr.Any{
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: off, Len: 2},
		&expr.Cmp{Op: op, Register: 1, Data: []byte{byte(port >> 8), byte(port)}},
	}
}

// ip4Op is `ip saddr|daddr [!=] n` (off 12 or 16), compiled as nft does.
func ip4Op(off uint32, op expr.CmpOp, n *net.IPNet) []expr.Any {
	ex := prefixMatch(expr.PayloadBaseNetworkHeader, off, n)
	ex[len(ex)-1].(*expr.Cmp).Op = op
	return ex
}

// fibDaddrType is `fib daddr type <t>`; the result is a host-order u32.
func fibDaddrType(t uint32) []expr.Any {
	return []expr.Any{
		&expr.Fib{Register: 1, FlagDADDR: true, ResultADDRTYPE: true},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: binaryutil.NativeEndian.PutUint32(t)},
	}
}

// ctStateNew is `ct state new`.
func ctStateNew() []expr.Any { return ctStateIn(expr.CtStateBitNEW) }

// natSrcBit is IPS_SRC_NAT: the flow's source is rewritten (a masquerade or SNAT applies).
const natSrcBit = 1 << 4

// ctStatusClear is `ct status & bit == 0`.
func ctStatusClear(bit uint32) []expr.Any { return ctBits(expr.CtKeySTATUS, bit, expr.CmpOpEq) }

// ipOptions is `ip hdrlength != 5`: the IPv4 header carries options.
func ipOptions() []expr.Any {
	return masked(expr.PayloadBaseNetworkHeader, 0, []byte{0x0f}, expr.CmpOpNeq, []byte{0x05})
}

// ctStateIn is `ct state S1,S2,...`: any of the state bits.
func ctStateIn(bits uint32) []expr.Any { return ctBits(expr.CtKeySTATE, bits, expr.CmpOpNeq) }

// ctBits compares `ct <key> & bits` with 0: != for any of them set, == for none.
func ctBits(key expr.CtKey, bits uint32, op expr.CmpOp) []expr.Any {
	return []expr.Any{
		&expr.Ct{Key: key, Register: 1},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4,
			Mask: binaryutil.NativeEndian.PutUint32(bits), Xor: make([]byte, 4)},
		&expr.Cmp{Op: op, Register: 1, Data: make([]byte, 4)},
	}
}
