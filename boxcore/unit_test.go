package boxcore

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// The boot unit (systemd hosts only; none runs here) is planned from a file comparison, and
// its content re-applies the firewall of the stack's bridge after Incus is up.
func TestBootUnitPlan(t *testing.T) {
	dir := t.TempDir()
	proc := filepath.Join(dir, "proc")
	if err := os.MkdirAll(filepath.Join(proc, "1"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(proc, "1", "comm"), []byte("systemd\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	h := &Host{Stack: DefaultStack(), Kernel: Kernel{Proc: proc, Sys: dir, UnitDir: dir}}
	if !h.Kernel.SystemdIsInit() {
		t.Fatal("systemd as PID 1 not seen")
	}
	up, err := h.planUnit()
	if err != nil || !up.write {
		t.Fatalf("a missing unit must be written: %+v %v", up, err)
	}
	c := string(up.content)
	for _, w := range []string{"Type=oneshot", "After=incus.service", "host firewall --network claudenet", "WantedBy=multi-user.target"} {
		if !strings.Contains(c, w) {
			t.Errorf("unit lacks %q:\n%s", w, c)
		}
	}
	if err := os.WriteFile(up.path, up.content, 0o644); err != nil {
		t.Fatal(err)
	}
	if up, _ := h.planUnit(); up.write {
		t.Fatal("an identical unit is rewritten")
	}
	if err := os.WriteFile(up.path, []byte("stale"), 0o644); err != nil {
		t.Fatal(err)
	}
	if up, _ := h.planUnit(); !up.write {
		t.Fatal("a stale unit is kept")
	}
	if removed, err := h.removeUnit(); err != nil || !removed {
		t.Fatalf("removeUnit: %v %v", removed, err)
	}
	if _, err := os.Stat(up.path); !os.IsNotExist(err) {
		t.Fatal("unit still there")
	}
}
