package cli

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"golang.org/x/term"

	"github.com/claudebox/claudebox/boxcore"
	"github.com/claudebox/claudebox/boxcore/incus"
)

// signalGrace is how long a command that was passed claudebox's SIGINT, SIGTERM or SIGHUP
// has to end before it is killed.
const signalGrace = 3 * time.Second

// defaultSession is the tmux session `claudebox tmux BOX` makes when the box has none.
const defaultSession = "claude"

// shellBox logs in to a box as its user: with a terminal, a terminal of the same size that
// follows its resizes; without one (stdin a pipe or a file), the login shell reads its
// commands from stdin and ends at EOF. --session attaches to a tmux session instead.
func shellBox(c *Ctx) error {
	if err := needRunning(c, "shell"); err != nil {
		return err
	}
	u, err := boxes(c).LookupUser(c.Context.Context, c.Box, c.String("user"))
	if err != nil {
		return err
	}
	if c.IsSet("session") {
		return attachTmux(c, u, c.String("session"), "shell --session")
	}
	return runInteractive(c, boxcore.UserExec(u, nil), stdinTerminal(c))
}

// execBox runs a command as the box's user (claude where it exists, else root; --user picks
// another) with that user's login environment. Its exit code is claudebox's, as a shell
// reports it: 127 not found, 126 not executable, 128+N killed by signal N.
func execBox(c *Ctx) error {
	cmd := c.Args[1:]
	if len(cmd) > 0 && cmd[0] == "--" {
		cmd = cmd[1:]
	}
	if len(cmd) == 0 {
		return boxcore.Usagef("exec: no command (usage: claudebox exec BOX [--user NAME] -- CMD...)")
	}
	if err := needRunning(c, "exec"); err != nil {
		return err
	}
	u, err := boxes(c).LookupUser(c.Context.Context, c.Box, c.String("user"))
	if err != nil {
		return err
	}
	tty := stdinTerminal(c) && isTerminal(os.Stdout)
	return runInteractive(c, boxcore.UserExec(u, cmd), tty)
}

// tmuxBox attaches to (or makes) a tmux session in the box that outlives the terminal:
// closing the terminal detaches, the session's programs keep running.
func tmuxBox(c *Ctx) error {
	if err := needRunning(c, "tmux"); err != nil {
		return err
	}
	u, err := boxes(c).LookupUser(c.Context.Context, c.Box, c.String("user"))
	if err != nil {
		return err
	}
	if c.Bool("list") {
		if len(c.Args) > 1 {
			return boxcore.Usagef("tmux: --list takes no SESSION")
		}
		sessions, err := boxes(c).TmuxSessions(c.Context.Context, c.Box, u)
		if err != nil {
			return err
		}
		if len(sessions) == 0 {
			c.Warn("no tmux sessions of %s in %s (start one: claudebox tmux %s [SESSION])", u.Name, c.Box.Name, c.Box.Name)
			return nil
		}
		tw := tabwriter.NewWriter(c.Env.Stdout, 0, 0, 2, ' ', 0)
		fmt.Fprintln(tw, "SESSION\tWINDOWS\tATTACHED\tCREATED")
		for _, s := range sessions {
			fmt.Fprintf(tw, "%s\t%d\t%d\t%s\n", s.Name, s.Windows, s.Attached, time.Unix(s.Created, 0).UTC().Format("2006-01-02 15:04"))
		}
		return tw.Flush()
	}
	return attachTmux(c, u, argAt(c.Args, 1), "tmux")
}

// attachTmux runs `tmux new-session -A -s NAME` as u on the caller's terminal. Without a
// name it picks the only session, makes "claude" when there is none, and refuses to guess
// between several.
func attachTmux(c *Ctx, u boxcore.BoxUser, name, verb string) error {
	if name != "" && (strings.ContainsAny(name, ":.") || strings.TrimSpace(name) == "") {
		return boxcore.Usagef("%s: session name %q: tmux names cannot be blank or hold ':' or '.'", verb, name)
	}
	sessions, err := boxes(c).TmuxSessions(c.Context.Context, c.Box, u)
	if err != nil {
		return err
	}
	if !stdinTerminal(c) {
		return boxcore.Usagef("%s: attaching to a session needs a terminal (stdin is not one); list them with: claudebox tmux %s --list", verb, c.Box.Name)
	}
	if name == "" {
		switch len(sessions) {
		case 0:
			name = defaultSession
		case 1:
			name = sessions[0].Name
		default:
			var names []string
			for _, s := range sessions {
				names = append(names, s.Name)
			}
			return boxcore.Usagef("%s: %s has %d tmux sessions (%s): name one: claudebox tmux %s SESSION",
				verb, c.Box.Name, len(sessions), strings.Join(names, ", "), c.Box.Name)
		}
	}
	return runInteractive(c, boxcore.UserExec(u, []string{"tmux", "new-session", "-A", "-s", name}), true)
}

