package boxcore

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"

	"github.com/claudebox/claudebox/boxcore/incus"
)

// Resource limits that keep the host alive: every container box gets a process limit
// (limits.processes, a finite pids.max in the kernel) and a hard CPU quota
// (limits.cpu.allowance, a CFS quota), on its own config because both are container-only in
// Incus and a VM shares the profile; every box gets a memory limit, from the profile unless
// --memory or its template asks for another. Defaults and caps are sized from the host this
// process runs on.

// Config keys of the limits.
const (
	KeyProcesses    = "limits.processes"
	KeyMemory       = "limits.memory"
	KeyCPU          = "limits.cpu"
	KeyCPUAllowance = "limits.cpu.allowance"
	KeySyscallsDeny = "security.syscalls.deny"
)

// HostSize is what the host can give: CPUs, memory, and the kernel's pid space.
type HostSize struct {
	CPUs     int
	MemTotal int64 // bytes, from /proc/meminfo
	PidMax   int64 // /proc/sys/kernel/pid_max
}

var (
	hostSizeOnce sync.Once
	hostSize     HostSize
)

// ReadHostSize reads this host's size once per process.
func ReadHostSize() HostSize {
	hostSizeOnce.Do(func() {
		hostSize = readHostSize("/proc/meminfo", "/proc/sys/kernel/pid_max", runtime.NumCPU())
	})
	return hostSize
}

// readHostSize reads the files given; what cannot be read falls back to a small host (4 GiB,
// pid_max 32768) so the limits err on the tight side.
func readHostSize(meminfo, pidMax string, cpus int) HostSize {
	h := HostSize{CPUs: max(cpus, 1), MemTotal: 4 << 30, PidMax: 32768}
	if f, err := os.Open(meminfo); err == nil {
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			fields := strings.Fields(sc.Text())
			if len(fields) >= 2 && fields[0] == "MemTotal:" {
				if kb, err := strconv.ParseInt(fields[1], 10, 64); err == nil && kb > 0 {
					h.MemTotal = kb * 1024
				}
			}
		}
		f.Close()
	}
	if b, err := os.ReadFile(pidMax); err == nil {
		if n, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64); err == nil && n > 0 {
			h.PidMax = n
		}
	}
	return h
}

// Limits are the defaults and caps sized from a host.
type Limits struct {
	Host HostSize
	// Processes is a container box's default limits.processes; ProcessesCap the most a user
	// may ask for.
	Processes, ProcessesCap int64
	// Memory is the profile's default limits.memory (bytes). MemoryBudget is what all
	// running boxes together may have (the host keeps the rest), and the most one box may ask.
	Memory, MemoryBudget int64
	// AllowanceCPUs is the hard CPU quota, in CPUs, of a container box: the default, and the
	// most any box gets (one CPU stays the host's where there are two or more).
	AllowanceCPUs int
}

// DefaultLimits are the limits sized from this host.
func DefaultLimits() Limits { return LimitsFor(ReadHostSize()) }

// LimitsFor sizes the limits for a host:
//
//   - processes: pid_max/16 in [512, 8192]; at most pid_max/4
//   - memory: MemTotal/8 in [512MiB, 4GiB]; the budget MemTotal - MemTotal/8, at least 2GiB
//   - CPU: a hard quota of CPUs-1 CPUs, at least 1
func LimitsFor(h HostSize) Limits {
	l := Limits{Host: h}
	l.Processes = clamp(h.PidMax/16, 512, 8192)
	l.ProcessesCap = max(h.PidMax/4, l.Processes)
	l.Memory = clamp(h.MemTotal/8, 512<<20, 4<<30) &^ (1<<20 - 1) // whole MiB
	l.MemoryBudget = max(h.MemTotal-h.MemTotal/8, 2<<30)
	l.AllowanceCPUs = max(h.CPUs-1, 1)
	return l
}

func clamp(v, lo, hi int64) int64 { return min(max(v, lo), hi) }

