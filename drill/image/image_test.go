package image_test

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/claudebox/claudebox/boxcore/incus"
	"github.com/claudebox/claudebox/drill/image"
	"github.com/claudebox/claudebox/internal/testenv"
)

func TestBuild(t *testing.T) {
	bin := []byte("\x7fELF pretend static binary")
	a, h1, err := image.Build(bin)
	if err != nil {
		t.Fatal(err)
	}
	b, h2, _ := image.Build(bin)
	if !bytes.Equal(a, b) || h1 != h2 || len(h1) != 64 {
		t.Fatalf("not deterministic: %v %s %s", bytes.Equal(a, b), h1, h2)
	}
	if _, h3, _ := image.Build(append(bin, 'x')); h3 == h1 {
		t.Errorf("different binaries, same hash")
	}
	if got := image.Alias("cbt-x", h1); got != "cbt-x-"+h1[:16] {
		t.Errorf("alias %s", got)
	}
	entries := map[string]*tar.Header{}
	tr := tar.NewReader(bytes.NewReader(a))
	var meta, init []byte
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		entries[h.Name] = h
		switch h.Name {
		case "metadata.yaml":
			meta, _ = io.ReadAll(tr)
		case "rootfs/sbin/init":
			init, _ = io.ReadAll(tr)
		}
		if h.Uid != 0 || h.Gid != 0 || !h.ModTime.Equal(time.Unix(1700000000, 0)) {
			t.Errorf("%s: owner %d:%d time %v", h.Name, h.Uid, h.Gid, h.ModTime)
		}
	}
	if !bytes.Equal(init, bin) || entries["rootfs/sbin/init"].Mode != 0o755 {
		t.Errorf("/sbin/init: %q mode %o", init, entries["rootfs/sbin/init"].Mode)
	}
	for _, d := range []string{"dev", "proc", "sys", "tmp", "run", "etc", "root", "var"} {
		h := entries["rootfs/"+d+"/"]
		if h == nil || h.Typeflag != tar.TypeDir {
			t.Errorf("rootfs/%s/ missing", d)
		}
	}
	if entries["rootfs/tmp/"].Mode != 0o1777 {
		t.Errorf("/tmp mode %o", entries["rootfs/tmp/"].Mode)
	}
	if entries["rootfs/etc/hostname"] != nil {
		t.Errorf("has /etc/hostname")
	}
	m := string(meta)
	if !strings.Contains(m, "architecture: "+image.Arch()) || !strings.Contains(m, "creation_date: 1700000000") || !strings.Contains(m, h1) {
		t.Errorf("metadata.yaml:\n%s", m)
	}
}

