package probes

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

// resendEvery is how often the spoofing kinds repeat their frames within the
// window: poisoning must outlast the victim's own traffic correcting it.
const resendEvery = 100 * time.Millisecond

// watch sends with send() at once and every resendEvery until ctx ends, while
// reading every frame on pc; match says whether a frame is a sighting. It
// fills c.Sent/SendErrors/FirstSeen and returns the sightings and the first
// send error. A read error other than the deadline ends the window early and
// is returned as readErr.
func watch(ctx context.Context, pc *packetConn, c *Counts, send func() error, match func(frameInfo, []byte, uint8) bool) (seen int, sendErr, readErr error) {
	var sent, failed atomic.Int64
	var once sync.Once
	sendOnce := func() {
		if err := send(); err != nil {
			failed.Add(1)
			once.Do(func() { sendErr = err })
			return
		}
		sent.Add(1)
	}
	sendOnce()
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		t := time.NewTicker(resendEvery)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-t.C:
				sendOnce()
			}
		}
	}()
	deadline, _ := ctx.Deadline()
	_ = pc.setDeadline(deadline)
	buf := make([]byte, 65536)
	for {
		n, pt, err := pc.recv(buf)
		if err != nil {
			if !isDeadline(err) {
				readErr = err
			}
			break
		}
		if pt == pktOutgoing {
			continue
		}
		fi := parseFrame(buf[:n])
		if match(fi, buf[:n], pt) {
			seen++
			if c.FirstSeen == "" {
				c.FirstSeen = describeFrame(fi)
			}
		}
		if ctx.Err() != nil { // cancelled by a match that decided
			break
		}
	}
	close(done)
	wg.Wait()
	c.Sent, c.SendErrors = int(sent.Load()), int(failed.Load())
	return seen, sendErr, readErr
}

func describeFrame(fi frameInfo) string {
	s := fmt.Sprintf("%s > %s type %#04x", fi.Src, fi.Dst, fi.EtherType)
	if fi.IPSrc.IsValid() {
		s += fmt.Sprintf(" %s > %s proto %d", fi.IPSrc, fi.IPDst, fi.Proto)
	}
	if fi.ARPOp != 0 {
		s += fmt.Sprintf(" arp op %d %s is %s", fi.ARPOp, fi.ARPSPA, fi.ARPSHA)
	}
	return s
}

// finish sets the outcome of a watching kind.
func finish(r *Result, seen int, sendErr, readErr error, what string) {
	if readErr != nil {
		r.Outcome, r.Evidence = CheckFailed, "capture failed: "+readErr.Error()
		return
	}
	r.Outcome, r.Evidence = outcomeOfSightings(r.Counts, seen, sendErr, what)
	if r.Outcome == Open {
		r.Answer = r.Counts.FirstSeen
	}
}

// probeSpoofUDP sends the marker from Spoof.SrcIP to Target:Port through a
// raw IP socket (the kernel routes it and resolves the next hop), and counts
// replies that come back to this box. The reply goes to the forged source,
// so open means it reached us anyway (flooded, or we own the address); the
// claim's real evidence is the receivers' hits carrying the marker.
func probeSpoofUDP(ctx context.Context, s Spec, r *Result) {
	dst := netip.MustParseAddr(s.Target).Unmap()
	src := netip.MustParseAddr(s.Spoof.SrcIP).Unmap()
	ifi, _, err := linkFor(s.Iface, dst)
	if err != nil {
		r.Outcome, r.Evidence = CheckFailed, err.Error()
		return
	}
	if _, err := routeCheck(dst, ifi.Name); err != nil {
		r.Outcome, r.Evidence = CheckFailed, err.Error()
		return
	}
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.IPPROTO_RAW)
	if err != nil {
		r.Outcome, r.Evidence = CheckFailed, "raw IP socket: "+err.Error()
		return
	}
	defer unix.Close(fd)
	if err := unix.SetsockoptString(fd, unix.SOL_SOCKET, unix.SO_BINDTODEVICE, ifi.Name); err != nil {
		r.Outcome, r.Evidence = CheckFailed, "bind raw socket to "+ifi.Name+": "+err.Error()
		return
	}
	pc, err := openPacket(ifi.Name)
	if err != nil {
		r.Outcome, r.Evidence = CheckFailed, err.Error()
		return
	}
	defer pc.Close()
	sport := uint16(s.Spoof.SrcPort)
	if sport == 0 {
		sport = 40000
	}
	marker := []byte(r.Counts.Marker)
	pkt := udpPacket(netip.AddrPortFrom(src, sport), netip.AddrPortFrom(dst, uint16(s.Port)), marker)
	if s.Spoof.BadChecksum {
		pkt[20+6] ^= 0xff // the UDP checksum after the 20-byte IPv4 header (spoof-udp refuses an IPv6 source)
	}
	if s.Spoof.TimestampOption {
		pkt = withTimestampOption(pkt)
	}
	if s.Spoof.ErrorAbout != "" {
		if pkt, err = icmpErrorAbout(src, dst, s.Spoof.ErrorAbout, marker); err != nil {
			r.Outcome, r.Evidence = CheckFailed, err.Error()
			return
		}
	}
	to := &unix.SockaddrInet4{Addr: dst.As4()}
	send := func() error { return unix.Sendto(fd, pkt, 0, to) }
	match := func(fi frameInfo, _ []byte, _ uint8) bool {
		return fi.IPSrc == dst && fi.IPDst == src && fi.SPort == uint16(s.Port) && fi.DPort == sport && bytes.Contains(fi.L4, marker)
	}
	r.Local = fmt.Sprintf("%s (forged) via %s", netip.AddrPortFrom(src, sport), ifi.Name)
	seen, sendErr, readErr := watch(ctx, pc, r.Counts, send, match)
	r.Counts.Replies = seen
	finish(r, seen, sendErr, readErr, "replies to the forged source reached us")
}