// MemoryValue is the default memory limit in Incus's syntax.
func (l Limits) MemoryValue() string { return FormatBytes(l.Memory) }

// Allowance is the hard CPU quota for a box that asks for cpus CPUs (0: no ask): at most
// AllowanceCPUs, written as Incus's "<quota>ms/<period>ms" (a CFS quota, not a share).
func (l Limits) Allowance(cpus int) string {
	n := l.AllowanceCPUs
	if cpus > 0 && cpus < n {
		n = cpus
	}
	return fmt.Sprintf("%dms/100ms", n*100)
}

// HostAllowance is a hard CPU quota of every CPU of the host: the bake's builder's, a
// build the user asked for, not a box's workload.
func (l Limits) HostAllowance() string { return fmt.Sprintf("%dms/100ms", max(l.Host.CPUs, 1)*100) }

// ContainerKeys are the container-only limits a new container box gets on its own config:
// the default process limit, and the hard CPU quota for the CPUs it asks (limits.cpu, "" for
// the profile's).
func (l Limits) ContainerKeys(cpu string) map[string]string {
	return map[string]string{
		KeyProcesses:    strconv.FormatInt(l.Processes, 10),
		KeyCPUAllowance: l.Allowance(cpuCount(cpu)),
		KeySyscallsDeny: SubvolumeDeny,
	}
}

// SubvolumeDeny is the seccomp deny list of every container box: the btrfs ioctls that create
// a subvolume or a snapshot. A subvolume a box makes inside its root gets a qgroup of its own,
// outside the box's quota (found by the attacker: 300 MiB written into one past a 64 MiB
// quota). The request is compared on its low 32 bits: the kernel reads it as 32 bits, so the
// same request with bit 32 set must be denied too. Incus appends these lines to the policy it
// generates (after its own defaults); seccomp applies at start.
const SubvolumeDeny = "ioctl errno 1 [1,1342215182,SCMP_CMP_MASKED_EQ,4294967295]\n" + // BTRFS_IOC_SUBVOL_CREATE
	"ioctl errno 1 [1,1342215192,SCMP_CMP_MASKED_EQ,4294967295]\n" + // BTRFS_IOC_SUBVOL_CREATE_V2
	"ioctl errno 1 [1,1342215169,SCMP_CMP_MASKED_EQ,4294967295]\n" + // BTRFS_IOC_SNAP_CREATE
	"ioctl errno 1 [1,1342215191,SCMP_CMP_MASKED_EQ,4294967295]\n" // BTRFS_IOC_SNAP_CREATE_V2

// cpuCount is how many CPUs a limits.cpu value names: a count, or the CPUs of a set; 0 for
// "" or what does not parse.
func cpuCount(v string) int {
	if v == "" {
		return 0
	}
	if n, err := strconv.Atoi(v); err == nil {
		return n
	}
	ids, ok := cpuSet(v)
	if !ok {
		return 0
	}
	return len(ids)
}

func cpuSet(v string) ([]int, bool) {
	if !cpuSetRE.MatchString(v) {
		return nil, false
	}
	seen := map[int]bool{}
	var ids []int
	for _, part := range strings.Split(v, ",") {
		lo, hi, isRange := strings.Cut(part, "-")
		a, _ := strconv.Atoi(lo)
		b := a
		if isRange {
			b, _ = strconv.Atoi(hi)
		}
		if a > b {
			return nil, false
		}
		for i := a; i <= b && i < 1<<16; i++ {
			if !seen[i] {
				seen[i] = true
				ids = append(ids, i)
			}
		}
	}
	return ids, true
}

