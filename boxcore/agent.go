package boxcore

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/claudebox/claudebox/boxcore/incus"
)

// The agent is claudebox's long-running part on a host: the boot unit runs it. It applies
// the firewall once, then binds the port of every instance that starts on this host — on a
// cluster, of every box Incus starts on this member, whoever asked for the start and on
// whichever member. A box's port binding, FDB pin and port rp_filter are this kernel's, and
// without the agent only a claudebox verb run here would set them: Incus's own placement,
// `new --target` another member, a start from another member and Incus's autostart at boot
// would leave a box running with those layers missing.
//
// On a cluster it says so: once a box's port is bound it writes TagBound on the box (the
// member and the start it bound), which `new` and `start` on another member wait for.

// TagBound is "MEMBER@LAST_USED_AT": the member whose agent bound the box's port, and the
// start that binding is for (Incus sets last_used_at at every start, and only then).
const TagBound = "user.claudebox.bound"

// AgentBindWait is how long `new` and `start` wait for another member's agent to bind a box
// (a purged CI run's restore waited 20 s for a mark its agent had written for the start
// before; the agent's mark check now asks for a round for such a start within seconds).
const AgentBindWait = 30 * time.Second

// boundMark is TagBound's value for a box as it runs now on member.
func boundMark(member string, lastUsed time.Time) string {
	return member + "@" + lastUsed.UTC().Format(time.RFC3339Nano)
}

// Agent binds the boxes that start on this host.
type Agent struct {
	Client *incus.Client
	Stack  Stack
	// Log gets one line per thing done or gone wrong (nil: silent).
	Log func(format string, args ...any)
	// Settle gathers the starts that come together into one bind (default 50 ms).
	Settle time.Duration
	// Bound, when set, is called after every bind round with the boxes it acknowledged (tests).
	Bound func(acked []string)

	local atomic.Pointer[string] // this member's name as the last round read it

	// asked counts the rounds the mark check asked for each start running unacknowledged
	// (box and mark): a few at most, since a box no round binds, such as one off
	// claudebox's network, is not worth a round every few seconds.
	asked map[string]int
}

// member is this member's name as the last round read it ("" before the first, and on a
// standalone daemon).
func (a *Agent) member() string {
	if p := a.local.Load(); p != nil {
		return *p
	}
	return ""
}

func (a *Agent) logf(format string, args ...any) {
	if a.Log != nil {
		a.Log(format, args...)
	}
}

// Run applies the firewall, then binds on every start until ctx ends. It returns an error
// only when it cannot start at all (no daemon, no stack); a lost event stream is subscribed
// again, and everything running is bound again then (a start may have been missed).
func (a *Agent) Run(ctx context.Context) error {
	if a.Settle == 0 {
		a.Settle = 50 * time.Millisecond
	}
	local, err := localMember(ctx, a.Client)
	if err != nil {
		return err
	}
	// Subscribed before the first bind: a start between the two is bound by one or the other.
	events, err := a.Client.Events(ctx, "lifecycle")
	if err != nil {
		return err
	}
	// The firewall, as the boot unit always applied it; under the network's lock, so that an
	// agent (re)started during a drill does not undo its seeded hole.
	unlock, err := a.lockNetwork(ctx)
	if err == nil {
		_, err = NewHost(a.Client, a.Stack).ApplyFirewall(ctx)
		unlock()
	}
	if err != nil {
		events.Close()
		return err
	}
	where := "this host"
	if local != "" {
		where = "member " + local
	}
	a.logf("agent: firewall applied; binding every box that starts on %s", where)
	poke := make(chan struct{}, 1)
	kick := func() {
		select {
		case poke <- struct{}{}:
		default:
		}
	}
	kick() // the boxes already running: acknowledged, and anything started meanwhile bound
	done := make(chan struct{})
	go func() { defer close(done); a.binder(ctx, poke) }()
	defer func() { <-done }()
	if local != "" {
		beat := make(chan struct{})
		go func() { defer close(beat); a.heartbeat(ctx, local) }()
		defer func() { <-beat }()
	}
	// A round now and then bounds whatever no event announced (an event the daemon dropped).
	sweep := time.NewTicker(AgentSweep)
	defer sweep.Stop()
	// On a cluster, a start left unacknowledged gets a round within AgentMarkCheck: the
	// sweep's minute is longer than a verb on another member waits for the mark.
	var markCheck <-chan time.Time
	if local != "" {
		t := time.NewTicker(AgentMarkCheck)
		defer t.Stop()
		markCheck = t.C
	}
	backoff := time.Second
	for {
		select {
		case <-ctx.Done():
			events.Close()
			return nil
		case <-sweep.C:
			kick()
		case <-markCheck:
			if a.unacked(ctx) {
				kick()
			}
		case e, ok := <-events.C:
			if ok {
				backoff = time.Second
				if bindsOn(e, a.member()) {
					kick()
				}
				continue
			}
			if ctx.Err() != nil {
				return nil
			}
			a.logf("agent: %v; subscribing again", events.Err())
			for events = nil; events == nil; {
				select {
				case <-ctx.Done():
					return nil
				case <-time.After(backoff):
				}
				backoff = min(2*backoff, 10*time.Second)
				if events, err = a.Client.Events(ctx, "lifecycle"); err != nil {
					a.logf("agent: %v", err)
				}
			}
			kick()
		}
	}
}

