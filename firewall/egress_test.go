package firewall

import (
	"bytes"
	"encoding/binary"
	"net"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// TestEgressGuardAlone proves the guard's egress chain as a layer of its own: with no NAT
// anywhere in the lab (no Incus, no wall) a box's datagram reaches the public decoy with the
// box's own address (the control: the probe sees un-NATed egress); with the guard's egress
// chain alone it never leaves; with the wall's masquerade beside it the decoy sees the
// uplink address (the guard drops nothing NATed).
func TestEgressGuardAlone(t *testing.T) {
	t.Parallel()
	l := newWallLab(t)
	public := listenRecorder(t, l.wan, "udp4", hostPort(wlPublic, 7100))
	seen := func() string {
		tok := token("egress")
		if err := sendUDP(l.box, "udp4", "", hostPort(wlPublic, 7100), tok); err != nil {
			return "check-failed: " + err.Error()
		}
		return public.wait(tok)
	}
	s := l.spec().Resolved()
	egressOnly := func() { t.Helper(); guardEgress(t, l, s) }

	l.noWall(t)
	must(t, RemovePart(s, PartGuard))
	if got := seen(); got != wlBox {
		t.Fatalf("control, no NAT and no guard: the decoy saw %q, want the box's own %s", got, wlBox)
	}
	egressOnly()
	if got := seen(); got != dropped {
		t.Errorf("the guard's egress chain alone: the decoy saw %q, want %s (un-NATed egress never leaves)", got, dropped)
	}
	l.loadWall(t)
	l.flushConntrack(t)
	if got := seen(); got != wlUp {
		t.Errorf("wall and guard egress: the decoy saw %q, want the uplink %s (NATed egress passes the guard)", got, wlUp)
	}
	must(t, RemovePart(s, PartGuard))
	l.loadWall(t, wNATMasq)
	l.flushConntrack(t)
	if got := seen(); got != wlBox {
		t.Errorf("hole, the wall without its masquerade and no guard: the decoy saw %q, want the box's own %s", got, wlBox)
	}
}

// TestWallDropsInvalid: a datagram with a wrong UDP checksum is invalid to conntrack, so no
// NAT chain sees it; forwarded, it would reach the uplink with the box's own address. The
// wall's invalid drop alone keeps it in (the wall's masquerade cannot help); without that
// rule it arrives un-NATed. A raw socket on the far side hears what UDP sockets drop.
func TestWallDropsInvalid(t *testing.T) {
	t.Parallel()
	l := newWallLab(t)
	rec := rawUDPRecorder(t, l.wan)
	send := func() string {
		tok := token("invalid")
		pkt := udpBadChecksum(wlBox, wlPublic, 40001, 7100, tok)
		if err := sendIPFrame(l.box, l.boxIf, l.gwMAC, pkt); err != nil {
			return "check-failed: " + err.Error()
		}
		return rec.wait(tok)
	}
	l.noWall(t)
	must(t, RemovePart(l.spec(), PartGuard))
	if got := send(); got != wlBox {
		t.Fatalf("control, no wall and no guard: the far side heard %q, want the box's own %s", got, wlBox)
	}
	l.applyWall(t)
	if got := send(); got != dropped {
		t.Errorf("the wall alone: the far side heard %q, want %s (invalid is never forwarded)", got, dropped)
	}
	l.applyWall(t, wFwdInvalid)
	if got := send(); got != wlBox {
		t.Errorf("hole, the wall without its invalid drop: the far side heard %q, want the box's own %s (un-NATed: its masquerade never sees an invalid packet)", got, wlBox)
	}
}

// udpBadChecksum is an IPv4 UDP packet whose UDP checksum is wrong on purpose.
func udpBadChecksum(src, dst string, sport, dport uint16, payload string) []byte {
	pkt := udpPacket4(src, dst, sport, dport, payload)
	cs := checksum(append(udpPseudo(pkt), pkt[20:]...))
	binary.BigEndian.PutUint16(pkt[26:], ^cs) // never the right one (and never 0: "no checksum")
	if ^cs == 0 || ^cs == cs {
		binary.BigEndian.PutUint16(pkt[26:], 0x1234)
	}
	return pkt
}

func udpPseudo(pkt []byte) []byte {
	p := make([]byte, 12)
	copy(p[0:8], pkt[12:20])
	p[9] = unix.IPPROTO_UDP
	binary.BigEndian.PutUint16(p[10:], uint16(len(pkt)-20))
	return p
}

// sendIPFrame sends an IPv4 packet as a frame to dstMAC out of ifindex in ns.
func sendIPFrame(ns netns.NsHandle, ifindex int, dstMAC net.HardwareAddr, pkt []byte) error {
	return inNS(ns, func() error {
		fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_DGRAM, int(htons(unix.ETH_P_IP)))
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		sa := &unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_IP), Ifindex: ifindex, Halen: 6}
		copy(sa.Addr[:], dstMAC)
		return unix.Sendto(fd, pkt, 0, sa)
	})
}

