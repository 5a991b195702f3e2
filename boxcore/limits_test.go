package boxcore

import (
	"errors"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

func TestLimitsSizing(t *testing.T) {
	for _, tc := range []struct {
		name                string
		h                   HostSize
		procs, procsCap     int64
		mem, budget         int64
		allowance, memValue string
	}{
		// This machine: 2 cores, 24683664 kB, pid_max 32768.
		{"here", HostSize{CPUs: 2, MemTotal: 24683664 << 10, PidMax: 32768}, 2048, 8192, 3013 << 20, 24683664<<10 - 24683664<<10/8, "100ms/100ms", "3013MiB"},
		{"tiny", HostSize{CPUs: 1, MemTotal: 1 << 30, PidMax: 4096}, 512, 1024, 512 << 20, 2 << 30, "100ms/100ms", "512MiB"},
		{"big", HostSize{CPUs: 64, MemTotal: 512 << 30, PidMax: 4194304}, 8192, 1048576, 4 << 30, 448 << 30, "6300ms/100ms", "4GiB"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := LimitsFor(tc.h)
			if l.Processes != tc.procs || l.ProcessesCap != tc.procsCap {
				t.Errorf("processes %d cap %d, want %d cap %d", l.Processes, l.ProcessesCap, tc.procs, tc.procsCap)
			}
			if l.Memory != tc.mem || l.MemoryBudget != tc.budget || l.MemoryValue() != tc.memValue {
				t.Errorf("memory %d (%s) budget %d, want %d (%s) budget %d", l.Memory, l.MemoryValue(), l.MemoryBudget, tc.mem, tc.memValue, tc.budget)
			}
			if got := l.Allowance(0); got != tc.allowance {
				t.Errorf("allowance %s, want %s", got, tc.allowance)
			}
		})
	}
	l := LimitsFor(HostSize{CPUs: 8, MemTotal: 16 << 30, PidMax: 32768})
	if got := l.Allowance(2); got != "200ms/100ms" {
		t.Errorf("allowance for 2 CPUs on 8: %s", got)
	}
	if got := l.Allowance(8); got != "700ms/100ms" {
		t.Errorf("allowance for 8 CPUs on 8 (one stays the host's): %s", got)
	}
	if got := l.ContainerKeys("0,2-3"); got[KeyCPUAllowance] != "300ms/100ms" || got[KeyProcesses] != "2048" {
		t.Errorf("container keys for a set of 3: %v", got)
	}
}

func TestReadHostSize(t *testing.T) {
	dir := t.TempDir()
	mi, pm := filepath.Join(dir, "meminfo"), filepath.Join(dir, "pid_max")
	os.WriteFile(mi, []byte("MemFree:  100 kB\nMemTotal:       24683664 kB\nSwapTotal: 0 kB\n"), 0o644)
	os.WriteFile(pm, []byte("4194304\n"), 0o644)
	h := readHostSize(mi, pm, 3)
	if h.CPUs != 3 || h.MemTotal != 24683664*1024 || h.PidMax != 4194304 {
		t.Fatalf("%+v", h)
	}
	h = readHostSize(filepath.Join(dir, "none"), filepath.Join(dir, "none"), 0)
	if h.CPUs != 1 || h.MemTotal != 4<<30 || h.PidMax != 32768 {
		t.Fatalf("fallback %+v", h)
	}
	real := ReadHostSize()
	if real.CPUs < 1 || real.MemTotal < 1<<20 || real.PidMax < 300 {
		t.Fatalf("this host: %+v", real)
	}
}

