package cli

import (
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/claudebox/claudebox/boxcore"
)

var boxPre = []Precondition{NeedsArgs, NeedsDaemon, NeedsBox}

// boxCommands is the box verbs' rows of the command table. Long by design: it is data, one
// row per verb (name, synopsis, flags, preconditions, action), read top to bottom like help.
func boxCommands() []Command {
	return []Command{
		{
			Name:     "new",
			Examples: []string{"claudebox new --name work", "claudebox new --name work --container --template blank --memory 4GiB", "claudebox new --name work2 --from work/authed"},
			Synopsis: "--name NAME [--vm|--container] [--image REF] [--template T] [--cpu N] [--memory SIZE] [--processes N] [--disk SIZE] [--from SRC[/SNAP]] [--target MEMBER] [--keep-failed] [--no-bake] [--verbose]",
			Summary:  "mint a box: isolated, Claude Code installed, nobody logged in",
			Pre:      []Precondition{NeedsArgs, NeedsDaemon},
			Flags: []cli.Flag{
				&cli.StringFlag{Name: "name", Usage: "the box's name", Required: true},
				&cli.BoolFlag{Name: "vm", Usage: "a virtual machine (the default; the VM is the trust boundary)"},
				&cli.BoolFlag{Name: "container", Usage: "a container (shares the host's kernel: no VM trust boundary)"},
				&cli.StringFlag{Name: "image", Usage: "image ref: ALIAS or REMOTE:ALIAS (default: for a container, claudebox/debian12-cloud when 'claudebox image build' made it; else the template's)"},
				&cli.StringFlag{Name: "template", Usage: "template (see 'claudebox templates')"},
				&cli.StringFlag{Name: "cpu", Usage: "CPU limit (limits.cpu); a container also gets a hard CPU quota of at most all CPUs but one"},
				&cli.StringFlag{Name: "memory", Usage: "memory limit, e.g. 4GiB (default: the template's, at most what the host can give)"},
				&cli.Int64Flag{Name: "processes", Usage: "process limit of a container (limits.processes; default sized from the host's pid_max)"},
				&cli.StringFlag{Name: "disk", Usage: "root disk size, e.g. 20GiB"},
				&cli.StringFlag{Name: "from", Usage: "clone a box or one of its snapshots: SRC or SRC/SNAP"},
				&cli.StringFlag{Name: "target", Usage: "on an Incus cluster: the member to mint on (default: Incus's placement); a box on another member is bound there by its claudebox agent, and new waits for that"},
				&cli.BoolFlag{Name: "keep-failed", Usage: "keep a box whose first boot failed, to look inside"},
				&cli.BoolFlag{Name: "no-bake", Usage: "run the template's first boot even when 'templates bake' made a bake of it"},
				&cli.BoolFlag{Name: "verbose", Usage: "print how long launch, cloud-init and the Claude install took"},
			},
			Action: newBox,
		},
		{
			Name:     "list",
			Examples: []string{"claudebox list", "claudebox list --format json"},
			Synopsis: "[--format table|json|yaml|csv]",
			Summary:  "list boxes (and only boxes)",
			Pre:      []Precondition{NeedsArgs, NeedsDaemon},
			Flags:    []cli.Flag{formatFlag()},
			Action:   listBoxes,
		},
		{
			Name: "info", Args: []string{"BOX"}, Synopsis: "[--format table|json|yaml|csv]",
			Examples: []string{"claudebox info work", "claudebox info work --format yaml"},
			Summary:  "state, addresses, provenance, snapshots, and how to clone it",
			Pre:      boxPre, Flags: []cli.Flag{formatFlag()},
			Action: infoBox,
		},
		{
			Name: "shell", Args: []string{"BOX"}, Synopsis: "[--user NAME] [--session NAME]",
			Examples: []string{"claudebox shell work", "claudebox shell work --user root", "claudebox shell work --session main"},
			Summary:  "log in to a box (as its claude user, or root when it has none); works with or without a terminal",
			Pre:      boxPre,
			Flags: []cli.Flag{
				&cli.StringFlag{Name: "user", Usage: "log in as this user of the box (root included)"},
				&cli.StringFlag{Name: "session", Usage: "attach to (or make) this tmux session instead: it outlives the terminal"},
			},
			Action: shellBox,
		},
		{
			Name: "exec", Args: []string{"BOX"}, Variadic: "CMD...", Synopsis: "[--user NAME] -- CMD...",
			Examples: []string{"claudebox exec work -- claude --version", "claudebox exec work --user root -- apt-get update"},
			Summary:  "run a command in a box as its user, with a login environment; its exit code is claudebox's",
			Pre:      boxPre,
			Flags:    []cli.Flag{&cli.StringFlag{Name: "user", Usage: "run as this user of the box (default: claude where it exists, else root)"}},
			Action:   execBox,
		},
		{
			Name: "tmux", Args: []string{"BOX"}, Optional: []string{"SESSION"}, Synopsis: "[--list] [--user NAME]",
			Examples: []string{"claudebox tmux work", "claudebox tmux work main", "claudebox tmux work --list"},
			Summary:  "attach to a tmux session in a box that survives the terminal (default: the only one, or a new 'claude')",
			Pre:      boxPre,
			Flags: []cli.Flag{
				&cli.BoolFlag{Name: "list", Usage: "list the sessions (needs no terminal)"},
				&cli.StringFlag{Name: "user", Usage: "the sessions of this user of the box (default: claude where it exists, else root)"},
			},
			Action: tmuxBox,
		},
		{
			Name: "start", Args: []string{"BOX"}, Summary: "start a box", Pre: boxPre,
			Examples: []string{"claudebox start work"},
			Action:   func(c *Ctx) error { return boxes(c).Start(c.Context.Context, c.Box) },
		},
		{
			Name: "stop", Args: []string{"BOX"}, Synopsis: "[--kill]", Summary: "stop a box",
			Examples: []string{"claudebox stop work", "claudebox stop work --kill"},
			Pre:      boxPre,
			Flags: []cli.Flag{
				&cli.BoolFlag{Name: "kill", Usage: "kill at once instead of shutting down cleanly (a box not shut down within 30s is killed anyway)"},
				// The old name of --kill: --force now means only "even if running".
				&cli.BoolFlag{Name: "force", Usage: "the old name of --kill", Hidden: true},
			},
			Action: func(c *Ctx) error {
				return boxes(c).Stop(c.Context.Context, c.Box, c.Bool("kill") || c.Bool("force"))
			},
		},
		{
			Name: "expose", Args: []string{"BOX", "PORT"}, Synopsis: "[--on [ADDR:]HOSTPORT]",
			Examples: []string{"claudebox expose work 3000", "claudebox expose work 3000 --on 8080", "claudebox expose work 5173 --on 127.0.0.2:5173"},
			Summary:  "reach a port of a box from this host's loopback (and nowhere else): 127.0.0.1:PORT by default",
			Pre:      boxPre,
			Flags:    []cli.Flag{&cli.StringFlag{Name: "on", Usage: "where on the host: HOSTPORT, or ADDR:HOSTPORT with a loopback ADDR (127.0.0.0/8, [::1])"}},
			Action: func(c *Ctx) error {
				port, err := boxcore.ParsePort(c.Args[1])
				if err != nil {
					return err
				}
				on, err := boxcore.ParseExposeOn(c.String("on"), port)
				if err != nil {
					return err
				}
				e, err := boxes(c).Expose(c.Context.Context, c.Box, port, on)
				if err == nil {
					c.Out("%s port %d is on %s (this host only): claudebox unexpose %s %d", c.Box.Name, e.Port, e.On, c.Box.Name, e.Port)
				}
				return err
			},
		},
		{
			Name: "unexpose", Args: []string{"BOX", "PORT"},
			Examples: []string{"claudebox unexpose work 3000"},
			Summary:  "stop exposing a port of a box",
			Pre:      boxPre,
			Action: func(c *Ctx) error {
				port, err := boxcore.ParsePort(c.Args[1])
				if err != nil {
					return err
				}
				return boxes(c).Unexpose(c.Context.Context, c.Box, port)
			},
		},
		{
			Name: "snapshot", Args: []string{"BOX"}, Optional: []string{"LABEL"},
			Examples: []string{"claudebox snapshot work", "claudebox snapshot work authed"},
			Summary:  "checkpoint a box (default label: the time); prints the label",
			Pre:      boxPre,
			Action: func(c *Ctx) error {
				label, err := boxes(c).Snapshot(c.Context.Context, c.Box, argAt(c.Args, 1))
				if err == nil {
					c.Out("%s", label)
				}
				return err
			},
		},
		{
			Name: "restore", Args: []string{"BOX", "SNAP"}, Synopsis: "[--yes] [--force]",
			Examples: []string{"claudebox restore work authed", "claudebox restore work authed --yes", "claudebox restore work authed --force"},
			Summary:  "roll a box back to a snapshot",
			Pre:      []Precondition{NeedsArgs, NeedsDaemon, NeedsBox, NeedsSnapshot, NeedsForceIfRunning, Confirms},
			Prompt:   "Roll box %s back? Changes since the snapshot are lost.", ConfirmFlag: "yes",
			Flags: []cli.Flag{yesFlag, forceFlag},
			Action: func(c *Ctx) error {
				return boxes(c).Restore(c.Context.Context, c.Box, c.Args[1])
			},
		},
		{
			Name: "rename", Args: []string{"BOX", "NEW"},
			Examples: []string{"claudebox rename work work-old"},
			Summary:  "rename a stopped box",
			Pre:      []Precondition{NeedsArgs, NeedsDaemon, NeedsBox, NeedsStopped},
			Action: func(c *Ctx) error {
				return boxes(c).Rename(c.Context.Context, c.Box, c.Args[1])
			},
		},
		{
			Name: "rm", Args: []string{"BOX"}, Synopsis: "[--yes] [--force]",
			Examples: []string{"claudebox rm work", "claudebox rm work --yes", "claudebox rm work --force"},
			Summary:  "delete a box and its snapshots",
			Pre:      []Precondition{NeedsArgs, NeedsDaemon, NeedsBox, NeedsForceIfRunning, Confirms},
			Prompt:   "Delete box %s and all its snapshots?", ConfirmFlag: "yes",
			Flags:  []cli.Flag{yesFlag, forceFlag},
			Action: func(c *Ctx) error { return boxes(c).Remove(c.Context.Context, c.Box) },
		},
		{
			Name: "incus", Args: []string{"BOX"}, Variadic: "ARGS...",
			Examples: []string{"claudebox incus work -- config show {}", "claudebox incus work -- snapshot list {}"},
			Summary:  "escape hatch: run the incus CLI on a box ({} is the box; warns when it could leave the isolation stack)",
			Pre:      boxPre,
			Action:   incusHatch,
		},
	}
}

