package firewall

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
)

// Every kernel-touching test runs in network namespaces it creates, so the
// host's ruleset is never read or written and tests run in parallel with
// anyone else's. Traffic never leaves these namespaces.

func requireRoot(tb testing.TB) {
	tb.Helper()
	if os.Geteuid() != 0 {
		tb.Skip("needs root: network namespaces and nftables")
	}
}

// freshNS locks the calling goroutine to its thread and moves the thread into
// a new, empty network namespace until the test ends.
func freshNS(tb testing.TB) netns.NsHandle {
	tb.Helper()
	requireRoot(tb)
	runtime.LockOSThread()
	orig, err := netns.Get()
	if err != nil {
		runtime.UnlockOSThread()
		tb.Fatalf("netns.Get: %v", err)
	}
	ns, err := netns.New()
	if err != nil {
		orig.Close()
		runtime.UnlockOSThread()
		tb.Fatalf("netns.New: %v", err)
	}
	tb.Cleanup(func() {
		if err := netns.Set(orig); err != nil {
			// Leave the thread locked: the runtime discards it when the
			// goroutine ends, so no other goroutine inherits this namespace.
			tb.Errorf("restore netns: %v", err)
			return
		}
		orig.Close()
		ns.Close()
		runtime.UnlockOSThread()
	})
	setUp(tb, ns, "lo")
	return ns
}

// sideNS makes another namespace without leaving the current one.
func sideNS(tb testing.TB) netns.NsHandle {
	tb.Helper()
	cur, err := netns.Get()
	if err != nil {
		tb.Fatal(err)
	}
	defer cur.Close()
	ns, err := netns.New()
	if err != nil {
		tb.Fatal(err)
	}
	if err := netns.Set(cur); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { ns.Close() })
	setUp(tb, ns, "lo")
	return ns
}

func handle(tb testing.TB, ns netns.NsHandle) *netlink.Handle {
	tb.Helper()
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(h.Close)
	return h
}

func setUp(tb testing.TB, ns netns.NsHandle, name string) {
	tb.Helper()
	h := handle(tb, ns)
	l, err := h.LinkByName(name)
	if err != nil {
		tb.Fatalf("link %s: %v", name, err)
	}
	if err := h.LinkSetUp(l); err != nil {
		tb.Fatalf("up %s: %v", name, err)
	}
}

// nsPath names a namespace handle for child processes.
func nsPath(ns netns.NsHandle) string {
	return fmt.Sprintf("/proc/%d/fd/%d", os.Getpid(), int(ns))
}