// ValidateLimits checks the limits `new` asks for against the host's caps, before anything is
// made: --processes (containers only) at most ProcessesCap, --memory at most the budget,
// --cpu at most the host's CPUs. processes 0 means the default.
func (l Limits) ValidateLimits(cpu, memory string, processes int64, vm bool) error {
	switch {
	case processes < 0:
		return Usagef("new: --processes %d: want a number of processes, 1 or more (e.g. --processes 1024)", processes)
	case processes > 0 && vm:
		return Usagef("new: --processes limits a container's processes (limits.processes); a VM has its own kernel and Incus has no such limit for it: drop --processes, or pass --container")
	case processes > l.ProcessesCap:
		return Usagef("new: --processes %d is above what this host allows one box (%d, a quarter of kernel.pid_max %d)", processes, l.ProcessesCap, l.Host.PidMax)
	}
	if memory != "" {
		b, ok := ParseMemory(memory, l.Host.MemTotal)
		if !ok {
			return Usagef("new: --memory %q: want a size above zero with a unit, e.g. --memory 4GiB or 512MiB, or a share of the host's, e.g. 50%%", memory)
		}
		if b > l.MemoryBudget {
			return Usagef("new: --memory %s is above what this host can give its boxes (%s of %s; the host keeps the rest)", memory, FormatBytes(l.MemoryBudget), FormatBytes(l.Host.MemTotal))
		}
	}
	if cpu != "" {
		if n, err := strconv.Atoi(cpu); err == nil {
			if n > l.Host.CPUs {
				return Usagef("new: --cpu %s is more CPUs than this host has (%d)", cpu, l.Host.CPUs)
			}
		} else if ids, ok := cpuSet(cpu); ok {
			for _, id := range ids {
				if id >= l.Host.CPUs {
					return Usagef("new: --cpu %s names CPU %d; this host has CPUs 0-%d", cpu, id, l.Host.CPUs-1)
				}
			}
		}
	}
	return nil
}

// ClampTemplate clamps a template's resources to what this host can give: memory to the
// budget, CPUs to the host's.
func (l Limits) ClampTemplate(cpus int, memory string) (int, string) {
	if cpus > l.Host.CPUs {
		cpus = l.Host.CPUs
	}
	if b, ok := ParseMemory(memory, l.Host.MemTotal); ok && b > l.MemoryBudget {
		memory = FormatBytes(l.MemoryBudget &^ (1<<20 - 1))
	}
	return cpus, memory
}

var memRE = regexp.MustCompile(`^([0-9]+(?:\.[0-9]+)?)(B|kB|MB|GB|TB|PB|EB|KiB|MiB|GiB|TiB|PiB|EiB)?$`)

var memUnits = map[string]float64{
	"": 1, "B": 1,
	"kB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "PB": 1e15, "EB": 1e18,
	"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40, "PiB": 1 << 50, "EiB": 1 << 60,
}

// ParseMemory reads a limits.memory value (a size, or a percentage of memTotal) as bytes.
func ParseMemory(v string, memTotal int64) (int64, bool) {
	v = strings.TrimSpace(v)
	if m := percentRE.FindStringSubmatch(v); m != nil {
		p, _ := strconv.Atoi(m[1])
		if p <= 0 || p > 100 {
			return 0, false
		}
		return memTotal / 100 * int64(p), true
	}
	m := memRE.FindStringSubmatch(v)
	if m == nil {
		return 0, false
	}
	f, err := strconv.ParseFloat(m[1], 64)
	if err != nil || f <= 0 {
		return 0, false
	}
	b := f * memUnits[m[2]]
	if b >= 1<<62 {
		return 0, false
	}
	return int64(b), true
}

// FormatBytes writes a size in Incus's syntax, in the largest binary unit that is exact.
func FormatBytes(b int64) string {
	for _, u := range []struct {
		name  string
		shift uint
	}{{"GiB", 30}, {"MiB", 20}, {"KiB", 10}} {
		if b > 0 && b%(1<<u.shift) == 0 {
			return strconv.FormatInt(b>>u.shift, 10) + u.name
		}
	}
	return strconv.FormatInt(b, 10) + "B"
}

