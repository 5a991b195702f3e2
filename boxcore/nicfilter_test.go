package boxcore_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/hex"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/miekg/dns"
	"golang.org/x/sys/unix"

	"github.com/claudebox/claudebox/boxcore"
	"github.com/claudebox/claudebox/boxcore/incus"
	"github.com/claudebox/claudebox/internal/testenv"
	"github.com/claudebox/claudebox/internal/teststack"
)

// frameCase is one frame a hostile box sends to the broadcast address, and whether it must
// reach the bridge (the host side) while the NIC filtering holds.
type frameCase struct {
	name  string
	frame []byte
	pass  bool // passes with filtering on (controls and what filtering allows)
}

// spoofFrames are the frames box a (mac, ip) sends, naming sibling b (bmac, bip).
func spoofFrames(amac, bmac net.HardwareAddr, aip, bip net.IP) []frameCase {
	bcast := net.HardwareAddr{0xff, 0xff, 0xff, 0xff, 0xff, 0xff}
	udp := func(name string, src net.IP) []byte {
		return ipv4UDP(src, net.IPv4bcast, 9, 9, []byte(marker(name)))
	}
	fake := net.HardwareAddr{0x02, 0xcb, 0, 0, 0, 0x42}
	return []frameCase{
		{"own-ipv4", ether(bcast, amac, 0x0800, udp("own-ipv4", aip)), true},
		{"own-arp", ether(bcast, amac, 0x0806, arpFrame(2, amac, aip, bcast, aip, "own-arp")), true},
		{"dhcp-foreign-chaddr", ether(bcast, amac, 0x0800, ipv4UDP(net.IPv4zero, net.IPv4bcast, 68, 67, dhcpDiscover(fake, "dhcp-foreign-chaddr"))), true},
		{"ip-of-sibling", ether(bcast, amac, 0x0800, udp("ip-of-sibling", bip)), false},
		{"ip-unrelated", ether(bcast, amac, 0x0800, udp("ip-unrelated", net.IPv4(192, 0, 2, 77))), false},
		{"mac-of-sibling", ether(bcast, bmac, 0x0800, udp("mac-of-sibling", aip)), false},
		{"arp-is-at-sibling", ether(bcast, amac, 0x0806, arpFrame(2, amac, bip, bcast, bip, "arp-is-at-sibling")), false},
		{"arp-sender-mac-of-sibling", ether(bcast, amac, 0x0806, arpFrame(2, bmac, aip, bcast, aip, "arp-sender-mac-of-sibling")), false},
		{"arp-0.0.0.0", ether(bcast, amac, 0x0806, arpFrame(1, amac, net.IPv4zero, bcast, bip, "arp-0.0.0.0")), false},
		{"vlan0-ipv4", vlan(bcast, amac, 0, 0x0800, udp("vlan0-ipv4", aip)), false},
		{"vlan5-ipv4", vlan(bcast, amac, 5, 0x0800, udp("vlan5-ipv4", aip)), false},
		{"ethertype-0x88b5", ether(bcast, amac, 0x88b5, []byte(marker("ethertype-0x88b5"))), false},
		{"ipv6-link-local", ether(net.HardwareAddr{0x33, 0x33, 0, 0, 0, 1}, amac, 0x86dd, ipv6UDP("ipv6-link-local")), false},
	}
}

func marker(name string) string { return "cbxmark:" + name + ":" }

func ether(dst, src net.HardwareAddr, typ uint16, payload []byte) []byte {
	b := append(append([]byte{}, dst...), src...)
	b = binary.BigEndian.AppendUint16(b, typ)
	return append(b, payload...)
}

func vlan(dst, src net.HardwareAddr, vid, typ uint16, payload []byte) []byte {
	b := append(append([]byte{}, dst...), src...)
	b = binary.BigEndian.AppendUint16(b, 0x8100)
	b = binary.BigEndian.AppendUint16(b, vid)
	b = binary.BigEndian.AppendUint16(b, typ)
	return append(b, payload...)
}

func ipv4UDP(src, dst net.IP, sport, dport uint16, payload []byte) []byte {
	l := 20 + 8 + len(payload)
	h := []byte{0x45, 0, byte(l >> 8), byte(l), 0, 1, 0, 0, 64, 17, 0, 0}
	h = append(h, src.To4()...)
	h = append(h, dst.To4()...)
	var sum uint32
	for i := 0; i < 20; i += 2 {
		sum += uint32(h[i])<<8 | uint32(h[i+1])
	}
	for sum > 0xffff {
		sum = sum&0xffff + sum>>16
	}
	binary.BigEndian.PutUint16(h[10:], ^uint16(sum))
	u := binary.BigEndian.AppendUint16(nil, sport)
	u = binary.BigEndian.AppendUint16(u, dport)
	u = binary.BigEndian.AppendUint16(u, uint16(8+len(payload)))
	u = append(u, 0, 0)
	return append(append(h, u...), payload...)
}

