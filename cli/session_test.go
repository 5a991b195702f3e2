package cli

import (
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/claudebox/claudebox/internal/cloudimage"
	"github.com/claudebox/claudebox/internal/testenv"
	"github.com/claudebox/claudebox/internal/teststack"
)

// ptyProc is the claudebox binary running on a real pseudo-terminal, as its session leader
// with the pty as its controlling terminal (so resizes give it SIGWINCH and closing the
// master gives it SIGHUP).
type ptyProc struct {
	t      *testing.T
	master *os.File
	cmd    *exec.Cmd
	mu     sync.Mutex
	out    bytes.Buffer
	done   chan struct{}
	read   chan struct{} // closed when the master reads EOF or EIO: all output is in
	code   int
}

// openPTY opens a pseudo-terminal pair. The master is non-blocking, so that closing it while
// a goroutine reads it really closes it (a hang-up for the other side).
func openPTY(t *testing.T) (master, slave *os.File) {
	t.Helper()
	fd, err := unix.Open("/dev/ptmx", unix.O_RDWR|unix.O_NOCTTY|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.IoctlSetPointerInt(fd, unix.TIOCSPTLCK, 0); err != nil {
		t.Fatal(err)
	}
	n, err := unix.IoctlGetInt(fd, unix.TIOCGPTN)
	if err != nil {
		t.Fatal(err)
	}
	s, err := os.OpenFile("/dev/pts/"+strconv.Itoa(n), os.O_RDWR|syscall.O_NOCTTY, 0)
	if err != nil {
		t.Fatal(err)
	}
	return os.NewFile(uintptr(fd), "ptmx"), s
}

// setWinsize sets the terminal's size (the kernel then sends SIGWINCH to its foreground
// process group), without Fd(), which would make the master blocking.
func setWinsize(t *testing.T, f *os.File, cols, rows int) {
	t.Helper()
	rc, err := f.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var ierr error
	if err := rc.Control(func(fd uintptr) {
		ierr = unix.IoctlSetWinsize(int(fd), unix.TIOCSWINSZ, &unix.Winsize{Col: uint16(cols), Row: uint16(rows)})
	}); err != nil {
		t.Fatal(err)
	}
	if ierr != nil {
		t.Fatal(ierr)
	}
}

func (h *harness) startPTY(cols, rows int, args ...string) *ptyProc {
	h.t.Helper()
	m, s := openPTY(h.t)
	setWinsize(h.t, m, cols, rows)
	cmd := exec.Command(teststack.Binary(h.t), args...)
	cmd.Env = append(os.Environ(), "CLAUDEBOX_STACK="+h.stack.Network, "TERM=xterm")
	cmd.Stdin, cmd.Stdout, cmd.Stderr = s, s, s
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Setctty: true, Ctty: 0}
	if err := cmd.Start(); err != nil {
		h.t.Fatal(err)
	}
	s.Close()
	p := &ptyProc{t: h.t, master: m, cmd: cmd, done: make(chan struct{}), read: make(chan struct{})}
	go func() {
		defer close(p.read)
		buf := make([]byte, 4096)
		for {
			n, err := m.Read(buf)
			p.mu.Lock()
			p.out.Write(buf[:n])
			p.mu.Unlock()
			if err != nil {
				return
			}
		}
	}()
	go func() {
		err := cmd.Wait()
		var ee *exec.ExitError
		p.code = 0
		if errors.As(err, &ee) {
			p.code = ee.ExitCode()
		} else if err != nil {
			p.code = -1
		}
		close(p.done)
	}()
	h.t.Cleanup(func() {
		select {
		case <-p.done:
		default:
			_ = cmd.Process.Kill()
			<-p.done
		}
		m.Close()
	})
	return p
}

func (p *ptyProc) output() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.out.String()
}

// waitFor waits until the output after offset matches re, and returns the offset past it.
func (p *ptyProc) waitFor(from int, re string, within time.Duration) int {
	p.t.Helper()
	rx := regexp.MustCompile(re)
	deadline := time.Now().Add(within)
	for time.Now().Before(deadline) {
		out := p.output()
		if from <= len(out) {
			if loc := rx.FindStringIndex(out[from:]); loc != nil {
				return from + loc[1]
			}
		}
		select {
		case <-p.done:
			p.t.Fatalf("claudebox exited %d before printing %q; output:\n%q", p.code, re, p.output())
		case <-time.After(50 * time.Millisecond):
		}
	}
	p.t.Fatalf("no %q within %s; output:\n%q", re, within, p.output())
	return 0
}

func (p *ptyProc) send(s string) {
	p.t.Helper()
	if _, err := p.master.Write([]byte(s)); err != nil {
		p.t.Fatal(err)
	}
}

