package drill

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/claudebox/claudebox/boxcore"
	"github.com/claudebox/claudebox/drill/probes"
)

// The resource claims: a box cannot take the host down. Every box's limits are read from the
// kernel; then, on the first box, one bounded stress per limit runs against a tight limit the
// lab sets just before it (live, through Incus, as claudebox sets every limit), while the
// sibling and the host show they still start processes, allocate memory, write and compute.
// The tight limit sits just above what the box holds, and each stress is bounded by the probe
// itself at twice that headroom, far below the box's own limit and the host's: a missing limit
// turns the row red without ever exhausting anything. A stress runs only once the box's limit
// reads finite from the kernel.

// ClaimResources is the resource claim's name.
const ClaimResources = "a box cannot take the host down"

// The resource layers: the box's own limits, which the lab tightens around each stress. They
// are the drill's own (boxcore sets them on every box; the lab only tightens them), so a seeded
// hole switches them off by not tightening: the box keeps its own finite limit beneath, the
// bounded stress goes past the tight one, and its row must turn red.
const (
	LayerBoxPids   Layer = "box-pids-limit"
	LayerBoxMemory Layer = "box-memory-limit"
	LayerBoxDisk   Layer = "box-disk-quota"
	LayerBoxCPU    Layer = "box-cpu-quota"
	// LayerBoxSubvolDeny is the box's seccomp deny of the btrfs subvolume ioctls
	// (boxcore.SubvolumeDeny): its hole restarts the first box without it (seccomp applies at
	// start), and again with it afterwards.
	LayerBoxSubvolDeny Layer = "box-subvolume-deny"
)

// ResourceLayers are the resource layers, in the order the self-test goes.
var ResourceLayers = []Layer{LayerBoxPids, LayerBoxMemory, LayerBoxDisk, LayerBoxCPU, LayerBoxSubvolDeny}

func isResourceLayer(l Layer) bool { return slices.Contains(ResourceLayers, l) }

// Held and Unbounded are what a stress row observes: the limit stopped the stress within its
// headroom, or the stress went past it.
const (
	Held      Outcome = "held"
	Unbounded Outcome = "unbounded"
)

// Windows of the resource phase: one step per stress, in this order, after every other row.
const (
	WindowResLimits = "res-limits"
	WindowResPids   = "res-pids"
	WindowResMemory = "res-memory"
	WindowResDisk   = "res-disk"
	WindowResCPU    = "res-cpu"
	WindowResSubvol = "res-subvolume"
)

// KindLabLimits: the lab reads a box's limits from the kernel (cgroups, the disk quota).
const KindLabLimits = "lab-limits"

// The tight limits and the bounds of the stresses against them.
const (
	pidsHeadroom   = 100 // tasks above what the box runs
	memoryHeadroom = 192 // MiB above what the box uses
	diskHeadroom   = 64  // MiB above what the box's root holds
	cpuQuota       = "50ms/100ms"
	cpuQuotaShare  = 0.5
	// A stress is bounded at twice its headroom; it must reach at least minShare of it to
	// show it ran at all.
	stressBound = 2
	minShare    = 0.5
	// cpuSlack: the burner's share may exceed its quota by this factor (scheduler rounding).
	cpuSlack = 1.3
	// latencyBound: the sibling's and the host's work unit during the burn, against before.
	latencyBound = 2.5
	// diskSlack: what the box's root may grow beyond the headroom (btrfs metadata).
	diskSlackMiB = 16
)

var (
	// FromStressBox is the resource box, when the run has a sibling to watch it.
	FromStressBox = Selector{"the resource box (stresses)", func(t *Topology, _ Endpoint) []Endpoint {
		if !resourcesPlanned(t) {
			return nil
		}
		return boxEnds([]*Box{t.ResBox}, nil)
	}}
	FromResBoxes = Selector{"every box (resources)", func(t *Topology, _ Endpoint) []Endpoint {
		if !resourcesPlanned(t) {
			return nil
		}
		return boxEnds(append(slices.Clone(t.Boxes), t.ResBox), nil)
	}}
	FromResSibling = Selector{"the second box (resources)", func(t *Topology, _ Endpoint) []Endpoint {
		if !resourcesPlanned(t) {
			return nil
		}
		return boxEnds(t.Boxes[1:2], nil)
	}}
	FromResHost = Selector{"the host (resources)", func(t *Topology, _ Endpoint) []Endpoint {
		if !resourcesPlanned(t) {
			return nil
		}
		return []Endpoint{hostEnd}
	}}
	ToResSibling = Selector{"the second box", func(t *Topology, _ Endpoint) []Endpoint { return boxEnds(t.Boxes[1:2], nil) }}

	resLimits = Control{"res/limits", EndSource, EndSource}
)

