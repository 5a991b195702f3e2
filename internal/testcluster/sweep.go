package testcluster

import (
	"crypto/rand"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/claudebox/claudebox/internal/mounts"
	"github.com/claudebox/claudebox/internal/procstat"
)

// StateRoot holds one directory per run: StateRoot/<run>/{owner,nets,m1/,m2/,...}.
const StateRoot = "/var/lib/claudebox-testcluster"

// RunPrefix starts every run's name: RunPrefix + 6 characters [a-z0-9], e.g. "cbclk3x9q2".
// Network namespaces are "<run>-br" (the link) and "<run>-m<i>" (members); test instances
// should be named "<run>-..." (container cgroups are named lxc.payload.<name> host-wide).
const RunPrefix = "cbcl"

var runRe = regexp.MustCompile(`^` + RunPrefix + `[a-z0-9]{6}$`)

// procRe finds a run in a process's command line or environment (its state directory).
var procRe = regexp.MustCompile(regexp.QuoteMeta(StateRoot+"/") + `(` + RunPrefix + `[a-z0-9]{6})(/|\x00|$)`)

// cgroupRe finds a run in a process's cgroup (a container or its monitor).
var cgroupRe = regexp.MustCompile(`/lxc\.(?:payload|monitor)\.(` + RunPrefix + `[a-z0-9]{6})-`)

// newRunName returns a fresh run name.
func newRunName() string {
	const abc = "abcdefghijklmnopqrstuvwxyz0123456789"
	b := make([]byte, 6)
	if _, err := rand.Read(b); err != nil {
		panic(err)
	}
	for i := range b {
		b[i] = abc[int(b[i])%len(abc)]
	}
	return RunPrefix + string(b)
}

// runState is a run's directory: its owner file names the test process (pid and start
// time, so a reused pid is not taken for the owner) and its nets file the /24s it claimed.
type runState struct {
	name string
	dir  string
}

func (r *runState) ownerFile() string { return filepath.Join(r.dir, "owner") }
func (r *runState) netsFile() string  { return filepath.Join(r.dir, "nets") }

// createRun makes the run's directory and owner file.
func createRun(name string) (*runState, error) {
	r := &runState{name: name, dir: filepath.Join(StateRoot, name)}
	// Another run's removal may take StateRoot away when it is empty: make it again.
	for try := 0; ; try++ {
		if err := os.MkdirAll(StateRoot, 0o711); err != nil {
			return nil, err
		}
		err := os.Mkdir(r.dir, 0o711)
		if err == nil {
			break
		}
		if !errors.Is(err, fs.ErrNotExist) || try == 5 {
			return nil, err
		}
	}
	pid := os.Getpid()
	st, err := procstat.StartTime(pid)
	if err != nil {
		return nil, err
	}
	if err := os.WriteFile(r.ownerFile(), fmt.Appendf(nil, "%d %d\n", pid, st), 0o644); err != nil {
		return nil, err
	}
	return r, nil
}

// alive reports whether the run's owner process still runs. A directory without an owner
// file younger than a minute is a run being created, and counts as alive.
func (r *runState) alive() bool {
	b, err := os.ReadFile(r.ownerFile())
	if err != nil {
		if fi, serr := os.Stat(r.dir); serr == nil && time.Since(fi.ModTime()) < time.Minute {
			return true
		}
		return false
	}
	var pid int
	var start uint64
	if _, err := fmt.Sscanf(string(b), "%d %d", &pid, &start); err != nil {
		return false
	}
	return procstat.Alive(pid, start)
}

func (r *runState) nets() []*net.IPNet {
	b, err := os.ReadFile(r.netsFile())
	if err != nil {
		return nil
	}
	var out []*net.IPNet
	for _, l := range strings.Fields(string(b)) {
		if _, n, err := net.ParseCIDR(l); err == nil {
			out = append(out, n)
		}
	}
	return out
}

func (r *runState) writeNets(ns []*net.IPNet) error {
	var b strings.Builder
	for _, n := range ns {
		b.WriteString(n.String() + "\n")
	}
	tmp := r.netsFile() + ".tmp"
	if err := os.WriteFile(tmp, []byte(b.String()), 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, r.netsFile())
}

