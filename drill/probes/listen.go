package probes

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"time"

	"golang.org/x/net/ipv4"
	"golang.org/x/net/ipv6"
)

// StateDir is where the agent keeps what the engine reads with `exec cat`.
const StateDir = "/run/claudebox-probe"

// DefaultHitsFile is the JSON-lines log of who reached the listeners.
const DefaultHitsFile = StateDir + "/hits.jsonl"

// Default listener ports of the scratch image.
const (
	DefaultTCPPort = 7001
	DefaultUDPPort = 7002
)

// ListenerConfig says what to serve. Every port listens on all addresses,
// IPv4 and IPv6 (link-local included).
type ListenerConfig struct {
	TCP []int `json:"tcp"`
	UDP []int `json:"udp"`
	// HitsFile gets one JSON Hit per line, appended; empty means memory only.
	HitsFile string `json:"hits_file,omitempty"`
	// Banner is written to every TCP peer (default names the host and port).
	Banner string `json:"banner,omitempty"`
	// Capture names an interface to watch with AF_PACKET (empty: off): frames
	// carrying a drill marker and frames addressed to this box from an
	// unexpected source MAC become Hits with Proto "frame", so "B hears
	// nothing" is observable. CaptureAllow lists source MACs that are
	// expected besides our own and the default gateway's.
	Capture      string   `json:"capture,omitempty"`
	CaptureAllow []string `json:"capture_allow,omitempty"`
}

// Hit is one peer reaching a listener.
type Hit struct {
	Time  time.Time `json:"time"`
	Proto string    `json:"proto"` // "tcp", "udp" or "frame"
	Port  int       `json:"port"`
	// Peer is who connected ("198.18.0.1:40112", "[fe80::1%eth0]:40112").
	Peer string `json:"peer"`
	// Local is the address that was reached, so the engine can tell which of
	// the target's addresses let the peer in.
	Local string `json:"local,omitempty"`
	// Payload is the start of a UDP datagram (the prober's token), or a
	// frame's marker.
	Payload string `json:"payload,omitempty"`
	// Frame: what the capture listener saw (Proto "frame"); Peer is then the
	// source MAC (and IP), Local the interface.
	Frame *FrameHit `json:"frame,omitempty"`
}

// Listeners is a running set of TCP and UDP echo listeners.
type Listeners struct {
	cfg    ListenerConfig
	mu     sync.Mutex
	hits   []Hit
	file   *os.File
	closer []func() error
	wg     sync.WaitGroup
	// done closes on Close: it wakes read loops out of their backoff.
	done      chan struct{}
	closeOnce sync.Once
	stopCtx   func() bool
	host      string
	// Bound reports the ports actually bound (useful with port 0 in tests).
	TCPAddrs []net.Addr
	UDPAddrs []net.Addr
}

