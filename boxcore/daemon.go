package boxcore

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/claudebox/claudebox/boxcore/incus"
)

// RestartDaemon restarts the Incus daemon the way an admin or a package upgrade does, with
// every instance left running: systemd's incus.service where systemd runs it, else SIGTERM
// (Incus's "temporarily stopped": instances keep running) and the same command line again,
// detached, its output appended where the old daemon's went. It returns once the new daemon
// answers. Only the soak of the drill calls it: a restart makes Incus set every network up
// again, which is what the soak measures.
func RestartDaemon(ctx context.Context, c *incus.Client) error {
	if os.Geteuid() != 0 {
		return errors.New("restarting incusd needs root")
	}
	pid, argv, err := findDaemon()
	if err != nil {
		return err
	}
	if unit := systemdUnitOf(pid); unit != "" {
		if out, err := exec.CommandContext(ctx, "systemctl", "restart", unit).CombinedOutput(); err != nil {
			return fmt.Errorf("systemctl restart %s: %v: %s", unit, err, bytes.TrimSpace(out))
		}
		return waitDaemon(ctx, c, pid)
	}
	logPath, _ := os.Readlink(fmt.Sprintf("/proc/%d/fd/1", pid))
	env, _ := os.ReadFile(fmt.Sprintf("/proc/%d/environ", pid))
	if err := syscall.Kill(pid, syscall.SIGTERM); err != nil {
		return fmt.Errorf("stopping incusd (pid %d): %w", pid, err)
	}
	for deadline := time.Now().Add(60 * time.Second); processAlive(pid); time.Sleep(50 * time.Millisecond) {
		if time.Now().After(deadline) || ctx.Err() != nil {
			return fmt.Errorf("incusd (pid %d) did not stop within 60s of SIGTERM", pid)
		}
	}
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Env = splitEnv(env)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if strings.HasPrefix(logPath, "/") && !strings.HasPrefix(logPath, "/dev/") {
		if f, err := os.OpenFile(logPath, os.O_WRONLY|os.O_APPEND, 0); err == nil {
			defer f.Close()
			cmd.Stdout, cmd.Stderr = f, f
		}
	}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("starting incusd again (%s): %w", strings.Join(argv, " "), err)
	}
	_ = cmd.Process.Release()
	return waitDaemon(ctx, c, pid)
}

// findDaemon is the main incusd process: comm "incusd", argv[0] the incusd binary, its first
// argument a flag or nothing (its fork helpers run the same binary with a sub-command),
// serving the default directory (not a test cluster member with INCUS_DIR set elsewhere).
func findDaemon() (int, []string, error) {
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return 0, nil, err
	}
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		comm, _ := os.ReadFile(filepath.Join("/proc", e.Name(), "comm"))
		if strings.TrimSpace(string(comm)) != "incusd" {
			continue
		}
		raw, _ := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		argv := strings.Split(strings.TrimRight(string(raw), "\x00"), "\x00")
		// The daemon's argv[0] is its binary; its children rename themselves ("[lxc monitor]
		// /var/lib/incus/containers NAME" keeps comm "incusd") or run a sub-command.
		if len(argv) == 0 || filepath.Base(argv[0]) != "incusd" || (len(argv) > 1 && !strings.HasPrefix(argv[1], "-")) {
			continue
		}
		env, _ := os.ReadFile(filepath.Join("/proc", e.Name(), "environ"))
		if dir := envValue(env, "INCUS_DIR"); dir != "" && filepath.Clean(dir) != "/var/lib/incus" {
			continue
		}
		return pid, argv, nil
	}
	return 0, nil, errors.New("no incusd daemon process found")
}

// systemdUnitOf is the systemd service running pid ("" when none: no systemd, or started by hand).
func systemdUnitOf(pid int) string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	if err != nil {
		return ""
	}
	for _, l := range strings.Split(string(b), "\n") {
		for _, part := range strings.Split(l, "/") {
			if strings.HasPrefix(part, "incus") && strings.HasSuffix(part, ".service") {
				return part
			}
		}
	}
	return ""
}

func waitDaemon(ctx context.Context, c *incus.Client, old int) error {
	deadline := time.Now().Add(90 * time.Second)
	for {
		if pid, _, err := findDaemon(); err == nil && pid != old {
			if _, err := c.Server(ctx); err == nil {
				return nil
			}
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return errors.New("incusd did not answer within 90s of its restart")
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func processAlive(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	// A zombie (state Z after the ")") has exited.
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	return i < 0 || i+2 >= len(s) || s[i+2] != 'Z'
}

func envValue(env []byte, key string) string {
	for _, kv := range splitEnv(env) {
		if v, ok := strings.CutPrefix(kv, key+"="); ok {
			return v
		}
	}
	return ""
}

func splitEnv(env []byte) []string {
	var out []string
	for _, kv := range strings.Split(string(env), "\x00") {
		if kv != "" {
			out = append(out, kv)
		}
	}
	return out
}
