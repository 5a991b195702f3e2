package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"sort"
	"strings"
	"sync"
	"testing"

	"github.com/claudebox/claudebox/boxcore"
	"github.com/claudebox/claudebox/boxcore/incus"
	"github.com/claudebox/claudebox/internal/testenv"
	"github.com/claudebox/claudebox/internal/teststack"
)

func TestMain(m *testing.M) {
	code := m.Run()
	teststack.RemoveBinary()
	os.Exit(code)
}

// harness runs the real command line in-process against the real daemon and a test stack.
type harness struct {
	t     *testing.T
	c     *incus.Client
	stack boxcore.Stack
	image string
}

type result struct {
	code           int
	stdout, stderr string
}

func (h *harness) run(args ...string) result {
	h.t.Helper()
	return h.runIn("", args...)
}

// runIn runs a command line with stdin holding the given text (no terminal).
func (h *harness) runIn(stdin string, args ...string) result {
	h.t.Helper()
	var out, errb bytes.Buffer
	env := &Env{Stdin: strings.NewReader(stdin), Stdout: &out, Stderr: &errb, Stack: h.stack}
	code := Run(env, append([]string{"claudebox"}, args...))
	return result{code, out.String(), errb.String()}
}

// expect runs a command and checks its exit code and that stderr (or stdout) holds a text.
func (h *harness) expect(code int, want string, args ...string) result {
	h.t.Helper()
	r := h.run(args...)
	if r.code != code || !strings.Contains(r.stdout+r.stderr, want) {
		h.t.Fatalf("claudebox %s: exit %d, want %d with %q\nstdout: %s\nstderr: %s", strings.Join(args, " "), r.code, code, want, r.stdout, r.stderr)
	}
	return r
}

func (h *harness) name(suffix string) string { return "l" + testenv.RunID() + "-" + suffix }

// newBox mints a container box from the probe image, tagged for the sweep.
func (h *harness) newBox(name string, extra ...string) result {
	return h.run(append([]string{"new", "--name", name, "--container", "--image", h.image}, extra...)...)
}

// state renders every instance on the daemon (boxes or not), with its config, profiles,
// devices, status and snapshots: the "nothing changed" witness.
func (h *harness) state() string {
	h.t.Helper()
	ctx := context.Background()
	insts, err := h.c.Instances(ctx, nil, true)
	if err != nil {
		h.t.Fatal(err)
	}
	var lines []string
	for _, in := range insts {
		if in.Config[testenv.TagKey] != testenv.RunID() {
			continue // other test packages' instances come and go in parallel
		}
		var snaps []string
		for _, s := range in.Snapshots {
			snaps = append(snaps, s.Name)
		}
		sort.Strings(snaps)
		cfg := map[string]string{}
		for k, v := range in.Config {
			if !strings.HasPrefix(k, "volatile.") || strings.HasSuffix(k, "hwaddr") {
				cfg[k] = v
			}
		}
		b, _ := json.Marshal([]any{in.Name, in.Status, cfg, in.Profiles, in.Devices, snaps})
		lines = append(lines, string(b))
	}
	sort.Strings(lines)
	return strings.Join(lines, "\n")
}

// unchanged runs a command that must fail and change nothing.
func (h *harness) unchanged(code int, want string, args ...string) {
	h.t.Helper()
	before := h.state()
	h.expect(code, want, args...)
	if after := h.state(); after != before {
		h.t.Fatalf("claudebox %s changed state:\nbefore: %s\nafter:  %s", strings.Join(args, " "), before, after)
	}
}

func newHarness(t *testing.T) *harness {
	c := testenv.RequireIncus(t)
	s := teststack.New(t, c, "lifecycle")
	return &harness{t: t, c: c, stack: s, image: teststack.ProbeImage(t, c)}
}