// nft runs the nft CLI inside ns (tests only: to read back and to tamper).
func nft(tb testing.TB, ns netns.NsHandle, args ...string) string {
	tb.Helper()
	out, err := nftErr(ns, args...)
	if err != nil {
		tb.Fatalf("nft %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return out
}

func nftErr(ns netns.NsHandle, args ...string) (string, error) {
	if _, err := exec.LookPath("nft"); err != nil {
		return "", err
	}
	cmd := exec.Command("nsenter", append([]string{"--net=" + nsPath(ns), "nft"}, args...)...)
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// nftStdin feeds script to `nft -f -` inside ns.
func nftStdin(ns netns.NsHandle, script string) (string, error) {
	cmd := exec.Command("nsenter", "--net="+nsPath(ns), "nft", "-f", "-")
	cmd.Stdin = strings.NewReader(script)
	out, err := cmd.CombinedOutput()
	return string(out), err
}

func requireNft(tb testing.TB) {
	tb.Helper()
	for _, bin := range []string{"nft", "nsenter"} {
		if _, err := exec.LookPath(bin); err != nil {
			tb.Skipf("needs %s: %v", bin, err)
		}
	}
}

// inNS runs fn on a fresh OS thread inside ns. The thread is never unlocked,
// so it dies with the goroutine and its namespace cannot leak.
func inNS(ns netns.NsHandle, fn func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		if err := netns.Set(ns); err != nil {
			errc <- err
			return
		}
		errc <- fn()
	}()
	return <-errc
}

// lab is a bridge with its gateway address in the test's namespace (the
// "host"), two boxes each in its own namespace on a veth port, and a second
// host address (not the gateway's) on loopback.
type lab struct {
	host, box1, box2 netns.NsHandle
	bridge           string
	gw, b1, b2, alt  net.IP
	ports            []PortBinding // the boxes' ports, as a bind round would bind them
}

func (l *lab) spec() Spec { return Spec{Bridge: l.bridge, Gateway: l.gw} }

// boundSpec is spec with both boxes bound: only a bound box port speaks for the subnet to
// the host (the L2 ranges), as a claudebox box once its start is bound.
func (l *lab) boundSpec() Spec {
	s := l.spec()
	s.Ports = l.ports
	return s
}

func newLab(t *testing.T) *lab {
	t.Helper()
	l := &lab{
		host:   freshNS(t),
		bridge: "cbfw0",
		gw:     net.IPv4(10, 77, 12, 1).To4(),
		b1:     net.IPv4(10, 77, 12, 11).To4(),
		b2:     net.IPv4(10, 77, 12, 12).To4(),
		alt:    net.IPv4(10, 77, 99, 1).To4(),
	}
	l.box1, l.box2 = sideNS(t), sideNS(t)
	h := handle(t, l.host)

	br := &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: l.bridge}}
	must(t, h.LinkAdd(br))
	must(t, h.AddrAdd(br, &netlink.Addr{IPNet: &net.IPNet{IP: l.gw, Mask: net.CIDRMask(24, 32)}}))
	must(t, h.LinkSetUp(br))

	// No dummy driver in this kernel; loopback holds the extra host address.
	lo, err := h.LinkByName("lo")
	must(t, err)
	must(t, h.AddrAdd(lo, &netlink.Addr{IPNet: &net.IPNet{IP: l.alt, Mask: net.CIDRMask(32, 32)}}))

	for i, box := range []struct {
		ns netns.NsHandle
		ip net.IP
	}{{l.box1, l.b1}, {l.box2, l.b2}} {
		port, peer := fmt.Sprintf("cbfwp%d", i+1), fmt.Sprintf("cbfwv%d", i+1)
		veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: port, MasterIndex: br.Attrs().Index}, PeerName: peer}
		must(t, h.LinkAdd(veth))
		must(t, h.LinkSetUp(veth))
		p, err := h.LinkByName(peer)
		must(t, err)
		must(t, h.LinkSetNsFd(p, int(box.ns)))

		bh := handle(t, box.ns)
		p, err = bh.LinkByName(peer)
		must(t, err)
		must(t, bh.LinkSetName(p, "eth0"))
		must(t, bh.AddrAdd(p, &netlink.Addr{IPNet: &net.IPNet{IP: box.ip, Mask: net.CIDRMask(24, 32)}}))
		ip, _ := netip.AddrFromSlice(box.ip.To4())
		l.ports = append(l.ports, PortBinding{Port: port, MAC: p.Attrs().HardwareAddr, IPv4: ip})
		must(t, bh.LinkSetUp(p))
		// Boxes route everything via the gateway, as under Incus.
		must(t, bh.RouteAdd(&netlink.Route{LinkIndex: p.Attrs().Index, Gw: l.gw}))
	}
	return l
}

func must(tb testing.TB, err error) {
	tb.Helper()
	if err != nil {
		tb.Fatal(err)
	}
}

// Probe outcomes, as in the drill.
const (
	open    = "open"
	refused = "refused"
	dropped = "dropped"
)

const probeTimeout = 400 * time.Millisecond

func classify(err error) string {
	var ne net.Error
	switch {
	case err == nil:
		return open
	case errors.Is(err, syscall.ECONNREFUSED):
		return refused
	case errors.As(err, &ne) && ne.Timeout():
		return dropped
	}
	return "check-failed: " + err.Error()
}