var allowanceRE = regexp.MustCompile(`^([0-9]+)ms/([0-9]+)ms$`)

// ParseAllowance reads a hard limits.cpu.allowance ("<quota>ms/<period>ms") as CPUs; ok is
// false for a soft share ("50%"), an empty value or anything else.
func ParseAllowance(v string) (cpus float64, ok bool) {
	m := allowanceRE.FindStringSubmatch(strings.TrimSpace(v))
	if m == nil {
		return 0, false
	}
	q, _ := strconv.ParseFloat(m[1], 64)
	p, _ := strconv.ParseFloat(m[2], 64)
	if q <= 0 || p <= 0 {
		return 0, false
	}
	return q / p, true
}

// limitWithinCaps says whether a limits.* key claudebox sets has a value no looser than
// claudebox sets: a process limit at most the cap, a hard CPU quota of at most AllowanceCPUs,
// a memory limit within the budget (or none of its own: the profile's holds). ok is false for
// other keys.
func (l Limits) limitWithinCaps(k, v string) (within, ok bool) {
	switch k {
	case KeyProcesses:
		n, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
		return err == nil && n >= 1 && n <= l.ProcessesCap, true
	case KeyCPUAllowance:
		c, hard := ParseAllowance(v)
		return hard && c <= float64(l.AllowanceCPUs)+1e-9, true
	case KeyMemory:
		if v == "" {
			return true, true // unset on a box: the profile's limit holds
		}
		b, parsed := ParseMemory(v, l.Host.MemTotal)
		return parsed && b <= l.MemoryBudget, true
	case KeySyscallsDeny:
		return v == SubvolumeDeny, true // claudebox's list exactly: a shorter one lets a subvolume out
	}
	return false, false
}

// BoxLimits are a box's effective limits (its own config over its profiles'), as info and
// list show them. A key that is absent is "".
type BoxLimits struct {
	Processes    string   `json:"processes" yaml:"processes"`
	Memory       string   `json:"memory" yaml:"memory"`
	CPU          string   `json:"cpu" yaml:"cpu"`
	CPUAllowance string   `json:"cpu_allowance" yaml:"cpu_allowance"`
	Missing      []string `json:"missing" yaml:"missing"`
}

// LimitsOf reads an instance's effective limits: its expanded config when the daemon sent
// one, else its own config.
func LimitsOf(in incus.Instance) BoxLimits {
	eff := in.ExpandedConfig
	if len(eff) == 0 {
		eff = in.Config
	}
	return BoxLimits{
		Processes: eff[KeyProcesses], Memory: eff[KeyMemory], CPU: eff[KeyCPU], CPUAllowance: eff[KeyCPUAllowance],
		Missing: MissingLimits(in.Type, eff),
	}
}

// MissingLimits names the limits an instance's effective config lacks: a process limit and a
// hard CPU quota (containers only; a soft "50%" share is no limit), and a memory limit.
// Empty means the box is limited as claudebox limits it.
func MissingLimits(typ string, eff map[string]string) []string {
	missing := []string{}
	if typ != "virtual-machine" {
		if n, err := strconv.ParseInt(eff[KeyProcesses], 10, 64); err != nil || n < 1 {
			missing = append(missing, KeyProcesses)
		}
	}
	if _, ok := ParseMemory(eff[KeyMemory], 1); !ok {
		missing = append(missing, KeyMemory)
	}
	if typ != "virtual-machine" {
		if _, hard := ParseAllowance(eff[KeyCPUAllowance]); !hard {
			missing = append(missing, KeyCPUAllowance+" (a hard quota)")
		}
		if eff[KeySyscallsDeny] != SubvolumeDeny {
			missing = append(missing, KeySyscallsDeny+" (the btrfs subvolume ioctls)")
		}
	}
	return missing
}

