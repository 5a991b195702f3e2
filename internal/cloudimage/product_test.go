package cloudimage

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/claudebox/claudebox/boxcore/incus"
	"github.com/claudebox/claudebox/internal/testenv"
)

// The product's wording of a missing debootstrap says how to install it, not "make setup" only.
func TestMissingToolsSaysWhatToInstall(t *testing.T) {
	t.Setenv("PATH", t.TempDir())
	err := MissingTools()
	if err == nil || !strings.Contains(err.Error(), "sudo apt-get install debootstrap") {
		t.Fatalf("MissingTools with no debootstrap on PATH: %v", err)
	}
	t.Setenv("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
	if _, lerr := os.Stat("/usr/sbin/debootstrap"); lerr == nil {
		if err := MissingTools(); err != nil {
			t.Fatalf("debootstrap is installed, yet: %v", err)
		}
	}
}

// tinyImage imports a minimal image (metadata only, empty rootfs) that claims recipe hash,
// standing in for an older build under the alias.
func tinyImage(t *testing.T, c *incus.Client, recipe string) string {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	md := fmt.Sprintf("architecture: %s\ncreation_date: %d\nproperties:\n  description: claudebox test stand-in %s\n  %s: %s\n",
		incusArch(DebArch()), time.Now().Unix(), testenv.RunID(), RecipeProperty, recipe)
	_ = tw.WriteHeader(&tar.Header{Name: "metadata.yaml", Mode: 0o644, Size: int64(len(md)), ModTime: time.Now()})
	_, _ = tw.Write([]byte(md))
	_ = tw.WriteHeader(&tar.Header{Name: "rootfs/", Typeflag: tar.TypeDir, Mode: 0o755, ModTime: time.Now()})
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	fp, err := c.ImportImage(context.Background(), &buf, nil)
	if err != nil {
		t.Fatalf("importing the stand-in image: %v", err)
	}
	t.Cleanup(func() { _ = c.DeleteImage(context.Background(), fp) })
	return fp
}

// `claudebox image build`'s core against the real daemon: into a test alias, from the cache the
// tests already keep (Ensure builds it once); then idempotent; then an alias of another recipe
// is moved to this one and the image it left (no other alias) is deleted.
func TestBuildAliasRealDaemon(t *testing.T) {
	c := testenv.RequireIncus(t)
	ctx := context.Background()
	r := Default()
	ens, err := Ensure(ctx, c, r, testLogger{t})
	if err != nil {
		t.Fatalf("the test image: %v", err)
	}
	alias := "claudebox-test/build-" + testenv.RunID()
	t.Cleanup(func() { _ = c.DeleteImageAlias(context.Background(), alias) })
	noTools := func() error { return errors.New("no debootstrap here") }

	res, err := BuildAlias(ctx, c, r, AliasOptions{Alias: alias, NeedTools: noTools}, testLogger{t})
	if err != nil {
		t.Fatalf("BuildAlias from the cache: %v", err)
	}
	if res.Built || res.UpToDate || res.Cached != CachePath(r.Hash()) || res.Fingerprint != ens.Fingerprint {
		t.Fatalf("first BuildAlias: %+v (the test image is %s)", res, ens.Fingerprint)
	}
	img, err := c.ImageByAlias(ctx, alias)
	if err != nil || img.Properties[RecipeProperty] != r.Hash() || img.Type != "container" {
		t.Fatalf("the alias: %+v, %v", img, err)
	}
	t.Logf("imported from the cache in %s", res.ImportTime.Round(time.Millisecond))

	res, err = BuildAlias(ctx, c, r, AliasOptions{Alias: alias, NeedTools: noTools}, testLogger{t})
	if err != nil || !res.UpToDate || res.Fingerprint != ens.Fingerprint {
		t.Fatalf("second BuildAlias is not a no-op: %+v, %v", res, err)
	}

	// An older build under the alias: replaced, and deleted since nothing else names it.
	if err := c.DeleteImageAlias(ctx, alias); err != nil {
		t.Fatal(err)
	}
	old := tinyImage(t, c, "0000-an-older-recipe")
	if err := c.CreateImageAlias(ctx, alias, old); err != nil {
		t.Fatal(err)
	}
	res, err = BuildAlias(ctx, c, r, AliasOptions{Alias: alias, NeedTools: noTools}, testLogger{t})
	if err != nil || res.UpToDate || res.Replaced != old || !res.Removed {
		t.Fatalf("replacing an older image: %+v, %v", res, err)
	}
	if a, err := c.ImageAlias(ctx, alias); err != nil || a.Target != ens.Fingerprint {
		t.Fatalf("the alias after the replacement: %+v, %v", a, err)
	}
	if _, err := c.Image(ctx, old); !errors.Is(err, incus.ErrNotFound) {
		t.Fatalf("the replaced image is still there: %v", err)
	}
	// The test image's own alias names the same image: never deleted along the way.
	if _, err := c.ImageAlias(ctx, ens.Alias); err != nil {
		t.Fatalf("the test image's alias: %v", err)
	}
}

// With nothing cached, the build needs debootstrap: NeedTools is asked first and its error
// stops everything before any alias is made.
func TestBuildAliasNeedsToolsWhenNothingIsCached(t *testing.T) {
	c := testenv.RequireIncus(t)
	ctx := context.Background()
	t.Setenv("CLAUDEBOX_IMAGE_CACHE", filepath.Join(t.TempDir(), "cache"))
	alias := "claudebox-test/notools-" + testenv.RunID()
	t.Cleanup(func() { _ = c.DeleteImageAlias(context.Background(), alias) })
	asked := false
	_, err := BuildAlias(ctx, c, Default(), AliasOptions{Alias: alias, NeedTools: func() error {
		asked = true
		return errors.New("debootstrap is not installed")
	}}, testLogger{t})
	if !asked || err == nil || !strings.Contains(err.Error(), "debootstrap is not installed") {
		t.Fatalf("asked %v, err %v", asked, err)
	}
	if _, err := c.ImageAlias(ctx, alias); !errors.Is(err, incus.ErrNotFound) {
		t.Fatalf("a failed build made the alias: %v", err)
	}
}

type testLogger struct{ t *testing.T }

func (l testLogger) Write(p []byte) (int, error) {
	l.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}
