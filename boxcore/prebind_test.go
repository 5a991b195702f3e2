package boxcore_test

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"

	"github.com/claudebox/claudebox/boxcore"
	"github.com/claudebox/claudebox/firewall"
	"github.com/claudebox/claudebox/internal/testenv"
	"github.com/claudebox/claudebox/internal/teststack"
)

// portRules are the lines of the stack's port-binding chain that name port.
func portRules(t *testing.T, network, port string) []string {
	t.Helper()
	out, err := exec.Command("nft", "list", "chain", "bridge", "claudebox_"+network, "prerouting").CombinedOutput()
	if err != nil {
		t.Fatalf("nft list chain: %v: %s", err, out)
	}
	var lines []string
	for _, l := range strings.Split(string(out), "\n") {
		if strings.Contains(l, `"`+port+`"`) {
			lines = append(lines, strings.TrimSpace(l))
		}
	}
	return lines
}

// bindsTo reports whether the rules bind the port to mac (the rule dropping other MACs).
func bindsTo(rules []string, mac string) bool {
	for _, r := range rules {
		if strings.Contains(r, "ether saddr != "+mac) {
			return true
		}
	}
	return false
}

// TestPreBind: `new` picks its box's address and MAC, so the port's rules go in before the
// box starts (its first frame meets them), and the step after the start only pins — unless
// another round applied meanwhile or the box did not come up as planned, when it leaves the
// port to a full round. A planned port no box came of is gone with the next round; a `new`
// of a taken name never touches the binding of the box holding it; boxes minted at once
// get distinct addresses, every one bound.
func TestPreBind(t *testing.T) {
	c := testenv.RequireIncus(t)
	ctx := context.Background()
	var network string
	t.Cleanup(func() { // after the stack's teardown (cleanups run last first)
		if _, err := os.Stat(boxcore.PendingDir(network)); network != "" && !os.IsNotExist(err) {
			t.Errorf("after the teardown: %s is left (%v)", boxcore.PendingDir(network), err)
		}
	})
	s := teststack.New(t, c, "prebind")
	network = s.Network
	bs := &boxcore.Boxes{Client: c, Stack: s, Version: "test"}
	h := boxcore.NewHost(c, s)
	img := teststack.ProbeImage(t, c)
	name := func(x string) string { return "cbt-pre-" + testenv.RunID() + "-" + x }

	// A port planned for a box that never starts: bound by its own round, gone with the next.
	ghost := name("ghost")
	b, release, err := boxcore.PlanNIC(ctx, bs, ghost)
	release()
	if err != nil || b == nil {
		t.Fatalf("plan: %v %v, want a plan on a local standalone daemon", b, err)
	}
	st, err := h.Read(ctx)
	if err != nil || st.Gateway == nil {
		t.Fatalf("read: %v", err)
	}
	gw, _ := netip.AddrFromSlice(st.Gateway.IP.To4())
	ones, _ := st.Gateway.Mask.Size()
	sub := netip.PrefixFrom(gw, ones).Masked()
	if !sub.Contains(b.IPv4) || b.IPv4 == gw || b.Port != boxcore.HostName(ghost) || b.MAC[0] != 0x10 {
		t.Errorf("plan %s: want a host address of %s other than %s, port %s, an Incus-range MAC", b, sub, gw, boxcore.HostName(ghost))
	}
	token, err := boxcore.PreBind(ctx, bs, ghost, *b)
	if err != nil {
		t.Fatalf("bind before the start: %v", err)
	}
	if rules := portRules(t, s.Network, b.Port); !bindsTo(rules, b.MAC.String()) {
		t.Fatalf("after the bind before the start: %s's rules %q, want them binding %s", b.Port, rules, b.MAC)
	}
	// Another verb's round while the mint runs keeps the pending port bound.
	if err := h.BindPorts(ctx); err != nil {
		t.Fatal(err)
	}
	if rules := portRules(t, s.Network, b.Port); !bindsTo(rules, b.MAC.String()) {
		t.Errorf("another round during the mint: %s's rules %q, want them binding %s still", b.Port, rules, b.MAC)
	}
	// The box never came up: the step after the start leaves it to a full round.
	if done, err := boxcore.CompleteBind(ctx, h, ghost, *b, token); done || err != nil {
		t.Errorf("complete for a port not on the bridge: done=%v err=%v, want a full round asked for", done, err)
	}
	boxcore.DropPending(bs, ghost) // the mint's end
	if err := h.BindPorts(ctx); err != nil {
		t.Fatal(err)
	}
	if rules := portRules(t, s.Network, b.Port); len(rules) > 0 {
		t.Errorf("a full round after the mint: %s still has rules %q", b.Port, rules)
	}

	// new: the NIC as planned, bound with no drift, the address Incus reserved.
	first := name("a")
	if _, err := bs.New(ctx, boxcore.NewOptions{Name: first, Image: img, Config: teststack.Tag()}); err != nil {
		t.Fatalf("new: %v", err)
	}
	in, _, err := c.Instance(ctx, first)
	if err != nil {
		t.Fatal(err)
	}
	addr, mac := in.Devices["eth0"]["ipv4.address"], in.Config["volatile.eth0.hwaddr"]
	n := nicOf(t, c, first)
	if addr == "" || n.ip.String() != addr || n.mac.String() != mac {
		t.Errorf("%s: eth0 ipv4.address %q, volatile MAC %q; the box has %s %s", first, addr, mac, n.ip, n.mac)
	}
	if r := mustCheck(t, h); !r.OK {
		t.Errorf("after new: drift %v", driftItems(r))
	}
	if !bindsTo(portRules(t, s.Network, n.veth), mac) {
		t.Errorf("after new: %s not bound to %s", n.veth, mac)
	}

	// The step after the start for a box that came up as planned: done, it only pins (the
	// control for what follows).
	planned := firewall.PortBinding{Port: n.veth, MAC: n.mac, IPv4: netip.MustParseAddr(addr)}
	token, err = boxcore.PreBind(ctx, bs, first, planned)
	if err != nil {
		t.Fatal(err)
	}
	if done, err := boxcore.CompleteBind(ctx, h, first, planned, token); !done || err != nil {
		t.Errorf("complete with nothing applied since: done=%v err=%v, want done", done, err)
	}
	boxcore.DropPending(bs, first)
	// Another round between the two: the token is no longer the stamp's, a full round is asked.
	if token, err = boxcore.PreBind(ctx, bs, first, planned); err != nil {
		t.Fatal(err)
	}
	if err := h.BindPorts(ctx); err != nil {
		t.Fatal(err)
	}
	if done, _ := boxcore.CompleteBind(ctx, h, first, planned, token); done {
		t.Error("complete after another round applied: done, want a full round asked for")
	}
	boxcore.DropPending(bs, first)

	// A plan for a name a running box holds (a new about to be refused) never rebinds that
	// box's port to the plan's MAC, not even for the moment before the refusal.
	squat := planned
	squat.MAC = append([]byte(nil), n.mac...)
	squat.MAC[5] ^= 0xff
	g4 := gw.As4()
	squat.IPv4 = netip.AddrFrom4([4]byte{g4[0], g4[1], g4[2], 250}) // no NIC's address
	token, err = boxcore.PreBind(ctx, bs, first, squat)
	if err != nil {
		t.Fatal(err)
	}
	if rules := portRules(t, s.Network, n.veth); !bindsTo(rules, mac) || bindsTo(rules, squat.MAC.String()) {
		t.Errorf("a plan for the taken name %s: its port's rules %q, want them binding %s alone", first, rules, mac)
	}
	// Its port is on the bridge (the running box's veth), but bound to the running box: the
	// step after the start must not call the plan bound (a renamed box on the old name's port).
	if done, _ := boxcore.CompleteBind(ctx, h, first, squat, token); done {
		t.Error("complete for a plan the round did not bind: done, want a full round asked for")
	}
	boxcore.DropPending(bs, first)
	_, err = bs.New(ctx, boxcore.NewOptions{Name: first, Image: img, Config: teststack.Tag()})
	var ue *boxcore.UsageError
	if !errors.As(err, &ue) {
		t.Errorf("new of a taken name: %v, want a usage error", err)
	}
	if !bindsTo(portRules(t, s.Network, n.veth), mac) {
		t.Errorf("after a new of its name: %s no longer bound to %s", n.veth, mac)
	}
	if r := mustCheck(t, h); !r.OK {
		t.Errorf("after a new of a taken name: drift %v", driftItems(r))
	}

	// Four at once: distinct addresses, all bound.
	var wg sync.WaitGroup
	errs := make([]error, 4)
	for i := range errs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, errs[i] = bs.New(ctx, boxcore.NewOptions{Name: name(fmt.Sprint("p", i)), Image: img, Config: teststack.Tag()})
		}()
	}
	wg.Wait()
	seen := map[string]string{}
	for i, err := range errs {
		if err != nil {
			t.Errorf("parallel new %d: %v", i, err)
			continue
		}
		nb := nicOf(t, c, name(fmt.Sprint("p", i)))
		if prev, dup := seen[nb.ip.String()]; dup {
			t.Errorf("%s and %s both have %s", prev, nb.name, nb.ip)
		}
		seen[nb.ip.String()] = nb.name
	}
	if r := mustCheck(t, h); !r.OK {
		for _, d := range r.Drift() {
			t.Logf("drift %s: %s: want %q, have %q", d.Layer, d.Item, d.Expected, d.Actual)
		}
		t.Errorf("after four at once: drift %v", driftItems(r))
	}
}