func TestLifecycle(t *testing.T) {
	h := newHarness(t)
	tag := fmt.Sprintf("%s=%s", testenv.TagKey, testenv.RunID())
	_ = tag
	a, b := h.name("a"), h.name("b")

	// new: tag, provenance, exactly the stack profile, running with a lease.
	if r := h.newBox(a); r.code != 0 {
		t.Fatalf("new: %d %s", r.code, r.stderr)
	}
	h.tagForSweep(a)
	in, _, err := h.c.Instance(context.Background(), a)
	if err != nil {
		t.Fatal(err)
	}
	if in.Config["user.claudebox"] != "1" || in.Config["user.claudebox.origin"] != "fresh" || in.Config["user.claudebox.from"] != h.image ||
		in.Config["user.claudebox.created"] == "" || in.Config["user.claudebox.version"] == "" {
		t.Fatalf("tags: %v", in.Config)
	}
	if len(in.Profiles) != 1 || in.Profiles[0] != h.stack.Profile {
		t.Fatalf("profiles %v, want exactly [%s]", in.Profiles, h.stack.Profile)
	}

	t.Run("list", func(t *testing.T) {
		r := h.expect(0, a, "list")
		if !strings.Contains(r.stdout, "NAME") || !strings.Contains(r.stdout, "RUNNING") {
			t.Fatalf("list table: %s", r.stdout)
		}
		var js []boxcore.Summary
		r = h.expect(0, "", "list", "--format", "json")
		if err := json.Unmarshal([]byte(r.stdout), &js); err != nil {
			t.Fatalf("list json: %v\n%s", err, r.stdout)
		}
		found := false
		for _, s := range js {
			if s.Name == a {
				found = len(s.IPv4) > 0
			}
		}
		if !found {
			t.Fatalf("list json lacks %s with an IPv4: %s", a, r.stdout)
		}
		h.expect(0, "name: "+a, "list", "--format", "yaml")
		h.expect(0, "name,state,type,ipv4,snapshots,created", "list", "--format", "csv")
	})

	t.Run("info", func(t *testing.T) {
		r := h.expect(0, "claudebox new --name "+a+"-2 --from "+a, "info", a)
		for _, w := range []string{"state:", "RUNNING", "eth0", "origin: fresh", "from: " + h.image} {
			if !strings.Contains(r.stdout, w) {
				t.Errorf("info lacks %q:\n%s", w, r.stdout)
			}
		}
	})

	t.Run("exec propagates the exit code", func(t *testing.T) {
		h.expect(0, `"ready": true`, "exec", a, "--", "/sbin/init", "probe", "status")
		r := h.run("exec", a, "--", "/sbin/init", "probe", "nosuch")
		if r.code != 2 {
			t.Fatalf("exec exit %d, want the command's 2: %s", r.code, r.stderr)
		}
	})

	t.Run("snapshot restore clone", func(t *testing.T) {
		r := h.expect(0, "snap-", "snapshot", a)
		auto := strings.TrimSpace(r.stdout)
		h.expect(0, "authed", "snapshot", a, "authed")
		h.unchanged(2, "already has a snapshot", "snapshot", a, "authed")
		h.expect(0, "", "restore", a, "authed", "--force")
		h.expect(0, "", "restore", a, auto, "--force")

		// The clone: a box, tagged clone, exactly the profile, its own MAC and lease.
		h.expect(0, "is ready", "new", "--name", b, "--from", a+"/authed")
		h.tagForSweep(b)
		ca, cb := h.boxState(a), h.boxState(b)
		if ca.mac == cb.mac || ca.ipv4 == cb.ipv4 || cb.ipv4 == "" {
			t.Fatalf("clone shares identity: %+v vs %+v", ca, cb)
		}
		in, _, _ := h.c.Instance(context.Background(), b)
		if in.Config["user.claudebox.origin"] != "clone" || in.Config["user.claudebox.from"] != a+"/authed" || len(in.Profiles) != 1 || in.Profiles[0] != h.stack.Profile {
			t.Fatalf("clone tags/profiles: %v %v", in.Config, in.Profiles)
		}
	})

	t.Run("stop rename start", func(t *testing.T) {
		h.unchanged(2, "is running — stop it first: claudebox stop "+b, "rename", b, h.name("c"))
		h.expect(0, "", "stop", b) // a clean shutdown: the agent as PID 1 must answer LXC's signal
		h.unchanged(2, "already exists", "rename", b, a)
		h.unchanged(2, "invalid box name", "rename", b, "9lives")
		h.expect(0, "", "rename", b, h.name("c"))
		h.expect(0, "", "start", h.name("c"))
		h.expect(0, h.name("c"), "list")
		// The renamed box's port is named for its new name: a box of the old name gets a port
		// of its own, and both stay bound.
		in, _, err := h.c.Instance(context.Background(), h.name("c"))
		if err != nil || in.Devices["eth0"]["host_name"] != boxcore.HostName(h.name("c")) {
			t.Fatalf("renamed box's eth0 host_name %q (%v), want %s", in.Devices["eth0"]["host_name"], err, boxcore.HostName(h.name("c")))
		}
		h.expect(0, "is ready", "new", "--name", b, "--container", "--image", h.image)
		h.tagForSweep(b)
		h.expect(0, "", "host", "check")
	})

	t.Run("escape hatch", func(t *testing.T) {
		r := h.expect(0, "1", "incus", a, "--", "config", "get", "{}", "user.claudebox")
		if strings.Contains(r.stderr, "warning") {
			t.Fatalf("harmless hatch warned: %s", r.stderr)
		}
		r = h.expect(0, "", "incus", a, "--", "config", "set", "{}", "user.note=x")
		if strings.Contains(r.stderr, "warning") {
			t.Fatalf("harmless hatch warned: %s", r.stderr)
		}
		r = h.expect(0, "warning", "incus", a, "--", "config", "set", "{}", "security.nesting=false")
		if !strings.Contains(r.stderr, "security") {
			t.Fatalf("warning does not say why: %s", r.stderr)
		}
		h.expect(0, "", "incus", a, "--", "config", "unset", "{}", "security.nesting")
	})

	t.Run("--remote", func(t *testing.T) {
		h.t = t
		testenv.LoopbackRemote(t)
		h.expect(0, a, "list", "--remote", "loop")
		h.expect(0, "name:      "+a, "info", a, "--remote", "loop")
		h.expect(0, `"ready": true`, "exec", a, "--remote", "loop", "--", "/sbin/init", "probe", "status")
		h.expect(0, "label", "snapshot", a, "label", "--remote", "loop")
		// The escape hatch hands the remote to the incus CLI, which reads the same config.
		h.expect(0, "1", "incus", a, "--remote", "loop", "--", "config", "get", "{}", "user.claudebox")
		h.expect(1, "certificate", "list", "--remote", "stranger")
		h.t = t
	})
	h.t = t

	t.Run("rm", func(t *testing.T) {
		// --force means only "even if running": a running box is refused without it, --yes
		// or not; a stopped one is asked about, and --yes (or --force) answers.
		for _, args := range [][]string{{"rm", a}, {"rm", a, "--yes"}, {"restore", a, "authed"}, {"restore", a, "authed", "--yes"}} {
			h.unchanged(2, "is running: stop it first (claudebox stop "+a+"), or pass --force", args...)
		}
		h.expect(0, "", "stop", a)
		h.unchanged(2, "no terminal to confirm on: pass --yes", "rm", a)
		h.unchanged(2, "no terminal to confirm on: pass --yes", "restore", a, "authed")
		h.expect(0, "", "restore", a, "authed", "--yes")
		h.expect(0, "", "rm", a, "--yes")
		h.expect(0, "", "rm", h.name("c"), "--force")
		if _, _, err := h.c.Instance(context.Background(), h.name("c")); err == nil {
			t.Fatal("rm left the box")
		}
	})
}

