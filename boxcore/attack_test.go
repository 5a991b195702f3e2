package boxcore_test

// Attack harness: what a hostile root in a box tries beyond the drill's rows. Runs only with
// CLAUDEBOX_ATTACK=1 (never in `make test`), on a stack of its own (teststack "atk"); traffic
// goes only to this machine's own addresses (checked with netlink RouteGet before each probe)
// and to a namespace the test creates.
//
//	CLAUDEBOX_ATTACK=1 go test ./boxcore -run TestAttack -v -count=1

import (
	"context"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/miekg/dns"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/claudebox/claudebox/boxcore"
	"github.com/claudebox/claudebox/boxcore/incus"
	"github.com/claudebox/claudebox/internal/testenv"
	"github.com/claudebox/claudebox/internal/teststack"
)

// mustLocal aborts unless the kernel delivers ip locally or routes it by bridge (a box).
func mustLocal(t *testing.T, ip net.IP, bridge string) {
	t.Helper()
	rs, err := netlink.RouteGet(ip)
	if err != nil || len(rs) == 0 {
		t.Fatalf("route get %s: %v", ip, err)
	}
	r := rs[0]
	if r.Type == unix.RTN_LOCAL {
		return
	}
	if l, err := netlink.LinkByIndex(r.LinkIndex); err == nil && l.Attrs().Name == bridge {
		return
	}
	t.Fatalf("ABORT: %s is not routed locally or to bridge %s (%+v)", ip, bridge, r)
}

func csum(b []byte) uint16 {
	var s uint32
	for i := 0; i+1 < len(b); i += 2 {
		s += uint32(b[i])<<8 | uint32(b[i+1])
	}
	if len(b)%2 == 1 {
		s += uint32(b[len(b)-1]) << 8
	}
	for s > 0xffff {
		s = s&0xffff + s>>16
	}
	return ^uint16(s)
}

// ipv4Pkt builds an IPv4 header (with options, padded to 4 bytes) around payload.
func ipv4Pkt(src, dst net.IP, proto byte, ttl byte, opts []byte, payload []byte) []byte {
	for len(opts)%4 != 0 {
		opts = append(opts, 0)
	}
	hl := 20 + len(opts)
	l := hl + len(payload)
	h := []byte{byte(0x40 | hl/4), 0, byte(l >> 8), byte(l), byte(rand.IntN(256)), byte(rand.IntN(256)), 0, 0, ttl, proto, 0, 0}
	h = append(h, src.To4()...)
	h = append(h, dst.To4()...)
	h = append(h, opts...)
	binary.BigEndian.PutUint16(h[10:], csum(h))
	return append(h, payload...)
}

func udpPkt(src, dst net.IP, sport, dport uint16, payload []byte) []byte {
	return ipv4UDP(src, dst, sport, dport, payload)
}

func icmpEcho(src, dst net.IP, payload []byte) []byte {
	b := []byte{8, 0, 0, 0, 0x12, 0x34, 0, 1}
	b = append(b, payload...)
	binary.BigEndian.PutUint16(b[2:], csum(b))
	return ipv4Pkt(src, dst, 1, 64, nil, b)
}

func tcpSyn(src, dst net.IP, sport, dport uint16, payload []byte) []byte {
	th := make([]byte, 20)
	binary.BigEndian.PutUint16(th[0:], sport)
	binary.BigEndian.PutUint16(th[2:], dport)
	binary.BigEndian.PutUint32(th[4:], rand.Uint32())
	th[12] = 5 << 4
	th[13] = 0x02
	binary.BigEndian.PutUint16(th[14:], 64240)
	seg := append(th, payload...)
	ph := append(append(append([]byte{}, src.To4()...), dst.To4()...), 0, 6, byte(len(seg)>>8), byte(len(seg)))
	binary.BigEndian.PutUint16(seg[16:], csum(append(ph, seg...)))
	return ipv4Pkt(src, dst, 6, 64, nil, seg)
}

// hostListener is a UDP+TCP listener on every host address (0.0.0.0:port): it records
// markers received and echoes each UDP datagram back with an "echo-" marker.
type hostListener struct {
	port    int
	mu      sync.Mutex
	udp     map[string]string // marker -> source
	tcp     []string          // sources of accepted connections
	uc      *net.UDPConn
	tl      net.Listener
	closeMu sync.Once
}

func listenHost(t *testing.T) *hostListener {
	t.Helper()
	for range 20 {
		p := 40000 + rand.IntN(20000)
		uc, err := net.ListenUDP("udp4", &net.UDPAddr{Port: p})
		if err != nil {
			continue
		}
		tl, err := net.Listen("tcp4", fmt.Sprintf(":%d", p))
		if err != nil {
			uc.Close()
			continue
		}
		hl := &hostListener{port: p, udp: map[string]string{}, uc: uc, tl: tl}
		go func() {
			buf := make([]byte, 65536)
			for {
				n, from, err := uc.ReadFromUDP(buf)
				if err != nil {
					return
				}
				msg := string(buf[:n])
				if i := strings.Index(msg, "cbxmark:"); i >= 0 {
					name := strings.SplitN(msg[i+8:], ":", 2)[0]
					hl.mu.Lock()
					hl.udp[name] = from.String()
					hl.mu.Unlock()
					_, _ = uc.WriteToUDP([]byte(marker("echo-"+name)), from)
				}
			}
		}()
		go func() {
			for {
				c, err := tl.Accept()
				if err != nil {
					return
				}
				hl.mu.Lock()
				hl.tcp = append(hl.tcp, c.RemoteAddr().String())
				hl.mu.Unlock()
				c.Close()
			}
		}()
		t.Cleanup(hl.close)
		return hl
	}
	t.Fatal("no free port")
	return nil
}