// LayerGuestAPIOff: the profile's security.guestapi=false (boxcore).
const LayerGuestAPIOff = boxcore.LayerGuestAPIOff

// resourcesPlanned: the topology asks for the resource rows, has their box, and a sibling.
func resourcesPlanned(t *Topology) bool { return t.Resources && t.ResBox != nil && len(t.Boxes) >= 2 }

func resSpec(kind string, r probes.ResourceSpec, timeout time.Duration) func(_, _ Endpoint, _ *Topology) probes.Spec {
	return func(_, _ Endpoint, _ *Topology) probes.Spec {
		rs := r
		return probes.Spec{Kind: kind, Timeout: timeout, Resource: &rs}
	}
}

// statSpec: a stat of path inside the box.
func statSpec(path string) func(_, _ Endpoint, _ *Topology) probes.Spec {
	return func(_, _ Endpoint, _ *Topology) probes.Spec { return probes.Spec{Kind: probes.KindStat, Target: path} }
}

// resourceClaims: the limits, then one step per stress. Controls run in the stress's step,
// concurrently with it, after a delay that puts them while the stress is at its limit.
var resourceClaims = []ClaimRow{
	// The guest API: a box asking /dev/incus from 8 threads at once crashed incusd 6.0.4 (found
	// by the attacker). It is not there at all. The control: the probe sees the box's files.
	{Key: "ctl/stat-proc", Claim: ClaimControl, Kind: "stat", ID: "ctl/{from}/stat-proc", From: FromBoxes, To: ToSelf, Expect: Open,
		Probe: statSpec("/proc/self/status")},
	{Key: "res/guest-api", Claim: ClaimResources, Kind: "stat", ID: "res/{from}/guest-api", From: FromBoxes, To: ToSelf, Expect: Dropped,
		Probe:    statSpec("/dev/incus/sock"),
		Controls: []Control{{"ctl/stat-proc", EndSource, EndSource}}, Holds: any1(LayerGuestAPIOff)},

	{Key: "res/limits", Claim: ClaimResources, Kind: "limits", ID: "res/{from}/limits", From: FromResBoxes, To: ToSelf, Expect: Open,
		Probe: lab(KindLabLimits), Window: WindowResLimits},

	// Processes: a fork bomb stops at the box's limit; the sibling and the host still start processes.
	{Key: "ctl/res-spawn", Claim: ClaimControl, Kind: "spawn", ID: "ctl/{from}/spawn-during-bomb", From: FromResSibling, To: ToSelf, Expect: Open,
		Probe: resSpec(probes.KindSpawn, probes.ResourceSpec{Delay: 300 * time.Millisecond}, 5*time.Second), Window: WindowResPids},
	{Key: "ctl/res-host-spawn", Claim: ClaimControl, Kind: "spawn", ID: "ctl/{from}/spawn-during-bomb", From: FromResHost, To: ToSelf, Expect: Open,
		Probe: resSpec(probes.KindSpawn, probes.ResourceSpec{Delay: 300 * time.Millisecond}, 5*time.Second), Window: WindowResPids},
	{Key: "res/fork-bomb", Claim: ClaimResources, Kind: "fork-bomb", ID: "res/{from}/fork-bomb", From: FromStressBox, To: ToResSibling, Expect: Held,
		Probe:    resSpec(probes.KindForkBomb, probes.ResourceSpec{Bound: stressBound * pidsHeadroom, Hold: 800 * time.Millisecond}, 15*time.Second),
		Controls: []Control{resLimits, {"ctl/res-spawn", EndTarget, EndTarget}, {"ctl/res-host-spawn", EndHost, EndHost}},
		Holds:    any1(LayerBoxPids), Window: WindowResPids},

	// Memory: a hog stops at the box's limit (the kernel kills or stalls it there); the sibling
	// and the host still allocate.
	{Key: "ctl/res-alloc", Claim: ClaimControl, Kind: "alloc", ID: "ctl/{from}/alloc-during-hog", From: FromResSibling, To: ToSelf, Expect: Open,
		Probe: resSpec(probes.KindAlloc, probes.ResourceSpec{Bound: 32, Delay: 300 * time.Millisecond}, 10*time.Second), Window: WindowResMemory},
	{Key: "ctl/res-host-alloc", Claim: ClaimControl, Kind: "alloc", ID: "ctl/{from}/alloc-during-hog", From: FromResHost, To: ToSelf, Expect: Open,
		Probe: resSpec(probes.KindAlloc, probes.ResourceSpec{Bound: 64, Delay: 300 * time.Millisecond}, 10*time.Second), Window: WindowResMemory},
	{Key: "res/mem-hog", Claim: ClaimResources, Kind: "mem-hog", ID: "res/{from}/mem-hog", From: FromStressBox, To: ToResSibling, Expect: Held,
		Probe:    resSpec(probes.KindMemHog, probes.ResourceSpec{Bound: stressBound * memoryHeadroom, StallAfter: time.Second}, 30*time.Second),
		Controls: []Control{resLimits, {"ctl/res-alloc", EndTarget, EndTarget}, {"ctl/res-host-alloc", EndHost, EndHost}},
		Holds:    any1(LayerBoxMemory), Window: WindowResMemory},

	// Disk: filling the root stops at the box's quota, and the box's volume grew no more; the
	// sibling still writes.
	{Key: "ctl/res-write", Claim: ClaimControl, Kind: "write", ID: "ctl/{from}/write-during-fill", From: FromResSibling, To: ToSelf, Expect: Open,
		Probe: resSpec(probes.KindWrite, probes.ResourceSpec{Bound: 4, Delay: 200 * time.Millisecond}, 10*time.Second), Window: WindowResDisk},
	{Key: "res/disk-fill", Claim: ClaimResources, Kind: "disk-fill", ID: "res/{from}/disk-fill", From: FromStressBox, To: ToResSibling, Expect: Held,
		Probe:    resSpec(probes.KindDiskFill, probes.ResourceSpec{Bound: stressBound * diskHeadroom}, 30*time.Second),
		Controls: []Control{resLimits, {"ctl/res-write", EndTarget, EndTarget}},
		Holds:    any1(LayerBoxDisk), Window: WindowResDisk},

	// CPU: a burner gets no more than its quota; the sibling's and the host's work units stay
	// within a bound of what they took around the burn: the slower of just before and just
	// after, so that load the burner did not cause (the network rows beside it) is bracketed.
	{Key: "res/latency-before", Claim: ClaimControl, Kind: "latency", ID: "ctl/{from}/latency-before-burn", From: FromResSibling, To: ToSelf, Expect: Open,
		Probe: resSpec(probes.KindLatency, probes.ResourceSpec{Duration: 300 * time.Millisecond}, 5*time.Second), Window: WindowResCPU},
	{Key: "res/host-latency-before", Claim: ClaimControl, Kind: "latency", ID: "ctl/{from}/latency-before-burn", From: FromResHost, To: ToSelf, Expect: Open,
		Probe: resSpec(probes.KindLatency, probes.ResourceSpec{Duration: 300 * time.Millisecond}, 5*time.Second), Window: WindowResCPU},
	{Key: "res/latency-after", Claim: ClaimControl, Kind: "latency", ID: "ctl/{from}/latency-after-burn", From: FromResSibling, To: ToSelf, Expect: Open,
		Probe: resSpec(probes.KindLatency, probes.ResourceSpec{Duration: 300 * time.Millisecond, Delay: 1400 * time.Millisecond}, 5*time.Second), Window: WindowResCPU},
	{Key: "res/host-latency-after", Claim: ClaimControl, Kind: "latency", ID: "ctl/{from}/latency-after-burn", From: FromResHost, To: ToSelf, Expect: Open,
		Probe: resSpec(probes.KindLatency, probes.ResourceSpec{Duration: 300 * time.Millisecond, Delay: 1400 * time.Millisecond}, 5*time.Second), Window: WindowResCPU},
	{Key: "res/cpu-burn", Claim: ClaimResources, Kind: "cpu-burn", ID: "res/{from}/cpu-burn", From: FromStressBox, To: ToResSibling, Expect: Held,
		Probe:    resSpec(probes.KindCPUBurn, probes.ResourceSpec{Threads: 2, Duration: 900 * time.Millisecond, Delay: 300 * time.Millisecond}, 10*time.Second),
		Controls: []Control{resLimits}, Holds: any1(LayerBoxCPU), Window: WindowResCPU},
	// A btrfs subvolume made inside the box would have a qgroup of its own, outside the box's
	// quota (found by the attacker: 300 MiB past a 64 MiB quota). The deny holds it; the
	// control is the limits row (the probe's own mkdir control is in its evidence).
	{Key: "res/subvolume", Claim: ClaimResources, Kind: "subvolume", ID: "res/{from}/subvolume", From: FromStressBox, To: ToResSibling, Expect: Held,
		Probe:    func(_, _ Endpoint, _ *Topology) probes.Spec { return probes.Spec{Kind: probes.KindSubvolume} },
		Controls: []Control{resLimits}, Holds: any1(LayerBoxSubvolDeny), Window: WindowResSubvol},
	{Key: "res/latency-during", Claim: ClaimResources, Kind: "latency", ID: "res/{from}/latency-during-burn", From: FromResSibling, To: ToSelf, Expect: Open,
		Probe: resSpec(probes.KindLatency, probes.ResourceSpec{Duration: 400 * time.Millisecond, Delay: 500 * time.Millisecond}, 5*time.Second), Window: WindowResCPU},
	{Key: "res/host-latency-during", Claim: ClaimResources, Kind: "latency", ID: "res/{from}/latency-during-burn", From: FromResHost, To: ToSelf, Expect: Open,
		Probe: resSpec(probes.KindLatency, probes.ResourceSpec{Duration: 400 * time.Millisecond, Delay: 500 * time.Millisecond}, 5*time.Second), Window: WindowResCPU},
}

