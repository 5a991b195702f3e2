package boxcore_test

import (
	"context"
	"net"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/claudebox/claudebox/boxcore"
	"github.com/claudebox/claudebox/boxcore/incus"
	"github.com/claudebox/claudebox/internal/testenv"
	"github.com/claudebox/claudebox/internal/teststack"
)

// fdbPortOf returns the bridge port `bridge fdb show` has mac on ("" if none).
func fdbPortOf(t *testing.T, bridge string, mac net.HardwareAddr) string {
	if f := strings.Fields(fdbLine(t, bridge, mac)); len(f) >= 3 {
		return f[2]
	}
	return ""
}

// TestPortBinding runs the port-binding layer on the real daemon: a running box with no
// binding is drift, BindPorts binds what runs (read from Incus's dnsmasq.hosts allocation),
// and with NIC filtering switched off on the attacking box (and the FDB pins off: see
// TestFDBPin) the bindings alone keep its spoofed frames off the bridge (and the sibling's
// FDB entry where it is); with both off they get through (the capture's control). A stopped box leaves a stale binding: drift
// until BindPorts.
func TestPortBinding(t *testing.T) {
	c := testenv.RequireIncus(t)
	ctx := context.Background()
	s := teststack.New(t, c, "portbind")
	bs := &boxcore.Boxes{Client: c, Stack: s, Version: "test"}
	h := boxcore.NewHost(c, s)
	img := teststack.ProbeImage(t, c)
	nics := mintTwo(t, ctx, bs, img, "cbt-pbind")
	// New binds what it starts.
	if r := mustCheck(t, h); !r.OK {
		t.Errorf("after new: drift %+v, want both boxes bound", r.Drift())
	}
	requireLayer(t, h, boxcore.LayerPortBinding, true)

	// Boxes restarted behind claudebox's back (incus restart, as a reboot inside the box
	// does: new veths) keep their fixed port names, so every rule naming the port holds the
	// new veth at once: no port-binding drift. (Before the fixed names they came back unbound:
	// a root in a box could reboot it to shed its binding.)
	for _, n := range nics {
		if n.veth != boxcore.HostName(n.name) {
			t.Errorf("%s: port %s, want its fixed name %s", n.name, n.veth, boxcore.HostName(n.name))
		}
		if err := c.SetState(ctx, n.name, "restart", true, 0); err != nil {
			t.Fatalf("restarting %s: %v", n.name, err)
		}
	}
	nics = []boxNIC{nicOf(t, c, nics[0].name), nicOf(t, c, nics[1].name)}
	a, b := nics[0], nics[1]
	t.Logf("a %s %s %s, b %s %s %s", a.veth, a.mac, a.ip, b.veth, b.mac, b.ip)
	r := mustCheck(t, h)
	for _, d := range r.Drift() {
		if d.Layer == "port binding" {
			t.Errorf("after an incus restart: port-binding drift %s: %s", d.Item, d.Actual)
		}
	}
	for _, n := range nics {
		if n.veth != boxcore.HostName(n.name) {
			t.Errorf("after the restart %s: port %s, want its fixed name %s", n.name, n.veth, boxcore.HostName(n.name))
		}
	}
	requireLayer(t, h, boxcore.LayerPortBinding, true)

	if err := h.BindPorts(ctx); err != nil {
		t.Fatalf("BindPorts: %v", err)
	}
	st, err := h.Read(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range []boxNIC{a, b} {
		i := slices.IndexFunc(st.NICs, func(x boxcore.NICBinding) bool { return x.Box == n.name })
		if i < 0 {
			t.Fatalf("no NIC read for %s: %+v", n.name, st.NICs)
		}
		got := st.NICs[i]
		t.Logf("%s: %s from %s", n.name, got.Binding, got.IPFrom)
		if got.Problem != "" || got.Binding.Port != n.veth || got.Binding.MAC.String() != n.mac.String() ||
			got.Binding.IPv4.String() != n.ip.String() || got.IPFrom != "dnsmasq.hosts" {
			t.Errorf("%s: binding %+v, want %s %s %s from dnsmasq.hosts", n.name, got, n.veth, n.mac, n.ip)
		}
	}
	requireLayer(t, h, boxcore.LayerPortBinding, true)
	requireLayer(t, h, boxcore.LayerL2Ranges, true)
	if r := mustCheck(t, h); !r.OK {
		t.Fatalf("check after BindPorts drifts: %v", driftItems(r))
	}
	out, _ := exec.Command("nft", "list", "chain", "bridge", "claudebox_"+s.Network, "prerouting").CombinedOutput()
	t.Logf("prerouting:\n%s", out)

	// NIC filtering off on a: the bindings alone. The FDB pins hold a sibling's MAC too (the
	// fdb-pin layer): off for every box, so the FDB rows measure the bindings alone.
	restorePin, err := h.SwitchOff(ctx, []boxcore.Layer{boxcore.LayerFDBPin}, nil)
	if err != nil {
		t.Fatalf("switch fdb pin off: %v", err)
	}
	// Unpinned, b's MAC is in the FDB again once b sends: its own ARP teaches it on b's port.
	sendFrom(t, c, b.name, spoofFrames(b.mac, a.mac, b.ip, a.ip)[1:2])
	if p := fdbPortOf(t, s.Network, b.mac); p != b.veth {
		t.Fatalf("unpinned, after b's own ARP: b's MAC on %q, want %s", p, b.veth)
	}
	restoreNIC, err := h.SwitchOff(ctx, []boxcore.Layer{boxcore.LayerNICFiltering}, []string{a.name})
	if err != nil {
		t.Fatalf("switch NIC filtering off: %v", err)
	}
	frames := spoofFrames(a.mac, b.mac, a.ip, b.ip)
	// Own IPv4 and ARP pass, and an ARP probe (sender 0.0.0.0: port isolation and the
	// bridge table's forward chain keep it from b); everything else the bindings drop (the
	// foreign chaddr too, which NIC filtering lets through).
	pass := func(fc frameCase) bool {
		return fc.name == "own-ipv4" || fc.name == "own-arp" || fc.name == "arp-0.0.0.0"
	}
	// The FDB spoof is a raw-ethertype frame from b's MAC: an IPv4 one is dropped by the wall
	// through br_netfilter before the bridge learns, which would hide the control.
	macOfB := frameCase{"fdb-spoof", ether(net.HardwareAddr{0xff, 0xff, 0xff, 0xff, 0xff, 0xff}, b.mac, 0x88b5, []byte(marker("fdb-spoof"))), false}
	spoofFDB := func() string {
		sendFrom(t, c, a.name, []frameCase{macOfB})
		return fdbPortOf(t, s.Network, b.mac)
	}
	seenBound := capture(t, s.Network, func() { sendFrom(t, c, a.name, frames) })
	fdbBound := spoofFDB()
	t.Logf("NIC filtering off, bindings on: the bridge saw %v; b's MAC on %q", seenBound, fdbBound)

	restorePB, err := h.SwitchOff(ctx, []boxcore.Layer{boxcore.LayerPortBinding}, nil)
	if err != nil {
		t.Fatalf("switch port binding off: %v", err)
	}
	requireLayer(t, h, boxcore.LayerPortBinding, false)
	seenNone := capture(t, s.Network, func() { sendFrom(t, c, a.name, frames) })
	fdbNone := spoofFDB()
	t.Logf("both off: the bridge saw %v; b's MAC on %q", seenNone, fdbNone)
	if err := restorePB(ctx); err != nil {
		t.Fatalf("restore port binding: %v", err)
	}
	if err := restoreNIC(ctx); err != nil {
		t.Fatalf("restore NIC filtering: %v", err)
	}
	if err := restorePin(ctx); err != nil {
		t.Fatalf("restore fdb pin: %v", err)
	}

	measured := 0
	for _, fc := range frames {
		on, off := slices.Contains(seenBound, fc.name), slices.Contains(seenNone, fc.name)
		switch {
		case !off:
			t.Logf("unmeasured: %s does not reach the bridge's tap with both layers off", fc.name)
		case on != pass(fc):
			t.Errorf("bindings alone: %s reached the bridge = %v, want %v", fc.name, on, pass(fc))
		default:
			measured++
		}
	}
	if measured < 7 {
		t.Errorf("only %d frames measured: the capture sees too little", measured)
	}
	if fdbBound != b.veth {
		t.Errorf("bindings alone: b's MAC moved to %q, want on %s", fdbBound, b.veth)
	}
	if fdbNone != a.veth {
		t.Errorf("neither layer: b's MAC on %q, want moved to %s (the control)", fdbNone, a.veth)
	}
	t.Logf("FDB: b's MAC on %s with the bindings, on %s with neither layer (a is %s)", fdbBound, fdbNone, a.veth)

	// A stopped box leaves a stale binding until BindPorts.
	if err := c.SetState(ctx, b.name, "stop", true, 0); err != nil {
		t.Fatal(err)
	}
	r = mustCheck(t, h)
	if !slices.ContainsFunc(r.Drift(), func(row boxcore.CheckRow) bool {
		return row.Layer == "port binding" && row.Actual == "stale binding"
	}) {
		t.Errorf("after stopping %s: no stale-binding drift: %v", b.name, driftItems(r))
	}
	if err := h.BindPorts(ctx); err != nil {
		t.Fatal(err)
	}
	if r := mustCheck(t, h); !r.OK {
		t.Fatalf("check after re-binding drifts: %v", driftItems(r))
	}
}

// The bind lists the other networks by name and asks only about bridges and names with no
// kernel link (never a host interface such as a veth, lo or eth0): the same managed networks
// as the daemon's full listing (every box's veth makes that one slower), a second test
// stack's network among them, the stack's own not.
func TestOtherNetworks(t *testing.T) {
	c := testenv.RequireIncus(t)
	ctx := context.Background()
	s, other := teststack.New(t, c, "othernets"), teststack.New(t, c, "qothernets")
	got, err := boxcore.OtherNetworks(ctx, boxcore.NewHost(c, s))
	if err != nil {
		t.Fatal(err)
	}
	all, err := c.Networks(ctx)
	if err != nil {
		t.Fatal(err)
	}
	managed := func(ns []incus.Network) (out []string) {
		for _, n := range ns {
			if n.Managed && n.Name != s.Network {
				out = append(out, n.Name+" "+n.Config["ipv4.address"])
			}
		}
		slices.Sort(out)
		return out
	}
	if g, w := managed(got), managed(all); !slices.Equal(g, w) || !slices.ContainsFunc(g, func(n string) bool { return strings.HasPrefix(n, other.Network+" ") }) {
		t.Errorf("managed networks but %s: %v, the full listing %v (want equal, with %s)", s.Network, g, w, other.Network)
	}
}

// Box verbs binding at once share rounds: a round that read Incus after a verb's change and
// bound every port stands for that verb's round; one that read before it does not, and a
// change to the stack's kernel state (a drill's hole, an apply) voids every earlier round.
func TestBindRoundsCoalesce(t *testing.T) {
	c := testenv.RequireIncus(t)
	ctx := context.Background()
	s := teststack.New(t, c, "coalesce")
	h := boxcore.NewHost(c, s)
	round := func(since time.Time, want bool, when string) {
		t.Helper()
		ran, err := boxcore.BindRound(ctx, h, since)
		if err != nil {
			t.Fatalf("%s: %v", when, err)
		}
		if ran != want {
			t.Errorf("%s: round ran=%v, want %v", when, ran, want)
		}
	}
	before := time.Now()
	round(before, true, "first round")
	round(before, false, "a change made before the last full round read")
	round(time.Now(), true, "a change made after it")
	restore, err := h.SwitchOff(ctx, []boxcore.Layer{boxcore.LayerPortBinding}, nil)
	if err != nil {
		t.Fatal(err)
	}
	round(before, true, "after a hole was switched on")
	if err := restore(ctx); err != nil {
		t.Fatal(err)
	}
	round(before, true, "after the hole's restore")
	if r := mustCheck(t, h); !r.OK {
		t.Errorf("after the rounds: drift %v", driftItems(r))
	}
}
