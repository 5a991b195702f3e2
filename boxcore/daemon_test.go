package boxcore

import (
	"os"
	"path/filepath"
	"strconv"
	"testing"
)

// findDaemon picks the daemon, never one of its children that keep comm "incusd" (the lxc
// monitor of every running container renames its argv): SIGTERM to those kills a box.
func TestFindDaemonIsTheDaemon(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("reads other processes' cmdline and environ")
	}
	pid, argv, err := findDaemon()
	if err != nil {
		t.Skipf("no incusd running: %v", err)
	}
	if filepath.Base(argv[0]) != "incusd" {
		t.Fatalf("pid %d %q is not the daemon", pid, argv)
	}
	raw, _ := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cmdline")
	t.Logf("incusd pid %d: %q", pid, raw)
}
