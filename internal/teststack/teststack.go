// Package teststack gives integration tests a complete isolation stack of their own (network,
// ACL, profile, firewall) and the probe image, on the real daemon, so tests never touch the
// user's claudenet and several test packages can run side by side.
//
// Every stack network carries user.claudebox.test=<run> and user.claudebox.test.at=<unix>;
// every box a test mints should carry Tag(). New first removes stacks and boxes that dead runs
// left behind (older than testenv.SweepAge), and its cleanup tears down its own.
package teststack

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/claudebox/claudebox/boxcore"
	"github.com/claudebox/claudebox/boxcore/incus"
	"github.com/claudebox/claudebox/drill/image"
	"github.com/claudebox/claudebox/internal/testenv"
)

const atKey = testenv.TagKey + ".at"

// Name is the stack (and bridge) name for a component: "cbt" + its first letter + run id.
func Name(component string) string {
	return "cbt" + component[:1] + testenv.RunID()
}

// Stack returns the named test stack, marked with this run.
func Stack(component string) boxcore.Stack {
	return marked(Name(component))
}

// Numbered returns the i-th of several test stacks of one component (Name plus i, 0 <= i < 10000),
// marked with this run, for tests that need stacks side by side.
func Numbered(component string, i int) boxcore.Stack {
	return marked(Name(component) + strconv.Itoa(i))
}

func marked(name string) boxcore.Stack {
	s := boxcore.NamedStack(name)
	s.Marks = map[string]string{testenv.TagKey: testenv.RunID(), atKey: strconv.FormatInt(time.Now().Unix(), 10)}
	return s
}

// New sweeps what dead runs left, inits a fresh test stack (host DNS upstream) and registers
// its teardown.
func New(t testing.TB, c *incus.Client, component string) boxcore.Stack {
	t.Helper()
	return NewOnPool(t, c, component, "")
}

// NewOnPool is New with the stack's boxes on an existing storage pool of the host (the
// product's btrfs pool, where a test must see what a real box sees; "": the test stacks'
// own); the teardown leaves the pool alone.
func NewOnPool(t testing.TB, c *incus.Client, component, pool string) boxcore.Stack {
	t.Helper()
	Sweep(t, c)
	s := Stack(component)
	if pool != "" {
		s.Pool = pool
	}
	t.Cleanup(func() { Remove(t, c, s) })
	h := boxcore.NewHost(c, s)
	if _, err := h.Init(context.Background(), boxcore.InitOptions{DNS: "host"}); err != nil {
		t.Fatalf("init test stack %s on pool %s: %v", s.Network, s.Pool, err)
	}
	return s
}

// Tag is the config a test box carries so that a sweep can find it.
func Tag() map[string]string { return testenv.Tag() }

// Remove deletes the boxes of this run on the stack, then tears the stack down. A teardown that
// fails fails the test: what it leaves behind would sit on the host until a sweep 15 minutes on.
// (Incus 6.0.4's bridge-children race on the network delete is retried by the client.)
func Remove(t testing.TB, c *incus.Client, s boxcore.Stack) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	// This run's tagged instances, and anything else on this test stack: a box a test minted
	// through the binary and was killed before it could tag it still sits on the profile.
	deleteInstances(ctx, t, c, func(in incus.Instance) bool {
		return in.Config[testenv.TagKey] == testenv.RunID() || slices.Contains(in.Profiles, s.Profile)
	})
	h := boxcore.NewHost(c, s)
	p, err := h.PlanTeardown(ctx, true)
	if err != nil {
		t.Errorf("teardown of test stack %s: %v", s.Network, err)
		return
	}
	if _, err := h.ApplyTeardown(ctx, p); err != nil {
		t.Errorf("teardown of test stack %s: %v", s.Network, err)
	}
}

// Sweep removes test boxes and stacks that other, dead runs left behind.
func Sweep(t testing.TB, c *incus.Client) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	old := time.Now().Add(-testenv.SweepAge)
	deleteInstances(ctx, t, c, func(in incus.Instance) bool {
		run, ok := in.Config[testenv.TagKey]
		return ok && run != testenv.RunID() && in.CreatedAt.Before(old)
	})
	nets, err := c.Networks(ctx)
	if err != nil {
		return
	}
	for _, n := range nets {
		run, ok := n.Config[testenv.TagKey]
		if !ok || run == testenv.RunID() {
			continue
		}
		at, _ := strconv.ParseInt(n.Config[atKey], 10, 64)
		if time.Unix(at, 0).After(old) {
			continue
		}
		t.Logf("sweep: tearing down test stack %s left by run %s", n.Name, run)
		dead := boxcore.NamedStack(n.Name)
		deleteInstances(ctx, t, c, func(in incus.Instance) bool { return slices.Contains(in.Profiles, dead.Profile) })
		h := boxcore.NewHost(c, dead)
		if p, err := h.PlanTeardown(ctx, true); err == nil {
			_, _ = h.ApplyTeardown(ctx, p)
		}
	}
}

func deleteInstances(ctx context.Context, t testing.TB, c *incus.Client, match func(incus.Instance) bool) {
	insts, err := c.Instances(ctx, nil, false)
	if err != nil {
		t.Logf("listing instances: %v", err)
		return
	}
	for _, in := range insts {
		if !match(in) {
			continue
		}
		if in.Status != "Stopped" {
			_ = c.SetState(ctx, in.Name, "stop", true, 0)
		}
		if err := c.DeleteInstance(ctx, in.Name); err != nil && !errors.Is(err, incus.ErrNotFound) {
			t.Logf("deleting %s: %v", in.Name, err)
		}
	}
}

var (
	buildOnce sync.Once
	binPath   string
	buildErr  error
)

// Binary builds claudebox (static) once per test process and returns its path.
func Binary(t testing.TB) string {
	t.Helper()
	buildOnce.Do(func() {
		dir, err := os.MkdirTemp("", "claudebox-test-bin-")
		if err != nil {
			buildErr = err
			return
		}
		_ = os.Chmod(dir, 0o755) // tests also run it as an unprivileged user
		binPath = filepath.Join(dir, "claudebox")
		cmd := exec.Command("go", "build", "-trimpath", "-ldflags", "-s -w", "-o", binPath, "github.com/claudebox/claudebox/cmd/claudebox")
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			buildErr = fmt.Errorf("building claudebox: %v\n%s", err, out)
		}
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return binPath
}

// RemoveBinary deletes the binary Binary built; call it from TestMain after m.Run.
func RemoveBinary() {
	if binPath != "" {
		_ = os.RemoveAll(filepath.Dir(binPath))
	}
}

// ProbeImage returns the alias of the scratch probe image built from this tree's claudebox
// (imported once, reused by content hash).
func ProbeImage(t testing.TB, c *incus.Client) string {
	t.Helper()
	alias, err := image.EnsureImage(context.Background(), c, Binary(t), "claudebox-probe")
	if err != nil {
		t.Fatalf("probe image: %v", err)
	}
	return alias
}
