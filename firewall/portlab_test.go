package firewall

import (
	"bytes"
	"encoding/binary"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// portLab is the wall lab plus a sibling box on the same bridge:
//
//	box (10.77.12.11, port cbwb1) and sib (10.77.12.12, port cbwb2) on cbw0
//
// Both ports are bound. Only the bridge table's L2 parts are loaded (no
// forward chain rules, no guard, no wall, no Incus-like NIC filtering or port
// isolation), so each case shows the one rule that holds it.
type portLab struct {
	*wallLab
	sib              netns.NsHandle
	sibIf            int
	boxMAC, sibMAC   net.HardwareAddr
	boxPort, sibPort string
	llRec            *recorder      // the host's echo service of the link-local tests
	extraBlocked     []netip.Prefix // blocked besides the wall lab's ranges
}

const plSib = "10.77.12.12"

func newPortLab(t *testing.T) *portLab {
	t.Helper()
	l := &portLab{wallLab: newWallLab(t), boxPort: "cbwb1", sibPort: "cbwb2"}
	l.sib = sideNS(t)
	// No IPv6 on the sibling: its own router solicitations and MLD reports (sent for a
	// while after its link comes up) carry its MAC and would re-teach the bridge between
	// the spoof and the FDB read, hiding the attack's control (a CI run saw exactly that).
	for _, k := range []string{"all", "default"} {
		sysctl(t, l.sib, "ipv6/conf/"+k+"/disable_ipv6", "1")
	}
	h := handle(t, l.host)
	br, err := h.LinkByName(l.bridge)
	must(t, err)
	sibIf := vethTo(t, l.host, l.sib, l.sibPort, br.Attrs().Index, nil, []string{plSib + "/24"})
	route(t, l.sib, "", wlGW, sibIf)
	l.sibIf, l.sibMAC = sibIf.Attrs().Index, sibIf.Attrs().HardwareAddr
	bl, err := handle(t, l.box).LinkByIndex(l.boxIf)
	must(t, err)
	l.boxMAC = bl.Attrs().HardwareAddr
	return l
}

func (l *portLab) spec() Spec {
	s := l.wallLab.spec()
	s.Blocked = append(s.Blocked, l.extraBlocked...)
	s.Ports = []PortBinding{
		{Port: l.boxPort, MAC: l.boxMAC, IPv4: netip.MustParseAddr(wlBox)},
		{Port: l.sibPort, MAC: l.sibMAC, IPv4: netip.MustParseAddr(plSib)},
	}
	return s
}

// loadL2 loads the bridge table's L2 parts alone (prerouting, input, output;
// the forward chain empty), without the rules whose keys are listed, and
// removes the wall and the guard.
func (l *portLab) loadL2(t *testing.T, without ...string) {
	t.Helper()
	s := l.spec().Resolved()
	must(t, RemovePart(s, PartWall))
	bt, gt := TableNames(s.Bridge)
	_, _ = Remove(s.Bridge)
	obs, err := Read(s.Bridge)
	must(t, err)
	var only Observed
	for _, ts := range obs.Tables {
		if ts.Name == bt && ts.Family == FamilyBridge {
			only.Tables = append(only.Tables, ts)
		}
	}
	skip := map[string]bool{}
	for _, k := range without {
		skip[k] = true
	}
	var rules []Rule
	for _, r := range Desired(s) {
		if r.Table == bt && r.Chain != ForwardChain && !skip[r.key] {
			rules = append(rules, r)
		}
	}
	must(t, applyRules(s, only, rules, false))
	_ = gt
	l.flushConntrack(t)
}

func (l *portLab) noL2(t *testing.T) {
	t.Helper()
	_, err := Remove(l.bridge)
	must(t, err)
	l.flushConntrack(t)
}

// Frames, built by hand.

var bcastMAC = net.HardwareAddr{0xff, 0xff, 0xff, 0xff, 0xff, 0xff}

func marker(name string) string { return "cbxmark:" + name + ":" }

func etherFrame(dst, src net.HardwareAddr, typ uint16, payload []byte) []byte {
	b := append(append([]byte{}, dst...), src...)
	b = binary.BigEndian.AppendUint16(b, typ)
	return append(b, payload...)
}

func taggedFrame(dst, src net.HardwareAddr, tpid, vid, typ uint16, payload []byte) []byte {
	b := append(append([]byte{}, dst...), src...)
	b = binary.BigEndian.AppendUint16(b, tpid)
	b = binary.BigEndian.AppendUint16(b, vid)
	b = binary.BigEndian.AppendUint16(b, typ)
	return append(b, payload...)
}

// ipv4Packet is an IPv4/UDP packet; fragOff is the raw flags+offset field.
func ipv4Packet(src, dst string, sport, dport uint16, fragOff uint16, payload []byte) []byte {
	pkt := make([]byte, 28+len(payload))
	pkt[0], pkt[8], pkt[9] = 0x45, 64, unix.IPPROTO_UDP
	binary.BigEndian.PutUint16(pkt[2:], uint16(len(pkt)))
	binary.BigEndian.PutUint16(pkt[6:], fragOff)
	copy(pkt[12:16], net.ParseIP(src).To4())
	copy(pkt[16:20], net.ParseIP(dst).To4())
	binary.BigEndian.PutUint16(pkt[10:], checksum(pkt[:20]))
	binary.BigEndian.PutUint16(pkt[20:], sport)
	binary.BigEndian.PutUint16(pkt[22:], dport)
	binary.BigEndian.PutUint16(pkt[24:], uint16(8+len(payload)))
	copy(pkt[28:], payload)
	return pkt
}

// arpBody is an Ethernet/IPv4 ARP body (shape overridable), the marker as padding.
func arpBody(shape []byte, op uint16, sha net.HardwareAddr, spa string, tpa string, name string) []byte {
	b := append([]byte{}, shape...)
	b = binary.BigEndian.AppendUint16(b, op)
	b = append(b, sha...)
	b = append(b, net.ParseIP(spa).To4()...)
	b = append(b, make([]byte, 6)...)
	b = append(b, net.ParseIP(tpa).To4()...)
	return append(b, marker(name)...)
}

var arpEthIPv4 = []byte{0, 1, 8, 0, 6, 4}

// withField overwrites b at off with v (a BOOTP field: hops 3, ciaddr 12, giaddr 24).
func withField(b []byte, off int, v []byte) []byte {
	copy(b[off:], v)
	return b
}

// bootp is a BOOTP request (DHCP discover/release) for chaddr with hlen, the
// marker in its file field.
func bootp(chaddr net.HardwareAddr, hlen byte, msgType byte, name string) []byte {
	b := make([]byte, 236)
	b[0], b[1], b[2] = 1, 1, hlen
	copy(b[4:8], []byte{0xcb, 0, 0, 1})
	copy(b[28:], chaddr)
	copy(b[108:], marker(name))
	return append(b, 0x63, 0x82, 0x53, 0x63, 53, 1, msgType, 255)
}

func ipv6LinkLocal(name string) []byte {
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

// sendFrames writes whole Ethernet frames out of ifindex in ns.
func sendFrames(ns netns.NsHandle, ifindex int, frames ...[]byte) error {
	return inNS(ns, func() error {
		fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW, 0) // protocol 0: send only
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		to := &unix.SockaddrLinklayer{Ifindex: ifindex, Halen: 6}
		for _, f := range frames {
			if err := unix.Sendto(fd, f, 0, to); err != nil {
				return err
			}
		}
		return nil
	})
}

// capture collects the markers of every frame the interface (in ns) sees
// while send runs and for a short tail after.
func capture(t *testing.T, ns netns.NsHandle, iface string, send func()) []string {
	t.Helper()
	proto := htons(unix.ETH_P_ALL)
	var fd int
	must(t, inNS(ns, func() error {
		ifi, err := net.InterfaceByName(iface)
		if err != nil {
			return err
		}
		if fd, err = unix.Socket(unix.AF_PACKET, unix.SOCK_RAW, int(proto)); err != nil {
			return err
		}
		return unix.Bind(fd, &unix.SockaddrLinklayer{Protocol: proto, Ifindex: ifi.Index})
	}))
	defer unix.Close(fd)
	tv := unix.Timeval{Usec: 50000}
	_ = unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
	var mu sync.Mutex
	seen := map[string]bool{}
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		buf := make([]byte, 65536)
		for {
			select {
			case <-stop:
				return
			default:
			}
			n, _, err := unix.Recvfrom(fd, buf, 0)
			if err != nil {
				continue
			}
			for rest := buf[:n]; ; {
				i := bytes.Index(rest, []byte("cbxmark:"))
				if i < 0 {
					break
				}
				rest = rest[i+8:]
				if j := bytes.IndexByte(rest, ':'); j > 0 {
					mu.Lock()
					seen[string(rest[:j])] = true
					mu.Unlock()
				}
			}
		}
	}()
	send()
	time.Sleep(300 * time.Millisecond)
	close(stop)
	<-done
	mu.Lock()
	defer mu.Unlock()
	out := make([]string, 0, len(seen))
	for k := range seen {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// fdbPort returns the bridge port the FDB holds mac on ("" if none).
func (l *portLab) fdbPort(t *testing.T, mac net.HardwareAddr) string {
	t.Helper()
	h := handle(t, l.host)
	ns, err := h.NeighList(0, unix.AF_BRIDGE)
	must(t, err)
	for _, n := range ns {
		if bytes.Equal(n.HardwareAddr, mac) && n.Flags&netlink.NTF_SELF == 0 {
			if lk, err := h.LinkByIndex(n.LinkIndex); err == nil {
				return lk.Attrs().Name
			}
		}
	}
	return ""
}

// fdbSettle is how long the FDB is watched for a frame's learning. The bridge
// learns in the receive softirq, which on a loaded machine (test packages side
// by side on 2 cores) runs in ksoftirqd, well after the send returned: a fixed
// 10 ms sleep missed the spoof's move in the control.
const fdbSettle = 500 * time.Millisecond

// waitFDB polls where the FDB has mac until it is on port or fdbSettle passed,
// and returns where it is then.
func (l *portLab) waitFDB(t *testing.T, mac net.HardwareAddr, port string) string {
	t.Helper()
	deadline := time.Now().Add(fdbSettle)
	for {
		p := l.fdbPort(t, mac)
		if p == port || time.Now().After(deadline) {
			return p
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// relearn has the sibling send one frame so the FDB holds its MAC on its port.
func (l *portLab) relearn(t *testing.T) {
	t.Helper()
	f := etherFrame(bcastMAC, l.sibMAC, unix.ETH_P_IP, ipv4Packet(plSib, "255.255.255.255", 9, 9, 0, []byte(marker("sib-learn"))))
	must(t, sendFrames(l.sib, l.sibIf, f))
	if p := l.waitFDB(t, l.sibMAC, l.sibPort); p != l.sibPort {
		t.Fatalf("FDB holds the sibling's MAC on %q, want %s", p, l.sibPort)
	}
}

// spoofFDB sends the sibling's MAC from the box's port alone, right after
// the sibling re-taught the bridge, and returns where the FDB then has it:
// the box's port as soon as the spoof moved it, else the sibling's once
// fdbSettle passed without a move.
func (l *portLab) spoofFDB(t *testing.T) string {
	t.Helper()
	l.relearn(t)
	// br_netfilter would hand the frame to the wall (prerouting: a box-subnet source on a
	// port is dropped) before the bridge learns from it: only the bridge table is measured.
	var was []byte
	must(t, inNS(l.host, func() (err error) {
		was, err = os.ReadFile("/proc/sys/net/bridge/bridge-nf-call-iptables")
		return err
	}))
	sysctl(t, l.host, "bridge/bridge-nf-call-iptables", "0")
	defer sysctl(t, l.host, "bridge/bridge-nf-call-iptables", strings.TrimSpace(string(was)))
	f := etherFrame(bcastMAC, l.sibMAC, unix.ETH_P_IP, ipv4Packet(wlBox, "255.255.255.255", 9, 9, 0, []byte(marker("fdb-spoof"))))
	must(t, sendFrames(l.box, l.boxIf, f, f, f))
	return l.waitFDB(t, l.sibMAC, l.boxPort)
}

func bridgeFDB(ns netns.NsHandle, br string) string {
	out, _ := exec.Command("nsenter", "--net="+nsPath(ns), "bridge", "fdb", "show", "br", br).CombinedOutput()
	var keep []string
	for _, line := range strings.Split(string(out), "\n") {
		if line != "" && !strings.Contains(line, "permanent") {
			keep = append(keep, line)
		}
	}
	return strings.Join(keep, "; ")
}

// frameCase is a frame the bound box sends, the rules (keys) that must all
// be taken out for it to reach the bridge, none for a control.
type frameCase struct {
	name    string
	frame   []byte
	holders []string
}

func (l *portLab) frameCases() []frameCase {
	box, sib, own := l.boxMAC, l.sibMAC, wlBox
	fake := net.HardwareAddr{0x02, 0xcb, 0, 0, 0, 0x42}
	gwMAC := l.gwMAC
	udp := func(name, src, dst string, sport, dport uint16) []byte {
		return ipv4Packet(src, dst, sport, dport, 0, []byte(marker(name)))
	}
	eth := func(src net.HardwareAddr, typ uint16, p []byte) []byte { return etherFrame(bcastMAC, src, typ, p) }
	ip4 := uint16(unix.ETH_P_IP)
	arp := uint16(unix.ETH_P_ARP)
	return []frameCase{
		// Controls: what a bound box sends for itself.
		{"own-ipv4", eth(box, ip4, udp("own-ipv4", own, "255.255.255.255", 9, 9)), nil},
		{"own-arp-request", eth(box, arp, arpBody(arpEthIPv4, 1, box, own, wlGW, "own-arp-request")), nil},
		{"own-arp-probe-0.0.0.0", eth(box, arp, arpBody(arpEthIPv4, 1, box, "0.0.0.0", own, "own-arp-probe-0.0.0.0")), nil},
		{"own-dhcp-discover", eth(box, ip4, ipv4Packet("0.0.0.0", "255.255.255.255", 68, 67, 0, bootp(box, 6, 1, "own-dhcp-discover"))), nil},
		{"own-dhcp-renew-unicast", etherFrame(gwMAC, box, ip4, ipv4Packet(own, wlGW, 68, 67, 0, bootp(box, 6, 3, "own-dhcp-renew-unicast"))), nil},

		{"ip-of-sibling", eth(box, ip4, udp("ip-of-sibling", plSib, "255.255.255.255", 9, 9)), []string{kPortIP}},
		{"ip-unrelated", eth(box, ip4, udp("ip-unrelated", "192.0.2.77", "255.255.255.255", 9, 9)), []string{kPortIP}},
		{"mac-of-sibling", eth(sib, ip4, udp("mac-of-sibling", own, "255.255.255.255", 9, 9)), []string{kPortMAC}},
		{"arp-is-at-sibling-ip", eth(box, arp, arpBody(arpEthIPv4, 2, box, plSib, plSib, "arp-is-at-sibling-ip")), []string{kPortARPIP}},
		{"arp-sender-mac-of-sibling", eth(box, arp, arpBody(arpEthIPv4, 2, sib, own, own, "arp-sender-mac-of-sibling")), []string{kPortARPMAC}},
		{"arp-not-ethernet-ipv4", eth(box, arp, arpBody([]byte{0, 1, 0x86, 0xdd, 6, 4}, 2, box, own, own, "arp-not-ethernet-ipv4")), []string{kPortARPShape}},
		{"dhcp-foreign-chaddr", eth(box, ip4, ipv4Packet("0.0.0.0", "255.255.255.255", 68, 67, 0, bootp(fake, 6, 1, "dhcp-foreign-chaddr"))), []string{kPortChaddr, kL2Chaddr}},
		{"dhcp-release-sibling", etherFrame(gwMAC, box, ip4, ipv4Packet(own, wlGW, 68, 67, 0, bootp(sib, 6, 7, "dhcp-release-sibling"))), []string{kPortChaddr, kL2Chaddr}},
		// A relayed request (giaddr a sibling's address): dnsmasq would answer at the sibling.
		{"dhcp-relay-giaddr", etherFrame(gwMAC, box, ip4, ipv4Packet(own, wlGW, 68, 67, 0, withField(bootp(box, 6, 1, "dhcp-relay-giaddr"), 24, net.ParseIP(plSib).To4()))), []string{kPortRelay, kL2Relay}},
		{"dhcp-relay-hops", etherFrame(gwMAC, box, ip4, ipv4Packet(own, wlGW, 68, 67, 0, withField(bootp(box, 6, 1, "dhcp-relay-hops"), 3, []byte{1}))), []string{kPortRelay, kL2Relay}},
		{"dhcp-from-port-67", etherFrame(gwMAC, box, ip4, ipv4Packet(own, wlGW, 67, 67, 0, bootp(box, 6, 1, "dhcp-from-port-67"))), []string{kPortRelay, kL2Relay}},
		{"dhcp-ciaddr-sibling", etherFrame(gwMAC, box, ip4, ipv4Packet(own, wlGW, 68, 67, 0, withField(bootp(box, 6, 3, "dhcp-ciaddr-sibling"), 12, net.ParseIP(plSib).To4()))), []string{kPortRelay, kL2Relay}},
		{"dhcp-hlen-16", eth(box, ip4, ipv4Packet("0.0.0.0", "255.255.255.255", 68, 67, 0, bootp(box, 16, 1, "dhcp-hlen-16"))), []string{kPortDHCPHw, kL2DHCPHw}},
		{"0.0.0.0-not-dhcp", eth(box, ip4, udp("0.0.0.0-not-dhcp", "0.0.0.0", "255.255.255.255", 1234, 9999)), []string{kPortZero}},
		// A first fragment (MF) of a DHCP discover with its own chaddr: the
		// 0.0.0.0 rules and the fragment rules each hold it.
		{"0.0.0.0-fragment", eth(box, ip4, ipv4Packet("0.0.0.0", "255.255.255.255", 68, 67, 0x2000, bootp(box, 6, 1, "0.0.0.0-fragment"))), []string{kPortFrag, kPortZero, kL2Frag}},
		// A later fragment (offset 8) to the gateway: no transport header, so
		// no DHCP rule can see a chaddr in it; only the fragment rules hold it.
		{"later-fragment-to-gateway", etherFrame(gwMAC, box, ip4, ipv4Packet(own, wlGW, 68, 67, 0x0001, []byte(marker("later-fragment-to-gateway")))), []string{kPortFrag, kL2Frag, kPortRelay, kL2Relay}},
		{"vlan0-ipv4", taggedFrame(bcastMAC, box, 0x8100, 0, ip4, udp("vlan0-ipv4", own, "255.255.255.255", 9, 9)), []string{kPortEthertype}},
		{"vlan5-ipv4", taggedFrame(bcastMAC, box, 0x8100, 5, ip4, udp("vlan5-ipv4", own, "255.255.255.255", 9, 9)), []string{kPortEthertype}},
		{"qinq-ipv4", taggedFrame(bcastMAC, box, 0x88a8, 7, ip4, udp("qinq-ipv4", own, "255.255.255.255", 9, 9)), []string{kPortEthertype}},
		{"ethertype-0x88b5", eth(box, 0x88b5, []byte(marker("ethertype-0x88b5"))), []string{kPortEthertype}},
		{"ipv6-link-local", etherFrame(net.HardwareAddr{0x33, 0x33, 0, 0, 0, 1}, box, unix.ETH_P_IPV6, ipv6LinkLocal("ipv6-link-local")), []string{kPortEthertype}},
	}
}

// sendCases sends every case from the box (three times) and returns what
// the bridge device saw.
func (l *portLab) sendCases(t *testing.T, cs []frameCase) []string {
	t.Helper()
	var frames [][]byte
	for _, c := range cs {
		frames = append(frames, c.frame)
	}
	return capture(t, l.host, l.bridge, func() {
		for i := 0; i < 3; i++ {
			must(t, sendFrames(l.box, l.boxIf, frames...))
			time.Sleep(20 * time.Millisecond)
		}
	})
}

func checkSeen(t *testing.T, phase string, cs []frameCase, seen []string, want func(frameCase) bool) {
	t.Helper()
	for _, c := range cs {
		if got := slices.Contains(seen, c.name); got != want(c) {
			t.Errorf("%s: %s reached the bridge = %v, want %v", phase, c.name, got, want(c))
		}
	}
}

// TestPortBinding proves each per-port rule alone, with frames a root in a
// box can send: with no L2 rules every frame reaches the bridge (the
// capture's control); with the bound port's rules only the controls do; and
// with exactly the rules holding a case taken out, that case does. A frame
// with the sibling's MAC never moves the sibling's FDB entry while the rule
// holds, and does move it without.
func TestPortBinding(t *testing.T) {
	t.Parallel()
	l := newPortLab(t)
	cs := l.frameCases()
	control := func(c frameCase) bool { return len(c.holders) == 0 }
	all := func(frameCase) bool { return true }

	l.noL2(t)
	l.relearn(t)
	checkSeen(t, "no L2 rules", cs, l.sendCases(t, cs), all)
	noRules := l.spoofFDB(t)
	t.Logf("no L2 rules: after the spoofed frames the FDB holds the sibling's MAC on %s (%s)", noRules, bridgeFDB(l.host, l.bridge))
	if noRules != l.boxPort {
		t.Errorf("no L2 rules: sibling's MAC on %q after the spoof, want %s (the attack's control)", noRules, l.boxPort)
	}

	modes := []string{"as is"}
	if perNetnsBrNetfilter(t) {
		modes = []string{"0", "1"}
	}
	for _, mode := range modes {
		if mode != "as is" {
			sysctl(t, l.host, "bridge/bridge-nf-call-iptables", mode)
		}
		l.loadL2(t)
		l.relearn(t)
		phase := "port binding, call-iptables=" + mode
		checkSeen(t, phase, cs, l.sendCases(t, cs), control)
		if p := l.spoofFDB(t); p != l.sibPort {
			t.Errorf("%s: FDB moved the sibling's MAC to %q (%s)", phase, p, bridgeFDB(l.host, l.bridge))
		} else {
			t.Logf("%s: FDB unchanged: %s", phase, bridgeFDB(l.host, l.bridge))
		}
	}
	if t.Failed() {
		return
	}

	groups := map[string][]frameCase{}
	for _, c := range cs {
		if len(c.holders) > 0 {
			k := joinKeys(c.holders)
			groups[k] = append(groups[k], c)
		}
	}
	keys := make([]string, 0, len(groups))
	for k := range groups {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		g := groups[k]
		l.loadL2(t, g[0].holders...)
		l.relearn(t)
		// Every case of the group reaches the bridge; every control too.
		seen := l.sendCases(t, append(slices.Clone(g), cs[:5]...))
		checkSeen(t, "without "+k, g, seen, all)
		if len(g[0].holders) > 1 {
			for _, h := range g[0].holders {
				l.loadL2(t, h)
				checkSeen(t, "without only "+h, g, l.sendCases(t, g), func(frameCase) bool { return false })
			}
		}
		if k == kPortMAC {
			if p := l.spoofFDB(t); p != l.boxPort {
				t.Errorf("without %s: sibling's MAC on %q, want moved to %s", k, p, l.boxPort)
			}
		}
	}
}

// TestPortBindingLinkLocal: frames to an IEEE 802.1D reserved group address
// (01:80:c2:00:00:0x) are learnt by the bridge outside the prerouting hook
// (LLDP, ...0e, with no hook at all; most others after the input hook), so
// the port binding alone cannot keep them from moving a sibling's FDB entry.
// The bridge option no_linklocal_learn=1 stops that learning; boxcore sets it
// (SetNoLinkLocalLearn) with the bindings. (...00, STP's address, goes through
// prerouting while STP is off, as on Incus bridges.)
func TestPortBindingLinkLocal(t *testing.T) {
	t.Parallel()
	l := newPortLab(t)
	l.loadL2(t)
	for _, dst := range []net.HardwareAddr{
		{0x01, 0x80, 0xc2, 0, 0, 0x0e}, {0x01, 0x80, 0xc2, 0, 0, 0x03}, {0x01, 0x80, 0xc2, 0, 0, 0x00},
	} {
		for _, noLL := range []string{"0", "1"} {
			if out, err := exec.Command("nsenter", "--net="+nsPath(l.host), "ip", "link", "set", l.bridge,
				"type", "bridge", "no_linklocal_learn", noLL).CombinedOutput(); err != nil {
				t.Fatalf("no_linklocal_learn: %v %s", err, out)
			}
			l.relearn(t)
			f := etherFrame(dst, l.sibMAC, unix.ETH_P_IP, ipv4Packet(wlBox, "255.255.255.255", 9, 9, 0, []byte(marker("ll"))))
			must(t, sendFrames(l.box, l.boxIf, f, f, f))
			time.Sleep(30 * time.Millisecond)
			got := l.fdbPort(t, l.sibMAC)
			t.Logf("dst %s, port binding loaded, no_linklocal_learn=%s: the sibling's MAC is on %s", dst, noLL, got)
			if noLL == "1" && got != l.sibPort {
				t.Errorf("dst %s with no_linklocal_learn=1: the sibling's MAC moved to %s", dst, got)
			}
		}
	}
}

// l2Probes are the routed-range and host→box cases the L2 ranges hold, and
// the controls that must stay open under every L2 rule.
func (l *portLab) l2Probes(t *testing.T) []wallProbe {
	t.Helper()
	listenTCP(t, l.host, hostPort(wlGW, 53))
	listenRecorder(t, l.host, "udp4", hostPort(wlGW, 53)) // SO_REUSEADDR: the probe below sends from gw:53
	dhcp := listenRecorder(t, l.host, "udp4", "0.0.0.0:67")
	listenTCP(t, l.box, hostPort(wlBox, 7000))
	box68 := listenRecorder(t, l.box, "udp4", hostPort(wlBox, 68))
	listenTCP(t, l.wan, hostPort(wlPublic, 7000))
	listenTCP(t, l.wan, hostPort(wlLAN, 7000))
	lan := listenRecorder(t, l.wan, "udp4", hostPort(wlLAN, 7100))

	oneWay := func(from netns.NsHandle, laddr, raddr string, rec *recorder) func() string {
		return func() string {
			tok := token("l2")
			if err := sendUDP(from, "udp4", laddr, raddr, tok); err != nil {
				if strings.Contains(err.Error(), "operation not permitted") {
					return dropped
				}
				return "check-failed: " + err.Error()
			}
			if rec.wait(tok) == dropped {
				return dropped
			}
			return open
		}
	}
	return []wallProbe{
		// Controls.
		{name: "box→gw dns udp", run: func() string { return udpProbe(l.box, hostPort(wlGW, 53)) }, want: open},
		{name: "box→gw dns tcp", run: func() string { return tcpProbe(l.box, hostPort(wlGW, 53)) }, want: open},
		{name: "box→public tcp (egress)", run: func() string { return tcpProbe(l.box, hostPort(wlPublic, 7000)) }, want: open},
		{name: "box 0.0.0.0:68→255.255.255.255:67 own chaddr (DHCP discover)", run: func() string {
			tok := token("dhcp")
			pkt := bootp(l.boxMAC, 6, 1, tok)
			if err := rawUDP(l.box, l.boxIf, bcastMAC, "0.0.0.0", "255.255.255.255", 68, 67, string(pkt)); err != nil {
				return "check-failed: " + err.Error()
			}
			if dhcp.wait(string(pkt)) == dropped {
				return dropped
			}
			return open
		}, want: open},
		{name: "host gw:67→box:68 (DHCP reply)", run: oneWay(l.host, hostPort(wlGW, 67), hostPort(wlBox, 68), box68), want: open},
		{name: "host gw:53→box:68 (DNS-reply-like)", run: oneWay(l.host, hostPort(wlGW, 53), hostPort(wlBox, 68), box68), want: open},

		// Routed blocked ranges.
		{name: "box→LAN decoy udp (one way)", run: oneWay(l.box, "", hostPort(wlLAN, 7100), lan), want: dropped, holders: []string{kL2BlockedDst}},
		{name: "box→LAN decoy tcp", run: func() string { return tcpProbe(l.box, hostPort(wlLAN, 7000)) }, want: dropped, holders: []string{kL2BlockedDst, kL2BlockedSrc}},
		{name: "LAN decoy→box udp (one way)", run: oneWay(l.wan, hostPort(wlLAN, 7101), hostPort(wlBox, 68), box68), want: dropped, holders: []string{kL2BlockedSrc}},
		{name: "LAN decoy→box tcp", run: func() string { return dialFrom(l.wan, wlLAN, hostPort(wlBox, 7000)) }, want: dropped, holders: []string{kL2BlockedDst, kL2BlockedSrc, kL2HostSYN}},

		// Host→box from the gateway.
		{name: "host→box tcp SYN", run: func() string { return tcpProbe(l.host, hostPort(wlBox, 7000)) }, want: dropped, holders: []string{kL2HostSYN}},
		{name: "host gw:5000→box:68 udp", run: oneWay(l.host, hostPort(wlGW, 5000), hostPort(wlBox, 68), box68), want: dropped, holders: []string{kL2HostUDP}},
		{name: "host→box ping", run: func() string { return icmpProbe(l.host, parseIP(wlBox)) }, want: dropped, holders: []string{kL2HostEcho}},
	}
}

// dialFrom opens a TCP connection from a local address in ns.
func dialFrom(ns netns.NsHandle, laddr, raddr string) string {
	var out string
	_ = inNS(ns, func() error {
		d := net.Dialer{Timeout: probeTimeout, LocalAddr: &net.TCPAddr{IP: net.ParseIP(laddr)}}
		c, err := d.Dial("tcp4", raddr)
		if err == nil {
			c.Close()
		}
		out = classify(err)
		return nil
	})
	return out
}

// TestL2Ranges proves the routed-range and host→box rules at L2 alone (no
// wall, no guard, no Incus ACL), with br_netfilter's call-iptables off and
// on: the controls stay open, each case is dropped, and each turns open with
// exactly its rules taken out.
func TestL2Ranges(t *testing.T) {
	t.Parallel()
	l := newPortLab(t)
	ps := l.l2Probes(t)
	holeWant := func(p wallProbe) string { return p.holeWant() }

	modes := []string{"as is"}
	if perNetnsBrNetfilter(t) {
		modes = []string{"0", "1"}
	}
	t.Logf("bridge-nf-call-iptables modes: %v", modes)
	for _, mode := range modes {
		if mode != "as is" {
			sysctl(t, l.host, "bridge/bridge-nf-call-iptables", mode)
		}
		sfx := ", call-iptables=" + mode
		l.noL2(t)
		runWall(t, "no L2 rules"+sfx, ps, holeWant)
		l.loadL2(t)
		runWall(t, "L2 rules"+sfx, ps, func(p wallProbe) string { return p.want })
		if t.Failed() {
			return
		}
		groups := map[string][]wallProbe{}
		for _, p := range ps {
			if len(p.holders) > 0 {
				groups[joinKeys(p.holders)] = append(groups[joinKeys(p.holders)], p)
			}
		}
		keys := make([]string, 0, len(groups))
		for k := range groups {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		for _, k := range keys {
			g := groups[k]
			l.loadL2(t, g[0].holders...)
			runWall(t, "L2 without "+k+sfx, g, holeWant)
			if len(g[0].holders) < 2 {
				continue
			}
			for _, h := range g[0].holders {
				l.loadL2(t, h)
				runWall(t, "L2 without only "+h+sfx, g, func(p wallProbe) string { return p.want })
			}
		}
	}
}