// resourceStep is one stress: what the lab tightens on the stress box, and how its rows are
// judged from what the probes counted.
type resourceStep struct {
	window string
	layer  Layer
	// tighten computes the tight limit from the box's limits as the kernel has them, and
	// returns it with the value the stress must stay under (tasks, MiB, CPU share).
	tighten func(e *engine, ctx context.Context, box string, kl boxcore.KernelLimits) (boxcore.Tighten, float64, error)
}

var resourceSteps = []resourceStep{
	{WindowResPids, LayerBoxPids, func(_ *engine, _ context.Context, _ string, kl boxcore.KernelLimits) (boxcore.Tighten, float64, error) {
		limit := kl.PidsCurrent + pidsHeadroom
		return boxcore.Tighten{Config: map[string]string{"limits.processes": strconv.FormatInt(limit, 10)}}, pidsHeadroom, nil
	}},
	{WindowResMemory, LayerBoxMemory, func(_ *engine, _ context.Context, _ string, kl boxcore.KernelLimits) (boxcore.Tighten, float64, error) {
		limit := kl.MemoryUsage + memoryHeadroom<<20
		return boxcore.Tighten{Config: map[string]string{"limits.memory": strconv.FormatInt(limit, 10)}}, memoryHeadroom, nil
	}},
	{WindowResCPU, LayerBoxCPU, func(*engine, context.Context, string, boxcore.KernelLimits) (boxcore.Tighten, float64, error) {
		return boxcore.Tighten{Config: map[string]string{"limits.cpu.allowance": cpuQuota}}, cpuQuotaShare, nil
	}},
	{WindowResDisk, LayerBoxDisk, func(e *engine, ctx context.Context, box string, _ boxcore.KernelLimits) (boxcore.Tighten, float64, error) {
		q, err := boxcore.ReadDiskQuota(ctx, e.c, e.o.Stack.Pool, box)
		if err != nil {
			return boxcore.Tighten{}, 0, err
		}
		e.diskBefore = q.Referenced
		// Incus takes sizes in bytes; round up to a MiB.
		limit := (q.Referenced>>20 + 1 + diskHeadroom) << 20
		return boxcore.Tighten{RootSize: strconv.FormatInt(limit, 10) + "B"}, diskHeadroom, nil
	}},
}