func ipv6UDP(name string) []byte {
	payload := []byte(marker(name))
	h := []byte{0x60, 0, 0, 0}
	h = binary.BigEndian.AppendUint16(h, uint16(8+len(payload)))
	h = append(h, 17, 64)
	h = append(h, net.ParseIP("fe80::cb:1")...)
	h = append(h, net.ParseIP("ff02::1")...)
	u := []byte{0, 9, 0, 9}
	u = binary.BigEndian.AppendUint16(u, uint16(8+len(payload)))
	u = append(u, 0, 0)
	return append(append(h, u...), payload...)
}

// arpFrame is an ARP body with the marker as trailing padding.
func arpFrame(op uint16, sha net.HardwareAddr, spa net.IP, tha net.HardwareAddr, tpa net.IP, name string) []byte {
	b := []byte{0, 1, 8, 0, 6, 4}
	b = binary.BigEndian.AppendUint16(b, op)
	b = append(b, sha...)
	b = append(b, spa.To4()...)
	b = append(b, tha...)
	b = append(b, tpa.To4()...)
	return append(b, marker(name)...)
}

// dhcpDiscover is a BOOTP discover for chaddr, the marker in its file field.
func dhcpDiscover(chaddr net.HardwareAddr, name string) []byte {
	b := make([]byte, 236)
	b[0], b[1], b[2] = 1, 1, 6
	copy(b[4:8], []byte{0xcb, 0, 0, 1})
	b[10] = 0x80 // broadcast flag
	copy(b[28:], chaddr)
	copy(b[108:], marker(name))
	b = append(b, 0x63, 0x82, 0x53, 0x63, 53, 1, 1, 255)
	return b
}

var rawsendOnce struct {
	sync.Once
	path string
	err  error
}

// rawsend builds boxcore/testdata/rawsend (static) once.
func rawsend(t *testing.T) string {
	t.Helper()
	rawsendOnce.Do(func() {
		dir, err := os.MkdirTemp("", "cbt-rawsend-")
		if err != nil {
			rawsendOnce.err = err
			return
		}
		rawsendOnce.path = filepath.Join(dir, "rawsend")
		cmd := exec.Command("go", "build", "-o", rawsendOnce.path, "./testdata/rawsend")
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			rawsendOnce.err = &exec.ExitError{}
			t.Logf("%s", out)
		}
	})
	if rawsendOnce.err != nil {
		t.Fatalf("building rawsend: %v", rawsendOnce.err)
	}
	return rawsendOnce.path
}

// openCapture opens a raw socket seeing every frame of iface (both directions), with a
// 100 ms read timeout so readers can watch a clock.
func openCapture(t *testing.T, iface string) int {
	t.Helper()
	ifi, err := net.InterfaceByName(iface)
	if err != nil {
		t.Fatal(err)
	}
	proto := uint16(unix.ETH_P_ALL)<<8 | uint16(unix.ETH_P_ALL)>>8
	fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW, int(proto))
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.Bind(fd, &unix.SockaddrLinklayer{Protocol: proto, Ifindex: ifi.Index}); err != nil {
		unix.Close(fd)
		t.Fatal(err)
	}
	tv := unix.Timeval{Usec: 100000}
	_ = unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
	return fd
}

// capture reads every frame an interface sees (both directions) while send runs, plus a
// short tail, and returns the names of the markers it saw.
func capture(t *testing.T, iface string, send func()) []string {
	t.Helper()
	seen := map[string]bool{}
	captureWhile(t, iface, time.Second, send, func(f []byte, _ *unix.SockaddrLinklayer) { markersIn(f, seen) })
	return sortedSet(seen)
}

// captureWhile hands every frame iface sees (both directions) to each while send runs, and
// for tail after it.
func captureWhile(t *testing.T, iface string, tail time.Duration, send func(), each func(frame []byte, ll *unix.SockaddrLinklayer)) {
	t.Helper()
	fd := openCapture(t, iface)
	defer unix.Close(fd)
	done := make(chan struct{})
	go func() { send(); close(done) }()
	var until time.Time
	buf := make([]byte, 65536)
	for until.IsZero() || time.Now().Before(until) {
		select {
		case <-done:
			if until.IsZero() {
				until = time.Now().Add(tail)
			}
		default:
		}
		n, sa, err := unix.Recvfrom(fd, buf, 0)
		if err != nil {
			continue
		}
		ll, _ := sa.(*unix.SockaddrLinklayer)
		each(buf[:n], ll)
	}
}

