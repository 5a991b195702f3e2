package probes

import (
	"context"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"net"
	"net/netip"
	"time"

	"golang.org/x/net/icmp"
	"golang.org/x/net/ipv4"
	"golang.org/x/net/ipv6"
)

const (
	protoICMP   = 1
	protoICMPv6 = 58
)

// icmpConn opens a raw ICMP socket (boxes run the agent as root, and raw is
// the only kind that also sees the destination-unreachable errors), falling
// back to an unprivileged ping socket, which sees replies only.
func icmpConn(ctx context.Context, v6 bool, iface string) (net.PacketConn, bool, error) {
	network, laddr := "ip4:icmp", "0.0.0.0"
	if v6 {
		network, laddr = "ip6:ipv6-icmp", "::"
	}
	lc := net.ListenConfig{Control: bindControl(iface)}
	c, rawErr := lc.ListenPacket(ctx, network, laddr)
	if rawErr == nil {
		return c, true, nil
	}
	if iface != "" {
		return nil, false, fmt.Errorf("raw ICMP socket: %w", rawErr)
	}
	pnet := "udp4"
	if v6 {
		pnet = "udp6"
	}
	pc, err := icmp.ListenPacket(pnet, laddr)
	if err != nil {
		return nil, false, fmt.Errorf("cannot open an ICMP socket: raw: %v; ping: %v", rawErr, err)
	}
	return pc, false, nil
}

func probeICMP(ctx context.Context, s Spec, r *Result) {
	dst, err := routableTarget(ctx, s.Target, s.Iface)
	if err != nil {
		r.Outcome, r.Evidence = CheckFailed, err.Error()
		return
	}
	c, raw, err := icmpConn(ctx, dst.Is6(), s.Iface)
	if err != nil {
		r.Outcome, r.Evidence = CheckFailed, err.Error()
		return
	}
	defer c.Close()
	deadline, _ := ctx.Deadline()
	_ = c.SetReadDeadline(deadline)

	e := newEchoer(c, raw, dst)
	start := time.Now()
	if err := e.send(); err != nil {
		r.Outcome, r.Evidence = classify(err, dst, s.Iface)
		return
	}
	defer resendUntil(s.Timeout, func() { _ = e.send() })()
	e.await(r, s.Iface, start)
}

// icmpKinds are one address family's ICMP message types and protocol number.
type icmpKinds struct {
	echo, reply, unreach, exceeded icmp.Type
	proto                          int
}

func icmpKindsOf(v6 bool) icmpKinds {
	if v6 {
		return icmpKinds{ipv6.ICMPTypeEchoRequest, ipv6.ICMPTypeEchoReply, ipv6.ICMPTypeDestinationUnreachable, ipv6.ICMPTypeTimeExceeded, protoICMPv6}
	}
	return icmpKinds{ipv4.ICMPTypeEcho, ipv4.ICMPTypeEchoReply, ipv4.ICMPTypeDestinationUnreachable, ipv4.ICMPTypeTimeExceeded, protoICMP}
}

// echoer pings dst over c and tells its answers from everything else the
// socket sees.
type echoer struct {
	c       net.PacketConn
	raw     bool // a raw socket; false for a ping socket
	dst     netip.Addr
	to      net.Addr
	kinds   icmpKinds
	id      int
	payload []byte
	seq     int
}

func newEchoer(c net.PacketConn, raw bool, dst netip.Addr) *echoer {
	var to net.Addr = &net.IPAddr{IP: dst.AsSlice(), Zone: dst.Zone()}
	if !raw {
		to = &net.UDPAddr{IP: dst.AsSlice(), Zone: dst.Zone()}
	}
	return &echoer{c: c, raw: raw, dst: dst, to: to, kinds: icmpKindsOf(dst.Is6()),
		id: rand.IntN(0xffff) + 1, payload: []byte(token())}
}