// TestBoot imports a scratch image of testinit (first without alias, as a concurrent
// importer would), lets EnsureImage adopt it, boots a container from the alias, runs a
// command in it and stops it cleanly (fast: the init handles LXC's halt signal).
func TestBoot(t *testing.T) {
	c := testenv.RequireIncus(t)
	testenv.Sweep(t, c, "scratch")
	prefix := testenv.Prefix("scratch")
	bin := testenv.BuildTestInit(t, prefix)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()

	tarball, hash, err := image.BuildFile(bin)
	if err != nil {
		t.Fatal(err)
	}
	fp, err := c.ImportImage(ctx, bytes.NewReader(tarball), nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := c.DeleteImage(context.Background(), fp); err != nil && !errors.Is(err, incus.ErrNotFound) {
			t.Errorf("deleting image: %v", err)
		}
	})
	if fp != image.Fingerprint(tarball) {
		t.Errorf("fingerprint %s, want %s", fp, image.Fingerprint(tarball))
	}
	start := time.Now()
	alias, err := image.EnsureImage(ctx, c, bin, prefix)
	if err != nil {
		t.Fatal(err)
	}
	if alias != image.Alias(prefix, hash) {
		t.Errorf("alias %s", alias)
	}
	again, err := image.EnsureImage(ctx, c, bin, prefix)
	if err != nil || again != alias {
		t.Errorf("reuse: %s %v", again, err)
	}
	t.Logf("EnsureImage (adopt + reuse): %v", time.Since(start))
	img, err := c.ImageByAlias(ctx, alias)
	if err != nil || img.Fingerprint != fp || img.Properties["claudebox.hash"] != hash {
		t.Fatalf("image: %+v %v", img, err)
	}

	name := prefix + "-boot"
	start = time.Now()
	err = c.CreateInstance(ctx, incus.InstancesPost{Name: name, Profiles: []string{}, Config: testenv.Tag(),
		Devices: testenv.RootDisk(t, c), Start: true, Source: incus.InstanceSource{Type: "image", Alias: alias}}, nil)
	t.Cleanup(func() {
		ctx := context.Background()
		_ = c.SetState(ctx, name, "stop", true, 0)
		if err := c.DeleteInstance(ctx, name); err != nil && !errors.Is(err, incus.ErrNotFound) {
			t.Errorf("deleting %s: %v", name, err)
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("launch: %v", time.Since(start))
	st, err := c.InstanceState(ctx, name)
	if err != nil || st.Status != "Running" {
		t.Fatalf("state: %+v %v", st, err)
	}
	r, err := c.Exec(ctx, name, incus.ExecRequest{Command: []string{"/sbin/init", "tag"}})
	if err != nil || strings.TrimSpace(string(r.Stdout)) != prefix {
		t.Errorf("exec: %q %v", r.Stdout, err)
	}
	r, err = c.Exec(ctx, name, incus.ExecRequest{Command: []string{"/sbin/init", "stat", "/tmp"}})
	if err != nil || strings.TrimSpace(string(r.Stdout)) != "1777 0 0" {
		t.Errorf("/tmp: %q %v", r.Stdout, err)
	}
	start = time.Now()
	if err := c.SetState(ctx, name, "stop", false, 10*time.Second); err != nil {
		t.Fatalf("clean stop: %v", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("clean stop took %v: init ignored the halt signal", d)
	}
	t.Logf("clean stop: %v", time.Since(start))
}

// A new build's image replaces the old one: PruneImages removes every other image under the
// prefix (older than the age given), and keeps the current one.
func TestPruneImages(t *testing.T) {
	c := testenv.RequireIncus(t)
	ctx := context.Background()
	prefix := testenv.Prefix("prune")
	var aliases []string
	for _, tag := range []string{prefix + "-1", prefix + "-2"} {
		alias, err := image.EnsureImage(ctx, c, testenv.BuildTestInit(t, tag), prefix)
		if err != nil {
			t.Fatal(err)
		}
		aliases = append(aliases, alias)
	}
	t.Cleanup(func() { image.PruneImages(context.Background(), c, prefix, "", -time.Hour) })
	if aliases[0] == aliases[1] {
		t.Fatal("two builds gave one alias")
	}
	if _, err := c.ImageAlias(ctx, aliases[0]); err != nil {
		t.Fatalf("a fresh image was pruned at once: %v", err)
	}
	if n := image.PruneImages(ctx, c, prefix, aliases[1], -time.Hour); n != 1 {
		t.Fatalf("pruned %d images, want 1", n)
	}
	if _, err := c.ImageAlias(ctx, aliases[0]); !errors.Is(err, incus.ErrNotFound) {
		t.Fatalf("old image still there: %v", err)
	}
	if _, err := c.ImageAlias(ctx, aliases[1]); err != nil {
		t.Fatalf("current image pruned: %v", err)
	}
}

// A dynamically linked binary is refused before any image is made (every box would fail to
// exec it as init); a static one is taken.
func TestBuildFileRefusesDynamicBinaries(t *testing.T) {
	if _, _, err := image.BuildFile("/bin/true"); err == nil || !strings.Contains(err.Error(), "linked dynamically") {
		t.Errorf("BuildFile(/bin/true): %v, want a refusal naming dynamic linking", err)
	}
	static := testenv.BuildTestInit(t, testenv.Prefix("static"))
	if _, _, err := image.BuildFile(static); err != nil {
		t.Errorf("BuildFile(static test init): %v", err)
	}
}
