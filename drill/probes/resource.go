package probes

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// The resource kinds (issue 14): a stress against a limit the lab sets on the box, and
// small positive controls that run beside it on a sibling or the host. Every stress is
// bounded by the probe itself (ResourceSpec.Bound, Duration), whatever the kernel lets
// it do, so a missing limit cannot take the machine down. See doc.go.

// ResourceSpec tunes the resource kinds; nil means every default.
type ResourceSpec struct {
	// Bound caps the stress: tasks (fork-bomb, spawn), MiB touched (mem-hog, alloc),
	// MiB written (disk-fill, write). 0 is the kind's default.
	Bound int `json:"bound,omitempty"`
	// Hold: fork-bomb keeps its tasks, mem-hog/alloc their memory, this long before
	// releasing them (fork-bomb default 1s, others 0).
	Hold time.Duration `json:"hold,omitempty"`
	// Delay: the probe waits this long before it starts (any kind): a control then runs
	// while a concurrent stress sits at its limit, a stress after a "before" measurement.
	Delay time.Duration `json:"delay,omitempty"`
	// Duration: cpu-burn's burn (default 3s) and latency's run (default 2s).
	Duration time.Duration `json:"duration,omitempty"`
	// StallAfter: mem-hog's child making no progress this long counts as held at the
	// limit (a cgroup v1 box with its OOM killer off stalls instead of killing). Default 3s.
	StallAfter time.Duration `json:"stall_after,omitempty"`
	// Threads: cpu-burn's busy threads (default 2).
	Threads int `json:"threads,omitempty"`
	// Units: latency runs this many work units (0: as many as fit in Duration); with
	// both set, whichever ends first.
	Units int `json:"units,omitempty"`
	// Path: the file disk-fill / write create (must not exist; removed afterwards).
	// Default /var/tmp/claudebox-<kind>.<pid>, on the box's root filesystem.
	Path string `json:"path,omitempty"`
}

// resourceJSON is ResourceSpec on the wire: durations as Go duration strings ("1500ms";
// a number is nanoseconds), unknown fields refused.
type resourceJSON struct {
	Bound      int    `json:"bound,omitempty"`
	Hold       Dur    `json:"hold,omitempty"`
	Delay      Dur    `json:"delay,omitempty"`
	Duration   Dur    `json:"duration,omitempty"`
	StallAfter Dur    `json:"stall_after,omitempty"`
	Threads    int    `json:"threads,omitempty"`
	Units      int    `json:"units,omitempty"`
	Path       string `json:"path,omitempty"`
}

func (rs ResourceSpec) MarshalJSON() ([]byte, error) {
	return json.Marshal(resourceJSON{Bound: rs.Bound, Hold: Dur(rs.Hold), Delay: Dur(rs.Delay), Duration: Dur(rs.Duration),
		StallAfter: Dur(rs.StallAfter), Threads: rs.Threads, Units: rs.Units, Path: rs.Path})
}

func (rs *ResourceSpec) UnmarshalJSON(b []byte) error {
	var j resourceJSON
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&j); err != nil {
		return fmt.Errorf("resource: %w", err)
	}
	*rs = ResourceSpec{Bound: j.Bound, Hold: j.Hold.D(), Delay: j.Delay.D(), Duration: j.Duration.D(),
		StallAfter: j.StallAfter.D(), Threads: j.Threads, Units: j.Units, Path: j.Path}
	return nil
}

// ResourceResult is what a resource kind did.
type ResourceResult struct {
	// Bound is the effective bound (after defaults).
	Bound int `json:"bound,omitempty"`
	// Count: tasks created (fork-bomb, at the peak), processes that ran (spawn), MiB
	// touched (mem-hog: the last the child reported; alloc), MiB written (disk-fill, write).
	Count int64 `json:"count"`
	// Stopped says why the stress ended: "EAGAIN", "EDQUOT", "ENOSPC", "ENOMEM",
	// "oom-killed", "stalled", "bound", "done" (cpu-burn, latency), or an error's text.
	Stopped string `json:"stopped,omitempty"`
	// Released: fork-bomb tasks killed right after creation failed, to give the box's own
	// processes room to make threads while the rest are held.
	Released int `json:"released,omitempty"`
	// CPUShare (cpu-burn): CPU seconds of the burning threads / wall seconds of the burn.
	CPUShare float64 `json:"cpu_share,omitempty"`
	CPUNs    int64   `json:"cpu_ns,omitempty"`
	WallNs   int64   `json:"wall_ns,omitempty"`
	// UnitNs / UnitP90Ns (latency): median and 90th percentile of one work unit;
	// Units: how many ran.
	UnitNs    int64 `json:"unit_ns,omitempty"`
	UnitP90Ns int64 `json:"unit_p90_ns,omitempty"`
	Units     int   `json:"units,omitempty"`
}

// IsResourceKind reports the resource kinds.
func IsResourceKind(k Kind) bool {
	switch k {
	case KindForkBomb, KindSpawn, KindMemHog, KindAlloc, KindDiskFill, KindWrite, KindCPUBurn, KindLatency:
		return true
	}
	return false
}