// resourcePhase reads every box's limits, tries a subvolume, then runs each step on the
// resource box: tighten (unless the seeded hole has that layer off), read the limit back
// finite from the kernel, run the step's rows once the step's gate (if any) closes, put the
// box's own limit back.
func (e *engine) resourcePhase(ctx context.Context, phase map[string][]*Row, gates map[string]<-chan struct{}) {
	for _, r := range phase[WindowResLimits] {
		read, missing := e.readLimits(ctx, r.From)
		if missing != "" {
			r.Result = probes.Result{Probe: r.Probe, Outcome: probes.Refused, Evidence: "missing: " + missing}
		} else {
			r.Result = probes.Result{Probe: r.Probe, Outcome: probes.Open, Evidence: read}
		}
		r.Observed = Observe(r.Case, r.Result)
	}
	e.subvolumeStep(ctx, phase[WindowResSubvol])
	for _, step := range resourceSteps {
		rows := phase[step.window]
		if len(rows) == 0 {
			continue
		}
		e.resourceStep(ctx, step, rows, gates[step.window])
	}
}

// subvolumeStep: the first box tries to create a btrfs subvolume. With the hole open, the box
// is restarted without its deny list first (seccomp applies at start) and restarted with it
// afterwards; a restarted box's port is bound again, as the box verbs do.
func (e *engine) subvolumeStep(ctx context.Context, rows []*Row) {
	if len(rows) == 0 {
		return
	}
	box := rows[0].From
	fail := func(why string) {
		for _, r := range rows {
			r.Result = probes.Result{Probe: r.Probe, Outcome: probes.CheckFailed, Evidence: why}
			r.Observed = CheckFailed
		}
	}
	if slices.Contains(e.holeOff, LayerBoxSubvolDeny) {
		restore, err := e.host.TightenBox(ctx, box, boxcore.Tighten{Config: map[string]string{boxcore.KeySyscallsDeny: ""}})
		if err != nil {
			fail(err.Error())
			return
		}
		defer func() {
			ctx := context.WithoutCancel(ctx)
			if err := restore(ctx); err != nil {
				e.progress("  putting %s's deny list back: %v", box, err)
			}
			if err := e.restartBox(ctx, box); err != nil {
				e.progress("  %v", err)
			}
		}()
		if err := e.restartBox(ctx, box); err != nil {
			fail(err.Error())
			return
		}
	} else if inst, _, err := e.c.Instance(ctx, box); err != nil {
		fail(err.Error())
		return
	} else if inst.Config[boxcore.KeySyscallsDeny] != boxcore.SubvolumeDeny {
		fail(box + " has no deny list of the btrfs subvolume ioctls (it was made by an older claudebox?)")
		return
	}
	e.execute(ctx, rows)
	for _, r := range rows {
		switch r.Result.Outcome {
		case probes.Refused:
			r.Observed = Held
		case probes.Open:
			r.Observed = Unbounded
		default:
			r.Observed = CheckFailed
		}
	}
}