func (r *runState) addNet(n *net.IPNet) error { return r.writeNets(append(r.nets(), n)) }

func (r *runState) removeNet(n *net.IPNet) error {
	var keep []*net.IPNet
	for _, m := range r.nets() {
		if m.String() != n.String() {
			keep = append(keep, m)
		}
	}
	return r.writeNets(keep)
}

// scanProcs maps runs to the processes that belong to them: any process in one of the
// run's network namespaces, any whose command line or environment names the run's state
// directory (incusd, dnsmasq, lxc monitors, forkfile/forkproxy helpers), and any in a
// container cgroup named after the run. The calling process is never listed.
func scanProcs() map[string][]int {
	byIno := map[uint64]string{}
	for _, n := range listNetns() {
		run, _, ok := strings.Cut(n, "-")
		if !ok || !runRe.MatchString(run) {
			continue
		}
		if ino, err := netnsInode(n); err == nil {
			byIno[ino] = run
		}
	}
	out := map[string][]int{}
	ents, _ := os.ReadDir("/proc")
	self := os.Getpid()
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == self || pid == 1 {
			continue
		}
		var run string
		var st unix.Stat_t
		if unix.Stat(fmt.Sprintf("/proc/%d/ns/net", pid), &st) == nil {
			run = byIno[st.Ino]
		}
		for _, f := range []string{"cmdline", "environ"} {
			if run != "" {
				break
			}
			if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/%s", pid, f)); err == nil {
				if m := procRe.FindSubmatch(b); m != nil {
					run = string(m[1])
				}
			}
		}
		if run == "" {
			if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid)); err == nil {
				if m := cgroupRe.FindSubmatch(b); m != nil {
					run = string(m[1])
				}
			}
		}
		if run != "" {
			out[run] = append(out[run], pid)
		}
	}
	return out
}

// procDesc describes a process for logs: "pid (command line)".
func procDesc(pid int) string {
	cmd, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	c := strings.TrimSpace(strings.ReplaceAll(string(cmd), "\x00", " "))
	if len(c) > 100 {
		c = c[:100] + "..."
	}
	return fmt.Sprintf("%d (%s)", pid, c)
}

