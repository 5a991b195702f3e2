package probes

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"
)

// flooder holds the flood's shared counters; the senders and the echo reader
// update it under mu.
type flooder struct {
	s       Spec
	marker  []byte
	mu      sync.Mutex
	c       *Counts
	through map[string]bool
	udpSet  map[netip.AddrPort]bool
	err     error // the first send error
}

func (f *flooder) note(fn func(c *Counts)) {
	f.mu.Lock()
	defer f.mu.Unlock()
	fn(f.c)
}

// probeFlood keeps blocked destinations under steady fire for Duration, so a
// window in which a layer is absent (an Incus re-apply) lets something
// through and this probe counts it. Open: anything connected or echoed;
// refused: no echo or connect, but a TCP RST/ICMP came back; dropped: silence;
// check-failed: nothing could be sent, or a target has no route.
func probeFlood(ctx context.Context, s Spec, r *Result) {
	fl := s.Flood
	f := &flooder{s: s, marker: []byte(r.Counts.Marker), c: r.Counts, through: map[string]bool{}, udpSet: map[netip.AddrPort]bool{}}
	var udp, tcp []netip.AddrPort
	for _, t := range fl.UDP {
		ap := netip.MustParseAddrPort(t)
		udp, f.udpSet[unmapAP(ap)] = append(udp, ap), true
	}
	for _, t := range fl.TCP {
		tcp = append(tcp, netip.MustParseAddrPort(t))
	}
	for _, ap := range append(append([]netip.AddrPort{}, udp...), tcp...) {
		if _, err := routeCheck(ap.Addr(), s.Iface); err != nil {
			r.Outcome, r.Evidence = CheckFailed, err.Error()
			return
		}
	}
	lc := net.ListenConfig{Control: bindControl(s.Iface)}
	pc, err := lc.ListenPacket(ctx, "udp", ":0")
	if err != nil {
		r.Outcome, r.Evidence = CheckFailed, "flood socket: "+err.Error()
		return
	}
	defer pc.Close()
	r.Local = pc.LocalAddr().String()
	readerDone := make(chan struct{})
	go func() { defer close(readerDone); f.readEchoes(pc) }()

	floodCtx, stop := context.WithTimeout(ctx, fl.Duration.D())
	defer stop()
	tail := ctx
	if ch, ok := ctx.Value(floodStopKey{}).(<-chan struct{}); ok {
		// A detached run (the soak) ends its floods when told, then waits stoppedTail for
		// late echoes instead of the rest of its timeout.
		tailCtx, endTail := context.WithCancel(ctx)
		defer endTail()
		tail = tailCtx
		go func() {
			select {
			case <-ch:
				stop()
				select {
				case <-time.After(stoppedTail):
					endTail()
				case <-tailCtx.Done():
				}
			case <-floodCtx.Done():
			}
		}()
	}
	var wg sync.WaitGroup
	start := time.Now()
	if len(udp) > 0 {
		wg.Add(1)
		go func() { defer wg.Done(); f.sendUDP(floodCtx, pc, udp) }()
	}
	if len(tcp) > 0 {
		wg.Add(1)
		go func() { defer wg.Done(); f.connectTCP(floodCtx, tail, tcp) }()
	}
	wg.Wait()
	// Late echoes: wait out the probe's tail (its deadline ends it).
	<-tail.Done()
	_ = pc.Close()
	<-readerDone
	f.verdict(r, time.Since(start))
}

type floodStopKey struct{}

// stoppedTail is how long a stopped flood still reads late echoes.
const stoppedTail = 500 * time.Millisecond

// WithFloodStop makes every flood run under ctx end early when stop closes (the probe's
// tail for late echoes still runs): a detached run's floods last until it is told to stop.
func WithFloodStop(ctx context.Context, stop <-chan struct{}) context.Context {
	return context.WithValue(ctx, floodStopKey{}, stop)
}

func unmapAP(ap netip.AddrPort) netip.AddrPort {
	return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
}