// restartBox restarts one of the run's boxes through Incus, waits for its agent and binds its
// new port.
func (e *engine) restartBox(ctx context.Context, name string) error {
	if err := e.c.SetState(ctx, name, "restart", true, 30*time.Second); err != nil {
		return fmt.Errorf("restarting %s: %w", name, err)
	}
	nb, err := e.waitReady(ctx, name)
	if err != nil {
		return err
	}
	e.replaceBox(nb)
	return e.host.BindPorts(ctx)
}

// gate, when not nil, holds the stress and its controls back until it closes (the limit is
// set and read back before).
func (e *engine) resourceStep(ctx context.Context, step resourceStep, rows []*Row, gate <-chan struct{}) {
	var stress *Row
	for _, r := range rows {
		if r.Claim == ClaimResources && r.Expected == Held {
			stress = r
		}
	}
	fail := func(why string) {
		for _, r := range rows {
			r.Result = probes.Result{Probe: r.Probe, Outcome: probes.CheckFailed, Evidence: why}
			r.Observed = CheckFailed
		}
	}
	if stress == nil {
		fail("no stress row in " + step.window)
		return
	}
	box := stress.From
	kl, err := boxcore.ReadKernelLimits(box)
	if err != nil {
		fail(err.Error())
		return
	}
	tight, under, err := step.tighten(e, ctx, box, kl)
	if err != nil {
		fail(err.Error())
		return
	}
	off := slices.Contains(e.holeOff, step.layer)
	if !off {
		restore, err := e.host.TightenBox(ctx, box, tight)
		if err != nil {
			fail(err.Error())
			return
		}
		defer func() {
			if err := restore(context.WithoutCancel(ctx)); err != nil {
				e.progress("  putting %s's own limits back: %v", box, err)
			}
		}()
	}
	// Never a stress whose box has no finite limit: with the layer off, the box's own limit
	// (far above the stress's bound) must still read finite.
	if why := e.finite(ctx, step.layer, box); why != "" {
		fail("no stress without a finite limit: " + why)
		return
	}
	if gate != nil {
		select {
		case <-gate:
		case <-ctx.Done():
		}
	}
	e.execute(ctx, rows)
	var lostRunner string
	if runnerKilled(stress) {
		// The memcg OOM killer takes the hog (oom_score_adj 1000), but when the runner
		// faults a page while the dead hog's memory is still being freed, a second OOM
		// kill takes the runner (measured: 30 ms after the first, usage still at the
		// limit). The step could not run, which is no verdict: run it once more.
		lostRunner = stress.Result.Evidence
		e.progress("  %s: the stress's runner was killed (%s): running the step again", box, lostRunner)
		e.reviveIfDown(ctx, box)
		e.execute(ctx, rows)
	}
	e.judgeStress(ctx, step, stress, under)
	if lostRunner != "" {
		stress.Result.Evidence += " (a second run: the first lost its runner: " + lostRunner + ")"
	}
	if step.window == WindowResCPU {
		judgeLatency(rows)
	}
	e.reviveIfDown(ctx, box)
}