func tcpProbe(ns netns.NsHandle, addr string) string {
	var out string
	_ = inNS(ns, func() error {
		c, err := net.DialTimeout("tcp4", addr, probeTimeout)
		if err == nil {
			c.Close()
		}
		out = classify(err)
		return nil
	})
	return out
}

// udpProbe sends a datagram and waits for the echo. Broadcast destinations
// use an unconnected socket, since the answer comes from a unicast address.
func udpProbe(ns netns.NsHandle, addr string) string {
	var out string
	_ = inNS(ns, func() error {
		dst, err := net.ResolveUDPAddr("udp4", addr)
		if err != nil {
			out = classify(err)
			return nil
		}
		var c *net.UDPConn
		if dst.IP.Equal(net.IPv4bcast) {
			c, err = net.ListenUDP("udp4", nil)
		} else {
			c, err = net.DialUDP("udp4", nil, dst)
		}
		if err != nil {
			out = classify(err)
			return nil
		}
		defer c.Close()
		if dst.IP.Equal(net.IPv4bcast) {
			_, err = c.WriteToUDP([]byte("probe"), dst)
		} else {
			_, err = c.Write([]byte("probe"))
		}
		if err != nil {
			out = classify(err)
			return nil
		}
		_ = c.SetReadDeadline(time.Now().Add(probeTimeout))
		buf := make([]byte, 64)
		_, _, err = c.ReadFromUDP(buf)
		out = classify(err)
		return nil
	})
	return out
}

// icmpProbe sends one echo request on a raw socket and waits for the reply.
func icmpProbe(ns netns.NsHandle, dst net.IP) string {
	var out string
	_ = inNS(ns, func() error {
		c, err := net.ListenPacket("ip4:icmp", "0.0.0.0")
		if err != nil {
			out = classify(err)
			return nil
		}
		defer c.Close()
		id := uint16(os.Getpid())
		msg := []byte{8, 0, 0, 0, byte(id >> 8), byte(id), 0, 1, 'c', 'b'}
		cs := checksum(msg)
		msg[2], msg[3] = byte(cs>>8), byte(cs)
		if _, err := c.WriteTo(msg, &net.IPAddr{IP: dst}); err != nil {
			out = classify(err)
			return nil
		}
		deadline := time.Now().Add(probeTimeout)
		_ = c.SetReadDeadline(deadline)
		buf := make([]byte, 1500)
		for {
			n, from, err := c.ReadFrom(buf)
			if err != nil {
				out = classify(err)
				return nil
			}
			if n >= 8 && buf[0] == 0 && buf[4] == byte(id>>8) && buf[5] == byte(id) &&
				from.(*net.IPAddr).IP.Equal(dst) {
				out = open
				return nil
			}
		}
	})
	return out
}

func checksum(b []byte) uint16 {
	var s uint32
	for i := 0; i+1 < len(b); i += 2 {
		s += uint32(b[i])<<8 | uint32(b[i+1])
	}
	if len(b)%2 == 1 {
		s += uint32(b[len(b)-1]) << 8
	}
	for s>>16 != 0 {
		s = s&0xffff + s>>16
	}
	return ^uint16(s)
}

// listenTCP accepts and closes connections on addr inside ns until the test ends.
func listenTCP(t *testing.T, ns netns.NsHandle, addr string) {
	t.Helper()
	var ln net.Listener
	must(t, inNS(ns, func() (err error) { ln, err = net.Listen("tcp4", addr); return }))
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
}

// listenUDP echoes datagrams on addr inside ns until the test ends.
func listenUDP(t *testing.T, ns netns.NsHandle, addr string) {
	t.Helper()
	var pc net.PacketConn
	must(t, inNS(ns, func() (err error) { pc, err = net.ListenPacket("udp4", addr); return }))
	t.Cleanup(func() { pc.Close() })
	go func() {
		buf := make([]byte, 1500)
		for {
			n, from, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			_, _ = pc.WriteTo(buf[:n], from)
		}
	}()
}