// Defaults and ceilings of ResourceSpec, per kind.
const (
	ForkBombDefaultBound = 1024
	ForkBombMaxBound     = 8192
	ForkBombDefaultHold  = time.Second
	// forkBombHeadroom tasks are killed as soon as creation fails.
	forkBombHeadroom = 4
	// forkBombWarmThreads idle OS threads are made before the bomb; it refuses to
	// start with less than forkBombMinRoom tasks below the pids limit.
	forkBombWarmThreads = 4
	forkBombMinRoom     = 16

	SpawnDefaultBound = 4
	SpawnMaxBound     = 64

	MemHogDefaultBound      = 512 // MiB
	MemHogMaxBound          = 16384
	MemHogDefaultStallAfter = 3 * time.Second
	memHogStepMiB           = 4

	AllocDefaultBound = 32 // MiB
	AllocMaxBound     = 1024

	DiskFillDefaultBound = 256  // MiB
	DiskFillMaxBound     = 4096 // a box without a quota fills the host's disk: keep it small
	diskSyncEveryMiB     = 8

	WriteDefaultBound = 4 // MiB
	WriteMaxBound     = 256

	CPUBurnDefaultThreads  = 2
	CPUBurnMaxThreads      = 64
	CPUBurnDefaultDuration = 3 * time.Second

	LatencyDefaultDuration = 2 * time.Second
	LatencyMaxUnits        = 100000

	resourceMaxDuration = 10 * time.Minute
)

func (s Spec) res() ResourceSpec {
	if s.Resource == nil {
		return ResourceSpec{}
	}
	return *s.Resource
}

// bound is the effective Bound of kind k.
func (rs ResourceSpec) bound(k Kind) int {
	if rs.Bound > 0 {
		return rs.Bound
	}
	switch k {
	case KindForkBomb:
		return ForkBombDefaultBound
	case KindSpawn:
		return SpawnDefaultBound
	case KindMemHog:
		return MemHogDefaultBound
	case KindAlloc:
		return AllocDefaultBound
	case KindDiskFill:
		return DiskFillDefaultBound
	case KindWrite:
		return WriteDefaultBound
	}
	return 0
}

func maxBound(k Kind) int {
	switch k {
	case KindForkBomb:
		return ForkBombMaxBound
	case KindSpawn:
		return SpawnMaxBound
	case KindMemHog:
		return MemHogMaxBound
	case KindAlloc:
		return AllocMaxBound
	case KindDiskFill:
		return DiskFillMaxBound
	case KindWrite:
		return WriteMaxBound
	}
	return 0
}

func (rs ResourceSpec) hold(k Kind) time.Duration {
	if rs.Hold == 0 && k == KindForkBomb {
		return ForkBombDefaultHold
	}
	return rs.Hold
}

func (rs ResourceSpec) duration(k Kind) time.Duration {
	if rs.Duration > 0 {
		return rs.Duration
	}
	switch k {
	case KindCPUBurn:
		return CPUBurnDefaultDuration
	case KindLatency:
		if rs.Units > 0 {
			return 0 // Units alone: run them all (within the timeout)
		}
		return LatencyDefaultDuration
	}
	return 0
}

func (rs ResourceSpec) stallAfter() time.Duration {
	if rs.StallAfter > 0 {
		return rs.StallAfter
	}
	return MemHogDefaultStallAfter
}

func (rs ResourceSpec) threads() int {
	if rs.Threads > 0 {
		return rs.Threads
	}
	return CPUBurnDefaultThreads
}

func (rs ResourceSpec) path(k Kind) string {
	if rs.Path != "" {
		return rs.Path
	}
	return fmt.Sprintf("/var/tmp/claudebox-%s.%d", k, os.Getpid())
}

// resourceTimeout is the default Spec.Timeout: Delay, the kind's own time, and room.
func resourceTimeout(s Spec) time.Duration {
	rs := s.res()
	t := rs.Delay
	switch s.Kind {
	case KindForkBomb:
		t += rs.hold(s.Kind) + 30*time.Second
	case KindSpawn:
		t += 10 * time.Second
	case KindMemHog:
		t += rs.Hold + rs.stallAfter() + 60*time.Second
	case KindAlloc:
		t += rs.Hold + 30*time.Second
	case KindDiskFill:
		t += 180 * time.Second
	case KindWrite:
		t += 30 * time.Second
	case KindCPUBurn:
		t += rs.duration(s.Kind) + 5*time.Second
	case KindLatency:
		if rs.duration(s.Kind) == 0 {
			t += 60 * time.Second
		} else {
			t += rs.duration(s.Kind) + 5*time.Second
		}
	}
	return t
}

func (s Spec) validateResource() error {
	if err := s.validateResourceFields(); err != nil {
		return fmt.Errorf("%s probe: %w", s.Kind, err)
	}
	return nil
}