// finite reads back, from the kernel, the limit the step stresses.
func (e *engine) finite(ctx context.Context, l Layer, box string) string {
	if l == LayerBoxDisk {
		q, err := boxcore.ReadDiskQuota(ctx, e.c, e.o.Stack.Pool, box)
		if err != nil {
			return err.Error()
		}
		if q.Limit <= 0 {
			return box + "'s root has no quota"
		}
		return ""
	}
	kl, err := boxcore.ReadKernelLimits(box)
	if err != nil {
		return err.Error()
	}
	switch {
	case l == LayerBoxPids && kl.PidsMax < 0:
		return box + ": pids.max is max"
	case l == LayerBoxMemory && kl.MemoryMax < 0:
		return box + ": the memory limit is unlimited"
	case l == LayerBoxCPU && kl.CPUQuotaUs < 0:
		return box + ": no CFS quota"
	}
	return ""
}

// judgeStress turns the stress row's count into held (the limit stopped it within its
// headroom, after it had gone at least part of the way) or unbounded.
func (e *engine) judgeStress(ctx context.Context, step resourceStep, r *Row, under float64) {
	res := r.Result.Resource
	if r.Result.Outcome == probes.CheckFailed || res == nil {
		r.Observed = CheckFailed
		return
	}
	var got float64
	unit := "MiB"
	switch step.layer {
	case LayerBoxPids:
		got, unit = float64(res.Count), "tasks"
	case LayerBoxCPU:
		got, unit = res.CPUShare, "CPU"
	default:
		got = float64(res.Count)
	}
	limitNote := fmt.Sprintf("%.4g %s against a tight limit of %.4g", got, unit, under)
	if slices.Contains(e.holeOff, step.layer) {
		limitNote += " (seeded hole: the tight limit was not set)"
	}
	switch step.layer {
	case LayerBoxCPU:
		switch {
		case got < 0.1:
			r.Observed, r.Result.Evidence = CheckFailed, "the burner barely ran: "+limitNote
		case got <= under*cpuSlack:
			r.Observed, r.Result.Evidence = Held, limitNote
		default:
			r.Observed, r.Result.Evidence = Unbounded, limitNote
		}
		return
	case LayerBoxDisk:
		q, err := boxcore.ReadDiskQuota(ctx, e.c, e.o.Stack.Pool, r.From)
		if err == nil && e.diskBefore > 0 {
			grew := float64(q.Referenced-e.diskBefore) / (1 << 20)
			limitNote += fmt.Sprintf("; the volume grew %.1f MiB", grew)
			if r.Result.Outcome == probes.Refused && grew > under+diskSlackMiB {
				r.Observed, r.Result.Evidence = Unbounded, limitNote+" past its quota"
				return
			}
		}
	}
	switch {
	case r.Result.Outcome == probes.Open:
		r.Observed, r.Result.Evidence = Unbounded, "reached its bound: "+limitNote
	case r.Result.Outcome != probes.Refused:
		r.Observed = CheckFailed
	case got > under+slack(step.layer):
		r.Observed, r.Result.Evidence = Unbounded, "stopped ("+res.Stopped+") only past the limit: "+limitNote
	case got < under*minShare && step.layer != LayerBoxMemory:
		r.Observed, r.Result.Evidence = CheckFailed, "stopped ("+res.Stopped+") before it neared the limit: "+limitNote
	default:
		r.Observed, r.Result.Evidence = Held, "stopped ("+res.Stopped+"): "+limitNote
	}
}

