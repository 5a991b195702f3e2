package drill

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"strings"
	"time"

	"github.com/claudebox/claudebox/boxcore"
	"github.com/claudebox/claudebox/boxcore/incus"
	"github.com/claudebox/claudebox/drill/probes"
	"github.com/claudebox/claudebox/firewall"
)

// The soak (drill --soak N): the re-apply window N times over, then an incusd restart and a
// host init drift repair, all under one flood from every box. Each box floods from a detached
// run (an incusd restart ends every exec session, not the boxes); the lab collects the runs
// once the sequence settled. Nothing may get through at any moment of it.

// soakResults is where a box's detached soak run writes its Results.
const soakResults = probes.StateDir + "/soak.json"

// SoakFloodMax bounds a soak flood: the lab ends the floods once the sequence is done, so this
// is only the ceiling if it never is.
const SoakFloodMax = 10 * time.Minute

func (e *engine) soak(ctx context.Context, rows []*Row) {
	if len(rows) == 0 {
		return
	}
	var labRows []*Row
	byBox := map[string][]*Row{}
	for _, r := range rows {
		if strings.HasPrefix(r.Probe.Kind, "lab-") {
			labRows = append(labRows, r)
		} else {
			byBox[r.From] = append(byBox[r.From], r)
		}
	}
	started := map[*Box][]*Row{}
	for _, b := range e.boxes {
		rs := byBox[b.Name]
		if len(rs) == 0 {
			continue
		}
		if err := e.startDetached(ctx, b, rs); err != nil {
			failRows(rs, err.Error())
			continue
		}
		started[b] = rs
	}
	time.Sleep(WindowLead)
	var steps []string
	var stepErr error
	e.cover(false, func() { steps, stepErr = e.soakSteps(ctx) })
	for b, rs := range started {
		res, err := e.collectDetached(ctx, b, len(rs))
		if err != nil {
			failRows(rs, err.Error())
			continue
		}
		for i, r := range rs {
			r.Result = res[i]
			r.Observed = Observe(r.Case, r.Result)
		}
	}
	for _, r := range labRows {
		switch r.Probe.Kind {
		case KindLabSoak:
			r.Result = probes.Result{Outcome: probes.Open, Evidence: strings.Join(steps, "; ")}
			if stepErr != nil {
				r.Result = probes.Result{Outcome: probes.CheckFailed, Evidence: stepErr.Error() + " (after: " + strings.Join(steps, "; ") + ")"}
			}
		case KindLabConntrackOut:
			r.Result = e.leftFlows(true)
		}
		r.Result.Probe = r.Probe
		r.Observed = Observe(r.Case, r.Result)
	}
}

func failRows(rs []*Row, why string) {
	for _, r := range rs {
		r.Result = probes.Result{Probe: r.Probe, Outcome: probes.CheckFailed, Evidence: why}
		r.Observed = CheckFailed
	}
}

// soakSteps makes Incus set the network up again e.o.Soak times, restarts incusd and repairs a
// drift with host init, each step waiting until its re-apply settled. It reports each step
// and how many re-applies the watcher saw; a step without one is an error (it proved nothing).
func (e *engine) soakSteps(ctx context.Context) (done []string, err error) {
	net := e.o.Stack.Network
	seen, t0 := 0, time.Now()
	step := func(name string, f func() error) error {
		w, err := firewall.Watch()
		if err != nil {
			return err
		}
		start := time.Now()
		err = e.settleAround(ctx, f)
		gens := w.Stop()
		if err != nil {
			return fmt.Errorf("%s: %w", name, err)
		}
		ra, ok := firewall.ReapplyOf(gens, net)
		if !ok {
			return fmt.Errorf("%s: Incus did not re-apply %s", name, net)
		}
		seen++
		if name != "" {
			done = append(done, fmt.Sprintf("%s: re-applied +%.1fs..+%.1fs (step %.1fs)", name,
				ra.Start.Sub(t0).Seconds(), ra.End.Sub(t0).Seconds(), time.Since(start).Seconds()))
		}
		return nil
	}
	for i := 1; i <= e.o.Soak; i++ {
		if err := step("", func() error { e.windowGen++; return e.reapply(ctx) }); err != nil {
			return done, fmt.Errorf("re-apply %d of %d: %w", i, e.o.Soak, err)
		}
	}
	done = append(done, fmt.Sprintf("%d raw.dnsmasq re-applies in %.1fs", e.o.Soak, time.Since(t0).Seconds()))
	if err := step("incusd restarted", func() error { return boxcore.RestartDaemon(ctx, e.c) }); err != nil {
		return done, err
	}
	if err := step("ACL detached, host init repaired it", func() error { return e.driftAndRepair(ctx) }); err != nil {
		return done, err
	}
	done = append(done, fmt.Sprintf("%d re-applies seen, none outside the flood", seen))
	return done, nil
}

