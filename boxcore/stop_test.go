package boxcore_test

import (
	"context"
	"maps"
	"strings"
	"testing"
	"time"

	"github.com/claudebox/claudebox/boxcore"
	"github.com/claudebox/claudebox/internal/testenv"
	"github.com/claudebox/claudebox/internal/teststack"
)

// A box whose init never sees the shutdown signal (as an init just started, before its
// handlers are set up) is killed once the stop's grace is over, and Warn says so; a box that
// shuts down cleanly is stopped without a word. The control: the daemon's own clean stop of
// the deaf box gives up and leaves it running, so the kill is what stopped it.
func TestStopKillsABoxThatIgnoresShutdown(t *testing.T) {
	c := testenv.RequireIncus(t)
	ctx := context.Background()
	s := teststack.New(t, c, "stop")
	var warnings []string
	bs := &boxcore.Boxes{Client: c, Stack: s, Version: "test", StopGrace: 2 * time.Second,
		Warn: func(w string) { warnings = append(warnings, w) }}
	img := teststack.ProbeImage(t, c)
	name := func(suffix string) string { return "cbt-stop-" + testenv.RunID() + "-" + suffix }
	deaf, clean := name("deaf"), name("clean")
	// LXC sends lxc.signal.halt to init; the probe image's init neither handles nor dies of
	// SIGWINCH, and a namespace's init is not sent a signal it has no handler for.
	cfg := maps.Clone(teststack.Tag())
	cfg["raw.lxc"] = "lxc.signal.halt=SIGWINCH"
	for n, config := range map[string]map[string]string{deaf: cfg, clean: teststack.Tag()} {
		if _, err := bs.New(ctx, boxcore.NewOptions{Name: n, Image: img, Config: config}); err != nil {
			t.Fatalf("new %s: %v", n, err)
		}
		t.Cleanup(func() {
			if b, err := boxcore.Resolve(context.Background(), c, n); err == nil {
				_ = bs.Remove(context.Background(), b)
			}
		})
	}
	status := func(n string) string {
		in, _, err := c.Instance(ctx, n)
		if err != nil {
			t.Fatal(err)
		}
		return in.Status
	}

	if err := c.SetState(ctx, deaf, "stop", false, 2*time.Second); err == nil || status(deaf) != "Running" {
		t.Fatalf("control: the daemon's clean stop of %s: %v, status %s; want it to give up, running", deaf, err, status(deaf))
	}
	box, err := boxcore.Resolve(ctx, c, deaf)
	if err != nil {
		t.Fatal(err)
	}
	if err := bs.Stop(ctx, box, false); err != nil {
		t.Fatalf("stop %s: %v", deaf, err)
	}
	if st := status(deaf); st != "Stopped" {
		t.Errorf("%s after stop: %s", deaf, st)
	}
	if len(warnings) != 1 || !strings.Contains(warnings[0], "did not shut down within 2s: killed it") {
		t.Errorf("stop of a deaf box: warnings %q, want one saying it was killed", warnings)
	}

	warnings = nil
	box, err = boxcore.Resolve(ctx, c, clean)
	if err != nil {
		t.Fatal(err)
	}
	if err := bs.Stop(ctx, box, false); err != nil {
		t.Fatalf("stop %s: %v", clean, err)
	}
	if st := status(clean); st != "Stopped" || len(warnings) != 0 {
		t.Errorf("clean stop of %s: status %s, warnings %q; want stopped, none", clean, st, warnings)
	}
}