func (s Spec) validateResourceFields() error {
	rs := s.res()
	if rs.Bound < 0 {
		return fmt.Errorf("resource.bound %d: want >= 0", rs.Bound)
	}
	if m := maxBound(s.Kind); m == 0 && rs.Bound != 0 {
		return errors.New("resource.bound does not apply to this kind")
	} else if rs.Bound > m {
		return fmt.Errorf("resource.bound %d: at most %d", rs.Bound, m)
	}
	for _, d := range []struct {
		name string
		v    time.Duration
	}{{"hold", rs.Hold}, {"delay", rs.Delay}, {"duration", rs.Duration}, {"stall_after", rs.StallAfter}} {
		if d.v < 0 || d.v > resourceMaxDuration {
			return fmt.Errorf("resource.%s %v: want 0..%v", d.name, d.v, resourceMaxDuration)
		}
	}
	if rs.Threads < 0 || rs.Threads > CPUBurnMaxThreads {
		return fmt.Errorf("resource.threads %d: want 0..%d", rs.Threads, CPUBurnMaxThreads)
	}
	if rs.Units < 0 || rs.Units > LatencyMaxUnits {
		return fmt.Errorf("resource.units %d: want 0..%d", rs.Units, LatencyMaxUnits)
	}
	if rs.Path != "" {
		if s.Kind != KindDiskFill && s.Kind != KindWrite {
			return errors.New("resource.path applies to disk-fill and write only")
		}
		if !filepath.IsAbs(rs.Path) || filepath.Clean(rs.Path) != rs.Path {
			return fmt.Errorf("resource.path %q: want a clean absolute path", rs.Path)
		}
	}
	// The probe's own time must fit in the timeout, or it could never finish.
	need := rs.Delay
	switch s.Kind {
	case KindForkBomb:
		need += rs.hold(s.Kind)
	case KindMemHog, KindAlloc:
		need += rs.Hold
	case KindCPUBurn, KindLatency:
		need += rs.duration(s.Kind)
	}
	if s.Timeout != 0 && s.Timeout <= need {
		return fmt.Errorf("timeout %v must exceed the probe's own time %v", s.Timeout, need)
	}
	return nil
}

func runResource(ctx context.Context, s Spec, r *Result) {
	rs := s.res()
	r.Resource = &ResourceResult{Bound: rs.bound(s.Kind)}
	if err := sleepCtx(ctx, rs.Delay); err != nil {
		r.Outcome, r.Evidence = CheckFailed, "not started after the delay: "+err.Error()
		return
	}
	switch s.Kind {
	case KindForkBomb:
		probeForkBomb(ctx, rs, r)
	case KindSpawn:
		probeSpawn(ctx, rs, r)
	case KindMemHog:
		probeMemHog(ctx, rs, r)
	case KindAlloc:
		probeAlloc(ctx, rs, r)
	case KindDiskFill, KindWrite:
		probeDiskWrite(ctx, s.Kind, rs, r)
	case KindCPUBurn:
		probeCPUBurn(ctx, rs, r)
	case KindLatency:
		probeLatency(ctx, rs, r)
	}
}

func errnoName(e syscall.Errno) string {
	if n := unix.ErrnoName(e); n != "" {
		return n
	}
	return e.Error()
}

// ---------------------------------------------------------------------------
// Tasks: fork-bomb and spawn.
//
// The children are raw clone(2)s of this process, made the way syscall's
// forkAndExecInChild makes its child: in the child only //go:nosplit code that makes
// raw system calls runs, so nothing of the Go runtime (no allocation, no stack growth,
// no scheduler, no signal handling) is touched in a process that has one thread and a
// copy of a multi-threaded runtime's memory. All signals are blocked across the clone,
// so the child starts with every catchable signal blocked (none of the runtime's
// handlers can run in it); SIGKILL, which cannot be blocked, is the only way it ends.
// Each child is exactly one task, so the count is exact.

// rawCloneMode: what a raw child does.
const (
	cloneExit  = 0 // exit_group(0) at once (spawn)
	clonePause = 1 // PR_SET_PDEATHSIG(SIGKILL), then wait for SIGKILL forever (fork-bomb)
)

// rawClone forks. It runs on a locked OS thread with all signals blocked (forkChild).
// Parent: the child's pid, or the errno. The child never returns.
//
//go:norace
//go:nosplit
//go:noinline
func rawClone(ppid uintptr, mode int) (uintptr, syscall.Errno) {
	r1, _, e := syscall.RawSyscall6(syscall.SYS_CLONE, uintptr(syscall.SIGCHLD), 0, 0, 0, 0, 0)
	if e != 0 || r1 != 0 {
		return r1, e
	}
	// The child. Raw system calls only from here on.
	if mode == clonePause {
		// Hold no file of the parent's (a pipe kept open would keep its reader
		// waiting for EOF); ENOSYS before Linux 5.9 is harmless.
		syscall.RawSyscall(unix.SYS_CLOSE_RANGE, 0, ^uintptr(0)>>32, 0)
		// Die with the thread that made us; if that already happened (we were
		// reparented before the prctl took), leave at once.
		syscall.RawSyscall(syscall.SYS_PRCTL, syscall.PR_SET_PDEATHSIG, uintptr(syscall.SIGKILL), 0)
		if p, _, _ := syscall.RawSyscall(syscall.SYS_GETPPID, 0, 0, 0); p == ppid {
			for {
				// ppoll(NULL, 0, NULL, NULL): sleep until a signal; all but
				// SIGKILL/SIGSTOP are blocked, so this is "until killed".
				syscall.RawSyscall6(syscall.SYS_PPOLL, 0, 0, 0, 0, 0, 0)
			}
		}
	}
	for {
		syscall.RawSyscall(syscall.SYS_EXIT_GROUP, 0, 0, 0)
	}
}

