package boxcore_test

import (
	"context"
	"net"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"

	"github.com/claudebox/claudebox/boxcore"
	"github.com/claudebox/claudebox/firewall"
	"github.com/claudebox/claudebox/internal/testenv"
	"github.com/claudebox/claudebox/internal/teststack"
)

// fdbLine is `bridge fdb show br <bridge>`'s line for mac on the bridge's ports ("" if none):
// an independent reading of the kernel's entry (port, static, sticky).
func fdbLine(t *testing.T, bridge string, mac net.HardwareAddr) string {
	t.Helper()
	out, err := exec.Command("bridge", "fdb", "show", "br", bridge).CombinedOutput()
	if err != nil {
		t.Fatalf("bridge fdb show: %v %s", err, out)
	}
	for _, l := range strings.Split(string(out), "\n") {
		f := strings.Fields(l)
		if len(f) >= 3 && strings.EqualFold(f[0], mac.String()) && f[1] == "dev" && f[2] != bridge {
			return strings.TrimSpace(l)
		}
	}
	return ""
}

func pinnedOn(line, port string) bool {
	f := strings.Fields(line)
	return len(f) >= 3 && f[2] == port && slices.Contains(f, "static") && slices.Contains(f, "sticky")
}

func learning(t *testing.T, port string) string {
	t.Helper()
	b, err := os.ReadFile("/sys/class/net/" + port + "/brport/learning")
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(b))
}

func fdbDrift(r boxcore.CheckReport) []string {
	var out []string
	for _, d := range r.Drift() {
		if d.Layer == "fdb pin" {
			out = append(out, d.Item+": "+d.Actual)
		}
	}
	return out
}