// markersIn adds the names of the "cbxmark:NAME:" markers in frame to seen.
func markersIn(frame []byte, seen map[string]bool) {
	for rest := frame; ; {
		i := bytes.Index(rest, []byte("cbxmark:"))
		if i < 0 {
			return
		}
		rest = rest[i+8:]
		if j := bytes.IndexByte(rest, ':'); j > 0 {
			seen[string(rest[:j])] = true
		}
	}
}

func sortedSet(m map[string]bool) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}

type boxNIC struct {
	name, veth string
	mac        net.HardwareAddr
	ip         net.IP
}

// mintTwo mints PREFIX-RUN-a and PREFIX-RUN-b from img on bs's stack and returns their NICs.
func mintTwo(t *testing.T, ctx context.Context, bs *boxcore.Boxes, img, prefix string) []boxNIC {
	t.Helper()
	var nics []boxNIC
	for _, suffix := range []string{"a", "b"} {
		name := prefix + "-" + testenv.RunID() + "-" + suffix
		if _, err := bs.New(ctx, boxcore.NewOptions{Name: name, Image: img, Config: teststack.Tag()}); err != nil {
			t.Fatalf("new %s: %v", name, err)
		}
		nics = append(nics, nicOf(t, bs.Client, name))
	}
	return nics
}