// AgentSweep is how often the agent binds with no event asking. Not shorter: each sweep also
// repairs the member's firewall, and at 20 s it undid the cluster test's drift before that
// member's check could show it.
const AgentSweep = time.Minute

// AgentMarkCheck is how often the agent on a cluster member looks for a box running there
// with no acknowledgement of its start (one list request, filtered by the box tag).
const AgentMarkCheck = 3 * time.Second

// unacked: a box runs on this member with no acknowledgement of the start it runs now, and
// the mark check has asked for fewer than three rounds for that start. (A round can read a
// box that is restarting before Incus moves its last_used_at, or find it changed when it
// acknowledges; a restored snapshot brings back the mark it was taken with.)
func (a *Agent) unacked(ctx context.Context) bool {
	local := a.member()
	if local == "" {
		return false
	}
	ins, err := a.Client.Instances(ctx, map[string]string{TagKey: "1"}, false)
	if err != nil {
		return false // the sweep and the next check try again
	}
	asked := map[string]int{} // only the starts running now: the map does not grow
	ask := false
	for _, in := range ins {
		if in.Location != local || in.Status != "Running" {
			continue
		}
		want := boundMark(local, in.LastUsedAt)
		if in.Config[TagBound] == want {
			continue
		}
		key := in.Name + " " + want
		asked[key] = a.asked[key]
		if !ask && asked[key] < 3 {
			asked[key]++
			ask = true
		}
	}
	a.asked = asked
	return ask
}

// bindsOn: a lifecycle event after which a port on this member may need binding (a start,
// a box moved or renamed here, a restore) or a binding may be stale (a deletion). Other
// members' events are theirs: a round per event on every member would make every member's
// agent busy with the whole cluster's starts. (An update — a NIC added to a running box — is
// left to the next sweep: each acknowledgement is an update too.)
func bindsOn(e incus.Event, local string) bool {
	l, ok := e.Lifecycle()
	if !ok || l.Instance() == "" || (local != "" && e.Location != "" && e.Location != local) {
		return false
	}
	switch l.Action {
	case "instance-started", "instance-restarted", "instance-resumed", "instance-migrated",
		"instance-renamed", "instance-restored", "instance-deleted":
		return true
	}
	return false
}

// AgentKey is the cluster member config key an agent's heartbeat goes in (one per network:
// one agent per stack).
func AgentKey(network string) string { return "user.claudebox.agent." + network }

// AgentBeat is how often the heartbeat is written; AgentFresh how old it may be for `new`
// and `start` to send a box to that member (clocks of members may differ a little).
const (
	AgentBeat  = 20 * time.Second
	AgentFresh = 90 * time.Second
)

// heartbeat writes the time into the member's config every AgentBeat, and removes it when
// the agent ends: `new` and `start` on other members send a box here only while it is fresh.
func (a *Agent) heartbeat(ctx context.Context, member string) {
	key := AgentKey(a.Stack.Network)
	for {
		if err := a.Client.SetMemberConfig(ctx, member, key, time.Now().UTC().Format(time.RFC3339)); err != nil && ctx.Err() == nil {
			a.logf("agent: heartbeat: %v", err)
		}
		select {
		case <-ctx.Done():
			dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
			defer cancel()
			_ = a.Client.SetMemberConfig(dctx, member, key, "")
			return
		case <-time.After(AgentBeat):
		}
	}
}

// binder runs one bind round per poke (pokes that come while one runs make one more).
func (a *Agent) binder(ctx context.Context, poke chan struct{}) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-poke:
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(a.Settle):
		}
		acked, err := a.bindRound(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			a.logf("agent: binding: %v; again in 2 s", err)
			select {
			case <-ctx.Done():
				return
			case <-time.After(2 * time.Second):
			}
			select { // and try again (a start meanwhile has poked already)
			case poke <- struct{}{}:
			default:
			}
			continue
		}
		if a.Bound != nil {
			a.Bound(acked)
		}
	}
}

