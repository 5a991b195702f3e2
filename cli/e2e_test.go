package cli

import (
	"context"
	"errors"
	"maps"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/claudebox/claudebox/boxcore"
	"github.com/claudebox/claudebox/boxcore/incus"
	"github.com/claudebox/claudebox/boxcore/templates"
	"github.com/claudebox/claudebox/internal/cloudimage"
	"github.com/claudebox/claudebox/internal/testenv"
	"github.com/claudebox/claudebox/internal/teststack"
)

// TestClaudeBoxEndToEnd is issue 5's proof: `claudebox new` on the real stack mints a box
// where cloud-init finished, `claude --version` works for user claude, the global CLAUDE.md
// says what it must, and no credential exists; then the creds-free reuse workflow:
// snapshot → new --from → restore.
func TestClaudeBoxEndToEnd(t *testing.T) {
	c := testenv.RequireIncus(t)
	ctx := context.Background()
	img, err := cloudimage.Ensure(ctx, c, cloudimage.Default(), testLog{t})
	if err != nil {
		t.Fatalf("cloud image: %v", err)
	}
	h := &harness{t: t, c: c, stack: teststack.New(t, c, "e2e"), image: img.Alias}
	box, clone := h.name("e2e"), h.name("e2e2")

	r := h.run("new", "--name", box, "--container", "--image", img.Alias, "--template", "claude", "--verbose")
	if r.code != 0 {
		t.Fatalf("new: exit %d\n%s\n%s", r.code, r.stdout, r.stderr)
	}
	h.tagForSweep(box)
	t.Logf("new: %s", strings.TrimSpace(r.stdout))

	asClaude := func(name string, cmd ...string) string {
		t.Helper()
		res, err := c.Exec(ctx, name, incus.ExecRequest{Command: append([]string{"su", "-l", templates.User, "-c"}, strings.Join(cmd, " "))})
		if err != nil || res.ExitCode != 0 {
			t.Fatalf("%s as claude: exit %d err %v\n%s%s", cmd, res.ExitCode, err, res.Stdout, res.Stderr)
		}
		return string(res.Stdout)
	}
	root := func(name string, cmd ...string) (string, int) {
		t.Helper()
		res, err := c.Exec(ctx, name, incus.ExecRequest{Command: cmd})
		if err != nil {
			t.Fatalf("%v: %v", cmd, err)
		}
		return string(res.Stdout), res.ExitCode
	}

	t.Run("claude is installed, nobody is logged in", func(t *testing.T) {
		if v := asClaude(box, "claude", "--version"); !regexp.MustCompile(`\d+\.\d+\.\d+`).MatchString(v) {
			t.Fatalf("claude --version printed %q", v)
		}
		// Non-login shell, through claudebox exec as root, as the user.
		r := h.expect(0, "", "exec", box, "--user", "root", "--", "su", templates.User, "-c", "claude --version")
		if !strings.Contains(r.stdout, "Claude Code") {
			t.Fatalf("non-login claude --version: %q", r.stdout)
		}
		// claudebox exec itself runs as the user, with a login environment.
		r = h.expect(0, "", "exec", box, "--", "claude", "--version")
		if !strings.Contains(r.stdout, "Claude Code") {
			t.Fatalf("claudebox exec claude --version: %q", r.stdout)
		}
		md := asClaude(box, "cat", "~/.claude/CLAUDE.md")
		for _, p := range templates.ClaudeMDPoints() {
			if !strings.Contains(strings.ToLower(md), strings.ToLower(p)) {
				t.Errorf("CLAUDE.md lacks %q", p)
			}
		}
		out, _ := root(box, "sh", "-c", "find /home/claude /root -name '.credentials.json' -o -name '.git-credentials' -o -name hosts.yml -o -name '.netrc' | head; grep -rl 'oauth\\|sk-ant' /home/claude/.claude.json /home/claude/.claude 2>/dev/null | head")
		if strings.TrimSpace(out) != "" {
			t.Fatalf("credential-like files in a fresh box:\n%s", out)
		}
	})

	t.Run("shell logs in as claude", func(t *testing.T) {
		r := h.runIn("whoami; echo home=$HOME; claude --version; exit 7\n", "shell", box)
		if r.code != 7 || !strings.Contains(r.stdout, "claude") || !strings.Contains(r.stdout, "home=/home/claude") || !strings.Contains(r.stdout, "Claude Code") {
			t.Fatalf("shell: exit %d\nstdout: %s\nstderr: %s", r.code, r.stdout, r.stderr)
		}
	})

	t.Run("a failing first boot is reported and cleaned up", func(t *testing.T) {
		bs := &boxcore.Boxes{Client: c, Stack: h.stack, Version: "test"}
		failing := "#cloud-config\nruncmd:\n  - [sh, -c, 'echo claudebox-failing-on-purpose; exit 3']\n"
		kept := h.name("fail")
		cfg := map[string]string{"cloud-init.user-data": failing}
		maps.Copy(cfg, teststack.Tag())
		_, err := bs.New(ctx, boxcore.NewOptions{Name: kept, Image: img.Alias, Config: cfg, KeepFailed: true,
			FirstBoot: &boxcore.FirstBoot{Required: true, Timeout: 5 * time.Minute}})
		var fb *boxcore.FirstBootError
		if !errors.As(err, &fb) {
			t.Fatalf("new with failing user-data: %v", err)
		}
		if !strings.Contains(fb.Stage, "modules-final") || !strings.Contains(fb.LogTail, "claudebox-failing-on-purpose") || !strings.Contains(err.Error(), "kept for inspection") {
			t.Fatalf("first-boot error lacks the stage or the log tail:\n%v", err)
		}
		if _, _, err := c.Instance(ctx, kept); err != nil {
			t.Fatalf("--keep-failed did not keep the box: %v", err)
		}
		h.expect(0, "", "rm", kept, "--force")

		// Without --keep-failed (here: a first boot that cannot finish in time) nothing is left.
		gone := h.name("slow")
		_, err = bs.New(ctx, boxcore.NewOptions{Name: gone, Image: img.Alias, Config: maps.Clone(cfg),
			FirstBoot: &boxcore.FirstBoot{Required: true, Timeout: time.Second}})
		if !errors.As(err, &fb) || !strings.Contains(err.Error(), "did not finish within 1s") {
			t.Fatalf("new with a 1 s first-boot bound: %v", err)
		}
		if _, _, err := c.Instance(ctx, gone); !errors.Is(err, incus.ErrNotFound) {
			t.Fatalf("a failed new left its box: %v", err)
		}
	})

	t.Run("an interrupt during cloud-init is named as such and leaves nothing", func(t *testing.T) {
		bs := &boxcore.Boxes{Client: c, Stack: h.stack, Version: "test"}
		name := h.name("intr")
		cfg := map[string]string{"cloud-init.user-data": "#cloud-config\nruncmd:\n  - [sleep, '600']\n"}
		maps.Copy(cfg, teststack.Tag())
		ictx, cancel := context.WithCancelCause(ctx)
		defer cancel(nil)
		sigint := errors.New("SIGINT")
		var at time.Time
		_, err := bs.New(ictx, boxcore.NewOptions{Name: name, Image: img.Alias, Config: cfg,
			FirstBoot: &boxcore.FirstBoot{Required: true, Timeout: 15 * time.Minute},
			Progress: func(p boxcore.Progress) {
				if p.Stage == "first boot" {
					time.AfterFunc(3*time.Second, func() { at = time.Now(); cancel(sigint) })
				}
			}})
		var ie *boxcore.InterruptedError
		if !errors.As(err, &ie) || !errors.Is(err, sigint) || !strings.Contains(err.Error(), "interrupted (SIGINT) while waiting for the first boot") ||
			strings.Contains(err.Error(), "did not finish within") {
			t.Fatalf("interrupted first boot: %v", err)
		}
		t.Logf("interrupt during cloud-init: %v, %v after the interrupt", err, time.Since(at).Round(time.Millisecond))
		if _, _, err := c.Instance(ctx, name); !errors.Is(err, incus.ErrNotFound) {
			t.Fatalf("an interrupted new left its box: %v", err)
		}
	})

	t.Run("the box is on the stack", func(t *testing.T) {
		in, _, err := c.Instance(ctx, box)
		if err != nil {
			t.Fatal(err)
		}
		if in.Config["user.claudebox"] != "1" || len(in.Profiles) != 1 || in.Profiles[0] != h.stack.Profile {
			t.Fatalf("tag %q profiles %v", in.Config["user.claudebox"], in.Profiles)
		}
		nic := in.ExpandedDevices["eth0"]
		if nic["network"] != h.stack.Network || nic["security.port_isolation"] != "true" {
			t.Fatalf("eth0 = %v", nic)
		}
	})

	t.Run("snapshot, clone, restore", func(t *testing.T) {
		// A stand-in for what /login writes.
		asClaude(box, "mkdir", "-p", "~/.claude", "&&", "echo", "stand-in", ">", "~/.claude/.credentials.json")
		h.expect(0, "authed", "snapshot", box, "authed")
		asClaude(box, "touch", "~/after-snapshot")

		r := h.run("new", "--name", clone, "--container", "--from", box+"/authed")
		if r.code != 0 {
			t.Fatalf("new --from: exit %d\n%s\n%s", r.code, r.stdout, r.stderr)
		}
		h.tagForSweep(clone)
		if got := asClaude(clone, "cat", "~/.claude/.credentials.json"); strings.TrimSpace(got) != "stand-in" {
			t.Fatalf("clone lacks the snapshot's file: %q", got)
		}
		if _, code := root(clone, "test", "-e", "/home/claude/after-snapshot"); code == 0 {
			t.Fatal("clone has a file made after the snapshot")
		}
		a, b := h.boxState(box), h.boxState(clone)
		if a.mac == b.mac || a.ipv4 == b.ipv4 || b.ipv4 == "" {
			t.Fatalf("clone shares network identity: %+v vs %+v", a, b)
		}
		ma, _ := root(box, "cat", "/etc/machine-id")
		mb, _ := root(clone, "cat", "/etc/machine-id")
		if strings.TrimSpace(ma) == "" || strings.TrimSpace(ma) == strings.TrimSpace(mb) {
			t.Fatalf("machine-id: %q vs %q", ma, mb)
		}
		in, _, _ := c.Instance(ctx, clone)
		if len(in.Profiles) != 1 || in.Profiles[0] != h.stack.Profile || in.ExpandedDevices["eth0"]["security.port_isolation"] != "true" {
			t.Fatalf("clone's stack: %v %v", in.Profiles, in.ExpandedDevices["eth0"])
		}

		h.expect(0, "", "restore", box, "authed", "--force")
		if _, code := root(box, "test", "-e", "/home/claude/after-snapshot"); code == 0 {
			t.Fatal("restore did not roll back a change made after the snapshot")
		}
	})
}

type testLog struct{ t *testing.T }

func (l testLog) Write(p []byte) (int, error) {
	l.t.Logf("%s", strings.TrimRight(string(p), "\n"))
	return len(p), nil
}
