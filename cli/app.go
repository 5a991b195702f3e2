package cli

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/urfave/cli/v2"
	"golang.org/x/term"

	"github.com/claudebox/claudebox/boxcore"
	"github.com/claudebox/claudebox/boxcore/incus"
)

// Version is set at build time.
var Version = "dev"

// Env is what the command line runs against; tests swap the streams.
type Env struct {
	Stdin          io.Reader
	Stdout, Stderr io.Writer
	// Terminal reports whether prompts can be asked (stdin and stderr are terminals).
	Terminal bool
	// Stack is the host stack the verbs use (DefaultStack unless CLAUDEBOX_STACK names a test stack).
	Stack boxcore.Stack
}

// Ctx is what an action sees once its preconditions held.
type Ctx struct {
	*cli.Context
	Env    *Env
	Cmd    Command
	Client *incus.Client // set by NeedsDaemon
	Box    *boxcore.Box  // set by NeedsBox
	Args   []string      // positional arguments (after the box, for box verbs: all of them)
}

// Out prints a line to stdout.
func (c *Ctx) Out(format string, a ...any) { fmt.Fprintf(c.Env.Stdout, format+"\n", a...) }

// Warn prints a line to stderr.
func (c *Ctx) Warn(format string, a ...any) { fmt.Fprintf(c.Env.Stderr, format+"\n", a...) }

// exitError carries an exit code chosen by an action (exec, incus) through urfave/cli.
type exitError struct{ code int }

func (e exitError) Error() string { return fmt.Sprintf("exit %d", e.code) }

// DefaultEnv is the process's own streams.
func DefaultEnv() *Env {
	return &Env{
		Stdin: os.Stdin, Stdout: os.Stdout, Stderr: os.Stderr,
		Terminal: term.IsTerminal(int(os.Stdin.Fd())) && term.IsTerminal(int(os.Stderr.Fd())),
		Stack:    StackFromEnv(),
	}
}

// StackFromEnv returns the product stack, or a named test stack when CLAUDEBOX_STACK is set,
// so that tests never touch a user's real claudenet.
func StackFromEnv() boxcore.Stack {
	if name := os.Getenv("CLAUDEBOX_STACK"); name != "" {
		return boxcore.NamedStack(name)
	}
	return boxcore.DefaultStack()
}

// Run runs the command line and returns the process exit code: 0 ok, 2 usage, 1 failure,
// or the code an exec'd command returned.
func Run(env *Env, args []string) int {
	code := 0
	app := NewApp(env, &code)
	ctx, cancel := context.WithCancelCause(context.Background())
	defer cancel(nil)
	sigs := make(chan os.Signal, 1)
	// Never stopped: a signal after the command's work is done (between Run returning and
	// the process exiting) must not kill a process whose box is whole — it exits with its
	// code. Measured: `new` finished at 300 ms, a SIGINT then killed it (exit -1) with the
	// box running.
	signal.Notify(sigs, os.Interrupt, syscall.SIGTERM, syscall.SIGHUP) // SIGHUP: the terminal went away (exit 129)
	go func() {
		select {
		case s := <-sigs:
			cancel(&signalError{s.(syscall.Signal)})
		case <-ctx.Done():
		}
	}()
	err := app.RunContext(ctx, permuteFlags(args))
	// An interrupted command exits 128+signal (130 on SIGINT, 143 on SIGTERM), as a shell
	// reports it, whatever the action made of the cut-short step. A command that finished
	// its work although the signal came in at the very end succeeded: `new` then made a
	// whole box, and says so with exit 0.
	var se *signalError
	if cause := context.Cause(ctx); err != nil && errors.As(cause, &se) {
		msg := err.Error()
		if !strings.Contains(msg, "interrupted (") {
			// Cut short before a step that says what it left (new's, import's): name the
			// signal, not Go's "context canceled" (a SIGTERM during new's first request to
			// Incus said only that).
			msg = "interrupted (" + se.Error() + "): " + strings.ReplaceAll(msg, context.Canceled.Error(), "cut short")
		}
		fmt.Fprintln(env.Stderr, "claudebox: "+msg)
		return 128 + int(se.sig)
	}
	if err == nil {
		return code
	}
	var ee exitError
	switch {
	case errors.As(err, &ee):
		return ee.code
	case boxcore.IsUsage(err) || isFlagError(err):
		fmt.Fprintln(env.Stderr, "claudebox: "+Render(err))
		return 2
	default:
		fmt.Fprintln(env.Stderr, "claudebox: "+Render(err))
		return 1
	}
}

