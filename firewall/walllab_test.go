package firewall

import (
	"context"
	"encoding/binary"
	"fmt"
	"net"
	"net/netip"
	"os"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// wallLab is the wall's world, every part a namespace the test makes:
//
//	box  (10.77.12.11, fd00:77::11) ─ cbw0 bridge in host (10.77.12.1, fd00:77::1)
//	host ─ cbwup (198.51.100.1, fd00:99::1; the default route: the uplink) ─ wan
//	       wan holds 198.51.100.2, the public decoy 203.0.113.2 and a blocked
//	       "LAN" decoy 198.18.77.2 (a LAN on the uplink, as at home), fd00:99::2
//	host ─ cbwside (198.19.5.1; another local network, not blocked) ─ side
//	       side holds 198.19.5.2 and 10.77.12.200, a box-subnet address the
//	       host routes (/32) by cbwside, standing in for the default route
//	       during Incus's bridge-address flap
//
// Addresses come from documentation/benchmark ranges and 10.77.12/24, none
// of which this host routes; nothing leaves the namespaces.
type wallLab struct {
	host, box, wan, side netns.NsHandle
	bridge               string
	gwMAC                net.HardwareAddr
	boxIf                int // box's eth0 index, in box
	boxPort              PortBinding
}

const (
	wlGW, wlBox, wlGW6, wlBox6 = "10.77.12.1", "10.77.12.11", "fd00:77::1", "fd00:77::11"
	wlUp, wlWan, wlWan6        = "198.51.100.1", "198.51.100.2", "fd00:99::2"
	wlPublic, wlLAN            = "203.0.113.2", "198.18.77.2"
	wlSide, wlImpostor         = "198.19.5.2", "10.77.12.200"
)

func (l *wallLab) spec() Spec {
	var blocked []netip.Prefix
	for _, p := range []string{"10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "169.254.0.0/16", "198.18.0.0/16"} {
		blocked = append(blocked, netip.MustParsePrefix(p))
	}
	return Spec{Bridge: l.bridge, Gateway: net.ParseIP(wlGW), Blocked: blocked} // Uplinks from the default route
}

func cidr(tb testing.TB, s string) *netlink.Addr {
	tb.Helper()
	a, err := netlink.ParseAddr(s)
	must(tb, err)
	if a.IP.To4() == nil {
		a.Flags = unix.IFA_F_NODAD // usable at once
	}
	return a
}

// vethTo makes a veth with hostName in the host namespace and "eth0" in ns.
func vethTo(tb testing.TB, host, ns netns.NsHandle, hostName string, master int, hostAddrs, peerAddrs []string) netlink.Link {
	tb.Helper()
	h, ph := handle(tb, host), handle(tb, ns)
	peer := hostName + "p"
	must(tb, h.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: hostName, MasterIndex: master}, PeerName: peer}))
	hl, err := h.LinkByName(hostName)
	must(tb, err)
	for _, a := range hostAddrs {
		must(tb, h.AddrAdd(hl, cidr(tb, a)))
	}
	must(tb, h.LinkSetUp(hl))
	p, err := h.LinkByName(peer)
	must(tb, err)
	must(tb, h.LinkSetNsFd(p, int(ns)))
	p, err = ph.LinkByName(peer)
	must(tb, err)
	must(tb, ph.LinkSetName(p, "eth0"))
	for _, a := range peerAddrs {
		must(tb, ph.AddrAdd(p, cidr(tb, a)))
	}
	must(tb, ph.LinkSetUp(p))
	return p
}

func addLo(tb testing.TB, ns netns.NsHandle, addrs ...string) {
	tb.Helper()
	h := handle(tb, ns)
	lo, err := h.LinkByName("lo")
	must(tb, err)
	for _, a := range addrs {
		must(tb, h.AddrAdd(lo, cidr(tb, a)))
	}
}

func route(tb testing.TB, ns netns.NsHandle, dst, gw string, link netlink.Link) {
	tb.Helper()
	r := &netlink.Route{LinkIndex: link.Attrs().Index, Gw: net.ParseIP(gw)}
	if dst != "" {
		_, n, err := net.ParseCIDR(dst)
		must(tb, err)
		r.Dst = n
	}
	must(tb, handle(tb, ns).RouteAdd(r))
}

// sysctl writes a per-namespace /proc/sys/net value inside ns.
func sysctl(tb testing.TB, ns netns.NsHandle, key, val string) {
	tb.Helper()
	must(tb, inNS(ns, func() error {
		return os.WriteFile("/proc/sys/net/"+key, []byte(val), 0o644)
	}))
}