func (h *hostListener) close() { h.closeMu.Do(func() { h.uc.Close(); h.tl.Close() }) }

func (h *hostListener) got(name string) (string, bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	s, ok := h.udp[name]
	return s, ok
}

func (h *hostListener) tcpFrom(ip net.IP) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	n := 0
	for _, s := range h.tcp {
		if strings.HasPrefix(s, ip.String()+":") {
			n++
		}
	}
	return n
}

// captureDir is capture that tells directions apart on a host-side port: toBox are frames
// the host sends into the box (PACKET_OUTGOING on the veth), fromBox the box's own.
func captureDir(t *testing.T, iface string, send func()) (toBox, fromBox []string) {
	t.Helper()
	to, from := map[string]bool{}, map[string]bool{}
	captureWhile(t, iface, time.Second, send, func(f []byte, ll *unix.SockaddrLinklayer) {
		if ll != nil && ll.Pkttype == unix.PACKET_OUTGOING {
			markersIn(f, to)
		} else {
			markersIn(f, from)
		}
	})
	return sortedSet(to), sortedSet(from)
}

type atkFixture struct {
	c       *incus.Client
	s       boxcore.Stack
	h       *boxcore.Host
	a, b    boxNIC
	gw      net.IP
	subnet  *net.IPNet
	brMAC   net.HardwareAddr
	hostIPs []net.IP // the host's addresses on interfaces other than the bridge and lo
}

// result is one attack's measured outcome.
type result struct {
	attack, outcome string
}

var results struct {
	sync.Mutex
	list []result
}

func record(t *testing.T, attack, format string, a ...any) {
	t.Helper()
	s := fmt.Sprintf(format, a...)
	t.Logf("RESULT %-40s %s", attack, s)
	results.Lock()
	results.list = append(results.list, result{attack, s})
	results.Unlock()
}

func TestAttack(t *testing.T) {
	if os.Getenv("CLAUDEBOX_ATTACK") != "1" {
		t.Skip("attack harness: set CLAUDEBOX_ATTACK=1")
	}
	c := testenv.RequireIncus(t)
	ctx := context.Background()
	s := teststack.New(t, c, "atk")
	bs := &boxcore.Boxes{Client: c, Stack: s, Version: "test"}
	img := teststack.ProbeImage(t, c)
	f := &atkFixture{c: c, s: s, h: boxcore.NewHost(c, s)}
	nics := mintTwo(t, ctx, bs, img, "cbt-atk")
	f.a, f.b = nics[0], nics[1]
	gwc := mustNetwork(t, c, s.Network).Config["ipv4.address"]
	var err error
	f.gw, f.subnet, err = net.ParseCIDR(gwc)
	if err != nil {
		t.Fatal(err)
	}
	f.gw = f.gw.To4()
	br, err := net.InterfaceByName(s.Network)
	if err != nil {
		t.Fatal(err)
	}
	f.brMAC = br.HardwareAddr
	ifs, _ := net.Interfaces()
	for _, ifi := range ifs {
		if ifi.Name == s.Network || ifi.Flags&net.FlagLoopback != 0 {
			continue
		}
		addrs, _ := ifi.Addrs()
		for _, ad := range addrs {
			if ipn, ok := ad.(*net.IPNet); ok && ipn.IP.To4() != nil {
				f.hostIPs = append(f.hostIPs, ipn.IP.To4())
			}
		}
	}
	t.Logf("stack %s gw %s; a %s %s %s; b %s %s %s; host addrs %v", s.Network, f.gw, f.a.veth, f.a.mac, f.a.ip, f.b.veth, f.b.mac, f.b.ip, f.hostIPs)
	if r := mustCheck(t, f.h); !r.OK {
		t.Fatalf("stack not converged: %v", driftItems(r))
	}

	t.Run("LinkLocalGroupMAC", f.linkLocalGroupMAC)
	t.Run("LinkLocalGroupMore", f.linkLocalMore)
	t.Run("BroadcastMulticast", f.broadcastMulticast)
	t.Run("IPOptions", f.ipOptions)
	t.Run("Fragments", f.fragments)
	t.Run("DNS", f.dnsTricks)
	t.Run("UplinkOnLink", f.uplinkOnLink)

	results.Lock()
	defer results.Unlock()
	for _, r := range results.list {
		t.Logf("SUMMARY %-40s %s", r.attack, r.outcome)
	}
}

// pick returns a host address outside the blocked ranges, on another interface (the uplink's).
func (f *atkFixture) otherHostIP() net.IP {
	for _, ip := range f.hostIPs {
		if !ip.IsPrivate() && !strings.HasPrefix(ip.String(), "100.") && !ip.IsLinkLocalUnicast() {
			return ip
		}
	}
	return nil
}