func TestValidateLimits(t *testing.T) {
	l := LimitsFor(HostSize{CPUs: 2, MemTotal: 24 << 30, PidMax: 32768})
	ok := []struct {
		cpu, mem string
		procs    int64
		vm       bool
	}{{"", "", 0, false}, {"2", "4GiB", 300, false}, {"0-1", "21GiB", 8192, false}, {"1", "50%", 0, true}, {"", "512MiB", 1, false}}
	for _, c := range ok {
		if err := l.ValidateLimits(c.cpu, c.mem, c.procs, c.vm); err != nil {
			t.Errorf("%+v: %v", c, err)
		}
	}
	bad := []struct {
		cpu, mem string
		procs    int64
		vm       bool
		want     string
	}{
		{"", "", 8193, false, "above what this host allows"},
		{"", "", -1, false, "1 or more"},
		{"", "", 100, true, "VM"},
		{"", "22GiB", 0, false, "above what this host can give"},
		{"", "100%", 0, false, "above what this host can give"},
		{"", "lots", 0, false, "want a size"},
		{"3", "", 0, false, "more CPUs than this host has"},
		{"1-2", "", 0, false, "names CPU 2"},
	}
	for _, c := range bad {
		err := l.ValidateLimits(c.cpu, c.mem, c.procs, c.vm)
		var ue *UsageError
		if !errors.As(err, &ue) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v: %v, want a usage error with %q", c, err, c.want)
		}
	}
}

func TestClampTemplate(t *testing.T) {
	small := LimitsFor(HostSize{CPUs: 1, MemTotal: 2 << 30, PidMax: 32768}) // budget: 2GiB
	if cpus, mem := small.ClampTemplate(2, "4GiB"); cpus != 1 || mem != "2GiB" {
		t.Errorf("small host: %d %s", cpus, mem)
	}
	big := LimitsFor(HostSize{CPUs: 8, MemTotal: 64 << 30, PidMax: 32768})
	if cpus, mem := big.ClampTemplate(2, "4GiB"); cpus != 2 || mem != "4GiB" {
		t.Errorf("big host: %d %s", cpus, mem)
	}
}

func TestParseMemoryAndAllowance(t *testing.T) {
	for v, want := range map[string]int64{"4GiB": 4 << 30, "512MiB": 512 << 20, "1GB": 1e9, "1073741824": 1 << 30, "50%": 50 << 20, "1.5GiB": 3 << 29} {
		if got, ok := ParseMemory(v, 100<<20); !ok || got != want {
			t.Errorf("ParseMemory(%q) = %d %v, want %d", v, got, ok, want)
		}
	}
	for _, v := range []string{"", "0", "-1GiB", "4 GiB", "101%", "0%", "4gib", "max"} {
		if _, ok := ParseMemory(v, 100<<20); ok {
			t.Errorf("ParseMemory(%q) accepted", v)
		}
	}
	if c, ok := ParseAllowance("150ms/100ms"); !ok || c != 1.5 {
		t.Errorf("150ms/100ms: %v %v", c, ok)
	}
	for _, v := range []string{"", "50%", "100%", "0ms/100ms", "100ms", "100ms/0ms"} {
		if _, ok := ParseAllowance(v); ok {
			t.Errorf("ParseAllowance(%q) accepted as a hard quota", v)
		}
	}
	for b, want := range map[int64]string{4 << 30: "4GiB", 3013 << 20: "3013MiB", 3072: "3KiB", 1536: "1536B", 1000: "1000B"} {
		if got := FormatBytes(b); got != want {
			t.Errorf("FormatBytes(%d) = %s, want %s", b, got, want)
		}
	}
}

