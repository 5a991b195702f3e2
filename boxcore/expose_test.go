package boxcore_test

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/claudebox/claudebox/boxcore"
	"github.com/claudebox/claudebox/drill/probes"
	"github.com/claudebox/claudebox/firewall"
	"github.com/claudebox/claudebox/internal/testenv"
	"github.com/claudebox/claudebox/internal/teststack"
)

func TestAsExposure(t *testing.T) {
	dev := func(listen, connect string) map[string]string {
		return map[string]string{"type": "proxy", "bind": "host", "listen": listen, "connect": connect}
	}
	for _, c := range []struct {
		name string
		d    map[string]string
		ok   bool
	}{
		{"expose-3000", dev("tcp:127.0.0.1:8080", "tcp:127.0.0.1:3000"), true},
		{"expose-3000", dev("tcp:[::1]:8080", "tcp:127.0.0.1:3000"), true},
		{"expose-3000", dev("tcp:0.0.0.0:8080", "tcp:127.0.0.1:3000"), false},    // every address
		{"expose-3000", dev("tcp:10.0.0.1:8080", "tcp:127.0.0.1:3000"), false},   // not loopback
		{"expose-3000", dev("tcp:127.0.0.1:8080", "tcp:127.0.0.1:3001"), false},  // another port than its name
		{"expose-3000", dev("tcp:127.0.0.1:8080", "tcp:10.87.0.1:3000"), false},  // out of the box
		{"expose-3000", dev("udp:127.0.0.1:8080", "udp:127.0.0.1:3000"), false},  // not TCP
		{"expose-03000", dev("tcp:127.0.0.1:8080", "tcp:127.0.0.1:3000"), false}, // not the name Expose gives
		{"web", dev("tcp:127.0.0.1:8080", "tcp:127.0.0.1:3000"), false},          // not ours
		{"expose-3000", map[string]string{"type": "proxy", "bind": "instance", "listen": "tcp:127.0.0.1:8080", "connect": "tcp:127.0.0.1:3000"}, false},
	} {
		d := c.d
		if c.name == "expose-3000" && c.ok {
			d["nat"] = "" // any extra key is no longer Expose's shape
			if _, ok := boxcore.AsExposure(c.name, d); ok {
				t.Errorf("AsExposure accepted an extra key: %v", d)
			}
			delete(d, "nat")
		}
		if _, ok := boxcore.AsExposure(c.name, d); ok != c.ok {
			t.Errorf("AsExposure(%s, %v) = %v, want %v", c.name, d, ok, c.ok)
		}
	}
}

func TestParseExposeOn(t *testing.T) {
	for _, c := range []struct {
		on   string
		want string // "" = a usage error
	}{
		{"", "127.0.0.1:3000"},
		{"8080", "127.0.0.1:8080"},
		{"127.0.0.2:8080", "127.0.0.2:8080"},
		{"[::1]:8080", "[::1]:8080"},
		{"[::ffff:127.0.0.1]:8080", "127.0.0.1:8080"}, // one spelling per address
		{"0.0.0.0:8080", ""},
		{"10.87.0.1:8080", ""},
		{"[::]:8080", ""},
		{"localhost:8080", ""},
		{"70000", ""},
		{"0", ""},
		{"127.0.0.1:0", ""},
	} {
		got, err := boxcore.ParseExposeOn(c.on, 3000)
		switch {
		case c.want == "" && (err == nil || !boxcore.IsUsage(err)):
			t.Errorf("--on %q: %v, %v; want a usage error", c.on, got, err)
		case c.want != "" && (err != nil || got.String() != c.want):
			t.Errorf("--on %q: %v, %v; want %s", c.on, got, err, c.want)
		}
	}
}

