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
	bin := filepath.Join(dir, "libexec", "claudebox", "claudebox")
	defer func(old string) { bootBinary = old }(bootBinary)
	bootBinary = bin
	if !h.Kernel.SystemdIsInit() {
		t.Fatal("systemd as PID 1 not seen")
	}
	up, err := h.planUnit()
	if err != nil || !up.write {
		t.Fatalf("a missing unit must be written: %+v %v", up, err)
	}
	c := string(up.content)
	// The unit runs the installed, root-owned copy, quoted; never the binary that ran init.
	exe, _ := os.Executable()
	if strings.Contains(c, exe) {
		t.Errorf("unit runs %s, the binary that ran init:\n%s", exe, c)
	}
	for _, w := range []string{"Type=simple", "Restart=always", "StartLimitIntervalSec=0", "After=incus.service", `ExecStart="` + bin + `" host agent --network "claudenet"`, "WantedBy=multi-user.target"} {
		if !strings.Contains(c, w) {
			t.Errorf("unit lacks %q:\n%s", w, c)
		}
	}
	if !up.binWrite {
		t.Fatal("a missing installed binary must be installed")
	}
	if err := os.WriteFile(up.path, up.content, 0o644); err != nil {
		t.Fatal(err)
	}
	if os.Geteuid() == 0 {
		if err := installBinary(up.src, up.bin); err != nil {
			t.Fatal(err)
		}
		st, err := os.Stat(bin)
		if err != nil || st.Mode().Perm() != 0o755 || !ownedByRoot(st) || !sameFile(exe, bin) {
			t.Fatalf("installed copy: %v %v", st, err)
		}
		if up, _ := h.planUnit(); up.write {
			t.Fatal("an identical unit and binary are rewritten")
		}
		// A copy someone else could have written is not trusted.
		if err := os.Chmod(bin, 0o777); err != nil {
			t.Fatal(err)
		}
		if up, _ := h.planUnit(); !up.binWrite {
			t.Fatal("a world-writable installed copy is kept")
		}
		_ = os.Chmod(bin, 0o755)
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
	if _, err := os.Stat(bin); !os.IsNotExist(err) {
		t.Fatal("installed binary still there")
	}
}

func TestSystemdQuote(t *testing.T) {
	for in, want := range map[string]string{
		"/usr/local/libexec/claudebox/claudebox": `"/usr/local/libexec/claudebox/claudebox"`,
		`/a b/"c"%$`:                             `"/a b/\"c\"%%$$"`,
	} {
		if got := systemdQuote(in); got != want {
			t.Errorf("systemdQuote(%q) = %s, want %s", in, got, want)
		}
	}
}
