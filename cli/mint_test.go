package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/claudebox/claudebox/boxcore"
	"github.com/claudebox/claudebox/boxcore/incus"
	"github.com/claudebox/claudebox/internal/testenv"
	"github.com/claudebox/claudebox/internal/teststack"
)

// gone fails the test when an instance of that name exists, and removes it.
func (h *harness) gone(name, why string) {
	h.t.Helper()
	ctx := context.Background()
	in, _, err := h.c.Instance(ctx, name)
	if errors.Is(err, incus.ErrNotFound) {
		return
	}
	h.t.Errorf("%s left instance %s behind (status %s, err %v)", why, name, in.Status, err)
	_ = h.c.SetState(ctx, name, "stop", true, 0)
	_ = h.c.DeleteInstance(ctx, name)
}

// removeLater deletes an instance of that name when the test ends, tagged or not.
func (h *harness) removeLater(name string) {
	h.t.Cleanup(func() {
		ctx := context.Background()
		if _, _, err := h.c.Instance(ctx, name); err == nil {
			_ = h.c.SetState(ctx, name, "stop", true, 0)
			_ = h.c.DeleteInstance(ctx, name)
		}
	})
}

type procResult struct {
	code           int
	stdout, stderr string
	took           time.Duration
}

// runSignalled runs the claudebox binary and sends sig after delay (none when delay < 0).
func (h *harness) runSignalled(sig syscall.Signal, delay time.Duration, args ...string) procResult {
	h.t.Helper()
	cmd := exec.Command(teststack.Binary(h.t), args...)
	cmd.Env = append(os.Environ(), "CLAUDEBOX_STACK="+h.stack.Network)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	start := time.Now()
	if err := cmd.Start(); err != nil {
		h.t.Fatal(err)
	}
	var sentAt time.Time
	if delay >= 0 {
		t := time.AfterFunc(delay, func() { sentAt = time.Now(); _ = cmd.Process.Signal(sig) })
		defer t.Stop()
	}
	err := cmd.Wait()
	r := procResult{stdout: out.String(), stderr: errb.String(), took: time.Since(start)}
	if !sentAt.IsZero() {
		r.took = time.Since(sentAt)
	}
	var ee *exec.ExitError
	switch {
	case err == nil:
	case errors.As(err, &ee):
		r.code = ee.ExitCode()
	default:
		h.t.Fatal(err)
	}
	return r
}

// An interrupted `new` leaves nothing, exits 128+signal, says it was interrupted (not a
// timeout), and the same name works right after. Delays cover the create, the start and the
// moments between.
func TestNewInterrupted(t *testing.T) {
	h := newHarness(t)
	n := 0
	for _, sig := range []syscall.Signal{syscall.SIGINT, syscall.SIGTERM} {
		for _, d := range []time.Duration{0, 20 * time.Millisecond, 50 * time.Millisecond, 100 * time.Millisecond, 200 * time.Millisecond, 300 * time.Millisecond, 500 * time.Millisecond} {
			n++
			name := h.name(fmt.Sprintf("sig%d", n))
			h.removeLater(name)
			r := h.runSignalled(sig, d, "new", "--name", name, "--container", "--image", h.image)
			t.Logf("%v at %v: exit %d, cleanup took %v after the signal: %s", sig, d, r.code, r.took.Round(time.Millisecond), strings.TrimSpace(r.stderr))
			switch r.code {
			case 0: // finished before the signal: a whole box
				h.tagForSweep(name)
				h.expect(0, "", "rm", name, "--force")
				continue
			case 128 + int(sig):
			case -1: // killed before the runtime installed its handlers: nothing was started
				h.gone(name, fmt.Sprintf("%v at %v (before the handlers)", sig, d))
				continue
			default:
				t.Fatalf("%v at %v: exit %d, want %d\n%s", sig, d, r.code, 128+int(sig), r.stderr)
			}
			want := "interrupted (" + map[syscall.Signal]string{syscall.SIGINT: "SIGINT", syscall.SIGTERM: "SIGTERM"}[sig] + ")"
			if !strings.Contains(r.stderr, want) || strings.Contains(r.stderr, "did not finish within") || strings.Contains(r.stderr, "context canceled") {
				t.Errorf("%v at %v: message does not name the interrupt: %s", sig, d, r.stderr)
			}
			h.gone(name, fmt.Sprintf("%v at %v", sig, d))
			// Nothing of it comes back later either (a create still running in the daemon).
			time.Sleep(300 * time.Millisecond)
			h.gone(name, fmt.Sprintf("%v at %v (300 ms later)", sig, d))
			h.expect(0, "is ready", "new", "--name", name, "--container", "--image", h.image)
			h.tagForSweep(name)
			h.expect(0, "", "rm", name, "--force")
		}
	}
}