// rawRecorder hears every packet of one protocol delivered to ns (a raw socket gets its copy
// before UDP checks the checksum) and finds tokens anywhere in them.
type rawRecorder struct {
	mu   sync.Mutex
	pkts [][]byte
}

func rawUDPRecorder(t *testing.T, ns netns.NsHandle) *rawRecorder {
	return rawRecorderFor(t, ns, unix.IPPROTO_UDP)
}

func rawRecorderFor(t *testing.T, ns netns.NsHandle, proto int) *rawRecorder {
	t.Helper()
	r := &rawRecorder{}
	var fd int
	must(t, inNS(ns, func() (err error) {
		fd, err = unix.Socket(unix.AF_INET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, proto)
		return err
	}))
	f := os.NewFile(uintptr(fd), "raw")
	t.Cleanup(func() { f.Close() })
	go func() {
		buf := make([]byte, 65536)
		for {
			n, err := f.Read(buf)
			if err != nil {
				return
			}
			if n >= 20 {
				r.mu.Lock()
				r.pkts = append(r.pkts, append([]byte(nil), buf[:n]...))
				r.mu.Unlock()
			}
		}
	}()
	return r
}

// packet returns the packet that carried the token, waiting up to a second.
func (r *rawRecorder) packet(tok string) []byte {
	for deadline := time.Now().Add(time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		r.mu.Lock()
		for _, p := range r.pkts {
			if bytes.Contains(p, []byte(tok)) {
				r.mu.Unlock()
				return p
			}
		}
		r.mu.Unlock()
	}
	return nil
}

// wait returns the source the token came from, or dropped.
func (r *rawRecorder) wait(tok string) string {
	if p := r.packet(tok); p != nil {
		return net.IP(p[12:16]).String()
	}
	return dropped
}

// TestIPOptionsNeverLeave: a router fills an IPv4 timestamp option (flag 1) with the address
// of the interface the packet came in by, so a box's datagram carrying one leaves with the
// gateway's address in its header, NATed or not. The wall's forward drop and the guard's
// egress drop each keep it in alone; with neither it arrives, the gateway's address inside.
func TestIPOptionsNeverLeave(t *testing.T) {
	t.Parallel()
	l := newWallLab(t)
	rec := rawUDPRecorder(t, l.wan)
	var last []byte
	send := func() string {
		tok := token("ipopt")
		pkt := udpWithTimestampOption(wlBox, wlPublic, 40002, 7100, tok)
		if err := sendIPFrame(l.box, l.boxIf, l.gwMAC, pkt); err != nil {
			return "check-failed: " + err.Error()
		}
		got := rec.wait(tok)
		if p := rec.packet(tok); p != nil {
			last = p[:int(p[0]&0x0f)*4]
		}
		return got
	}
	s := l.spec().Resolved()
	l.noWall(t)
	must(t, RemovePart(s, PartGuard))
	if got := send(); got != wlBox || !bytes.Contains(last, net.ParseIP(wlGW).To4()) {
		t.Fatalf("control, no wall and no guard: heard %q with header % x, want the box's %s with the gateway %s in its timestamp option", got, last, wlBox, wlGW)
	}
	l.applyWall(t)
	if got := send(); got != dropped {
		t.Errorf("the wall alone: heard %q, want %s", got, dropped)
	}
	l.applyWall(t, wFwdIPOptions)
	if got := send(); got == dropped {
		t.Fatalf("hole, the wall without its options drop: %s, want it heard", got)
	}
	guardEgress(t, l, s)
	if got := send(); got != dropped {
		t.Errorf("the wall without its options drop, the guard's egress beside it: heard %q, want %s", got, dropped)
	}
}

// guardEgress loads the guard's egress chain alone into the guard table (its other chains
// empty), conntrack flushed.
func guardEgress(t *testing.T, l *wallLab, s Spec) {
	t.Helper()
	must(t, RemovePart(s, PartGuard))
	obs, err := Read(s.Bridge)
	must(t, err)
	_, gt := TableNames(s.Bridge)
	var guardOnly Observed
	for _, ts := range obs.Tables {
		if ts.Name == gt {
			guardOnly.Tables = append(guardOnly.Tables, ts)
		}
	}
	var rules []Rule
	for _, r := range Desired(s) {
		if r.Table == gt && r.Chain == EgressChain {
			rules = append(rules, r)
		}
	}
	must(t, applyRules(s, guardOnly, rules, false))
	l.flushConntrack(t)
}