// MemoryBudgetWarning says, when it is so, that a box's memory limit plus the limits of the
// other running boxes exceeds the host's budget; "" otherwise. limit is the box's own
// limits.memory value ("" for the profile's default). One instance list.
func (bs *Boxes) MemoryBudgetWarning(ctx context.Context, name, limit string) string {
	if bs.Client.Remote() != "local" {
		return "" // the host size read here is not that daemon's
	}
	l := DefaultLimits()
	if limit == "" {
		limit = l.MemoryValue()
	}
	mine, ok := ParseMemory(limit, l.Host.MemTotal)
	if !ok {
		return ""
	}
	insts, err := bs.Client.Instances(ctx, map[string]string{TagKey: "1"}, false)
	if err != nil {
		return ""
	}
	var others int64
	var unlimited []string
	n := 0
	for _, in := range insts {
		if in.Name == name || in.Status == "Stopped" || !IsBox(in) {
			continue
		}
		v := LimitsOf(in).Memory
		b, ok := ParseMemory(v, l.Host.MemTotal)
		if !ok {
			b = l.Host.MemTotal // an unlimited box may take it all
			unlimited = append(unlimited, in.Name)
		}
		others += b
		n++
	}
	if others+mine <= l.MemoryBudget {
		return ""
	}
	un := ""
	if len(unlimited) > 0 {
		un = fmt.Sprintf(", of which %d without a memory limit (%s) count as all of the host's", len(unlimited), strings.Join(unlimited, ", "))
	}
	return fmt.Sprintf("warning: %s's memory limit (%s) plus the limits of the %d running boxes (%s%s) is more than this host can give its boxes (%s of %s): under load the host may swap or kill processes; stop a box or pass a smaller --memory",
		name, FormatBytes(mine), n, FormatBytes(others), un, FormatBytes(l.MemoryBudget), FormatBytes(l.Host.MemTotal))
}

// KernelLimits are a running container's limits as the kernel holds them (its cgroup
// lxc.payload.<name>), cgroup v1 or v2.
type KernelLimits struct {
	CgroupV2    bool
	PidsMax     int64 // -1: max (no limit)
	PidsCurrent int64
	MemoryMax   int64 // bytes; -1: unlimited
	MemoryUsage int64
	CPUQuotaUs  int64 // -1: no quota
	CPUPeriodUs int64
	Paths       []string // the files read
}

// Unlimited names what the kernel does not limit: "pids.max", "memory", "cpu quota".
func (k KernelLimits) Unlimited() []string {
	var out []string
	if k.PidsMax < 0 {
		out = append(out, "pids.max=max")
	}
	if k.MemoryMax < 0 {
		out = append(out, "memory unlimited")
	}
	if k.CPUQuotaUs < 0 {
		out = append(out, "no CPU quota")
	}
	return out
}

// ReadKernelLimits reads a running container instance's limits from the host's cgroup files.
// An instance that is not running (or a VM) has no such cgroup: the error wraps
// os.ErrNotExist.
func ReadKernelLimits(instance string) (KernelLimits, error) {
	return readKernelLimits("/sys/fs/cgroup", instance)
}

// memoryUnlimited: cgroup v1 reports "no limit" as a page-rounded huge number.
const memoryUnlimited = int64(1) << 60