// A start that fails (1 byte of memory) leaves nothing, and the name is free again.
func TestNewFailedStart(t *testing.T) {
	h := newHarness(t)
	name := h.name("mem1")
	h.removeLater(name)
	before := h.state()
	r := h.expect(1, "starting "+name, "new", "--name", name, "--container", "--image", h.image, "--memory", "1")
	if strings.Contains(r.stderr, "could not be removed") {
		t.Fatalf("cleanup failed: %s", r.stderr)
	}
	h.gone(name, "a failed start")
	if after := h.state(); after != before {
		t.Fatalf("state changed:\n%s\n%s", before, after)
	}
	h.expect(0, "is ready", "new", "--name", name, "--container", "--image", h.image)
	h.tagForSweep(name)
}

// While `new` is still at work the box is listed, and shown by info, as MINTING; once done,
// as its real state. A box mid-mint cannot be cloned.
func TestNewMintingMarker(t *testing.T) {
	h := newHarness(t)
	name := h.name("mint")
	h.removeLater(name)
	bs := &boxcore.Boxes{Client: h.c, Stack: h.stack, Version: "test"}
	var listed, infoed, cloned, started result
	_, err := bs.New(context.Background(), boxcore.NewOptions{Name: name, Image: h.image, Config: teststack.Tag(),
		Progress: func(p boxcore.Progress) {
			if p.Stage == "start" {
				listed = h.run("list", "--format", "json")
				infoed = h.run("info", name)
				cloned = h.run("new", "--name", h.name("mint2"), "--container", "--from", name)
				started = h.run("start", name)
			}
		}})
	if err != nil {
		t.Fatal(err)
	}
	var js []boxcore.Summary
	if err := json.Unmarshal([]byte(listed.stdout), &js); err != nil {
		t.Fatalf("list: %v %s", err, listed.stdout)
	}
	found := false
	for _, s := range js {
		if s.Name == name {
			found = true
			if s.State != boxcore.StateMinting {
				t.Errorf("mid-mint box listed as %s", s.State)
			}
		}
	}
	if !found {
		t.Errorf("mid-mint box not listed: %s", listed.stdout)
	}
	if !strings.Contains(infoed.stdout, "MINTING") || !strings.Contains(infoed.stdout, "not ready") {
		t.Errorf("info mid-mint: %s", infoed.stdout)
	}
	if cloned.code != 2 || !strings.Contains(cloned.stderr, "still being minted") {
		t.Errorf("clone of a box mid-mint: exit %d %s", cloned.code, cloned.stderr)
	}
	h.gone(h.name("mint2"), "a refused clone")
	// A start would call the half-made box made (its marker ends with its first start).
	if started.code != 2 || !strings.Contains(started.stderr, "still being minted") {
		t.Errorf("start of a box mid-mint: exit %d %s", started.code, started.stderr)
	}
	// This box is made once started: new drops no marker, the first start ends it.
	if in, _, err := h.c.Instance(context.Background(), name); err != nil || !strings.HasSuffix(in.Config["user.claudebox.mint"], "+start") || boxcore.Minting(in.Config) {
		t.Errorf("made-at-start marker: %q, minting %v (%v)", in.Config["user.claudebox.mint"], boxcore.Minting(in.Config), err)
	}
	// Only this box: another package's test may be minting one of its own right now.
	r := h.expect(0, name, "list", "--format", "json")
	js = nil
	if err := json.Unmarshal([]byte(r.stdout), &js); err != nil {
		t.Fatalf("list: %v %s", err, r.stdout)
	}
	for _, s := range js {
		if s.Name == name && s.State == boxcore.StateMinting {
			t.Fatalf("finished box still minting: %s", r.stdout)
		}
	}
}

