package boxcore_test

import (
	"context"
	"errors"
	"maps"
	"strings"
	"testing"

	"github.com/claudebox/claudebox/boxcore"
	"github.com/claudebox/claudebox/boxcore/incus"
	"github.com/claudebox/claudebox/internal/testenv"
	"github.com/claudebox/claudebox/internal/teststack"
)

// TestETagCheckedWrites: init's writes carry the ETags its plan read, so an object someone
// else wrote between plan and apply makes the apply fail with a ChangedError naming it, and
// their write stays; a fresh plan then converges.
func TestETagCheckedWrites(t *testing.T) {
	c := testenv.RequireIncus(t)
	ctx := context.Background()
	s := teststack.New(t, c, "writes")
	h := boxcore.NewHost(c, s)

	// Drift in all three objects, so the plan writes each.
	n, _, err := c.Network(ctx, s.Network)
	if err != nil {
		t.Fatal(err)
	}
	cfg := maps.Clone(n.Config)
	cfg["raw.dnsmasq"] = strings.Replace(cfg["raw.dnsmasq"], "no-ident\n", "", 1)
	// Incus's bridge-children race (a box's veth of a parallel package vanishing mid-update)
	// is retried, as boxcore's own network writes retry it.
	if err := incus.RetryBridgeChildrenRace(ctx, func() error { return c.UpdateNetwork(ctx, s.Network, cfg, n.Description, "") }); err != nil {
		t.Fatal(err)
	}
	acl, _, err := c.NetworkACL(ctx, s.ACL)
	if err != nil {
		t.Fatal(err)
	}
	acl.Egress = acl.Egress[1:]
	if err := c.UpdateNetworkACL(ctx, acl, ""); err != nil {
		t.Fatal(err)
	}
	prof, _, err := c.Profile(ctx, s.Profile)
	if err != nil {
		t.Fatal(err)
	}
	prof.Config["limits.cpu"] = "1"
	if err := c.UpdateProfile(ctx, prof, ""); err != nil {
		t.Fatal(err)
	}

	plan := func() *boxcore.InitPlan {
		t.Helper()
		p, err := h.PlanInit(ctx, boxcore.InitOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	wantChanged := func(p *boxcore.InitPlan, object string) {
		t.Helper()
		_, err := h.ApplyInit(ctx, p)
		var ce *boxcore.ChangedError
		if !errors.As(err, &ce) || ce.Object != object {
			t.Fatalf("apply after a concurrent write to %s: %v (%T), want a ChangedError for it", object, err, err)
		}
		t.Logf("concurrent write to %s: %v", object, err)
	}

	// The ACL (written first).
	p := plan()
	acl, _, _ = c.NetworkACL(ctx, s.ACL)
	acl.Description = "someone else's"
	if err := c.UpdateNetworkACL(ctx, acl, ""); err != nil {
		t.Fatal(err)
	}
	wantChanged(p, "acl "+s.ACL)
	if a, _, _ := c.NetworkACL(ctx, s.ACL); a.Description != "someone else's" {
		t.Errorf("the ACL write overwrote the concurrent one: description %q", a.Description)
	}

	// The network: a user.* key (no re-apply of its own) written between plan and apply.
	p = plan()
	n, _, _ = c.Network(ctx, s.Network)
	n.Config["user.claudebox.test.concurrent"] = "1"
	if err := incus.RetryBridgeChildrenRace(ctx, func() error { return c.UpdateNetwork(ctx, s.Network, n.Config, n.Description, "") }); err != nil {
		t.Fatal(err)
	}
	wantChanged(p, "network "+s.Network)
	if n, _, _ := c.Network(ctx, s.Network); n.Config["user.claudebox.test.concurrent"] != "1" || strings.Contains(n.Config["raw.dnsmasq"], "no-ident") {
		t.Errorf("the network write went through: %v", n.Config)
	}

	// The network's If-Match itself (putNetwork also compares the ETag before it writes):
	// a PUT with a stale ETag is refused with 412.
	n, stale, _ := c.Network(ctx, s.Network)
	n.Config["user.claudebox.test.concurrent"] = "2"
	if err := incus.RetryBridgeChildrenRace(ctx, func() error { return c.UpdateNetwork(ctx, s.Network, n.Config, n.Description, "") }); err != nil {
		t.Fatal(err)
	}
	if err := c.UpdateNetwork(ctx, s.Network, n.Config, "stale write", stale); !incus.IsPreconditionFailed(err) {
		t.Fatalf("network PUT with a stale ETag: %v, want 412", err)
	}

	// The profile.
	p = plan()
	prof, _, _ = c.Profile(ctx, s.Profile)
	prof.Description = "someone else's"
	if err := c.UpdateProfile(ctx, prof, ""); err != nil {
		t.Fatal(err)
	}
	wantChanged(p, "profile "+s.Profile)

	// Nobody in between: converges.
	if _, err := h.ApplyInit(ctx, plan()); err != nil {
		t.Fatalf("apply: %v", err)
	}
	if r := mustCheck(t, h); !r.OK {
		t.Fatalf("check drifts: %v", driftItems(r))
	}
}