// forkChild makes one raw child. The caller must hold runtime.LockOSThread, so the
// signal mask is blocked and restored on the same thread.
func forkChild(ppid uintptr, mode int) (int, syscall.Errno) {
	all, old := ^uint64(0), uint64(0)
	if _, _, e := syscall.RawSyscall6(syscall.SYS_RT_SIGPROCMASK, unix.SIG_SETMASK,
		uintptr(unsafe.Pointer(&all)), uintptr(unsafe.Pointer(&old)), 8, 0, 0); e != 0 {
		return 0, e
	}
	pid, e := rawClone(ppid, mode)
	syscall.RawSyscall6(syscall.SYS_RT_SIGPROCMASK, unix.SIG_SETMASK, uintptr(unsafe.Pointer(&old)), 0, 8, 0, 0)
	return int(pid), e
}

// warmThreads makes sure the runtime has n idle OS threads, so it need not create one
// while the bomb has the box's task limit exhausted (a Go process that cannot create
// a thread it needs dies). Threads are never destroyed once idle.
func warmThreads(n int) {
	var wg sync.WaitGroup
	release := make(chan struct{})
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func() {
			runtime.LockOSThread()
			wg.Done()
			<-release
			runtime.UnlockOSThread()
		}()
	}
	wg.Wait()
	close(release)
}

// pidsRoom is pids.max - pids.current of this process's pids cgroup (v1 or v2), when
// both are readable and there is a limit.
func pidsRoom() (int64, bool) {
	b, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		return 0, false
	}
	var dirs []string
	for _, l := range strings.Split(string(b), "\n") {
		f := strings.SplitN(l, ":", 3)
		if len(f) != 3 {
			continue
		}
		if strings.Contains(","+f[1]+",", ",pids,") {
			dirs = append(dirs, filepath.Join("/sys/fs/cgroup/pids", f[2]), "/sys/fs/cgroup/pids")
		} else if f[0] == "0" && f[1] == "" {
			dirs = append(dirs, filepath.Join("/sys/fs/cgroup", f[2]))
		}
	}
	read := func(name string) (int64, bool) {
		v, err := os.ReadFile(name)
		if err != nil {
			return 0, false
		}
		n, err := strconv.ParseInt(strings.TrimSpace(string(v)), 10, 64)
		return n, err == nil
	}
	for _, d := range dirs {
		limit, ok1 := read(filepath.Join(d, "pids.max")) // "max" does not parse: no limit here
		cur, ok2 := read(filepath.Join(d, "pids.current"))
		if ok1 && ok2 {
			return limit - cur, true
		}
	}
	return 0, false
}

// reapAll kills every pid with SIGKILL and waits for each; it returns how many could
// not be reaped (never zero-or-more silently: the caller reports them).
func reapAll(pids []int) (left int, firstErr error) {
	for _, p := range pids {
		_ = unix.Kill(p, unix.SIGKILL)
	}
	for _, p := range pids {
		for {
			var ws unix.WaitStatus
			_, err := unix.Wait4(p, &ws, 0, nil)
			if errors.Is(err, unix.EINTR) {
				continue
			}
			if err != nil && !errors.Is(err, unix.ECHILD) {
				left++
				if firstErr == nil {
					firstErr = fmt.Errorf("reaping %d: %w", p, err)
				}
			}
			break
		}
	}
	return left, firstErr
}

// probeForkBomb creates raw children until clone fails or Bound is reached, holds
// them for Hold, then kills and reaps every one.
func probeForkBomb(ctx context.Context, rs ResourceSpec, r *Result) {
	res := r.Resource
	bound := res.Bound
	pids := make([]int, 0, bound) // no allocation while at the limit
	if room, ok := pidsRoom(); ok && room < forkBombMinRoom {
		// Too close to the limit for the agent's own threads: the Go runtime dies
		// when it cannot make one.
		res.Stopped = "no room"
		r.Outcome, r.Evidence = CheckFailed, fmt.Sprintf("only %d tasks below the pids limit before the bomb (want %d): the agent cannot run there", room, forkBombMinRoom)
		return
	}
	warmThreads(forkBombWarmThreads)
	// The children's parent is this OS thread (their PR_SET_PDEATHSIG fires when it
	// ends): keep it ours until every child is reaped, so no other goroutine can
	// retire it early.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	ppid := uintptr(os.Getpid())
	var stop syscall.Errno
	var releaseErr error
	for len(pids) < bound && ctx.Err() == nil {
		pid, e := forkChild(ppid, clonePause)
		if e != 0 {
			stop = e
			break
		}
		pids = append(pids, pid)
	}
	res.Count = int64(len(pids))
	cleanup := func() error {
		left, err := reapAll(pids)
		pids = nil
		if left > 0 {
			return fmt.Errorf("%d tasks not reaped: %w", left, err)
		}
		return nil
	}
	defer func() {
		if pids != nil {
			_ = cleanup()
		}
	}()
	if stop != 0 && len(pids) > 0 {
		// Creation failed: the box is at its limit. Give back a little at once.
		n := min(forkBombHeadroom, len(pids))
		left, err := reapAll(pids[len(pids)-n:])
		pids = pids[:len(pids)-n]
		res.Released = n
		if left > 0 {
			releaseErr = fmt.Errorf("%d released tasks not reaped: %w", left, err)
		}
	}
	var timedOut error
	if ctx.Err() == nil {
		timedOut = sleepCtx(ctx, rs.hold(KindForkBomb))
	} else {
		timedOut = ctx.Err()
	}
	reapErr := cleanup()
	if reapErr == nil {
		reapErr = releaseErr
	}
	held := fmt.Sprintf("held %v", rs.hold(KindForkBomb))
	if timedOut != nil {
		held = "the hold cut short (" + timedOut.Error() + ")"
	}
	switch {
	case reapErr != nil:
		res.Stopped = reapErr.Error()
		r.Outcome, r.Evidence = CheckFailed, reapErr.Error()
	case stop == unix.EAGAIN:
		res.Stopped = "EAGAIN"
		r.Outcome = Refused
		r.Evidence = fmt.Sprintf("task creation refused (EAGAIN) after %d tasks; %d released at once, the rest %s; all reaped", res.Count, res.Released, held)
	case stop != 0:
		res.Stopped = errnoName(stop)
		r.Outcome, r.Evidence = CheckFailed, fmt.Sprintf("clone failed after %d tasks: %v", res.Count, stop)
	case res.Count >= int64(bound):
		res.Stopped = "bound"
		r.Outcome = Open
		r.Evidence = fmt.Sprintf("created %d tasks (the bound): nothing stopped them; %s; all reaped", res.Count, held)
	default:
		res.Stopped = "timeout"
		r.Outcome, r.Evidence = CheckFailed, fmt.Sprintf("stopped after %d tasks: %v", res.Count, ctx.Err())
	}
}

