package drill

import (
	"net/netip"
	"slices"
	"strings"
	"time"

	"github.com/claudebox/claudebox/drill/probes"
)

// The isolation contract as data: one ClaimRow per probe of a claim, with its selectors,
// probe, expectation, positive controls and the layers that hold it. The attribution is
// what the seeded holes MEASURED on this project's test machine (kernel without
// nft_meta_bridge, Incus 6.0.4); docs/drill.md lists where it differs from DESIGN.md.
// Adding a claim is adding rows here (and, if new, a probe kind in drill/probes).

// Selectors.
var (
	FromBoxes = Selector{"every box", func(t *Topology, _ Endpoint) []Endpoint { return boxEnds(t.Boxes, nil) }}
	FromHost  = Selector{"the host", func(*Topology, Endpoint) []Endpoint { return []Endpoint{hostEnd} }}
	// The soak's selectors pick nothing unless the run soaks.
	FromSoakBoxes = Selector{"every box (--soak)", func(t *Topology, _ Endpoint) []Endpoint {
		if t.Soak == 0 {
			return nil
		}
		return boxEnds(t.Boxes, nil)
	}}
	// FromRestarted is the first box, restarted behind claudebox's back (--soak).
	FromRestarted = Selector{"the first box, restarted (--soak)", func(t *Topology, _ Endpoint) []Endpoint {
		if t.Soak == 0 || len(t.Boxes) == 0 {
			return nil
		}
		return boxEnds(t.Boxes[:1], nil)
	}}
	FromSoakHost = Selector{"the host (--soak)", func(t *Topology, _ Endpoint) []Endpoint {
		if t.Soak == 0 {
			return nil
		}
		return []Endpoint{hostEnd}
	}}

	ToSelf = Selector{"the box itself", func(_ *Topology, from Endpoint) []Endpoint { return []Endpoint{from} }}
	// ToSelfLL is the box itself when it has an IPv6 link-local address.
	ToSelfLL = Selector{"the box itself (link-local)", func(_ *Topology, from Endpoint) []Endpoint {
		if from.Box == nil || !from.Box.LL.IsValid() {
			return nil
		}
		return []Endpoint{from}
	}}
	ToBoxes = Selector{"every box", func(t *Topology, _ Endpoint) []Endpoint { return boxEnds(t.Boxes, nil) }}
	// (A nested container's own box is not another box: it is the container's host.)
	ToOtherBoxes = Selector{"every other box", func(t *Topology, from Endpoint) []Endpoint {
		return boxEnds(t.Boxes, func(b *Box) bool { return b.Name != from.Key && b != from.Box })
	}}
	ToOtherBoxesLL = Selector{"every other box with a link-local address", func(t *Topology, from Endpoint) []Endpoint {
		return boxEnds(t.Boxes, func(b *Box) bool { return b.Name != from.Key && b != from.Box && b.LL.IsValid() })
	}}
	ToGateway = Selector{"the gateway", func(t *Topology, _ Endpoint) []Endpoint { return []Endpoint{t.gatewayEnd()} }}
	// The first box and its sibling (the cache row: one pair is enough to show a shared cache).
	FromFirstBox = Selector{"the first box", func(t *Topology, _ Endpoint) []Endpoint {
		if len(t.Boxes) < 2 {
			return nil
		}
		return boxEnds(t.Boxes[:1], nil)
	}}
	FromSecondBox = Selector{"the second box", func(t *Topology, _ Endpoint) []Endpoint {
		if len(t.Boxes) < 2 {
			return nil
		}
		return boxEnds(t.Boxes[1:2], nil)
	}}
	ToSecondBox = Selector{"the second box", func(t *Topology, _ Endpoint) []Endpoint { return boxEnds(t.Boxes[1:2], nil) }}
	ToPublic    = Selector{"the public decoy", func(t *Topology, _ Endpoint) []Endpoint { return []Endpoint{t.publicEnd()} }}
	ToPublicDNS = Selector{"the public name at the gateway", func(t *Topology, _ Endpoint) []Endpoint {
		return []Endpoint{{Key: t.PublicName, Label: "gateway DNS: " + t.PublicName, Name: t.PublicName}}
	}}
	ToHostNames = Selector{"the host's names", func(t *Topology, _ Endpoint) []Endpoint {
		var out []Endpoint
		for _, n := range t.HostNames {
			out = append(out, Endpoint{Key: n, Label: "host name " + n, Name: n})
		}
		return out
	}}
	ToHostAddrs      = Selector{"every host address", hostAddrs(func(netip.Addr, bool) bool { return true })}
	ToGatewayAddr    = Selector{"the gateway address", hostAddrs(func(_ netip.Addr, gw bool) bool { return gw })}
	ToOtherHostAddrs = Selector{"every other host address", hostAddrs(func(_ netip.Addr, gw bool) bool { return !gw })}
	ToDecoysTCP      = Selector{"every decoy, each TCP port", decoys(isAnyDecoy, true)}
	ToDecoys         = Selector{"every decoy", decoys(isAnyDecoy, false)}
	ToLANDecoysTCP   = Selector{"LAN decoys, each TCP port", decoys(isLAN, true)}
	ToLANDecoys      = Selector{"LAN decoys", decoys(isLAN, false)}
	ToCGNATDecoysTCP = Selector{"CGNAT and link-local decoys, each TCP port", decoys(isCGNAT, true)}
	ToCGNATDecoys    = Selector{"CGNAT and link-local decoys", decoys(isCGNAT, false)}
	ToUplinkNetTCP   = Selector{"the decoy on the uplink's own subnet, each TCP port", decoys(isUplinkSubnet, true)}
	ToUplinkNet      = Selector{"the decoy on the uplink's own subnet", decoys(isUplinkSubnet, false)}
	ToOtherNetTCP    = Selector{"the decoy on another local network, each TCP port", decoys(isOtherNet, true)}
	ToOtherNet       = Selector{"the decoy on another local network", decoys(isOtherNet, false)}
	FromDecoy        = Selector{"the decoy's LAN side", func(*Topology, Endpoint) []Endpoint { return []Endpoint{decoyEnd} }}
	ToDecoyHostSide  = Selector{"the host's end of the decoy's LAN side", func(t *Topology, _ Endpoint) []Endpoint {
		return []Endpoint{{Key: "host", Label: "host " + t.DecoyHostSide.String(), Addr: t.DecoyHostSide}}
	}}
	ToBlockedDecoys = Selector{"every blocked decoy and the other network", func(*Topology, Endpoint) []Endpoint {
		return []Endpoint{{Key: "decoys", Label: "every blocked decoy and the other network"}}
	}}
	ToHostAll      = Selector{"every host address", func(*Topology, Endpoint) []Endpoint { return []Endpoint{{Key: "host", Label: "every host address"}} }}
	ToConntrackOut = Selector{"the host's conntrack table (out of boxes)", func(*Topology, Endpoint) []Endpoint {
		return []Endpoint{{Key: "conntrack", Label: "flows from boxes to blocked decoys"}}
	}}
	ToConntrackIn = Selector{"the host's conntrack table (into boxes)", func(*Topology, Endpoint) []Endpoint {
		return []Endpoint{{Key: "conntrack", Label: "flows into boxes from the host or the decoy"}}
	}}
	reapplied      = Control{"ctl/reapply", EndHost, EndGateway}
	dhcpRenew      = Control{"ctl/dhcp-renew", EndSource, EndGateway}
	windowControls = []Control{{"ctl/window-public", EndSource, EndPublic}, reapplied}
	soaked         = Control{"ctl/soak", EndHost, EndGateway}
	restarted      = Control{"ctl/restarted", EndSource, EndSource}
	soakControls   = []Control{{"ctl/soak-public", EndSource, EndPublic}, soaked}
	toHostFlood    = func(_, to Endpoint, t *Topology) probes.Spec {
		return flood(udpTo(t.HostUDP, to.Addr), tcpTo(t.HostTCP, to.Addr))
	}
	toBoxFlood = func(_, to Endpoint, _ *Topology) probes.Spec {
		return flood(udpTo(probes.DefaultUDPPort, to.Box.IPv4), tcpTo(probes.DefaultTCPPort, to.Box.IPv4))
	}
	selfTCP, selfUDP = Control{"ctl/self-tcp", EndTarget, EndTarget}, Control{"ctl/self-udp", EndTarget, EndTarget}
	inetTCP, inetDNS = Control{"internet/tcp", EndSource, EndPublic}, Control{"internet/dns", EndSource, EndPublic}
	hostListener     = func(p string) Control { return Control{"ctl/host-" + p, EndHost, EndTarget} }
	decoyFromHost    = func(p string) Control { return Control{"ctl/decoy-" + p, EndHost, EndTarget} }
	boxBoxLayers     = Holds{{LayerPortIso}, {LayerNFTBridge}, {LayerBRNF}}
	// A sibling's name: dnsmasq must know it through neither Incus (dns.mode) nor the box's
	// own DHCP hostname, or its answer (authoritative: its own data) must not reach the box.
	bothNameLayers = Holds{{LayerDNSModeNone, LayerIgnoreNames}, {LayerLocalAnswers}}
	// A frame from a sibling's MAC fails two ways: it moves the sibling's FDB entry (the port
	// binding drops it before learning; the fdb pin never lets the entry move) or the sibling
	// hears it (the port binding; else port isolation, NIC filtering or the nft bridge table
	// keep it from the sibling's port: measured, the pin alone did not when the first two were
	// off, and the pin with the nft bridge table held it with the other three off).
	macSpoofLayers = Holds{{LayerPortBinding}, {LayerFDBPin, LayerPortIso}, {LayerFDBPin, LayerNICFiltering}, {LayerFDBPin, LayerNFTBridge}}
	defaultSelfTCP = func(from, _ Endpoint, _ *Topology) probes.Spec { return tcp(from.Box.IPv4, probes.DefaultTCPPort) }
	defaultSelfUDP = func(from, _ Endpoint, _ *Topology) probes.Spec { return udp(from.Box.IPv4, probes.DefaultUDPPort) }
	toAddrTCP      = func(_, to Endpoint, _ *Topology) probes.Spec { return tcp(to.Addr, to.Port) }
	// A sibling's address as the source (replies go to the public decoy).
	spoofSiblingIP = func(_, to Endpoint, t *Topology) probes.Spec { return spoofUDP(to.Box.IPv4, t.Public) }
	// A release of the sibling's lease (its chaddr and address) sent to the gateway.
	releaseSibling = func(_, to Endpoint, t *Topology) probes.Spec {
		return dhcpSpec(probes.KindDHCPRelease, t.Gateway.Addr(), &probes.DHCPSpec{VictimIP: to.Box.IPv4.String(), VictimMAC: to.Box.MAC})
	}
	toAddrICMP   = func(_, to Endpoint, _ *Topology) probes.Spec { return icmp(to.Addr) }
	toDecoyUDP   = func(_, to Endpoint, _ *Topology) probes.Spec { return udp(to.Addr, DecoyUDP) }
	toBoxTCP     = func(_, to Endpoint, _ *Topology) probes.Spec { return tcp(to.Box.IPv4, probes.DefaultTCPPort) }
	toBoxUDP     = func(_, to Endpoint, _ *Topology) probes.Spec { return udp(to.Box.IPv4, probes.DefaultUDPPort) }
	toHostTCP    = func(_, to Endpoint, t *Topology) probes.Spec { return tcp(to.Addr, t.HostTCP) }
	toHostUDP    = func(_, to Endpoint, t *Topology) probes.Spec { return udp(to.Addr, t.HostUDP) }
	askCacheName = func(_, _ Endpoint, t *Topology) probes.Spec {
		return dnsq(t.Gateway.Addr(), CacheName(t.PublicName, t.Round), "A")
	}
	askGateway = func(name func(to Endpoint, t *Topology) string, typ string) func(_, to Endpoint, t *Topology) probes.Spec {
		return func(_, to Endpoint, t *Topology) probes.Spec { return dnsq(t.Gateway.Addr(), name(to, t), typ) }
	}
)