func boxes(c *Ctx) *boxcore.Boxes {
	return &boxcore.Boxes{Client: c.Client, Stack: c.Env.Stack, Version: Version, Warn: func(s string) { c.Warn("%s", s) }}
}

func argAt(args []string, i int) string {
	if i < len(args) {
		return args[i]
	}
	return ""
}

func newBox(c *Ctx) error {
	if c.Bool("vm") && c.Bool("container") {
		return boxcore.Usagef("new: --vm and --container exclude each other")
	}
	o := boxcore.NewOptions{
		Name: c.String("name"), Image: c.String("image"), From: c.String("from"),
		CPU: c.String("cpu"), Memory: c.String("memory"), Disk: c.String("disk"),
		Processes: c.Int64("processes"), KeepFailed: c.Bool("keep-failed"), Target: c.String("target"),
	}
	if o.From != "" && (c.String("template") != "" || o.Image != "" || o.CPU != "" || o.Memory != "" || o.Disk != "" || c.IsSet("processes")) {
		return boxcore.Usagef("new: --from copies a box whole; it does not take --image, --template, --cpu, --memory, --processes or --disk")
	}
	if c.IsSet("processes") && o.Processes <= 0 {
		return boxcore.Usagef("new: --processes %d: want a number of processes, 1 or more (e.g. --processes 1024)", o.Processes)
	}
	if err := boxcore.ValidateName(o.Name); err != nil {
		return err
	}
	// Everything that can be checked without the daemon is, before it is asked anything.
	if err := boxcore.ValidateResources(o.CPU, o.Memory, o.Disk); err != nil {
		return err
	}
	if err := boxcore.DefaultLimits().ValidateLimits(o.CPU, o.Memory, o.Processes, o.From == "" && !c.Bool("container")); err != nil {
		return err
	}
	if o.From != "" {
		if _, _, err := boxcore.ParseFrom(o.From); err != nil {
			return err
		}
		switch {
		case c.Bool("vm"):
			o.Type = "virtual-machine"
		case c.Bool("container"):
			o.Type = "container"
		}
	}
	if o.From == "" {
		o.VM = !c.Bool("container")
		if o.VM {
			srv, err := c.Client.Server(c.Context.Context)
			if err != nil {
				return err
			}
			if !srv.VMSupported {
				return boxcore.Usagef("new: this host cannot run VMs (Incus reports no working VM driver: no KVM or vhost-vsock). " +
					"Pass --container to get a container instead: it shares the host's kernel, so it gives up the VM trust boundary")
			}
		}
		if o.Image == "" && !o.VM {
			// A container without --image: the local image of 'claudebox image build' when it
			// exists, else the template's (an image server).
			img, err := boxes(c).LocalDefaultImage(c.Context.Context)
			if err != nil {
				return err
			}
			o.Image = img
		}
		if err := applyTemplate(c, &o); err != nil {
			return err
		}
		if err := useBake(c, &o); err != nil {
			return err
		}
	}
	stopProgress := func() {}
	if c.Env.Terminal {
		o.Progress, stopProgress = terminalProgress(c)
	} else {
		o.Progress = pipedProgress(c)
	}
	timings := &boxcore.MintTimings{}
	o.Timings = timings
	start := time.Now()
	box, err := boxes(c).New(c.Context.Context, o)
	stopProgress()
	if err != nil {
		return err
	}
	c.Out("%s is ready (%s, %.1fs): claudebox shell %s", box.Name, box.Instance.Type, time.Since(start).Seconds(), box.Name)
	switch {
	case !c.Bool("verbose"):
	case box.Instance.Config[boxcore.TagBake] != "":
		c.Out("time: launch %.1fs, lease %.1fs (from the bake %s: no first boot)",
			timings.Launch.Seconds(), timings.FirstBoot.Seconds(), box.Instance.Config[boxcore.TagBake])
	default:
		c.Out("time: launch %.1fs, cloud-init %.1fs (of which Claude install %.1fs)",
			timings.Launch.Seconds(), timings.FirstBoot.Seconds(), timings.ClaudeInstall.Seconds())
	}
	return nil
}