// TestFDBPin runs the fdb-pin layer on the real daemon: minting pins each box's MAC on its
// port (static, sticky) with learning off there; an entry deleted by hand, a port learning
// again or a stale pin is drift until BindPorts. Then the seeded hole: with the port binding
// off (NIC filtering on, which runs after the bridge learns), a frame with b's MAC from a
// leaves b's entry on b's port while the pin holds, and moves it to a's port with the pin off
// too (the control); the sticky entry alone holds with a's port learning; the port binding
// alone holds with the pin off.
func TestFDBPin(t *testing.T) {
	c := testenv.RequireIncus(t)
	ctx := context.Background()
	s := teststack.New(t, c, "fdbpin")
	bs := &boxcore.Boxes{Client: c, Stack: s, Version: "test"}
	h := boxcore.NewHost(c, s)
	k := boxcore.LocalKernel()
	img := teststack.ProbeImage(t, c)
	nics := mintTwo(t, ctx, bs, img, "cbt-fdbpin")
	a, b := nics[0], nics[1]
	t.Logf("a %s %s %s, b %s %s %s", a.veth, a.mac, a.ip, b.veth, b.mac, b.ip)
	br := s.Network

	// New pins what it starts.
	for _, n := range nics {
		if l := fdbLine(t, br, n.mac); !pinnedOn(l, n.veth) {
			t.Errorf("after new: %s's entry %q, want static sticky on %s", n.name, l, n.veth)
		}
		if v := learning(t, n.veth); v != "0" {
			t.Errorf("after new: %s learning=%s, want 0", n.veth, v)
		}
	}
	t.Logf("after new: %q, %q", fdbLine(t, br, a.mac), fdbLine(t, br, b.mac))
	requireLayer(t, h, boxcore.LayerFDBPin, true)
	if r := mustCheck(t, h); !r.OK {
		t.Fatalf("after new: drift %v", driftItems(r))
	}

	// Drift: the entry deleted by hand.
	if out, err := exec.Command("bridge", "fdb", "del", b.mac.String(), "dev", b.veth, "master").CombinedOutput(); err != nil {
		t.Fatalf("bridge fdb del: %v %s", err, out)
	}
	d := fdbDrift(mustCheck(t, h))
	t.Logf("entry deleted: drift %v", d)
	if !slices.ContainsFunc(d, func(s string) bool { return strings.Contains(s, b.name) && strings.Contains(s, "none") }) {
		t.Errorf("b's entry deleted by hand: fdb pin drift %v, want b's entry none", d)
	}
	requireLayer(t, h, boxcore.LayerFDBPin, false)
	if err := h.BindPorts(ctx); err != nil {
		t.Fatal(err)
	}
	if r := mustCheck(t, h); !r.OK {
		t.Fatalf("after BindPorts: drift %v", driftItems(r))
	}

	// Drift: a stale pin (a MAC no box has, pinned on a's port).
	if out, err := exec.Command("bridge", "fdb", "add", "02:cb:00:00:00:77", "dev", a.veth, "master", "static", "sticky").CombinedOutput(); err != nil {
		t.Fatalf("bridge fdb add: %v %s", err, out)
	}
	d = fdbDrift(mustCheck(t, h))
	t.Logf("stale pin: drift %v", d)
	if !slices.ContainsFunc(d, func(s string) bool { return strings.Contains(s, "stale pin") }) {
		t.Errorf("a stale pin: fdb pin drift %v, want a stale pin", d)
	}
	if err := h.BindPorts(ctx); err != nil {
		t.Fatal(err)
	}
	if r := mustCheck(t, h); !r.OK {
		t.Fatalf("after pruning: drift %v", driftItems(r))
	}

	// Drift: learning on again on a's port (kept for the sticky-alone measurement below).
	if out, err := exec.Command("ip", "link", "set", "dev", a.veth, "type", "bridge_slave", "learning", "on").CombinedOutput(); err != nil {
		t.Fatalf("learning on: %v %s", err, out)
	}
	d = fdbDrift(mustCheck(t, h))
	t.Logf("learning on: drift %v", d)
	if !slices.ContainsFunc(d, func(s string) bool { return strings.Contains(s, a.name) && strings.Contains(s, "learning on") }) {
		t.Errorf("a's port learning: fdb pin drift %v, want a's learning on", d)
	}

	// The seeded hole: the port binding off alone.
	frame := []frameCase{{"fdb-spoof", ether(net.HardwareAddr{0xff, 0xff, 0xff, 0xff, 0xff, 0xff}, b.mac, 0x88b5, []byte(marker("fdb-spoof"))), false}}
	spoof := func() string {
		sendFrom(t, c, a.name, slices.Repeat(frame, 5))
		return fdbLine(t, br, b.mac)
	}
	restorePB, err := h.SwitchOff(ctx, []boxcore.Layer{boxcore.LayerPortBinding}, nil)
	if err != nil {
		t.Fatalf("switch port binding off: %v", err)
	}
	requireLayer(t, h, boxcore.LayerPortBinding, false)
	requireLayer(t, h, boxcore.LayerNICFiltering, true)
	stickyAlone := spoof()
	t.Logf("port binding off, b pinned, a's port learning: b's entry %q", stickyAlone)
	if _, err := k.PinFDB(br, []firewall.PortBinding{{Port: a.veth, MAC: a.mac}}); err != nil {
		t.Fatal(err)
	}
	requireLayer(t, h, boxcore.LayerFDBPin, true)
	pinned := spoof()
	t.Logf("port binding off, fdb pin on: b's entry %q", pinned)

	restorePin, err := h.SwitchOff(ctx, []boxcore.Layer{boxcore.LayerFDBPin}, nil)
	if err != nil {
		t.Fatalf("switch fdb pin off: %v", err)
	}
	requireLayer(t, h, boxcore.LayerFDBPin, false)
	if l := learning(t, a.veth); l != "1" {
		t.Errorf("fdb pin off: %s learning=%s, want 1", a.veth, l)
	}
	neither := spoof()
	t.Logf("port binding and fdb pin off: b's entry %q", neither)
	if err := restorePin(ctx); err != nil {
		t.Fatalf("restore fdb pin: %v", err)
	}
	repinned := fdbLine(t, br, b.mac)
	t.Logf("fdb pin restored: b's entry %q", repinned)
	if err := restorePB(ctx); err != nil {
		t.Fatalf("restore port binding: %v", err)
	}

	// The pin off alone: the port binding holds.
	restorePin, err = h.SwitchOff(ctx, []boxcore.Layer{boxcore.LayerFDBPin}, []string{a.name, b.name})
	if err != nil {
		t.Fatalf("switch fdb pin off: %v", err)
	}
	bindingAlone := spoof()
	t.Logf("fdb pin off, port binding on: b's entry %q", bindingAlone)
	if err := restorePin(ctx); err != nil {
		t.Fatalf("restore fdb pin: %v", err)
	}

	if !pinnedOn(stickyAlone, b.veth) {
		t.Errorf("the sticky entry alone (a's port learning): b's entry %q, want still static sticky on %s", stickyAlone, b.veth)
	}
	if !pinnedOn(pinned, b.veth) {
		t.Errorf("fdb pin alone: b's entry %q, want still static sticky on %s", pinned, b.veth)
	}
	if f := strings.Fields(neither); len(f) < 3 || f[2] != a.veth {
		t.Errorf("neither layer: b's entry %q, want moved to %s (the control)", neither, a.veth)
	}
	if !pinnedOn(repinned, b.veth) {
		t.Errorf("after the restore: b's entry %q, want static sticky on %s again", repinned, b.veth)
	}
	if f := strings.Fields(bindingAlone); len(f) >= 3 && f[2] == a.veth {
		t.Errorf("port binding alone: b's entry %q moved to a's port", bindingAlone)
	}
	if r := mustCheck(t, h); !r.OK {
		t.Fatalf("after the holes: drift %v", driftItems(r))
	}
	requireLayer(t, h, boxcore.LayerFDBPin, true)
}
