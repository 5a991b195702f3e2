package probes

import (
	"context"
	"encoding/json"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
)

// TestInitInBox runs PID-1 mode's work (minus mounts and signals) in the box
// namespace against dnsmasq in the peer: DHCP with the hostname option,
// address, default route, resolv.conf, listeners and the status file.
func TestInitInBox(t *testing.T) {
	dir := t.TempDir()
	cfg := InitConfig{
		Hostname:   "cbprobe-box1",
		StatusFile: filepath.Join(dir, "status.json"),
		ResolvConf: filepath.Join(dir, "resolv.conf"),
		Listen:     ListenerConfig{TCP: []int{7001}, UDP: []int{7002}, HitsFile: filepath.Join(dir, "hits.jsonl")},
		SkipMounts: true,
	}.withDefaults()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	logw := &testWriter{t: t}
	go func() { done <- inNS(topo.box, func() error { return runInit(ctx, cfg, logw) }) }()
	defer func() {
		cancel()
		if err := <-done; err != context.Canceled {
			t.Errorf("runInit returned %v", err)
		}
	}()

	start := time.Now()
	var st Status
	waitFor(t, 10*time.Second, "status ready", func() bool {
		var err error
		st, err = ReadStatus(cfg.StatusFile)
		return err == nil && st.Ready
	})
	t.Logf("lease after %v (dhcp %d ms): %+v", time.Since(start), st.DHCPMillis, st)
	if !strings.HasPrefix(st.IPv4, "198.18.1.") || !strings.HasSuffix(st.IPv4, "/24") || st.Gateway != "198.18.1.1" ||
		st.Error != "" || st.LeaseSeconds != 3600 || st.Hostname != "cbprobe-box1" || len(st.TCP) != 1 || len(st.UDP) != 1 {
		t.Errorf("status %+v", st)
	}
	resolv, _ := os.ReadFile(cfg.ResolvConf)
	if !strings.Contains(string(resolv), "nameserver 198.18.1.1\n") || !strings.Contains(string(resolv), "search cbtest") {
		t.Errorf("resolv.conf:\n%s", resolv)
	}

	// The kernel agrees: address on eth0 and a default route, in the box.
	bh, err := netlink.NewHandleAt(topo.box)
	if err != nil {
		t.Fatal(err)
	}
	eth0, err := bh.LinkByName("eth0")
	if err != nil {
		t.Fatal(err)
	}
	addrs, _ := bh.AddrList(eth0, netlink.FAMILY_V4)
	if len(addrs) != 1 || addrs[0].IPNet.String() != st.IPv4 {
		t.Errorf("eth0 addresses %v, status says %s", addrs, st.IPv4)
	}
	routes, _ := bh.RouteList(nil, netlink.FAMILY_V4)
	hasDefault := false
	for _, r := range routes {
		hasDefault = hasDefault || (r.Gw != nil && r.Gw.Equal(net.ParseIP("198.18.1.1")) && (r.Dst == nil || r.Dst.IP.IsUnspecified()))
	}
	if !hasDefault {
		t.Errorf("no default route via 198.18.1.1 in %v", routes)
	}

	// dnsmasq received option 12 (the drill relies on a box announcing its name).
	waitFor(t, 2*time.Second, "hostname in dnsmasq's lease file", func() bool {
		b, _ := os.ReadFile(filepath.Join(topo.dir, "leases"))
		return strings.Contains(string(b), " cbprobe-box1 ")
	})
	logb, _ := os.ReadFile(topo.dnsmasqLog)
	if !strings.Contains(string(logb), "cbprobe-box1") {
		t.Errorf("dnsmasq log lacks the hostname:\n%s", logb)
	}

	// The box's listeners answer from the peer's side of the wire.
	lease := strings.TrimSuffix(st.IPv4, "/24")
	var results []Result
	err = inNS(topo.peer, func() error {
		// Run's sockets are created on this goroutine, so they live in the peer.
		results = []Result{
			Run(ctx, Spec{Kind: KindTCP, Target: lease, Port: 7001, Timeout: quick}),
			Run(ctx, Spec{Kind: KindUDP, Target: lease, Port: 7002, Timeout: quick}),
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range results {
		if r.Outcome != Open {
			t.Errorf("peer → box %s: %s (%s)", r.Probe.Kind, r.Outcome, r.Evidence)
		}
	}
	// The listeners append hits as they answer; the UDP one may land just after the probe saw
	// its echo (CI under load), so read until both are there.
	var hits []Hit
	for deadline := time.Now().Add(3 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		hits, _ = ReadHits(cfg.Listen.HitsFile)
		if len(hits) >= 2 || time.Now().After(deadline) {
			break
		}
	}
	if len(hits) < 2 || !strings.HasPrefix(hits[0].Peer, "198.18.1.1:") {
		t.Errorf("box hits %+v", hits)
	}

	// Facts from inside the box show the lease and the default route.
	var f *Facts
	_ = inNS(topo.box, func() error { f, err = GatherFacts(""); return err })
	if err != nil || len(f.IPv4) != 1 || f.IPv4[0] != st.IPv4 || len(f.DefaultRoutes) != 1 || f.DefaultRoutes[0].Gateway != "198.18.1.1" {
		b, _ := json.Marshal(f)
		t.Errorf("box facts %s (err %v)", b, err)
	}
}

func TestInitDHCPFailureIsReported(t *testing.T) {
	dir := t.TempDir()
	cfg := InitConfig{
		Iface:       "nosuch0",
		StatusFile:  filepath.Join(dir, "status.json"),
		ResolvConf:  filepath.Join(dir, "resolv.conf"),
		Listen:      ListenerConfig{TCP: []int{0}, UDP: []int{0}},
		SkipMounts:  true,
		DHCPTimeout: 300 * time.Millisecond,
	}.withDefaults()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- inNS(topo.box, func() error { return runInit(ctx, cfg, io.Discard) }) }()
	var st Status
	waitFor(t, 8*time.Second, "dhcp error in status", func() bool {
		var err error
		st, err = ReadStatus(cfg.StatusFile)
		return err == nil && st.Error != ""
	})
	cancel()
	<-done
	if st.Ready || st.Phase != "dhcp-failed" || !strings.Contains(st.Error, "nosuch0") {
		t.Errorf("status %+v", st)
	}
}

func TestStatusFile(t *testing.T) {
	p := filepath.Join(t.TempDir(), "sub", "status.json")
	in := Status{Ready: true, Phase: "ready", IPv4: "198.18.1.50/24"}
	if err := WriteStatus(p, in); err != nil {
		t.Fatal(err)
	}
	out, err := ReadStatus(p)
	if err != nil || !out.Ready || out.IPv4 != in.IPv4 || out.Updated.IsZero() {
		t.Fatalf("%+v %v", out, err)
	}
	b, _ := os.ReadFile(p)
	for _, k := range []string{`"ready":true`, `"ipv4":"198.18.1.50/24"`, `"error":""`} {
		if !strings.Contains(string(b), k) {
			t.Errorf("status JSON %s lacks %s", b, k)
		}
	}
	if _, err := os.Stat(p + ".tmp"); !os.IsNotExist(err) {
		t.Error("temporary file left behind")
	}
}

func TestRunInitRefusesOutsidePID1(t *testing.T) {
	if err := RunInit(InitConfig{}); err == nil || IsInitMode() {
		t.Fatalf("RunInit outside PID 1: %v", err)
	}
}

// testWriter sends runInit's log lines to the test log.
type testWriter struct{ t *testing.T }

func (w *testWriter) Write(b []byte) (int, error) {
	w.t.Log(strings.TrimSpace(string(b)))
	return len(b), nil
}