// signalError is the cause of the command's context when a signal ended it.
type signalError struct{ sig syscall.Signal }

func (e *signalError) Error() string {
	switch e.sig {
	case syscall.SIGINT:
		return "SIGINT"
	case syscall.SIGTERM:
		return "SIGTERM"
	case syscall.SIGHUP:
		return "SIGHUP"
	}
	return e.sig.String()
}

func isFlagError(err error) bool {
	s := err.Error()
	return strings.HasPrefix(s, "flag provided but not defined") || strings.HasPrefix(s, "invalid value") ||
		strings.Contains(s, "flag needs an argument") || strings.HasPrefix(s, "Required flag")
}

// NewApp renders the table into a urfave/cli application.
func NewApp(env *Env, code *int) *cli.App {
	app := &cli.App{
		Name:      "claudebox",
		Usage:     "trust-less, network-isolated Incus boxes with Claude Code installed, and a drill that proves the isolation",
		Version:   Version,
		Reader:    env.Stdin,
		Writer:    env.Stdout,
		ErrWriter: env.Stderr,
		// Errors are printed once, by Run, with the right exit code.
		ExitErrHandler:  func(*cli.Context, error) {},
		HideHelpCommand: true,
		// The table has its own help row, so urfave adds no --help of its own: this is it.
		Flags:                []cli.Flag{cli.HelpFlag},
		EnableBashCompletion: false,
		CommandNotFound: func(c *cli.Context, name string) {
			fmt.Fprintln(env.Stderr, "claudebox: "+unknownCommand(name, verbs()).Error())
			*code = 2
		},
		OnUsageError: func(c *cli.Context, err error, _ bool) error { return boxcore.Usagef("%v", err) },
	}
	groups := map[string]*cli.Command{}
	for _, row := range Commands() {
		cmd := render(env, row)
		parent, leaf, nested := strings.Cut(row.Name, " ")
		if !nested {
			app.Commands = append(app.Commands, cmd)
			continue
		}
		cmd.Name = leaf
		g := groups[parent]
		if g == nil {
			g = &cli.Command{Name: parent, Usage: groupUsage[parent], HideHelpCommand: true, Hidden: true}
			g.Action = groupAction(env, parent)
			groups[parent] = g
			app.Commands = append(app.Commands, g)
		}
		g.Subcommands = append(g.Subcommands, cmd)
		g.Hidden = g.Hidden && row.Hidden // a group shows when one of its rows does
	}
	return app
}

// groupDefault is the subcommand a group runs when named alone (`claudebox templates`, the
// verb's name before it became a group); a group without one shows its help.
var groupDefault = map[string]string{"templates": "list"}

// groupAction runs for a group named alone (its default, else its help) or with a word that
// is none of its subcommands (a usage error naming the nearest).
func groupAction(env *Env, group string) cli.ActionFunc {
	return func(c *cli.Context) error {
		if c.Args().Len() == 0 {
			if sub, ok := groupDefault[group]; ok {
				row, _, _ := findRow([]string{group, sub})
				ctx := &Ctx{Context: c, Env: env, Cmd: row}
				if err := runPreconditions(ctx); err != nil {
					return err
				}
				return row.Action(ctx)
			}
			return cli.ShowSubcommandHelp(c)
		}
		return unknownCommand(group+" "+c.Args().First(), subverbs(group))
	}
}

var groupUsage = map[string]string{
	"host":      "build, check and tear down the host's isolation stack",
	"image":     "build the local Debian 12 cloud image (for hosts that reach no image server)",
	"templates": "list the box templates, and bake one into a local image (ready in seconds)",
}

