package boxcore_test

import (
	"context"
	"errors"
	"maps"
	"regexp"
	"strings"
	"testing"

	"github.com/claudebox/claudebox/boxcore"
	"github.com/claudebox/claudebox/boxcore/incus"
	"github.com/claudebox/claudebox/boxcore/templates"
	"github.com/claudebox/claudebox/internal/cloudimage"
	"github.com/claudebox/claudebox/internal/testenv"
	"github.com/claudebox/claudebox/internal/teststack"
)

type bakeLog struct{ t *testing.T }

func (l bakeLog) Write(p []byte) (int, error) {
	l.t.Logf("%s", strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

// bakeTestAlias points the bakes of this test process at aliases of its own and removes
// their images when the test ends.
func bakeTestAlias(t *testing.T, c *incus.Client) {
	t.Setenv(boxcore.BakePrefixEnv, "claudebox-test/bake-"+testenv.RunID()+"/")
	t.Cleanup(func() {
		ctx := context.Background()
		for _, tmpl := range templates.Names() {
			if img, err := c.ImageByAlias(ctx, boxcore.BakeAlias(tmpl)); err == nil {
				_ = c.DeleteImage(ctx, img.Fingerprint)
			}
		}
	})
}

// coldOptions is a cold container mint of a template on the test cloud image, tagged for
// the sweep, as `new` makes it.
func coldOptions(t *testing.T, name, tmpl, image string) boxcore.NewOptions {
	t.Helper()
	tp, err := templates.Get(tmpl)
	if err != nil {
		t.Fatal(err)
	}
	cas, err := templates.HostExtraCAs(templates.HostCADir)
	if err != nil {
		t.Fatal(err)
	}
	o := boxcore.NewOptions{Name: name, Image: image, Config: teststack.Tag()}
	if err := boxcore.ApplyTemplate(&o, boxcore.TemplateChoice{Template: tp, Explicit: true, HostCAs: cas}); err != nil {
		t.Fatal(err)
	}
	return o
}

// TestBake is issue 12's proof of a baked template on the real daemon: the claude template
// baked once; its state fits and a second bake does nothing; a changed template, base or CA
// set makes it stale; `new` from it runs no first boot yet gives a box with every tag, limit
// and isolation key, where `claude --version` works as user claude, with its own hostname
// and machine-id; neither the image nor the box holds a credential; a clone of it is ready
// without cloud-init too.
func TestBake(t *testing.T) {
	c := testenv.RequireIncus(t)
	ctx := context.Background()
	img, err := cloudimage.Ensure(ctx, c, cloudimage.Default(), bakeLog{t})
	if err != nil {
		t.Fatalf("cloud image: %v", err)
	}
	s := teststack.New(t, c, "bake")
	bakeTestAlias(t, c)
	bs := &boxcore.Boxes{Client: c, Stack: s, Version: "test"}
	prefix := testenv.ShortPrefix("bake")

	cold := coldOptions(t, "", "claude", img.Alias)
	var stages []string
	var builderQuota string // the builder's CPU quota, read while it runs
	res, err := bs.Bake(ctx, boxcore.BakeOptions{New: cold, Progress: func(p boxcore.Progress) {
		stages = append(stages, p.Stage)
		if p.Stage != "check" {
			return
		}
		insts, _ := c.Instances(ctx, map[string]string{testenv.TagKey: testenv.RunID()}, false)
		for _, in := range insts {
			if strings.HasPrefix(in.Name, "bake-claude-") {
				builderQuota = in.Config[boxcore.KeyCPUAllowance]
			}
		}
	}})
	if err != nil {
		t.Fatalf("bake: %v", err)
	}
	if want := boxcore.DefaultLimits().HostAllowance(); builderQuota != want {
		t.Errorf("the builder's CPU quota %q, want every CPU of the host (%s)", builderQuota, want)
	}
	t.Logf("bake: %s in %s (builder %s, publish %s), stages %v", res.State.Label(), res.Total, res.Mint, res.Publish, stages)
	if res.UpToDate || res.Why != "no bake yet" || !res.State.Current() || !regexp.MustCompile(`^\d+\.\d+\.\d+$`).MatchString(res.State.Claude()) {
		t.Fatalf("bake result: %+v", res)
	}
	if _, _, err := c.Instance(ctx, res.Builder); !errors.Is(err, incus.ErrNotFound) {
		t.Fatalf("the builder %s is still there: %v", res.Builder, err)
	}
	p := res.State.Image.Properties
	if p[boxcore.PropBakeBase] != img.Alias || p[boxcore.PropBakeBaseFP] != img.Fingerprint || p[boxcore.PropBakeTemplate] != "claude" ||
		p[boxcore.PropBakeRecipe] != res.State.Recipe.Hash() || res.State.Image.Public {
		t.Fatalf("bake image properties: %v (public %v)", p, res.State.Image.Public)
	}

	t.Run("a second bake does nothing", func(t *testing.T) {
		again, err := bs.Bake(ctx, boxcore.BakeOptions{New: cold})
		if err != nil || !again.UpToDate || again.Builder != "" || again.State.Image.Fingerprint != res.State.Image.Fingerprint {
			t.Fatalf("second bake: %+v %v", again, err)
		}
	})

	t.Run("staleness", func(t *testing.T) {
		for _, tc := range []struct {
			what string
			edit func(o *boxcore.NewOptions)
			want string
		}{
			{"template text", func(o *boxcore.NewOptions) { o.Config["cloud-init.user-data"] += "# changed\n" }, "the template changed"},
			{"base image", func(o *boxcore.NewOptions) { o.Image = teststack.ProbeImage(t, c) }, "the base image is now"},
			{"host CAs", func(o *boxcore.NewOptions) { o.Config["cloud-init.vendor-data"] += "# another CA\n" }, "extra CA certificates changed"},
		} {
			o := cold
			o.Config = maps.Clone(cold.Config)
			tc.edit(&o)
			st, err := bs.BakeState(ctx, o)
			if err != nil || st.Current() || !strings.Contains(st.Stale, tc.want) {
				t.Errorf("%s: stale %q (current %v, err %v), want %q", tc.what, st.Stale, st.Current(), err, tc.want)
			}
			before := o.Image
			if _, err := bs.UseBake(ctx, &o); err != nil || o.Image != before || o.Config[boxcore.TagBake] != "" {
				t.Errorf("%s: a stale bake was used: image %s, bake tag %q (%v)", tc.what, o.Image, o.Config[boxcore.TagBake], err)
			}
		}
		// The same base under another alias is another base too: new of that ref bakes anew.
		other := "claudebox-test/bake-base-" + testenv.RunID()
		if err := c.CreateImageAlias(ctx, other, img.Fingerprint); err != nil {
			t.Fatal(err)
		}
		defer c.DeleteImageAlias(ctx, other)
		o := cold
		o.Image = other
		if st, err := bs.BakeState(ctx, o); err != nil || st.Current() {
			t.Errorf("bake on %s judged current for %s: %+v %v", img.Alias, other, st, err)
		}
	})

	// new from the bake.
	boxA, boxB := prefix+"-a", prefix+"-b"
	mint := func(name string) *boxcore.Box {
		t.Helper()
		o := coldOptions(t, name, "claude", img.Alias)
		st, err := bs.UseBake(ctx, &o)
		if err != nil || !st.Current() || o.Image != boxcore.BakeAlias("claude") || o.Config["cloud-init.user-data"] != "" || !o.FirstBoot.Baked {
			t.Fatalf("UseBake: %+v image %s first boot %+v: %v", st, o.Image, o.FirstBoot, err)
		}
		timings := &boxcore.MintTimings{}
		o.Timings = timings
		box, err := bs.New(ctx, o)
		if err != nil {
			t.Fatalf("new from the bake: %v", err)
		}
		t.Logf("new %s from the bake: launch %s, lease %s", name, timings.Launch, timings.FirstBoot)
		return box
	}
	mint(boxA)
	mint(boxB)
	root := func(name string, cmd ...string) (string, int) {
		t.Helper()
		r, err := c.Exec(ctx, name, incus.ExecRequest{Command: cmd})
		if err != nil {
			t.Fatalf("%s: %v: %v", name, cmd, err)
		}
		return strings.TrimSpace(string(r.Stdout)), r.ExitCode
	}

	t.Run("claude runs as user claude, and the box is whole", func(t *testing.T) {
		out, code := root(boxA, "su", "-l", templates.User, "-c", "claude --version")
		if code != 0 || !strings.Contains(out, res.State.Claude()+" (Claude Code)") {
			t.Fatalf("claude --version as claude: exit %d %q", code, out)
		}
		md, _ := root(boxA, "cat", templates.Home+"/.claude/CLAUDE.md")
		for _, p := range templates.ClaudeMDPoints() {
			if !strings.Contains(strings.ToLower(md), strings.ToLower(p)) {
				t.Errorf("CLAUDE.md lacks %q", p)
			}
		}
		if st, _ := root(boxA, "cloud-init", "status"); !strings.Contains(st, "disabled") {
			t.Errorf("cloud-init in a baked box: %q, want disabled", st)
		}
	})

	t.Run("per box: hostname, machine-id, lease", func(t *testing.T) {
		for _, n := range []string{boxA, boxB} {
			if h, _ := root(n, "hostname"); h != n {
				t.Errorf("%s: hostname %q", n, h)
			}
			if h, _ := root(n, "sh", "-c", "grep -w 127.0.1.1 /etc/hosts"); !strings.Contains(h, n) {
				t.Errorf("%s: /etc/hosts has %q", n, h)
			}
		}
		ma, _ := root(boxA, "cat", "/etc/machine-id")
		mb, _ := root(boxB, "cat", "/etc/machine-id")
		if len(ma) != 32 || ma == mb {
			t.Errorf("machine-ids %q and %q", ma, mb)
		}
		if out, code := root(boxA, "sh", "-c", "ls /etc/ssh/ssh_host_* 2>/dev/null; ls /var/lib/dhcp/"); code > 1 || strings.Contains(out, "ssh_host") {
			t.Errorf("per-box files from the bake: %q", out)
		}
	})

	t.Run("every tag, limit and isolation key", func(t *testing.T) {
		in, _, err := c.Instance(ctx, boxA)
		if err != nil {
			t.Fatal(err)
		}
		cfg := in.Config
		if cfg[boxcore.TagKey] != "1" || cfg[boxcore.TagOrigin] != "fresh" || cfg[boxcore.TagTemplate] != "claude" ||
			!strings.HasPrefix(cfg[boxcore.TagBake], boxcore.BakeAlias("claude")+" (image ") || cfg[boxcore.TagFrom] != boxcore.BakeAlias("claude") {
			t.Errorf("tags: %v", cfg)
		}
		for _, k := range []string{"limits.processes", "limits.cpu.allowance", "limits.memory", "limits.cpu"} {
			if cfg[k] == "" {
				t.Errorf("baked box lacks %s", k)
			}
		}
		// The builder's quota of every CPU is not a box's: a box from the bake has its own.
		if cpus, hard := boxcore.ParseAllowance(cfg[boxcore.KeyCPUAllowance]); !hard || int(cpus) > boxcore.DefaultLimits().AllowanceCPUs {
			t.Errorf("baked box's CPU quota %q: more than a box's %d CPUs", cfg[boxcore.KeyCPUAllowance], boxcore.DefaultLimits().AllowanceCPUs)
		}
		if len(in.Profiles) != 1 || in.Profiles[0] != s.Profile {
			t.Errorf("profiles %v", in.Profiles)
		}
		nic := in.ExpandedDevices["eth0"]
		if nic["network"] != s.Network || nic["security.port_isolation"] != "true" || in.Devices["root"]["size"] == "" || in.Devices["root"]["pool"] != s.Pool {
			t.Errorf("devices: eth0 %v root %v", nic, in.Devices["root"])
		}
		if off := boxcore.OffBoundary(in.Config, in.Devices, s); len(off) > 0 {
			t.Errorf("a baked box is off the boundary: %v", off)
		}
	})

	t.Run("no credential in the bake or in a box from it", func(t *testing.T) {
		if out, _ := root(boxA, "sh", "-c", boxcore.CredentialScanScript); out != "" {
			t.Fatalf("credential-like files in a box from the bake:\n%s", out)
		}
		// The image itself, read through the files API of an instance made from it and never
		// started (nothing of a boot can have removed anything).
		raw := prefix + "-raw"
		rcfg := teststack.Tag()
		if err := c.CreateInstance(ctx, incus.InstancesPost{Name: raw, Type: "container", Config: rcfg,
			Devices: map[string]map[string]string{"root": {"type": "disk", "path": "/", "pool": s.Pool}},
			Source:  incus.InstanceSource{Type: "image", Alias: boxcore.BakeAlias("claude")}}, nil); err != nil {
			t.Fatal(err)
		}
		defer c.DeleteInstance(context.Background(), raw)
		for _, f := range []string{templates.Home + "/.claude/.credentials.json", "/root/.claude/.credentials.json", templates.Home + "/.claude.json",
			templates.Home + "/.git-credentials", "/root/.git-credentials", templates.Home + "/.config/gh/hosts.yml"} {
			if _, err := c.PullFile(ctx, raw, f); !errors.Is(err, incus.ErrNotFound) {
				t.Errorf("the bake holds %s (%v)", f, err)
			}
		}
		if b, err := c.PullFile(ctx, raw, templates.Home+"/.claude/CLAUDE.md"); err != nil || len(b) == 0 {
			t.Errorf("the bake lacks the global CLAUDE.md (%v): the files check reads the wrong place", err)
		}
		if b, err := c.PullFile(ctx, raw, "/etc/machine-id"); err != nil || len(strings.TrimSpace(string(b))) != 0 {
			t.Errorf("the bake's machine-id: %q %v", b, err)
		}
		// The scan sees what a login would leave: it can fail.
		root(boxB, "su", "-l", templates.User, "-c", "echo '{\"claudeAiOauth\":{\"accessToken\":\"sk-ant-oat01-standin0000\"}}' > ~/.claude/.credentials.json")
		if out, _ := root(boxB, "sh", "-c", boxcore.CredentialScanScript); !strings.Contains(out, ".credentials.json") {
			t.Fatalf("the credential scan missed a stand-in login:\n%q", out)
		}
	})

	t.Run("a clone of a baked box needs no first boot either", func(t *testing.T) {
		clone := prefix + "-c"
		box, err := bs.New(ctx, boxcore.NewOptions{Name: clone, From: boxA, Config: teststack.Tag()})
		if err != nil {
			t.Fatalf("clone: %v", err)
		}
		if box.Instance.Config[boxcore.TagBake] == "" {
			t.Errorf("the clone does not say which bake it came from: %v", box.Instance.Config)
		}
		if h, _ := root(clone, "hostname"); h != clone {
			t.Errorf("clone hostname %q", h)
		}
		ma, _ := root(boxA, "cat", "/etc/machine-id")
		mc, _ := root(clone, "cat", "/etc/machine-id")
		if len(mc) != 32 || mc == ma {
			t.Errorf("clone machine-id %q (source %q)", mc, ma)
		}
		if out, code := root(clone, "su", "-l", templates.User, "-c", "claude --version"); code != 0 || !strings.Contains(out, "Claude Code") {
			t.Errorf("claude in the clone: %d %q", code, out)
		}
	})
}
