package boxcore_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/claudebox/claudebox/boxcore"
	"github.com/claudebox/claudebox/internal/testenv"
	"github.com/claudebox/claudebox/internal/teststack"
)

// TestAgent runs the boot unit's agent against the real daemon. A box that Incus starts
// behind claudebox's back (incus restart, as a reboot inside the box does; incus start) gets
// a new veth with its port's FDB pin and rp_filter missing: drift, with no agent running (the
// control). With the agent running, every such start is bound within a second or two, and
// the drift is gone. The agent ends cleanly with its context.
func TestAgent(t *testing.T) {
	c := testenv.RequireIncus(t)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	s := teststack.New(t, c, "agent")
	bs := &boxcore.Boxes{Client: c, Stack: s, Version: "test"}
	h := boxcore.NewHost(c, s)
	img := teststack.ProbeImage(t, c)
	box := "cbt-agent-" + testenv.RunID()
	if _, err := bs.New(ctx, boxcore.NewOptions{Name: box, Image: img, Config: teststack.Tag()}); err != nil {
		t.Fatalf("new: %v", err)
	}
	if r := mustCheck(t, h); !r.OK {
		t.Fatalf("after new: drift %v", driftItems(r))
	}
	portDrift := func() []string {
		var out []string
		for _, d := range driftItems(mustCheck(t, h)) {
			if strings.Contains(d, box) || strings.Contains(d, boxcore.HostName(box)) {
				out = append(out, d)
			}
		}
		return out
	}
	restart := func() {
		t.Helper()
		if err := c.SetState(ctx, box, "restart", true, 0); err != nil {
			t.Fatalf("incus restart: %v", err)
		}
	}

	// The control: no agent, and the restarted box's new port is not pinned.
	restart()
	nicOf(t, c, box)
	if d := portDrift(); len(d) == 0 {
		t.Fatalf("a box restarted behind claudebox's back shows no drift without the agent: the test cannot fail")
	} else {
		t.Logf("without the agent, after incus restart: %v", d)
	}

	actx, stop := context.WithCancel(ctx)
	ran := make(chan error, 1)
	rounds := make(chan []string, 16)
	a := &boxcore.Agent{Client: c, Stack: s, Log: t.Logf, Bound: func(acked []string) {
		select {
		case rounds <- acked:
		default:
		}
	}}
	// Started while the network's lock is held (a drill with a seeded hole open: a unit
	// restart can come at any time), the agent applies nothing until the lock is free.
	held, err := boxcore.LockNetwork(ctx, s.Network)
	if err != nil {
		t.Fatal(err)
	}
	go func() { ran <- a.Run(actx) }()
	time.Sleep(1500 * time.Millisecond)
	if d := portDrift(); len(d) == 0 {
		t.Errorf("the agent applied the firewall at its start while the network's lock was held")
	}
	held()
	// At its start the agent applies the firewall and binds what runs: the drift is repaired.
	awaitNoDrift := func(what string) {
		t.Helper()
		deadline := time.Now().Add(15 * time.Second)
		for {
			d := portDrift()
			if len(d) == 0 {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: still drift with the agent running: %v", what, d)
			}
			time.Sleep(200 * time.Millisecond)
		}
	}
	awaitNoDrift("the agent's start")
	for _, step := range []struct {
		what string
		do   func()
	}{
		{"incus restart", restart},
		{"incus stop, then incus start", func() {
			if err := c.SetState(ctx, box, "stop", true, 0); err != nil {
				t.Fatal(err)
			}
			if err := c.SetState(ctx, box, "start", false, 0); err != nil {
				t.Fatal(err)
			}
		}},
	} {
		step.do()
		nicOf(t, c, box)
		awaitNoDrift("after " + step.what)
	}
	// While the network's lock is held (a drill with a seeded hole open) the agent binds
	// nothing: a restart then stays unbound until the lock is free, and is bound right after.
	unlock, err := boxcore.LockNetwork(ctx, s.Network)
	if err != nil {
		t.Fatal(err)
	}
	restart()
	nicOf(t, c, box)
	time.Sleep(time.Second)
	if d := portDrift(); len(d) == 0 {
		t.Errorf("the agent bound a restarted box while the network's lock was held (a drill's hole would be undone)")
	}
	unlock()
	awaitNoDrift("after the lock was released")

	// On a standalone daemon the agent acknowledges nothing on the box (TagBound is a
	// cluster's): the box's config is as claudebox made it.
	if in, _, err := c.Instance(ctx, box); err != nil || in.Config[boxcore.TagBound] != "" {
		t.Errorf("box config %s=%q (%v), want none on a standalone daemon", boxcore.TagBound, in.Config[boxcore.TagBound], err)
	}
	stop()
	select {
	case err := <-ran:
		if err != nil {
			t.Errorf("agent ended with %v, want nil on its context's end", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the agent did not end within 10 s of its context")
	}

	// An agent for a stack that is not there says so and ends.
	missing := s
	missing.Network = "cbt-none-" + testenv.RunID()
	err = (&boxcore.Agent{Client: c, Stack: missing}).Run(ctx)
	var sm *boxcore.StackMissingError
	if !errors.As(err, &sm) {
		t.Errorf("agent on a missing network: %v, want a StackMissingError", err)
	}
}
