package firewall

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"net"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// The link-local group path. A frame a box sends to an IEEE 802.1 reserved
// group MAC (01:80:c2:00:00:0X) that the bridge does not forward is handed to
// the IP stack on the box's port (iif = the veth), not on the bridge: every
// `iifname B` rule misses it, and for 0e (LLDP) the bridge's input hook is
// skipped too. Two independent layers hold it: the wall's prerouting rules
// pre-port and pre-subnet-elsewhere (nftables), and rp_filter=1 on every bound
// port (a sysctl). Each is proven alone here: on, every case is held; off,
// every case reaches the host; on again, held again.

const llPort = 7007 // the host's UDP echo service, on 0.0.0.0 in the lab's host namespace

// llCase is one frame the box sends and what shows it got through.
type llCase struct {
	name  string
	frame []byte
	// icmp: the proof of a hole is an echo reply into the box, not the listener.
	icmp bool
	// boxSrc: the source is in the box subnet (what pre-subnet-elsewhere matches).
	boxSrc bool
	// zeroSrc: 0.0.0.0 to the limited broadcast. The kernel does no source
	// validation for it, so rp_filter does not hold it; the wall does.
	zeroSrc bool
}

func icmpEchoPacket(src, dst string, payload []byte) []byte {
	body := append([]byte{8, 0, 0, 0, 0xcb, 0x01, 0, 1}, payload...)
	binary.BigEndian.PutUint16(body[2:], checksum(body))
	pkt := make([]byte, 20, 20+len(body))
	pkt[0], pkt[8], pkt[9] = 0x45, 64, unix.IPPROTO_ICMP
	binary.BigEndian.PutUint16(pkt[2:], uint16(20+len(body)))
	copy(pkt[12:16], net.ParseIP(src).To4())
	copy(pkt[16:20], net.ParseIP(dst).To4())
	binary.BigEndian.PutUint16(pkt[10:], checksum(pkt[:20]))
	return append(pkt, body...)
}

func (l *portLab) llCases() []llCase {
	var cs []llCase
	ip4 := uint16(unix.ETH_P_IP)
	for _, x := range []byte{0x03, 0x0e, 0x0f} {
		ll := net.HardwareAddr{0x01, 0x80, 0xc2, 0, 0, x}
		n := func(s string) string { return fmt.Sprintf("ll%02x-%s", x, s) }
		udp := func(name string, smac net.HardwareAddr, src, dst string) llCase {
			return llCase{name: name, boxSrc: strings.HasPrefix(src, "10.77.12."),
				frame: etherFrame(ll, smac, ip4, ipv4Packet(src, dst, 40123, llPort, 0, []byte(marker(name))))}
		}
		cs = append(cs,
			udp(n("udp-gw"), l.boxMAC, wlBox, wlGW),
			udp(n("udp-uplink-addr"), l.boxMAC, wlBox, wlUp),
			udp(n("udp-bcast"), l.boxMAC, wlBox, "255.255.255.255"),
			udp(n("spoof-sib-ip"), l.boxMAC, plSib, wlUp),
			udp(n("spoof-sib-ip-mac"), l.sibMAC, plSib, wlUp),
			udp(n("spoof-public"), l.boxMAC, wlPublic, wlGW),
			llCase{name: n("icmp-gw"), icmp: true, boxSrc: true, frame: etherFrame(ll, l.boxMAC, ip4, icmpEchoPacket(wlBox, wlGW, []byte(marker(n("icmp-gw")))))},
			llCase{name: n("zero-bcast"), zeroSrc: true, frame: etherFrame(ll, l.boxMAC, ip4,
				ipv4Packet("0.0.0.0", "255.255.255.255", 40124, llPort, 0, []byte(marker(n("zero-bcast")))))},
		)
	}
	return cs
}