// pipedProgress prints one line per stage of `new` to stderr as it begins (create, download,
// start, first boot, ready), with the seconds since the start: no redrawing, no escapes.
func pipedProgress(c *Ctx) func(boxcore.Progress) { return pipedProgressAs(c, "new") }

// pipedProgressAs is pipedProgress with another verb before each line.
func pipedProgressAs(c *Ctx, verb string) func(boxcore.Progress) {
	var mu sync.Mutex
	last, start := "", time.Now()
	return func(p boxcore.Progress) {
		mu.Lock()
		defer mu.Unlock()
		if p.Stage == last {
			return // download percentages: the stage's first line says it
		}
		last = p.Stage
		text := p.Text
		if p.Stage == "download" {
			text = "preparing the image (download or unpack into the pool)"
		}
		fmt.Fprintf(c.Env.Stderr, "%s: %s: %s (%.1fs)\n", verb, p.Stage, text, time.Since(start).Seconds())
	}
}

// terminalProgress draws one status line on stderr, redrawn every second with the time the
// step has taken, so a long cloud-init wait visibly moves. stop ends the redrawing.
func terminalProgress(c *Ctx) (update func(boxcore.Progress), stop func()) {
	var mu sync.Mutex
	line, since := "", time.Now()
	draw := func() {
		fmt.Fprintf(c.Env.Stderr, "\r\033[K%s (%ds)", line, int(time.Since(since).Seconds()))
	}
	done := make(chan struct{})
	go func() {
		t := time.NewTicker(time.Second)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-t.C:
				mu.Lock()
				draw()
				mu.Unlock()
			}
		}
	}()
	update = func(p boxcore.Progress) {
		mu.Lock()
		defer mu.Unlock()
		text := p.Text
		if p.Percent >= 0 {
			text = fmt.Sprintf("%s: %d%%", p.Stage, p.Percent)
		}
		if p.Stage != "download" || !strings.HasPrefix(line, "download") {
			since = time.Now()
		}
		line = text
		draw()
	}
	stop = func() {
		close(done)
		mu.Lock()
		fmt.Fprint(c.Env.Stderr, "\r\033[K")
		mu.Unlock()
	}
	return update, stop
}

