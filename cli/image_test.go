package cli

import (
	"bytes"
	"context"
	"errors"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/claudebox/claudebox/boxcore"
	"github.com/claudebox/claudebox/boxcore/incus"
	"github.com/claudebox/claudebox/internal/cloudimage"
	"github.com/claudebox/claudebox/internal/testenv"
	"github.com/claudebox/claudebox/internal/teststack"
)

// The README's first-run path on a host with no image server: `image build` into an alias
// (here a test alias, through $CLAUDEBOX_IMAGE_ALIAS, imported from the cache the tests keep),
// idempotent; then a container `new` without --image picks that alias, and a piped `new`
// prints one line per stage as it happens, the first boot naming its template.
func TestImageBuildThenNewWithoutImage(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	// The tarball cache the other tests use (built once by Ensure, reused here).
	if _, err := cloudimage.Ensure(ctx, h.c, cloudimage.Default(), testLog{t}); err != nil {
		t.Fatalf("cloud image: %v", err)
	}
	alias := "claudebox-test/cloud-" + testenv.RunID()
	t.Setenv(boxcore.LocalImageEnv, alias)
	t.Cleanup(func() { _ = h.c.DeleteImageAlias(context.Background(), alias) })

	t0 := time.Now()
	r := h.expect(0, alias+": imported from the cache", "image", "build")
	t.Logf("image build (from the cache): %.1fs\n%s%s", time.Since(t0).Seconds(), r.stderr, r.stdout)
	if !strings.Contains(r.stdout, "a container 'claudebox new' without --image now uses it") {
		t.Fatalf("image build does not say what it is for:\n%s", r.stdout)
	}
	img, err := h.c.ImageByAlias(ctx, alias)
	if err != nil || img.Properties[cloudimage.RecipeProperty] != cloudimage.Default().Hash() {
		t.Fatalf("after image build: %+v %v", img, err)
	}
	h.expect(0, alias+" is up to date", "image", "build")
	h.unchanged(2, "want a local alias", "image", "build", "--alias", "images:debian/12")

	name := h.name("noimg")
	h.removeLater(name)
	t0 = time.Now()
	r = h.run("new", "--name", name, "--container", "--template", "blank")
	took := time.Since(t0)
	if r.code != 0 {
		t.Fatalf("new without --image: exit %d\n%s\n%s", r.code, r.stdout, r.stderr)
	}
	h.tagForSweep(name)
	t.Logf("new --template blank without --image: %.1fs\nstderr:\n%s", took.Seconds(), r.stderr)
	in, _, err := h.c.Instance(ctx, name)
	if err != nil || in.Config[boxcore.TagFrom] != alias || in.Config["volatile.base_image"] != img.Fingerprint {
		t.Fatalf("new without --image did not use %s: from %q base %q (%v)", alias, in.Config[boxcore.TagFrom], in.Config["volatile.base_image"], err)
	}

	// One line per stage, in order, each with its time; nothing drawn for a terminal. The
	// image's preparation (unpacking into the pool) has one line of its own when it happens.
	stages := []string{"create", "start", "first boot", "ready"}
	var lines []string
	for _, l := range strings.Split(strings.TrimSpace(r.stderr), "\n") {
		if strings.HasPrefix(l, "new: ") && !strings.HasPrefix(l, "new: download: ") {
			lines = append(lines, l)
		}
	}
	if n := strings.Count(r.stderr, "new: download: "); n > 1 {
		t.Errorf("%d download lines, want at most one:\n%s", n, r.stderr)
	}
	if len(lines) != len(stages) || strings.Contains(r.stderr, "\r") || strings.Contains(r.stderr, "\033[") {
		t.Fatalf("piped new: want %d stage lines %v, got:\n%q", len(stages), stages, r.stderr)
	}
	stamp := regexp.MustCompile(`\((\d+\.\d)s\)$`)
	for i, st := range stages {
		if !strings.HasPrefix(lines[i], "new: "+st+": ") || !stamp.MatchString(lines[i]) {
			t.Errorf("line %d: %q, want stage %q with its time", i, lines[i], st)
		}
	}
	if !strings.Contains(lines[0], "from "+alias) {
		t.Errorf("the create line does not name the image: %q", lines[0])
	}
	if !strings.Contains(lines[2], "the blank template's first boot") || strings.Contains(r.stderr, "Claude Code") {
		t.Errorf("the first-boot line does not name the blank template: %q", lines[2])
	}
	h.expect(0, "", "rm", name, "--yes", "--force")
}