// TestExpose, on the real daemon: a box's listener is reachable on the host's loopback at the
// exposed port and on none of the host's other addresses; bad requests are usage errors that
// change nothing; the exposure is the box's own (inside the boundary); a clone of it does not
// inherit it (and so starts beside it); unexpose closes it.
func TestExpose(t *testing.T) {
	c := testenv.RequireIncus(t)
	ctx := context.Background()
	s := teststack.New(t, c, "expose")
	bs := &boxcore.Boxes{Client: c, Stack: s, Version: "test"}
	img := teststack.ProbeImage(t, c)
	nics := mintTwo(t, ctx, bs, img, "cbt-exp")
	a, b := nics[0].name, nics[1].name
	box, err := boxcore.Resolve(ctx, c, a)
	if err != nil {
		t.Fatal(err)
	}
	on := netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), freePort(t))

	e, err := bs.Expose(ctx, box, probes.DefaultTCPPort, on)
	if err != nil {
		t.Fatalf("expose: %v", err)
	}
	if got := banner(t, on.String()); !strings.Contains(got, a) {
		t.Fatalf("on %s: banner %q, want the box %s's listener", on, got, a)
	}
	otherAddrs(t, on.Port())

	// Each layer alone: the guard's rules out, the proxy's loopback listen still keeps the
	// other addresses out (the guard's rule alone: firewall's TestExposureRules).
	host := boxcore.NewHost(c, s)
	st, err := host.Read(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(st.Exposed) != 1 || st.Exposed[0] != on.Port() {
		t.Fatalf("the stack's exposed host ports: %v, want [%d]", st.Exposed, on.Port())
	}
	st.Exposed = nil
	if _, err := firewall.Apply(host.FirewallSpec(st)); err != nil {
		t.Fatal(err)
	}
	otherAddrs(t, on.Port())
	if rep, err := host.Check(ctx); err != nil || len(rep.Drift()) == 0 {
		t.Errorf("host check with the exposure's guard rules gone: drift %v (%v), want it seen", rep.Drift(), err)
	}
	if err := host.BindPorts(ctx); err != nil {
		t.Fatal(err)
	}
	if rep, err := host.Check(ctx); err != nil || len(rep.Drift()) > 0 {
		t.Errorf("host check after the rebind: %v (%v)", rep.Drift(), err)
	}

	in, _, err := c.Instance(ctx, a)
	if err != nil {
		t.Fatal(err)
	}
	if got := boxcore.Exposures(in.Devices); len(got) != 1 || got[0] != e {
		t.Errorf("exposures %v, want [%v]", got, e)
	}
	if off := boxcore.OffBoundary(in.Config, in.Devices, s); len(off) > 0 {
		t.Errorf("an exposed box is off the boundary: %v", off)
	}
	info, err := bs.Info(ctx, &boxcore.Box{Name: a, Instance: in})
	if err != nil || len(info.Exposures) != 1 {
		t.Errorf("info's exposures: %v (%v)", info.Exposures, err)
	}

	// Asked wrong: a usage error, and nothing changes.
	other, _ := boxcore.Resolve(ctx, c, b)
	for what, err := range map[string]error{
		"the same port again":        func() error { _, err := bs.Expose(ctx, box, probes.DefaultTCPPort, on); return err }(),
		"another box, same --on":     func() error { _, err := bs.Expose(ctx, other, probes.DefaultTCPPort, on); return err }(),
		"not a loopback address":     func() error { _, err := bs.Expose(ctx, box, 22, netip.MustParseAddrPort("0.0.0.0:2222")); return err }(),
		"unexpose an unexposed port": bs.Unexpose(ctx, box, 22),
	} {
		if err == nil || !boxcore.IsUsage(err) {
			t.Errorf("%s: %v, want a usage error", what, err)
		}
	}
	if now, _, _ := c.Instance(ctx, a); len(boxcore.Exposures(now.Devices)) != 1 {
		t.Errorf("a refused expose changed the box: %v", boxcore.Exposures(now.Devices))
	}
	if now, _, _ := c.Instance(ctx, b); len(boxcore.Exposures(now.Devices)) != 0 {
		t.Errorf("a refused expose exposed %s: %v", b, boxcore.Exposures(now.Devices))
	}
	// A port in use on the host (not by an exposure) is refused in our words.
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := bs.Expose(ctx, other, probes.DefaultTCPPort, netip.MustParseAddrPort(busy.Addr().String())); err == nil || !boxcore.IsUsage(err) {
		t.Errorf("expose on a host port in use: %v, want a usage error", err)
	}
	busy.Close()

	// A clone of the exposed box (from a snapshot that holds the exposure) exposes nothing,
	// so it starts beside its source.
	if _, err := bs.Snapshot(ctx, box, "exposed"); err != nil {
		t.Fatal(err)
	}
	clone := "cbt-exp-" + testenv.RunID() + "-clone"
	if _, err := bs.New(ctx, boxcore.NewOptions{Name: clone, From: a + "/exposed", Config: teststack.Tag()}); err != nil {
		t.Fatalf("a clone of an exposed box: %v", err)
	}
	if cin, _, err := c.Instance(ctx, clone); err != nil || len(boxcore.Exposures(cin.Devices)) != 0 || cin.Status != "Running" {
		t.Errorf("the clone: exposures %v, status %s (%v); want none, running", boxcore.Exposures(cin.Devices), cin.Status, err)
	}
	if got := banner(t, on.String()); !strings.Contains(got, a) {
		t.Errorf("after the clone, %s answers %q, want the source %s", on, got, a)
	}

	if err := bs.Unexpose(ctx, box, probes.DefaultTCPPort); err != nil {
		t.Fatalf("unexpose: %v", err)
	}
	if conn, err := net.DialTimeout("tcp", on.String(), time.Second); err == nil {
		conn.Close()
		t.Errorf("%s still answers after unexpose", on)
	}

	// A snapshot's exposure does not come back with it: the box keeps what it has now (an
	// imported box's snapshots hold its old host's exposures).
	if err := bs.Restore(ctx, box, "exposed"); err != nil {
		t.Fatalf("restore: %v", err)
	}
	if now, _, _ := c.Instance(ctx, a); len(boxcore.Exposures(now.Devices)) != 0 || now.Status != "Running" {
		t.Errorf("after restoring a snapshot taken while exposed: exposures %v, status %s; want none, running", boxcore.Exposures(now.Devices), now.Status)
	}

	// The escape hatch widens an exposure past loopback: the guard still answers the port
	// with a reset at every other address, and host check names the proxy.
	box, _ = boxcore.Resolve(ctx, c, a)
	if _, err := bs.Expose(ctx, box, probes.DefaultTCPPort, on); err != nil {
		t.Fatal(err)
	}
	in, etag, err := c.Instance(ctx, a)
	if err != nil {
		t.Fatal(err)
	}
	put := in.Writable()
	put.Devices["expose-7001"]["listen"] = fmt.Sprintf("tcp:0.0.0.0:%d", on.Port())
	if err := c.UpdateInstance(ctx, a, put, etag); err != nil {
		t.Fatal(err)
	}
	if err := host.BindPorts(ctx); err != nil { // what host init would do: the guard stays
		t.Fatal(err)
	}
	otherAddrs(t, on.Port())
	rep, err := host.Check(ctx)
	found := false
	for _, r := range rep.Drift() {
		found = found || r.Layer == "exposures" && strings.Contains(r.Item, "0.0.0.0")
	}
	if err != nil || !found {
		t.Errorf("host check with a widened proxy: %v (%v), want an exposures row naming it", rep.Drift(), err)
	}
	in, etag, _ = c.Instance(ctx, a)
	put = in.Writable()
	delete(put.Devices, "expose-7001")
	if err := c.UpdateInstance(ctx, a, put, etag); err != nil {
		t.Fatal(err)
	}

	// A host service on the port (at any address) is never cut off by an exposure, running
	// box or stopped.
	svc, err := net.Listen("tcp", ":0")
	if err != nil {
		t.Fatal(err)
	}
	defer svc.Close()
	cl, _ := boxcore.Resolve(ctx, c, clone)
	if err := bs.Stop(ctx, cl, true); err != nil {
		t.Fatal(err)
	}
	cl, _ = boxcore.Resolve(ctx, c, clone)
	svcOn := netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), uint16(svc.Addr().(*net.TCPAddr).Port))
	if _, err := bs.Expose(ctx, cl, probes.DefaultTCPPort, svcOn); err == nil || !boxcore.IsUsage(err) {
		t.Errorf("expose a stopped box on a port a host service listens on: %v, want a usage error", err)
	}

	// rm takes the box's binding and guard rules with it: the stack is as declared.
	if err := bs.Remove(ctx, cl); err != nil {
		t.Fatal(err)
	}
	if rep, err := host.Check(ctx); err != nil || len(rep.Drift()) > 0 {
		t.Errorf("host check at the end: %v (%v)", rep.Drift(), err)
	}
}

