package firewall

// Layer 2 of claudebox's own, in the bridge table `bridge claudebox_<B>`,
// independent of Incus's NIC filtering (`table bridge incus`, input/forward
// hooks: after the bridge has learnt a frame's source MAC) and of port
// isolation:
//
//	chain prerouting: filter, hook prerouting, priority -200   (port-binding)
//	chain input:      filter, hook input,      priority -200   (l2-ranges)
//	chain output:     filter, hook output,     priority -200   (l2-ranges)
//
// Port binding. Each bound port (the host-side veth of a running box) may
// send only from its MAC and IPv4 address. The prerouting hook runs before
// the bridge learns a frame's source MAC (br_handle_frame_finish), so a
// dropped frame never poisons the FDB. Per port, every rule a drop:
//
//	source MAC not the port's
//	ethertype neither IPv4 nor ARP (IPv6, 802.1Q/802.1ad tags: the tag is
//	  read back into the link header, so a tagged frame shows 0x8100/0x88a8)
//	ARP not Ethernet/IPv4 (htype 1, ptype 0x0800, hlen 6, plen 4: the
//	  offsets below hold only then); sender MAC not the port's; sender IP
//	  neither the port's nor 0.0.0.0 (probes)
//	IPv4 source neither the port's nor 0.0.0.0; from 0.0.0.0 only unfragmented
//	  UDP 68→67 (DHCP)
//	DHCP to a server (udp dport 67) not htype 1/hlen 6, or whose chaddr (BOOTP
//	  offset 28: transport header + 36) is not the port's MAC (no release or
//	  request for a sibling's lease, no lease for a made-up MAC)
//	IPv4 fragments to the box subnet or the limited broadcast (a DHCP
//	  datagram split so the chaddr lands in a later fragment, which has no
//	  transport header to match)
//
// A port with no binding is left alone: on kernels without nft_meta_bridge a
// bridge-family rule cannot tell which bridge a port belongs to, so the table
// cannot default-drop unknown ports (it would cut every other bridge's ports).
// Callers must bind every running box (boxcore does, on every apply).
//
// Routed ranges at L2. The input hook sees frames the bridge delivers to the
// host, the output hook frames the host sends through the bridge, with or
// without br_netfilter:
//
//	input:  IPv4 from the box subnet to a blocked range, except the gateway
//	input:  per bound port, DHCP to the host only with htype 1/hlen 6 and the
//	        port's chaddr, and no fragment to the box subnet or the broadcast:
//	        a second copy of the prerouting binding for what reaches dnsmasq
//	        (a release naming a sibling's MAC deletes its lease record)
//	output: IPv4 from a blocked range outside the box subnet, to the box subnet
//	output: to the box subnet: TCP SYN without ACK, ICMP echo request (any source);
//	        from the gateway: UDP from a port other than 53 (DNS) or 67 (DHCP)
//
// These repeat at L2 what the wall and the ACL hold at L3, in a table Incus
// never touches.

import (
	"errors"
	"fmt"
	"net"
	"net/netip"

	"github.com/google/nftables/expr"
	"golang.org/x/sys/unix"
)

// PortBinding binds one bridge port to the one MAC and IPv4 address the box
// behind it may send from.
type PortBinding struct {
	Port string           // host-side veth (Incus: volatile.eth0.host_name)
	MAC  net.HardwareAddr // the box NIC's MAC
	IPv4 netip.Addr       // the box's address in the bridge subnet
}

func (p PortBinding) String() string { return fmt.Sprintf("%s=%s/%s", p.Port, p.MAC, p.IPv4) }

// Bridge-table chains beside ForwardChain, and their priority ("filter").
const (
	BridgeL2Prio = -200
)

const (
	PartPorts    Part = "port-binding" // chain prerouting of bridge claudebox_<B>: per-port MAC/IP binding
	PartL2Ranges Part = "l2-ranges"    // chains input/output of bridge claudebox_<B>: routed ranges and host→box at L2
)

