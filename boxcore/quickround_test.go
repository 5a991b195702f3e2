package boxcore_test

import (
	"context"
	"net/netip"
	"os"
	"testing"

	"github.com/claudebox/claudebox/boxcore"
	"github.com/claudebox/claudebox/firewall"
	"github.com/claudebox/claudebox/internal/testenv"
	"github.com/claudebox/claudebox/internal/teststack"
)

// TestQuickRound: the bind before a start applies the last round's spec with the pending
// ports added — the same rules a full round gives (no drift) — only while that round is the
// last thing applied and its ports are all still on the veths it bound. A hole switched on,
// a spec saved by another round than the stamp's, a plan for an address a box holds or for a
// port running unbound, a box restarted behind claudebox's back, a planned port
// a box already holds with another MAC, or a bound box stopped behind claudebox's back each
// leave it to a full round, applying nothing; an instance started behind claudebox's back is
// left as the last round left it (unbound) until a full round binds it.
func TestQuickRound(t *testing.T) {
	c := testenv.RequireIncus(t)
	ctx := context.Background()
	s := teststack.New(t, c, "quick")
	bs := &boxcore.Boxes{Client: c, Stack: s, Version: "test"}
	h := boxcore.NewHost(c, s)
	img := teststack.ProbeImage(t, c)
	name := func(x string) string { return "cbt-qr-" + testenv.RunID() + "-" + x }
	quick := func(want bool, when string) {
		t.Helper()
		ok, err := boxcore.QuickRound(ctx, h)
		if err != nil || ok != want {
			t.Fatalf("%s: quick round ok=%v err=%v, want ok=%v", when, ok, err, want)
		}
	}

	if err := h.BindPorts(ctx); err != nil {
		t.Fatal(err)
	}
	box := name("a")
	if _, err := bs.New(ctx, boxcore.NewOptions{Name: box, Image: img, Config: teststack.Tag()}); err != nil {
		t.Fatalf("new: %v", err)
	}
	n := nicOf(t, c, box)
	// The new box's veth, noted after its start, is the one its binding was made for.
	quick(true, "right after a new")
	ghost := name("ghost")
	plan, release, err := boxcore.PlanNIC(ctx, bs, ghost)
	release()
	if err != nil || plan == nil {
		t.Fatalf("plan: %v %v", plan, err)
	}
	if err := boxcore.WritePending(bs, ghost, *plan); err != nil {
		t.Fatal(err)
	}
	quick(true, "right after a full round")
	if rules := portRules(t, s.Network, plan.Port); !bindsTo(rules, plan.MAC.String()) {
		t.Errorf("after the quick round: %s's rules %q, want them binding %s", plan.Port, rules, plan.MAC)
	}
	if !bindsTo(portRules(t, s.Network, n.veth), n.mac.String()) {
		t.Errorf("after the quick round: %s no longer bound to %s", n.veth, n.mac)
	}
	if r := mustCheck(t, h); !r.OK {
		t.Errorf("after the quick round: drift %v, want what a full round gives", driftItems(r))
	}
	quick(true, "right after a quick round")

	// A hole, switched on and off: no earlier round vouches for the kernel any more.
	restore, err := h.SwitchOff(ctx, []boxcore.Layer{boxcore.LayerPortBinding}, nil)
	if err != nil {
		t.Fatal(err)
	}
	quick(false, "with a hole on")
	if err := restore(ctx); err != nil {
		t.Fatal(err)
	}
	quick(false, "after a hole")
	if err := h.BindPorts(ctx); err != nil {
		t.Fatal(err)
	}
	quick(true, "after the full round that followed the hole")
	// A spec saved by a round other than the stamp's (one that could not save its own, or a
	// claudebox from before quick rounds): it is not what the kernel holds.
	older, err := os.ReadFile(boxcore.SavedRoundPath(s.Network))
	if err != nil {
		t.Fatal(err)
	}
	if err := h.BindPorts(ctx); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(boxcore.SavedRoundPath(s.Network), older, 0o600); err != nil {
		t.Fatal(err)
	}
	quick(false, "a spec saved by an earlier round than the stamp's")
	if err := h.BindPorts(ctx); err != nil {
		t.Fatal(err)
	}

	// A plan for the port a box holds, with another MAC: only a read says which is current.
	squat := *plan
	squat.Port = n.veth
	if err := boxcore.WritePending(bs, box, squat); err != nil {
		t.Fatal(err)
	}
	quick(false, "a plan for a bound port with another MAC")
	if rules := portRules(t, s.Network, n.veth); !bindsTo(rules, n.mac.String()) || bindsTo(rules, squat.MAC.String()) {
		t.Errorf("a plan for the taken port %s: its rules %q, want them binding %s alone", n.veth, rules, n.mac)
	}
	boxcore.DropPending(bs, box)
	// A plan for a bound address on a port of its own: two ports would hold one address.
	twin := *plan
	twin.Port, twin.IPv4 = boxcore.HostName(name("twin")), netip.MustParseAddr(n.ip.String())
	if err := boxcore.WritePending(bs, name("twin"), twin); err != nil {
		t.Fatal(err)
	}
	quick(false, "a plan for an address a box holds")
	boxcore.DropPending(bs, name("twin"))

	// Restarted behind claudebox's back: its veth is another, whatever its config is now.
	if err := c.SetState(ctx, box, "restart", true, 0); err != nil {
		t.Fatal(err)
	}
	quick(false, "a bound box restarted behind claudebox's back")
	if err := h.BindPorts(ctx); err != nil {
		t.Fatal(err)
	}

	// Stopped behind claudebox's back: its port is gone, a full round drops its rules.
	if err := c.SetState(ctx, box, "stop", true, 0); err != nil {
		t.Fatal(err)
	}
	quick(false, "a bound box stopped behind claudebox's back")
	if err := h.BindPorts(ctx); err != nil {
		t.Fatal(err)
	}
	quick(true, "after the full round that followed the stop")
	// Started behind claudebox's back: left unbound by a quick round, bound by a full one.
	if err := c.SetState(ctx, box, "start", false, 0); err != nil {
		t.Fatal(err)
	}
	quick(true, "a box started behind claudebox's back")
	if rules := portRules(t, s.Network, n.veth); len(rules) > 0 {
		t.Errorf("a quick round bound %s, started behind its back: %q", n.veth, rules)
	}
	// A plan for that port: an instance of its name is running there unbound.
	if err := boxcore.WritePending(bs, box, firewall.PortBinding{Port: n.veth, MAC: n.mac, IPv4: netip.MustParseAddr(n.ip.String())}); err != nil {
		t.Fatal(err)
	}
	quick(false, "a plan for a port on the bridge that no round bound")
	boxcore.DropPending(bs, box)
	if err := h.BindPorts(ctx); err != nil {
		t.Fatal(err)
	}
	if !bindsTo(portRules(t, s.Network, n.veth), n.mac.String()) {
		t.Errorf("after a full round: %s not bound to %s", n.veth, n.mac)
	}
	boxcore.DropPending(bs, ghost)
}