// render turns one row into a urfave command whose action runs the preconditions, then the row.
func render(env *Env, row Command) *cli.Command {
	flags := append([]cli.Flag{}, row.Flags...)
	if row.Has(NeedsDaemon) {
		flags = append(flags, remoteFlag)
	}
	usage := strings.Join(row.Args, " ")
	for _, o := range row.Optional {
		usage += " [" + o + "]"
	}
	if row.Variadic != "" {
		usage = strings.TrimSpace(usage + " [--] " + row.Variadic)
	}
	if row.Synopsis != "" {
		usage = strings.TrimSpace(usage + " " + row.Synopsis)
	}
	return &cli.Command{
		Name:               row.Name,
		Usage:              row.Summary,
		ArgsUsage:          usage,
		Hidden:             row.Hidden,
		CustomHelpTemplate: helpTemplate(cli.CommandHelpTemplate, row.Examples),
		Flags:              flags,
		SkipFlagParsing:    row.Passthrough,
		OnUsageError:       func(c *cli.Context, err error, _ bool) error { return flagUsage(row, err) },
		Action: func(c *cli.Context) error {
			ctx := &Ctx{Context: c, Env: env, Cmd: row, Args: c.Args().Slice()}
			if err := runPreconditions(ctx); err != nil {
				return err
			}
			return row.Action(ctx)
		},
	}
}

var remoteFlag = &cli.StringFlag{Name: "remote", Usage: "Incus remote (from the incus CLI's config)", Value: ""}

// runPreconditions checks a row's preconditions in the fixed order, before any action.
func runPreconditions(c *Ctx) error {
	row := c.Cmd
	for _, p := range preconditionOrder {
		if !row.Has(p) {
			continue
		}
		switch p {
		case NeedsArgs:
			if len(c.Args) < len(row.Args) {
				return boxcore.Usagef("%s: missing %s (usage: claudebox %s %s)", row.Name,
					strings.Join(row.Args[len(c.Args):], " "), row.Name, strings.Join(row.Args, " "))
			}
			if row.Variadic == "" && len(c.Args) > len(row.Args)+len(row.Optional) {
				return boxcore.Usagef("%s: unexpected argument %q (usage: claudebox %s %s)", row.Name,
					c.Args[len(row.Args)], row.Name, strings.Join(row.Args, " "))
			}
		case NeedsRoot:
			if err := boxcore.RequireRoot(); err != nil {
				return err
			}
		case NeedsDaemon:
			cl, err := incus.Connect(c.Context.Context, c.String("remote"))
			if err != nil {
				var ur *incus.UnknownRemoteError
				if errors.As(err, &ur) {
					return boxcore.Usagef("%v", err)
				}
				return err
			}
			c.Client = cl
		case NeedsBox:
			box, err := boxcore.Resolve(c.Context.Context, c.Client, c.Args[0])
			if err != nil {
				return err
			}
			c.Box = box
		case NeedsStopped:
			if c.Box.Running() {
				return boxcore.Usagef("box '%s' is running — stop it first: claudebox stop %s", c.Box.Name, c.Box.Name)
			}
		case NeedsSnapshot:
			b := &boxcore.Boxes{Client: c.Client, Stack: c.Env.Stack}
			if _, err := b.FindSnapshot(c.Context.Context, c.Box, c.Args[1]); err != nil {
				return err
			}
		case NeedsForceIfRunning:
			if c.Box.Running() && !c.Bool("force") {
				return boxcore.Usagef("%s: box %s is %s: stop it first (claudebox stop %s), or pass --force to %s it anyway",
					row.Name, c.Box.Name, strings.ToLower(c.Box.Instance.Status), c.Box.Name, row.Name)
			}
		case Confirms:
			name := ""
			if c.Box != nil {
				name = c.Box.Name
			}
			if err := c.confirm(fmt.Sprintf(row.Prompt, name)); err != nil {
				return err
			}
		}
	}
	return nil
}

// confirm asks on a terminal; without one it needs --yes. Never a silent yes.
func (c *Ctx) confirm(question string) error {
	// --yes answers every prompt; on a row where --force means "even if running", --force
	// answers it too (scripts written before --yes pass only --force).
	if c.Bool(c.Cmd.ConfirmFlag) || (c.Cmd.Has(NeedsForceIfRunning) && c.Bool("force")) {
		return nil
	}
	if !c.Env.Terminal {
		return boxcore.Usagef("%s: no terminal to confirm on: pass --%s to go ahead", c.Cmd.Name, c.Cmd.ConfirmFlag)
	}
	fmt.Fprintf(c.Env.Stderr, "%s [y/N] ", question)
	line, _ := bufio.NewReader(c.Env.Stdin).ReadString('\n')
	if a := strings.ToLower(strings.TrimSpace(line)); a == "y" || a == "yes" {
		return nil
	}
	return boxcore.Usagef("%s: not confirmed; nothing changed", c.Cmd.Name)
}