// Keys of bridge-table rules (tests take out exactly the rules holding a case).
const (
	kPortMAC       = "port-mac"
	kPortEthertype = "port-ethertype"
	kPortARPShape  = "port-arp-shape"
	kPortARPMAC    = "port-arp-mac"
	kPortARPIP     = "port-arp-ip"
	kPortIP        = "port-ip"
	kPortZero      = "port-zero"
	kPortDHCPHw    = "port-dhcp-hw"
	kPortChaddr    = "port-dhcp-chaddr"
	kPortFrag      = "port-frag"
	kL2BlockedDst  = "l2-blocked-daddr"
	kL2DHCPHw      = "l2-dhcp-hw"
	kL2Chaddr      = "l2-dhcp-chaddr"
	kL2Frag        = "l2-frag"
	kPortRelay     = "port-dhcp-relay"
	kL2Relay       = "l2-dhcp-relay"
	kL2OutChaddr   = "l2-out-dhcp-chaddr"
	kL2OutDstMAC   = "l2-out-dst-mac"
	kL2BlockedSrc  = "l2-blocked-saddr"
	kL2HostSYN     = "l2-host-syn"
	kL2HostUDP     = "l2-host-udp"
	kL2HostEcho    = "l2-host-echo"
	kL2BoxPort     = "l2-box-port"
	kL2NotBoxPort  = "l2-not-box-port"
)

// validatePorts checks the bindings: distinct ports, MACs and addresses, each
// a unicast MAC and an address inside the subnet that is not the gateway.
func validatePorts(s Spec) error {
	n := s.subnet()
	ports, macs, ips := map[string]bool{}, map[string]bool{}, map[netip.Addr]bool{}
	for _, p := range s.Ports {
		if err := validateBridge(p.Port); err != nil {
			return fmt.Errorf("firewall: port binding: %w", err)
		}
		if p.Port == s.Bridge {
			return fmt.Errorf("firewall: port binding %s: the bridge itself is not a port", p)
		}
		if len(p.MAC) != 6 || p.MAC[0]&1 != 0 || isZero(p.MAC) {
			return fmt.Errorf("firewall: port binding %s: want a unicast Ethernet MAC", p)
		}
		a := p.IPv4.Unmap()
		if !a.Is4() {
			return fmt.Errorf("firewall: port binding %s: want an IPv4 address", p)
		}
		ip := net.IP(a.AsSlice())
		if !n.Contains(ip) || ip.Equal(s.Gateway.To4()) || ip.Equal(n.IP) || ip.Equal(broadcast(n)) {
			return fmt.Errorf("firewall: port binding %s: address not a host address of %s other than the gateway", p, n)
		}
		switch {
		case ports[p.Port]:
			return fmt.Errorf("firewall: port %s bound twice", p.Port)
		case macs[p.MAC.String()]:
			return fmt.Errorf("firewall: MAC %s bound to two ports", p.MAC)
		case ips[a]:
			return fmt.Errorf("firewall: address %s bound to two ports", a)
		}
		ports[p.Port], macs[p.MAC.String()], ips[a] = true, true, true
	}
	return nil
}

func broadcast(n *net.IPNet) net.IP {
	b := make(net.IP, 4)
	for i := range b {
		b[i] = n.IP.To4()[i] | ^n.Mask[i]
	}
	return b
}

// bridgeL2Chains are the bridge table's chains beside forward.
func bridgeL2Chains(s Spec) []Chain {
	bt, _ := TableNames(s.Bridge)
	return []Chain{
		{Table: bt, Family: FamilyBridge, Name: PreroutingChain, Type: "filter", Hook: "prerouting", Priority: BridgeL2Prio, Policy: "accept"},
		{Table: bt, Family: FamilyBridge, Name: InputChain, Type: "filter", Hook: "input", Priority: BridgeL2Prio, Policy: "accept"},
		{Table: bt, Family: FamilyBridge, Name: OutputChain, Type: "filter", Hook: "output", Priority: BridgeL2Prio, Policy: "accept"},
	}
}

// etherType is `ether type <t>` (the link header: a VLAN tag shows as 0x8100).
func etherType(op expr.CmpOp, t uint16) []expr.Any {
	return []expr.Any{
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseLLHeader, Offset: 12, Len: 2},
		&expr.Cmp{Op: op, Register: 1, Data: []byte{byte(t >> 8), byte(t)}},
	}
}

// rawCmp compares len(data) bytes at base+off with data.
func rawCmp(base expr.PayloadBase, off uint32, op expr.CmpOp, data []byte) []expr.Any {
	return []expr.Any{
		&expr.Payload{DestRegister: 1, Base: base, Offset: off, Len: uint32(len(data))},
		&expr.Cmp{Op: op, Register: 1, Data: append([]byte(nil), data...)},
	}
}

// masked is `<base>,off,len(mask) & mask <op> val`.
func masked(base expr.PayloadBase, off uint32, mask []byte, op expr.CmpOp, val []byte) []expr.Any {
	l := uint32(len(mask))
	return []expr.Any{
		&expr.Payload{DestRegister: 1, Base: base, Offset: off, Len: l},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: l, Mask: append([]byte(nil), mask...), Xor: make([]byte, l)},
		&expr.Cmp{Op: op, Register: 1, Data: append([]byte(nil), val...)},
	}
}