func nicOf(t *testing.T, c *incus.Client, name string) boxNIC {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		st, err := c.InstanceState(context.Background(), name)
		if err != nil {
			t.Fatal(err)
		}
		eth := st.Network["eth0"]
		for _, a := range eth.Addresses {
			if a.Family == "inet" {
				mac, _ := net.ParseMAC(eth.Hwaddr)
				return boxNIC{name, eth.HostName, mac, net.ParseIP(a.Address).To4()}
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s has no IPv4 lease after 20 s (state %+v)", name, eth)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// sendFrom pushes rawsend into a box and sends the frames from its eth0.
func sendFrom(t *testing.T, c *incus.Client, box string, frames []frameCase) {
	t.Helper()
	ctx := context.Background()
	f, err := os.Open(rawsend(t))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := c.PushFile(ctx, box, "/rawsend", f, 0o755, 0, 0); err != nil {
		t.Fatal(err)
	}
	args := []string{"/rawsend", "eth0"}
	for _, fc := range frames {
		args = append(args, hex.EncodeToString(fc.frame))
	}
	r, err := c.Exec(ctx, box, incus.ExecRequest{Command: args})
	if err != nil || r.ExitCode != 0 {
		t.Fatalf("rawsend in %s: %v exit %d %s", box, err, r.ExitCode, r.Stderr)
	}
}

// TestNICFiltering measures the profile NIC's anti-spoofing on the real daemon: boxes still
// lease and resolve, and what a hostile box sends from anything but its own MAC and address
// never reaches the bridge.
func TestNICFiltering(t *testing.T) {
	c := testenv.RequireIncus(t)
	ctx := context.Background()
	s := teststack.New(t, c, "nicfilter")
	bs := &boxcore.Boxes{Client: c, Stack: s, Version: "test"}
	img := teststack.ProbeImage(t, c)
	nics := mintTwo(t, ctx, bs, img, "cbt-nicf")
	a, b := nics[0], nics[1]
	t.Logf("a %s %s %s, b %s %s %s", a.veth, a.mac, a.ip, b.veth, b.mac, b.ip)
	out, _ := exec.Command("nft", "list", "table", "bridge", "incus").CombinedOutput()
	t.Logf("table bridge incus:\n%s", out)
	leases, _ := c.NetworkLeases(ctx, s.Network)
	t.Logf("leases: %+v", leases)

	frames := spoofFrames(a.mac, b.mac, a.ip, b.ip)
	h := boxcore.NewHost(c, s)
	// What NIC filtering alone drops: claudebox's port binding (which new applies) and the L2
	// ranges' per-port DHCP binding are off on a for this capture.
	unbind, err := h.SwitchOff(ctx, []boxcore.Layer{boxcore.LayerPortBinding, boxcore.LayerL2Ranges}, []string{a.name})
	if err != nil {
		t.Fatalf("port binding off: %v", err)
	}
	seenOn := capture(t, s.Network, func() { sendFrom(t, c, a.name, frames) })
	if err := unbind(ctx); err != nil {
		t.Fatalf("port binding back: %v", err)
	}
	t.Logf("filtering on: the bridge saw %v", seenOn)
	requireLayer(t, h, boxcore.LayerNICFiltering, true)

	// DHCP and DNS through the filter: the box holds its lease (above) and the gateway's
	// dnsmasq answers it.
	gw := strings.Split(mustNetwork(t, c, s.Network).Config["ipv4.address"], "/")[0]
	r, err := c.Exec(ctx, a.name, incus.ExecRequest{Command: []string{"/sbin/init", "probe", "run",
		`{"kind":"dns","dns":{"server":"` + gw + `","name":"nosuchname.invalid"}}`}})
	if err != nil || r.ExitCode != 0 || !strings.Contains(strings.ReplaceAll(string(r.Stdout), " ", ""), `"answered":true`) {
		t.Errorf("DNS from a filtered box to %s: %v exit %d %s %s", gw, err, r.ExitCode, r.Stdout, r.Stderr)
	}
	// no-ident: no CHAOS answers about the resolver.
	for _, q := range []string{"version.bind.", "servers.bind."} {
		m := new(dns.Msg)
		m.SetQuestion(q, dns.TypeTXT)
		m.Question[0].Qclass = dns.ClassCHAOS
		resp, _, err := (&dns.Client{Timeout: 2 * time.Second}).Exchange(m, net.JoinHostPort(gw, "53"))
		if err != nil {
			t.Fatalf("CHAOS %s: %v", q, err)
		}
		t.Logf("CHAOS %s: rcode %s, %d answers", q, dns.RcodeToString[resp.Rcode], len(resp.Answer))
		if len(resp.Answer) > 0 {
			t.Errorf("dnsmasq answers CHAOS %s with no-ident: %v", q, resp.Answer)
		}
	}
	// security.idmap.isolated: each box has its own host uid range.
	ia, _, _ := c.Instance(ctx, a.name)
	ib, _, _ := c.Instance(ctx, b.name)
	t.Logf("idmap: a %s, b %s", ia.Config["volatile.idmap.base"], ib.Config["volatile.idmap.base"])
	if base := ia.Config["volatile.idmap.base"]; base == "" || base == ib.Config["volatile.idmap.base"] {
		t.Errorf("boxes share an idmap base (%q, %q): security.idmap.isolated does not hold", base, ib.Config["volatile.idmap.base"])
	}

	// The switch: NIC filtering off on box a only (with claudebox's port binding, the other
	// layer against these frames, off too); the same frames now reach the bridge (the
	// capture's control), b keeps its filter, and restore puts a's back.
	restore, err := h.SwitchOff(ctx, []boxcore.Layer{boxcore.LayerNICFiltering, boxcore.LayerPortBinding, boxcore.LayerL2Ranges}, []string{a.name})
	if err != nil {
		t.Fatalf("switch off: %v", err)
	}
	if got := nicOf(t, c, a.name); got.veth != a.veth || !got.ip.Equal(a.ip) {
		t.Errorf("switching the filter changed a's NIC: %+v, was %+v", got, a)
	}
	requireLayer(t, h, boxcore.LayerNICFiltering, false)
	lb := layerOf(t, h, boxcore.LayerNICFiltering, []string{b.name})
	if !lb.On {
		t.Errorf("switching a's filter off touched b's: %+v", lb)
	}
	seenOff := capture(t, s.Network, func() { sendFrom(t, c, a.name, frames) })
	t.Logf("filtering off: the bridge saw %v", seenOff)
	// A frame counts only where the control shows the capture can see it: it reaches the
	// bridge with the filter off. (IPv4/IPv6 frames with a unicast source do not reach the
	// bridge's packet tap here even with the filter off while br_netfilter is on: unmeasured
	// by this test, logged.)
	measured := 0
	for _, fc := range frames {
		on, off := slices.Contains(seenOn, fc.name), slices.Contains(seenOff, fc.name)
		switch {
		case !off:
			t.Logf("unmeasured: %s does not reach the bridge's tap even unfiltered", fc.name)
		case on != fc.pass:
			t.Errorf("filtering on: %s reached the bridge = %v, want %v", fc.name, on, fc.pass)
		default:
			measured++
		}
	}
	if measured < 8 {
		t.Errorf("only %d frames measured: the capture sees too little", measured)
	}
	if err := restore(ctx); err != nil {
		t.Fatalf("restore: %v", err)
	}
	requireLayer(t, h, boxcore.LayerNICFiltering, true)
	if r := mustCheck(t, h); !r.OK {
		t.Fatalf("check after restore drifts: %v", driftItems(r))
	}
}

func mustNetwork(t *testing.T, c *incus.Client, name string) incus.Network {
	t.Helper()
	n, _, err := c.Network(context.Background(), name)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

func layerOf(t *testing.T, h *boxcore.Host, l boxcore.Layer, boxes []string) boxcore.LayerState {
	t.Helper()
	ls, err := h.ReadLayers(context.Background(), boxes)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range ls {
		if s.Layer == l {
			return s
		}
	}
	t.Fatalf("no layer %s in %v", l, ls)
	return boxcore.LayerState{}
}

func requireLayer(t *testing.T, h *boxcore.Host, l boxcore.Layer, on bool) {
	t.Helper()
	if s := layerOf(t, h, l, nil); s.On != on {
		t.Fatalf("layer %s on=%v, want %v (%s)", l, s.On, on, s.What)
	}
}
