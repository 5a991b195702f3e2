package probes

// The active kinds need a bridged LAN, built on first use inside namespaces
// of the test's own (nothing here touches a host bridge):
//
//	client ns = attacker A  la0 198.18.5.10/24 .11/24 02:cb:00:00:05:0a ── pA ┐
//	nsB       = victim B    lb0 198.18.5.20/24, default via .1            ── pB ├─ br0 (nsSW)
//	nsG       = gateway G   lg0 198.18.5.1/24, dnsmasq DHCP .100-.150,    ── pG ┘
//	                        listeners TCP 7001 / UDP 7002
//
// B runs the listeners with the capture on lb0, as a box does. "Blocked"
// cases switch on what claudebox's layers would do at the bridge: a bridge
// nft table on A's port (source MAC/IP, ethertypes, DHCP chaddr) or port
// isolation of pA and pB.

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/claudebox/claudebox/internal/netdump"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
)

const (
	lanA, lanA2, lanB, lanG = "198.18.5.10", "198.18.5.11", "198.18.5.20", "198.18.5.1"
	macA, macB, macG        = "02:cb:00:00:05:0a", "02:cb:00:00:05:0b", "02:cb:00:00:05:01"
)

var lan struct {
	once       sync.Once
	err        error
	sw, b, g   netns.NsHandle
	bLis, gLis *Listeners
	dnsmasq    *exec.Cmd
	leases     string
}

// needLAN builds the LAN once; a failure fails every test that needs it.
func needLAN(t *testing.T) {
	t.Helper()
	lan.once.Do(func() { lan.err = buildLAN() })
	if lan.err != nil {
		t.Fatalf("LAN topology: %v", lan.err)
	}
}

func lanTeardown() {
	if lan.dnsmasq != nil && lan.dnsmasq.Process != nil {
		_ = lan.dnsmasq.Process.Kill()
		_ = lan.dnsmasq.Wait()
	}
	for _, l := range []*Listeners{lan.bLis, lan.gLis} {
		if l != nil {
			_ = l.Close()
		}
	}
}

func buildLAN() error {
	var err error
	for _, ns := range []*netns.NsHandle{&lan.sw, &lan.b, &lan.g} {
		if *ns, err = newNS(); err != nil {
			return err
		}
	}
	h, _ := netlink.NewHandle()
	sh, err := netlink.NewHandleAt(lan.sw)
	if err != nil {
		return err
	}
	br := &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: "br0"}}
	if err := sh.LinkAdd(br); err != nil {
		return fmt.Errorf("bridge: %w", err)
	}
	for _, v := range []struct {
		name, port, mac string
		into            netns.NsHandle
	}{{"la0", "pA", macA, 0}, {"lb0", "pB", macB, lan.b}, {"lg0", "pG", macG, lan.g}} {
		la := netlink.NewLinkAttrs()
		la.Name = v.name
		la.HardwareAddr, _ = net.ParseMAC(v.mac)
		if err := h.LinkAdd(&netlink.Veth{LinkAttrs: la, PeerName: v.port, PeerNamespace: netlink.NsFd(int(lan.sw))}); err != nil {
			return fmt.Errorf("veth %s: %w", v.name, err)
		}
		if v.into != 0 {
			l, _ := h.LinkByName(v.name)
			if err := h.LinkSetNsFd(l, int(v.into)); err != nil {
				return err
			}
		}
		p, _ := sh.LinkByName(v.port)
		if err := sh.LinkSetMaster(p, br); err != nil {
			return err
		}
		if err := sh.LinkSetUp(p); err != nil {
			return err
		}
	}
	if err := sh.LinkSetUp(br); err != nil {
		return err
	}
	if err := lanHost("la0", []string{lanA + "/24", lanA2 + "/24", "fe80::a5/64"}, ""); err != nil {
		return err
	}
	if err := inNS(lan.b, func() error { return lanHost("lb0", []string{lanB + "/24", "fe80::b5/64"}, lanG) }); err != nil {
		return err
	}
	if err := inNS(lan.g, func() error { return lanHost("lg0", []string{lanG + "/24", "fe80::15/64"}, "") }); err != nil {
		return err
	}
	if err := inNS(lan.b, func() error {
		var err error
		lan.bLis, err = Serve(context.Background(), ListenerConfig{TCP: []int{7001}, UDP: []int{7002}, Capture: "lb0"})
		return err
	}); err != nil {
		return err
	}
	return inNS(lan.g, startGateway)
}

// lanHost configures one end on the calling thread's namespace: no DAD (the
// addresses are usable at once), RAs accepted (the rogue RA must be able to
// land), addresses, up, and an optional default route.
func lanHost(iface string, cidrs []string, gw string) error {
	for _, p := range []string{"net/ipv6/conf/" + iface + "/accept_dad", "net/ipv6/conf/" + iface + "/dad_transmits"} {
		_ = writeSysctl(p, "0")
	}
	_ = writeSysctl("net/ipv6/conf/"+iface+"/accept_ra", "1")
	h, _ := netlink.NewHandle()
	l, err := h.LinkByName(iface)
	if err != nil {
		return err
	}
	for _, c := range cidrs {
		if err := addAddr(h, l, c); err != nil {
			return fmt.Errorf("%s %s: %w", iface, c, err)
		}
	}
	lo, _ := h.LinkByName("lo")
	_ = h.LinkSetUp(lo)
	if err := h.LinkSetUp(l); err != nil {
		return err
	}
	if gw == "" {
		return nil
	}
	return h.RouteAdd(&netlink.Route{LinkIndex: l.Attrs().Index, Gw: net.ParseIP(gw)})
}