// tagForSweep marks a box with this run so a dead run's leftovers can be found.
func (h *harness) tagForSweep(name string) {
	h.t.Helper()
	ctx := context.Background()
	in, etag, err := h.c.Instance(ctx, name)
	if err != nil {
		h.t.Fatal(err)
	}
	put := in.Writable()
	put.Config[testenv.TagKey] = testenv.RunID()
	if err := h.c.UpdateInstance(ctx, name, put, etag); err != nil {
		h.t.Fatal(err)
	}
}

type netID struct{ mac, ipv4 string }

func (h *harness) boxState(name string) netID {
	h.t.Helper()
	st, err := h.c.InstanceState(context.Background(), name)
	if err != nil {
		h.t.Fatal(err)
	}
	n := st.Network["eth0"]
	id := netID{mac: n.Hwaddr}
	for _, a := range n.Addresses {
		if a.Family == "inet" {
			id.ipv4 = a.Address
		}
	}
	return id
}

func TestBadInput(t *testing.T) {
	h := newHarness(t)
	a := h.name("bad")
	if r := h.newBox(a); r.code != 0 {
		t.Fatalf("new: %d %s", r.code, r.stderr)
	}
	h.tagForSweep(a)
	h.expect(0, "s1", "snapshot", a, "s1")

	for _, tc := range []struct {
		code int
		want string
		args []string
	}{
		{2, "invalid box name", []string{"new", "--name", "1abc", "--container", "--image", h.image}},
		{2, "invalid box name", []string{"new", "--name", "-abc", "--container", "--image", h.image}},
		{2, "invalid box name", []string{"new", "--name", "abc_def", "--container", "--image", h.image}},
		{2, "invalid box name", []string{"new", "--name", strings.Repeat("a", 64), "--container", "--image", h.image}},
		{2, "already exists", []string{"new", "--name", a, "--container", "--image", h.image}},
		{2, "cannot run VMs", []string{"new", "--name", h.name("vm"), "--image", h.image}},
		{2, "has no cloud-init", []string{"new", "--name", h.name("t"), "--container", "--image", h.image, "--template", "claude"}},
		{2, "no template named", []string{"new", "--name", h.name("t"), "--container", "--image", h.image, "--template", "nosuch"}},
		{2, "exclude each other", []string{"new", "--name", h.name("x"), "--vm", "--container"}},
		{2, "no such box", []string{"info", h.name("nosuch")}},
		{2, "no such box", []string{"exec", h.name("nosuch"), "--", "true"}},
		{2, "has no snapshot", []string{"restore", a, "nosnap", "--force"}},
		{2, "no such box", []string{"new", "--name", h.name("y"), "--container", "--from", h.name("nosuch")}},
		{2, "has no snapshot", []string{"new", "--name", h.name("y"), "--container", "--from", a + "/nosnap"}},
		{2, "does not take --image", []string{"new", "--name", h.name("y"), "--from", a, "--image", h.image}},
		{2, "does not take --image", []string{"new", "--name", h.name("y"), "--from", a, "--template", "claude"}},
		{2, "does not take --image", []string{"new", "--name", h.name("y"), "--from", a, "--cpu", "1"}},
		{2, "unknown Incus remote", []string{"list", "--remote", "nosuchremote"}},
		{2, "unknown Incus remote", []string{"info", a, "--remote", "nosuchremote"}},
		{2, "is running: stop it first", []string{"rm", a}},
		{2, "is running: stop it first", []string{"restore", a, "s1", "--yes"}},
		{2, "missing BOX", []string{"rm"}},
	} {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			h.t = t
			h.unchanged(tc.code, tc.want, tc.args...)
		})
	}
	h.t = t

	t.Run("no stack", func(t *testing.T) {
		h2 := *h
		h2.t = t
		h2.stack = boxcore.NamedStack("cbtn" + testenv.RunID())
		h2.unchanged(1, "isolation stack is missing", "new", "--name", h.name("nostack"), "--container", "--image", h.image)
	})

	t.Run("daemon down", func(t *testing.T) {
		t.Setenv("INCUS_SOCKET", "/nonexistent/unix.socket")
		h.t = t
		h.unchanged(1, "not answering at /nonexistent/unix.socket", "list")
		h.unchanged(1, "not answering", "info", a)
	})
}

