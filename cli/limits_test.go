package cli

import (
	"encoding/json"
	"strconv"
	"strings"
	"testing"

	"github.com/claudebox/claudebox/boxcore"
)

// `new --processes` reaches the kernel, and info and list show the limits; values above the
// host's caps, invalid values, --processes on a VM or on a clone are refused (exit 2) before
// anything is made.
func TestNewLimits(t *testing.T) {
	h := newHarness(t)
	l := boxcore.DefaultLimits()
	a := h.name("lim")
	h.removeLater(a)

	// Refused before anything is made: above the caps, invalid, VM-only, clone.
	for _, tc := range []struct {
		want string
		args []string
	}{
		{"above what this host allows", []string{"--processes", strconv.FormatInt(l.ProcessesCap+1, 10)}},
		{"1 or more", []string{"--processes", "0"}},
		{"", []string{"--processes", "many"}},
		{"above what this host can give", []string{"--memory", boxcore.FormatBytes(l.MemoryBudget + 1<<30)}},
		{"more CPUs than this host has", []string{"--cpu", strconv.Itoa(l.Host.CPUs + 1)}},
	} {
		h.unchanged(2, tc.want, append([]string{"new", "--name", a, "--container", "--image", h.image}, tc.args...)...)
	}
	h.unchanged(2, "a VM has its own kernel", "new", "--name", a, "--vm", "--image", h.image, "--processes", "100")
	h.gone(a, "refused new")

	if r := h.newBox(a, "--processes", "300"); r.code != 0 {
		t.Fatalf("new --processes 300: %d %s", r.code, r.stderr)
	}
	h.tagForSweep(a)
	k, err := boxcore.ReadKernelLimits(a)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("kernel: %+v", k)
	if k.PidsMax != 300 || k.CPUQuotaUs != int64(l.AllowanceCPUs)*100000 || k.MemoryMax <= 0 {
		t.Errorf("kernel limits %+v, want pids.max 300, a CFS quota of %d CPUs and a memory limit", k, l.AllowanceCPUs)
	}
	h.unchanged(2, "--processes", "new", "--name", h.name("limclone"), "--from", a, "--processes", "100")

	r := h.expect(0, "limits:", "info", a)
	if !strings.Contains(r.stdout, "processes 300") || !strings.Contains(r.stdout, "cpu allowance "+l.Allowance(0)) || strings.Contains(r.stdout, "missing:") {
		t.Errorf("info's limits line:\n%s", r.stdout)
	}
	var info struct {
		Limits boxcore.BoxLimits `json:"limits"`
	}
	r = h.expect(0, "", "info", a, "--format", "json")
	if err := json.Unmarshal([]byte(r.stdout), &info); err != nil {
		t.Fatal(err)
	}
	if info.Limits.Processes != "300" || info.Limits.Memory == "" || info.Limits.CPUAllowance != l.Allowance(0) || len(info.Limits.Missing) != 0 {
		t.Errorf("info json limits: %+v", info.Limits)
	}
	var list []struct {
		Name   string            `json:"name"`
		Limits boxcore.BoxLimits `json:"limits"`
	}
	r = h.expect(0, "", "list", "--format", "json")
	if err := json.Unmarshal([]byte(r.stdout), &list); err != nil {
		t.Fatal(err)
	}
	found := false
	for _, b := range list {
		if b.Name == a {
			found = true
			if b.Limits.Processes != "300" || b.Limits.CPUAllowance == "" || b.Limits.Memory == "" {
				t.Errorf("list json limits of %s: %+v", a, b.Limits)
			}
		}
	}
	if !found {
		t.Errorf("list json lacks %s:\n%s", a, r.stdout)
	}

	// A box whose limit was removed by hand (the hatch warns) shows what it lacks, and host
	// check reports it until it is set again.
	h.expect(0, "looser than claudebox does", "incus", a, "--", "config", "unset", "{}", boxcore.KeyProcesses)
	r = h.expect(0, "limits:", "info", a)
	if !strings.Contains(r.stdout, "missing: "+boxcore.KeyProcesses) {
		t.Errorf("info after unsetting %s:\n%s", boxcore.KeyProcesses, r.stdout)
	}
	r = h.run("host", "check")
	if r.code != 1 || !driftLine(r.stdout, a, "missing: "+boxcore.KeyProcesses) || !driftLine(r.stdout, a, "pids.max=max") {
		t.Errorf("host check after unsetting %s: exit %d\n%s\n%s", boxcore.KeyProcesses, r.code, r.stdout, r.stderr)
	}
	h.expect(0, "", "incus", a, "--", "config", "set", "{}", boxcore.KeyProcesses+"=300")
	r = h.run("host", "check")
	if driftLine(r.stdout, a, "") {
		t.Errorf("host check after restoring %s still drifts:\n%s", boxcore.KeyProcesses, r.stdout)
	}
	h.expect(0, "", "rm", a, "--force")
}

// driftLine reports whether host check's table has a DRIFT row for box holding text.
func driftLine(out, box, text string) bool {
	for _, line := range strings.Split(out, "\n") {
		if strings.Contains(line, box) && strings.Contains(line, text) && strings.HasSuffix(strings.TrimSpace(line), "DRIFT") {
			return true
		}
	}
	return false
}