// killRun SIGKILLs every process of the run until none is left (or 20 s pass).
func killRun(run string, logf func(string, ...any)) error {
	deadline := time.Now().Add(20 * time.Second)
	seen := map[int]bool{}
	for {
		pids := scanProcs()[run]
		if len(pids) == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("processes of %s still alive after SIGKILL: %v", run, pids)
		}
		for _, p := range pids {
			if !seen[p] {
				seen[p] = true
				logf("testcluster: %s: killing %s", run, procDesc(p))
			}
			_ = syscall.Kill(p, syscall.SIGKILL)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// removeCgroups removes the container and monitor cgroups of the run's instances
// (lxc.payload.<run>-*, lxc.monitor.<run>-*) from every cgroup hierarchy, deepest first.
func removeCgroups(run string) {
	var dirs []string
	_ = filepath.WalkDir("/sys/fs/cgroup", func(p string, d fs.DirEntry, err error) error {
		if err != nil || !d.IsDir() {
			return nil
		}
		if strings.Count(strings.TrimPrefix(p, "/sys/fs/cgroup"), "/") > 4 {
			return fs.SkipDir
		}
		b := d.Name()
		if strings.HasPrefix(b, "lxc.payload."+run+"-") || strings.HasPrefix(b, "lxc.monitor."+run+"-") {
			_ = filepath.WalkDir(p, func(q string, e fs.DirEntry, err error) error {
				if err == nil && e.IsDir() {
					dirs = append(dirs, q)
				}
				return nil
			})
			return fs.SkipDir
		}
		return nil
	})
	sort.Slice(dirs, func(i, j int) bool { return len(dirs[i]) > len(dirs[j]) })
	for _, d := range dirs {
		_ = unix.Rmdir(d)
	}
}

// unmountUnder lazily unmounts every mount of this mount namespace at or under dir,
// deepest first, so removing dir never walks into a mounted file system.
func unmountUnder(dir string) {
	for _, mp := range mounts.Under(dir) {
		_ = unix.Unmount(mp, unix.MNT_DETACH)
	}
}

// removeRun removes everything of a run: its processes (killed), container cgroups,
// network namespaces, state directory and unreachable routes (those in its nets file,
// plus extra).
func removeRun(run string, extra []*net.IPNet, logf func(string, ...any)) error {
	var errs []error
	if err := killRun(run, logf); err != nil {
		errs = append(errs, err)
	}
	removeCgroups(run)
	for _, n := range listNetns() {
		if strings.HasPrefix(n, run+"-") {
			if err := ipCmd("netns", "delete", n); err != nil {
				errs = append(errs, err)
			}
		}
	}
	r := &runState{name: run, dir: filepath.Join(StateRoot, run)}
	nets := append(r.nets(), extra...)
	unmountUnder(r.dir)
	if err := os.RemoveAll(r.dir); err != nil {
		errs = append(errs, err)
	}
	_ = os.Remove(StateRoot) // only when no other run is there
	for _, n := range nets {
		if n == nil {
			continue
		}
		if err := delGuardRoute(n); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// Sweep removes what runs whose test process is gone left behind (a killed `go test`):
// their incusd, dnsmasq and container processes, network namespaces, state directories and
// unreachable routes. Runs whose owner still lives (parallel tests) are left alone. It is
// called at the start of every Up; logf (may be nil) hears what is removed.
func Sweep(logf func(format string, args ...any)) error {
	if logf == nil {
		logf = func(string, ...any) {}
	}
	runs := map[string]bool{}
	if ents, err := os.ReadDir(StateRoot); err == nil {
		for _, e := range ents {
			if runRe.MatchString(e.Name()) {
				runs[e.Name()] = true
			}
		}
	}
	for _, n := range listNetns() {
		if run, _, ok := strings.Cut(n, "-"); ok && runRe.MatchString(run) {
			runs[run] = true
		}
	}
	for run := range scanProcs() {
		runs[run] = true
	}
	liveNets := map[string]bool{}
	var errs []error
	for run := range runs {
		r := &runState{name: run, dir: filepath.Join(StateRoot, run)}
		if r.alive() {
			for _, n := range r.nets() {
				liveNets[n.String()] = true
			}
			continue
		}
		logf("testcluster: sweeping run %s left by a dead test process", run)
		if err := removeRun(run, nil, logf); err != nil {
			errs = append(errs, err)
		}
	}
	for _, n := range guardRoutes() {
		if !liveNets[n.String()] {
			logf("testcluster: removing the unreachable route for %s (no live run holds it)", n)
			if err := delGuardRoute(n); err != nil {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}

// Leftovers lists what of run is still on the machine: network namespaces, processes,
// the state directory, unreachable routes, container cgroups. Empty after a clean Down.
func Leftovers(run string) []string {
	var out []string
	for _, n := range listNetns() {
		if strings.HasPrefix(n, run+"-") {
			out = append(out, "netns "+n)
		}
	}
	for _, p := range scanProcs()[run] {
		out = append(out, "process "+procDesc(p))
	}
	if _, err := os.Lstat(filepath.Join(StateRoot, run)); err == nil {
		out = append(out, "directory "+filepath.Join(StateRoot, run))
	}
	_ = filepath.WalkDir("/sys/fs/cgroup", func(p string, d fs.DirEntry, err error) error {
		if err != nil || !d.IsDir() {
			return nil
		}
		if strings.Count(strings.TrimPrefix(p, "/sys/fs/cgroup"), "/") > 4 {
			return fs.SkipDir
		}
		if strings.Contains(d.Name(), "."+run+"-") {
			out = append(out, "cgroup "+p)
			return fs.SkipDir
		}
		return nil
	})
	return out
}

// GuardRoutes lists the unreachable routes of this package in the host namespace (every
// run's); a test compares it with the nets a run claimed.
func GuardRoutes() []string {
	var out []string
	for _, n := range guardRoutes() {
		out = append(out, n.String())
	}
	return out
}