// Claims is the contract. Controls come first only for reading; Plan resolves references
// in any order.
var Claims = withNested(append([]ClaimRow{
	// Positive controls: each box reaches its own listeners and the gateway's ARP, holds a
	// lease; the host reaches its own listeners and every decoy.
	{Key: "ctl/self-tcp", Claim: ClaimControl, Kind: "self", ID: "ctl/{from}/self-tcp", From: FromBoxes, To: ToSelf, Probe: defaultSelfTCP, Expect: Open},
	{Key: "ctl/self-udp", Claim: ClaimControl, Kind: "self", ID: "ctl/{from}/self-udp", From: FromBoxes, To: ToSelf, Probe: defaultSelfUDP, Expect: Open},
	{Key: "ctl/self-tcp6ll", Claim: ClaimControl, Kind: "self", ID: "ctl/{from}/self-tcp6ll", From: FromBoxes, To: ToSelfLL, Expect: Open,
		Probe: func(from, _ Endpoint, _ *Topology) probes.Spec { return tcp6ll(from.Box.LL) }},
	{Key: "ctl/arp-gateway", Claim: ClaimControl, Kind: "arp", ID: "ctl/{from}/arp-gateway", From: FromBoxes, To: ToGateway, Expect: Open,
		Probe: func(_, to Endpoint, _ *Topology) probes.Spec { return arp(to.Addr) }},
	{Key: "ctl/lease", Claim: ClaimControl, Kind: "lease", ID: "ctl/{from}/lease", From: FromBoxes, To: ToSelf, Expect: Lease, Probe: facts},
	{Key: "ctl/host-tcp", Claim: ClaimControl, Kind: "host-listener", ID: "ctl/host>{to}/tcp", From: FromHost, To: ToHostAddrs, Probe: toHostTCP, Expect: Open},
	{Key: "ctl/host-udp", Claim: ClaimControl, Kind: "host-listener", ID: "ctl/host>{to}/udp", From: FromHost, To: ToHostAddrs, Probe: toHostUDP, Expect: Open},
	{Key: "ctl/decoy-tcp", Claim: ClaimControl, Kind: "decoy", ID: "ctl/host>{to}/tcp{port}", From: FromHost, To: ToDecoysTCP, Probe: toAddrTCP, Expect: Open},
	{Key: "ctl/decoy-udp", Claim: ClaimControl, Kind: "decoy", ID: "ctl/host>{to}/udp", From: FromHost, To: ToDecoys, Probe: toDecoyUDP, Expect: Open},
	{Key: "ctl/decoy-icmp", Claim: ClaimControl, Kind: "decoy", ID: "ctl/host>{to}/icmp", From: FromHost, To: ToDecoys, Probe: toAddrICMP, Expect: Open},

	// The internet: the only thing a box reaches (it is also the control of most claims).
	{Key: "internet/tcp", Claim: ClaimInternet, Kind: "tcp", ID: "internet/{from}/tcp", From: FromBoxes, To: ToPublic, Probe: toAddrTCP, Expect: Open},
	{Key: "internet/dns", Claim: ClaimInternet, Kind: "dns", ID: "internet/{from}/dns", From: FromBoxes, To: ToPublicDNS, Expect: Answer,
		Probe: askGateway(func(to Endpoint, _ *Topology) string { return to.Name }, "A")},

	// Box→box over IPv4: port isolation, the nft bridge drop (subnet mode covers IPv4+ARP),
	// and the ACL/guard forward chain while br_netfilter hands bridged frames to inet.
	{Key: "box-box/tcp", Claim: ClaimBoxBox, Kind: "tcp", ID: "box-box/{from}>{to}/tcp", From: FromBoxes, To: ToOtherBoxes, Probe: toBoxTCP,
		Expect: Dropped, Controls: []Control{selfTCP, inetTCP}, Holds: boxBoxLayers},
	{Key: "box-box/udp", Claim: ClaimBoxBox, Kind: "udp", ID: "box-box/{from}>{to}/udp", From: FromBoxes, To: ToOtherBoxes, Probe: toBoxUDP,
		Expect: Dropped, Controls: []Control{selfUDP, inetTCP}, Holds: boxBoxLayers},
	{Key: "box-box/icmp", Claim: ClaimBoxBox, Kind: "icmp", ID: "box-box/{from}>{to}/icmp", From: FromBoxes, To: ToOtherBoxes, Expect: Dropped,
		Probe: func(_, to Endpoint, _ *Topology) probes.Spec { return icmp(to.Box.IPv4) }, Controls: []Control{selfTCP, inetTCP}, Holds: boxBoxLayers},
	{Key: "box-box-l2/arp", Claim: ClaimBoxBoxL2, Kind: "arp", ID: "box-box-l2/{from}>{to}/arp", From: FromBoxes, To: ToOtherBoxes, Expect: Dropped,
		Probe:    func(_, to Endpoint, _ *Topology) probes.Spec { return arp(to.Box.IPv4) },
		Controls: []Control{{"ctl/arp-gateway", EndSource, EndGateway}}, Holds: any1(LayerPortIso, LayerNFTBridge)},
	// IPv6 link-local: the nft fallback (subnet mode) does not see IPv6; br_netfilter's
	// ip6tables hook hands it to the guard forward chain.
	{Key: "box-box-l2/tcp6ll", Claim: ClaimBoxBoxL2, Kind: "tcp6ll", ID: "box-box-l2/{from}>{to}/tcp6ll", From: FromBoxes, To: ToOtherBoxesLL, Expect: Dropped,
		Probe:    func(_, to Endpoint, _ *Topology) probes.Spec { return tcp6ll(to.Box.LL) },
		Controls: []Control{{"ctl/self-tcp6ll", EndTarget, EndTarget}}, Holds: any1(LayerPortIso, LayerBRNF, LayerNICFiltering, LayerPortBinding)},

	// Box→box by name. Measured: dns.mode=managed registers the instance name (unqualified,
	// .<domain>, PTR); without dhcp-ignore-names dnsmasq registers the DHCP hostname
	// (unqualified and PTR; the qualified form needs the domain only dns.mode gives). The
	// scratch agent sends the instance name as its DHCP hostname, so the unqualified rows
	// need both options. dnsmasq marks every answer from its own data authoritative, and
	// the local-answers part drops those on their way to a box: the second layer of every
	// name row (silence, then, is the verdict: the resolver's control answers meanwhile).
	// Over TCP the part refuses the connection (a stream cannot be read for headers).
	nameRow("dns-instance", func(to Endpoint, _ *Topology) string { return to.Box.Name }, "A", false, bothNameLayers),
	nameRow("dns-instance-tcp", func(to Endpoint, _ *Topology) string { return to.Box.Name }, "A", true, bothNameLayers),
	nameRow("dns-hostname", func(to Endpoint, _ *Topology) string { return to.Box.Hostname }, "A", false, bothNameLayers),
	nameRow("dns-hostname-fqdn", func(to Endpoint, t *Topology) string { return to.Box.Hostname + "." + t.Domain }, "A", false, any1(LayerDNSModeNone, LayerLocalAnswers)),
	nameRow("dns-ptr", func(to Endpoint, _ *Topology) string { return to.Box.IPv4.String() }, "PTR", false, bothNameLayers),
	// Whether the name exists at all (found by the attacker): dnsmasq answers AAAA of a name
	// it holds NOERROR without records and without AA, which the local-answers part cannot
	// tell from a forwarded answer; a name it does not hold is NXDOMAIN. Only the dnsmasq
	// options hide existence (no filter that drops can: silence differs from NXDOMAIN too).
	{Key: "box-box-name/dns-exists", Claim: ClaimBoxBoxName, Kind: "dns-exists", ID: "box-box-name/{from}>{to}/dns-exists",
		From: FromBoxes, To: ToOtherBoxes, Expect: NoSuchName, Controls: []Control{inetDNS},
		Holds: Holds{{LayerDNSModeNone, LayerIgnoreNames}},
		Probe: askGateway(func(to Endpoint, _ *Topology) string { return to.Box.Name }, "AAAA")},
	{Key: "host-names/dns", Claim: ClaimHostNames, Kind: "dns", ID: "host-names/{from}/{to}", From: FromBoxes, To: ToHostNames, Expect: NoAnswer,
		Probe:    askGateway(func(to Endpoint, _ *Topology) string { return to.Name }, "A"),
		Controls: []Control{inetDNS}, Holds: any1(LayerNoHosts, LayerLocalAnswers)},
	{Key: "host-names/dns-tcp", Claim: ClaimHostNames, Kind: "dns-tcp", ID: "host-names/{from}/{to}/tcp", From: FromBoxes, To: ToHostNames, Expect: NoAnswer,
		Probe: func(_, to Endpoint, t *Topology) probes.Spec {
			return dnsOver(dnsq(t.Gateway.Addr(), to.Name, "A"), true)
		},
		Controls: []Control{inetDNS}, Holds: any1(LayerNoHosts, LayerLocalAnswers)},

	// Box→host: the gateway (guard and ACL) and the host's other addresses (guard).
	{Key: "box-host/gateway-tcp", Claim: ClaimBoxHost, Kind: "gateway", ID: "box-host/{from}>{to}/tcp", From: FromBoxes, To: ToGatewayAddr, Probe: toHostTCP,
		Expect: Dropped, Controls: []Control{hostListener("tcp"), inetDNS}, Holds: any1(LayerHostGuard, LayerACL, LayerWall)},
	{Key: "box-host/gateway-udp", Claim: ClaimBoxHost, Kind: "gateway", ID: "box-host/{from}>{to}/udp", From: FromBoxes, To: ToGatewayAddr, Probe: toHostUDP,
		Expect: Dropped, Controls: []Control{hostListener("udp"), inetDNS}, Holds: any1(LayerHostGuard, LayerACL, LayerWall)},
	{Key: "box-host/addr-tcp", Claim: ClaimBoxHost, Kind: "host-addr", ID: "box-host/{from}>{to}/tcp", From: FromBoxes, To: ToOtherHostAddrs, Probe: toHostTCP,
		Expect: Dropped, Controls: []Control{hostListener("tcp"), inetDNS}, Holds: any1(LayerHostGuard, LayerWall, LayerL2Ranges)},
	{Key: "box-host/addr-udp", Claim: ClaimBoxHost, Kind: "host-addr", ID: "box-host/{from}>{to}/udp", From: FromBoxes, To: ToOtherHostAddrs, Probe: toHostUDP,
		Expect: Dropped, Controls: []Control{hostListener("udp"), inetDNS}, Holds: any1(LayerHostGuard, LayerWall, LayerL2Ranges)},

	// Box→LAN, CGNAT and link-local decoys (169.254.169.254:80 included).
	decoyRow(ClaimLAN, "lan", "tcp", ToLANDecoysTCP),
	decoyRow(ClaimLAN, "lan", "udp", ToLANDecoys),
	decoyRow(ClaimLAN, "lan", "icmp", ToLANDecoys),
	decoyRow(ClaimCGNAT, "cgnat", "tcp", ToCGNATDecoysTCP),
	decoyRow(ClaimCGNAT, "cgnat", "udp", ToCGNATDecoys),
	decoyRow(ClaimCGNAT, "cgnat", "icmp", ToCGNATDecoys),
	// Other local networks: an address outside every blocked range, behind an interface
	// that is not the uplink (another bridge, a VPN, a LAN route).
	otherNetRow("tcp", ToOtherNetTCP),
	otherNetRow("udp", ToOtherNet),
	otherNetRow("icmp", ToOtherNet),
	// The uplink's own subnet: the host's LAN neighbours, reached by the uplink itself.
	uplinkNetRow("tcp", ToUplinkNetTCP),
	uplinkNetRow("udp", ToUplinkNet),
	uplinkNetRow("icmp", ToUplinkNet),

	// IPv6: no global/ULA address, no v6 default route. The host input guard drops the
	// boxes' router solicitations, which delays SLAAC until dnsmasq's next advertisement,
	// but does not stop it (measured both ways): not a layer.
	{Key: "ipv6/facts", Claim: ClaimIPv6, Kind: "facts", ID: "ipv6/{from}", From: FromBoxes, To: ToSelf, Probe: facts, Expect: None,
		Controls: []Control{{"ctl/lease", EndSource, EndSource}}, Holds: any1(LayerIPv6Off, LayerWall)},

	// Every second, not only a quiet one: while the lab makes Incus re-apply the network's
	// firewall (Incus deletes its chains, NAT and ACL included, for about a second), every
	// box floods every blocked decoy, the host and its siblings, and the host and the LAN
	// side of the decoy flood into the boxes. Nothing may get through, and no flow may be
	// left in conntrack. The ACL is absent in the window by definition: it is no layer here.
	{Key: "ctl/reapply", Claim: ClaimControl, Kind: "reapply", ID: "ctl/reapply", From: FromHost, To: ToGateway, Expect: Open,
		Probe: lab(KindLabReapply), Window: WindowReapply},
	{Key: "ctl/window-public", Claim: ClaimControl, Kind: "flood", ID: "ctl/{from}/window-public", From: FromBoxes, To: ToPublic, Expect: Open,
		Probe: func(_, to Endpoint, _ *Topology) probes.Spec {
			return flood(udpTo(DecoyUDP, to.Addr), tcpTo(DecoyTCP, to.Addr))
		}, Window: WindowReapply},
	{Key: "ctl/window-decoy", Claim: ClaimControl, Kind: "flood", ID: "ctl/decoy>{to}/window", From: FromDecoy, To: ToDecoyHostSide, Expect: Open,
		Probe: toHostFlood, Window: WindowReapply},
	{Key: "window/decoys", Claim: ClaimWindow, Kind: "flood", ID: "window/{from}>decoys", From: FromBoxes, To: ToBlockedDecoys, Expect: Dropped,
		Probe:    func(_, _ Endpoint, t *Topology) probes.Spec { return flood(blockedDecoyTargets(t)) },
		Controls: windowControls, Holds: any1(LayerWall, LayerL2Ranges), Window: WindowReapply},
	{Key: "window/host", Claim: ClaimWindow, Kind: "flood", ID: "window/{from}>host", From: FromBoxes, To: ToHostAll, Expect: Dropped,
		Probe:    func(_, _ Endpoint, t *Topology) probes.Spec { return flood(hostTargets(t)) },
		Controls: windowControls, Holds: any1(LayerHostGuard, LayerWall), Window: WindowReapply},
	{Key: "window/box", Claim: ClaimWindow, Kind: "flood", ID: "window/{from}>{to}", From: FromBoxes, To: ToOtherBoxes, Expect: Dropped,
		Probe: toBoxFlood, Controls: append([]Control{selfUDP}, windowControls...), Holds: boxBoxLayers, Window: WindowReapply},
	{Key: "window/host-box", Claim: ClaimWindow, Kind: "flood", ID: "window/host>{to}", From: FromHost, To: ToBoxes, Expect: Dropped,
		Probe: toBoxFlood, Controls: []Control{selfUDP, reapplied}, Holds: any1(LayerWall, LayerHostGuard, LayerL2Ranges), Window: WindowReapply},
	{Key: "window/decoy-box", Claim: ClaimWindow, Kind: "flood", ID: "window/decoy>{to}", From: FromDecoy, To: ToBoxes, Expect: Dropped,
		Probe: toBoxFlood, Controls: []Control{selfUDP, reapplied, {"ctl/window-decoy", EndSource, EndHost}}, Holds: any1(LayerWall, LayerHostGuard, LayerL2Ranges), Window: WindowReapply},
	// Flows out of a box are dropped before conntrack by either layer (the L2 input hook runs
	// before the IP stack); flows into a box are confirmed before the bridge's output hook
	// drops their packets, so the wall and the guard keep them out of the table.
	{Key: "window/conntrack-out", Claim: ClaimWindow, Kind: "conntrack", ID: "window/conntrack-out", From: FromHost, To: ToConntrackOut, Expect: Dropped,
		Probe: lab(KindLabConntrackOut), Controls: []Control{reapplied}, Holds: any1(LayerWall, LayerL2Ranges), Window: WindowReapply},
	{Key: "window/conntrack-in", Claim: ClaimWindow, Kind: "conntrack", ID: "window/conntrack-in", From: FromHost, To: ToConntrackIn, Expect: Dropped,
		Probe: lab(KindLabConntrackIn), Controls: []Control{reapplied}, Holds: any1(LayerWall, LayerHostGuard), Window: WindowReapply},

	// The soak (--soak N): the window N times over, then an incusd restart and a host init
	// drift repair (the ACL detached, then converged back), under one flood from every box
	// that lasts the whole sequence. The floods run detached in the boxes: a restart ends
	// every exec session, not the boxes.
	{Key: "ctl/soak", Claim: ClaimControl, Kind: "soak", ID: "ctl/soak", From: FromSoakHost, To: ToGateway, Expect: Open,
		Probe: lab(KindLabSoak), Window: WindowSoak},
	{Key: "ctl/soak-public", Claim: ClaimControl, Kind: "flood", ID: "ctl/{from}/soak-public", From: FromSoakBoxes, To: ToPublic, Expect: Open,
		Probe: func(_, to Endpoint, _ *Topology) probes.Spec {
			return soakFlood(udpTo(DecoyUDP, to.Addr), tcpTo(DecoyTCP, to.Addr))
		}, Window: WindowSoak},
	{Key: "soak/decoys", Claim: ClaimSoak, Kind: "flood", ID: "soak/{from}>decoys", From: FromSoakBoxes, To: ToBlockedDecoys, Expect: Dropped,
		Probe:    func(_, _ Endpoint, t *Topology) probes.Spec { return soakFlood(blockedDecoyTargets(t)) },
		Controls: soakControls, Holds: any1(LayerWall, LayerL2Ranges), Window: WindowSoak},
	{Key: "soak/host", Claim: ClaimSoak, Kind: "flood", ID: "soak/{from}>host", From: FromSoakBoxes, To: ToHostAll, Expect: Dropped,
		Probe:    func(_, _ Endpoint, t *Topology) probes.Spec { return soakFlood(hostTargets(t)) },
		Controls: soakControls, Holds: any1(LayerHostGuard, LayerWall), Window: WindowSoak},
	{Key: "soak/conntrack-out", Claim: ClaimSoak, Kind: "conntrack", ID: "soak/conntrack-out", From: FromSoakHost, To: ToConntrackOut, Expect: Dropped,
		Probe: lab(KindLabConntrackOut), Controls: []Control{soaked}, Holds: any1(LayerWall, LayerL2Ranges), Window: WindowSoak},

	// A frame for a MAC the bridge has no entry for (a box stopped or restarting) is flooded
	// to every port: no box may hear one (found by the attacker). The host sends it onto the
	// bridge; the boxes' captures are the evidence.
	{Key: "frames/unknown-unicast", Claim: ClaimFrames, Kind: "frame", ID: "frames/host>{to}/unknown-unicast", From: FromHost, To: ToBoxes,
		Expect: Dropped, Window: WindowSpoof, Controls: []Control{{"ctl/self-udp", EndTarget, EndTarget}}, Holds: any1(LayerL2Ranges, LayerFDBPin),
		Probe: func(_, _ Endpoint, t *Topology) probes.Spec {
			return probes.Spec{Kind: probes.KindFrame, Iface: t.Bridge, Timeout: 500 * time.Millisecond,
				Frame: &probes.FrameSpec{Variant: probes.FrameEthertype, DstMAC: "02:cb:dd:00:00:01"}}
		}},

	// A box restarted behind claudebox's back — as `reboot` inside it does: Incus gives it a
	// new veth — must not come back on a port no rule names. Before anything binds it again,
	// it tries a sibling's address, a sibling's lease and the sibling's lease record.
	{Key: "ctl/restarted", Claim: ClaimControl, Kind: "restart", ID: "ctl/{from}/restarted", From: FromRestarted, To: ToSelf, Expect: Open,
		Probe: lab(KindLabRestarted), Window: WindowRestart},
	{Key: "restart/sibling-ip", Claim: ClaimSpoof, Kind: "spoof-udp", ID: "restart/{from}>{to}/sibling-ip", From: FromRestarted, To: ToOtherBoxes,
		Expect: Dropped, Window: WindowRestart, Controls: []Control{restarted, inetTCP}, Holds: any1(LayerNICFiltering, LayerPortBinding),
		Probe: spoofSiblingIP},
	{Key: "restart/release", Claim: ClaimSpoof, Kind: "dhcp-release", ID: "restart/{from}>{to}/release", From: FromRestarted, To: ToOtherBoxes, Expect: NoLease,
		Window: WindowRestart, Controls: []Control{restarted, dhcpRenew}, Holds: any1(LayerNICFiltering, LayerDHCPKnownOnly, LayerPortBinding, LayerL2Ranges),
		Probe: releaseSibling},
	{Key: "restart/release-intact", Claim: ClaimSpoof, Kind: "lease", ID: "restart/{from}>{to}/lease-intact", From: FromRestarted, To: ToOtherBoxes,
		Expect: Dropped, Window: WindowRestart, Controls: []Control{restarted, {"ctl/dhcp-renew", EndTarget, EndGateway}}, Holds: any1(LayerPortBinding, LayerL2Ranges),
		Probe: lab(KindLabLeaseIntact)},

	// No spoofing: a box sends only from its own MAC and address, answers ARP only for its own
	// address, and can neither release, steal nor invent a lease. The other end is the
	// evidence: the decoy or the sibling heard the marker, the host's neighbour entry or the
	// bridge's FDB moved, a lease came back. These run in a phase of their own: a successful
	// spoof disturbs the victim's traffic.
	{Key: "spoof/sibling-ip", Claim: ClaimSpoof, Kind: "spoof-udp", ID: "spoof/{from}>{to}/sibling-ip", From: FromBoxes, To: ToOtherBoxes,
		Expect: Dropped, Window: WindowSpoof, Controls: []Control{inetTCP, selfUDP}, Holds: any1(LayerNICFiltering, LayerPortBinding),
		Probe: spoofSiblingIP},
	{Key: "spoof/any-ip", Claim: ClaimSpoof, Kind: "spoof-udp", ID: "spoof/{from}/any-ip", From: FromBoxes, To: ToPublic,
		Expect: Dropped, Window: WindowSpoof, Controls: []Control{inetTCP}, Holds: any1(LayerNICFiltering, LayerWall, LayerPortBinding),
		// The forged source is an address nobody owns: the public decoy's answer to it is
		// blackholed inside the decoy namespace, never sent to a real network.
		Probe: func(_, to Endpoint, t *Topology) probes.Spec { return spoofUDP(t.Forged, to.Addr) }},
	{Key: "spoof/arp", Claim: ClaimSpoof, Kind: "arp-spoof", ID: "spoof/{from}>{to}/arp", From: FromBoxes, To: ToOtherBoxes,
		Expect: Dropped, Window: WindowSpoof, Controls: []Control{{"ctl/arp-gateway", EndSource, EndGateway}, selfUDP}, Holds: any1(LayerNICFiltering, LayerPortBinding),
		Probe: func(_, to Endpoint, t *Topology) probes.Spec {
			return probes.Spec{Kind: probes.KindARPSpoof, Target: t.Gateway.Addr().String(), Spoof: &probes.SpoofSpec{VictimIP: to.Box.IPv4.String()}}
		}},
	{Key: "spoof/mac", Claim: ClaimSpoof, Kind: "mac-spoof", ID: "spoof/{from}>{to}/mac", From: FromBoxes, To: ToOtherBoxes,
		Expect: Dropped, Window: WindowSpoof, Controls: []Control{{"ctl/arp-gateway", EndSource, EndGateway}, selfUDP}, Holds: macSpoofLayers,
		Probe: func(_, to Endpoint, _ *Topology) probes.Spec {
			return probes.Spec{Kind: probes.KindMACSpoof, Timeout: time.Second, Spoof: &probes.SpoofSpec{VictimMAC: to.Box.MAC, VictimIP: to.Box.IPv4.String()}}
		}},
	{Key: "ctl/dhcp-renew", Claim: ClaimControl, Kind: "dhcp", ID: "ctl/{from}/dhcp-renew", From: FromBoxes, To: ToGateway, Expect: Lease, Window: WindowDHCP,
		Probe: func(from, to Endpoint, _ *Topology) probes.Spec {
			return dhcpSpec(probes.KindDHCPSteal, to.Addr, &probes.DHCPSpec{VictimIP: from.Box.IPv4.String(), AskMAC: from.Box.MAC})
		}},
	{Key: "dhcp/fake-mac", Claim: ClaimSpoof, Kind: "dhcp-fake-mac", ID: "dhcp/{from}/fake-mac", From: FromBoxes, To: ToGateway, Expect: NoLease,
		Window: WindowDHCP, Controls: []Control{dhcpRenew}, Holds: any1(LayerNICFiltering, LayerDHCPKnownOnly, LayerPortBinding, LayerL2Ranges),
		Probe: func(_, to Endpoint, _ *Topology) probes.Spec {
			return dhcpSpec(probes.KindDHCPFakeMAC, to.Addr, &probes.DHCPSpec{})
		}},
	// The same client invented in the DHCP payload only, from the box's own MAC: NIC
	// filtering (which checks the frame's source) lets it through.
	{Key: "dhcp/fake-chaddr", Claim: ClaimSpoof, Kind: "dhcp-fake-mac", ID: "dhcp/{from}/fake-chaddr", From: FromBoxes, To: ToGateway, Expect: NoLease,
		Window: WindowDHCP, Controls: []Control{dhcpRenew}, Holds: any1(LayerDHCPKnownOnly, LayerPortBinding, LayerL2Ranges),
		Probe: func(_, to Endpoint, _ *Topology) probes.Spec {
			return dhcpSpec(probes.KindDHCPFakeMAC, to.Addr, &probes.DHCPSpec{OwnFrame: true})
		}},
	// (Asking for a sibling's address without releasing it first is refused by dnsmasq
	// itself while the sibling holds the lease, "address in use": no layer of ours to
	// measure. The release row frees the lease first.)
	{Key: "dhcp/release", Claim: ClaimSpoof, Kind: "dhcp-release", ID: "dhcp/{from}>{to}/release", From: FromBoxes, To: ToOtherBoxes, Expect: NoLease,
		Window: WindowDHCP, Controls: []Control{dhcpRenew}, Holds: any1(LayerNICFiltering, LayerDHCPKnownOnly, LayerPortBinding, LayerL2Ranges),
		Probe: releaseSibling},
	// A box posing as a DHCP relay (giaddr a sibling's address): dnsmasq answers at
	// giaddr:67, echoing option 82 — a path from box to box through the gateway with every
	// box→box layer on (found by the attacker). The sibling's capture hearing the marker is
	// the evidence.
	{Key: "dhcp/relay", Claim: ClaimSpoof, Kind: "dhcp-relay", ID: "dhcp/{from}>{to}/relay", From: FromBoxes, To: ToOtherBoxes, Expect: Dropped,
		Window: WindowDHCP, Controls: []Control{dhcpRenew}, Holds: any1(LayerPortBinding, LayerL2Ranges, LayerHostGuard, LayerWall),
		Probe: func(_, to Endpoint, t *Topology) probes.Spec {
			return dhcpSpec(probes.KindDHCPRelay, t.Gateway.Addr(), &probes.DHCPSpec{VictimIP: to.Box.IPv4.String()})
		}},
	// The release itself: dnsmasq keys leases by chaddr, so a release naming the sibling's
	// MAC frees its lease record. Harmless while the reservation holds the address for it
	// (it renews the same address), but only the port binding keeps the record intact.
	{Key: "dhcp/release-intact", Claim: ClaimSpoof, Kind: "lease", ID: "dhcp/{from}>{to}/lease-intact", From: FromBoxes, To: ToOtherBoxes,
		Expect: Dropped, Window: WindowLeases, Controls: []Control{{"ctl/dhcp-renew", EndTarget, EndGateway}}, Holds: any1(LayerPortBinding, LayerL2Ranges),
		Probe: lab(KindLabLeaseIntact)},

	// The link-local group path: a frame to 01:80:c2:00:00:0X is not bridged, the kernel hands
	// it to the IP stack on the sender's own port, around every rule that names the bridge.
	// The host must hear nothing, and a sibling's address must not get a host service's reply.
	linkLocalRow("0e", "01:80:c2:00:00:0e", ToHostAddrs, any1(LayerWall, LayerPortRPFilter)),
	linkLocalRow("03-gw", "01:80:c2:00:00:03", ToGatewayAddr, any1(LayerWall, LayerPortRPFilter)),
	// :03 (unlike :0e) still passes the bridge's input hook, where the L2 ranges drop the
	// host's addresses outside the gateway.
	linkLocalRow("03", "01:80:c2:00:00:03", ToOtherHostAddrs, any1(LayerWall, LayerPortRPFilter, LayerL2Ranges)),
	{Key: "spoof/ll-reflect", Claim: ClaimSpoof, Kind: "frame", ID: "spoof/{from}>{to}/ll-reflect", From: FromBoxes, To: ToOtherBoxes,
		Expect: Dropped, Window: WindowSpoof, Controls: []Control{{"ctl/arp-gateway", EndSource, EndGateway}, selfUDP},
		Holds: any1(LayerWall, LayerPortRPFilter),
		Probe: func(_, to Endpoint, t *Topology) probes.Spec {
			return probes.Spec{Kind: probes.KindFrame, Frame: &probes.FrameSpec{Variant: probes.FrameLinkLocalUDP,
				DstMAC: "01:80:c2:00:00:0e", SrcIP: to.Box.IPv4.String(), TargetIP: t.reflector().String(), Port: t.HostUDP}}
		}},

	// Odd frames to a sibling: priority-tagged (VLAN 0) IPv4, IPv6, DHCP offer and router
	// advertisement, a raw ethertype, ARP from 0.0.0.0. The sibling's capture is the evidence.
	frameRow(probes.FrameVLAN0IPv4), frameRow(probes.FrameVLAN0IPv6), frameRow(probes.FrameVLAN0DHCPOffer),
	frameRow(probes.FrameVLAN0RA), frameRow(probes.FrameEthertype), frameRow(probes.FrameARPZero),

	// The resolver says nothing about itself (its upstreams and their query counters, which
	// would let one box watch another's DNS activity, or its version).
	chaosRow("servers.bind", false), chaosRow("version.bind", false), chaosRow("servers.bind", true),

	// Nor about what the boxes ask it (found by the attacker): a name the sibling has just
	// asked reaches the first box from upstream with its TTL whole. With dnsmasq's shared
	// cache it came counted down, with no upstream query: the box saw the sibling's lookup.
	{Key: "ctl/cache-prime", Claim: ClaimControl, Kind: "dns", ID: "ctl/{from}/cache-prime", From: FromSecondBox, To: ToPublicDNS,
		Expect: Answer, Window: WindowCache, Probe: askCacheName},
	{Key: "resolver/cache", Claim: ClaimResolver, Kind: "dns-cache", ID: "resolver/{from}/cache-after-{to}", From: FromFirstBox, To: ToSecondBox,
		Expect: Fresh, Window: WindowCache, Probe: askCacheName,
		Controls: []Control{{"ctl/cache-prime", EndTarget, EndTarget}}, Holds: any1(LayerNoCache)},

	// Host→box: the ACL's default ingress drop, the wall's and the guard's "no new flow into a box".
	{Key: "host-box/tcp", Claim: ClaimHostBox, Kind: "tcp", ID: "host-box/host>{to}/tcp", From: FromHost, To: ToBoxes, Probe: toBoxTCP,
		Expect: Dropped, Controls: []Control{selfTCP}, Holds: any1(LayerACL, LayerWall, LayerHostGuard, LayerL2Ranges)},
	{Key: "host-box/udp", Claim: ClaimHostBox, Kind: "udp", ID: "host-box/host>{to}/udp", From: FromHost, To: ToBoxes, Probe: toBoxUDP,
		Expect: Dropped, Controls: []Control{selfUDP}, Holds: any1(LayerACL, LayerWall, LayerHostGuard, LayerL2Ranges)},
}, slices.Concat(exposureClaims, resourceClaims, clusterRows, memberBoxRows, natRows)...))