// probeSpawn starts Bound short-lived raw children (each exits 0 at once) one after
// another and waits for each.
func probeSpawn(ctx context.Context, rs ResourceSpec, r *Result) {
	res := r.Resource
	ppid := uintptr(os.Getpid())
	for i := 0; i < res.Bound; i++ {
		if err := ctx.Err(); err != nil {
			r.Outcome, r.Evidence = CheckFailed, fmt.Sprintf("%d of %d ran: %v", res.Count, res.Bound, err)
			return
		}
		runtime.LockOSThread()
		pid, e := forkChild(ppid, cloneExit)
		runtime.UnlockOSThread()
		if e != 0 {
			res.Stopped = errnoName(e)
			r.Outcome, r.Evidence = CheckFailed, fmt.Sprintf("clone failed after %d: %v", res.Count, e)
			if e == unix.EAGAIN {
				r.Outcome, r.Evidence = Refused, fmt.Sprintf("task creation refused (EAGAIN) after %d of %d", res.Count, res.Bound)
			}
			return
		}
		var ws unix.WaitStatus
		var err error
		for {
			if _, err = unix.Wait4(pid, &ws, 0, nil); !errors.Is(err, unix.EINTR) {
				break
			}
		}
		if err != nil || !ws.Exited() || ws.ExitStatus() != 0 {
			res.Stopped = fmt.Sprintf("child %d: %v (status %#x)", pid, err, uint32(ws))
			r.Outcome, r.Evidence = CheckFailed, res.Stopped
			return
		}
		res.Count++
	}
	res.Stopped = "bound"
	r.Outcome, r.Evidence = Open, fmt.Sprintf("%d processes ran and exited 0", res.Count)
}

// ---------------------------------------------------------------------------
// Memory: mem-hog (a child that the OOM killer picks) and alloc.

// Child modes of this binary, chosen by an environment variable read by the package's
// init (so /proc/self/exe is the only program a scratch box needs).
const (
	childModeEnv = "CLAUDEBOX_PROBE_CHILD"
	childArgsEnv = "CLAUDEBOX_PROBE_CHILD_ARGS"
	childMemHog  = "mem-hog"
)

// Exit codes of the mem-hog child.
const (
	memHogExitENOMEM = 3
	memHogExitError  = 4
)

func init() {
	if m := os.Getenv(childModeEnv); m != "" {
		os.Exit(runChildMode(m, os.Getenv(childArgsEnv)))
	}
}

func runChildMode(mode, args string) int {
	switch mode {
	case childMemHog:
		return memHogChild(args)
	}
	fmt.Fprintf(os.Stderr, "claudebox: unknown child mode %q\n", mode)
	return memHogExitError
}

// memHogChild: args "bound_mib,hold_ns". Progress records on fd 3: 8-byte little
// endian MiB touched so far; -1 once Bound is reached (then it holds and exits 0).
func memHogChild(args string) int {
	var bound int
	var hold int64
	if _, err := fmt.Sscanf(args, "%d,%d", &bound, &hold); err != nil || bound <= 0 || bound > MemHogMaxBound {
		fmt.Fprintf(os.Stderr, "mem-hog child: bad args %q\n", args)
		return memHogExitError
	}
	// Be the OOM killer's first choice, never the box's init.
	if err := os.WriteFile("/proc/self/oom_score_adj", []byte("1000"), 0); err != nil {
		fmt.Fprintf(os.Stderr, "mem-hog child: oom_score_adj: %v\n", err)
		return memHogExitError
	}
	out := os.NewFile(3, "progress")
	var rec [8]byte
	send := func(v int64) bool {
		binary.LittleEndian.PutUint64(rec[:], uint64(v))
		_, err := out.Write(rec[:])
		return err == nil
	}
	for mib := 0; mib < bound; {
		n := min(memHogStepMiB, bound-mib)
		if _, err := touchMiB(n); err != nil {
			fmt.Fprintf(os.Stderr, "mem-hog child: mmap after %d MiB: %v\n", mib, err)
			if errors.Is(err, unix.ENOMEM) {
				return memHogExitENOMEM
			}
			return memHogExitError
		}
		mib += n
		if !send(int64(mib)) {
			return memHogExitError // the parent is gone
		}
	}
	if !send(-1) {
		return memHogExitError
	}
	time.Sleep(time.Duration(hold))
	return 0
}