// linkLocalGroupMAC: frames to 01:80:c2:00:00:0X (X≠0,1) are not forwarded by the bridge but
// passed up on the *port* device (veth), not the bridge: every inet rule that matches
// `iifname "<bridge>"` (the wall, the guard, Incus's in.<B> and ACL chains) misses them.
func (f *atkFixture) linkLocalGroupMAC(t *testing.T) {
	hl := listenHost(t)
	a := f.a
	targets := []net.IP{f.gw}
	if o := f.otherHostIP(); o != nil {
		targets = append(targets, o)
	}
	for _, ip := range targets {
		mustLocal(t, ip, f.s.Network)
	}
	type tc struct {
		name   string
		dstMAC net.HardwareAddr
		dst    net.IP
	}
	var cases []tc
	for _, ip := range targets {
		for _, x := range []byte{0x03, 0x0e, 0x0f} {
			cases = append(cases, tc{fmt.Sprintf("ll%02x-udp-%s", x, ip), net.HardwareAddr{1, 0x80, 0xc2, 0, 0, x}, ip})
		}
		// control: the same datagram by the ordinary path (dst MAC = the bridge's)
		cases = append(cases, tc{"ctl-bridgemac-udp-" + ip.String(), f.brMAC, ip})
	}
	var frames []frameCase
	for _, c := range cases {
		frames = append(frames, frameCase{name: c.name, frame: ether(c.dstMAC, a.mac, 0x0800,
			udpPkt(a.ip, c.dst, 40123, uint16(hl.port), []byte(marker(c.name))))})
	}
	ll := net.HardwareAddr{1, 0x80, 0xc2, 0, 0, 0x03}
	frames = append(frames,
		frameCase{name: "ll03-icmp-gw", frame: ether(ll, a.mac, 0x0800, icmpEcho(a.ip, f.gw, []byte(marker("ll03-icmp-gw"))))},
		frameCase{name: "ctl-icmp-gw", frame: ether(f.brMAC, a.mac, 0x0800, icmpEcho(a.ip, f.gw, []byte(marker("ctl-icmp-gw"))))},
		frameCase{name: "ll03-tcp-gw", frame: ether(ll, a.mac, 0x0800, tcpSyn(a.ip, f.gw, 40124, uint16(hl.port), nil))},
		frameCase{name: "ll03-udp-127", frame: ether(ll, a.mac, 0x0800, udpPkt(a.ip, net.IPv4(127, 0, 0, 1), 40123, uint16(hl.port), []byte(marker("ll03-udp-127"))))},
	)
	toBox, fromBox := captureDir(t, a.veth, func() { sendFrom(t, f.c, a.name, frames) })
	time.Sleep(300 * time.Millisecond)
	t.Logf("a's port: to box %v; from box %v", toBox, fromBox)
	for _, c := range cases {
		src, ok := hl.got(c.name)
		echo := slices.Contains(toBox, "echo-"+c.name)
		switch {
		case ok:
			record(t, "box→host "+c.name, "HOLE: host listener %s:%d received it (from %s); echo back into the box: %v", c.dst, hl.port, src, echo)
			if !strings.HasPrefix(c.name, "ctl") {
				t.Errorf("HOLE: %s reached the host's listener (echo into box: %v)", c.name, echo)
			} else {
				t.Errorf("HOLE: control path %s reached the host", c.name)
			}
		default:
			record(t, "box→host "+c.name, "blocked (listener heard nothing)")
		}
	}
	// ICMP: the echo reply carries the same marker back into the box.
	for _, n := range []string{"ll03-icmp-gw", "ctl-icmp-gw"} {
		if slices.Contains(toBox, n) {
			record(t, "box→host "+n, "HOLE: the host answered the echo (reply into the box)")
			t.Errorf("HOLE: %s answered", n)
		} else {
			record(t, "box→host "+n, "blocked (no echo reply)")
		}
	}
	if n := hl.tcpFrom(a.ip); n > 0 {
		record(t, "box→host ll03-tcp-gw", "HOLE: %d TCP connections accepted", n)
	} else {
		record(t, "box→host ll03-tcp-gw", "no connection (tcp_v4_rcv drops non-PACKET_HOST; SYN-ACK seen in box: %v)", false)
	}
	if _, ok := hl.got("ll03-udp-127"); ok {
		record(t, "box→host ll03-udp-127", "HOLE: loopback reached")
		t.Errorf("HOLE: 127.0.0.1 reached")
	} else {
		record(t, "box→host ll03-udp-127", "blocked (martian)")
	}

	// The same with every layer that can be switched per box or per table off, to see
	// which layer (if any) would hold it: NIC filtering and port binding.
	restore, err := f.h.SwitchOff(context.Background(), []boxcore.Layer{boxcore.LayerNICFiltering, boxcore.LayerPortBinding, boxcore.LayerL2Ranges}, []string{a.name})
	if err != nil {
		t.Fatalf("switch off: %v", err)
	}
	a2 := nicOf(t, f.c, a.name)
	// IPv6 by the link-local group MAC to the host's port (disable_ipv6 on host veths?)
	v6 := ether(net.HardwareAddr{1, 0x80, 0xc2, 0, 0, 0x03}, a2.mac, 0x86dd, ipv6UDP("ll03-ipv6"))
	toBox2, _ := captureDir(t, a2.veth, func() {
		sendFrom(t, f.c, a.name, []frameCase{{name: "ll03-ipv6", frame: v6},
			{name: "ll03-udp-off", frame: ether(ll, a2.mac, 0x0800, udpPkt(a2.ip, f.gw, 40125, uint16(hl.port), []byte(marker("ll03-udp-off"))))},
			{name: "ll03-udp-10net", frame: ether(ll, a2.mac, 0x0800, udpPkt(a2.ip, net.IPv4(10, 0, 0, 1), 40125, uint16(hl.port), []byte(marker("ll03-udp-10net"))))},
		})
	})
	disable, _ := os.ReadFile("/proc/sys/net/ipv6/conf/" + a2.veth + "/disable_ipv6")
	t.Logf("layers off: to box %v; host veth disable_ipv6=%s", toBox2, strings.TrimSpace(string(disable)))
	_, ok := hl.got("ll03-udp-off")
	record(t, "box→host ll03-udp (NIC filter+binding+L2 off)", "received=%v", ok)
	if err := restore(context.Background()); err != nil {
		t.Fatalf("restore: %v", err)
	}
	if err := f.h.BindPorts(context.Background()); err != nil {
		t.Fatalf("bind: %v", err)
	}
	f.a = nicOf(t, f.c, a.name)
}

