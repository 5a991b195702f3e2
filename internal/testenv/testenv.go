// Package testenv holds the few helpers tests share when they talk to the real Incus daemon.
//
//   - RequireIncus(t) skips the test when not root, and FAILS it when root and the daemon does
//     not answer: CI runs as root with the daemon up, so a silent skip there would hide a
//     broken setup.
//   - RunID() is a random 6-character id fixed for the test process; Prefix("incus") gives
//     "cbt-incus-<runid>", the prefix for every Incus object a test creates.
//   - Tag() is the config that marks a test instance: user.claudebox.test=<runid>.
//     Description() is the description to put on test networks, ACLs and profiles.
//   - Sweep(t, c, component) removes what dead runs of the same component left behind:
//     instances, images, profiles, ACLs and networks carrying the test marks of another run
//     of that component, older than SweepAge (so parallel runs are left alone).
//   - BuildTestInit(t, tag) builds internal/testinit (static) for a scratch image.
package testenv

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/claudebox/claudebox/boxcore/incus"
)

// TagKey marks instances created by tests; its value is the run id.
const TagKey = "user.claudebox.test"

// SweepAge is how old another run's objects must be before Sweep removes them.
const SweepAge = 15 * time.Minute

var (
	runOnce sync.Once
	runID   string
	started = time.Now()
)

// RunID returns this test process's random 6-character id ([a-z0-9]).
func RunID() string {
	runOnce.Do(func() {
		const abc = "abcdefghijklmnopqrstuvwxyz0123456789"
		b := make([]byte, 6)
		if _, err := rand.Read(b); err != nil {
			panic(err)
		}
		for i := range b {
			b[i] = abc[int(b[i])%len(abc)]
		}
		runID = string(b)
	})
	return runID
}

// Prefix returns "cbt-<component>-<runid>", the name prefix for this run's Incus objects.
func Prefix(component string) string { return "cbt-" + component + "-" + RunID() }

// Tag returns the config marking a test instance of this run.
func Tag() map[string]string { return map[string]string{TagKey: RunID()} }

// Description returns the description to give test networks, ACLs and profiles, which
// have no config key to carry the tag: "claudebox-test run=<id> at=<unix seconds>".
func Description() string {
	return fmt.Sprintf("claudebox-test run=%s at=%d", RunID(), started.Unix())
}

// parseDescription reads Description's fields back.
func parseDescription(d string) (run string, at time.Time, ok bool) {
	f := strings.Fields(d)
	if len(f) != 3 || f[0] != "claudebox-test" || !strings.HasPrefix(f[1], "run=") || !strings.HasPrefix(f[2], "at=") {
		return "", time.Time{}, false
	}
	secs, err := strconv.ParseInt(strings.TrimPrefix(f[2], "at="), 10, 64)
	if err != nil {
		return "", time.Time{}, false
	}
	return strings.TrimPrefix(f[1], "run="), time.Unix(secs, 0), true
}

// RequireIncus returns a client for the local daemon. It skips the test when not running
// as root, and fails it when root and the daemon does not answer.
func RequireIncus(t testing.TB) *incus.Client {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("integration test against the real Incus daemon: needs root (CI runs it as root)")
	}
	c, err := incus.Connect(context.Background(), "")
	if err != nil {
		t.Fatalf("connecting to Incus: %v", err)
	}
	// A daemon that is down refuses at once; one that is up but busy (every package's tests
	// at once on 2 cores) once took over 10 s to answer GET /1.0 in CI: give it a minute.
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := c.Server(ctx); err != nil {
		t.Fatalf("running as root but the Incus daemon does not answer (CI starts it; locally run 'make setup'): %v", err)
	}
	return c
}

// RootDisk returns a devices map holding a root disk on the storage pool "default" (or the
// first pool there is), so test instances need no profile.
func RootDisk(t testing.TB, c *incus.Client) map[string]map[string]string {
	t.Helper()
	pools, err := c.StoragePools(context.Background())
	if err != nil {
		t.Fatalf("listing storage pools: %v", err)
	}
	if len(pools) == 0 {
		t.Fatalf("the Incus daemon has no storage pool (run 'make setup')")
	}
	pool := pools[0].Name
	for _, p := range pools {
		if p.Name == "default" {
			pool = p.Name
		}
	}
	return map[string]map[string]string{"root": {"type": "disk", "path": "/", "pool": pool}}
}