func nameRow(kind string, name func(Endpoint, *Topology) string, typ string, tcp bool, h Holds) ClaimRow {
	ask := askGateway(name, typ)
	return ClaimRow{Key: "box-box-name/" + kind, Claim: ClaimBoxBoxName, Kind: kind, ID: "box-box-name/{from}>{to}/" + kind,
		From: FromBoxes, To: ToOtherBoxes, Expect: NoAnswer, Controls: []Control{inetDNS}, Holds: h,
		Probe: func(from, to Endpoint, t *Topology) probes.Spec { return dnsOver(ask(from, to, t), tcp) }}
}

// dnsOver sets a DNS probe's transport (TCP when tcp).
func dnsOver(s probes.Spec, tcp bool) probes.Spec {
	s.DNS.TCP = tcp
	return s
}

// decoyRow is box→decoy for one protocol; its control is the host reaching the same decoy
// (and port) the same way.
func decoyRow(claim, key, proto string, to Selector) ClaimRow {
	r := ClaimRow{Key: key + "/" + proto, Claim: claim, Kind: proto, ID: "decoy/{from}>{to}/" + proto, From: FromBoxes, To: to,
		Expect: Dropped, Controls: []Control{decoyFromHost(proto)}, Holds: any1(LayerACL, LayerWall, LayerL2Ranges)}
	switch proto {
	case "tcp":
		r.ID += "{port}"
		r.Probe = toAddrTCP
	case "udp":
		r.Probe = toDecoyUDP
	default:
		r.Probe = toAddrICMP
	}
	return r
}