// A box whose making goes on after its start (a bake's: its lease is waited for, and a lease
// that never comes removes the box) shows as MINTING until new is done, and cannot be cloned
// meanwhile; once done it carries no marker.
func TestNewMintingAfterStart(t *testing.T) {
	h := newHarness(t)
	name := h.name("mintb")
	h.removeLater(name)
	bs := &boxcore.Boxes{Client: h.c, Stack: h.stack, Version: "test"}
	var listed, cloned result
	var marker string
	_, err := bs.New(context.Background(), boxcore.NewOptions{Name: name, Image: h.image, Config: teststack.Tag(),
		FirstBoot: &boxcore.FirstBoot{Baked: true, Timeout: time.Minute},
		Progress: func(p boxcore.Progress) {
			if p.Stage == "first boot" { // started, the lease not yet awaited
				listed = h.run("list", "--format", "json")
				cloned = h.run("new", "--name", h.name("mintb2"), "--container", "--from", name)
				if in, _, err := h.c.Instance(context.Background(), name); err == nil {
					marker = in.Config["user.claudebox.mint"]
				}
			}
		}})
	if err != nil {
		t.Fatal(err)
	}
	var js []boxcore.Summary
	if err := json.Unmarshal([]byte(listed.stdout), &js); err != nil {
		t.Fatalf("list: %v %s", err, listed.stdout)
	}
	for _, s := range js {
		if s.Name == name && s.State != boxcore.StateMinting {
			t.Errorf("started box still awaiting its lease listed as %s", s.State)
		}
	}
	if marker == "" || strings.HasSuffix(marker, "+start") {
		t.Errorf("marker while the lease is awaited: %q, want a plain token", marker)
	}
	if cloned.code != 2 || !strings.Contains(cloned.stderr, "still being minted") {
		t.Errorf("clone of a box awaiting its lease: exit %d %s", cloned.code, cloned.stderr)
	}
	h.gone(h.name("mintb2"), "a refused clone")
	if in, _, err := h.c.Instance(context.Background(), name); err != nil || in.Config["user.claudebox.mint"] != "" {
		t.Errorf("finished baked box: marker %q (%v)", in.Config["user.claudebox.mint"], err)
	}
}

// A box whose new died: made once started and never started, start refuses it (a start
// would call it made); kept after a failed first boot (a plain marker), start starts it and
// it still shows as MINTING.
func TestStartOfDeadMint(t *testing.T) {
	h := newHarness(t)
	name := h.name("dead")
	h.removeLater(name)
	if r := h.newBox(name); r.code != 0 {
		t.Fatalf("new: %s", r.stderr)
	}
	h.tagForSweep(name)
	h.expect(0, "", "stop", name)
	ctx := context.Background()
	setMarker := func(token string) {
		in, etag, err := h.c.Instance(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		put := in.Writable()
		put.Config["user.claudebox.mint"] = token
		delete(put.Config, "volatile.last_state.power") // as a box never started has it
		if err := h.c.UpdateInstance(ctx, name, put, etag); err != nil {
			t.Fatal(err)
		}
	}
	setMarker("dead+start")
	h.unchanged(2, "its new died before starting it", "start", name)
	setMarker("kept")
	h.expect(0, "", "start", name)
	r := h.expect(0, name, "list", "--format", "json")
	var js []boxcore.Summary
	if err := json.Unmarshal([]byte(r.stdout), &js); err != nil {
		t.Fatalf("list: %v %s", err, r.stdout)
	}
	for _, s := range js {
		if s.Name == name && s.State != boxcore.StateMinting {
			t.Errorf("a started box its new never finished listed as %s", s.State)
		}
	}
}

// Four `new` of one name at once: exactly one box, the others a clear error, no orphan.
func TestNewSameNameRace(t *testing.T) {
	h := newHarness(t)
	name := h.name("race")
	h.removeLater(name)
	var wg sync.WaitGroup
	rs := make([]procResult, 4)
	for i := range rs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rs[i] = h.runSignalled(0, -1, "new", "--name", name, "--container", "--image", h.image)
		}()
	}
	wg.Wait()
	wins := 0
	for _, r := range rs {
		switch {
		case r.code == 0:
			wins++
		case r.code == 2 && (strings.Contains(r.stderr, "is making "+name+" right now") || strings.Contains(r.stderr, "already exists")):
		default:
			t.Errorf("racing new: exit %d: %s", r.code, r.stderr)
		}
	}
	if wins != 1 {
		t.Fatalf("%d of 4 racing news won: %+v", wins, rs)
	}
	h.tagForSweep(name)
	in, _, err := h.c.Instance(context.Background(), name)
	if err != nil || in.Status != "Running" || in.Config["user.claudebox"] != "1" {
		t.Fatalf("the winner is not a running box: %v %v", in.Status, err)
	}
	if boxcore.Minting(in.Config) {
		t.Fatal("the winner is still minting")
	}
}

