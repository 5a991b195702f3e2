// Package cli is claudebox's command line: one table of commands, rendered into urfave/cli.
// It parses, asks and prints; everything that touches Incus or the kernel lives in boxcore.
package cli

import "github.com/urfave/cli/v2"

// Precondition is a check a command needs before its action runs. They run in one place
// (runPreconditions), always in the order of this list, whatever order a row names them in.
type Precondition int

const (
	// NeedsArgs: the row's Args must all be present (and no more than those unless Variadic).
	NeedsArgs Precondition = iota
	// NeedsRoot: the command changes the host.
	NeedsRoot
	// NeedsDaemon: connect to Incus (honouring --remote) before acting.
	NeedsDaemon
	// NeedsBox: the first argument names a box; it is resolved and tag-checked.
	NeedsBox
	// NeedsStopped: the box must be stopped.
	NeedsStopped
	// NeedsSnapshot: the second argument names an existing snapshot of the box.
	NeedsSnapshot
	// NeedsForceIfRunning: a running box is refused unless --force ("even if running": the one
	// thing --force means).
	NeedsForceIfRunning
	// Confirms: asks the row's Prompt on a terminal; with no terminal it needs --yes (or, on a
	// row that takes --force, --force: old scripts pass that).
	Confirms
)

var preconditionOrder = []Precondition{NeedsArgs, NeedsRoot, NeedsDaemon, NeedsBox, NeedsStopped, NeedsSnapshot, NeedsForceIfRunning, Confirms}

func (p Precondition) String() string {
	return [...]string{"needs-args", "needs-root", "needs-daemon", "needs-box", "needs-stopped", "needs-snapshot", "needs-force-if-running", "confirms"}[p]
}

// Command is one row of the table: everything that exists, its help, and what runs.
type Command struct {
	Name     string // "list", or "host init" for a subcommand
	Args     []string
	Optional []string // trailing optional positional args
	Variadic string   // name of trailing repeated args, e.g. "CMD..."
	Synopsis string   // flags as shown in help; every --flag named here must exist
	Summary  string
	// Examples are whole command lines ("claudebox rm work --yes"), shown under EXAMPLES in
	// --help; a test parses each against the table. Every visible row has some.
	Examples []string
	// Hidden rows dispatch but are not listed in help or offered by completion (probe,
	// __complete).
	Hidden bool
	Flags  []cli.Flag
	Pre    []Precondition
	Prompt string // the Confirms question; %s is the box name
	// ConfirmFlag is the flag that answers the prompt without a terminal: "yes".
	ConfirmFlag string
	// Passthrough hands every argument to the action unparsed (the probe agent parses its own).
	Passthrough bool
	Action      func(*Ctx) error
}

// Has reports whether a row names a precondition.
func (c Command) Has(p Precondition) bool {
	for _, q := range c.Pre {
		if q == p {
			return true
		}
	}
	return false
}

// Commands is the table. Help and dispatch are both rendered from it.
func Commands() []Command {
	cmds := []Command{}
	cmds = append(cmds, boxCommands()...)
	cmds = append(cmds, exportCommands()...)
	cmds = append(cmds, hostCommands()...)
	cmds = append(cmds, imageCommands()...)
	cmds = append(cmds, templateCommands()...)
	cmds = append(cmds, miscCommands()...)
	cmds = append(cmds, drillCommands()...)
	cmds = append(cmds, helpCommands()...)
	return cmds
}