func linkLocalRow(tag, mac string, to Selector, h Holds) ClaimRow {
	return ClaimRow{Key: "box-host/ll" + tag, Claim: ClaimBoxHost, Kind: "link-local", ID: "box-host/{from}>{to}/ll" + tag, From: FromBoxes, To: to,
		Expect: Dropped, Controls: []Control{hostListener("udp"), {"ctl/arp-gateway", EndSource, EndGateway}},
		Holds: h,
		Probe: func(_, to Endpoint, t *Topology) probes.Spec {
			return probes.Spec{Kind: probes.KindFrame, Frame: &probes.FrameSpec{Variant: probes.FrameLinkLocalUDP,
				DstMAC: mac, TargetIP: to.Addr.String(), Port: t.HostUDP}}
		}}
}

// reflector is the host address a reflection aims at: one that is not the gateway when the
// host has one (the L2 rules drop the gateway's answers anyway), else the gateway.
func (t *Topology) reflector() netip.Addr {
	for _, h := range t.HostAddrs {
		if h != t.Gateway.Addr() {
			return h
		}
	}
	return t.Gateway.Addr()
}

func frameRow(variant string) ClaimRow {
	return ClaimRow{Key: "frames/" + variant, Claim: ClaimFrames, Kind: "frame", ID: "frames/{from}>{to}/" + variant, From: FromBoxes, To: ToOtherBoxes,
		Expect: Dropped, Window: WindowSpoof, Controls: []Control{{"ctl/arp-gateway", EndSource, EndGateway}, selfUDP},
		Holds: frameLayers(variant, LayerPortIso),
		Probe: func(_, to Endpoint, _ *Topology) probes.Spec {
			return probes.Spec{Kind: probes.KindFrame, Frame: &probes.FrameSpec{Variant: variant, DstMAC: to.Box.MAC, TargetIP: to.Box.IPv4.String()}}
		}}
}