// captureIn collects the markers of frames arriving at iface in ns (not the
// ones it sends) while send runs and for a short tail after.
func captureIn(t *testing.T, ns netns.NsHandle, iface string, send func()) []string {
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
	stop, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		buf := make([]byte, 65536)
		for {
			select {
			case <-stop:
				return
			default:
			}
			n, sa, err := unix.Recvfrom(fd, buf, 0)
			if err != nil {
				continue
			}
			if ll, ok := sa.(*unix.SockaddrLinklayer); ok && ll.Pkttype == unix.PACKET_OUTGOING {
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

// sendLL sends every case from the box and returns, per case, what got
// through: the host's service heard it, a reply entered the box, or one was
// reflected into the sibling ("" when nothing did).
func (l *portLab) sendLL(t *testing.T, rec *recorder, cs []llCase) map[string]string {
	t.Helper()
	var toSib []string
	toBox := captureIn(t, l.box, "eth0", func() {
		toSib = captureIn(t, l.sib, "eth0", func() {
			for _, c := range cs {
				must(t, sendFrames(l.box, l.boxIf, c.frame))
			}
		})
	})
	out := map[string]string{}
	for _, c := range cs {
		var got []string
		rec.mu.Lock()
		src, heard := rec.seen[marker(c.name)]
		rec.mu.Unlock()
		if heard {
			got = append(got, "host service heard it from "+src)
		}
		if slices.Contains(toBox, c.name) {
			got = append(got, "a reply entered the box")
		}
		if slices.Contains(toSib, c.name) {
			got = append(got, "reflected into the sibling")
		}
		out[c.name] = strings.Join(got, "; ")
	}
	rec.mu.Lock()
	clear(rec.seen)
	rec.mu.Unlock()
	return out
}

// loadWallOnly loads the wall of the port lab's spec (its bindings included)
// alone, without the rules whose keys are listed; the bridge table and the
// guard are removed.
func (l *portLab) loadWallOnly(t *testing.T, without ...string) {
	t.Helper()
	s := l.spec().Resolved()
	_, err := Remove(s.Bridge)
	must(t, err)
	obs, err := Read(s.Bridge)
	must(t, err)
	var only Observed
	for _, ts := range obs.Tables {
		if ts.Name == WallTableName(s.Bridge) {
			only.Tables = append(only.Tables, ts)
		}
	}
	var rules []Rule
	for _, r := range Desired(s) {
		if r.Table == WallTableName(s.Bridge) && !slices.Contains(without, r.key) {
			rules = append(rules, r)
		}
	}
	must(t, applyRules(s, only, rules, false))
	l.flushConntrack(t)
}

func (l *portLab) setRPFilter(t *testing.T, v int) {
	t.Helper()
	must(t, inNS(l.host, func() error {
		for _, p := range []string{l.boxPort, l.sibPort} {
			if err := SetPortRPFilter(p, v); err != nil {
				return err
			}
			if eff, own, err := PortRPFilter(p); err != nil || eff != v || own != v {
				return fmt.Errorf("port %s rp_filter: effective %d own %d (%v), want %d", p, eff, own, err, v)
			}
		}
		return nil
	}))
}

// llControls are what must keep working whatever holds the link-local path:
// the box's DNS to the gateway and its egress over the bridge, the host
// talking to its own gateway address (loopback, with a box-subnet source).
func (l *portLab) llControls(t *testing.T, phase string) {
	t.Helper()
	rec := l.llRec
	for _, c := range []struct{ name, got string }{
		{"box DNS to the gateway", udpFrom(l.box, "udp4", "", hostPort(wlGW, 53))},
		{"box egress to the public decoy", udpFrom(l.box, "udp4", "", hostPort(wlPublic, llPort))},
	} {
		if c.got != open {
			t.Errorf("%s: control %s: %s, want %s", phase, c.name, c.got, open)
		}
	}
	tok := token("host-to-own-gateway")
	must(t, sendUDP(l.host, "udp4", "", hostPort(wlGW, llPort), tok))
	if src := rec.wait(tok); src != wlGW {
		t.Errorf("%s: control host→own gateway address: %s, want received from %s", phase, src, wlGW)
	}
}

// runLL sends every case and wants each held (held(c)) or through.
func (l *portLab) runLL(t *testing.T, phase string, held func(llCase) bool) {
	t.Helper()
	cs := l.llCases()
	got := l.sendLL(t, l.llRec, cs)
	var through []string
	for _, c := range cs {
		if got[c.name] != "" {
			through = append(through, c.name)
		}
	}
	t.Logf("%s: through %v", phase, through)
	for _, c := range cs {
		switch through := got[c.name]; {
		case held(c) && through != "":
			t.Errorf("%s: %s got through: %s", phase, c.name, through)
		case !held(c) && through == "":
			t.Errorf("%s: %s held, want it through (the hole this phase opens)", phase, c.name)
		}
	}
	l.llControls(t, phase)
}

var (
	heldAll  = func(llCase) bool { return true }
	heldNone = func(llCase) bool { return false }
	heldRP   = func(c llCase) bool { return !c.zeroSrc }
)

func TestLinkLocalGroupPath(t *testing.T) {
	t.Parallel()
	l := newPortLab(t)
	l.llRec = listenRecorder(t, l.host, "udp4", hostPort("0.0.0.0", llPort))
	listenRecorder(t, l.host, "udp4", hostPort(wlGW, 53))
	listenRecorder(t, l.wan, "udp4", hostPort(wlPublic, llPort))
	sysctl(t, l.host, "ipv4/conf/"+l.boxPort+"/rp_filter", "0")
	sysctl(t, l.host, "ipv4/conf/"+l.sibPort+"/rp_filter", "0")

	l.noL2(t)
	l.runLL(t, "no layer", heldNone)
	if t.Failed() {
		t.Fatal("the lab does not reproduce the link-local group path")
	}

	// Layer 1, the wall alone: on, off (the two rules out), on.
	l.loadWallOnly(t)
	l.runLL(t, "wall alone", heldAll)
	// (The rule for a box-subnet destination arriving elsewhere holds the cases aimed at
	// the gateway too: it goes out with them.)
	l.loadWallOnly(t, wPrePort, wPreSubnetElse, wPreSubnetDst)
	l.runLL(t, "wall without pre-port and pre-subnet-elsewhere", heldNone)
	l.loadWallOnly(t)
	l.runLL(t, "wall alone again", heldAll)
	// Each of the two rules alone: the port rule holds every case, the
	// subnet rule every case with a box-subnet source.
	l.loadWallOnly(t, wPreSubnetElse)
	l.runLL(t, "wall without only pre-subnet-elsewhere", heldAll)
	l.loadWallOnly(t, wPrePort, wPreSubnetDst)
	l.runLL(t, "wall without only pre-port", func(c llCase) bool { return c.boxSrc })

	// Layer 2, rp_filter alone (no nftables at all): on, off, on.
	l.noL2(t)
	l.setRPFilter(t, 1)
	l.runLL(t, "rp_filter alone", heldRP)
	l.setRPFilter(t, 0)
	l.runLL(t, "rp_filter off", heldNone)
	l.setRPFilter(t, 1)
	l.runLL(t, "rp_filter alone again", heldRP)

	// Both, with the whole ruleset as Apply installs it.
	_, err := Apply(l.spec())
	must(t, err)
	l.flushConntrack(t)
	l.runLL(t, "everything", heldAll)
	drift, err := Check(l.spec())
	must(t, err)
	if len(drift) > 0 {
		t.Errorf("Check after Apply: %v", drift)
	}
}
