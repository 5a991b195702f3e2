package boxcore_test

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"testing"

	"github.com/claudebox/claudebox/boxcore"
	"github.com/claudebox/claudebox/boxcore/incus"
	"github.com/claudebox/claudebox/internal/testenv"
	"github.com/claudebox/claudebox/internal/teststack"
)

// limitRows are the check's rows of the limits layers for one box.
func limitRows(r boxcore.CheckReport, box string) []boxcore.CheckRow {
	var out []boxcore.CheckRow
	for _, row := range r.Rows {
		if strings.HasPrefix(row.Layer, "limits") && row.Item == box {
			out = append(out, row)
		}
	}
	return out
}

func setConfig(t *testing.T, c *incus.Client, name string, edit func(map[string]string)) {
	t.Helper()
	ctx := context.Background()
	in, etag, err := c.Instance(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	put := in.Writable()
	edit(put.Config)
	if err := c.UpdateInstance(ctx, name, put, etag); err != nil {
		t.Fatalf("updating %s: %v", name, err)
	}
}

// A container box minted by claudebox has finite limits in the kernel — pids.max at the
// host-sized default, the profile's memory limit, a CFS quota — --processes reaches the
// kernel, a value above the cap is refused with nothing made, and host check reports a box
// whose process limit was removed by hand (config and kernel) until it is restored.
func TestLimitsOnTheDaemon(t *testing.T) {
	c := testenv.RequireIncus(t)
	ctx := context.Background()
	s := teststack.New(t, c, "limits")
	var warnings []string
	bs := &boxcore.Boxes{Client: c, Stack: s, Version: "test", Warn: func(w string) { warnings = append(warnings, w) }}
	h := boxcore.NewHost(c, s)
	img := teststack.ProbeImage(t, c)
	l := boxcore.DefaultLimits()
	name := func(suffix string) string { return "cbt-lim-" + testenv.RunID() + "-" + suffix }
	a, b := name("a"), name("b")

	if _, err := bs.New(ctx, boxcore.NewOptions{Name: a, Image: img, Config: teststack.Tag()}); err != nil {
		t.Fatalf("new %s: %v", a, err)
	}
	k, err := boxcore.ReadKernelLimits(a)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("kernel limits of %s: %+v (defaults %+v)", a, k, l)
	if k.PidsMax != l.Processes {
		t.Errorf("pids.max %d, want the default %d", k.PidsMax, l.Processes)
	}
	if k.MemoryMax != l.Memory {
		t.Errorf("memory limit %d, want the profile's %d (%s)", k.MemoryMax, l.Memory, l.MemoryValue())
	}
	if k.CPUQuotaUs != int64(l.AllowanceCPUs)*k.CPUPeriodUs || k.CPUPeriodUs != 100000 {
		t.Errorf("CFS quota %d/%d, want %d CPUs of %d", k.CPUQuotaUs, k.CPUPeriodUs, l.AllowanceCPUs, 100000)
	}
	if k.PidsCurrent < 1 || k.MemoryUsage < 1 {
		t.Errorf("usage not read: %+v", k)
	}
	in, _, err := c.Instance(ctx, a)
	if err != nil {
		t.Fatal(err)
	}
	if bl := boxcore.LimitsOf(in); len(bl.Missing) != 0 || bl.Processes != strconv.FormatInt(l.Processes, 10) || bl.CPUAllowance != l.Allowance(0) || bl.Memory != l.MemoryValue() {
		t.Errorf("limits of %s: %+v", a, bl)
	}
	for _, row := range limitRows(mustCheck(t, h), a) {
		if !row.OK {
			t.Errorf("check after new: %+v", row)
		}
	}

	t.Run("--processes reaches the kernel", func(t *testing.T) {
		if _, err := bs.New(ctx, boxcore.NewOptions{Name: b, Image: img, Processes: 300, Config: teststack.Tag()}); err != nil {
			t.Fatalf("new %s: %v", b, err)
		}
		k, err := boxcore.ReadKernelLimits(b)
		if err != nil {
			t.Fatal(err)
		}
		if k.PidsMax != 300 {
			t.Errorf("pids.max %d, want 300", k.PidsMax)
		}
	})

	t.Run("above the cap: refused, nothing made", func(t *testing.T) {
		n := name("cap")
		_, err := bs.New(ctx, boxcore.NewOptions{Name: n, Image: img, Processes: l.ProcessesCap + 1, Config: teststack.Tag()})
		var ue *boxcore.UsageError
		if !errors.As(err, &ue) {
			t.Fatalf("new --processes %d: %v, want a usage error", l.ProcessesCap+1, err)
		}
		if _, _, err := c.Instance(ctx, n); !errors.Is(err, incus.ErrNotFound) {
			t.Errorf("an instance %s exists after a refused new (%v)", n, err)
		}
	})

	t.Run("memory budget warning", func(t *testing.T) {
		warnings = nil
		big := boxcore.FormatBytes(l.MemoryBudget &^ (1<<20 - 1))
		n := name("big")
		if _, err := bs.New(ctx, boxcore.NewOptions{Name: n, Image: img, Memory: big, Config: teststack.Tag()}); err != nil {
			t.Fatalf("new --memory %s: %v", big, err)
		}
		if len(warnings) != 1 || !strings.Contains(warnings[0], "more than this host can give") {
			t.Errorf("new --memory %s beside running boxes: warnings %q, want one about the budget", big, warnings)
		}
		box, err := boxcore.Resolve(ctx, c, n)
		if err != nil {
			t.Fatal(err)
		}
		if err := bs.Stop(ctx, box, true); err != nil {
			t.Fatal(err)
		}
		box, _ = boxcore.Resolve(ctx, c, n)
		warnings = nil
		if err := bs.Start(ctx, box); err != nil {
			t.Fatal(err)
		}
		if len(warnings) != 1 {
			t.Errorf("start: warnings %q, want one", warnings)
		}
		_ = bs.Remove(ctx, box)
	})

	t.Run("drift: limits.processes removed by hand", func(t *testing.T) {
		setConfig(t, c, a, func(cfg map[string]string) { delete(cfg, boxcore.KeyProcesses) })
		rows := limitRows(mustCheck(t, h), a)
		var cfgRow, kernelRow bool
		for _, row := range rows {
			if row.OK {
				continue
			}
			cfgRow = cfgRow || (row.Layer == "limits" && strings.Contains(row.Actual, "missing: "+boxcore.KeyProcesses))
			kernelRow = kernelRow || (row.Layer == "limits (kernel)" && strings.Contains(row.Actual, "pids.max=max"))
		}
		if !cfgRow || !kernelRow {
			t.Errorf("check after removing %s: rows %+v, want drift in the config and the kernel", boxcore.KeyProcesses, rows)
		}

		// A clone of a source without the process limit gets it.
		clone := name("clone")
		if _, err := bs.New(ctx, boxcore.NewOptions{Name: clone, From: a, Config: teststack.Tag()}); err != nil {
			t.Fatalf("clone: %v", err)
		}
		if k, err := boxcore.ReadKernelLimits(clone); err != nil || k.PidsMax != l.Processes {
			t.Errorf("clone of a source without limits.processes: pids.max %d (%v), want %d", k.PidsMax, err, l.Processes)
		}

		// A source looser than claudebox sets is refused at the boundary.
		setConfig(t, c, a, func(cfg map[string]string) { cfg[boxcore.KeyProcesses] = strconv.FormatInt(l.ProcessesCap+1, 10) })
		_, err := bs.New(ctx, boxcore.NewOptions{Name: name("loose"), From: a})
		if !errors.As(err, new(*boxcore.UsageError)) || !strings.Contains(err.Error(), "looser than claudebox sets") {
			t.Errorf("clone of a source with limits.processes above the cap: %v, want a refusal", err)
		}

		setConfig(t, c, a, func(cfg map[string]string) { cfg[boxcore.KeyProcesses] = strconv.FormatInt(l.Processes, 10) })
		for _, row := range limitRows(mustCheck(t, h), a) {
			if !row.OK {
				t.Errorf("check after restoring %s: %+v", boxcore.KeyProcesses, row)
			}
		}
	})
}
