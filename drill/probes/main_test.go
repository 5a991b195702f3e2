package probes

import (
	"encoding/json"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func runMain(t *testing.T, stdin string, args ...string) (int, string, string) {
	t.Helper()
	old := Stdin
	Stdin = strings.NewReader(stdin)
	defer func() { Stdin = old }()
	var out, errb strings.Builder
	code := Main(args, &out, &errb)
	return code, out.String(), errb.String()
}

func TestMainRun(t *testing.T) {
	// One spec as the argument, the way `incus exec box -- claudebox probe run '<json>'` passes it.
	code, out, errs := runMain(t, "", "run", `{"id":"a","kind":"tcp","target":"198.18.0.2","port":7001,"timeout":"500ms"}`)
	if code != ExitOK {
		t.Fatalf("exit %d: %s", code, errs)
	}
	var rs []Result
	if err := json.Unmarshal([]byte(out), &rs); err != nil || len(rs) != 1 || rs[0].Outcome != Open || rs[0].Probe.ID != "a" {
		t.Fatalf("%v %s", err, out)
	}
	// An array on stdin.
	code, out, errs = runMain(t, `[{"kind":"udp","target":"198.18.0.2","port":7002},{"kind":"tcp","target":"198.18.0.2","port":7009,"timeout":"200ms"}]`, "run")
	if code != ExitOK {
		t.Fatalf("exit %d: %s", code, errs)
	}
	if err := json.Unmarshal([]byte(out), &rs); err != nil || len(rs) != 2 || rs[0].Outcome != Open || rs[1].Outcome != Dropped {
		t.Fatalf("%v %s", err, out)
	}
	if !strings.Contains(out, `"outcome": "dropped"`) {
		t.Errorf("outcomes are not the documented strings: %s", out)
	}
}

func TestMainBadInput(t *testing.T) {
	for _, c := range []struct {
		name, stdin string
		args        []string
		want        string
	}{
		{"no sub-command", "", nil, "usage"},
		{"unknown sub-command", "", []string{"frobnicate"}, "unknown sub-command"},
		{"bad JSON", "", []string{"run", `{"kind":`}, "bad spec JSON"},
		{"empty stdin", "", []string{"run"}, "no JSON"},
		{"unknown field", "", []string{"run", `[{"kind":"tcp","tagret":"198.18.0.2","port":1}]`}, "tagret"},
		{"unknown kind", "", []string{"run", `{"kind":"smoke"}`}, "unknown probe kind"},
		{"bad port", "", []string{"run", `[{"kind":"udp","target":"198.18.0.2","port":7002},{"id":"p","kind":"tcp","target":"x","port":70000}]`}, `spec 1 (id "p")`},
		{"bad timeout", "", []string{"run", `{"kind":"icmp","target":"198.18.0.2","timeout":2}`}, "timeout"},
		{"trailing data", "", []string{"run", `{"kind":"facts"} {"kind":"facts"}`}, "trailing"},
		{"two arguments", "", []string{"run", "{}", "{}"}, "one JSON argument"},
		{"bad flag", "", []string{"facts", "--nope"}, "nope"},
		{"bad port list", "", []string{"serve", "--tcp", "x"}, "bad port"},
	} {
		t.Run(c.name, func(t *testing.T) {
			code, _, errs := runMain(t, c.stdin, c.args...)
			if code != ExitUsage || !strings.Contains(errs, c.want) {
				t.Errorf("exit %d, stderr %q; want %d and %q", code, errs, ExitUsage, c.want)
			}
		})
	}
}

func TestMainFactsAndStatus(t *testing.T) {
	code, out, errs := runMain(t, "", "facts", "--iface", "vc0")
	var f Facts
	if code != ExitOK || json.Unmarshal([]byte(out), &f) != nil || f.IPv4[0] != "198.18.0.1/24" {
		t.Fatalf("facts: exit %d %s %s", code, out, errs)
	}
	if code, _, _ := runMain(t, "", "status", "--file", "/nonexistent/status.json"); code != ExitError {
		t.Errorf("status of a missing file: exit %d", code)
	}
	if code, out, _ := runMain(t, "", "help"); code != ExitOK || !strings.Contains(out, "probe") {
		t.Errorf("help: %d", code)
	}
}

// A detached run outlives its caller and floods until collect ends it; collect prints its
// Results once the floods' tails are done.
func TestDetachedRun(t *testing.T) {
	out := filepath.Join(t.TempDir(), "soak.json")
	spec := `[{"id":"f","kind":"flood","target":"198.18.0.2","timeout":"61s","flood":{"duration":"60s","udp":["198.18.0.2:7002"],"tcp":["198.18.0.2:7001","198.18.0.3:7001"]}}]`
	start := time.Now()
	if code, _, errs := runMain(t, "", "run", "--detach", out, spec); code != ExitOK {
		t.Fatalf("detach: exit %d: %s", code, errs)
	}
	if time.Since(start) > 5*time.Second {
		t.Fatalf("detach returned after %s: it must not wait for the run", time.Since(start))
	}
	time.Sleep(500 * time.Millisecond)
	code, stdout, errs := runMain(t, "", "collect", out)
	if code != ExitOK {
		t.Fatalf("collect: exit %d: %s", code, errs)
	}
	var rs []Result
	if err := json.Unmarshal([]byte(stdout), &rs); err != nil || len(rs) != 1 {
		t.Fatalf("%v %s", err, stdout)
	}
	if rs[0].Outcome != Open || rs[0].Counts == nil || rs[0].Counts.Sent < 100 {
		t.Errorf("the flood ran and was echoed: %+v", rs[0])
	}
	if took := time.Since(start); took > 20*time.Second {
		t.Errorf("collect ended the 60s flood only after %s", took)
	}
	if code, _, errs := runMain(t, "", "collect", filepath.Join(t.TempDir(), "none.json")); code != ExitError || !strings.Contains(errs, "no results") {
		t.Errorf("collect of nothing: exit %d %s", code, errs)
	}
	if code, _, _ := runMain(t, "", "run", "--detach"); code != ExitUsage {
		t.Errorf("detach without a file: exit %d", code)
	}
}
