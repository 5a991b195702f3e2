package drill

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"runtime"
	"slices"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"

	"github.com/claudebox/claudebox/drill/probes"
	"github.com/claudebox/claudebox/internal/addr4"
)

// Boxes of other members. On a cluster every member's bridge has the same subnet (the
// network is defined once), and each is its own L2: a box here reaches a box on another
// member only if the bridges were joined (an external interface, a tunnel between the
// members). The drill proves that even then nothing passes, in both directions, with a
// stand-in for the other member's box: a host on the box subnet in a namespace of its own,
// behind a veth whose host end is on this bridge only while a seeded hole joins the
// bridges. Each member's drill proves its own half (its boxes' frames do not leave it; no
// frame from another member reaches its boxes), and on a standalone host the rows say the
// same of a bridge joined to another host's.

// LayerMembersApart: this member's bridge is joined to no other member's (the lab's own
// layer: a seeded hole attaches the stand-in's veth to the bridge).
const LayerMembersApart Layer = "members-apart"

// ClaimMemberBoxes is the claim of the rows below.
const ClaimMemberBoxes = "box↔boxes of other members"

// memberBoxLayers: the bridges apart, the nft bridge drop (subnet mode: IPv4 and ARP between
// any two ports, a joined one too), or br_netfilter handing the bridged frames to the guard's
// forward chain. Port isolation does not hold it: a join is no box port.
var memberBoxLayers = Holds{{LayerMembersApart}, {LayerNFTBridge}, {LayerBRNF}}

var (
	foreignEnd = Endpoint{Key: "other-member-box", Label: "another member's box (stand-in)"}

	FromForeign = Selector{"another member's box (stand-in)", func(t *Topology, _ Endpoint) []Endpoint { return foreignEnds(t) }}
	ToForeign   = Selector{"another member's box (stand-in)", func(t *Topology, _ Endpoint) []Endpoint { return foreignEnds(t) }}

	foreignSelfTCP = func(from, _ Endpoint, _ *Topology) probes.Spec { return tcp(from.Addr, DecoyTCP) }
	foreignSelfUDP = func(from, _ Endpoint, _ *Topology) probes.Spec { return udp(from.Addr, DecoyUDP) }

	memberBoxRows = []ClaimRow{
		{Key: "member-box/tcp", Claim: ClaimMemberBoxes, Kind: "tcp", ID: "member-box/{from}>{to}/tcp", From: FromBoxes, To: ToForeign,
			Probe: func(_, to Endpoint, _ *Topology) probes.Spec { return tcp(to.Addr, DecoyTCP) }, Expect: Dropped,
			Controls: []Control{{"ctl/foreign-tcp", EndTarget, EndTarget}, inetTCP}, Holds: memberBoxLayers},
		{Key: "member-box/udp", Claim: ClaimMemberBoxes, Kind: "udp", ID: "member-box/{from}>{to}/udp", From: FromBoxes, To: ToForeign,
			Probe: func(_, to Endpoint, _ *Topology) probes.Spec { return udp(to.Addr, DecoyUDP) }, Expect: Dropped,
			Controls: []Control{{"ctl/foreign-udp", EndTarget, EndTarget}, inetTCP}, Holds: memberBoxLayers},
		{Key: "member-box-in/tcp", Claim: ClaimMemberBoxes, Kind: "tcp", ID: "member-box/{from}>{to}/tcp", From: FromForeign, To: ToBoxes,
			Probe: toBoxTCP, Expect: Dropped,
			Controls: []Control{selfTCP, {"ctl/foreign-tcp", EndSource, EndSource}}, Holds: memberBoxLayers},
		{Key: "member-box-in/udp", Claim: ClaimMemberBoxes, Kind: "udp", ID: "member-box/{from}>{to}/udp", From: FromForeign, To: ToBoxes,
			Probe: toBoxUDP, Expect: Dropped,
			Controls: []Control{selfUDP, {"ctl/foreign-udp", EndSource, EndSource}}, Holds: memberBoxLayers},
		memberFrameRow(probes.FrameVLAN0IPv4), memberFrameRow(probes.FrameVLAN0IPv6), memberFrameRow(probes.FrameVLAN0DHCPOffer),
		memberFrameRow(probes.FrameVLAN0RA), memberFrameRow(probes.FrameEthertype), memberFrameRow(probes.FrameARPZero),
		foreignFrameRow(probes.FrameVLAN0IPv4), foreignFrameRow(probes.FrameVLAN0IPv6), foreignFrameRow(probes.FrameEthertype), foreignFrameRow(probes.FrameARPZero),
		// Nor does it speak to this host for the box subnet: the host would learn a box's
		// address at its MAC from its ARP, and answer it as a box (its dnsmasq). The L2
		// ranges take nothing with a source in the subnet from a port that is no box's.
		{Key: "member-host/arp", Claim: ClaimMemberBoxes, Kind: "arp", ID: "member-host/{from}>{to}/arp", From: FromForeign, To: ToGateway,
			Expect: Dropped, Controls: []Control{{"ctl/foreign-udp", EndSource, EndSource}}, Holds: any1(LayerMembersApart, LayerL2Ranges),
			Probe: func(_, to Endpoint, t *Topology) probes.Spec {
				s := arp(to.Addr)
				s.Iface = t.ForeignIface
				return s
			}},
		{Key: "member-host/dns", Claim: ClaimMemberBoxes, Kind: "dns", ID: "member-host/{from}>{to}/dns", From: FromForeign, To: ToGateway,
			Expect: NoAnswer, Controls: []Control{{"ctl/foreign-udp", EndSource, EndSource}}, Holds: any1(LayerMembersApart, LayerL2Ranges),
			Probe: func(_, to Endpoint, t *Topology) probes.Spec { return dnsq(to.Addr, t.PublicName, "A") }},
		// Nor does this member's dnsmasq lease it an address (and so learn a name for it): only
		// known clients get one (dhcp-known-only). The control: a box here renews its own.
		{Key: "member-host/dhcp", Claim: ClaimMemberBoxes, Kind: "dhcp-fake-mac", ID: "member-host/{from}>{to}/dhcp", From: FromForeign, To: ToGateway,
			Expect: NoLease, Window: WindowDHCP, Controls: []Control{{"ctl/dhcp-renew", EndFirstBox, EndGateway}, {"ctl/foreign-udp", EndSource, EndSource}},
			Holds: any1(LayerMembersApart, LayerDHCPKnownOnly),
			Probe: func(_, to Endpoint, t *Topology) probes.Spec {
				s := dhcpSpec(probes.KindDHCPFakeMAC, to.Addr, &probes.DHCPSpec{})
				s.Iface = t.ForeignIface
				return s
			}},
		{Key: "ctl/foreign-tcp", Claim: ClaimControl, Kind: "self", ID: "ctl/{from}/self-tcp", From: FromForeign, To: ToSelf, Probe: foreignSelfTCP, Expect: Open},
		{Key: "ctl/foreign-udp", Claim: ClaimControl, Kind: "self", ID: "ctl/{from}/self-udp", From: FromForeign, To: ToSelf, Probe: foreignSelfUDP, Expect: Open},
	}
)