// driftAndRepair detaches the ACL from the network (drift) and converges the stack as `host
// init` does (the forwarder is in the servers-file, which init leaves alone).
func (e *engine) driftAndRepair(ctx context.Context) error {
	n, _, err := e.c.Network(ctx, e.o.Stack.Network)
	if err != nil {
		return err
	}
	cfg := maps.Clone(n.Config)
	delete(cfg, "security.acls")
	if err := boxcore.PutNetworkConfig(ctx, e.c, n.Name, cfg); err != nil {
		return fmt.Errorf("detaching the ACL: %w", err)
	}
	if _, err := boxcore.NewHost(e.c, e.o.Stack).Init(ctx, boxcore.InitOptions{}); err != nil {
		return fmt.Errorf("host init: %w", err)
	}
	return nil
}

func (e *engine) startDetached(ctx context.Context, b *Box, rs []*Row) error {
	specs := make([]probes.Spec, len(rs))
	for i, r := range rs {
		specs[i] = r.Probe
	}
	in, err := json.Marshal(specs)
	if err != nil {
		return err
	}
	r, err := e.c.Exec(ctx, b.Name, incus.ExecRequest{Command: []string{b.agent, "probe", "run", "--detach", soakResults}, Stdin: bytes.NewReader(in)})
	if err != nil {
		return fmt.Errorf("%s: starting the soak flood: %w", b.Name, err)
	}
	if r.ExitCode != 0 {
		return fmt.Errorf("%s: starting the soak flood exited %d: %s", b.Name, r.ExitCode, strings.TrimSpace(string(r.Stderr)))
	}
	return nil
}

func (e *engine) collectDetached(ctx context.Context, b *Box, n int) ([]probes.Result, error) {
	r, err := e.c.Exec(ctx, b.Name, incus.ExecRequest{Command: []string{b.agent, "probe", "collect", soakResults}})
	if err != nil {
		return nil, fmt.Errorf("%s: collecting the soak flood: %w", b.Name, err)
	}
	if r.ExitCode != 0 {
		return nil, fmt.Errorf("%s: collecting the soak flood exited %d: %s", b.Name, r.ExitCode, strings.TrimSpace(string(r.Stderr)))
	}
	var out []probes.Result
	if err := json.Unmarshal(r.Stdout, &out); err != nil || len(out) != n {
		return nil, fmt.Errorf("%s: soak results: %d for %d floods (%v)", b.Name, len(out), n, err)
	}
	return out, nil
}

// restartPhase restarts the first box through Incus, not claudebox (as a reboot inside the box
// does: Incus gives it a new veth), and runs the restart rows before anything binds its port
// again; then it binds, as the box verbs would, so the run goes on from the declared stack.
// It returns the hits the box's listeners had before the restart (the restart empties them).
func (e *engine) restartPhase(ctx context.Context, rows []*Row) map[string][]probes.Hit {
	if len(rows) == 0 || len(e.boxes) == 0 {
		return nil
	}
	first := e.boxes[0]
	saved := map[string][]probes.Hit{first.Name: e.hits(ctx, first)}
	var probeRows, labRows []*Row
	for _, r := range rows {
		if strings.HasPrefix(r.Probe.Kind, "lab-") {
			labRows = append(labRows, r)
		} else {
			probeRows = append(probeRows, r)
		}
	}
	restartErr := e.c.SetState(ctx, first.Name, "restart", true, 0)
	var nb *Box
	if restartErr == nil {
		nb, restartErr = e.waitReady(ctx, first.Name)
	}
	if restartErr != nil {
		failRows(rows, "restarting "+first.Name+": "+restartErr.Error())
		return saved
	}
	e.boxes[0] = nb
	for _, r := range labRows {
		if r.Probe.Kind == KindLabRestarted {
			r.Result = probes.Result{Probe: r.Probe, Outcome: probes.Open,
				Evidence: fmt.Sprintf("restarted through Incus: port %s before, %s after", first.Veth, nb.Veth)}
			r.Observed = Observe(r.Case, r.Result)
		}
	}
	e.execute(ctx, probeRows)
	e.leasesIntact(ctx, labRows)
	if err := e.host.BindPorts(ctx); err != nil {
		e.progress("  binding %s's port again: %v", first.Name, err)
	}
	return saved
}