func newWallLab(t *testing.T) *wallLab {
	t.Helper()
	l := &wallLab{host: freshNS(t), bridge: "cbw0"}
	l.box, l.wan, l.side = sideNS(t), sideNS(t), sideNS(t)
	h := handle(t, l.host)
	br := &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: l.bridge}}
	must(t, h.LinkAdd(br))
	must(t, h.AddrAdd(br, cidr(t, wlGW+"/24")))
	must(t, h.AddrAdd(br, cidr(t, wlGW6+"/64")))
	must(t, h.LinkSetUp(br))

	boxIf := vethTo(t, l.host, l.box, "cbwb1", br.Attrs().Index, nil, []string{wlBox + "/24", wlBox6 + "/64"})
	l.boxIf = boxIf.Attrs().Index
	l.boxPort = PortBinding{Port: "cbwb1", MAC: boxIf.Attrs().HardwareAddr, IPv4: netip.MustParseAddr(wlBox)}
	route(t, l.box, "", wlGW, boxIf)
	route(t, l.box, "::/0", wlGW6, boxIf)

	wanIf := vethTo(t, l.host, l.wan, "cbwup", 0, []string{wlUp + "/24", "fd00:99::1/64"}, []string{wlWan + "/24", wlWan6 + "/64"})
	addLo(t, l.wan, wlPublic+"/32", wlLAN+"/32")
	route(t, l.wan, "", wlUp, wanIf)
	route(t, l.wan, "::/0", "fd00:99::1", wanIf)
	up, err := h.LinkByName("cbwup")
	must(t, err)
	route(t, l.host, "", wlWan, up) // the default route: cbwup is the uplink
	route(t, l.host, "::/0", "fd00:99::2", up)

	sideIf := vethTo(t, l.host, l.side, "cbwside", 0, []string{"198.19.5.1/24"}, []string{wlSide + "/24"})
	addLo(t, l.side, wlImpostor+"/32")
	route(t, l.side, "", "198.19.5.1", sideIf)
	sl, err := h.LinkByName("cbwside")
	must(t, err)
	route(t, l.host, wlImpostor+"/32", wlSide, sl)

	for _, kv := range [][2]string{
		{"ipv4/ip_forward", "1"}, {"ipv6/conf/all/forwarding", "1"},
		// The spoofing probes measure our rules, not reverse-path filtering.
		{"ipv4/conf/all/rp_filter", "0"}, {"ipv4/conf/default/rp_filter", "0"},
	} {
		sysctl(t, l.host, kv[0], kv[1])
	}
	brl, err := h.LinkByName(l.bridge)
	must(t, err)
	l.gwMAC = brl.Attrs().HardwareAddr
	return l
}

// applyWall loads the wall alone (no bridge table, no guard, no Incus)
// without the rules whose keys are listed; the conntrack table is flushed
// so that no flow from an earlier phase decides a probe.
func (l *wallLab) applyWall(t *testing.T, without ...string) {
	t.Helper()
	l.loadWall(t, without...)
	l.flushConntrack(t)
}

// loadWall is applyWall keeping the conntrack table: the flows opened
// before stay (what Incus's re-apply window leaves behind).
func (l *wallLab) loadWall(t *testing.T, without ...string) {
	t.Helper()
	s := l.spec().Resolved()
	if fmt.Sprint(s.Uplinks) != "[cbwup]" {
		t.Fatalf("uplinks resolved from the lab's default route = %v, want [cbwup]", s.Uplinks)
	}
	must(t, RemovePart(s, PartWall))
	obs, err := Read(s.Bridge)
	must(t, err)
	var wallOnly Observed
	for _, ts := range obs.Tables {
		if ts.Name == WallTableName(s.Bridge) {
			wallOnly.Tables = append(wallOnly.Tables, ts)
		}
	}
	skip := map[string]bool{}
	for _, k := range without {
		skip[k] = true
	}
	var rules []Rule
	for _, r := range Desired(s) {
		if r.Table == WallTableName(s.Bridge) && !skip[r.key] {
			rules = append(rules, r)
		}
	}
	must(t, applyRules(s, wallOnly, rules, false))
}

func (l *wallLab) noWall(t *testing.T) {
	t.Helper()
	must(t, RemovePart(l.spec(), PartWall))
	l.flushConntrack(t)
}

func (l *wallLab) flushConntrack(t *testing.T) {
	t.Helper()
	must(t, inNS(l.host, func() error {
		for _, f := range []netlink.InetFamily{unix.AF_INET, unix.AF_INET6} {
			if _, err := netlink.ConntrackDeleteFilters(netlink.ConntrackTable, f, &netlink.ConntrackFilter{}); err != nil {
				return err
			}
		}
		return nil
	}))
}

// recorder is a UDP socket that remembers which token came from where (and
// echoes, so it can serve as a plain UDP service too).
type recorder struct {
	mu   sync.Mutex
	seen map[string]string
}

