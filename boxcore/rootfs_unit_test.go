package boxcore

import (
	"os"
	"path/filepath"
	"testing"
)

// TestLacksCommand: a root without the command says so; a root with it (also behind an
// absolute symlink, resolved inside the root), an unmounted root and a missing container
// do not — and a symlink out of the root does not find the host's copy.
func TestLacksCommand(t *testing.T) {
	dir := t.TempDir()
	t.Setenv("INCUS_DIR", dir)
	root := func(name string) string {
		r := filepath.Join(dir, "containers", name, "rootfs")
		must(t, os.MkdirAll(r, 0o755))
		return r
	}
	file := func(p string) {
		must(t, os.MkdirAll(filepath.Dir(p), 0o755))
		must(t, os.WriteFile(p, nil, 0o755))
	}
	bare := root("bare")
	file(filepath.Join(bare, "sbin/init"))

	with := root("with")
	file(filepath.Join(with, "sbin/init"))
	file(filepath.Join(with, "usr/bin/cloud-init"))

	linked := root("linked") // a merged /usr: bin -> /usr/bin, absolute
	file(filepath.Join(linked, "usr/sbin/init"))
	file(filepath.Join(linked, "usr/bin/cloud-init"))
	must(t, os.Symlink("/usr/sbin", filepath.Join(linked, "sbin")))
	must(t, os.Remove(filepath.Join(linked, "usr/bin/cloud-init")))
	must(t, os.MkdirAll(filepath.Join(linked, "opt"), 0o755))
	file(filepath.Join(linked, "opt/cloud-init"))
	must(t, os.Symlink("/opt", filepath.Join(linked, "bin")))

	snap := root("snap") // on the PATH incus exec adds for snaps
	file(filepath.Join(snap, "sbin/init"))
	file(filepath.Join(snap, "snap/bin/cloud-init"))

	root("unmounted")

	escape := root("escape") // usr/local/bin leads out of the root, to a host copy
	file(filepath.Join(escape, "sbin/init"))
	file(filepath.Join(dir, "host/bin/cloud-init"))
	must(t, os.MkdirAll(filepath.Join(escape, "usr/local"), 0o755))
	must(t, os.Symlink("../../../../../host/bin", filepath.Join(escape, "usr/local/bin")))
	must(t, os.Symlink(filepath.Join(dir, "host/bin"), filepath.Join(escape, "usr/local/sbin")))

	for _, c := range []struct {
		name string
		want bool
	}{{"bare", true}, {"with", false}, {"linked", false}, {"snap", false}, {"unmounted", false}, {"missing", false}, {"escape", true}} {
		if got := lacksCommand(c.name, "cloud-init"); got != c.want {
			t.Errorf("lacksCommand(%s) = %v, want %v", c.name, got, c.want)
		}
	}
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// A box made once started is minting until its first start (which Incus records in
// volatile.last_state.power, kept by stops and snapshots); any other marker until new drops it.
func TestMinting(t *testing.T) {
	for _, c := range []struct {
		cfg  map[string]string
		want bool
	}{
		{map[string]string{}, false},
		{map[string]string{tagMint: "t"}, true},
		{map[string]string{tagMint: "t", "volatile.last_state.power": "RUNNING"}, true},
		{map[string]string{tagMint: "t" + mintMadeAtStart}, true},
		{map[string]string{tagMint: "t" + mintMadeAtStart, "volatile.last_state.power": "RUNNING"}, false},
		{map[string]string{tagMint: "t" + mintMadeAtStart, "volatile.last_state.power": "STOPPED"}, false},
	} {
		if got := Minting(c.cfg); got != c.want {
			t.Errorf("Minting(%v) = %v, want %v", c.cfg, got, c.want)
		}
	}
}