// broadcastMulticast: directed broadcast, limited broadcast, 224.0.0.x, mDNS, SSDP to siblings
// and the host.
func (f *atkFixture) broadcastMulticast(t *testing.T) {
	hl := listenHost(t)
	a, b := f.a, f.b
	bc := broadcast4(f.subnet)
	mcast := func(ip net.IP) net.HardwareAddr {
		ip = ip.To4()
		return net.HardwareAddr{1, 0, 0x5e, ip[1] & 0x7f, ip[2], ip[3]}
	}
	bcast := net.HardwareAddr{0xff, 0xff, 0xff, 0xff, 0xff, 0xff}
	type tc struct {
		name string
		mac  net.HardwareAddr
		dst  net.IP
		port uint16
	}
	cases := []tc{
		{"directed-bcast", bcast, bc, uint16(hl.port)},
		{"limited-bcast", bcast, net.IPv4bcast, uint16(hl.port)},
		{"allhosts-224.0.0.1", mcast(net.IPv4(224, 0, 0, 1)), net.IPv4(224, 0, 0, 1), uint16(hl.port)},
		{"mdns", mcast(net.IPv4(224, 0, 0, 251)), net.IPv4(224, 0, 0, 251), 5353},
		{"ssdp", mcast(net.IPv4(239, 255, 255, 250)), net.IPv4(239, 255, 255, 250), 1900},
		{"unicast-ip-bcast-mac-to-b", bcast, b.ip, uint16(hl.port)},
		{"unicast-ip-b-mac-gw", f.brMAC, b.ip, uint16(hl.port)},
	}
	var frames []frameCase
	for _, c := range cases {
		frames = append(frames, frameCase{name: c.name, frame: ether(c.mac, a.mac, 0x0800, udpPkt(a.ip, c.dst, 40200, c.port, []byte(marker(c.name))))})
	}
	var toB []string
	toB, _ = captureDir(t, b.veth, func() { sendFrom(t, f.c, a.name, frames) })
	time.Sleep(200 * time.Millisecond)
	for _, c := range cases {
		_, host := hl.got(c.name)
		sib := slices.Contains(toB, c.name)
		out := fmt.Sprintf("sibling got it: %v; host listener got it: %v", sib, host)
		if sib || host {
			t.Errorf("HOLE %s: %s", c.name, out)
			out = "HOLE: " + out
		} else {
			out = "blocked: " + out
		}
		record(t, "box→* "+c.name, "%s", out)
	}
}

func broadcast4(n *net.IPNet) net.IP {
	b := make(net.IP, 4)
	for i := range b {
		b[i] = n.IP.To4()[i] | ^n.Mask[i]
	}
	return b
}

// ipOptions: loose/strict source route via the gateway to the sibling, record-route, router
// alert.
func (f *atkFixture) ipOptions(t *testing.T) {
	hl := listenHost(t)
	a, b := f.a, f.b
	lsrr := func(typ byte, hop net.IP) []byte {
		return append([]byte{1, typ, 7, 4}, hop.To4()...) // NOP, opt, len 7, ptr 4, addr
	}
	cases := []struct {
		name string
		dst  net.IP
		opts []byte
	}{
		{"lsrr-via-gw-to-b", f.gw, lsrr(0x83, b.ip)},
		{"ssrr-via-gw-to-b", f.gw, lsrr(0x89, b.ip)},
		{"lsrr-to-b-via-gw", b.ip, lsrr(0x83, f.gw)},
		{"router-alert-gw", f.gw, []byte{0x94, 4, 0, 0}},
		{"rr-gw", f.gw, []byte{1, 7, 11, 4, 0, 0, 0, 0, 0, 0, 0, 0}},
	}
	var frames []frameCase
	for _, c := range cases {
		u := ipv4UDP(a.ip, c.dst, 40300, uint16(hl.port), []byte(marker(c.name)))[20:]
		frames = append(frames, frameCase{name: c.name, frame: ether(f.brMAC, a.mac, 0x0800, ipv4Pkt(a.ip, c.dst, 17, 64, c.opts, u))})
	}
	toB, _ := captureDir(t, b.veth, func() { sendFrom(t, f.c, a.name, frames) })
	time.Sleep(200 * time.Millisecond)
	for _, c := range cases {
		_, host := hl.got(c.name)
		sib := slices.Contains(toB, c.name)
		out := fmt.Sprintf("sibling: %v; host: %v", sib, host)
		if sib || host {
			t.Errorf("HOLE %s: %s", c.name, out)
			out = "HOLE: " + out
		} else {
			out = "blocked: " + out
		}
		record(t, "box→* ipopt "+c.name, "%s", out)
	}
}