// tailBuffer keeps the last 4 KiB written to it (the child's stderr).
type tailBuffer struct {
	mu sync.Mutex
	b  []byte
}

func (t *tailBuffer) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.b = append(t.b, p...)
	if len(t.b) > 4096 {
		t.b = append(t.b[:0], t.b[len(t.b)-4096:]...)
	}
	return len(p), nil
}

func (t *tailBuffer) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return strings.TrimSpace(string(t.b))
}

// probeMemHog: a child touches memory in 4 MiB steps up to Bound, reporting each step;
// the parent only watches (a fixed 8-byte read buffer, a channel, a ticker: nothing
// that grows while the box is at its memory limit).
func probeMemHog(ctx context.Context, rs ResourceSpec, r *Result) {
	res := r.Resource
	// After the hog, this runner is the OOM killer's next choice, never the box's init: a
	// second kill while the dead hog's memory is still being freed then takes the runner,
	// which the engine runs again, instead of init, which would stop the box (measured: the
	// resource box stopped that way, and its disk and CPU steps had no box left).
	if err := os.WriteFile("/proc/self/oom_score_adj", []byte("900"), 0); err != nil {
		r.Outcome, r.Evidence = CheckFailed, "oom_score_adj: "+err.Error()
		return
	}
	pr, pw, err := os.Pipe()
	if err != nil {
		r.Outcome, r.Evidence = CheckFailed, "pipe: "+err.Error()
		return
	}
	defer pr.Close()
	// The child's Pdeathsig fires when the thread that started it ends: keep that
	// thread ours until the child is gone (a retired thread must not kill the child
	// and fake an OOM kill).
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	oom0, oomKnown := memcgOOMKills()
	var stderr tailBuffer
	cmd := exec.Command("/proc/self/exe")
	cmd.Args = []string{"claudebox-mem-hog"}
	cmd.Env = []string{childModeEnv + "=" + childMemHog,
		childArgsEnv + "=" + strconv.Itoa(res.Bound) + "," + strconv.FormatInt(int64(rs.Hold), 10)}
	cmd.ExtraFiles = []*os.File{pw}
	cmd.Stderr = &stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		pw.Close()
		r.Outcome, r.Evidence = CheckFailed, "starting the child: "+err.Error()
		return
	}
	pw.Close()

	type progress struct {
		mib int64
		eof bool
	}
	prog := make(chan progress, 16)
	quit := make(chan struct{})
	defer close(quit)
	go func() {
		var rec [8]byte
		for {
			p := progress{eof: true}
			if _, err := io.ReadFull(pr, rec[:]); err == nil {
				p = progress{mib: int64(binary.LittleEndian.Uint64(rec[:]))}
			}
			select {
			case prog <- p:
			case <-quit:
				return
			}
			if p.eof {
				return
			}
		}
	}()
	exited := make(chan error, 1)
	var killedByUs atomic.Bool
	stall := rs.stallAfter()
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	lastProgress := time.Now()
	reached, stalled, eof := false, false, false
	var waitErr error
	waiting := false
	done := ctx.Done()
	kill := func() {
		killedByUs.Store(true)
		_ = cmd.Process.Kill()
	}
loop:
	for {
		select {
		case p := <-prog:
			if p.eof {
				eof = true
				if !waiting {
					waiting = true
					go func() { exited <- cmd.Wait() }()
				}
				continue
			}
			if p.mib < 0 {
				reached = true
				res.Count = int64(res.Bound)
			} else {
				res.Count = p.mib
			}
			lastProgress = time.Now()
		case waitErr = <-exited:
			break loop
		case <-tick.C:
			if !reached && !eof && !killedByUs.Load() && time.Since(lastProgress) > stall {
				stalled = true
				kill()
			}
		case <-done:
			done = nil
			if !killedByUs.Load() {
				kill()
			}
			if !waiting {
				waiting = true
				go func() { exited <- cmd.Wait() }()
			}
		}
	}
	var ws syscall.WaitStatus
	if cmd.ProcessState != nil {
		ws, _ = cmd.ProcessState.Sys().(syscall.WaitStatus)
	}
	tail := stderr.String()
	oomNote := ""
	if oom1, ok := memcgOOMKills(); ok && oomKnown {
		oomNote = fmt.Sprintf("; the memory cgroup's oom_kill counter rose by %d", oom1-oom0)
	}
	defer func() { r.Evidence += oomNote }()
	switch {
	case reached:
		res.Stopped = "bound"
		r.Outcome = Open
		r.Evidence = fmt.Sprintf("the child touched %d MiB (the bound): nothing stopped it", res.Count)
		if killedByUs.Load() {
			r.Evidence += "; killed during the hold: " + ctx.Err().Error()
		} else if waitErr != nil {
			r.Evidence += "; then: " + waitErr.Error()
		}
	case stalled:
		res.Stopped = "stalled"
		r.Outcome = Refused
		r.Evidence = fmt.Sprintf("the child stalled at %d MiB (no progress for %v: held at the limit); killed", res.Count, stall)
	case ctx.Err() != nil && killedByUs.Load():
		res.Stopped = "timeout"
		r.Outcome, r.Evidence = CheckFailed, fmt.Sprintf("timeout after %d MiB", res.Count)
	case ws.Signaled() && ws.Signal() == syscall.SIGKILL:
		res.Stopped = "oom-killed"
		r.Outcome = Refused
		r.Evidence = fmt.Sprintf("the child was killed (SIGKILL: the OOM killer) at %d MiB", res.Count)
	case ws.Exited() && ws.ExitStatus() == memHogExitENOMEM:
		res.Stopped = "ENOMEM"
		r.Outcome = Refused
		r.Evidence = fmt.Sprintf("allocation refused at %d MiB: %s", res.Count, tail)
	default:
		res.Stopped = fmt.Sprintf("child: %v", waitErr)
		r.Outcome = CheckFailed
		r.Evidence = fmt.Sprintf("the child failed at %d MiB: %v: %s", res.Count, waitErr, tail)
	}
}

