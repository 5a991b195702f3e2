package boxcore

import (
	"cmp"
	"context"
	"errors"
	"fmt"
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

// AgentBindWait is how long `new` and `start` wait for another member's agent to bind a box.
const AgentBindWait = 20 * time.Second

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
	if _, err := NewHost(a.Client, a.Stack).ApplyFirewall(ctx); err != nil {
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
	go func() { defer close(done); a.binder(ctx, local, poke) }()
	defer func() { <-done }()
	backoff := time.Second
	for {
		for e := range events.C {
			backoff = time.Second
			if a.startedHere(e, local) {
				kick()
			}
		}
		if ctx.Err() != nil {
			return nil
		}
		a.logf("agent: %v; subscribing again", events.Err())
		for {
			select {
			case <-ctx.Done():
				return nil
			case <-time.After(backoff):
			}
			backoff = min(2*backoff, 30*time.Second)
			if events, err = a.Client.Events(ctx, "lifecycle"); err == nil {
				break
			}
			a.logf("agent: %v", err)
		}
		kick()
	}
}

// startedHere: a lifecycle event of an instance starting on this member (every member's
// events reach a cluster member's subscribers).
func (a *Agent) startedHere(e incus.Event, local string) bool {
	l, ok := e.Lifecycle()
	if !ok || l.Instance() == "" {
		return false
	}
	if local != "" && e.Location != local {
		return false
	}
	switch l.Action {
	case "instance-started", "instance-restarted", "instance-resumed":
		return true
	case "instance-deleted": // its binding is stale: dropped (it would only block more)
		return true
	}
	return false
}

// binder runs one bind round per poke (pokes that come while one runs make one more).
func (a *Agent) binder(ctx context.Context, local string, poke chan struct{}) {
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
		acked, err := a.bindRound(ctx, local)
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
// network's lock, as every verb that binds does), then acknowledges on a cluster.
func (a *Agent) bindRound(ctx context.Context, local string) ([]string, error) {
	unlock, err := a.lockNetwork(ctx)
	if err != nil {
		return nil, err
	}
	st, err := NewHost(a.Client, a.Stack).bindPorts(ctx)
	unlock()
	if err != nil {
		return nil, err
	}
	if local == "" {
		return nil, nil
	}
	var acked []string
	var errs []error
	for _, n := range st.NICs {
		if n.Problem != "" || !n.Tagged || n.Device != "eth0" {
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

// AgentMissingError: a box started on another member, and nothing bound its port there.
type AgentMissingError struct {
	Box, Member string
	Wait        time.Duration
}

func (e *AgentMissingError) Error() string {
	return fmt.Sprintf("%s runs on cluster member %s, and no claudebox agent there bound its port within %s (none runs there, or it waits for a drill on %s to end): run 'sudo claudebox host init' on %s (its boot unit runs the agent, 'claudebox host agent')",
		e.Box, e.Member, e.Wait, e.Member, e.Member)
}