// startGateway runs on a thread inside nsG: listeners and a DHCP-only dnsmasq
// (--no-ping: the real one pings for ~3 s before an offer; the probes' own
// timeouts cover that, the tests need not wait it out).
func startGateway() error {
	var err error
	if lan.gLis, err = Serve(context.Background(), ListenerConfig{TCP: []int{7001}, UDP: []int{7002}}); err != nil {
		return err
	}
	lan.leases = filepath.Join(topo.dir, "lan-leases")
	dm := exec.Command("dnsmasq", "--no-daemon", "--conf-file=/dev/null", "--port=0",
		"--interface=lg0", "--bind-interfaces", "--except-interface=lo", "--no-ping",
		"--dhcp-range=198.18.5.100,198.18.5.150,255.255.255.0,1h",
		"--dhcp-leasefile="+lan.leases, "--pid-file="+filepath.Join(topo.dir, "lan-dnsmasq.pid"),
		"--log-dhcp", "--log-facility="+filepath.Join(topo.dir, "lan-dnsmasq.log"), "--user=root", "--group=root")
	dm.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := dm.Start(); err != nil {
		return fmt.Errorf("dnsmasq: %w", err)
	}
	lan.dnsmasq = dm
	return nil
}

// portFilter is what per-port NIC filtering does for A at the bridge.
const portFilter = `table bridge cbport {
	chain pre {
		type filter hook prerouting priority -200; policy accept;
		iifname "pA" ether saddr != ` + macA + ` drop
		iifname "pA" ether type != { ip, arp } drop
		iifname "pA" arp saddr ip != { ` + lanA + `, ` + lanA2 + ` } drop
		iifname "pA" ip saddr != { ` + lanA + `, ` + lanA2 + `, 0.0.0.0 } drop
		iifname "pA" udp dport 67 @ih,224,48 != 0x` + "02cb0000050a" + ` drop
	}
}
`

// nftIn runs an nft script in ns; "-" deletes quietly.
func nftIn(t *testing.T, ns netns.NsHandle, script string) {
	t.Helper()
	err := inNS(ns, func() error {
		c := exec.Command("nft", "-f", "-")
		c.Stdin = bytes.NewBufferString(script)
		if out, err := c.CombinedOutput(); err != nil {
			return fmt.Errorf("nft: %v: %s", err, out)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// withFilter switches A's port filter on or off for the rest of the test.
func withFilter(t *testing.T, on bool) {
	t.Helper()
	nftIn(t, lan.sw, "table bridge cbport {}\ndelete table bridge cbport\n")
	if on {
		nftIn(t, lan.sw, portFilter)
	}
	t.Cleanup(func() { nftIn(t, lan.sw, "table bridge cbport {}\ndelete table bridge cbport\n") })
}

// withIsolation sets bridge port isolation on pA and pB.
func withIsolation(t *testing.T, on bool) {
	t.Helper()
	set := func(v bool) {
		sh, err := netlink.NewHandleAt(lan.sw)
		if err != nil {
			t.Fatal(err)
		}
		defer sh.Close()
		for _, p := range []string{"pA", "pB"} {
			l, err := sh.LinkByName(p)
			if err != nil {
				t.Fatal(err)
			}
			if err := sh.LinkSetIsolated(l, v); err != nil {
				t.Fatalf("isolate %s: %v", p, err)
			}
		}
	}
	set(on)
	t.Cleanup(func() { set(false) })
}

// gTalksToB keeps G sending to B (UDP echo, every 10 ms) until the test
// ends: the traffic a poisoned neighbour entry or FDB would divert to A.
func gTalksToB(t *testing.T) {
	t.Helper()
	var c net.Conn
	if err := inNS(lan.g, func() error {
		var err error
		c, err = net.Dial("udp4", lanB+":7002")
		return err
	}); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		tk := time.NewTicker(10 * time.Millisecond)
		defer tk.Stop()
		for {
			select {
			case <-done:
				return
			case <-tk.C:
				_, _ = c.Write([]byte("g-to-b"))
			}
		}
	}()
	t.Cleanup(func() { close(done); _ = c.Close() })
	time.Sleep(50 * time.Millisecond) // G has resolved B before the probe starts
}

// markerHits returns the hits carrying marker.
func markerHits(hs []Hit, marker string) []Hit {
	var out []Hit
	for _, h := range hs {
		if strings.Contains(h.Payload, marker) || (h.Frame != nil && h.Frame.Marker == marker) {
			out = append(out, h)
		}
	}
	return out
}

// gNeighbourOfB is the MAC G's neighbour table holds for B.
func gNeighbourOfB(t *testing.T) string {
	t.Helper()
	var mac string
	_ = inNS(lan.g, func() error {
		ns, err := netdump.Neighs(0, netlink.FAMILY_V4)
		for _, n := range ns {
			if n.IP.String() == lanB {
				mac = n.HardwareAddr.String()
			}
		}
		return err
	})
	return mac
}

// bNeighbourOfG is the MAC B's neighbour table holds for its gateway G.
func bNeighbourOfG(t *testing.T) string {
	t.Helper()
	var mac string
	_ = inNS(lan.b, func() error {
		ns, err := netdump.Neighs(0, netlink.FAMILY_V4)
		for _, n := range ns {
			if n.IP.String() == lanG && len(n.HardwareAddr) == 6 {
				mac = n.HardwareAddr.String()
			}
		}
		return err
	})
	return mac
}

func readLeases(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile(lan.leases)
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	return string(b)
}