// memcgOOMKills reads the oom_kill counter of this process's memory cgroup (v1
// memory.oom_control, v2 memory.events), for the evidence only.
func memcgOOMKills() (int64, bool) {
	b, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		return 0, false
	}
	var files []string
	for _, l := range strings.Split(string(b), "\n") {
		f := strings.SplitN(l, ":", 3)
		if len(f) != 3 {
			continue
		}
		if strings.Contains(","+f[1]+",", ",memory,") {
			files = append(files, filepath.Join("/sys/fs/cgroup/memory", f[2], "memory.oom_control"), "/sys/fs/cgroup/memory/memory.oom_control")
		} else if f[0] == "0" && f[1] == "" {
			files = append(files, filepath.Join("/sys/fs/cgroup", f[2], "memory.events"))
		}
	}
	for _, name := range files {
		data, err := os.ReadFile(name)
		if err != nil {
			continue
		}
		for _, l := range strings.Split(string(data), "\n") {
			if v, ok := strings.CutPrefix(l, "oom_kill "); ok {
				if n, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64); err == nil {
					return n, true
				}
			}
		}
	}
	return 0, false
}

// touchMiB maps and touches n MiB outside the Go heap; the caller munmaps.
func touchMiB(n int) ([]byte, error) {
	b, err := unix.Mmap(-1, 0, n<<20, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return nil, err
	}
	for i := 0; i < len(b); i += 4096 {
		b[i] = byte(i>>12) | 1
	}
	return b, nil
}

// probeAlloc touches Bound MiB in this process, holds it for Hold, frees it.
func probeAlloc(ctx context.Context, rs ResourceSpec, r *Result) {
	res := r.Resource
	b, err := touchMiB(res.Bound)
	if err != nil {
		res.Stopped = err.Error()
		if errors.Is(err, unix.ENOMEM) {
			res.Stopped = "ENOMEM"
		}
		r.Outcome, r.Evidence = CheckFailed, fmt.Sprintf("mmap %d MiB: %v", res.Bound, err)
		return
	}
	res.Count = int64(res.Bound)
	_ = sleepCtx(ctx, rs.Hold)
	if err := unix.Munmap(b); err != nil {
		r.Outcome, r.Evidence = CheckFailed, "munmap: "+err.Error()
		return
	}
	res.Stopped = "bound"
	r.Outcome, r.Evidence = Open, fmt.Sprintf("touched and freed %d MiB", res.Count)
}

// ---------------------------------------------------------------------------
// Disk: disk-fill and write.

// probeDiskWrite writes 1 MiB chunks of pseudo-random data (every 4 KiB block
// distinct, so neither compression nor dedup shrinks them) to a new file, fsyncing
// every 8 MiB, until a write or fsync fails or Bound MiB are written; then removes
// the file and fsyncs its directory.
func probeDiskWrite(ctx context.Context, kind Kind, rs ResourceSpec, r *Result) {
	res := r.Resource
	path := rs.path(kind)
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		r.Outcome, r.Evidence = CheckFailed, "creating the file: "+err.Error()
		return
	}
	written, werr := fillFile(ctx, f, res.Bound)
	cerr := f.Close()
	if werr == nil {
		werr = cerr
	}
	res.Count = written
	rmErr := os.Remove(path)
	if rmErr == nil {
		rmErr = syncDir(filepath.Dir(path))
	}
	stopped := func(err error) (string, bool) {
		switch {
		case errors.Is(err, unix.EDQUOT):
			return "EDQUOT", true
		case errors.Is(err, unix.ENOSPC):
			return "ENOSPC", true
		}
		return err.Error(), false
	}
	switch {
	case rmErr != nil:
		res.Stopped = "remove: " + rmErr.Error()
		r.Outcome, r.Evidence = CheckFailed, fmt.Sprintf("wrote %d MiB to %s but could not remove it: %v", written, path, rmErr)
	case werr == nil:
		res.Stopped = "bound"
		r.Outcome, r.Evidence = Open, fmt.Sprintf("wrote and synced %d MiB (the bound) to %s; removed", written, path)
	default:
		name, limit := stopped(werr)
		res.Stopped = name
		if limit {
			r.Outcome, r.Evidence = Refused, fmt.Sprintf("refused (%s) after %d MiB at %s: %v; removed", name, written, path, werr)
		} else {
			r.Outcome, r.Evidence = CheckFailed, fmt.Sprintf("stopped after %d MiB: %v", written, werr)
		}
	}
}