func needRunning(c *Ctx, verb string) error {
	if !c.Box.Running() || c.Box.Instance.Status != "Running" {
		return boxcore.Usagef("%s: box %s is %s: start it first: claudebox start %s", verb, c.Box.Name, strings.ToLower(c.Box.Instance.Status), c.Box.Name)
	}
	return nil
}

// stdinTerminal reports whether the command's stdin is the process's own terminal.
func stdinTerminal(c *Ctx) bool {
	f, ok := c.Env.Stdin.(*os.File)
	return ok && f == os.Stdin && isTerminal(os.Stdin)
}

// runInteractive runs req in the box wired to claudebox's streams and returns its exit code
// as an exitError. With tty: the terminal is put in raw mode, the box gets a terminal of its
// size, and every SIGWINCH is passed on as a resize. Without: stdin is piped and its EOF is
// the command's. A SIGINT, SIGTERM or SIGHUP claudebox gets is passed to the command, which
// has signalGrace to end before it is killed; claudebox then exits 128+N.
func runInteractive(c *Ctx, req incus.ExecRequest, tty bool) error {
	w, h := 80, 24
	done := make(chan struct{})
	defer close(done)
	if req.Env == nil {
		req.Env = map[string]string{}
	}
	if tty {
		in := int(os.Stdin.Fd())
		sizeFD := int(os.Stdout.Fd())
		if !term.IsTerminal(sizeFD) {
			sizeFD = in
		}
		if cols, rows, err := term.GetSize(sizeFD); err == nil && cols > 0 && rows > 0 {
			w, h = cols, rows
		}
		req.Env["TERM"] = termName()
		resize := make(chan [2]int, 1)
		winch := make(chan os.Signal, 1)
		signal.Notify(winch, syscall.SIGWINCH)
		defer signal.Stop(winch)
		go forwardResizes(sizeFD, winch, resize, done)
		req.Resize = resize
		if old, err := term.MakeRaw(in); err == nil {
			defer term.Restore(in, old)
		}
	}
	parent := c.Context.Context
	sigs := make(chan int, 1)
	req.Signal = sigs
	ctx, cancel := context.WithCancel(context.WithoutCancel(parent))
	defer cancel()
	go func() {
		select {
		case <-done:
			return
		case <-parent.Done():
		}
		var se *signalError
		if errors.As(context.Cause(parent), &se) {
			sigs <- int(se.sig)
			select {
			case <-done:
				return
			case <-time.After(signalGrace):
			}
		}
		cancel()
	}()
	code, err := c.Client.ExecInteractive(ctx, c.Box.Name, req, c.Env.Stdin, c.Env.Stdout, c.Env.Stderr, tty, w, h)
	var se *signalError
	if errors.As(context.Cause(parent), &se) {
		if err != nil {
			return fmt.Errorf("%s: the command in %s did not end within %s of it and was killed", se, c.Box.Name, signalGrace)
		}
		return fmt.Errorf("%s: passed to the command in %s, which exited %d", se, c.Box.Name, code)
	}
	if err != nil {
		return err
	}
	if code != 0 {
		return exitError{code}
	}
	return nil
}

// forwardResizes reads the terminal's size on every SIGWINCH and offers it to resize,
// replacing a size not yet sent, until done.
func forwardResizes(fd int, winch <-chan os.Signal, resize chan [2]int, done <-chan struct{}) {
	for {
		select {
		case <-done:
			return
		case <-winch:
		}
		cols, rows, err := term.GetSize(fd)
		if err != nil || cols <= 0 || rows <= 0 {
			continue
		}
		select {
		case <-resize: // a size not yet sent is stale
		default:
		}
		select {
		case resize <- [2]int{cols, rows}:
		default:
		}
	}
}

func isTerminal(f *os.File) bool { return term.IsTerminal(int(f.Fd())) }

func termName() string {
	if t := os.Getenv("TERM"); t != "" {
		return t
	}
	return "xterm-256color"
}