// frameLayers hold an odd frame leaving a box: first (port isolation between two boxes; the
// bridges being apart toward another member's box), Incus's NIC filtering and the nft bridge
// table (nothing is switched from a box port to another port), and claudebox's port binding
// for every variant but arp-zero: its ARP probe from 0.0.0.0 with the box's own MAC is what
// a DHCP client sends, and the binding lets it through (a seeded hole leaving only the port
// binding on turned the arp-zero rows red, and no other frame row).
func frameLayers(variant string, first Layer) Holds {
	if variant == probes.FrameARPZero {
		return any1(first, LayerNICFiltering, LayerNFTBridge)
	}
	return any1(first, LayerNICFiltering, LayerPortBinding, LayerNFTBridge)
}

func chaosRow(name string, tcp bool) ClaimRow {
	key, kind := name, "dns-chaos"
	if tcp {
		key, kind = name+"/tcp", "dns-chaos-tcp"
	}
	return ClaimRow{Key: "resolver/" + key, Claim: ClaimResolver, Kind: kind, ID: "resolver/{from}/" + key, From: FromBoxes, To: ToGateway,
		Expect: NoAnswer, Controls: []Control{inetDNS}, Holds: any1(LayerNoIdent, LayerLocalAnswers),
		Probe: func(_, to Endpoint, _ *Topology) probes.Spec {
			return probes.Spec{Kind: probes.KindDNS, DNS: &probes.DNSQuery{Server: to.Addr.String(), Name: name, Type: "TXT", Class: "CH", TCP: tcp}}
		}}
}

