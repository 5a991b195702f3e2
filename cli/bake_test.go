package cli

import (
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/claudebox/claudebox/boxcore"
	"github.com/claudebox/claudebox/boxcore/incus"
	"github.com/claudebox/claudebox/boxcore/templates"
	"github.com/claudebox/claudebox/internal/cloudimage"
	"github.com/claudebox/claudebox/internal/testenv"
)

// TestBakeVerbs: `templates bake` through the command line on the real daemon, with the
// blank template (its first boot is the shortest; TestBake in boxcore proves the claude
// one): bad input changes nothing (exit 2), a daemon that cannot be reached is exit 1, a bake
// is made once and then up to date, `new` mints from it and `info` names it, a stale bake is
// not used (and `new` says so), and --refresh replaces the image.
func TestBakeVerbs(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	img, err := cloudimage.Ensure(ctx, h.c, cloudimage.Default(), testLog{t})
	if err != nil {
		t.Fatalf("cloud image: %v", err)
	}
	t.Setenv(boxcore.LocalImageEnv, img.Alias)
	t.Setenv(boxcore.BakePrefixEnv, "claudebox-test/bake-cli-"+testenv.RunID()+"/")
	alias := boxcore.BakeAlias("blank")
	t.Cleanup(func() {
		for _, tmpl := range templates.Names() {
			if im, err := h.c.ImageByAlias(context.Background(), boxcore.BakeAlias(tmpl)); err == nil {
				_ = h.c.DeleteImage(context.Background(), im.Fingerprint)
			}
		}
	})
	noBake := func(why string) {
		t.Helper()
		if _, err := h.c.ImageAlias(ctx, alias); !errors.Is(err, incus.ErrNotFound) {
			t.Fatalf("%s made %s: %v", why, alias, err)
		}
	}

	h.expect(0, "claude (default)", "templates")
	h.expect(0, "claude (default)", "templates", "list")
	h.unchanged(2, `no template named "nosuch"`, "templates", "bake", "nosuch")
	h.unchanged(2, "unexpected argument", "templates", "bake", "blank", "claude")
	h.unchanged(2, `unknown command "templates bak"`, "templates", "bak")
	noBake("bad input")

	// A remote whose daemon does not answer: the daemon went wrong, exit 1, nothing made.
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "config.yml"), []byte("remotes:\n  dead:\n    addr: https://"+addr+"\n    protocol: incus\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Setenv("INCUS_CONF", dir)
	h.unchanged(1, addr, "templates", "bake", "blank", "--remote", "dead")
	noBake("an unreachable daemon")
	os.Unsetenv("INCUS_CONF")

	r := h.expect(0, alias+": baked (no bake yet)", "templates", "bake", "blank")
	t.Logf("templates bake blank:\n%s%s", r.stderr, r.stdout)
	first, err := h.c.ImageByAlias(ctx, alias)
	if err != nil || first.Properties[boxcore.PropBakeTemplate] != "blank" || first.Properties[boxcore.PropBakeBaseFP] != img.Fingerprint {
		t.Fatalf("after the bake: %+v %v", first, err)
	}
	h.expect(0, alias+" is up to date", "templates", "bake", "blank")

	box := h.name("baked")
	h.removeLater(box)
	r = h.run("new", "--name", box, "--container", "--template", "blank", "--verbose")
	if r.code != 0 || !strings.Contains(r.stderr, "from a bake: no first boot to run") || !strings.Contains(r.stdout, "from the bake "+alias) {
		t.Fatalf("new from the bake: exit %d\n%s\n%s", r.code, r.stdout, r.stderr)
	}
	h.tagForSweep(box)
	t.Logf("new from the bake:\n%s%s", r.stderr, r.stdout)
	h.expect(0, "bake: "+alias+" (image "+first.Fingerprint[:12], "info", box)
	h.expect(0, "blank", "exec", box, "--user", "root", "--", "sh", "-c", "id claude && hostname && echo blank")

	// The base image under another name is another base: the bake is stale, not used.
	other := "claudebox-test/bake-cli-base-" + testenv.RunID()
	if err := h.c.CreateImageAlias(ctx, other, img.Fingerprint); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = h.c.DeleteImageAlias(context.Background(), other) })
	t.Setenv(boxcore.LocalImageEnv, other)
	cold := h.name("cold")
	h.removeLater(cold)
	r = h.run("new", "--name", cold, "--container", "--template", "blank")
	if r.code != 0 || !strings.Contains(r.stderr, "the bake of template blank is stale (the base image is now "+other) ||
		!strings.Contains(r.stderr, "the blank template's first boot") {
		t.Fatalf("new with a stale bake: exit %d\n%s\n%s", r.code, r.stdout, r.stderr)
	}
	h.tagForSweep(cold)
	if in, _, err := h.c.Instance(ctx, cold); err != nil || in.Config[boxcore.TagBake] != "" || in.Config[boxcore.TagFrom] != other {
		t.Fatalf("a stale bake was used: %v %v", in.Config, err)
	}
	t.Setenv(boxcore.LocalImageEnv, img.Alias)

	r = h.expect(0, alias+": baked (asked to refresh)", "templates", "bake", "blank", "--refresh")
	if !strings.Contains(r.stdout, "replaced image "+first.Fingerprint[:12]+" (deleted)") {
		t.Fatalf("refresh did not replace the old image:\n%s", r.stdout)
	}
	if _, err := h.c.Image(ctx, first.Fingerprint); !errors.Is(err, incus.ErrNotFound) {
		t.Fatalf("the replaced bake is still there: %v", err)
	}
}
