package probes

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strings"
	"sync"
	"time"

	"github.com/claudebox/claudebox/internal/netdump"
	"github.com/vishvananda/netlink"
)

// FrameHit is a frame the capture listener recorded (Hit.Proto "frame").
type FrameHit struct {
	// Reason: "marker" (a drill marker anywhere in the frame) or
	// "unexpected-source" (addressed to this box — unicast to our MAC,
	// broadcast or multicast — from a MAC that is neither ours, the
	// gateway's nor allowed).
	Reason    string `json:"reason"`
	SrcMAC    string `json:"src_mac"`
	DstMAC    string `json:"dst_mac"`
	EtherType string `json:"ethertype"`
	Marker    string `json:"marker,omitempty"`
	Summary   string `json:"summary,omitempty"`
}

// captureRepeat: the same (reason, source, destination, ethertype, marker)
// is recorded again at most this often, so a flood cannot fill the hits file.
const captureRepeat = 10 * time.Second

type capturer struct {
	l       *Listeners
	iface   string
	allow   map[string]bool
	mu      sync.Mutex // guards gw and gwAsked (read from the loop only, but cheap)
	gw      map[string]bool
	gwAsked time.Time
	last    map[string]time.Time
}

// startCapture opens the capture socket now when it can, so a permission
// error fails Serve; an interface that does not exist yet (PID 1 before
// Incus hands over eth0) is retried in the background.
func (l *Listeners) startCapture(iface string, allow []string) error {
	c := &capturer{l: l, iface: iface, allow: map[string]bool{}, gw: map[string]bool{}, last: map[string]time.Time{}}
	for _, m := range allow {
		hw, err := net.ParseMAC(m)
		if err != nil {
			return fmt.Errorf("capture allow %q: %w", m, err)
		}
		c.allow[hw.String()] = true
	}
	pc, err := openPacket(iface)
	if err != nil && !isNoDevice(err) {
		return fmt.Errorf("capture on %s: %w", iface, err)
	}
	l.wg.Add(1)
	go func() {
		defer l.wg.Done()
		var bo backoff
		for pc == nil {
			if !bo.wait(l.done) {
				return
			}
			pc, _ = openPacket(iface)
		}
		c.loop(pc)
	}()
	return nil
}

func isNoDevice(err error) bool {
	return strings.Contains(err.Error(), "no such network interface")
}

func (c *capturer) loop(pc *packetConn) {
	c.l.mu.Lock()
	closed := isClosed(c.l.done) // Close has begun: it will not see this closer
	if !closed {
		c.l.closer = append(c.l.closer, pc.Close)
	}
	c.l.mu.Unlock()
	if closed {
		_ = pc.Close()
		return
	}
	me := pc.ifi.HardwareAddr.String()
	buf := make([]byte, 65536)
	var bo backoff
	for {
		n, pt, err := pc.recv(buf)
		if err != nil {
			if errors.Is(err, net.ErrClosed) || !bo.wait(c.l.done) {
				return
			}
			continue
		}
		bo.reset()
		if pt == pktOutgoing {
			continue
		}
		if h, ok := c.judge(buf[:n], pt, me); ok {
			c.l.record(h)
		}
	}
}

func isClosed(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

// judge decides whether a frame is worth a hit, and builds it.
func (c *capturer) judge(b []byte, pt uint8, me string) (Hit, bool) {
	fi := parseFrame(b)
	fh := FrameHit{SrcMAC: fi.Src.String(), DstMAC: fi.Dst.String(), EtherType: fmt.Sprintf("%#04x", fi.EtherType)}
	if m := findMarker(b); m != "" {
		fh.Reason, fh.Marker = "marker", m
	} else if pt != pktOtherHost && fh.SrcMAC != me && !c.allow[fh.SrcMAC] && !c.isGateway(fh.SrcMAC) {
		fh.Reason = "unexpected-source"
	} else {
		return Hit{}, false
	}
	key := strings.Join([]string{fh.Reason, fh.SrcMAC, fh.DstMAC, fh.EtherType, fh.Marker}, "|")
	now := time.Now()
	if t, ok := c.last[key]; ok && now.Sub(t) < captureRepeat {
		return Hit{}, false
	}
	if len(c.last) > 4096 {
		c.last = map[string]time.Time{}
	}
	c.last[key] = now
	fh.Summary = describeFrame(fi)
	h := Hit{Proto: "frame", Peer: fh.SrcMAC, Local: c.iface, Frame: &fh}
	if fi.IPSrc.IsValid() {
		h.Peer = fh.SrcMAC + " " + fi.IPSrc.String()
	}
	if fi.Proto == 17 {
		h.Port = int(fi.DPort)
	}
	if fh.Marker != "" {
		h.Payload = fh.Marker
	}
	return h, true
}

// gatewayReread: the capture reads the neighbour table again on a miss at most this often.
const gatewayReread = 500 * time.Millisecond

// isGateway: mac is the neighbour entry of an IPv4/IPv6 default gateway.
// The table is re-read on a miss at most twice a second.
func (c *capturer) isGateway(mac string) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.gw[mac] {
		return true
	}
	if time.Since(c.gwAsked) < gatewayReread {
		return false
	}
	c.gwAsked = time.Now()
	for _, fam := range []int{netlink.FAMILY_V4, netlink.FAMILY_V6} {
		rs, _ := netdump.Routes(nil, fam)
		for _, rt := range rs {
			if rt.Gw == nil {
				continue
			}
			gw, _ := netip.AddrFromSlice(rt.Gw)
			ns, _ := netdump.Neighs(rt.LinkIndex, fam)
			for _, n := range ns {
				if a, ok := netip.AddrFromSlice(n.IP); ok && a.Unmap() == gw.Unmap() && len(n.HardwareAddr) == 6 {
					c.gw[n.HardwareAddr.String()] = true
				}
			}
		}
	}
	return c.gw[mac]
}