// Sweep removes objects left by dead runs of component: instances named "cbt-<component>-*"
// that carry TagKey with another run's id, images with such aliases, and profiles, ACLs and
// networks whose Description names another run, all only when older than SweepAge.
// Failures are logged, not fatal.
func Sweep(t testing.TB, c *incus.Client, component string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	prefix := "cbt-" + component + "-"
	old := time.Now().Add(-SweepAge)
	insts, err := c.Instances(ctx, nil, false)
	if err != nil {
		t.Logf("sweep: listing instances: %v", err)
		return
	}
	for _, in := range insts {
		run, tagged := in.Config[TagKey]
		if !tagged || run == RunID() || !strings.HasPrefix(in.Name, prefix) || in.CreatedAt.After(old) {
			continue
		}
		t.Logf("sweep: deleting instance %s left by run %s", in.Name, run)
		if in.Status != "Stopped" {
			_ = c.SetState(ctx, in.Name, "stop", true, 0)
		}
		if err := c.DeleteInstance(ctx, in.Name); err != nil {
			t.Logf("sweep: %v", err)
		}
	}
	if imgs, err := c.Images(ctx); err == nil {
		for _, im := range imgs {
			for _, a := range im.Aliases {
				if strings.HasPrefix(a, prefix) && !strings.HasPrefix(a, Prefix(component)) && im.UploadedAt.Before(old) {
					t.Logf("sweep: deleting image %s (%s)", im.Fingerprint[:12], a)
					if err := c.DeleteImage(ctx, im.Fingerprint); err != nil && !errors.Is(err, incus.ErrNotFound) {
						t.Logf("sweep: %v", err)
					}
					break
				}
			}
		}
	}
	dead := func(desc string) bool {
		run, at, ok := parseDescription(desc)
		return ok && run != RunID() && at.Before(old)
	}
	if ps, err := c.Profiles(ctx); err == nil {
		for _, p := range ps {
			if strings.HasPrefix(p.Name, prefix) && dead(p.Description) {
				t.Logf("sweep: deleting profile %s", p.Name)
				_ = c.DeleteProfile(ctx, p.Name)
			}
		}
	}
	if acls, err := c.NetworkACLs(ctx); err == nil {
		for _, a := range acls {
			if strings.HasPrefix(a.Name, prefix) && dead(a.Description) {
				t.Logf("sweep: deleting ACL %s", a.Name)
				_ = c.DeleteNetworkACL(ctx, a.Name)
			}
		}
	}
	if ns, err := c.Networks(ctx); err == nil {
		for _, n := range ns {
			if n.Managed && dead(n.Description) && strings.HasPrefix(n.Name, strings.TrimSuffix(ShortPrefix(component), RunID())) {
				t.Logf("sweep: deleting network %s", n.Name)
				_ = c.DeleteNetwork(ctx, n.Name)
			}
		}
	}
}

// ShortPrefix returns a name prefix short enough for network (interface) names, which
// Linux limits to 15 characters: "cb" + the component's first letter + the run id, e.g.
// "cbia1b2c3" for "incus". Always set Description() on such networks so Sweep can tell
// whose they are.
func ShortPrefix(component string) string {
	ch := "x"
	if component != "" {
		ch = component[:1]
	}
	return "cb" + ch + RunID()
}

// BuildTestInit builds internal/testinit as a static binary into a temp dir and
// returns its path. tag is stamped into the binary (main.buildTag), so that distinct tags
// give distinct images: use the run prefix to keep parallel test packages apart.
func BuildTestInit(t testing.TB, tag string) string {
	t.Helper()
	out := filepath.Join(t.TempDir(), "testinit")
	cmd := exec.Command("go", "build", "-trimpath", "-ldflags", "-s -w -X main.buildTag="+tag,
		"-o", out, "github.com/claudebox/claudebox/internal/testinit")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("building testinit: %v\n%s", err, b)
	}
	return out
}