func (p *ptyProc) wait(within time.Duration) int {
	p.t.Helper()
	select {
	case <-p.done:
	case <-time.After(within):
		p.t.Fatalf("claudebox did not exit within %s; output:\n%q", within, p.output())
	}
	// What it wrote last may still be in the master: read it all before judging.
	select {
	case <-p.read:
	case <-time.After(2 * time.Second):
	}
	return p.code
}

// hangup closes the terminal, as closing a terminal window does.
func (p *ptyProc) hangup() { p.master.Close() }

// runBin runs the binary with stdin from a string (never a terminal), bounded in time: a
// hang is a failure, not a stuck test.
func (h *harness) runBin(stdin string, within time.Duration, args ...string) procResult {
	h.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), within)
	defer cancel()
	cmd := exec.CommandContext(ctx, teststack.Binary(h.t), args...)
	cmd.Env = append(os.Environ(), "CLAUDEBOX_STACK="+h.stack.Network)
	cmd.Stdin = strings.NewReader(stdin)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	start := time.Now()
	err := cmd.Run()
	r := procResult{stdout: out.String(), stderr: errb.String(), took: time.Since(start)}
	if ctx.Err() != nil {
		h.t.Fatalf("claudebox %s: still running after %s (hung)\nstdout: %s\nstderr: %s", strings.Join(args, " "), within, r.stdout, r.stderr)
	}
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		r.code = ee.ExitCode()
	} else if err != nil {
		h.t.Fatal(err)
	}
	return r
}