// fragments: tiny first fragment (8 bytes: UDP header only), overlapping second that rewrites
// the destination port, to the gateway with dport 53 in the first fragment.
func (f *atkFixture) fragments(t *testing.T) {
	hl := listenHost(t)
	a := f.a
	frag := func(dst net.IP, id uint16, off int, mf bool, proto byte, data []byte) []byte {
		l := 20 + len(data)
		fo := uint16(off / 8)
		if mf {
			fo |= 0x2000
		}
		h := []byte{0x45, 0, byte(l >> 8), byte(l), byte(id >> 8), byte(id), byte(fo >> 8), byte(fo), 64, proto, 0, 0}
		h = append(h, a.ip.To4()...)
		h = append(h, dst.To4()...)
		binary.BigEndian.PutUint16(h[10:], csum(h))
		return append(h, data...)
	}
	var frames []frameCase
	for i, dst := range []net.IP{f.gw, f.otherHostIP()} {
		if dst == nil {
			continue
		}
		mustLocal(t, dst, f.s.Network)
		name := fmt.Sprintf("frag-overlap-%d", i)
		body := []byte(marker(name))
		// UDP header claiming dport 53 (what the accepts admit), checksum 0
		u53 := []byte{0x9c, 0x40, 0, 53, 0, byte(8 + len(body)), 0, 0}
		uP := []byte{0x9c, 0x40, byte(hl.port >> 8), byte(hl.port), 0, byte(8 + len(body)), 0, 0}
		id := uint16(rand.IntN(65535))
		frames = append(frames,
			frameCase{name: name + "a", frame: ether(f.brMAC, a.mac, 0x0800, frag(dst, id, 0, true, 17, u53))},
			frameCase{name: name + "b", frame: ether(f.brMAC, a.mac, 0x0800, frag(dst, id, 0, true, 17, uP))},
			frameCase{name: name + "c", frame: ether(f.brMAC, a.mac, 0x0800, frag(dst, id, 8, false, 17, body))},
		)
		// tiny fragments by the link-local path (LL group MAC) to the other host address
		ll := net.HardwareAddr{1, 0x80, 0xc2, 0, 0, 3}
		name2 := fmt.Sprintf("frag-ll-%d", i)
		body2 := []byte(marker(name2))
		id2 := uint16(rand.IntN(65535))
		frames = append(frames,
			frameCase{name: name2 + "a", frame: ether(ll, a.mac, 0x0800, frag(dst, id2, 0, true, 17, []byte{0x9c, 0x40, byte(hl.port >> 8), byte(hl.port), 0, byte(8 + len(body2)), 0, 0}))},
			frameCase{name: name2 + "b", frame: ether(ll, a.mac, 0x0800, frag(dst, id2, 8, false, 17, body2))},
		)
	}
	sendFrom(t, f.c, a.name, frames)
	time.Sleep(300 * time.Millisecond)
	for i := range 2 {
		for _, n := range []string{fmt.Sprintf("frag-overlap-%d", i), fmt.Sprintf("frag-ll-%d", i)} {
			if src, ok := hl.got(n); ok {
				record(t, "box→host "+n, "HOLE: reassembled datagram reached the host listener from %s", src)
				t.Errorf("HOLE %s", n)
			} else {
				record(t, "box→host "+n, "blocked")
			}
		}
	}
}

// dnsTricks asks the gateway's dnsmasq what a box could (from the host: dnsmasq answers the
// same data to anyone on the bridge).
func (f *atkFixture) dnsTricks(t *testing.T) {
	hn, _ := os.Hostname()
	srv := net.JoinHostPort(f.gw.String(), "53")
	rev := func(ip net.IP) string { r, _ := dns.ReverseAddr(ip.String()); return r }
	q := []struct {
		name  string
		qtype uint16
		tcp   bool
	}{
		{hn + ".", dns.TypeA, false},
		{hn + ".incus.", dns.TypeA, false},
		{"incus.", dns.TypeSOA, false},
		{"incus.", dns.TypeAXFR, true},
		{".", dns.TypeAXFR, true},
		{f.b.name + ".incus.", dns.TypeA, true},
		{f.b.name + ".", dns.TypeANY, true},
		{rev(f.gw), dns.TypePTR, false},
		{rev(f.b.ip), dns.TypePTR, false},
		{rev(net.IPv4(127, 0, 0, 1)), dns.TypePTR, false},
		{"localhost.", dns.TypeA, false},
		{"_gateway.", dns.TypeA, false},
		{"gateway.incus.", dns.TypeA, false},
		{"1.0.0.127.in-addr.arpa.", dns.TypePTR, true},
	}
	if o := f.otherHostIP(); o != nil {
		q = append(q, struct {
			name  string
			qtype uint16
			tcp   bool
		}{rev(o), dns.TypePTR, false})
	}
	for _, x := range q {
		m := new(dns.Msg)
		m.SetQuestion(x.name, x.qtype)
		m.SetEdns0(4096, true)
		cl := &dns.Client{Timeout: 2 * time.Second}
		if x.tcp {
			cl.Net = "tcp"
		}
		resp, _, err := cl.Exchange(m, srv)
		label := fmt.Sprintf("dns %s %s tcp=%v", x.name, dns.TypeToString[x.qtype], x.tcp)
		switch {
		case err != nil:
			record(t, label, "no answer (%v)", err)
		case len(resp.Answer) > 0:
			record(t, label, "ANSWER rcode %s: %v", dns.RcodeToString[resp.Rcode], resp.Answer)
			t.Logf("check: %s answered %v", label, resp.Answer)
		default:
			record(t, label, "rcode %s, no answer, %d ns", dns.RcodeToString[resp.Rcode], len(resp.Ns))
		}
	}
}

