package boxcore

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// host check says whether the kernel confines the boxes with AppArmor: enabled, disabled, or
// not in the kernel (this project's machines) — information, since claudebox cannot switch it.
func TestAppArmorState(t *testing.T) {
	dir := t.TempDir()
	on, off := filepath.Join(dir, "on"), filepath.Join(dir, "off")
	_ = os.WriteFile(on, []byte("Y\n"), 0o644)
	_ = os.WriteFile(off, []byte("N\n"), 0o644)
	for path, want := range map[string]string{on: "enabled", off: "disabled (N)", filepath.Join(dir, "none"): "not in this kernel"} {
		if got := appArmorState(path); !strings.HasPrefix(got, want) {
			t.Errorf("%s: %q, want %q...", filepath.Base(path), got, want)
		}
	}
	if got := appArmorState(appArmorEnabledFile); got == "" {
		t.Error("no reading on this machine")
	}
}