// memberFrameRow: an odd frame (frameRow's) from a box to the stand-in, heard by its capture.
// Port isolation, which holds it between two boxes, does not hold it over a join: Incus's NIC
// filtering, claudebox's port binding (only the box's own IPv4 and ARP leave its port; not for
// arp-zero) and the nft bridge table (nothing is switched from a box port) do: frameLayers.
func memberFrameRow(variant string) ClaimRow {
	return ClaimRow{Key: "member-box-frames/" + variant, Claim: ClaimMemberBoxes, Kind: "frame", ID: "member-box-frames/{from}>{to}/" + variant,
		From: FromBoxes, To: ToForeign, Expect: Dropped, Window: WindowSpoof,
		Controls: []Control{{"ctl/arp-gateway", EndSource, EndGateway}, {"ctl/foreign-udp", EndTarget, EndTarget}},
		Holds:    frameLayers(variant, LayerMembersApart),
		Probe: func(_, to Endpoint, t *Topology) probes.Spec {
			return probes.Spec{Kind: probes.KindFrame, Frame: &probes.FrameSpec{Variant: variant, DstMAC: t.ForeignMAC, TargetIP: to.Addr.String()}}
		}}
}

// foreignFrameRow: an odd frame from the stand-in to a box, heard by the box's capture: what
// another member's box could send over a join. No layer of the box's own port sees it (they
// filter what leaves a box); the nft bridge table switches nothing to a box port. The IPv4
// one comes from an address outside the subnet (the forged one: answers die in the decoy),
// past every rule that names the subnet (found by the attacker).
func foreignFrameRow(variant string) ClaimRow {
	return ClaimRow{Key: "member-box-frames-in/" + variant, Claim: ClaimMemberBoxes, Kind: "frame", ID: "member-box-frames/{from}>{to}/" + variant,
		From: FromForeign, To: ToBoxes, Expect: Dropped, Window: WindowSpoof,
		Controls: []Control{{"ctl/foreign-udp", EndSource, EndSource}, selfUDP},
		Holds:    any1(LayerMembersApart, LayerNFTBridge),
		Probe: func(_, to Endpoint, t *Topology) probes.Spec {
			f := &probes.FrameSpec{Variant: variant, DstMAC: to.Box.MAC, TargetIP: to.Box.IPv4.String()}
			switch variant {
			case probes.FrameVLAN0IPv4:
				f.SrcIP = t.Forged.String()
			case probes.FrameVLAN0IPv6, probes.FrameARPZero:
				f.DstMAC = "" // the all-nodes group, a broadcast who-has
			}
			return probes.Spec{Kind: probes.KindFrame, Iface: t.ForeignIface, Frame: f}
		}}
}

