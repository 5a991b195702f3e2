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
	v6 := dst.Is6()
	c, raw, err := icmpConn(ctx, v6, s.Iface)
	if err != nil {
		r.Outcome, r.Evidence = CheckFailed, err.Error()
		return
	}
	defer c.Close()
	deadline, _ := ctx.Deadline()
	_ = c.SetReadDeadline(deadline)

	var echoType, replyType, unreachType icmp.Type = ipv4.ICMPTypeEcho, ipv4.ICMPTypeEchoReply, ipv4.ICMPTypeDestinationUnreachable
	var exceededType icmp.Type = ipv4.ICMPTypeTimeExceeded
	proto := protoICMP
	if v6 {
		echoType, replyType, unreachType = ipv6.ICMPTypeEchoRequest, ipv6.ICMPTypeEchoReply, ipv6.ICMPTypeDestinationUnreachable
		exceededType, proto = ipv6.ICMPTypeTimeExceeded, protoICMPv6
	}
	var to net.Addr = &net.IPAddr{IP: dst.AsSlice(), Zone: dst.Zone()}
	if !raw {
		to = &net.UDPAddr{IP: dst.AsSlice(), Zone: dst.Zone()}
	}
	id := rand.IntN(0xffff) + 1
	payload := []byte(token())
	seq := 0
	send := func() error {
		seq++
		m := icmp.Message{Type: echoType, Body: &icmp.Echo{ID: id, Seq: seq, Data: payload}}
		b, err := m.Marshal(nil) // the kernel fills the ICMPv6 checksum
		if err != nil {
			return err
		}
		_, err = c.WriteTo(b, to)
		return err
	}
	start := time.Now()
	if err := send(); err != nil {
		r.Outcome, r.Evidence = classify(err, dst, s.Iface)
		return
	}
	defer resendUntil(s.Timeout, func() { _ = send() })()
	buf := make([]byte, 1500)
	for {
		n, from, err := c.ReadFrom(buf)
		if err != nil {
			r.Outcome, r.Evidence = classify(err, dst, s.Iface)
			return
		}
		m, err := icmp.ParseMessage(proto, buf[:n])
		if err != nil {
			continue
		}
		fromAddr := addrOf(from)
		switch m.Type {
		case replyType:
			e, ok := m.Body.(*icmp.Echo)
			// Ping sockets rewrite the ID and demultiplex for us; raw ones see
			// every reply on the box, so match ID, source and payload.
			if !ok || string(e.Data) != string(payload) || (raw && (e.ID != id || fromAddr.WithZone("") != dst.WithZone(""))) {
				continue
			}
			r.Outcome, r.RTT, r.Answer = Open, time.Since(start), fromAddr.String()
			r.Evidence = fmt.Sprintf("echo reply seq %d", e.Seq)
			return
		case unreachType, exceededType:
			var data []byte
			switch b := m.Body.(type) {
			case *icmp.DstUnreach:
				data = b.Data
			case *icmp.TimeExceeded:
				data = b.Data
			}
			if !quotesOurEcho(data, v6, dst, id, raw) {
				continue
			}
			r.RTT, r.Answer = time.Since(start), fromAddr.String()
			// The kernel sends itself host-unreachable when the next hop never
			// answered ARP/ND: that is silence on the wire.
			if failed, hop := neighbourFailed(dst, s.Iface); failed {
				r.Outcome = Dropped
				r.Evidence = fmt.Sprintf("no ARP/ND reply from next hop %s", hop)
				return
			}
			r.Outcome = Refused
			r.Evidence = fmt.Sprintf("ICMP %v code %d from %s", m.Type, m.Code, fromAddr)
			return
		}
	}
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
