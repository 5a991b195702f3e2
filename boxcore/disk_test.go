package boxcore_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/claudebox/claudebox/boxcore"
	"github.com/claudebox/claudebox/boxcore/incus"
	"github.com/claudebox/claudebox/internal/testenv"
	"github.com/claudebox/claudebox/internal/teststack"
)

func TestPoolSizeFor(t *testing.T) {
	for _, tc := range []struct{ free, want int64 }{
		{0, boxcore.MinPoolSize},
		{30 << 30, boxcore.MinPoolSize},
		{100 << 30, 50 << 30},
		{79 << 30, 79 << 29},
		{1 << 40, boxcore.MaxPoolSize},
	} {
		if got := boxcore.PoolSizeFor(tc.free); got != tc.want {
			t.Errorf("PoolSizeFor(%d) = %d, want %d", tc.free, got, tc.want)
		}
	}
	if got := boxcore.PoolSizeString(50 << 30); got != "50GiB" {
		t.Errorf("PoolSizeString = %q", got)
	}
}

func TestDiskBytes(t *testing.T) {
	for in, want := range map[string]int64{"64MiB": 64 << 20, "10GiB": 10 << 30, "1.5GiB": 3 << 29, "20GB": 20e9, "4096": 4096, "1kB": 1000} {
		if got, err := boxcore.DiskBytes(in); err != nil || got != want {
			t.Errorf("DiskBytes(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, bad := range []string{"", "GiB", "10 GiB", "-1GiB", "10gib", "ten"} {
		if _, err := boxcore.DiskBytes(bad); err == nil {
			t.Errorf("DiskBytes(%q) accepted", bad)
		}
	}
}

// The clone boundary takes a root size only at or below the stack's cap.
func TestOffBoundaryRootSize(t *testing.T) {
	s := boxcore.NamedStack("cbtx")
	s.MaxDisk = 20 << 30
	root := func(size string) map[string]map[string]string {
		return map[string]map[string]string{"root": {"type": "disk", "path": "/", "pool": s.Pool, "size": size}}
	}
	for size, ok := range map[string]bool{"10GiB": true, "20GiB": true, "21GiB": false, "1TiB": false, "lots": false} {
		off := boxcore.OffBoundary(nil, root(size), s)
		if (len(off) == 0) != ok {
			t.Errorf("root size %s: off boundary %v, want ok=%v", size, off, ok)
		}
	}
	s.MaxDisk = 0 // no cap known: any real size
	if off := boxcore.OffBoundary(nil, root("1TiB"), s); len(off) != 0 {
		t.Errorf("no cap: %v", off)
	}
}

// diskStack is a test stack whose pool is a small btrfs pool of its own, which init creates;
// the pool is deleted when the test ends (after the stack and its boxes).
func diskStack(t *testing.T, c *incus.Client) (boxcore.Stack, string) {
	t.Helper()
	if ok, why := boxcore.BtrfsUsable(); !ok {
		t.Fatalf("btrfs is not usable here (%s): make setup installs btrfs-progs", why)
	}
	teststack.Sweep(t, c)
	sweepTestPools(t, c)
	pool := "cbt-disk-" + testenv.RunID()
	t.Cleanup(func() {
		ctx := context.Background()
		if err := c.DeleteStoragePool(ctx, pool); err != nil && !errors.Is(err, incus.ErrNotFound) {
			t.Errorf("deleting test pool %s: %v", pool, err)
		}
	})
	s := teststack.Stack("disk")
	t.Cleanup(func() { teststack.Remove(t, c, s) })
	return s, pool
}

// sweepTestPools deletes the test pools of other runs that nothing but images uses any more
// (a live run's pool carries its profile or its boxes).
func sweepTestPools(t *testing.T, c *incus.Client) {
	t.Helper()
	pools, err := c.StoragePools(context.Background())
	if err != nil {
		return
	}
	for _, p := range pools {
		if !strings.HasPrefix(p.Name, "cbt-disk-") || p.Name == "cbt-disk-"+testenv.RunID() {
			continue
		}
		busy := false
		for _, u := range p.UsedBy {
			busy = busy || !strings.HasPrefix(u, "/1.0/images/")
		}
		if !busy {
			t.Logf("sweep: deleting test pool %s", p.Name)
			_ = c.DeleteStoragePool(context.Background(), p.Name)
		}
	}
}

// TestDiskQuota: host init moves an unused profile root to a new btrfs pool (and keeps going
// when instances rely on it), a box's --disk is a qgroup limit that stops a write inside the
// box near the limit without touching the host's disk, ReadDiskQuota reads it, a live PATCH of
// the size tightens it, and --disk above the pool's size is refused before anything is made.
func TestDiskQuota(t *testing.T) {
	c := testenv.RequireIncus(t)
	ctx := context.Background()
	s, pool := diskStack(t, c)
	img := teststack.ProbeImage(t, c)

	// A stack on the dir pool first, with an instance that takes its root from the profile.
	s.Pool = "default"
	if _, err := boxcore.NewHost(c, s).Init(ctx, boxcore.InitOptions{DNS: "host"}); err != nil {
		t.Fatalf("init on default: %v", err)
	}
	old := "cbt-disk-" + testenv.RunID() + "-old"
	oldReq := incus.InstancesPost{Name: old, Type: "container", Profiles: []string{s.Profile}, Config: teststack.Tag(),
		Source: incus.InstanceSource{Type: "image", Alias: img}}
	if err := c.CreateInstance(ctx, oldReq, nil); err != nil {
		t.Fatalf("creating %s: %v", old, err)
	}

	s.Pool = pool
	h := boxcore.NewHost(c, s)
	plan, err := h.PlanInit(ctx, boxcore.InitOptions{PoolSize: "3GiB"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := h.ApplyInit(ctx, plan); err != nil {
		t.Fatalf("init onto %s with an instance on the profile's root: %v (want a warning, not a failure)", pool, err)
	}
	if !strings.Contains(strings.Join(plan.Warnings, "\n"), "keeps its root disk on pool default") {
		t.Errorf("init did not say the profile root stays: %v", plan.Warnings)
	}
	if pl, _, err := c.StoragePool(ctx, pool); err != nil || pl.Driver != "btrfs" || pl.Config["size"] != "3GiB" {
		t.Fatalf("pool %s: %+v %v", pool, pl, err)
	}
	if err := c.DeleteInstance(ctx, old); err != nil {
		t.Fatal(err)
	}
	if _, err := h.Init(ctx, boxcore.InitOptions{}); err != nil {
		t.Fatalf("init after the instance went: %v", err)
	}
	if p, _, err := c.Profile(ctx, s.Profile); err != nil || p.Devices["root"]["pool"] != pool || p.Devices["root"]["size"] != boxcore.DefaultDisk {
		t.Fatalf("profile root not moved to %s: %v %v", pool, p.Devices["root"], err)
	}
	if r := mustCheck(t, h); !r.OK {
		t.Fatalf("check after init drifts: %v", driftItems(r))
	}
	if again, err := h.Init(ctx, boxcore.InitOptions{}); err != nil || len(again) != 0 {
		t.Fatalf("third init: %v %v", again, err)
	}

	bs := &boxcore.Boxes{Client: c, Stack: s, Version: "test"}
	name := "cbt-disk-" + testenv.RunID()
	t.Run("--disk above the pool's size is refused", func(t *testing.T) {
		_, err := bs.New(ctx, boxcore.NewOptions{Name: name + "-big", Image: img, Disk: "4GiB", Config: teststack.Tag()})
		if !boxcore.IsUsage(err) || !strings.Contains(err.Error(), "at most the pool's size") {
			t.Fatalf("--disk 4GiB on a 3GiB pool: %v, want a usage error", err)
		}
		if _, _, err := c.Instance(ctx, name+"-big"); !errors.Is(err, incus.ErrNotFound) {
			t.Fatalf("the refused box exists: %v", err)
		}
	})

	if _, err := bs.New(ctx, boxcore.NewOptions{Name: name, Image: img, Disk: "64MiB", Config: teststack.Tag()}); err != nil {
		t.Fatalf("new --disk 64MiB: %v", err)
	}
	q, err := boxcore.ReadDiskQuota(ctx, c, pool, name)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("quota of %s: %+v", name, q)
	if q.Limit != 64<<20 || q.Referenced <= 0 || q.Subvolume < 256 {
		t.Fatalf("quota %+v, want a 64MiB limit", q)
	}

	t.Run("a live size change tightens the qgroup", func(t *testing.T) {
		setRootSize(t, c, name, "48MiB")
		q, err := boxcore.ReadDiskQuota(ctx, c, pool, name)
		if err != nil || q.Limit != 48<<20 {
			t.Fatalf("after size=48MiB on the running box: %+v %v", q, err)
		}
	})

	t.Run("a write past the tightened limit fails inside the box", func(t *testing.T) {
		loop := filepath.Join(os.Getenv("INCUS_DIR"), "disks", pool+".img")
		if os.Getenv("INCUS_DIR") == "" {
			loop = filepath.Join("/var/lib/incus/disks", pool+".img")
		}
		loopBefore := allocated(t, loop)
		hostBefore := hostFree(t)
		w := &zeros{n: 128 << 20}
		err := c.PushFile(ctx, name, "/fill", w, 0o644, 0, 0)
		loopAfter, hostAfter := allocated(t, loop), hostFree(t)
		t.Logf("push of 128MiB: %v; %d bytes sent; loop file +%d bytes; host free %+d bytes",
			err, w.sent, loopAfter-loopBefore, hostAfter-hostBefore)
		if err == nil || !strings.Contains(err.Error(), "quota exceeded") && !strings.Contains(err.Error(), "no space") {
			t.Fatalf("writing 128MiB into a 48MiB box: %v, want EDQUOT/ENOSPC", err)
		}
		after, err := boxcore.ReadDiskQuota(ctx, c, pool, name)
		if err != nil {
			t.Fatal(err)
		}
		if after.Referenced > 48<<20 || after.Referenced < 40<<20 {
			t.Errorf("the box references %d bytes after the failed write, want near the 48MiB limit", after.Referenced)
		}
		// The loop file is where the pool's blocks reach the host's disk: its growth is what
		// the write cost the host. (The host's free space is only logged: the test suite's
		// other packages write beside this one.)
		if grew := loopAfter - loopBefore; grew >= 96<<20 {
			t.Errorf("the pool's loop file grew by %d bytes: more than the quota let through", grew)
		}
	})

	t.Run("a full box can be given more room live", func(t *testing.T) {
		setRootSize(t, c, name, "96MiB")
		if q, err := boxcore.ReadDiskQuota(ctx, c, pool, name); err != nil || q.Limit != 96<<20 {
			t.Fatalf("after size=96MiB: %+v %v", q, err)
		}
	})

	t.Run("no quota on a dir pool", func(t *testing.T) {
		if _, err := boxcore.ReadDiskQuota(ctx, c, "default", name); !errors.Is(err, boxcore.ErrNoQuota) {
			t.Fatalf("dir pool: %v, want ErrNoQuota", err)
		}
	})
}

// TestQgroupRepair: inconsistent accounting and the kernel's default drop_subtree_threshold
// are drift in host check, and host init repairs both.
func TestQgroupRepair(t *testing.T) {
	c := testenv.RequireIncus(t)
	ctx := context.Background()
	s, pool := diskStack(t, c)
	s.Pool = pool
	h := boxcore.NewHost(c, s)
	if _, err := h.Init(ctx, boxcore.InitOptions{DNS: "host", PoolSize: "3GiB"}); err != nil {
		t.Fatal(err)
	}
	// A sized volume of its own, so the pool has a qgroup besides the top level.
	bs := &boxcore.Boxes{Client: c, Stack: s, Version: "test"}
	name := "cbt-disk-" + testenv.RunID() + "-q"
	img := teststack.ProbeImage(t, c)
	if _, err := bs.New(ctx, boxcore.NewOptions{Name: name, Image: img, Disk: "64MiB", Config: teststack.Tag()}); err != nil {
		t.Fatal(err)
	}
	mount := boxcore.PoolMount(pool)
	st, err := boxcore.ReadQgroupStatus(mount)
	if err != nil || !st.Enabled || st.Inconsistent || st.DropThreshold != boxcore.QgroupDropThreshold {
		t.Fatalf("after init: %+v %v", st, err)
	}
	if r := mustCheck(t, h); !r.OK {
		t.Fatalf("check after init drifts: %v", driftItems(r))
	}

	// Break it: the kernel's default threshold, and a relation added without a rescan (the
	// kernel marks the counts inconsistent, as a large delete under the default does).
	q, err := boxcore.ReadDiskQuota(ctx, c, pool, name)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join("/sys/fs/btrfs", st.UUID, "qgroups", "drop_subtree_threshold"), []byte("3"), 0o644); err != nil {
		t.Fatal(err)
	}
	btrfs(t, "qgroup", "create", "1/4242", mount)
	btrfs(t, "qgroup", "assign", "--no-rescan", fmt.Sprintf("0/%d", q.Subvolume), "1/4242", mount)
	btrfs(t, "qgroup", "remove", "--no-rescan", fmt.Sprintf("0/%d", q.Subvolume), "1/4242", mount)
	btrfs(t, "qgroup", "destroy", "1/4242", mount)
	if st, _ := boxcore.ReadQgroupStatus(mount); !st.Inconsistent || st.DropThreshold != 3 {
		t.Fatalf("could not break the accounting: %+v", st)
	}
	drift := strings.Join(driftItems(mustCheck(t, h)), "\n")
	for _, want := range []string{"pool " + pool + " quota accounting consistent", "pool " + pool + " qgroups drop_subtree_threshold"} {
		if !strings.Contains(drift, want) {
			t.Errorf("check does not report %q; drift:\n%s", want, drift)
		}
	}

	changes, err := h.Init(ctx, boxcore.InitOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("repair: %v", changes)
	st, err = boxcore.ReadQgroupStatus(mount)
	if err != nil || st.Inconsistent || st.DropThreshold != boxcore.QgroupDropThreshold {
		t.Fatalf("after the repair: %+v %v", st, err)
	}
	if r := mustCheck(t, h); !r.OK {
		t.Fatalf("check after the repair drifts: %v", driftItems(r))
	}
}

func setRootSize(t *testing.T, c *incus.Client, name, size string) {
	t.Helper()
	ctx := context.Background()
	inst, etag, err := c.Instance(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	put := inst.Writable()
	put.Devices["root"]["size"] = size
	if err := c.UpdateInstance(ctx, name, put, etag); err != nil {
		t.Fatalf("root size=%s on %s: %v", size, name, err)
	}
}

func btrfs(t *testing.T, args ...string) {
	t.Helper()
	if out, err := exec.Command("btrfs", args...).CombinedOutput(); err != nil {
		t.Fatalf("btrfs %v: %v\n%s", args, err, out)
	}
}

// zeros reads n zero bytes, counting what was read.
type zeros struct{ n, sent int64 }

func (z *zeros) Read(p []byte) (int, error) {
	if z.sent >= z.n {
		return 0, io.EOF
	}
	k := min(int64(len(p)), z.n-z.sent)
	clear(p[:k])
	z.sent += k
	return int(k), nil
}

func allocated(t *testing.T, path string) int64 {
	t.Helper()
	var st syscall.Stat_t
	if err := syscall.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	return st.Blocks * 512
}

func hostFree(t *testing.T) int64 {
	t.Helper()
	var st syscall.Statfs_t
	if err := syscall.Statfs("/var/lib/incus", &st); err != nil {
		t.Fatal(err)
	}
	return int64(st.Bavail) * st.Bsize
}
