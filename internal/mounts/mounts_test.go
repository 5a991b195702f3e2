package mounts

import (
	"slices"
	"testing"
)

func TestUnescape(t *testing.T) {
	if got := Unescape(`/tmp/a\040b`); got != "/tmp/a b" {
		t.Errorf("Unescape = %q", got)
	}
}

// /proc is a mount point of every test machine; nothing is mounted under a fresh temp dir.
func TestUnder(t *testing.T) {
	if got := Under("/proc"); !slices.Contains(got, "/proc") {
		t.Errorf("Under(/proc) = %v, want /proc among them", got)
	}
	if got := Under(t.TempDir()); len(got) != 0 {
		t.Errorf("a fresh temp dir has mounts: %v", got)
	}
}