// ipFragment matches an IPv4 fragment (more-fragments set or a non-zero offset).
func ipFragment() []expr.Any {
	return masked(expr.PayloadBaseNetworkHeader, 6, []byte{0x3f, 0xff}, expr.CmpOpNeq, []byte{0, 0})
}

type relayRule struct {
	why string
	ex  [][]expr.Any
}

// dhcpRelayRules: DHCP from a box is a client's, never a relay's. dnsmasq sends its answer
// to a relayed request to giaddr, port 67: a box naming a sibling there (or the subnet's
// broadcast) reached it through the gateway with every other layer on (found by the
// attacker). No giaddr, no hops, not from port 67, and ciaddr only the box's own (a renew
// naming a sibling's address makes dnsmasq broadcast a NAK carrying the sender's xid).
func dhcpRelayRules(own *net.IPNet) []relayRule {
	zero4 := []byte{0, 0, 0, 0}
	dport := thPort(2, expr.CmpOpEq, 67)
	return []relayRule{
		{"DHCP to a server never relayed: giaddr 0", [][]expr.Any{dport, rawCmp(expr.PayloadBaseTransportHeader, 8+24, expr.CmpOpNeq, zero4)}},
		{"DHCP to a server never relayed: hops 0", [][]expr.Any{dport, rawCmp(expr.PayloadBaseTransportHeader, 8+3, expr.CmpOpNeq, []byte{0})}},
		{"DHCP to a server never from the relay port 67", [][]expr.Any{relayPorts()}},
		{"DHCP to a server with ciaddr only the box's own or 0.0.0.0",
			[][]expr.Any{dport, rawCmp(expr.PayloadBaseTransportHeader, 8+12, expr.CmpOpNeq, own.IP.To4()), rawCmp(expr.PayloadBaseTransportHeader, 8+12, expr.CmpOpNeq, zero4)}},
	}
}

// portRules are the prerouting chain's rules, port by port, in Ports order.
func portRules(s Spec) []Rule {
	bt, _ := TableNames(s.Bridge)
	n := s.subnet()
	zero := host32(net.IPv4zero.To4())
	drop := []expr.Any{verdict(expr.VerdictDrop)}
	var (
		ip, arp = etherType(expr.CmpOpEq, unix.ETH_P_IP), etherType(expr.CmpOpEq, unix.ETH_P_ARP)
		udp     = l4proto(expr.CmpOpEq, ipprotoUDP)
	)
	var rules []Rule
	for _, p := range s.Ports {
		a := p.IPv4.Unmap().As4()
		own := host32(net.IP(a[:]))
		mac := []byte(p.MAC)
		in := ifnameOp(expr.MetaKeyIIFNAME, expr.CmpOpEq, p.Port)
		r := func(key, why string, ex ...[]expr.Any) {
			rules = append(rules, Rule{Table: bt, Family: FamilyBridge, Chain: PreroutingChain, key: key,
				Why: p.Port + ": " + why, exprs: cat(append(append([][]expr.Any{in}, ex...), drop)...)})
		}
		r(kPortMAC, "frames only from the port's MAC "+p.MAC.String()+" (dropped before the bridge learns it)",
			rawCmp(expr.PayloadBaseLLHeader, 6, expr.CmpOpNeq, mac))
		r(kPortEthertype, "only IPv4 and ARP: no IPv6, no VLAN/QinQ tag, no other ethertype",
			etherType(expr.CmpOpNeq, unix.ETH_P_IP), etherType(expr.CmpOpNeq, unix.ETH_P_ARP))
		r(kPortARPShape, "ARP only for Ethernet/IPv4 (htype 1, ptype ip, hlen 6, plen 4)",
			arp, rawCmp(expr.PayloadBaseNetworkHeader, 0, expr.CmpOpNeq, []byte{0, 1, 8, 0, 6, 4}))
		r(kPortARPMAC, "ARP sender MAC only the port's",
			arp, rawCmp(expr.PayloadBaseNetworkHeader, 8, expr.CmpOpNeq, mac))
		r(kPortARPIP, "ARP sender address only the port's "+p.IPv4.String()+" or 0.0.0.0 (probe)",
			arp, ip4Op(14, expr.CmpOpNeq, own), ip4Op(14, expr.CmpOpNeq, zero))
		r(kPortIP, "IPv4 only from the port's address "+p.IPv4.String()+" (or 0.0.0.0 for DHCP, below)",
			ip, ip4Op(12, expr.CmpOpNeq, own), ip4Op(12, expr.CmpOpNeq, zero))
		r(kPortZero, "from 0.0.0.0 only DHCP: udp", ip, ip4Op(12, expr.CmpOpEq, zero), l4proto(expr.CmpOpNeq, ipprotoUDP))
		r(kPortZero, "from 0.0.0.0 only DHCP: unfragmented", ip, ip4Op(12, expr.CmpOpEq, zero), ipFragment())
		r(kPortZero, "from 0.0.0.0 only DHCP: source port 68", ip, ip4Op(12, expr.CmpOpEq, zero), udp, thPort(0, expr.CmpOpNeq, 68))
		r(kPortZero, "from 0.0.0.0 only DHCP: destination port 67", ip, ip4Op(12, expr.CmpOpEq, zero), udp, thPort(2, expr.CmpOpNeq, 67))
		r(kPortDHCPHw, "DHCP to a server only with htype 1 (Ethernet), hlen 6",
			ip, udp, thPort(2, expr.CmpOpEq, 67), rawCmp(expr.PayloadBaseTransportHeader, 8+1, expr.CmpOpNeq, []byte{1, 6}))
		r(kPortChaddr, "DHCP to a server only with chaddr "+p.MAC.String()+" (no lease, release or request for another MAC)",
			ip, udp, thPort(2, expr.CmpOpEq, 67), rawCmp(expr.PayloadBaseTransportHeader, 8+28, expr.CmpOpNeq, mac))
		for _, rr := range dhcpRelayRules(own) {
			r(kPortRelay, rr.why, append([][]expr.Any{ip, udp}, rr.ex...)...)
		}
		r(kPortFrag, "no IPv4 fragment to the box subnet (a DHCP chaddr in a later fragment)",
			ip, ip4Op(16, expr.CmpOpEq, n), ipFragment())
		r(kPortFrag, "no IPv4 fragment to the limited broadcast",
			ip, ip4Op(16, expr.CmpOpEq, host32(net.IPv4bcast.To4())), ipFragment())
	}
	return rules
}