// TestBoundary aims every verb at an instance without the tag: each refuses with the same
// words as for a missing box, and the instance is identical afterwards.
func TestBoundary(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	name := h.name("untagged")
	cfg := testenv.Tag()
	err := h.c.CreateInstance(ctx, incus.InstancesPost{
		Name: name, Profiles: []string{h.stack.Profile}, Config: cfg,
		Source: incus.InstanceSource{Type: "image", Alias: h.image}, Start: true,
	}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := h.c.CreateSnapshot(ctx, name, "s1"); err != nil {
		t.Fatal(err)
	}
	want := "no such box: " + name
	for _, args := range [][]string{
		{"info", name}, {"shell", name}, {"exec", name, "--", "true"}, {"start", name}, {"stop", name, "--force"},
		{"snapshot", name}, {"snapshot", name, "x"}, {"restore", name, "s1", "--force"}, {"rename", name, h.name("z")},
		{"rm", name, "--force"}, {"incus", name, "--", "delete", "-f", "{}"},
	} {
		h.unchanged(2, want, args...)
	}
	h.unchanged(2, "no such box: "+name, "new", "--name", h.name("z"), "--container", "--from", name)
	h.unchanged(2, "no such box: "+name, "new", "--name", h.name("z"), "--container", "--from", name+"/s1")
	r := h.expect(0, "", "list", "--format", "json")
	if strings.Contains(r.stdout, name) {
		t.Fatalf("list shows an untagged instance: %s", r.stdout)
	}
}

func TestConcurrentNew(t *testing.T) {
	h := newHarness(t)
	var wg sync.WaitGroup
	results := make([]result, 8)
	for i := range results {
		wg.Add(1)
		go func() {
			defer wg.Done()
			results[i] = h.newBox(h.name(fmt.Sprintf("p%d", i)))
		}()
	}
	wg.Wait()
	for i, r := range results {
		if r.code != 0 {
			// A failed new leaves nothing to tag: tagging first would hide why it failed.
			t.Errorf("parallel new %d: exit %d: %s", i, r.code, r.stderr)
			continue
		}
		h.tagForSweep(h.name(fmt.Sprintf("p%d", i)))
	}

	// Two racing for one name: one wins, the other says so, no orphan, the winner intact.
	same := h.name("same")
	var pair [2]result
	for i := range pair {
		wg.Add(1)
		go func() { defer wg.Done(); pair[i] = h.newBox(same) }()
	}
	wg.Wait()
	wins := 0
	for _, r := range pair {
		switch {
		case r.code == 0:
			wins++
		case r.code == 2 && (strings.Contains(r.stderr, "already exists") || strings.Contains(r.stderr, "is making "+same+" right now")):
		default:
			t.Errorf("racing new: exit %d: %s", r.code, r.stderr)
		}
	}
	if wins != 1 {
		t.Fatalf("%d of 2 racing news won: %+v", wins, pair)
	}
	h.tagForSweep(same)
	in, _, err := h.c.Instance(context.Background(), same)
	if err != nil || in.Status != "Running" || in.Config["user.claudebox"] != "1" {
		t.Fatalf("the winner is not a running box: %v %v", in.Status, err)
	}
}