// list never drops a box while it starts or stops (Incus then reports it with an empty
// config); it shows it with its state.
func TestListDuringTransitions(t *testing.T) {
	h := newHarness(t)
	name := h.name("trans")
	if r := h.newBox(name); r.code != 0 {
		t.Fatalf("new: %s", r.stderr)
	}
	h.tagForSweep(name)
	stop := make(chan struct{})
	var missed, lists int
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		bs := &boxcore.Boxes{Client: h.c, Stack: h.stack}
		for {
			select {
			case <-stop:
				return
			default:
			}
			l, err := bs.List(context.Background())
			if err != nil {
				continue
			}
			lists++
			ok := false
			for _, s := range l {
				ok = ok || (s.Name == name && s.State != "")
			}
			if !ok {
				missed++
			}
		}
	}()
	ctx := context.Background()
	for i := 0; i < 4; i++ {
		if err := h.c.SetState(ctx, name, "stop", true, 0); err != nil {
			t.Fatal(err)
		}
		if err := h.c.SetState(ctx, name, "start", false, 0); err != nil {
			t.Fatal(err)
		}
	}
	close(stop)
	wg.Wait()
	t.Logf("%d lists during 4 stop/start cycles, %d without the box", lists, missed)
	if missed > 0 {
		t.Fatalf("list dropped the box %d times of %d while it changed state", missed, lists)
	}
}

// The clone guard reads what the clone would get — the snapshot's config and devices for
// BOX/SNAP — against claudebox's own allow-list; a refusal creates nothing.
func TestCloneBoundary(t *testing.T) {
	h := newHarness(t)
	a := h.name("src")
	if r := h.newBox(a); r.code != 0 {
		t.Fatalf("new: %s", r.stderr)
	}
	h.tagForSweep(a)
	host := t.TempDir()
	// A snapshot taken while the box was privileged with a host folder mounted; then the live
	// box is cleaned. The live box passes; its snapshot must not.
	h.expect(0, "", "incus", a, "--", "config", "set", "{}", "security.privileged=true")
	h.expect(0, "", "incus", a, "--", "config", "device", "add", "{}", "hostdir", "disk", "source="+host, "path=/mnt/host")
	h.expect(0, "bad", "snapshot", a, "bad")
	h.expect(0, "", "incus", a, "--", "config", "unset", "{}", "security.privileged")
	h.expect(0, "", "incus", a, "--", "config", "device", "remove", "{}", "hostdir")
	h.expect(0, "good", "snapshot", a, "good")

	c := h.name("clone")
	h.removeLater(c)
	r := h.run("new", "--name", c, "--container", "--from", a+"/bad")
	if r.code != 2 || !strings.Contains(r.stderr, "security.privileged") || !strings.Contains(r.stderr, host) || !strings.Contains(r.stderr, "nothing was created") {
		t.Fatalf("clone of the privileged snapshot: exit %d\n%s", r.code, r.stderr)
	}
	h.gone(c, "a refused clone")

	for _, hole := range [][]string{
		{"config", "set", "{}", "raw.lxc=lxc.apparmor.profile=unconfined"},
		{"config", "set", "{}", "boot.autostart=false"},
		{"config", "device", "set", "{}", "eth0", "security.port_isolation=false"}, // the box's own eth0 (BoxNIC), loosened
		{"config", "device", "add", "{}", "p", "proxy", "listen=unix:" + host + "/s", "connect=unix:/tmp/s", "bind=host"},
	} {
		h.expect(0, "", append([]string{"incus", a, "--"}, hole...)...)
		h.unchanged(2, "a clone would inherit a hole", "new", "--name", c, "--container", "--from", a)
		undo := []string{"config", "unset", "{}", strings.Split(hole[3], "=")[0]}
		if hole[1] == "device" && hole[2] == "add" {
			undo = []string{"config", "device", "remove", "{}", hole[4]}
		} else if hole[1] == "device" {
			undo = []string{"config", "device", "set", "{}", hole[4], "security.port_isolation=true"}
		}
		h.expect(0, "", append([]string{"incus", a, "--"}, undo...)...)
	}
	h.expect(0, "is ready", "new", "--name", c, "--container", "--from", a+"/good")
	h.tagForSweep(c)
	in, _, _ := h.c.Instance(context.Background(), c)
	if in.Config["security.privileged"] != "" || in.Devices["hostdir"] != nil {
		t.Fatalf("the clone carries %v %v", in.Config, in.Devices)
	}
}

