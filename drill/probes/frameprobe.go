package probes

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"net"
	"net/netip"

	"github.com/insomniacslk/dhcp/dhcpv4"
)

var (
	allNodes    = netip.MustParseAddr("ff02::1")
	allNodesMAC = net.HardwareAddr{0x33, 0x33, 0, 0, 0, 1}
	// raPrefix is what a rogue RA offers: documentation space, so a box that
	// takes it gains an address and route that lead nowhere real.
	raPrefix = netip.MustParsePrefix("2001:db8:cb00::/64")
	// linkLocalLLDP is the nearest-bridge group address (LLDP), which the bridge neither
	// forwards nor passes through its input hook.
	linkLocalLLDP = net.HardwareAddr{0x01, 0x80, 0xc2, 0, 0, 0x0e}
)

// probeFrame sends one odd frame (FrameSpec.Variant) repeatedly over the
// window. Open: something answered it here (the UDP echo of vlan0-ipv4/ipv6,
// the ARP reply to arp-zero): it was delivered and processed. Dropped: no
// answer — for vlan0-dhcp-offer, vlan0-ra and ethertype there is none to
// expect, and the receiver's capture hits (the marker) are the evidence.
func probeFrame(ctx context.Context, s Spec, r *Result) {
	f := s.Frame
	ifi, own, err := linkFor(s.Iface, netip.Addr{})
	if err != nil {
		r.Outcome, r.Evidence = CheckFailed, err.Error()
		return
	}
	pc, err := openPacket(ifi.Name)
	if err != nil {
		r.Outcome, r.Evidence = CheckFailed, err.Error()
		return
	}
	defer pc.Close()
	b := frameBuilder{me: ifi.HardwareAddr, own: own, ll: ownLinkLocal(ifi), marker: []byte(r.Counts.Marker), f: f}
	frame, match, err := b.build()
	if err != nil {
		r.Outcome, r.Evidence = CheckFailed, err.Error()
		return
	}
	r.Local = fmt.Sprintf("%s from %s on %s", f.Variant, b.me, ifi.Name)
	seen, sendErr, readErr := watch(ctx, pc, r.Counts, func() error { return pc.send(frame) }, match)
	r.Counts.Replies = seen
	finish(r, seen, sendErr, readErr, "answers to the "+f.Variant+" frame")
}

type frameBuilder struct {
	me     net.HardwareAddr
	own    netip.Addr // IPv4, may be invalid
	ll     netip.Addr
	marker []byte
	f      *FrameSpec
}

type frameMatch = func(frameInfo, []byte, uint8) bool

func never(frameInfo, []byte, uint8) bool { return false }

func (b frameBuilder) build() ([]byte, frameMatch, error) {
	dst := macOr(b.f.DstMAC, broadcastMAC)
	port := uint16(b.f.Port)
	if port == 0 {
		port = DefaultUDPPort
	}
	src4 := b.own
	if !src4.IsValid() {
		src4 = netip.IPv4Unspecified()
	}
	echoed := func(fi frameInfo, _ []byte, _ uint8) bool {
		return fi.Proto == 17 && fi.SPort == port && bytes.Contains(fi.L4, b.marker)
	}
	bcast4 := netip.AddrFrom4([4]byte{255, 255, 255, 255})
	switch b.f.Variant {
	case FrameVLAN0IPv4:
		if b.f.SrcIP != "" {
			src4 = netip.MustParseAddr(b.f.SrcIP).Unmap() // outside the subnet: past its rules
		}
		pkt := udpPacket(netip.AddrPortFrom(src4, 40002), netip.AddrPortFrom(bcast4, port), b.marker)
		return ethFrame(dst, b.me, true, etherIPv4, pkt), echoed, nil
	case FrameVLAN0IPv6:
		pkt := udpPacket(netip.AddrPortFrom(b.ll, 40002), netip.AddrPortFrom(allNodes, port), b.marker)
		return ethFrame(macOr(b.f.DstMAC, allNodesMAC), b.me, true, etherIPv6, pkt), echoed, nil
	case FrameVLAN0DHCPOffer:
		offer, err := b.offer()
		if err != nil {
			return nil, nil, err
		}
		pkt := udpPacket(netip.AddrPortFrom(src4, 67), netip.AddrPortFrom(bcast4, 68), offer)
		return ethFrame(dst, b.me, true, etherIPv4, pkt), never, nil
	case FrameVLAN0RA:
		return ethFrame(macOr(b.f.DstMAC, allNodesMAC), b.me, true, etherIPv6, b.ra()), never, nil
	case FrameEthertype:
		return ethFrame(dst, b.me, false, EtherExperimental, padTo(b.marker, 46)), never, nil
	case FrameLinkLocalUDP:
		// The bridge does not forward 01:80:c2:00:00:0X: the kernel hands such a frame to
		// the IP stack on the box's own bridge port, around every rule that names the bridge.
		if b.f.TargetIP == "" {
			return nil, nil, fmt.Errorf("ll-udp needs a target IP")
		}
		src := src4
		if b.f.SrcIP != "" {
			src = netip.MustParseAddr(b.f.SrcIP).Unmap()
		}
		to := netip.MustParseAddr(b.f.TargetIP).Unmap()
		pkt := udpPacket(netip.AddrPortFrom(src, 40003), netip.AddrPortFrom(to, port), b.marker)
		return ethFrame(macOr(b.f.DstMAC, linkLocalLLDP), b.me, false, etherIPv4, pkt), echoed, nil
	case FrameARPZero:
		tpa := netip.MustParseAddr(b.f.TargetIP).Unmap()
		// The marker rides in the trailer after the ARP body (where the
		// Ethernet padding would be): ARP ignores it, a capture sees it.
		body := append(arpPacket(1, b.me, netip.IPv4Unspecified(), nil, tpa), b.marker...)
		replied := func(fi frameInfo, _ []byte, _ uint8) bool {
			return fi.ARPOp == 2 && fi.ARPSPA == tpa
		}
		return ethFrame(dst, b.me, false, etherARP, body), replied, nil
	}
	return nil, nil, fmt.Errorf("frame variant %q", b.f.Variant)
}