// uplinkOnLink: a box reaches the on-link subnet of an uplink (the host's LAN when it is not
// RFC1918). Simulated: a namespace joined by a veth that the stack admits as an uplink, with
// a connected /24 from 198.19.0.0/16 (RFC 2544) that the host does not route.
func (f *atkFixture) uplinkOnLink(t *testing.T) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	id := testenv.RunID()
	hostSide, nsSide, nsName := "cbatku"+id[:4], "cbatkn"+id[:4], "cbatk-"+id
	var prefix *net.IPNet
	for i := 0; i < 50; i++ {
		cand := net.IPv4(198, 19, byte(100+rand.IntN(150)), 0)
		rs, err := netlink.RouteGet(cand)
		if err != nil || len(rs) == 0 {
			continue
		}
		if l, err := netlink.LinkByIndex(rs[0].LinkIndex); err == nil && rs[0].Gw != nil {
			_ = l // routed by the default route only: free
			prefix = &net.IPNet{IP: cand.To4(), Mask: net.CIDRMask(24, 32)}
			break
		}
	}
	if prefix == nil {
		t.Fatal("no free 198.19.x.0/24")
	}
	hostIP := net.IPv4(prefix.IP[0], prefix.IP[1], prefix.IP[2], 1)
	neigh := net.IPv4(prefix.IP[0], prefix.IP[1], prefix.IP[2], 2)
	orig, _ := netns.Get()
	defer orig.Close()
	ns, err := netns.NewNamed(nsName)
	if err != nil {
		t.Fatal(err)
	}
	netns.Set(orig)
	t.Cleanup(func() { _ = netns.DeleteNamed(nsName); ns.Close() })
	veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: hostSide}, PeerName: nsSide}
	if err := netlink.LinkAdd(veth); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if l, err := netlink.LinkByName(hostSide); err == nil {
			_ = netlink.LinkDel(l)
		}
	})
	peer, _ := netlink.LinkByName(nsSide)
	if err := netlink.LinkSetNsFd(peer, int(ns)); err != nil {
		t.Fatal(err)
	}
	hl, _ := netlink.LinkByName(hostSide)
	_ = netlink.AddrAdd(hl, &netlink.Addr{IPNet: &net.IPNet{IP: hostIP, Mask: prefix.Mask}})
	_ = netlink.LinkSetUp(hl)
	// the neighbour inside the namespace
	cmd := func(args ...string) {
		out, err := exec.Command("ip", append([]string{"-n", nsName}, args...)...).CombinedOutput()
		if err != nil {
			t.Fatalf("ip %v: %v %s", args, err, out)
		}
	}
	cmd("link", "set", nsSide, "up")
	cmd("addr", "add", neigh.String()+"/24", "dev", nsSide)
	cmd("link", "set", "lo", "up")
	mustRouteVia(t, neigh, hostSide)

	// Admit it as an uplink of the test stack (the way the drill admits its public decoy).
	if err := f.h.SetAdmittedUplinks(context.Background(), []string{hostSide}); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = f.h.SetAdmittedUplinks(context.Background(), nil) }()
	// ping from a: the probe agent sends ICMP/TCP/UDP; use raw frames (UDP + ICMP echo).
	frames := []frameCase{
		{name: "onlink-udp", frame: ether(f.brMAC, f.a.mac, 0x0800, udpPkt(f.a.ip, neigh, 40400, 9, []byte(marker("onlink-udp"))))},
		{name: "onlink-icmp", frame: ether(f.brMAC, f.a.mac, 0x0800, icmpEcho(f.a.ip, neigh, []byte(marker("onlink-icmp"))))},
	}
	toBox, _ := captureDir(t, f.a.veth, func() {
		seen := capture(t, hostSide, func() { sendFrom(t, f.c, f.a.name, frames) })
		record(t, "box→uplink on-link neighbour "+neigh.String(), "frames seen leaving by the uplink: %v", seen)
		if len(seen) > 0 {
			t.Errorf("HOLE: box reaches the uplink's on-link neighbour %s: %v", neigh, seen)
		}
	})
	record(t, "box→uplink on-link neighbour (reply)", "into the box: %v", toBox)
}

func mustRouteVia(t *testing.T, ip net.IP, dev string) {
	t.Helper()
	rs, err := netlink.RouteGet(ip)
	if err != nil || len(rs) == 0 {
		t.Fatalf("route get %s: %v", ip, err)
	}
	l, err := netlink.LinkByIndex(rs[0].LinkIndex)
	if err != nil || l.Attrs().Name != dev {
		t.Fatalf("ABORT: %s not routed via %s", ip, dev)
	}
}

