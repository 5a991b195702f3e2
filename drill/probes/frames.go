package probes

import (
	"bytes"
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"net"
	"net/netip"
	"strings"
)

// MarkerPrefix starts every marker the active probes put in their frames, so
// a capture listener recognises them whatever the encapsulation.
const MarkerPrefix = "CLAUDEBOX-MARK-"

// newMarker returns MarkerPrefix plus a random suffix.
func newMarker() string {
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	return MarkerPrefix + hex.EncodeToString(b)
}

// markerOf is the spec's marker: Payload when given (prefixed if it lacks
// the prefix, so receivers still recognise it), else a fresh one.
func markerOf(s Spec) string {
	switch {
	case s.Payload == "":
		return newMarker()
	case strings.HasPrefix(s.Payload, MarkerPrefix):
		return s.Payload
	default:
		return MarkerPrefix + s.Payload
	}
}

// findMarker returns the first marker in b, or "".
func findMarker(b []byte) string {
	i := bytes.Index(b, []byte(MarkerPrefix))
	if i < 0 {
		return ""
	}
	end := i + len(MarkerPrefix)
	for end < len(b) && end-i < 64 && isMarkerByte(b[end]) {
		end++
	}
	return string(b[i:end])
}

func isMarkerByte(c byte) bool {
	return c == '-' || c == '_' || (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')
}

const (
	etherIPv4 = 0x0800
	etherARP  = 0x0806
	etherVLAN = 0x8100
	etherIPv6 = 0x86DD
	// EtherExperimental is IEEE's local experimental ethertype 1, the frame
	// kind's "raw ethertype" variant.
	EtherExperimental = 0x88B5
)

var broadcastMAC = net.HardwareAddr{0xff, 0xff, 0xff, 0xff, 0xff, 0xff}

// ethFrame builds an Ethernet header (with a priority tag, VID 0, when vlan0)
// followed by payload.
func ethFrame(dst, src net.HardwareAddr, vlan0 bool, etherType uint16, payload []byte) []byte {
	b := make([]byte, 0, 18+len(payload))
	b = append(b, dst[:6]...)
	b = append(b, src[:6]...)
	if vlan0 {
		b = binary.BigEndian.AppendUint16(b, etherVLAN)
		b = binary.BigEndian.AppendUint16(b, 0) // PCP 0, DEI 0, VID 0
	}
	b = binary.BigEndian.AppendUint16(b, etherType)
	return append(b, payload...)
}

// arpPacket is an Ethernet/IPv4 ARP body.
func arpPacket(op uint16, sha net.HardwareAddr, spa netip.Addr, tha net.HardwareAddr, tpa netip.Addr) []byte {
	b := []byte{0, 1, 0x08, 0, 6, 4}
	b = binary.BigEndian.AppendUint16(b, op)
	b = append(b, sha[:6]...)
	s4, t4 := spa.As4(), tpa.As4()
	b = append(b, s4[:]...)
	if tha == nil {
		tha = make(net.HardwareAddr, 6)
	}
	b = append(b, tha[:6]...)
	return append(b, t4[:]...)
}

func checksum(parts ...[]byte) uint16 {
	var sum uint32
	for _, p := range parts {
		for i := 0; i+1 < len(p); i += 2 {
			sum += uint32(p[i])<<8 | uint32(p[i+1])
		}
		if len(p)%2 == 1 {
			sum += uint32(p[len(p)-1]) << 8
		}
	}
	for sum > 0xffff {
		sum = sum>>16 + sum&0xffff
	}
	return ^uint16(sum)
}

// ipv4Packet is an IPv4 header (no options, TTL 64) plus payload.
func ipv4Packet(src, dst netip.Addr, proto uint8, payload []byte) []byte {
	h := make([]byte, 20)
	h[0], h[8], h[9] = 0x45, 64, proto
	binary.BigEndian.PutUint16(h[2:], uint16(20+len(payload)))
	s, d := src.As4(), dst.As4()
	copy(h[12:], s[:])
	copy(h[16:], d[:])
	binary.BigEndian.PutUint16(h[10:], checksum(h))
	return append(h, payload...)
}

// withTimestampOption returns an option-less IPv4 packet with an empty timestamp option
// (type 68, flag 1: room for one address and one timestamp) added to its header.
func withTimestampOption(pkt []byte) []byte {
	opt := []byte{68, 12, 5, 0x01, 0, 0, 0, 0, 0, 0, 0, 0}
	out := make([]byte, 0, len(pkt)+len(opt))
	out = append(append(append(out, pkt[:20]...), opt...), pkt[20:]...)
	out[0] = 0x40 | byte((20+len(opt))/4)
	binary.BigEndian.PutUint16(out[2:], uint16(len(out)))
	out[10], out[11] = 0, 0
	binary.BigEndian.PutUint16(out[10:], checksum(out[:20+len(opt)]))
	return out
}

// icmpErrorAbout is an ICMP port unreachable from src to dst quoting the UDP datagram of the
// flow "SRC:PORT>DST:PORT" (the quoted header, then the marker).
func icmpErrorAbout(src, dst netip.Addr, flow string, marker []byte) ([]byte, error) {
	a, b, ok := strings.Cut(flow, ">")
	in, err1 := netip.ParseAddrPort(a)
	out, err2 := netip.ParseAddrPort(b)
	if !ok || err1 != nil || err2 != nil || !in.Addr().Is4() || !out.Addr().Is4() {
		return nil, fmt.Errorf("error_about %q: want IPv4 SRC:PORT>DST:PORT", flow)
	}
	quoted := udpPacket(in, out, marker)
	icmp := append([]byte{3, 3, 0, 0, 0, 0, 0, 0}, quoted...)
	binary.BigEndian.PutUint16(icmp[2:], checksum(icmp))
	return ipv4Packet(src, dst, 1, icmp), nil
}

// ipv6Packet is an IPv6 header plus payload.
func ipv6Packet(src, dst netip.Addr, next uint8, hopLimit uint8, payload []byte) []byte {
	h := make([]byte, 40)
	h[0] = 0x60
	binary.BigEndian.PutUint16(h[4:], uint16(len(payload)))
	h[6], h[7] = next, hopLimit
	s, d := src.As16(), dst.As16()
	copy(h[8:], s[:])
	copy(h[24:], d[:])
	return append(h, payload...)
}

// pseudoHeader is the L4 checksum's pseudo-header for either family.
func pseudoHeader(src, dst netip.Addr, proto uint8, length int) []byte {
	var b []byte
	if src.Is4() {
		s, d := src.As4(), dst.As4()
		b = append(append(b, s[:]...), d[:]...)
		b = append(b, 0, proto)
		return binary.BigEndian.AppendUint16(b, uint16(length))
	}
	s, d := src.As16(), dst.As16()
	b = append(append(b, s[:]...), d[:]...)
	b = binary.BigEndian.AppendUint32(b, uint32(length))
	return append(b, 0, 0, 0, proto)
}

// udpPacket is a UDP header and payload with its checksum, wrapped in IPv4 or
// IPv6 by the family of src.
func udpPacket(src netip.AddrPort, dst netip.AddrPort, payload []byte) []byte {
	u := make([]byte, 8, 8+len(payload))
	binary.BigEndian.PutUint16(u[0:], src.Port())
	binary.BigEndian.PutUint16(u[2:], dst.Port())
	binary.BigEndian.PutUint16(u[4:], uint16(8+len(payload)))
	u = append(u, payload...)
	cs := checksum(pseudoHeader(src.Addr(), dst.Addr(), 17, len(u)), u)
	if cs == 0 {
		cs = 0xffff
	}
	binary.BigEndian.PutUint16(u[6:], cs)
	if src.Addr().Is4() {
		return ipv4Packet(src.Addr(), dst.Addr(), 17, u)
	}
	return ipv6Packet(src.Addr(), dst.Addr(), 17, 64, u)
}

// frameInfo is what the probes and the capture listener read from a frame.
type frameInfo struct {
	Dst, Src  net.HardwareAddr
	EtherType uint16
	Tagged    bool // an 802.1Q tag was in the data (the kernel usually strips it)
	// ARP fields (EtherType 0x0806).
	ARPOp        uint16
	ARPSHA       net.HardwareAddr
	ARPSPA       netip.Addr
	ARPTPA       netip.Addr
	IPSrc, IPDst netip.Addr
	Proto        uint8 // IPv4 protocol / IPv6 next header (first one)
	SPort, DPort uint16
	L4           []byte // UDP payload, or the IP payload for other protocols
}

// parseFrame decodes what it can; a short or odd frame yields a partial info.
func parseFrame(b []byte) frameInfo {
	var f frameInfo
	if len(b) < 14 {
		return f
	}
	f.Dst, f.Src = net.HardwareAddr(b[0:6]), net.HardwareAddr(b[6:12])
	f.EtherType = binary.BigEndian.Uint16(b[12:14])
	p := b[14:]
	if f.EtherType == etherVLAN && len(p) >= 4 {
		f.Tagged = true
		f.EtherType = binary.BigEndian.Uint16(p[2:4])
		p = p[4:]
	}
	switch f.EtherType {
	case etherARP:
		if len(p) >= 28 {
			f.ARPOp = binary.BigEndian.Uint16(p[6:8])
			f.ARPSHA = net.HardwareAddr(p[8:14])
			f.ARPSPA = netip.AddrFrom4([4]byte(p[14:18]))
			f.ARPTPA = netip.AddrFrom4([4]byte(p[24:28]))
		}
	case etherIPv4:
		if len(p) < 20 || p[0]>>4 != 4 {
			return f
		}
		hl := int(p[0]&0x0f) * 4
		tl := int(binary.BigEndian.Uint16(p[2:4]))
		if hl < 20 || tl < hl || len(p) < hl {
			return f
		}
		if tl < len(p) {
			p = p[:tl] // drop Ethernet padding
		}
		f.IPSrc, f.IPDst = netip.AddrFrom4([4]byte(p[12:16])), netip.AddrFrom4([4]byte(p[16:20]))
		f.Proto = p[9]
		f.parseL4(p[hl:])
	case etherIPv6:
		if len(p) < 40 {
			return f
		}
		f.IPSrc, f.IPDst = netip.AddrFrom16([16]byte(p[8:24])), netip.AddrFrom16([16]byte(p[24:40]))
		f.Proto = p[6]
		f.parseL4(p[40:])
	}
	return f
}

func (f *frameInfo) parseL4(p []byte) {
	f.L4 = p
	if f.Proto == 17 && len(p) >= 8 {
		f.SPort, f.DPort = binary.BigEndian.Uint16(p[0:2]), binary.BigEndian.Uint16(p[2:4])
		f.L4 = p[8:]
	}
}

// eui64LinkLocal is the link-local address SLAAC would derive from mac: a
// source for forged IPv6 frames when the interface has none of its own.
func eui64LinkLocal(mac net.HardwareAddr) netip.Addr {
	var a [16]byte
	a[0], a[1] = 0xfe, 0x80
	a[8], a[9], a[10] = mac[0]^0x02, mac[1], mac[2]
	a[11], a[12] = 0xff, 0xfe
	a[13], a[14], a[15] = mac[3], mac[4], mac[5]
	return netip.AddrFrom16(a)
}

// randomMAC is a locally administered unicast MAC: a client the DHCP server
// has never seen.
func randomMAC() net.HardwareAddr {
	m := make(net.HardwareAddr, 6)
	_, _ = rand.Read(m)
	m[0] = m[0]&0xfe | 0x02
	return m
}