// send sends the next echo request.
func (e *echoer) send() error {
	e.seq++
	m := icmp.Message{Type: e.kinds.echo, Body: &icmp.Echo{ID: e.id, Seq: e.seq, Data: e.payload}}
	b, err := m.Marshal(nil) // the kernel fills the ICMPv6 checksum
	if err != nil {
		return err
	}
	_, err = e.c.WriteTo(b, e.to)
	return err
}

// await reads until our echo is answered, or the read fails (the deadline).
func (e *echoer) await(r *Result, iface string, start time.Time) {
	buf := make([]byte, 1500)
	for {
		n, from, err := e.c.ReadFrom(buf)
		if err != nil {
			r.Outcome, r.Evidence = classify(err, e.dst, iface)
			return
		}
		m, err := icmp.ParseMessage(e.kinds.proto, buf[:n])
		if err != nil {
			continue
		}
		if e.judge(r, m, addrOf(from), iface, start) {
			return
		}
	}
}

// judge records m in r if it answers our echo: a reply, or an error quoting
// it. It reports whether m did.
func (e *echoer) judge(r *Result, m *icmp.Message, from netip.Addr, iface string, start time.Time) bool {
	switch m.Type {
	case e.kinds.reply:
		ech, ok := m.Body.(*icmp.Echo)
		// Ping sockets rewrite the ID and demultiplex for us; raw ones see
		// every reply on the box, so match ID, source and payload.
		if !ok || string(ech.Data) != string(e.payload) || (e.raw && (ech.ID != e.id || from.WithZone("") != e.dst.WithZone(""))) {
			return false
		}
		r.Outcome, r.RTT, r.Answer = Open, time.Since(start), from.String()
		r.Evidence = fmt.Sprintf("echo reply seq %d", ech.Seq)
		return true
	case e.kinds.unreach, e.kinds.exceeded:
		if !quotesOurEcho(quotedPacket(m), e.dst.Is6(), e.dst, e.id, e.raw) {
			return false
		}
		r.RTT, r.Answer = time.Since(start), from.String()
		// The kernel sends itself host-unreachable when the next hop never
		// answered ARP/ND: that is silence on the wire.
		if failed, hop := neighbourFailed(e.dst, iface); failed {
			r.Outcome = Dropped
			r.Evidence = fmt.Sprintf("no ARP/ND reply from next hop %s", hop)
			return true
		}
		r.Outcome = Refused
		r.Evidence = fmt.Sprintf("ICMP %v code %d from %s", m.Type, m.Code, from)
		return true
	}
	return false
}

// quotedPacket returns the original packet an ICMP error quotes.
func quotedPacket(m *icmp.Message) []byte {
	switch b := m.Body.(type) {
	case *icmp.DstUnreach:
		return b.Data
	case *icmp.TimeExceeded:
		return b.Data
	}
	return nil
}

func addrOf(a net.Addr) netip.Addr {
	var ip net.IP
	var zone string
	switch v := a.(type) {
	case *net.IPAddr:
		ip, zone = v.IP, v.Zone
	case *net.UDPAddr:
		ip, zone = v.IP, v.Zone
	}
	ad, _ := netip.AddrFromSlice(ip)
	return ad.Unmap().WithZone(zone)
}

// quotesOurEcho checks that an ICMP error quotes our echo request (the
// original IP header plus the first 8 bytes of our ICMP message).
func quotesOurEcho(data []byte, v6 bool, dst netip.Addr, id int, raw bool) bool {
	var hdrLen int
	var orig netip.Addr
	if v6 {
		if len(data) < 40+8 {
			return false
		}
		hdrLen = 40
		orig = netip.AddrFrom16([16]byte(data[24:40]))
	} else {
		if len(data) < 20 {
			return false
		}
		hdrLen = int(data[0]&0x0f) * 4
		if len(data) < hdrLen+8 {
			return false
		}
		orig = netip.AddrFrom4([4]byte(data[16:20]))
	}
	if orig != dst.WithZone("") {
		return false
	}
	echo := data[hdrLen:]
	return !raw || int(binary.BigEndian.Uint16(echo[4:6])) == id
}