func spoofUDP(src, dst netip.Addr) probes.Spec {
	return probes.Spec{Kind: probes.KindSpoofUDP, Target: dst.String(), Port: DecoyUDP, Spoof: &probes.SpoofSpec{SrcIP: src.String()}}
}

// DHCPTimeout covers dnsmasq's ping before it offers an address to a new client (~3 s).
const DHCPTimeout = 4 * time.Second

func dhcpSpec(kind string, server netip.Addr, d *probes.DHCPSpec) probes.Spec {
	d.Server = server.String()
	return probes.Spec{Kind: kind, Timeout: DHCPTimeout, DHCP: d}
}

// otherNet is the decoy outside every blocked range.
func (t *Topology) otherNet() netip.Addr {
	for _, d := range t.Decoys {
		if isOtherNet(d) {
			return d.Addr
		}
	}
	return netip.Addr{}
}

func uplinkNetRow(proto string, to Selector) ClaimRow {
	r := decoyRow(ClaimLAN, "uplink-net", proto, to)
	r.Holds = any1(LayerWall, LayerL2Ranges)
	return r
}

func otherNetRow(proto string, to Selector) ClaimRow {
	r := decoyRow(ClaimOtherNet, "other-net", proto, to)
	r.Holds = any1(LayerWall, LayerL2Ranges)
	return r
}