func readKernelLimits(root, instance string) (KernelLimits, error) {
	cg := "lxc.payload." + instance
	var k KernelLimits
	var err error
	read := func(path string, parse func(string) (int64, int64, error), a, b *int64) {
		if err != nil {
			return
		}
		raw, rerr := os.ReadFile(path)
		if rerr != nil {
			err = fmt.Errorf("reading the cgroup of %s: %w", instance, rerr)
			return
		}
		k.Paths = append(k.Paths, path)
		x, y, perr := parse(strings.TrimSpace(string(raw)))
		if perr != nil {
			err = fmt.Errorf("%s: %w", path, perr)
			return
		}
		*a = x
		if b != nil {
			*b = y
		}
	}
	one := func(s string) (int64, int64, error) { v, e := parseMaxInt(s); return v, 0, e }
	if _, serr := os.Stat(filepath.Join(root, "cgroup.controllers")); serr == nil {
		k.CgroupV2 = true
		dir := filepath.Join(root, cg)
		if _, serr := os.Stat(dir); serr != nil {
			return k, fmt.Errorf("no cgroup for %s (not running?): %w", instance, serr)
		}
		read(filepath.Join(dir, "pids.max"), one, &k.PidsMax, nil)
		read(filepath.Join(dir, "pids.current"), one, &k.PidsCurrent, nil)
		read(filepath.Join(dir, "memory.max"), one, &k.MemoryMax, nil)
		read(filepath.Join(dir, "memory.current"), one, &k.MemoryUsage, nil)
		read(filepath.Join(dir, "cpu.max"), parseCPUMax, &k.CPUQuotaUs, &k.CPUPeriodUs)
		return k, err
	}
	cpuDir := filepath.Join(root, "cpu", cg)
	if _, serr := os.Stat(cpuDir); serr != nil {
		if alt := filepath.Join(root, "cpu,cpuacct", cg); dirExists(alt) {
			cpuDir = alt
		}
	}
	pidsDir := filepath.Join(root, "pids", cg)
	if _, serr := os.Stat(pidsDir); serr != nil {
		return k, fmt.Errorf("no cgroup for %s (not running?): %w", instance, serr)
	}
	read(filepath.Join(pidsDir, "pids.max"), one, &k.PidsMax, nil)
	read(filepath.Join(pidsDir, "pids.current"), one, &k.PidsCurrent, nil)
	memDir := filepath.Join(root, "memory", cg)
	read(filepath.Join(memDir, "memory.limit_in_bytes"), one, &k.MemoryMax, nil)
	read(filepath.Join(memDir, "memory.usage_in_bytes"), one, &k.MemoryUsage, nil)
	read(filepath.Join(cpuDir, "cpu.cfs_quota_us"), one, &k.CPUQuotaUs, nil)
	read(filepath.Join(cpuDir, "cpu.cfs_period_us"), one, &k.CPUPeriodUs, nil)
	if k.MemoryMax >= memoryUnlimited {
		k.MemoryMax = -1
	}
	if k.CPUQuotaUs < 0 {
		k.CPUQuotaUs = -1
	}
	return k, err
}

func dirExists(p string) bool {
	st, err := os.Stat(p)
	return err == nil && st.IsDir()
}

// parseMaxInt reads a cgroup integer, "max" as -1.
func parseMaxInt(s string) (int64, error) {
	if s == "max" {
		return -1, nil
	}
	return strconv.ParseInt(s, 10, 64)
}

// parseCPUMax reads cgroup v2's cpu.max: "<quota|max> <period>".
func parseCPUMax(s string) (int64, int64, error) {
	q, p, ok := strings.Cut(s, " ")
	if !ok {
		return 0, 0, errors.New("cpu.max: want QUOTA PERIOD, got " + strconv.Quote(s))
	}
	quota, err := parseMaxInt(q)
	if err != nil {
		return 0, 0, err
	}
	period, err := strconv.ParseInt(strings.TrimSpace(p), 10, 64)
	return quota, period, err
}

// capOf says what claudebox allows for a limit key, for the boundary's explanations.
func (l Limits) capOf(k string) string {
	switch k {
	case KeyProcesses:
		return fmt.Sprintf("a process limit of 1 to %d", l.ProcessesCap)
	case KeyCPUAllowance:
		return fmt.Sprintf("a hard CPU quota of at most %s", l.Allowance(0))
	case KeyMemory:
		return "a memory limit of at most " + FormatBytes(l.MemoryBudget)
	case KeySyscallsDeny:
		return "exactly claudebox's deny list (the btrfs subvolume ioctls)"
	}
	return ""
}