func (f *flooder) sendUDP(ctx context.Context, pc net.PacketConn, targets []netip.AddrPort) {
	every := f.s.Flood.UDPEvery.D()
	if every <= 0 {
		every = time.Millisecond
	}
	t := time.NewTicker(every)
	defer t.Stop()
	for i := 0; ; i++ {
		ap := targets[i%len(targets)]
		_, err := pc.WriteTo(f.marker, net.UDPAddrFromAddrPort(ap))
		f.note(func(c *Counts) {
			if err != nil {
				c.SendErrors++
				if f.err == nil {
					f.err = err
				}
				return
			}
			c.Sent++
		})
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// connectTCP starts one connect every TCPEvery; each may run into the
// probe's tail (probeCtx), so a SYN sent late in the window still counts.
func (f *flooder) connectTCP(floodCtx, probeCtx context.Context, targets []netip.AddrPort) {
	every := f.s.Flood.TCPEvery.D()
	if every <= 0 {
		every = 20 * time.Millisecond
	}
	t := time.NewTicker(every)
	defer t.Stop()
	var wg sync.WaitGroup
	defer wg.Wait()
	sem := make(chan struct{}, 64) // bounded: a silent target must not pile up sockets
	d := net.Dialer{Control: bindControl(f.s.Iface), Timeout: 500 * time.Millisecond}
	for i := 0; ; i++ {
		select {
		case sem <- struct{}{}:
			ap := targets[i%len(targets)]
			f.note(func(c *Counts) { c.TCPAttempts++ })
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer func() { <-sem }()
				f.connectOnce(probeCtx, &d, ap)
			}()
		default: // all 64 in flight: skip this tick
		}
		select {
		case <-floodCtx.Done():
			return
		case <-t.C:
		}
	}
}

func (f *flooder) connectOnce(ctx context.Context, d *net.Dialer, ap netip.AddrPort) {
	c, err := d.DialContext(ctx, "tcp", ap.String())
	f.note(func(cn *Counts) {
		switch {
		case err == nil:
			cn.TCPConnected++
			f.through["tcp/"+ap.String()] = true
		case errors.Is(err, syscall.ECONNREFUSED):
			cn.TCPRefused++
		case f.err == nil && !isTimeout(err):
			f.err = err // kept for a flood that sent nothing
		}
	})
	if err == nil {
		_ = c.Close()
	}
}

func (f *flooder) readEchoes(pc net.PacketConn) {
	buf := make([]byte, 2048)
	for {
		n, from, err := pc.ReadFrom(buf)
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			continue // ICMP errors surface here on some kernels; not ours to judge
		}
		ua, ok := from.(*net.UDPAddr)
		if !ok || string(buf[:n]) != string(f.marker) {
			continue
		}
		ap := unmapAP(ua.AddrPort())
		if !f.udpSet[ap] {
			continue
		}
		f.note(func(c *Counts) {
			c.UDPEchoes++
			f.through["udp/"+ap.String()] = true
		})
	}
}

func (f *flooder) verdict(r *Result, ran time.Duration) {
	f.mu.Lock()
	defer f.mu.Unlock()
	c := f.c
	for t := range f.through {
		c.Through = append(c.Through, t)
	}
	sort.Strings(c.Through)
	summary := fmt.Sprintf("%v: %d datagrams sent (%d errors), %d echoed; %d TCP connects, %d connected, %d refused",
		ran.Round(time.Millisecond), c.Sent, c.SendErrors, c.UDPEchoes, c.TCPAttempts, c.TCPConnected, c.TCPRefused)
	switch {
	case c.Sent == 0 && c.TCPAttempts == 0:
		r.Outcome, r.Evidence = CheckFailed, "flood sent nothing: "+fmt.Sprint(f.err)
	case c.UDPEchoes > 0 || c.TCPConnected > 0:
		r.Outcome, r.Evidence = Open, summary
		r.Answer = strings.Join(c.Through, " ")
	case c.TCPRefused > 0:
		r.Outcome, r.Evidence = Refused, summary
	case c.Sent == 0 && len(f.s.Flood.UDP) > 0:
		r.Outcome, r.Evidence = CheckFailed, fmt.Sprintf("%s; no datagram could be sent: %v", summary, f.err)
	default:
		r.Outcome, r.Evidence = Dropped, summary
	}
}