// Serve starts the listeners and returns once every socket is bound (so
// sockets are created in the caller's network namespace). They stop when ctx
// ends or Close is called.
func Serve(ctx context.Context, cfg ListenerConfig) (*Listeners, error) {
	l := &Listeners{cfg: cfg, done: make(chan struct{})}
	l.host, _ = os.Hostname()
	if cfg.HitsFile != "" {
		if err := os.MkdirAll(filepath.Dir(cfg.HitsFile), 0o755); err != nil {
			return nil, err
		}
		f, err := os.OpenFile(cfg.HitsFile, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
		if err != nil {
			return nil, err
		}
		l.file = f
	}
	fail := func(err error) (*Listeners, error) {
		l.Close()
		return nil, err
	}
	for _, p := range cfg.TCP {
		// "tcp" on the wildcard is one dual-stack socket (IPv4-mapped peers
		// come back as plain IPv4), or IPv4 only where IPv6 is off.
		ln, err := net.Listen("tcp", ":"+strconv.Itoa(p))
		if err != nil {
			return fail(fmt.Errorf("tcp listener on %d: %w", p, err))
		}
		l.TCPAddrs = append(l.TCPAddrs, ln.Addr())
		l.closer = append(l.closer, ln.Close)
		l.wg.Add(1)
		go l.acceptLoop(ln)
	}
	for _, p := range cfg.UDP {
		if err := l.serveUDP(p); err != nil {
			return fail(err)
		}
	}
	if cfg.Capture != "" {
		if err := l.startCapture(cfg.Capture, cfg.CaptureAllow); err != nil {
			return fail(err)
		}
	}
	// AfterFunc instead of a goroutine parked on ctx.Done: with a context
	// that never ends, that goroutine would outlive Close.
	stop := context.AfterFunc(ctx, func() { _ = l.Close() })
	l.mu.Lock()
	l.stopCtx = stop
	l.mu.Unlock()
	return l, nil
}

// serveUDP binds one socket per family so each reply can leave from the
// address the datagram was sent to (IP_PKTINFO/IPV6_PKTINFO). Without that,
// a host holding several addresses answers from the wrong one and the
// prober's connected socket never sees the echo.
func (l *Listeners) serveUDP(port int) error {
	c4, err := net.ListenPacket("udp4", "0.0.0.0:"+strconv.Itoa(port))
	if err != nil {
		return fmt.Errorf("udp listener on %d: %w", port, err)
	}
	l.UDPAddrs = append(l.UDPAddrs, c4.LocalAddr())
	l.closer = append(l.closer, c4.Close)
	p4 := ipv4.NewPacketConn(c4)
	if err := p4.SetControlMessage(ipv4.FlagDst|ipv4.FlagInterface, true); err != nil {
		return fmt.Errorf("udp listener on %d: pktinfo: %w", port, err)
	}
	bound := c4.LocalAddr().(*net.UDPAddr).Port
	l.wg.Add(1)
	go l.echoLoop(bound, read4(p4, bound))
	c6, err := net.ListenPacket("udp6", "[::]:"+strconv.Itoa(bound))
	if err != nil {
		// A box with IPv6 switched off still serves IPv4.
		return nil
	}
	l.UDPAddrs = append(l.UDPAddrs, c6.LocalAddr())
	l.closer = append(l.closer, c6.Close)
	p6 := ipv6.NewPacketConn(c6)
	if err := p6.SetControlMessage(ipv6.FlagDst|ipv6.FlagInterface, true); err != nil {
		return fmt.Errorf("udp6 listener on %d: pktinfo: %w", port, err)
	}
	l.wg.Add(1)
	go l.echoLoop(bound, read6(p6, bound))
	return nil
}

// readEcho reads one datagram and returns who sent it, the local address it
// reached, and how to echo it from there.
type readEcho func(buf []byte) (n int, from net.Addr, local string, echo func([]byte), err error)

// echoLoop records and echoes every datagram until the socket closes.
func (l *Listeners) echoLoop(port int, read readEcho) {
	defer l.wg.Done()
	buf := make([]byte, 65536)
	var bo backoff
	for {
		n, from, local, echo, err := read(buf)
		if err != nil {
			if errors.Is(err, net.ErrClosed) || !bo.wait(l.done) {
				return
			}
			continue
		}
		bo.reset()
		// Record before echoing: a prober that saw its echo can rely on the hit.
		l.record(Hit{Proto: "udp", Port: port, Peer: from.String(), Local: local, Payload: truncate(string(buf[:n]), 64)})
		echo(buf[:n])
	}
}

func read4(p4 *ipv4.PacketConn, bound int) readEcho {
	return func(buf []byte) (int, net.Addr, string, func([]byte), error) {
		n, cm, from, err := p4.ReadFrom(buf)
		if err != nil {
			return 0, nil, "", nil, err
		}
		var wcm *ipv4.ControlMessage
		local := ""
		if cm != nil {
			// Answer from the address that was asked, unless it was a
			// broadcast: no datagram can leave from one (EINVAL), and an
			// echo to a broadcast probe (a VLAN-0 frame) is evidence.
			if !cm.Dst.Equal(net.IPv4bcast) && !cm.Dst.IsMulticast() {
				wcm = &ipv4.ControlMessage{Src: cm.Dst}
			}
			local = net.JoinHostPort(cm.Dst.String(), strconv.Itoa(bound))
		}
		return n, from, local, func(b []byte) { _, _ = p4.WriteTo(b, wcm, from) }, nil
	}
}

func read6(p6 *ipv6.PacketConn, bound int) readEcho {
	return func(buf []byte) (int, net.Addr, string, func([]byte), error) {
		n, cm, from, err := p6.ReadFrom(buf)
		if err != nil {
			return 0, nil, "", nil, err
		}
		var wcm *ipv6.ControlMessage
		local := ""
		if cm != nil {
			wcm = &ipv6.ControlMessage{Src: cm.Dst, IfIndex: cm.IfIndex}
			if cm.Dst.IsMulticast() { // as for IPv4 broadcast: let the kernel pick
				wcm.Src = nil
			}
			if a, ok := netip.AddrFromSlice(cm.Dst); ok {
				if a.IsLinkLocalUnicast() {
					if ifi, err := net.InterfaceByIndex(cm.IfIndex); err == nil {
						a = a.WithZone(ifi.Name)
					}
				}
				local = netip.AddrPortFrom(a, uint16(bound)).String()
			}
		}
		return n, from, local, func(b []byte) { _, _ = p6.WriteTo(b, wcm, from) }, nil
	}
}

func (l *Listeners) acceptLoop(ln net.Listener) {
	defer l.wg.Done()
	port := ln.Addr().(*net.TCPAddr).Port
	banner := l.cfg.Banner
	if banner == "" {
		banner = fmt.Sprintf("claudebox-probe %s tcp %d", l.host, port)
	}
	var bo backoff
	for {
		c, err := ln.Accept()
		if err != nil {
			// EMFILE and friends: back off instead of spinning.
			if errors.Is(err, net.ErrClosed) || !bo.wait(l.done) {
				return
			}
			continue
		}
		bo.reset()
		l.record(Hit{Proto: "tcp", Port: port, Peer: c.RemoteAddr().String(), Local: c.LocalAddr().String()})
		l.wg.Add(1) // the acceptLoop's own count keeps the group above zero here
		go func() {
			defer l.wg.Done()
			defer c.Close()
			_ = c.SetWriteDeadline(time.Now().Add(time.Second))
			_, _ = c.Write([]byte(banner + "\n"))
		}()
	}
}

func (l *Listeners) record(h Hit) {
	h.Time = time.Now().UTC()
	l.mu.Lock()
	defer l.mu.Unlock()
	l.hits = append(l.hits, h)
	if l.file != nil {
		b, _ := json.Marshal(h)
		_, _ = l.file.Write(append(b, '\n')) // one write per line: O_APPEND keeps lines whole
	}
}

// Hits returns a copy of every hit so far.
func (l *Listeners) Hits() []Hit {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]Hit(nil), l.hits...)
}

// Close stops every listener and waits for their loops.
func (l *Listeners) Close() error {
	l.closeOnce.Do(func() {
		close(l.done)
		l.mu.Lock()
		stop := l.stopCtx
		l.mu.Unlock()
		if stop != nil {
			stop()
		}
	})
	l.mu.Lock()
	closers := l.closer
	l.closer = nil
	l.mu.Unlock()
	for _, c := range closers {
		_ = c()
	}
	l.wg.Wait()
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.file != nil {
		err := l.file.Close()
		l.file = nil
		return err
	}
	return nil
}

// ReadHits parses a hits file; a missing file means no hits yet.
func ReadHits(path string) ([]Hit, error) {
	f, err := os.Open(path)
	if errors.Is(err, os.ErrNotExist) {
		return []Hit{}, nil
	}
	if err != nil {
		return nil, err
	}
	defer f.Close()
	out := []Hit{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if len(sc.Bytes()) == 0 {
			continue
		}
		var h Hit
		if err := json.Unmarshal(sc.Bytes(), &h); err != nil {
			return out, fmt.Errorf("%s: bad line: %w", path, err)
		}
		out = append(out, h)
	}
	return out, sc.Err()
}