func listenRecorder(t *testing.T, ns netns.NsHandle, network, addr string) *recorder {
	t.Helper()
	r := &recorder{seen: map[string]string{}}
	var pc net.PacketConn
	must(t, inNS(ns, func() (err error) { pc, err = reuseConfig.ListenPacket(context.Background(), network, addr); return }))
	t.Cleanup(func() { pc.Close() })
	go func() {
		buf := make([]byte, 1500)
		for {
			n, from, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			r.mu.Lock()
			r.seen[string(buf[:n])] = from.(*net.UDPAddr).IP.String()
			r.mu.Unlock()
			_, _ = pc.WriteTo(buf[:n], from)
		}
	}()
	return r
}

// wait returns the source a token came from, or "dropped".
func (r *recorder) wait(tok string) string {
	deadline := time.Now().Add(probeTimeout)
	for time.Now().Before(deadline) {
		r.mu.Lock()
		src, ok := r.seen[tok]
		r.mu.Unlock()
		if ok {
			return src
		}
		time.Sleep(10 * time.Millisecond)
	}
	return dropped
}

var tokenN struct {
	sync.Mutex
	n int
}

func token(name string) string {
	tokenN.Lock()
	defer tokenN.Unlock()
	tokenN.n++
	return fmt.Sprintf("%s#%d", name, tokenN.n)
}

// sendUDP sends one datagram with a token, from laddr ("" = any).
func sendUDP(ns netns.NsHandle, network, laddr, raddr, tok string) error {
	return inNS(ns, func() error {
		d := net.Dialer{Control: reuseConfig.Control}
		if laddr != "" {
			a, err := net.ResolveUDPAddr(network, laddr)
			if err != nil {
				return err
			}
			d.LocalAddr = a
		}
		c, err := d.Dial(network, raddr)
		if err != nil {
			return err
		}
		defer c.Close()
		_, err = c.Write([]byte(tok))
		return err
	})
}

// udpFrom sends from laddr to an echo service and waits for the echo.
func udpFrom(ns netns.NsHandle, network, laddr, raddr string) string {
	var out string
	_ = inNS(ns, func() error {
		d := net.Dialer{Control: reuseConfig.Control}
		if laddr != "" {
			a, err := net.ResolveUDPAddr(network, laddr)
			if err != nil {
				out = classify(err)
				return nil
			}
			d.LocalAddr = a
		}
		c, err := d.Dial(network, raddr)
		if err != nil {
			out = classify(err)
			return nil
		}
		defer c.Close()
		if _, err := c.Write([]byte("probe")); err != nil {
			out = classify(err)
			return nil
		}
		_ = c.SetReadDeadline(time.Now().Add(probeTimeout))
		_, err = c.Read(make([]byte, 64))
		out = classify(err)
		return nil
	})
	return out
}

func dialProbe(ns netns.NsHandle, network, addr string) string {
	var out string
	_ = inNS(ns, func() error {
		c, err := net.DialTimeout(network, addr, probeTimeout)
		if err == nil {
			c.Close()
		}
		out = classify(err)
		return nil
	})
	return out
}

// rawUDP sends an IPv4/UDP packet built by hand out of ifindex (in ns) to
// dstMAC: any source address, 0.0.0.0 included, as a root attacker can.
func rawUDP(ns netns.NsHandle, ifindex int, dstMAC net.HardwareAddr, src, dst string, sport, dport uint16, payload string) error {
	return sendIPFrame(ns, ifindex, dstMAC, udpPacket4(src, dst, sport, dport, payload))
}

// udpPacket4 is an IPv4/UDP packet from src:sport to dst:dport, with no UDP checksum (0:
// none, allowed for IPv4).
func udpPacket4(src, dst string, sport, dport uint16, payload string) []byte {
	pkt := make([]byte, 28+len(payload))
	pkt[0], pkt[8], pkt[9] = 0x45, 64, unix.IPPROTO_UDP
	binary.BigEndian.PutUint16(pkt[2:], uint16(len(pkt)))
	copy(pkt[12:16], net.ParseIP(src).To4())
	copy(pkt[16:20], net.ParseIP(dst).To4())
	binary.BigEndian.PutUint16(pkt[10:], checksum(pkt[:20]))
	binary.BigEndian.PutUint16(pkt[20:], sport)
	binary.BigEndian.PutUint16(pkt[22:], dport)
	binary.BigEndian.PutUint16(pkt[24:], uint16(8+len(payload)))
	copy(pkt[28:], payload)
	return pkt
}

func htons(v uint16) uint16 { return v<<8 | v>>8 }

var reuseConfig = net.ListenConfig{Control: func(_, _ string, c syscall.RawConn) error {
	var serr error
	err := c.Control(func(fd uintptr) {
		serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_REUSEADDR, 1)
		if serr == nil {
			serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_BROADCAST, 1)
		}
	})
	if err != nil {
		return err
	}
	return serr
}}

func hostPort(h string, p int) string { return net.JoinHostPort(h, fmt.Sprint(p)) }

func joinKeys(ks []string) string { return strings.Join(ks, "+") }