// The stage lines appear as the stages begin, not at the end: a Progress call prints at once.
func TestPipedProgressPrintsAsItHappens(t *testing.T) {
	var errb bytes.Buffer
	c := &Ctx{Env: &Env{Stderr: &errb}}
	p := pipedProgress(c)
	p(boxcore.Progress{Stage: "create", Percent: -1, Text: "creating w from img"})
	if !strings.HasPrefix(errb.String(), "new: create: creating w from img (") {
		t.Fatalf("after create: %q", errb.String())
	}
	p(boxcore.Progress{Stage: "download", Percent: 10, Text: "10%"})
	p(boxcore.Progress{Stage: "download", Percent: 50, Text: "50%"})
	p(boxcore.Progress{Stage: "start", Percent: -1, Text: "starting w"})
	if n := strings.Count(errb.String(), "\n"); n != 3 || strings.Count(errb.String(), "new: download:") != 1 {
		t.Fatalf("want create, one download line, start:\n%s", errb.String())
	}
}

// A missing image and an unreachable image server are refused before anything is made,
// exit 2, with what to do instead.
func TestNewImageMissingOrUnreachable(t *testing.T) {
	h := newHarness(t)
	y := h.name("img")
	h.removeLater(y)

	missing := "claudebox-test/none-" + testenv.RunID()
	h.unchanged(2, "no image \""+missing+"\" on this daemon: pick one from 'incus image list'",
		"new", "--name", y, "--container", "--image", missing)
	h.unchanged(2, "or run 'sudo claudebox image build'", "new", "--name", y, "--container", "--image", missing)
	// The local image `image build` makes, missing: build it.
	t.Setenv(boxcore.LocalImageEnv, missing)
	h.unchanged(2, "no image \""+missing+"\" on this daemon: run 'sudo claudebox image build'",
		"new", "--name", y, "--container", "--image", missing)
	h.gone(y, "new with a missing image")

	// A remote on a closed loopback port: the image server cannot be reached.
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	dir := t.TempDir()
	cfg := "remotes:\n  dead:\n    addr: https://" + addr + "\n    protocol: simplestreams\n    public: true\n  deadincus:\n    addr: https://" + addr + "\n    protocol: incus\n"
	if err := os.WriteFile(filepath.Join(dir, "config.yml"), []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Setenv("INCUS_CONF", dir)
	for _, ref := range []string{"dead:debian/12/cloud", "deadincus:debian12"} {
		t0 := time.Now()
		before := h.state()
		r := h.run("new", "--name", y, "--container", "--image", ref)
		if r.code != 2 || !strings.Contains(r.stderr, "the image server of \""+ref+"\" is unreachable") ||
			!strings.Contains(r.stderr, addr) || !strings.Contains(r.stderr, "connection refused") ||
			!strings.Contains(r.stderr, "claudebox image build") || strings.Contains(r.stderr, "operation") {
			t.Fatalf("%s: exit %d, want 2 naming the unreachable server:\n%s", ref, r.code, r.stderr)
		}
		if after := h.state(); after != before {
			t.Fatalf("%s: a refused new changed the daemon:\n%s\n---\n%s", ref, before, after)
		}
		h.gone(y, "new with an unreachable image server")
		t.Logf("%s: refused in %s: %s", ref, time.Since(t0).Round(time.Millisecond), strings.TrimSpace(r.stderr))
	}
	if _, _, err := h.c.Instance(context.Background(), y); !errors.Is(err, incus.ErrNotFound) {
		t.Fatalf("instance %s exists: %v", y, err)
	}
}

// Without root, `image build` says it needs root (exit 2) and touches nothing.
func TestImageBuildNeedsRoot(t *testing.T) {
	c := testenv.RequireIncus(t)
	alias := "claudebox-test/noroot-" + testenv.RunID()
	cmd := exec.Command(teststack.Binary(t), "image", "build", "--alias", alias)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	out, err := cmd.CombinedOutput()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 2 || !strings.Contains(string(out), "image build: needs root") || !strings.Contains(string(out), "sudo") {
		t.Fatalf("image build as nobody: %v %s", err, out)
	}
	if _, err := c.ImageAlias(context.Background(), alias); !errors.Is(err, incus.ErrNotFound) {
		_ = c.DeleteImageAlias(context.Background(), alias)
		t.Fatalf("image build as nobody made the alias: %v", err)
	}
}