func TestMissingLimits(t *testing.T) {
	full := map[string]string{KeyProcesses: "2048", KeyMemory: "3GiB", KeyCPUAllowance: "100ms/100ms", KeySyscallsDeny: SubvolumeDeny}
	if m := MissingLimits("container", full); len(m) != 0 {
		t.Errorf("full: %v", m)
	}
	if m := MissingLimits("virtual-machine", map[string]string{KeyMemory: "3GiB"}); len(m) != 0 {
		t.Errorf("a VM needs memory only: %v", m)
	}
	soft := map[string]string{KeyProcesses: "2048", KeyMemory: "3GiB", KeyCPUAllowance: "50%", KeySyscallsDeny: SubvolumeDeny}
	if m := MissingLimits("container", soft); !slices.Equal(m, []string{KeyCPUAllowance + " (a hard quota)"}) {
		t.Errorf("a soft share is no quota: %v", m)
	}
	if m := MissingLimits("container", map[string]string{}); len(m) != 4 {
		t.Errorf("nothing: %v", m)
	}
	// A shorter deny list lets a subvolume out: only claudebox's exact list counts.
	short := maps.Clone(full)
	short[KeySyscallsDeny] = SubvolumeDeny[:strings.Index(SubvolumeDeny, "\n")+1]
	if m := MissingLimits("container", short); len(m) != 1 {
		t.Errorf("one ioctl denied of four: %v", m)
	}
	if within, ok := DefaultLimits().limitWithinCaps(KeySyscallsDeny, short[KeySyscallsDeny]); !ok || within {
		t.Errorf("the boundary takes a shorter deny list (within %v, ok %v)", within, ok)
	}
}

// The boundary takes claudebox's limit keys only within the caps.
func TestLimitsBoundary(t *testing.T) {
	l := DefaultLimits()
	within := map[string]string{
		KeyProcesses: "300", KeyCPUAllowance: l.Allowance(0), KeyMemory: "512MiB",
	}
	for k, v := range within {
		if !OwnConfig(k, v) {
			t.Errorf("%s=%s refused", k, v)
		}
	}
	looser := [][2]string{
		{KeyProcesses, ""}, {KeyProcesses, "999999999"}, {KeyProcesses, "0"}, {KeyCPUAllowance, "50%"},
		{KeyCPUAllowance, allowanceOf(l.AllowanceCPUs + 1)}, {KeyMemory, FormatBytes(l.MemoryBudget + 1<<30)}, {KeyMemory, "100%"},
	}
	for _, kv := range looser {
		k, v := kv[0], kv[1]
		if OwnConfig(k, v) {
			t.Errorf("%s=%q accepted", k, v)
		}
		off := OffBoundary(map[string]string{k: v}, nil, NamedStack("x"))
		if len(off) != 1 || !strings.Contains(off[0], "looser than claudebox sets") {
			t.Errorf("%s=%q: %v", k, v, off)
		}
	}
	if r := ClassifyHatch([]string{"config", "set", "{}", "limits.processes=999999999"}); len(r) != 1 || !strings.Contains(r[0], "looser") {
		t.Errorf("hatch: %v", r)
	}
	if r := ClassifyHatch([]string{"config", "set", "{}", "limits.processes=300"}); len(r) != 0 {
		t.Errorf("hatch within the cap: %v", r)
	}
}

// allowanceOf writes n CPUs as a hard allowance.
func allowanceOf(n int) string { return LimitsFor(HostSize{CPUs: n + 1}).Allowance(n) }