// probeARPSpoof claims Spoof.VictimIP with our MAC: an is-at reply to Target
// (unicast when Target answers who-has, else broadcast) and a gratuitous
// request, repeated, while counting IPv4 frames for the victim's address
// that arrive here. Open: we captured the victim's traffic (the poisoning
// worked and nothing stopped it); dropped: none arrived (the host's
// neighbour table, read by the drill, is the other half of the evidence).
func probeARPSpoof(ctx context.Context, s Spec, r *Result) {
	victim := netip.MustParseAddr(s.Spoof.VictimIP).Unmap()
	ifi, _, err := linkFor(s.Iface, victim)
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
	me := ifi.HardwareAddr
	tellIP, tellMAC := victim, broadcastMAC
	if s.Target != "" {
		tellIP = netip.MustParseAddr(s.Target).Unmap()
		if m, ok := resolveMAC(ctx, ifi, tellIP); ok {
			tellMAC = m
		}
	}
	reply := ethFrame(tellMAC, me, false, etherARP, arpPacket(2, me, victim, tellMACOrZero(tellMAC), tellIP))
	gratuitous := ethFrame(broadcastMAC, me, false, etherARP, arpPacket(1, me, victim, nil, victim))
	send := func() error {
		if err := pc.send(reply); err != nil {
			return err
		}
		return pc.send(gratuitous)
	}
	match := func(fi frameInfo, _ []byte, _ uint8) bool {
		return fi.EtherType == etherIPv4 && fi.IPDst == victim
	}
	r.Local = fmt.Sprintf("%s is-at %s, told %s (%s)", victim, me, tellIP, tellMAC)
	seen, sendErr, readErr := watch(ctx, pc, r.Counts, send, match)
	r.Counts.Captured = seen
	finish(r, seen, sendErr, readErr, "frames for "+victim.String()+" captured")
}

func tellMACOrZero(m net.HardwareAddr) net.HardwareAddr {
	if bytes.Equal(m, broadcastMAC) {
		return nil
	}
	return m
}

// probeMACSpoof sends frames whose source is Spoof.VictimMAC (an ARP probe
// and a broadcast UDP datagram with the marker), repeated, while counting
// frames addressed to the victim's MAC (or IP) that arrive here: a bridge
// that learned the victim's MAC on our port forwards them to us.
func probeMACSpoof(ctx context.Context, s Spec, r *Result) {
	vmac, _ := net.ParseMAC(s.Spoof.VictimMAC)
	var vip netip.Addr
	if s.Spoof.VictimIP != "" {
		vip = netip.MustParseAddr(s.Spoof.VictimIP).Unmap()
	}
	ifi, own, err := linkFor(s.Iface, vip)
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
	probeTPA := vip
	if !probeTPA.IsValid() {
		probeTPA = own
	}
	if !probeTPA.IsValid() {
		probeTPA = netip.AddrFrom4([4]byte{192, 0, 2, 1})
	}
	srcIP := own
	if !srcIP.IsValid() {
		srcIP = netip.IPv4Unspecified()
	}
	arpProbe := ethFrame(broadcastMAC, vmac, false, etherARP, arpPacket(1, vmac, netip.IPv4Unspecified(), nil, probeTPA))
	udpB := ethFrame(broadcastMAC, vmac, false, etherIPv4,
		udpPacket(netip.AddrPortFrom(srcIP, 40001), netip.AddrPortFrom(netip.AddrFrom4([4]byte{255, 255, 255, 255}), 9), []byte(r.Counts.Marker)))
	// A raw ethertype too: no netfilter hook in front of the bridge sees it (br_netfilter
	// hands only IP and ARP to inet/arp tables), so it measures whether the bridge learns the
	// victim's MAC from our port — what the FDB poisoning claim is about.
	raw := ethFrame(broadcastMAC, vmac, false, EtherExperimental, padTo([]byte(r.Counts.Marker), 46))
	send := func() error {
		for _, f := range [][]byte{arpProbe, udpB, raw} {
			if err := pc.send(f); err != nil {
				return err
			}
		}
		return nil
	}
	match := func(fi frameInfo, _ []byte, _ uint8) bool {
		return bytes.Equal(fi.Dst, vmac) || (vip.IsValid() && fi.IPDst == vip)
	}
	r.Local = fmt.Sprintf("frames from %s on %s", vmac, ifi.Name)
	seen, sendErr, readErr := watch(ctx, pc, r.Counts, send, match)
	r.Counts.Captured = seen
	finish(r, seen, sendErr, readErr, "frames for the victim captured")
}

// resolveMAC asks who-has ip with our real identity, briefly; false when
// nobody answers (the caller falls back to broadcast).
func resolveMAC(ctx context.Context, ifi *net.Interface, ip netip.Addr) (net.HardwareAddr, bool) {
	ctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	r := Result{}
	probeARP(ctx, Spec{Kind: KindARP, Target: ip.String(), Iface: ifi.Name, Timeout: 300 * time.Millisecond}, &r)
	if r.Outcome != Open {
		return nil, false
	}
	m, err := net.ParseMAC(r.Answer)
	return m, err == nil
}