// yesFlag answers a row's prompt; forceFlag lets a row act on a running box (and, so that
// scripts from before --yes keep working, answers the prompt too).
var (
	yesFlag   = &cli.BoolFlag{Name: "yes", Usage: "do not ask"}
	forceFlag = &cli.BoolFlag{Name: "force", Usage: "even if the box is running (implies --yes)"}
)

func listBoxes(c *Ctx) error {
	format, err := checkFormat(c)
	if err != nil {
		return err
	}
	list, err := boxes(c).List(c.Context.Context)
	if err != nil {
		return err
	}
	return writeList(c.Env.Stdout, format, list)
}

func infoBox(c *Ctx) error {
	format, err := checkFormat(c)
	if err != nil {
		return err
	}
	info, err := boxes(c).Info(c.Context.Context, c.Box)
	if err != nil {
		return err
	}
	return writeInfo(c.Env.Stdout, format, info)
}

// limitsLine renders a box's limits for info: processes, memory, CPUs and CPU quota, and what
// is missing.
func limitsLine(l boxcore.BoxLimits) string {
	or := func(v string) string {
		if v == "" {
			return "none"
		}
		return v
	}
	line := fmt.Sprintf("processes %s, memory %s, cpu %s, cpu allowance %s", or(l.Processes), or(l.Memory), or(l.CPU), or(l.CPUAllowance))
	if len(l.Missing) > 0 {
		line += "; missing: " + strings.Join(l.Missing, ", ")
	}
	return line
}