// otherAddrs: nowhere else on this host, at every other address of it, does port answer.
func otherAddrs(t *testing.T, port uint16) {
	t.Helper()
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		t.Fatal(err)
	}
	for _, ad := range addrs {
		p, ok := netip.AddrFromSlice(ad.(*net.IPNet).IP)
		if !ok || p.Unmap().IsLoopback() {
			continue
		}
		to := netip.AddrPortFrom(p.Unmap(), port)
		if conn, err := net.DialTimeout("tcp", to.String(), time.Second); err == nil {
			conn.Close()
			t.Errorf("the exposure answers on the host's %s too", to)
		}
	}
}

// freePort is a TCP port free on the host's loopback now.
func freePort(t *testing.T) uint16 {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return uint16(l.Addr().(*net.TCPAddr).Port)
}

// banner reads the first line a TCP listener sends, retrying while the proxy comes up.
func banner(t *testing.T, addr string) string {
	t.Helper()
	var last error
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		conn, err := net.DialTimeout("tcp", addr, time.Second)
		if err != nil {
			last = err
			continue
		}
		_ = conn.SetDeadline(time.Now().Add(2 * time.Second))
		line, err := bufio.NewReader(conn).ReadString('\n')
		conn.Close()
		if err == nil {
			return strings.TrimSpace(line)
		}
		last = err
	}
	t.Fatalf("no banner from %s: %v", addr, last)
	return ""
}
