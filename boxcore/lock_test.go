package boxcore

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestLockFile: a second taker waits, gets it once the first lets go, and gives up with a
// HostLockedError naming the holder after the wait; a cancelled context ends the wait.
func TestLockFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "host.lock")
	ctx := context.Background()
	unlock, err := lockFile(ctx, path, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	_, err = lockFile(ctx, path, 300*time.Millisecond)
	var le *HostLockedError
	if !errors.As(err, &le) || !strings.Contains(le.Holder, "pid ") || time.Since(start) < 300*time.Millisecond {
		t.Fatalf("second taker: %v after %s, want a HostLockedError after the wait", err, time.Since(start))
	}
	cctx, cancel := context.WithTimeout(ctx, 150*time.Millisecond)
	defer cancel()
	if _, err := lockFile(cctx, path, time.Minute); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("cancelled wait: %v", err)
	}
	go func() { time.Sleep(200 * time.Millisecond); unlock() }()
	unlock2, err := lockFile(ctx, path, 5*time.Second)
	if err != nil {
		t.Fatalf("after the holder let go: %v", err)
	}
	unlock2()
}

// TestLockFileKilledHolder: a holder that is killed leaves no stale lock.
func TestLockFileKilledHolder(t *testing.T) {
	if _, err := exec.LookPath("flock"); err != nil {
		t.Skip("no flock(1)")
	}
	path := filepath.Join(t.TempDir(), "host.lock")
	if err := os.WriteFile(path, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	// -o: only flock itself holds the lock (its command does not inherit it).
	cmd := exec.Command("flock", "-o", "-x", path, "sleep", "5")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(200 * time.Millisecond)
	if _, err := lockFile(context.Background(), path, 200*time.Millisecond); err == nil {
		t.Fatal("took the lock while flock(1) held it")
	}
	_ = cmd.Process.Kill()
	_ = cmd.Wait()
	unlock, err := lockFile(context.Background(), path, time.Second)
	if err != nil {
		t.Fatalf("after the holder was killed: %v", err)
	}
	unlock()
}

// The host's daemon keeps the one host lock; a daemon at another socket (a test cluster's
// member, in its own network namespace) gets a lock of its own, one per socket.
func TestLockPerDaemon(t *testing.T) {
	t.Setenv("INCUS_SOCKET", "")
	t.Setenv("INCUS_DIR", "")
	if got := hostLockPath(); got != HostLockPath {
		t.Errorf("default daemon: %s, want %s", got, HostLockPath)
	}
	t.Setenv("INCUS_DIR", "/var/lib/claudebox-testcluster/r/m1/incus")
	a := hostLockPath()
	t.Setenv("INCUS_DIR", "/var/lib/claudebox-testcluster/r/m2/incus")
	b := hostLockPath()
	if a == HostLockPath || b == HostLockPath || a == b || !strings.HasPrefix(a, "/run/claudebox-host-") || !strings.HasSuffix(a, ".lock") {
		t.Errorf("members' locks: %s and %s (host's %s)", a, b, HostLockPath)
	}
}