func boxEnds(bs []*Box, keep func(*Box) bool) []Endpoint {
	var out []Endpoint
	for _, b := range bs {
		if keep == nil || keep(b) {
			out = append(out, Endpoint{Key: b.Name, Label: b.Name, Addr: b.IPv4, Box: b})
		}
	}
	return out
}

func hostAddrs(keep func(a netip.Addr, gateway bool) bool) func(*Topology, Endpoint) []Endpoint {
	return func(t *Topology, _ Endpoint) []Endpoint {
		var out []Endpoint
		for _, h := range t.HostAddrs {
			gw := h == t.Gateway.Addr()
			if !keep(h, gw) {
				continue
			}
			label := "host " + h.String()
			if gw {
				label = "gateway " + h.String()
			}
			out = append(out, Endpoint{Key: h.String(), Label: label, Addr: h})
		}
		return out
	}
}

func isAnyDecoy(DecoyTarget) bool   { return true }
func isOtherNet(d DecoyTarget) bool { return d.Range == OtherNetRange }
func isLAN(d DecoyTarget) bool      { return isBlocked(d) && !isCGNAT(d) }
func isCGNAT(d DecoyTarget) bool {
	return isBlocked(d) && (strings.HasPrefix(d.Range, "100.64") || strings.HasPrefix(d.Range, "169.254"))
}
func isBlocked(d DecoyTarget) bool {
	return d.Range != "public" && d.Range != OtherNetRange && d.Range != UplinkSubnetRange
}
func isUplinkSubnet(d DecoyTarget) bool { return d.Range == UplinkSubnetRange }

