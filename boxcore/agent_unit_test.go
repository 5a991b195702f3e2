package boxcore

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"net/http/httptest"
	"slices"
	"testing"
	"time"

	"github.com/claudebox/claudebox/boxcore/incus"
	"github.com/claudebox/claudebox/firewall"
)

// A round whose pins failed for some ports names exactly those, through the wrapping and
// joining of applyL2 and PinFDB: the agent acknowledges every other port.
func TestUnpinned(t *testing.T) {
	err := fmt.Errorf("binding ports: %w", fmt.Errorf("fdb pin: %w", errors.Join(
		&PortPinError{Port: "cbxa", Err: errors.New("port cbxa is not on bridge b")},
		&PortPinError{Port: "cbxb", Err: errors.New("gone")})))
	if got := slices.Sorted(maps.Keys(unpinned(err))); !slices.Equal(got, []string{"cbxa", "cbxb"}) {
		t.Errorf("unpinned: %v, want cbxa and cbxb", got)
	}
	if got := unpinned(errors.New("nft: apply failed")); len(got) != 0 {
		t.Errorf("a firewall error names ports %v", got)
	}
	if got := unpinned(nil); len(got) != 0 {
		t.Errorf("no error names ports %v", got)
	}
}

// The events a bind round follows: starts (and what moves or renames a box, or drops a
// binding) of any instance on this member; not other members', not updates (each
// acknowledgement is one), not the agent's own heartbeat or other objects.
func TestBindsOn(t *testing.T) {
	ev := func(typ, action, source string) incus.Event {
		meta, _ := json.Marshal(map[string]string{"action": action, "source": source})
		return incus.Event{Type: typ, Metadata: meta, Location: "m1"}
	}
	for _, c := range []struct {
		e    incus.Event
		want bool
	}{
		{ev("lifecycle", "instance-started", "/1.0/instances/a"), true},
		{ev("lifecycle", "instance-restarted", "/1.0/instances/a"), true},
		{ev("lifecycle", "instance-migrated", "/1.0/instances/a"), true},
		{ev("lifecycle", "instance-deleted", "/1.0/instances/a"), true},
		{ev("lifecycle", "instance-updated", "/1.0/instances/a"), false},
		{ev("lifecycle", "instance-exec", "/1.0/instances/a"), false},
		{ev("lifecycle", "cluster-member-updated", "/1.0/cluster/members/m1"), false},
		{ev("lifecycle", "network-updated", "/1.0/networks/claudenet"), false},
		{ev("operation", "instance-started", "/1.0/instances/a"), false},
	} {
		if got := bindsOn(c.e, "m1"); got != c.want {
			t.Errorf("bindsOn(%s): %v, want %v", c.e.Metadata, got, c.want)
		}
		if got := bindsOn(c.e, ""); got != c.want { // standalone: every event is here
			t.Errorf("bindsOn(%s) standalone: %v, want %v", c.e.Metadata, got, c.want)
		}
		if bindsOn(c.e, "m2") {
			t.Errorf("bindsOn(%s) on m2: an event of m1 binds", c.e.Metadata)
		}
	}
}

// A heartbeat is fresh for AgentFresh; older, missing or unreadable, the row says which.
func TestAgentSeen(t *testing.T) {
	now := time.Date(2026, 12, 5, 12, 0, 0, 0, time.UTC)
	for _, c := range []struct{ beat, want string }{
		{now.Add(-10 * time.Second).Format(time.RFC3339), agentFresh},
		{now.Add(-AgentFresh - time.Second).Format(time.RFC3339), "last heartbeat 2026-12-05T11:58:29Z, 1m31s ago"},
		{"", "none (no agent runs there or it stopped)"},
		{"soon", `unreadable heartbeat "soon"`},
	} {
		if got := agentSeen(c.beat, now); got != c.want {
			t.Errorf("agentSeen(%q): %q, want %q", c.beat, got, c.want)
		}
	}
}

// A verb fails on its own box's port pin only: a sibling's port that could not be pinned
// this moment is the sibling's verb's (a purged CI run had a new fail on one); an error of
// the firewall itself is everyone's.
func TestOwnBindError(t *testing.T) {
	st := &StackState{NICs: []NICBinding{
		{Box: "a", Device: "eth0", Binding: firewall.PortBinding{Port: "cbxa"}},
		{Box: "b", Device: "eth0", Binding: firewall.PortBinding{Port: "cbxb"}},
	}}
	pinB := fmt.Errorf("binding ports: %w", fmt.Errorf("fdb pin: %w", errors.Join(
		&PortPinError{Port: "cbxb", Err: errors.New("port cbxb is not on bridge n")})))
	if err := ownBindError(st, "a", pinB); err != nil {
		t.Errorf("a's verb, b's pin failed: %v, want nil", err)
	}
	if err := ownBindError(st, "", pinB); err != nil {
		t.Errorf("rm's round, b's pin failed: %v, want nil", err)
	}
	if err := ownBindError(st, "b", pinB); err == nil || !errors.Is(err, pinB) {
		t.Errorf("b's verb, b's pin failed: %v, want an error wrapping it", err)
	}
	nft := errors.New("binding ports: nft: apply failed")
	if err := ownBindError(st, "a", nft); err != nft {
		t.Errorf("a firewall error: %v, want it as it is", err)
	}
	if err := ownBindError(nil, "a", pinB); err != pinB {
		t.Errorf("no state read: %v, want the error as it is", err)
	}
	if err := ownBindError(st, "a", nil); err != nil {
		t.Errorf("no error: %v", err)
	}
}

// The mark check asks for a round for a box running on this member with no mark for the
// start it runs now: at most three times per start (a box no round can bind is not worth a
// round every few seconds), again for its next start; never for another member's box, a
// stopped one, or one acknowledged. (TestClusterStack shows a stale mark acknowledged again
// within seconds on a real cluster.)
func TestAgentUnacked(t *testing.T) {
	start := time.Date(2026, 12, 5, 8, 0, 0, 0, time.UTC)
	boxes := []incus.Instance{
		{Name: "acked", Status: "Running", Location: "m2", LastUsedAt: start, Config: map[string]string{TagBound: boundMark("m2", start)}},
		{Name: "elsewhere", Status: "Running", Location: "m1", LastUsedAt: start, Config: map[string]string{}},
		{Name: "stopped", Status: "Stopped", Location: "m2", LastUsedAt: start, Config: map[string]string{}},
		{Name: "stale", Status: "Running", Location: "m2", LastUsedAt: start, Config: map[string]string{TagBound: boundMark("m2", start.Add(-time.Hour))}},
	}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		json.NewEncoder(w).Encode(map[string]any{"type": "sync", "status": "Success", "status_code": 200, "metadata": boxes})
	}))
	defer srv.Close()
	a := &Agent{Client: incus.NewHTTPClient(srv.URL, srv.Client())}
	local := "m2"
	a.local.Store(&local)
	ctx := context.Background()
	var asks []bool
	for range 4 {
		asks = append(asks, a.unacked(ctx))
	}
	if want := []bool{true, true, true, false}; !slices.Equal(asks, want) {
		t.Errorf("a start left unacknowledged: asks %v, want %v", asks, want)
	}
	boxes[3].LastUsedAt = start.Add(time.Minute) // started again
	if !a.unacked(ctx) {
		t.Error("its next start: no round asked for")
	}
	boxes[3].Config[TagBound] = boundMark("m2", boxes[3].LastUsedAt)
	if a.unacked(ctx) || len(a.asked) != 0 {
		t.Errorf("every box acknowledged: a round asked for, or counts kept: %v", a.asked)
	}
}
