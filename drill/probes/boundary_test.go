package probes

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

func TestStat(t *testing.T) {
	dir := t.TempDir()
	r := Run(t.Context(), Spec{Kind: KindStat, Target: dir})
	if r.Outcome != Open {
		t.Errorf("an existing directory: %s (%s), want open", r.Outcome, r.Evidence)
	}
	r = Run(t.Context(), Spec{Kind: KindStat, Target: filepath.Join(dir, "absent")})
	if r.Outcome != Dropped {
		t.Errorf("a missing file: %s (%s), want dropped", r.Outcome, r.Evidence)
	}
	if r := Run(t.Context(), Spec{Kind: KindStat}); r.Outcome != CheckFailed {
		t.Errorf("no target: %s, want check-failed", r.Outcome)
	}
}

// On a btrfs filesystem a root without a seccomp deny creates the subvolume (open) and the
// probe removes it; on a filesystem that is not btrfs the probe establishes nothing.
func TestSubvolume(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Fatal("needs root (a loop-mounted btrfs; make test runs as root)")
	}
	if r := Run(t.Context(), Spec{Kind: KindSubvolume, Target: t.TempDir()}); r.Outcome != CheckFailed && !onBtrfs(t, os.TempDir()) {
		t.Errorf("not btrfs: %s (%s), want check-failed", r.Outcome, r.Evidence)
	}
	img := filepath.Join(t.TempDir(), "btrfs.img")
	mnt := t.TempDir()
	if err := os.WriteFile(img, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(img, 128<<20); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("mkfs.btrfs", "-q", img).CombinedOutput(); err != nil {
		t.Fatalf("mkfs.btrfs (setup installs btrfs-progs): %v: %s", err, out)
	}
	if out, err := exec.Command("mount", "-o", "loop", img, mnt).CombinedOutput(); err != nil {
		t.Fatalf("mount: %v: %s", err, out)
	}
	t.Cleanup(func() { _ = exec.Command("umount", mnt).Run() })
	r := Run(t.Context(), Spec{Kind: KindSubvolume, Target: mnt})
	if r.Outcome != Open || !strings.Contains(r.Evidence, "created subvolume") {
		t.Fatalf("btrfs as root: %s (%s), want open", r.Outcome, r.Evidence)
	}
	left, _ := os.ReadDir(mnt)
	if len(left) != 0 {
		t.Errorf("the probe left %d entries behind (%v)", len(left), left[0].Name())
	}
}

func onBtrfs(t *testing.T, dir string) bool {
	out, _ := exec.Command("stat", "-f", "-c", "%T", dir).Output()
	return strings.TrimSpace(string(out)) == "btrfs"
}