// decoys selects decoy targets; perPort gives one endpoint per TCP port.
func decoys(keep func(DecoyTarget) bool, perPort bool) func(*Topology, Endpoint) []Endpoint {
	return func(t *Topology, _ Endpoint) []Endpoint {
		var out []Endpoint
		for _, d := range t.Decoys {
			if !keep(d) {
				continue
			}
			e := Endpoint{Key: d.Addr.String(), Label: "decoy " + d.Addr.String(), Addr: d.Addr}
			if !perPort {
				out = append(out, e)
				continue
			}
			for _, p := range d.Ports {
				e.Port = p
				out = append(out, e)
			}
		}
		return out
	}
}

func tcp(target netip.Addr, port int) probes.Spec {
	return probes.Spec{Kind: probes.KindTCP, Target: target.String(), Port: port}
}
func udp(target netip.Addr, port int) probes.Spec {
	return probes.Spec{Kind: probes.KindUDP, Target: target.String(), Port: port}
}
func icmp(target netip.Addr) probes.Spec {
	return probes.Spec{Kind: probes.KindICMP, Target: target.String()}
}
func arp(target netip.Addr) probes.Spec {
	return probes.Spec{Kind: probes.KindARP, Target: target.String()}
}
func tcp6ll(target netip.Addr) probes.Spec {
	return probes.Spec{Kind: probes.KindTCP6LL, Target: target.String(), Port: probes.DefaultTCPPort}
}
func dnsq(server netip.Addr, name, typ string) probes.Spec {
	return probes.Spec{Kind: probes.KindDNS, DNS: &probes.DNSQuery{Server: server.String(), Name: name, Type: typ}}
}
func facts(_, _ Endpoint, _ *Topology) probes.Spec { return probes.Spec{Kind: probes.KindFacts} }

// WindowFlood is how long a window row floods; the lab starts the re-apply WindowLead
// after the floods start, and the re-apply must end inside the flood for the rows to count.
const (
	WindowFlood = 2000 * time.Millisecond
	WindowLead  = 200 * time.Millisecond
	// floodTail is how long a flood waits for late echoes after it stops sending.
	floodTail = 300 * time.Millisecond
)

func flood(udp, tcp []netip.AddrPort) probes.Spec {
	f := &probes.FloodSpec{Duration: probes.Dur(WindowFlood)}
	for _, a := range udp {
		f.UDP = append(f.UDP, a.String())
	}
	for _, a := range tcp {
		f.TCP = append(f.TCP, a.String())
	}
	return probes.Spec{Kind: probes.KindFlood, Timeout: WindowFlood + floodTail, Flood: f}
}

// soakFlood is a flood that lasts until the soak ends it (SoakFloodMax at most), slower than
// the window's (every 2 ms, a connect every 50 ms: the soak runs a minute or more on a
// loaded host, beside Incus restarting).
func soakFlood(udp, tcp []netip.AddrPort) probes.Spec {
	s := flood(udp, tcp)
	s.Flood.Duration, s.Timeout = probes.Dur(SoakFloodMax), SoakFloodMax+floodTail
	s.Flood.UDPEvery, s.Flood.TCPEvery = probes.Dur(2*time.Millisecond), probes.Dur(50*time.Millisecond)
	return s
}

// blockedDecoyTargets: every blocked decoy, the other network and the uplink's subnet.
func blockedDecoyTargets(t *Topology) (udp, tcp []netip.AddrPort) {
	for _, d := range t.Decoys {
		if isBlocked(d) || isOtherNet(d) || isUplinkSubnet(d) {
			udp = append(udp, udpTo(DecoyUDP, d.Addr)...)
			for _, p := range d.Ports {
				tcp = append(tcp, tcpTo(p, d.Addr)...)
			}
		}
	}
	return udp, tcp
}

// hostTargets: every host address, at the host's listener ports.
func hostTargets(t *Topology) (udp, tcp []netip.AddrPort) {
	for _, h := range t.HostAddrs {
		udp, tcp = append(udp, udpTo(t.HostUDP, h)...), append(tcp, tcpTo(t.HostTCP, h)...)
	}
	return udp, tcp
}

func udpTo(port int, a netip.Addr) []netip.AddrPort {
	return []netip.AddrPort{netip.AddrPortFrom(a, uint16(port))}
}
func tcpTo(port int, a netip.Addr) []netip.AddrPort { return udpTo(port, a) }

// lab is a row the lab itself observes (no probe runs anywhere).
func lab(kind string) func(_, _ Endpoint, _ *Topology) probes.Spec {
	return func(_, _ Endpoint, _ *Topology) probes.Spec { return probes.Spec{Kind: kind} }
}