// slack: what a count may exceed the headroom by (the memory hog's own process and the
// kernel's rounding; a disk's last chunk).
func slack(l Layer) float64 {
	switch l {
	case LayerBoxMemory:
		return 24
	case LayerBoxDisk:
		return 8
	}
	return 0
}

// judgeLatency: a work unit during the burn against the same box's (or host's) before.
func judgeLatency(rows []*Row) {
	// The reference: the slower of the units just before and just after the burn.
	ref := map[string]int64{}
	for _, r := range rows {
		if r.Claim == ClaimControl && r.Kind == "latency" && r.Result.Resource != nil && r.Observed == Open {
			ref[r.From] = max(ref[r.From], r.Result.Resource.UnitNs)
		}
	}
	for _, r := range rows {
		if r.Claim != ClaimResources || r.Kind != "latency" || r.Observed != Open {
			continue
		}
		b := ref[r.From]
		if b <= 0 || r.Result.Resource == nil || r.Result.Resource.UnitNs <= 0 {
			r.Observed, r.Result.Evidence = CheckFailed, "no work unit to compare with"
			continue
		}
		ratio := float64(r.Result.Resource.UnitNs) / float64(b)
		r.Result.Evidence = fmt.Sprintf("a work unit took %.2fx what it took around the burn (%s vs %s, the slower of before and after; bound %.1fx)",
			ratio, time.Duration(r.Result.Resource.UnitNs), time.Duration(b), latencyBound)
		if ratio > latencyBound {
			r.Observed = Refused
		}
	}
}

// readLimits reads a box's limits from the kernel: what it read, and what is missing.
func (e *engine) readLimits(ctx context.Context, box string) (read, missing string) {
	kl, err := boxcore.ReadKernelLimits(box)
	if err != nil {
		return "", err.Error()
	}
	var have, lack []string
	add := func(ok bool, what, why string) {
		if ok {
			have = append(have, what)
		} else {
			lack = append(lack, why)
		}
	}
	add(kl.PidsMax >= 0, fmt.Sprintf("pids.max %d", kl.PidsMax), "pids.max is max")
	add(kl.MemoryMax >= 0, fmt.Sprintf("memory %d MiB", kl.MemoryMax>>20), "no memory limit")
	add(kl.CPUQuotaUs >= 0, fmt.Sprintf("CFS quota %dus/%dus", kl.CPUQuotaUs, kl.CPUPeriodUs), "no CFS quota")
	q, err := boxcore.ReadDiskQuota(ctx, e.c, e.o.Stack.Pool, box)
	if err != nil {
		lack = append(lack, "disk quota: "+err.Error())
	} else {
		add(q.Limit > 0, fmt.Sprintf("disk quota %d MiB", q.Limit>>20), "no disk quota")
	}
	return strings.Join(have, ", "), strings.Join(lack, "; ")
}

// replaceBox puts a restarted box's new reading where the old one was.
func (e *engine) replaceBox(nb *Box) {
	if e.resBox != nil && e.resBox.Name == nb.Name {
		e.resBox = nb
		return
	}
	for i, b := range e.boxes {
		if b.Name == nb.Name {
			e.boxes[i] = nb
		}
	}
}

// reviveIfDown starts the stress box again if a stress ended it (the OOM killer's pick):
// the steps after it need it running.
func (e *engine) reviveIfDown(ctx context.Context, box string) {
	st, err := e.c.InstanceState(ctx, box)
	if err != nil || strings.EqualFold(st.Status, "running") {
		return
	}
	e.progress("  %s stopped during a stress (%s): starting it again", box, st.Status)
	if err := e.c.SetState(ctx, box, "start", false, 30*time.Second); err != nil {
		e.progress("  starting %s: %v", box, err)
		return
	}
	nb, err := e.waitReady(ctx, box)
	if err != nil {
		e.progress("  %s: %v", box, err)
		return
	}
	e.replaceBox(nb)
	if err := e.host.BindPorts(ctx); err != nil {
		e.progress("  binding %s's port: %v", box, err)
	}
}
