package boxcore

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/claudebox/claudebox/boxcore/incus"
)

// HostLockPath is the lock `host init`, `host teardown` and a drill run hold while they change
// the host stack, so that one never judges or converges what the other is halfway through.
const HostLockPath = "/run/claudebox-host.lock"

// hostLockPath is HostLockPath for the host's own daemon; a daemon at another socket (a test
// cluster's member, with its own network namespace and so its own kernel state) has a lock of
// its own, so that it neither waits for nor blocks the host's.
func hostLockPath() string { return perDaemon(HostLockPath) }

// perDaemon keeps path for the default Incus socket and gives any other socket its own file.
func perDaemon(path string) string {
	sock := incus.LocalSocket()
	if sock == incus.DefaultSocket {
		return path
	}
	sum := sha256.Sum256([]byte(sock))
	ext := filepath.Ext(path)
	return strings.TrimSuffix(path, ext) + "-" + hex.EncodeToString(sum[:6]) + ext
}

// HostLockWait is how long LockHost waits for another holder.
const HostLockWait = 30 * time.Second

// HostLockedError: another process held the host lock for all of HostLockWait.
type HostLockedError struct {
	Path   string
	Holder string // "pid N" as the holder wrote it, if readable
	Waited time.Duration
}

func (e *HostLockedError) Error() string {
	who := "another claudebox process"
	if e.Holder != "" {
		who += " (" + e.Holder + ")"
	}
	return fmt.Sprintf("%s has held the host lock %s for %s (host init, teardown or a drill run)", who, e.Path, e.Waited)
}

// LockHost takes the host lock (an exclusive flock on HostLockPath), waiting up to
// HostLockWait or until ctx ends. unlock releases it; the kernel also releases it when the
// process dies, so a killed holder never leaves it stuck. SwitchOff does not take it: the drill
// holds it around its whole run.
func LockHost(ctx context.Context) (unlock func(), err error) {
	return lockFile(ctx, hostLockPath(), HostLockWait)
}

// LockNetwork takes the lock of one stack's network: the box verbs hold it while they bind a
// started box's port, and a drill holds it for its whole run on that network, so a `new`
// never re-applies a stack in the middle of a seeded hole — while boxes of other stacks (test
// stacks) bind theirs undisturbed.
func LockNetwork(ctx context.Context, network string) (unlock func(), err error) {
	return lockFile(ctx, netLockPath(network), HostLockWait)
}

// netLockPath is the lock file of network's lock, per daemon: each member of a cluster has
// its own kernel and its own /run. (The test cluster's members share one /run; one file for
// all of them had a drill on m3 give up after 30 s behind the other members' agents, in a
// purged CI run.)
func netLockPath(network string) string {
	return perDaemon("/run/claudebox-net-" + network + ".lock")
}

func lockFile(ctx context.Context, path string, wait time.Duration) (func(), error) {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("host lock: %w", err)
	}
	start := time.Now()
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		if err == nil {
			break
		}
		if !errors.Is(err, unix.EWOULDBLOCK) {
			f.Close()
			return nil, fmt.Errorf("host lock %s: %w", path, err)
		}
		if time.Since(start) >= wait {
			holder, _ := os.ReadFile(path)
			f.Close()
			return nil, &HostLockedError{Path: path, Holder: string(holder), Waited: wait}
		}
		select {
		case <-ctx.Done():
			f.Close()
			return nil, fmt.Errorf("waiting for the host lock %s: %w", path, context.Cause(ctx))
		case <-tick.C:
		}
	}
	// Note who holds it, for the next waiter's message (information only: the flock is the lock).
	_ = f.Truncate(0)
	_, _ = f.WriteAt([]byte(fmt.Sprintf("pid %d", os.Getpid())), 0)
	return func() {
		_ = f.Truncate(0)
		_ = unix.Flock(int(f.Fd()), unix.LOCK_UN)
		f.Close()
	}, nil
}