// linkLocalMore: the link-local group path two-way (a service bound to the host's uplink
// address answers from it), broadcast to the host, a spoofed source (the sibling's address:
// the host reflects to b), and the proposed fix (a bridge input drop of 01:80:c2:00:00:0X
// from the port) measured in a scratch table.
func (f *atkFixture) linkLocalMore(t *testing.T) {
	a, b := f.a, f.b
	ll := net.HardwareAddr{1, 0x80, 0xc2, 0, 0, 0x03}
	other := f.otherHostIP()
	if other == nil {
		t.Skip("no host address outside the blocked ranges")
	}
	mustLocal(t, other, f.s.Network)
	// a UDP echo service bound to the uplink address: replies leave from it
	uc, err := net.ListenUDP("udp4", &net.UDPAddr{IP: other})
	if err != nil {
		t.Fatal(err)
	}
	defer uc.Close()
	port := uc.LocalAddr().(*net.UDPAddr).Port
	heard := map[string]string{}
	var mu sync.Mutex
	go func() {
		buf := make([]byte, 2048)
		for {
			n, from, err := uc.ReadFromUDP(buf)
			if err != nil {
				return
			}
			msg := string(buf[:n])
			if i := strings.Index(msg, "cbxmark:"); i >= 0 {
				name := strings.SplitN(msg[i+8:], ":", 2)[0]
				mu.Lock()
				heard[name] = from.String()
				mu.Unlock()
				mustLocalOrBox(from.IP, f)
				_, _ = uc.WriteToUDP([]byte(marker("echo-"+name)), from)
			}
		}
	}()
	hl := listenHost(t)
	bc := broadcast4(f.subnet)
	frames := []frameCase{
		{name: "ll-2way", frame: ether(ll, a.mac, 0x0800, udpPkt(a.ip, other, 40500, uint16(port), []byte(marker("ll-2way"))))},
		{name: "ll-limited-bcast", frame: ether(ll, a.mac, 0x0800, udpPkt(a.ip, net.IPv4bcast, 40501, uint16(hl.port), []byte(marker("ll-limited-bcast"))))},
		{name: "ll-directed-bcast", frame: ether(ll, a.mac, 0x0800, udpPkt(a.ip, bc, 40502, uint16(hl.port), []byte(marker("ll-directed-bcast"))))},
	}
	toBox, _ := captureDir(t, a.veth, func() { sendFrom(t, f.c, a.name, frames) })
	time.Sleep(200 * time.Millisecond)
	mu.Lock()
	src2, ok2 := heard["ll-2way"]
	mu.Unlock()
	echo := slices.Contains(toBox, "echo-ll-2way")
	record(t, "box→host ll-2way "+other.String(), "service heard it: %v (from %s); its reply entered the box: %v", ok2, src2, echo)
	if ok2 && echo {
		t.Errorf("HOLE: two-way UDP between a box and a host service on %s", other)
	}
	for _, n := range []string{"ll-limited-bcast", "ll-directed-bcast"} {
		_, ok := hl.got(n)
		record(t, "box→host "+n, "host listener on 0.0.0.0 got it: %v", ok)
		if ok {
			t.Errorf("HOLE: %s reached the host", n)
		}
	}

	// Spoofed source by the same path: the bridge prerouting port binding never sees these
	// frames; only Incus's NIC filtering (bridge input) does. With it off on a (port binding
	// on), a sends from b's address to the host's echo service, which answers b.
	restore, err := f.h.SwitchOff(context.Background(), []boxcore.Layer{boxcore.LayerNICFiltering}, []string{a.name})
	if err != nil {
		t.Fatal(err)
	}
	a2 := nicOf(t, f.c, a.name)
	if err := f.h.BindPorts(context.Background()); err != nil {
		t.Fatal(err)
	}
	requireLayer(t, f.h, boxcore.LayerPortBinding, true)
	spoof := []frameCase{
		{name: "ll-spoof-b", frame: ether(ll, a2.mac, 0x0800, udpPkt(b.ip, other, 40600, uint16(port), []byte(marker("ll-spoof-b"))))},
		{name: "ctl-spoof-b", frame: ether(f.brMAC, a2.mac, 0x0800, udpPkt(b.ip, other, 40601, uint16(port), []byte(marker("ctl-spoof-b"))))},
	}
	toB, _ := captureDir(t, b.veth, func() { sendFrom(t, f.c, a.name, spoof) })
	time.Sleep(200 * time.Millisecond)
	mu.Lock()
	s1, ok1 := heard["ll-spoof-b"]
	_, okc := heard["ctl-spoof-b"]
	mu.Unlock()
	record(t, "spoof b via ll path (NIC filtering off, binding on)", "host service heard it: %v (from %s); reflected into b: %v; control by the bridge MAC heard: %v",
		ok1, s1, slices.Contains(toB, "echo-ll-spoof-b"), okc)
	if ok1 {
		t.Errorf("single layer: spoofed source by the link-local path is held by NIC filtering alone")
	}
	if err := restore(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := f.h.BindPorts(context.Background()); err != nil {
		t.Fatal(err)
	}
	f.a = nicOf(t, f.c, a.name)
	a = f.a

	// LLDP's group (01:80:c2:00:00:0e) skips even the bridge input hook (the bridge passes it
	// up at once): Incus's NIC filtering never sees it. Spoof b's address that way, every
	// layer on: the host's service answers b.
	requireLayer(t, f.h, boxcore.LayerNICFiltering, true)
	lldp := net.HardwareAddr{1, 0x80, 0xc2, 0, 0, 0x0e}
	spoof0e := []frameCase{{name: "ll0e-spoof-b", frame: ether(lldp, a.mac, 0x0800, udpPkt(b.ip, other, 40602, uint16(port), []byte(marker("ll0e-spoof-b"))))},
		{name: "ll0e-spoof-srcmac", frame: ether(lldp, b.mac, 0x0800, udpPkt(b.ip, other, 40603, uint16(port), []byte(marker("ll0e-spoof-srcmac"))))}}
	toB, _ = captureDir(t, b.veth, func() { sendFrom(t, f.c, a.name, spoof0e) })
	time.Sleep(200 * time.Millisecond)
	for _, n := range []string{"ll0e-spoof-b", "ll0e-spoof-srcmac"} {
		mu.Lock()
		s0, ok0 := heard[n]
		mu.Unlock()
		refl := slices.Contains(toB, "echo-"+n)
		record(t, "spoof b via LLDP group, every layer on "+n, "host service heard it: %v (from %s); reflected into b: %v", ok0, s0, refl)
		if ok0 {
			t.Errorf("HOLE: %s: spoofed source accepted by the host (reflected into sibling: %v)", n, refl)
		}
	}
	fdb := fdbPortOf(t, f.s.Network, b.mac)
	record(t, "fdb after LLDP frame with b's MAC", "b's MAC on port %s (b's own port %s)", fdb, b.veth)

	// Candidate fixes, measured in scratch tables (removed after).
	try := func(label, script, cleanup string) {
		cmd := exec.Command("nft", "-f", "-")
		cmd.Stdin = strings.NewReader(script)
		if out, err := cmd.CombinedOutput(); err != nil {
			record(t, "fix "+label, "nft refused: %v %s", err, strings.TrimSpace(string(out)))
			return
		}
		defer exec.Command("nft", strings.Fields(cleanup)...).Run()
		var ff []frameCase
		for _, x := range []byte{0x03, 0x0e, 0x0f} {
			n := fmt.Sprintf("fix-%s-ll%02x", strings.ReplaceAll(label, " ", ""), x)
			ff = append(ff, frameCase{name: n, frame: ether(net.HardwareAddr{1, 0x80, 0xc2, 0, 0, x}, a.mac, 0x0800, udpPkt(a.ip, other, 40700, uint16(hl.port), []byte(marker(n))))})
		}
		ctl := "fix-" + strings.ReplaceAll(label, " ", "") + "-dns"
		sendFrom(t, f.c, a.name, ff)
		time.Sleep(200 * time.Millisecond)
		var through []string
		for _, fc := range ff {
			if _, ok := hl.got(fc.name); ok {
				through = append(through, fc.name)
			}
		}
		// control: DNS from the box still answered
		r, err := f.c.Exec(context.Background(), a.name, incus.ExecRequest{Command: []string{"/sbin/init", "probe", "run",
			`{"kind":"dns","dns":{"server":"` + f.gw.String() + `","name":"nosuchname.invalid"}}`}})
		dnsOK := err == nil && strings.Contains(strings.ReplaceAll(string(r.Stdout), " ", ""), `"answered":true`)
		record(t, "fix "+label, "through: %v; box DNS still answered: %v (%s)", through, dnsOK, ctl)
	}
	try("bridge input ll-group drop", fmt.Sprintf(`table bridge cbatkfix {
	chain in { type filter hook input priority -300; policy accept;
		iifname "%s" ether daddr & ff:ff:ff:ff:ff:f0 == 01:80:c2:00:00:00 drop
	}
}
`, a.veth), "delete table bridge cbatkfix")
	try("inet prerouting iifname port drop", fmt.Sprintf(`table inet cbatkfix {
	chain pre { type filter hook prerouting priority -300; policy accept;
		iifname "%s" drop
	}
}
`, a.veth), "delete table inet cbatkfix")
	try("inet veth rpf", `table inet cbatkfix {
	chain pre { type filter hook prerouting priority -300; policy accept;
		meta iifkind "veth" fib saddr . iif oif missing drop
	}
}
`, "delete table inet cbatkfix")
	try("netdev ingress port", fmt.Sprintf(`table netdev cbatkfix {
	chain ing { type filter hook ingress device "%s" priority -500; policy accept;
		ether daddr & ff:ff:ff:ff:ff:f0 == 01:80:c2:00:00:00 drop
	}
}
`, a.veth), "delete table netdev cbatkfix")
	if err := writeSysctl("net/ipv4/conf/"+a.veth+"/rp_filter", "1"); err == nil {
		try("sysctl rp_filter=1 on the port", "", "list tables")
		_ = writeSysctl("net/ipv4/conf/"+a.veth+"/rp_filter", "0")
	}
}

func writeSysctl(k, v string) error { return os.WriteFile("/proc/sys/"+k, []byte(v), 0o644) }

// mustLocalOrBox panics (never sends) unless ip is a box or host address: the echo service
// answers only where the kernel keeps the packet on this machine.
func mustLocalOrBox(ip net.IP, f *atkFixture) {
	rs, err := netlink.RouteGet(ip)
	if err != nil || len(rs) == 0 {
		panic("route get failed")
	}
	if rs[0].Type == unix.RTN_LOCAL {
		return
	}
	if l, err := netlink.LinkByIndex(rs[0].LinkIndex); err == nil && l.Attrs().Name == f.s.Network {
		return
	}
	panic(fmt.Sprintf("ABORT: echo to %s would leave the machine", ip))
}