// udpWithTimestampOption is an IPv4 UDP packet whose header carries an empty timestamp
// option (type 68, flag 1: each router records its address and a timestamp).
func udpWithTimestampOption(src, dst string, sport, dport uint16, payload string) []byte {
	opt := []byte{68, 12, 5, 0x01, 0, 0, 0, 0, 0, 0, 0, 0} // room for one address and one timestamp
	plain := udpPacket4(src, dst, sport, dport, payload)
	pkt := append(append(append([]byte{}, plain[:20]...), opt...), plain[20:]...)
	pkt[0] = 0x40 | byte((20+len(opt))/4)
	binary.BigEndian.PutUint16(pkt[2:], uint16(len(pkt)))
	pkt[10], pkt[11] = 0, 0
	binary.BigEndian.PutUint16(pkt[10:], checksum(pkt[:20+len(opt)]))
	return pkt
}

// TestRelatedErrorsNeverLeaveUnNATed: an ICMP error a box makes about one of the host's own
// flows is related to that flow, which has no source NAT, so no masquerade rewrites it. With
// neither layer it reaches the far side from the box's own address; the wall's related drop
// alone and the guard's egress drop alone each keep it in.
func TestRelatedErrorsNeverLeaveUnNATed(t *testing.T) {
	t.Parallel()
	l := newWallLab(t)
	rec := rawRecorderFor(t, l.wan, unix.IPPROTO_ICMP)
	listenUDP(t, l.wan, hostPort(wlPublic, 7200))
	s := l.spec().Resolved()
	send := func() string {
		// The host's own flow: wlUp:port → wlPublic:7200.
		var c net.Conn
		must(t, inNS(l.host, func() (err error) { c, err = net.Dial("udp4", hostPort(wlPublic, 7200)); return }))
		defer c.Close()
		if _, err := c.Write([]byte("host flow")); err != nil {
			return "check-failed: " + err.Error()
		}
		hostPortNum := uint16(c.LocalAddr().(*net.UDPAddr).Port)
		tok := token("related")
		pkt := icmpPortUnreachable(wlBox, wlPublic, wlPublic, wlUp, 7200, hostPortNum, tok)
		if err := sendIPFrame(l.box, l.boxIf, l.gwMAC, pkt); err != nil {
			return "check-failed: " + err.Error()
		}
		return rec.wait(tok)
	}
	l.noWall(t)
	must(t, RemovePart(s, PartGuard))
	if got := send(); got != wlBox {
		t.Fatalf("control, no wall and no guard: the far side heard %q, want the box's own %s", got, wlBox)
	}
	l.applyWall(t)
	if got := send(); got != dropped {
		t.Errorf("the wall alone: heard %q, want %s", got, dropped)
	}
	l.applyWall(t, wFwdRelatedRaw)
	if got := send(); got != wlBox {
		t.Errorf("hole, the wall without its related drop: heard %q, want the box's own %s (its masquerade never sees a related packet)", got, wlBox)
	}
	guardEgress(t, l, s)
	if got := send(); got != dropped {
		t.Errorf("the wall without its related drop, the guard's egress beside it: heard %q, want %s", got, dropped)
	}
}

// icmpPortUnreachable is an ICMP port unreachable from src to dst about a UDP datagram
// innerSrc:sport → innerDst:dport, the token after its header.
func icmpPortUnreachable(src, dst, innerSrc, innerDst string, sport, dport uint16, tok string) []byte {
	inner := udpPacket4(innerSrc, innerDst, sport, dport, tok)
	icmp := append([]byte{3, 3, 0, 0, 0, 0, 0, 0}, inner...)
	binary.BigEndian.PutUint16(icmp[2:], checksum(icmp))
	pkt := make([]byte, 20, 20+len(icmp))
	pkt[0], pkt[8], pkt[9] = 0x45, 64, unix.IPPROTO_ICMP
	binary.BigEndian.PutUint16(pkt[2:], uint16(20+len(icmp)))
	copy(pkt[12:16], net.ParseIP(src).To4())
	copy(pkt[16:20], net.ParseIP(dst).To4())
	binary.BigEndian.PutUint16(pkt[10:], checksum(pkt[:20]))
	return append(pkt, icmp...)
}