// The escape hatch refuses arguments naming another instance (box or not) and warns on raw
// API writes.
func TestHatchRails(t *testing.T) {
	h := newHarness(t)
	a, other := h.name("ha"), h.name("hb")
	for _, n := range []string{a, other} {
		if r := h.newBox(n); r.code != 0 {
			t.Fatalf("new: %s", r.stderr)
		}
		h.tagForSweep(n)
	}
	stranger := h.name("stranger")
	if err := h.c.CreateInstance(context.Background(), incus.InstancesPost{Name: stranger, Profiles: []string{h.stack.Profile}, Config: testenv.Tag(),
		Source: incus.InstanceSource{Type: "image", Alias: h.image}}, nil); err != nil {
		t.Fatal(err)
	}
	for _, args := range [][]string{
		{"exec", other, "--", "/sbin/init", "probe", "status"},
		{"stop", other, "--force"},
		{"exec", stranger, "--", "/sbin/init", "probe", "status"},
		{"delete", "-f", stranger},
		{"config", "set", "local:" + stranger, "user.x=1"},
		{"query", "/1.0/instances/" + stranger + "/state"},
	} {
		h.unchanged(2, "the escape hatch acts on its box only", append([]string{"incus", a, "--"}, args...)...)
	}
	r := h.expect(0, "", "incus", a, "--", "query", "-X", "PATCH", "/1.0/instances/{}", "--data", `{"config":{"user.patched":"1"}}`)
	if !strings.Contains(r.stderr, "warning") || !strings.Contains(r.stderr, "writes to the Incus API directly") {
		t.Fatalf("query write without a warning: %s", r.stderr)
	}
	r = h.expect(0, "", "incus", a, "--", "exec", "{}", "--", "/sbin/init", "probe", "status")
	if strings.Contains(r.stderr, "warning") {
		t.Fatalf("harmless exec warned: %s", r.stderr)
	}
}

// Every bad `new` flag is refused before Incus is touched, with what to type instead.
func TestNewValidation(t *testing.T) {
	h := newHarness(t)
	a := h.name("val")
	if r := h.newBox(a); r.code != 0 {
		t.Fatalf("new: %s", r.stderr)
	}
	h.tagForSweep(a)
	y := h.name("y")
	for _, tc := range []struct {
		want string
		args []string
	}{
		{"--cpu 2", []string{"--cpu", "0"}}, {"--cpu 2", []string{"--cpu", "-1"}}, {"--cpu 2", []string{"--cpu", "abc"}},
		{"--memory 4GiB", []string{"--memory", "1XB"}}, {"--memory 4GiB", []string{"--memory", "0"}},
		{"--disk 20GiB", []string{"--disk", "abc"}},
		{"incus image list", []string{"--image", "nosuch"}},
	} {
		args := append([]string{"new", "--name", y, "--container", "--image", h.image}, tc.args...)
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			h.t = t
			r := h.run(args...)
			if r.code != 2 || !strings.Contains(r.stderr, tc.want) || strings.Contains(r.stderr, "operation") {
				t.Fatalf("exit %d, want 2 with %q: %s", r.code, tc.want, r.stderr)
			}
			h.gone(y, "a refused new")
		})
	}
	h.t = t
	h.unchanged(2, "drop --vm", "new", "--name", y, "--vm", "--from", a)
	h.unchanged(2, "--from BOX/SNAP", "new", "--name", y, "--from", "/snap")
	h.unchanged(2, "--from BOX/SNAP", "new", "--name", y, "--from", a+"/")

	// Default snapshot labels never collide, even within one second.
	l1 := strings.TrimSpace(h.expect(0, "snap-", "snapshot", a).stdout)
	l2 := strings.TrimSpace(h.expect(0, "snap-", "snapshot", a).stdout)
	if l1 == l2 {
		t.Fatalf("two default labels: %s", l1)
	}

	// A later "--" is the box command's: exec runs it as given.
	r := h.run("exec", a, "/sbin/init", "probe", "nosuch", "--stat", "--", "f")
	if strings.Contains(r.stderr, "flag provided but not defined") || r.code != 2 {
		t.Fatalf("exec with a later --: exit %d %s", r.code, r.stderr)
	}
}

// Permission denied on the socket is not "the daemon is not answering".
func TestSocketPermission(t *testing.T) {
	h := newHarness(t)
	cmd := exec.Command(teststack.Binary(t), "list")
	cmd.Env = append(os.Environ(), "CLAUDEBOX_STACK="+h.stack.Network)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	out, err := cmd.CombinedOutput()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 1 || !strings.Contains(string(out), "permission denied on the Incus socket") || strings.Contains(string(out), "not answering") {
		t.Fatalf("list as nobody: %v %s", err, out)
	}
}