// TestSessions: shell follows terminal resizes and works without a terminal; exec runs as the
// box's user with a login environment (or --user), pipes stdin, and exits as a shell would;
// tmux sessions survive the terminal and are reattached and listed. One box from the test
// cloud image with the blank template (user claude); tmux is added by the test.
func TestSessions(t *testing.T) {
	c := testenv.RequireIncus(t)
	ctx := context.Background()
	img, err := cloudimage.Ensure(ctx, c, cloudimage.Default(), testLog{t})
	if err != nil {
		t.Fatalf("cloud image: %v", err)
	}
	h := &harness{t: t, c: c, stack: teststack.New(t, c, "session"), image: img.Alias}
	box := h.name("sess")
	h.removeLater(box)
	if r := h.run("new", "--name", box, "--container", "--image", img.Alias, "--template", "blank"); r.code != 0 {
		t.Fatalf("new: exit %d\n%s\n%s", r.code, r.stdout, r.stderr)
	}
	h.tagForSweep(box)
	top := h
	sub := func(t *testing.T) *harness { h := *top; h.t = t; return &h }

	t.Run("exec runs as the box's user with a login environment", func(t *testing.T) {
		h := sub(t)
		h.expect(0, "claude\n", "exec", box, "--", "id", "-un")
		r := h.expect(0, "", "exec", box, "--", "sh", "-c", `echo "home=$HOME user=$USER logname=$LOGNAME shell=$SHELL cwd=$(pwd) path=$PATH"`)
		for _, want := range []string{"home=/home/claude ", "user=claude ", "logname=claude ", "shell=/bin/bash ", "cwd=/home/claude "} {
			if !strings.Contains(r.stdout, want) {
				t.Errorf("exec environment lacks %q: %s", want, r.stdout)
			}
		}
		h.expect(0, "", "exec", box, "--", "sh", "-c", "mkdir -p ~/.local/bin && printf '#!/bin/sh\\necho mine\\n' > ~/.local/bin/mytool && chmod +x ~/.local/bin/mytool")
		h.expect(0, "mine", "exec", box, "--", "mytool")
		h.expect(0, "", "exec", box, "--", "touch", "/home/claude/made-by-exec")
		h.expect(0, "claude:claude", "exec", box, "--user", "root", "--", "stat", "-c", "%U:%G", "/home/claude/made-by-exec")
		// Arguments reach the command as given: no re-splitting, no expansion.
		h.expect(0, "a b|$HOME|c'd|*|", "exec", box, "--", "printf", "%s|", "a b", "$HOME", "c'd", "*")
	})

	t.Run("exec --user root", func(t *testing.T) {
		h := sub(t)
		r := h.expect(0, "root\n", "exec", box, "--user", "root", "--", "sh", "-c", "id -un; echo home=$HOME; pwd")
		if !strings.Contains(r.stdout, "home=/root\n/root\n") {
			t.Fatalf("root's environment: %q", r.stdout)
		}
		h.expect(2, "no user nosuchuser", "exec", box, "--user", "nosuchuser", "--", "true")
	})

	t.Run("exec pipes stdin without a terminal; EOF ends it", func(t *testing.T) {
		h := sub(t)
		r := h.runBin("one\ntwo\nthree\n", 30*time.Second, "exec", box, "--", "wc", "-l")
		if r.code != 0 || strings.TrimSpace(r.stdout) != "3" {
			t.Fatalf("exec wc -l: exit %d stdout %q stderr %q", r.code, r.stdout, r.stderr)
		}
		r = h.runBin("through cat\n", 30*time.Second, "exec", box, "--", "cat")
		if r.code != 0 || r.stdout != "through cat\n" {
			t.Fatalf("exec cat: exit %d stdout %q stderr %q", r.code, r.stdout, r.stderr)
		}
	})

	t.Run("exit codes as a shell gives them", func(t *testing.T) {
		h := sub(t)
		for _, tc := range []struct {
			code int
			cmd  []string
		}{
			{127, []string{"no-such-command-here"}},
			{126, []string{"/etc/passwd"}},
			{3, []string{"sh", "-c", "exit 3"}},
			{130, []string{"sh", "-c", "kill -INT $$"}},
			{143, []string{"sh", "-c", "kill -TERM $$"}},
		} {
			if r := h.run(append([]string{"exec", box, "--"}, tc.cmd...)...); r.code != tc.code {
				t.Errorf("exec %v: exit %d, want %d (stderr %q)", tc.cmd, r.code, tc.code, r.stderr)
			}
		}
		// SIGINT to claudebox without a terminal is passed to the command, which sees it.
		r := h.runSignalled(syscall.SIGINT, 2*time.Second, "exec", box, "--", "bash", "-c", `trap 'echo got-sigint; exit 0' INT; echo ready; sleep 60 & wait`)
		if r.code != 130 || !strings.Contains(r.stdout, "got-sigint") || r.took > 2*time.Second {
			t.Fatalf("interrupted exec: exit %d after %s, want 130 with the command's trap output\nstdout: %q\nstderr: %q", r.code, r.took, r.stdout, r.stderr)
		}
		r = h.runSignalled(syscall.SIGTERM, 2*time.Second, "exec", box, "--", "bash", "-c", `trap 'echo got-sigterm; exit 0' TERM; sleep 60 & wait`)
		if r.code != 143 || !strings.Contains(r.stdout, "got-sigterm") || r.took > 2*time.Second {
			t.Fatalf("terminated exec: exit %d after %s, want 143 with the command's trap output\nstdout: %q\nstderr: %q", r.code, r.took, r.stdout, r.stderr)
		}
	})

	t.Run("shell without a terminal reads stdin and ends at EOF", func(t *testing.T) {
		h := sub(t)
		r := h.runBin("id -un; echo home=$HOME; exit 7\n", 30*time.Second, "shell", box)
		if r.code != 7 || !strings.Contains(r.stdout, "claude\nhome=/home/claude") {
			t.Fatalf("shell < script: exit %d stdout %q stderr %q", r.code, r.stdout, r.stderr)
		}
		if r := h.runBin("", 30*time.Second, "shell", box); r.code != 0 {
			t.Fatalf("shell < /dev/null: exit %d stderr %q", r.code, r.stderr)
		}
		if r := h.runBin("id -un\n", 30*time.Second, "shell", box, "--user", "root"); r.code != 0 || r.stdout != "root\n" {
			t.Fatalf("shell --user root: exit %d stdout %q stderr %q", r.code, r.stdout, r.stderr)
		}
	})

	t.Run("shell follows terminal resizes", func(t *testing.T) {
		h := sub(t)
		p := h.startPTY(132, 40, "shell", box)
		p.send("stty size; echo M$((40+1))\r")
		at := p.waitFor(0, `40 132\r?\n(?:.*\n)?M41`, 30*time.Second)
		p.send("id -un; echo M$((40+2))\r")
		at = p.waitFor(at, `claude\r?\nM42`, 10*time.Second)
		setWinsize(t, p.master, 100, 30)
		time.Sleep(500 * time.Millisecond)
		p.send("stty size; echo M$((40+3))\r")
		p.waitFor(at, `M43`, 10*time.Second)
		seen := p.output()[at:]
		if !strings.Contains(seen, "30 100") {
			t.Fatalf("after a resize to 100x30 stty size did not say 30 100:\n%q", seen)
		}
		p.send("exit 5\r")
		if code := p.wait(20 * time.Second); code != 5 {
			t.Fatalf("shell exit 5 on a terminal: exit %d", code)
		}
	})

	// The control for the survival check below: a loop in a plain shell dies with the terminal.
	t.Run("a plain shell dies with its terminal", func(t *testing.T) {
		h := sub(t)
		p := h.startPTY(100, 30, "shell", box)
		p.send("while :; do date +%s%N >> /tmp/plain-loop; sleep 0.2; done\r")
		waitLines(t, h, box, "/tmp/plain-loop", 3)
		p.hangup()
		if code := p.wait(20 * time.Second); code != 129 {
			t.Fatalf("hung-up shell: exit %d, want 129", code)
		}
		time.Sleep(time.Second)
		a := countLines(t, h, box, "/tmp/plain-loop")
		time.Sleep(1500 * time.Millisecond)
		if b := countLines(t, h, box, "/tmp/plain-loop"); b != a {
			t.Fatalf("the plain shell's loop still writes after the terminal closed (%d → %d lines)", a, b)
		}
	})

	t.Run("tmux", func(t *testing.T) {
		h := sub(t)
		h.expect(2, "has no tmux", "tmux", box, "--list")
		h.expect(2, "has no tmux", "tmux", box, "work")
		r := h.run("exec", box, "--user", "root", "--", "sh", "-c", "DEBIAN_FRONTEND=noninteractive apt-get install -y tmux >/dev/null 2>&1 || (apt-get update >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y tmux)")
		if r.code != 0 {
			t.Fatalf("installing tmux in the box: exit %d\n%s\n%s", r.code, r.stdout, r.stderr)
		}
		r = h.expect(0, "no tmux sessions", "tmux", box, "--list")
		if r.stdout != "" {
			t.Fatalf("--list with no sessions printed %q on stdout", r.stdout)
		}
		h.expect(2, "needs a terminal", "tmux", box, "work")
		h.expect(2, "cannot be blank or hold", "tmux", box, "a:b")

		p := h.startPTY(120, 35, "tmux", box, "work")
		p.waitFor(0, `\[work\]`, 30*time.Second)
		p.send("X=marker$((40+2)); while :; do date +%s%N >> /tmp/tmux-loop; sleep 0.2; done\r")
		waitLines(t, h, box, "/tmp/tmux-loop", 3)
		p.hangup()
		if code := p.wait(20 * time.Second); code != 129 {
			t.Fatalf("hung-up tmux: exit %d, want 129", code)
		}
		a := countLines(t, h, box, "/tmp/tmux-loop")
		time.Sleep(1500 * time.Millisecond)
		if b := countLines(t, h, box, "/tmp/tmux-loop"); b <= a {
			t.Fatalf("the loop in the tmux session stopped when the terminal closed (%d → %d lines)", a, b)
		}
		r = h.expect(0, "work", "tmux", box, "--list")
		if !regexp.MustCompile(`(?m)^work\s+1\s+0\s`).MatchString(r.stdout) {
			t.Fatalf("--list: want work, 1 window, 0 attached:\n%s", r.stdout)
		}

		// Reattach without a name: the only session, the same shell (its variable, its loop).
		p = h.startPTY(120, 35, "tmux", box)
		p.waitFor(0, `\[work\]`, 30*time.Second)
		p.send("\x03")
		time.Sleep(300 * time.Millisecond)
		p.send("echo v=$X\r")
		p.waitFor(0, `v=marker42`, 10*time.Second)
		p.hangup()
		if code := p.wait(20 * time.Second); code != 129 {
			t.Fatalf("hung-up reattach: exit %d, want 129", code)
		}

		// shell --session makes a second one; then a bare reattach must not guess.
		p = h.startPTY(120, 35, "shell", box, "--session", "other")
		p.waitFor(0, `\[other\]`, 30*time.Second)
		p.hangup()
		p.wait(20 * time.Second)
		r = h.expect(0, "other", "tmux", box, "--list")
		if !strings.Contains(r.stdout, "work") {
			t.Fatalf("--list lost a session:\n%s", r.stdout)
		}
		p = h.startPTY(120, 35, "tmux", box)
		if code := p.wait(20 * time.Second); code != 2 || !strings.Contains(p.output(), "other, work") {
			t.Fatalf("bare tmux with two sessions: exit %d, want 2 listing them:\n%q", code, p.output())
		}
		// The sessions are the box user's: root has none.
		h.expect(0, "no tmux sessions of root", "tmux", box, "--list", "--user", "root")
	})
}

func countLines(t *testing.T, h *harness, box, path string) int {
	t.Helper()
	r := h.run("exec", box, "--", "sh", "-c", "cat "+path+" 2>/dev/null | wc -l")
	n, err := strconv.Atoi(strings.TrimSpace(r.stdout))
	if r.code != 0 || err != nil {
		t.Fatalf("counting lines of %s: exit %d %q %q", path, r.code, r.stdout, r.stderr)
	}
	return n
}

func waitLines(t *testing.T, h *harness, box, path string, n int) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		if countLines(t, h, box, path) >= n {
			return
		}
		time.Sleep(200 * time.Millisecond)
	}
	t.Fatalf("%s never got %d lines", path, n)
}