// l2RangeRules are the input and output chains' rules.
func l2RangeRules(s Spec) []Rule {
	bt, _ := TableNames(s.Bridge)
	n := s.subnet()
	g := s.Gateway.To4()
	if g == nil {
		g = net.IPv4zero.To4()
	}
	gw := host32(g)
	drop := []expr.Any{verdict(expr.VerdictDrop)}
	ip := etherType(expr.CmpOpEq, unix.ETH_P_IP)
	mk := func(chain, key, why string, ex ...[]expr.Any) Rule {
		return Rule{Table: bt, Family: FamilyBridge, Chain: chain, key: key, Why: why, exprs: cat(append(ex, drop)...)}
	}
	var rules []Rule
	for _, p := range s.blocked() {
		// Scoped to sources in the box subnet: the bridge family sees every bridge's frames,
		// and other bridges' boxes must still reach their own gateways in these ranges.
		rules = append(rules, mk(InputChain, kL2BlockedDst, "a box never reaches "+p.String()+" through the host (the gateway excepted)",
			ip, ip4Op(12, expr.CmpOpEq, n), ip4Op(16, expr.CmpOpEq, p), ip4Op(16, expr.CmpOpNeq, gw)))
	}
	udp := l4proto(expr.CmpOpEq, ipprotoUDP)
	for _, p := range s.Ports {
		in := ifnameOp(expr.MetaKeyIIFNAME, expr.CmpOpEq, p.Port)
		mac := []byte(p.MAC)
		rules = append(rules,
			mk(InputChain, kL2DHCPHw, p.Port+": DHCP to the host only with htype 1 (Ethernet), hlen 6",
				in, ip, udp, thPort(2, expr.CmpOpEq, 67), rawCmp(expr.PayloadBaseTransportHeader, 8+1, expr.CmpOpNeq, []byte{1, 6})),
			mk(InputChain, kL2Chaddr, p.Port+": DHCP to the host only with chaddr "+p.MAC.String()+" (no release of a sibling's lease)",
				in, ip, udp, thPort(2, expr.CmpOpEq, 67), rawCmp(expr.PayloadBaseTransportHeader, 8+28, expr.CmpOpNeq, mac)),
		)
		a := p.IPv4.Unmap().As4()
		for _, rr := range dhcpRelayRules(host32(net.IP(a[:]))) {
			rules = append(rules, mk(InputChain, kL2Relay, p.Port+": "+rr.why, append([][]expr.Any{in, ip, udp}, rr.ex...)...))
		}
		rules = append(rules,
			mk(InputChain, kL2Frag, p.Port+": no IPv4 fragment to the box subnet (a DHCP chaddr in a later fragment)",
				in, ip, ip4Op(16, expr.CmpOpEq, n), ipFragment()),
			mk(InputChain, kL2Frag, p.Port+": no IPv4 fragment to the limited broadcast",
				in, ip, ip4Op(16, expr.CmpOpEq, host32(net.IPv4bcast.To4())), ipFragment()),
		)
	}
	// Only a box port speaks for the box subnet to the host. A frame claiming an address of
	// it from any other port (a join to another member's bridge, where the same subnet's
	// boxes live) would teach the host a box's address at that port's MAC, or have dnsmasq
	// answer it as a box (found by the attacker). The box ports' frames end the chain here
	// (their own rules above have judged them; the chain's policy accepts); what is left
	// with a source in the subnet came from elsewhere.
	for _, p := range s.Ports {
		rules = append(rules, Rule{Table: bt, Family: FamilyBridge, Chain: InputChain, key: kL2BoxPort,
			Why:   p.Port + ": a box port's frames are judged by its rules above",
			exprs: cat(ifnameOp(expr.MetaKeyIIFNAME, expr.CmpOpEq, p.Port), []expr.Any{verdict(expr.VerdictReturn)})})
	}
	rules = append(rules,
		mk(InputChain, kL2NotBoxPort, "IPv4 from the box subnet only from a box port", bridgeIPv4(12, n)),
		mk(InputChain, kL2NotBoxPort, "ARP from the box subnet only from a box port", bridgeARP(14, n)))
	for _, p := range s.Ports {
		out := ifnameOp(expr.MetaKeyOIFNAME, expr.CmpOpEq, p.Port)
		mac := []byte(p.MAC)
		rules = append(rules,
			// dnsmasq answers a relay at giaddr: a DHCP reply on a port must be for that port's
			// box, or a box could reach a sibling through the gateway (found by the attacker).
			mk(OutputChain, kL2OutChaddr, p.Port+": DHCP replies out of this port only with chaddr "+p.MAC.String(),
				out, ip, udp, thPort(0, expr.CmpOpEq, 67), rawCmp(expr.PayloadBaseTransportHeader, 8+28, expr.CmpOpNeq, mac)),
			// A frame for a box whose FDB entry is gone (stopped, restarting) is flooded to
			// every port: only the port's own MAC (and group addresses) may leave by it.
			mk(OutputChain, kL2OutDstMAC, p.Port+": unicast out of this port only to "+p.MAC.String(),
				out, masked(expr.PayloadBaseLLHeader, 0, []byte{1}, expr.CmpOpEq, []byte{0}), rawCmp(expr.PayloadBaseLLHeader, 0, expr.CmpOpNeq, mac)),
		)
	}
	for _, p := range s.blocked() {
		rules = append(rules, mk(OutputChain, kL2BlockedSrc, "nothing from "+p.String()+" (outside the box subnet) reaches a box",
			ip, ip4Op(12, expr.CmpOpEq, p), ip4Op(12, expr.CmpOpNeq, n), ip4Op(16, expr.CmpOpEq, n)))
	}
	rules = append(rules,
		// No new TCP connection and no ping into a box from anything the host sends or routes
		// (whatever the source: while Incus re-applies, the gateway address is briefly gone
		// and the host picks another); UDP only from the gateway's DNS and DHCP ports.
		mk(OutputChain, kL2HostSYN, "nothing opens a TCP connection into a box (SYN without ACK)",
			ip, ip4Op(16, expr.CmpOpEq, n), l4proto(expr.CmpOpEq, ipprotoTCP),
			masked(expr.PayloadBaseTransportHeader, 13, []byte{0x12}, expr.CmpOpEq, []byte{0x02})),
		mk(OutputChain, kL2HostUDP, "host→box: UDP from the gateway only from DNS (53) and DHCP (67)",
			ip, ip4Op(12, expr.CmpOpEq, gw), l4proto(expr.CmpOpEq, ipprotoUDP), thPort(0, expr.CmpOpNeq, 53), thPort(0, expr.CmpOpNeq, 67)),
		mk(OutputChain, kL2HostEcho, "nothing pings a box",
			ip, ip4Op(16, expr.CmpOpEq, n), l4proto(expr.CmpOpEq, unix.IPPROTO_ICMP),
			rawCmp(expr.PayloadBaseTransportHeader, 0, expr.CmpOpEq, []byte{8})),
	)
	return rules
}

// removeChains deletes chains of one table, one batch each, so one already
// absent does not keep another.
func removeChains(table string, fam string, chains ...string) error {
	var errs []error
	for _, c := range chains {
		if err := delChain(table, fam, c); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}