// bindRound binds every running box's port (after a drill's seeded holes: it waits for the
// network's lock, as every verb that binds does), then acknowledges on a cluster what it
// bound — also when one port alone could not be pinned (it went or moved mid-round: a box
// rebooting from inside), which the next round tries again.
func (a *Agent) bindRound(ctx context.Context) ([]string, error) {
	local, err := localMember(ctx, a.Client) // read each round: a member can be renamed
	if err != nil {
		return nil, err
	}
	a.local.Store(&local)
	unlock, err := a.lockNetwork(ctx)
	if err != nil {
		return nil, err
	}
	st, bindErr := NewHost(a.Client, a.Stack).bindPorts(ctx, time.Time{})
	unlock()
	if st == nil || local == "" {
		return nil, bindErr
	}
	failed := unpinned(bindErr)
	if bindErr != nil && len(failed) == 0 {
		return nil, bindErr // the firewall itself: nothing is known bound
	}
	var acked []string
	errs := []error{bindErr}
	for _, n := range st.NICs {
		if n.Problem != "" || !n.Tagged || n.Device != "eth0" || failed[n.Binding.Port] {
			continue
		}
		mark := boundMark(local, n.Started)
		if n.Acked == mark {
			continue
		}
		if err := a.ack(ctx, n.Box, n.Started, mark); err != nil {
			errs = append(errs, err)
			continue
		}
		acked = append(acked, n.Box)
		a.logf("agent: bound %s (%s)", n.Box, n.Binding)
	}
	return acked, errors.Join(errs...)
}

// lockNetwork takes the network's lock however long a drill holds it (saying so once): the
// starts that come meanwhile are bound when it ends.
func (a *Agent) lockNetwork(ctx context.Context) (func(), error) {
	said := false
	for {
		unlock, err := LockNetwork(ctx, a.Stack.Network)
		var held *HostLockedError
		if !errors.As(err, &held) {
			return unlock, err
		}
		if !said {
			a.logf("agent: waiting for %s (held by %s: a drill or host init); binding when it is free", held.Path, cmp.Or(held.Holder, "another process"))
			said = true
		}
	}
}

// ack writes TagBound on a box, unless it started again since the bind read it (its new port
// is bound by the round its start event brings).
func (a *Agent) ack(ctx context.Context, box string, started time.Time, mark string) error {
	for range 3 {
		in, etag, err := a.Client.Instance(ctx, box)
		if err != nil {
			if errors.Is(err, incus.ErrNotFound) {
				return nil
			}
			return err
		}
		if !in.LastUsedAt.Equal(started) || in.Status != "Running" {
			return nil
		}
		put := in.Writable()
		put.Config[TagBound] = mark
		err = a.Client.UpdateInstance(ctx, box, put, etag)
		if err == nil {
			return nil
		}
		if !incus.IsPreconditionFailed(err) {
			return fmt.Errorf("acknowledging the binding of %s: %w", box, err)
		}
	}
	return fmt.Errorf("acknowledging the binding of %s: it kept changing", box)
}

// awaitBound waits until box's own member has bound the start it runs now (TagBound), for a
// box that started on another member. A box that stops meanwhile is an error too.
func (bs *Boxes) awaitBound(ctx context.Context, box, member string) error {
	ctx, cancel := context.WithTimeout(ctx, AgentBindWait)
	defer cancel()
	for {
		in, _, err := bs.Client.Instance(ctx, box)
		if err == nil {
			if in.Status != "Running" {
				return fmt.Errorf("%s stopped before its member %s bound its port", box, member)
			}
			if in.Config[TagBound] == boundMark(in.Location, in.LastUsedAt) {
				return nil
			}
		}
		select {
		case <-ctx.Done():
			if errors.Is(context.Cause(ctx), context.DeadlineExceeded) {
				return &AgentMissingError{Box: box, Member: member, Wait: AgentBindWait}
			}
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// agentReady checks that member's agent reported within AgentFresh (its heartbeat), before a
// box is started there: with no agent, the box would run with its port unbound.
func (bs *Boxes) agentReady(ctx context.Context, box, member string) error {
	cfg, err := bs.Client.MemberConfig(ctx, member)
	if err != nil {
		return fmt.Errorf("reading cluster member %s: %w", member, err)
	}
	seen := cfg[AgentKey(bs.Stack.Network)]
	if agentSeen(seen, time.Now()) == agentFresh {
		return nil
	}
	return &AgentMissingError{Box: box, Member: member, Seen: cmp.Or(seen, "never")}
}

// AgentMissingError: a box was to start on another member, and no claudebox agent runs there
// (Seen: its last heartbeat), or none bound the box within Wait of its start.
type AgentMissingError struct {
	Box, Member string
	Seen        string
	Wait        time.Duration
}

func (e *AgentMissingError) Error() string {
	fix := fmt.Sprintf("run 'sudo claudebox host init' on %s (its boot unit runs the agent, 'claudebox host agent')", e.Member)
	if e.Wait > 0 {
		return fmt.Sprintf("%s runs on cluster member %s, and no claudebox agent there bound its port within %s (it stopped, or it waits for a drill on %s to end): %s",
			e.Box, e.Member, e.Wait, e.Member, fix)
	}
	return fmt.Sprintf("%s would start on cluster member %s, where no claudebox agent runs to bind its port (its last heartbeat: %s): %s, or choose another member with --target",
		e.Box, e.Member, e.Seen, fix)
}