// checkLimits: every box on the stack has a process limit, a memory limit and a hard CPU
// quota in its effective config (one row per box), and, for a running container box on this
// host, the kernel holds them (a finite pids.max, memory limit and CFS quota).
func (h *Host) checkLimits(ctx context.Context, c *checker) error {
	insts, err := h.Client.Instances(ctx, map[string]string{TagKey: "1"}, false)
	if err != nil {
		return err
	}
	local, err := localMember(ctx, h.Client)
	if err != nil {
		return err
	}
	n := 0
	for _, in := range insts {
		if !IsBox(in) || !slices.Contains(in.Profiles, h.Stack.Profile) {
			continue
		}
		n++
		got := "limited"
		if miss := LimitsOf(in).Missing; len(miss) > 0 {
			got = "missing: " + strings.Join(miss, ", ") + limitsFix(in, miss)
		}
		c.add("limits", in.Name, "limited", got)
		if v, own := in.Config[KeyGuestAPI]; own && v != "false" {
			c.add("guest api", in.Name, "off (the profile's)", "the box's own "+KeyGuestAPI+"="+v+" (claudebox incus "+in.Name+" -- config unset {} "+KeyGuestAPI+")")
		}
		if in.Type != "container" || in.Status != "Running" || h.Client.Remote() != "local" || !onMember(in, local) {
			continue // its cgroup is another kernel's
		}
		k, err := ReadKernelLimits(in.Name)
		switch {
		case errors.Is(err, os.ErrNotExist):
			// Stopped in between, or a daemon that runs containers without cgroups (one
			// started where /sys/fs/cgroup is hidden limits nothing, and says nothing).
			if st, serr := h.Client.InstanceState(ctx, in.Name); serr == nil && st.Status == "Running" {
				c.add("limits (kernel)", in.Name, "limited", "no cgroup lxc.payload."+in.Name+": the kernel limits nothing")
			}
		case err != nil:
			c.add("limits (kernel)", in.Name, "limited", "unreadable: "+err.Error())
		case len(k.Unlimited()) > 0:
			c.add("limits (kernel)", in.Name, "limited", strings.Join(k.Unlimited(), ", "))
		default:
			c.add("limits (kernel)", in.Name, "limited", "limited")
		}
	}
	if n == 0 {
		c.note("limits", h.Stack.Profile, "no boxes")
	}
	return nil
}

// limitsFix says how to put back what a box lacks: the box's own keys through the hatch, the
// memory limit through host init (the profile's).
func limitsFix(in incus.Instance, missing []string) string {
	l := DefaultLimits()
	var sets []string
	for _, m := range missing {
		switch {
		case m == KeyProcesses:
			sets = append(sets, KeyProcesses+"="+strconv.FormatInt(l.Processes, 10))
		case strings.HasPrefix(m, KeyCPUAllowance):
			sets = append(sets, KeyCPUAllowance+"="+l.Allowance(cpuCount(LimitsOf(in).CPU)))
		case strings.HasPrefix(m, KeySyscallsDeny):
			return " (recreate the box, or clone it: new --from; the deny list applies at start)"
		}
	}
	if len(sets) == 0 {
		return " (the profile's: claudebox host init)"
	}
	return " (claudebox incus " + in.Name + " -- config set {} " + strings.Join(sets, " ") + ")"
}

// applyContainerKeys puts the container-only limits on a new container box's own config (a
// VM gets none: they are no VM keys, and the profile a VM shares carries none). A clone keeps
// its source's values (the boundary let only values within the caps through) and gets what
// its source lacks; processes > 0 is --processes.
func (l Limits) applyContainerKeys(typ string, cfg map[string]string, processes int64) {
	if typ != "container" {
		return
	}
	for k, v := range l.ContainerKeys(cfg[KeyCPU]) {
		if cfg[k] == "" {
			cfg[k] = v
		}
	}
	if processes > 0 {
		cfg[KeyProcesses] = strconv.FormatInt(processes, 10)
	}
}