func TestReadKernelLimits(t *testing.T) {
	write := func(t *testing.T, root string, files map[string]string) {
		for p, v := range files {
			p = filepath.Join(root, p)
			if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(p, []byte(v+"\n"), 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
	t.Run("v1", func(t *testing.T) {
		root := t.TempDir()
		write(t, root, map[string]string{
			"pids/lxc.payload.b/pids.max": "2048", "pids/lxc.payload.b/pids.current": "7",
			"memory/lxc.payload.b/memory.limit_in_bytes": "3159359488", "memory/lxc.payload.b/memory.usage_in_bytes": "17846272",
			"cpu/lxc.payload.b/cpu.cfs_quota_us": "100000", "cpu/lxc.payload.b/cpu.cfs_period_us": "100000",
			"pids/lxc.payload.u/pids.max": "max", "pids/lxc.payload.u/pids.current": "3",
			"memory/lxc.payload.u/memory.limit_in_bytes": "9223372036854771712", "memory/lxc.payload.u/memory.usage_in_bytes": "1",
			"cpu,cpuacct/lxc.payload.u/cpu.cfs_quota_us": "-1", "cpu,cpuacct/lxc.payload.u/cpu.cfs_period_us": "100000",
		})
		k, err := readKernelLimits(root, "b")
		if err != nil {
			t.Fatal(err)
		}
		if k.CgroupV2 || k.PidsMax != 2048 || k.PidsCurrent != 7 || k.MemoryMax != 3159359488 || k.MemoryUsage != 17846272 || k.CPUQuotaUs != 100000 || k.CPUPeriodUs != 100000 || len(k.Paths) != 6 || len(k.Unlimited()) != 0 {
			t.Errorf("limited: %+v", k)
		}
		k, err = readKernelLimits(root, "u")
		if err != nil {
			t.Fatal(err)
		}
		if k.PidsMax != -1 || k.MemoryMax != -1 || k.CPUQuotaUs != -1 || len(k.Unlimited()) != 3 {
			t.Errorf("unlimited: %+v %v", k, k.Unlimited())
		}
		if _, err := readKernelLimits(root, "gone"); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("no cgroup: %v", err)
		}
	})
	t.Run("v2", func(t *testing.T) {
		root := t.TempDir()
		write(t, root, map[string]string{
			"cgroup.controllers":           "cpu memory pids",
			"lxc.payload.b/pids.max":       "300",
			"lxc.payload.b/pids.current":   "4",
			"lxc.payload.b/memory.max":     "536870912",
			"lxc.payload.b/memory.current": "1000",
			"lxc.payload.b/cpu.max":        "100000 100000",
			"lxc.payload.u/pids.max":       "max",
			"lxc.payload.u/pids.current":   "4",
			"lxc.payload.u/memory.max":     "max",
			"lxc.payload.u/memory.current": "1000",
			"lxc.payload.u/cpu.max":        "max 100000",
		})
		k, err := readKernelLimits(root, "b")
		if err != nil {
			t.Fatal(err)
		}
		if !k.CgroupV2 || k.PidsMax != 300 || k.PidsCurrent != 4 || k.MemoryMax != 536870912 || k.MemoryUsage != 1000 || k.CPUQuotaUs != 100000 || k.CPUPeriodUs != 100000 || len(k.Unlimited()) != 0 {
			t.Errorf("limited: %+v", k)
		}
		k, err = readKernelLimits(root, "u")
		if err != nil {
			t.Fatal(err)
		}
		if k.PidsMax != -1 || k.MemoryMax != -1 || k.CPUQuotaUs != -1 || k.CPUPeriodUs != 100000 {
			t.Errorf("unlimited: %+v", k)
		}
		if _, err := readKernelLimits(root, "gone"); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("no cgroup: %v", err)
		}
	})
}

func TestApplyContainerKeys(t *testing.T) {
	l := LimitsFor(HostSize{CPUs: 4, MemTotal: 16 << 30, PidMax: 32768})
	vm := map[string]string{KeyCPU: "2"}
	l.applyContainerKeys("virtual-machine", vm, 0)
	if len(vm) != 1 {
		t.Errorf("a VM got container keys: %v", vm)
	}
	fresh := map[string]string{KeyCPU: "2"}
	l.applyContainerKeys("container", fresh, 0)
	if fresh[KeyProcesses] != "2048" || fresh[KeyCPUAllowance] != "200ms/100ms" {
		t.Errorf("fresh container: %v", fresh)
	}
	asked := map[string]string{}
	l.applyContainerKeys("container", asked, 300)
	if asked[KeyProcesses] != "300" || asked[KeyCPUAllowance] != "300ms/100ms" {
		t.Errorf("--processes 300: %v", asked)
	}
	clone := map[string]string{KeyProcesses: "500"} // a source's own value within the cap
	l.applyContainerKeys("container", clone, 0)
	if clone[KeyProcesses] != "500" || clone[KeyCPUAllowance] == "" {
		t.Errorf("clone: %v", clone)
	}
}