func fillFile(ctx context.Context, f *os.File, bound int) (int64, error) {
	buf := make([]byte, 1<<20)
	x := uint64(time.Now().UnixNano()) | 1
	for i := 0; i < len(buf); i += 8 {
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
		binary.LittleEndian.PutUint64(buf[i:], x)
	}
	var mib int64
	for mib < int64(bound) {
		if err := ctx.Err(); err != nil {
			return mib, err
		}
		for off := 0; off < len(buf); off += 4096 {
			binary.LittleEndian.PutUint64(buf[off:], uint64(mib))
			binary.LittleEndian.PutUint64(buf[off+8:], uint64(off))
		}
		if _, err := f.Write(buf); err != nil {
			return mib, err
		}
		mib++
		if mib%diskSyncEveryMiB == 0 {
			if err := f.Sync(); err != nil {
				return mib, err
			}
		}
	}
	return mib, f.Sync()
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}

// ---------------------------------------------------------------------------
// CPU: cpu-burn and latency.

var burnSink atomic.Uint64

// probeCPUBurn runs Threads busy loops, each on its own locked OS thread, for
// Duration; CPUShare = the threads' CPU time (CLOCK_THREAD_CPUTIME_ID) / wall time.
func probeCPUBurn(ctx context.Context, rs ResourceSpec, r *Result) {
	res := r.Resource
	n, d := rs.threads(), rs.duration(KindCPUBurn)
	var wg sync.WaitGroup
	var cpu atomic.Int64
	var failed atomic.Value
	start := time.Now()
	until := start.Add(d)
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			var t0, t1 unix.Timespec
			if err := unix.ClockGettime(unix.CLOCK_THREAD_CPUTIME_ID, &t0); err != nil {
				failed.Store(err.Error())
				return
			}
			burnSink.Add(burn(ctx, until))
			if err := unix.ClockGettime(unix.CLOCK_THREAD_CPUTIME_ID, &t1); err != nil {
				failed.Store(err.Error())
				return
			}
			cpu.Add(t1.Nano() - t0.Nano())
		}()
	}
	wg.Wait()
	wall := time.Since(start)
	res.CPUNs, res.WallNs = cpu.Load(), int64(wall)
	res.Count = int64(n)
	switch {
	case failed.Load() != nil:
		r.Outcome, r.Evidence = CheckFailed, "thread CPU clock: "+failed.Load().(string)
	case ctx.Err() != nil:
		r.Outcome, r.Evidence = CheckFailed, "cut short: "+ctx.Err().Error()
	case wall <= 0 || res.CPUNs <= 0:
		r.Outcome, r.Evidence = CheckFailed, "nothing measured"
	default:
		res.CPUShare = float64(res.CPUNs) / float64(wall)
		res.Stopped = "done"
		r.Outcome = Open
		r.Evidence = fmt.Sprintf("%d threads burned %v of CPU in %v: share %.2f", n, time.Duration(res.CPUNs).Round(time.Millisecond), wall.Round(time.Millisecond), res.CPUShare)
	}
}

func burn(ctx context.Context, until time.Time) uint64 {
	x := uint64(1)
	for {
		for i := 0; i < 1<<16; i++ {
			x = x*6364136223846793005 + 1442695040888963407
		}
		if ctx.Err() != nil || !time.Now().Before(until) {
			return x
		}
	}
}

// latencyRounds is the fixed work unit: this many chained SHA-256 sums of 32 bytes,
// about 2 ms on the drill's machines (measured ~80 ns a round with SHA-NI). The drill
// compares a unit's time against a run on an idle machine, never against a constant.
const latencyRounds = 25000

func workUnit(seed [32]byte) [32]byte {
	for i := 0; i < latencyRounds; i++ {
		seed = sha256.Sum256(seed[:])
	}
	return seed
}

// probeLatency runs the work unit back to back for Duration or Units times (whichever
// ends first) on a locked thread; UnitNs is the median.
func probeLatency(ctx context.Context, rs ResourceSpec, r *Result) {
	res := r.Resource
	d, units := rs.duration(KindLatency), rs.Units
	if units == 0 {
		units = LatencyMaxUnits
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	times := make([]int64, 0, min(units, 4096))
	var seed [32]byte
	start := time.Now()
	for len(times) < units && ctx.Err() == nil && (d == 0 || time.Since(start) < d) {
		t := time.Now()
		seed = workUnit(seed)
		times = append(times, int64(time.Since(t)))
	}
	burnSink.Add(uint64(seed[0]))
	res.Units = len(times)
	res.Count = int64(len(times))
	if len(times) == 0 {
		r.Outcome, r.Evidence = CheckFailed, "no unit ran: "+fmt.Sprint(ctx.Err())
		return
	}
	sort.Slice(times, func(i, j int) bool { return times[i] < times[j] })
	res.UnitNs = times[len(times)/2]
	res.UnitP90Ns = times[len(times)*9/10]
	res.Stopped = "done"
	if ctx.Err() != nil && rs.Units > 0 && len(times) < rs.Units {
		res.Stopped = "timeout"
	}
	r.Outcome = Open
	r.Evidence = fmt.Sprintf("%d units: median %v, p90 %v", res.Units, time.Duration(res.UnitNs), time.Duration(res.UnitP90Ns))
}