func foreignEnds(t *Topology) []Endpoint {
	if !t.Foreign.IsValid() {
		return nil
	}
	e := foreignEnd
	e.Addr, e.Label = t.Foreign, foreignEnd.Label+" "+t.Foreign.String()
	return []Endpoint{e}
}

// ForeignBox is the stand-in for another member's box.
type ForeignBox struct {
	NS       string     `json:"netns"`
	HostVeth string     `json:"host_veth"` // on the bridge only while the bridges are joined
	NSVeth   string     `json:"ns_veth"`
	Addr     netip.Addr `json:"addr"`
	MAC      string     `json:"mac"`
	Subnet   netip.Prefix

	ns        netns.NsHandle
	listeners *probes.Listeners
}

// PlanForeign picks the stand-in's address: the highest of the box subnet that is neither
// the gateway nor held by any lease (a box here with it would answer for it).
func PlanForeign(run string, gateway netip.Prefix, used []netip.Addr) (*ForeignBox, error) {
	f := &ForeignBox{NS: NetnsPrefix + run + "-m", HostVeth: VethPrefix + run + "j", NSVeth: VethPrefix + run + "k", Subnet: gateway.Masked()}
	for ip := addr4.Add(addr4.Last(f.Subnet), -1); f.Subnet.Contains(ip) && ip != f.Subnet.Addr(); ip = addr4.Add(ip, -1) {
		if ip != gateway.Addr() && !slices.Contains(used, ip) {
			f.Addr = ip
			return f, nil
		}
	}
	return nil, fmt.Errorf("no free address in %s for the stand-in of another member's box", f.Subnet)
}

// Up makes the namespace, the veth (its host end down and on no bridge), the address and the
// listeners. On error whatever was made is removed.
func (f *ForeignBox) Up() (err error) {
	defer func() {
		if err != nil {
			f.Down()
		}
	}()
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	orig, err := netns.Get()
	if err != nil {
		return err
	}
	defer orig.Close()
	ns, err := netns.NewNamed(f.NS) // switches this thread into it
	if err != nil {
		_ = netns.Set(orig)
		return fmt.Errorf("stand-in: creating netns %s: %w", f.NS, err)
	}
	f.ns = ns
	// No IPv6 in it: router and neighbour solicitations would only be noise on the bridge.
	for _, k := range []string{"all", "default"} {
		_ = os.WriteFile("/proc/sys/net/ipv6/conf/"+k+"/disable_ipv6", []byte("1"), 0o644)
	}
	if err := netns.Set(orig); err != nil {
		panic(fmt.Sprintf("stand-in: cannot return to the host netns: %v", err))
	}
	if err := netlink.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: f.HostVeth}, PeerName: f.NSVeth}); err != nil {
		return fmt.Errorf("stand-in: creating veth %s: %w", f.HostVeth, err)
	}
	host, err := netlink.LinkByName(f.HostVeth)
	if err != nil {
		return err
	}
	if err := netlink.LinkSetAlias(host, VethAlias+" "+f.HostVeth); err != nil {
		return err
	}
	_ = os.WriteFile("/proc/sys/net/ipv6/conf/"+f.HostVeth+"/disable_ipv6", []byte("1"), 0o644)
	peer, err := netlink.LinkByName(f.NSVeth)
	if err != nil {
		return err
	}
	if err := netlink.LinkSetNsFd(peer, int(ns)); err != nil {
		return fmt.Errorf("stand-in: moving %s into %s: %w", f.NSVeth, f.NS, err)
	}
	nh, err := netlink.NewHandleAt(ns)
	if err != nil {
		return err
	}
	defer nh.Close()
	if lo, err := nh.LinkByName("lo"); err == nil {
		_ = nh.LinkSetUp(lo)
	}
	nl, err := nh.LinkByName(f.NSVeth)
	if err != nil {
		return err
	}
	f.MAC = nl.Attrs().HardwareAddr.String()
	// The box subnet on-link, and no other route: the stand-in can only talk on the bridge.
	if err := nh.AddrAdd(nl, &netlink.Addr{IPNet: ipnet(f.Addr, f.Subnet.Bits())}); err != nil {
		return fmt.Errorf("stand-in: address %s: %w", f.Addr, err)
	}
	if err := nh.LinkSetUp(nl); err != nil {
		return err
	}
	if err := netns.Set(ns); err != nil {
		return err
	}
	// Its capture hears the odd frames' markers, which no socket takes.
	f.listeners, err = probes.Serve(context.Background(), probes.ListenerConfig{TCP: []int{DecoyTCP}, UDP: []int{DecoyUDP},
		Banner: "claudebox-drill another member's box (stand-in)", Capture: f.NSVeth})
	if serr := netns.Set(orig); serr != nil {
		panic(fmt.Sprintf("stand-in: cannot return to the host netns: %v", serr))
	}
	if err != nil {
		return fmt.Errorf("stand-in listeners: %w", err)
	}
	return nil
}