func padTo(b []byte, n int) []byte {
	if len(b) >= n {
		return b
	}
	return append(append([]byte{}, b...), make([]byte, n-len(b))...)
}

// offer is a rogue DHCPOFFER naming us router and DNS server.
func (b frameBuilder) offer() ([]byte, error) {
	yi := netip.MustParseAddr("192.0.2.77")
	if b.f.TargetIP != "" {
		yi = netip.MustParseAddr(b.f.TargetIP).Unmap()
	}
	us := net.IP(b.own.AsSlice())
	if !b.own.IsValid() {
		us = net.IPv4(192, 0, 2, 1)
	}
	m, err := dhcpv4.New(dhcpv4.WithReply(&dhcpv4.DHCPv4{OpCode: dhcpv4.OpcodeBootRequest, ClientHWAddr: broadcastMAC}),
		dhcpv4.WithMessageType(dhcpv4.MessageTypeOffer), dhcpv4.WithYourIP(net.IP(yi.AsSlice())),
		dhcpv4.WithServerIP(us), dhcpv4.WithOption(dhcpv4.OptServerIdentifier(us)),
		dhcpv4.WithRouter(us), dhcpv4.WithDNS(us), dhcpv4.WithNetmask(net.CIDRMask(24, 32)),
		dhcpv4.WithLeaseTime(3600), dhcpv4.WithOption(dhcpv4.OptMessage(string(b.marker))))
	if err != nil {
		return nil, err
	}
	return m.ToBytes(), nil
}

// ra is an ICMPv6 router advertisement from our link-local address: default
// router for 30 min, raPrefix on-link and autonomous, and the marker in an
// experimental option (type 253) that receivers skip.
func (b frameBuilder) ra() []byte {
	m := []byte{134, 0, 0, 0, 64, 0}
	m = binary.BigEndian.AppendUint16(m, 1800) // router lifetime
	m = append(m, make([]byte, 8)...)          // reachable, retrans timers
	m = append(append(m, 1, 1), b.me...)       // source link-layer address
	pfx := raPrefix.Addr().As16()
	m = append(m, 3, 4, byte(raPrefix.Bits()), 0xc0) // prefix info: on-link, autonomous
	m = binary.BigEndian.AppendUint32(m, 3600)
	m = binary.BigEndian.AppendUint32(m, 1800)
	m = append(append(m, 0, 0, 0, 0), pfx[:]...)
	opt := append([]byte{253, 0}, b.marker...)
	for len(opt)%8 != 0 {
		opt = append(opt, 0)
	}
	opt[1] = byte(len(opt) / 8)
	m = append(m, opt...)
	binary.BigEndian.PutUint16(m[2:], checksum(pseudoHeader(b.ll, allNodes, 58, len(m)), m))
	return ipv6Packet(b.ll, allNodes, 58, 255, m)
}

// ownLinkLocal is ifi's link-local address, or the EUI-64 one its MAC
// implies when IPv6 is off there (the frame is forged either way).
func ownLinkLocal(ifi *net.Interface) netip.Addr {
	addrs, _ := ifi.Addrs()
	for _, a := range addrs {
		if n, ok := a.(*net.IPNet); ok {
			if ip, ok := netip.AddrFromSlice(n.IP); ok && ip.Is6() && ip.IsLinkLocalUnicast() {
				return ip
			}
		}
	}
	return eui64LinkLocal(ifi.HardwareAddr)
}