// Join puts the stand-in's veth on bridge: the bridges of two members joined.
func (f *ForeignBox) Join(bridge string) error {
	br, err := netlink.LinkByName(bridge)
	if err != nil {
		return err
	}
	host, err := netlink.LinkByName(f.HostVeth)
	if err != nil {
		return err
	}
	if err := netlink.LinkSetMaster(host, br); err != nil {
		return fmt.Errorf("joining %s to %s: %w", f.HostVeth, bridge, err)
	}
	return netlink.LinkSetUp(host)
}

// Part takes the stand-in's veth off the bridge again (the bridges apart).
func (f *ForeignBox) Part() error {
	host, err := netlink.LinkByName(f.HostVeth)
	if err != nil {
		return err
	}
	if err := netlink.LinkSetDown(host); err != nil {
		return err
	}
	return netlink.LinkSetNoMaster(host)
}

// Hits returns who reached the stand-in's listeners.
func (f *ForeignBox) Hits() []probes.Hit {
	if f == nil || f.listeners == nil {
		return nil
	}
	return f.listeners.Hits()
}

// Down stops the listeners and removes the veth (off the bridge with it) and the namespace.
func (f *ForeignBox) Down() {
	if f.listeners != nil {
		_ = f.listeners.Close()
		f.listeners = nil
	}
	if l, err := netlink.LinkByName(f.HostVeth); err == nil {
		_ = netlink.LinkDel(l)
	}
	if f.ns != 0 {
		_ = f.ns.Close()
		f.ns = 0
	}
	_ = netns.DeleteNamed(f.NS)
}

// foreignUp plans and makes the stand-in, its address clear of every lease on the bridge.
func (e *engine) foreignUp(ctx context.Context) error {
	leases, err := e.c.NetworkLeases(ctx, e.o.Stack.Network)
	if err != nil {
		return fmt.Errorf("reading %s's leases: %w", e.o.Stack.Network, err)
	}
	var used []netip.Addr
	for _, l := range leases {
		if a, err := netip.ParseAddr(l.Address); err == nil {
			used = append(used, a)
		}
	}
	f, err := PlanForeign(e.run, e.gateway, used)
	if err != nil {
		return err
	}
	if err := f.Up(); err != nil {
		return err
	}
	e.foreign = f
	e.progress("  stand-in for another member's box: %s in %s (its veth %s joins %s only in a seeded hole)", f.Addr, f.NS, f.HostVeth, e.o.Stack.Network)
	return nil
}

// foreignClash: a box here was given the stand-in's address (a lease after foreignUp read
// them): its rows would aim at that box.
func (e *engine) foreignClash() error {
	if e.foreign == nil {
		return nil
	}
	for _, b := range e.boxes {
		if b.IPv4 == e.foreign.Addr {
			return fmt.Errorf("box %s was given %s, the address of the stand-in for another member's box: run the drill again", b.Name, e.foreign.Addr)
		}
	}
	return nil
}
