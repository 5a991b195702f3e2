package cli

import (
	"encoding/csv"
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/urfave/cli/v2"
	"golang.org/x/term"
	"gopkg.in/yaml.v3"

	"github.com/claudebox/claudebox/boxcore"
	"github.com/claudebox/claudebox/boxcore/incus"
)

var boxPre = []Precondition{NeedsArgs, NeedsDaemon, NeedsBox}

// boxCommands is the box verbs' rows of the command table. Long by design: it is data, one
// row per verb (name, synopsis, flags, preconditions, action), read top to bottom like help.
func boxCommands() []Command {
	return []Command{
		{
			Name:     "new",
			Synopsis: "--name NAME [--vm|--container] [--image REF] [--template T] [--cpu N] [--memory SIZE] [--processes N] [--disk SIZE] [--from SRC[/SNAP]] [--keep-failed] [--verbose]",
			Summary:  "mint a box: isolated, Claude Code installed, nobody logged in",
			Pre:      []Precondition{NeedsArgs, NeedsDaemon},
			Flags: []cli.Flag{
				&cli.StringFlag{Name: "name", Usage: "the box's name", Required: true},
				&cli.BoolFlag{Name: "vm", Usage: "a virtual machine (the default; the VM is the trust boundary)"},
				&cli.BoolFlag{Name: "container", Usage: "a container (shares the host's kernel: no VM trust boundary)"},
				&cli.StringFlag{Name: "image", Usage: "image ref: ALIAS or REMOTE:ALIAS (default: the template's)"},
				&cli.StringFlag{Name: "template", Usage: "template (see 'claudebox templates')"},
				&cli.StringFlag{Name: "cpu", Usage: "CPU limit (limits.cpu); a container also gets a hard CPU quota of at most all CPUs but one"},
				&cli.StringFlag{Name: "memory", Usage: "memory limit, e.g. 4GiB (default: the template's, at most what the host can give)"},
				&cli.Int64Flag{Name: "processes", Usage: "process limit of a container (limits.processes; default sized from the host's pid_max)"},
				&cli.StringFlag{Name: "disk", Usage: "root disk size, e.g. 20GiB"},
				&cli.StringFlag{Name: "from", Usage: "clone a box or one of its snapshots: SRC or SRC/SNAP"},
				&cli.BoolFlag{Name: "keep-failed", Usage: "keep a box whose first boot failed, to look inside"},
				&cli.BoolFlag{Name: "verbose", Usage: "print how long launch, cloud-init and the Claude install took"},
			},
			Action: newBox,
		},
		{
			Name:     "list",
			Synopsis: "[--format table|json|yaml|csv]",
			Summary:  "list boxes (and only boxes)",
			Pre:      []Precondition{NeedsArgs, NeedsDaemon},
			Flags:    []cli.Flag{formatFlag("table", "json", "yaml", "csv")},
			Action:   listBoxes,
		},
		{
			Name: "info", Args: []string{"BOX"}, Synopsis: "[--format text|json|yaml]",
			Summary: "state, addresses, provenance, snapshots, and how to clone it",
			Pre:     boxPre, Flags: []cli.Flag{formatFlag("text", "json", "yaml")},
			Action: infoBox,
		},
		{
			Name: "shell", Args: []string{"BOX"},
			Summary: "log in to a box (as its claude user, or root when it has none)",
			Pre:     boxPre,
			Action:  shellBox,
		},
		{
			Name: "exec", Args: []string{"BOX"}, Variadic: "CMD...",
			Summary: "run a command in a box; its exit code is claudebox's",
			Pre:     boxPre,
			Action:  execBox,
		},
		{
			Name: "start", Args: []string{"BOX"}, Summary: "start a box", Pre: boxPre,
			Action: func(c *Ctx) error { return boxes(c).Start(c.Context.Context, c.Box) },
		},
		{
			Name: "stop", Args: []string{"BOX"}, Synopsis: "[--force]", Summary: "stop a box",
			Pre:   boxPre,
			Flags: []cli.Flag{&cli.BoolFlag{Name: "force", Usage: "kill instead of shutting down cleanly"}},
			Action: func(c *Ctx) error {
				return boxes(c).Stop(c.Context.Context, c.Box, c.Bool("force"))
			},
		},
		{
			Name: "snapshot", Args: []string{"BOX"}, Optional: []string{"LABEL"},
			Summary: "checkpoint a box (default label: the time); prints the label",
			Pre:     boxPre,
			Action: func(c *Ctx) error {
				label, err := boxes(c).Snapshot(c.Context.Context, c.Box, argAt(c.Args, 1))
				if err == nil {
					c.Out("%s", label)
				}
				return err
			},
		},
		{
			Name: "restore", Args: []string{"BOX", "SNAP"}, Synopsis: "[--force]",
			Summary: "roll a box back to a snapshot",
			Pre:     []Precondition{NeedsArgs, NeedsDaemon, NeedsBox, NeedsSnapshot, Confirms},
			Prompt:  "Roll box %s back? Changes since the snapshot are lost.", ConfirmFlag: "force",
			Flags: []cli.Flag{&cli.BoolFlag{Name: "force", Usage: "do not ask"}},
			Action: func(c *Ctx) error {
				return boxes(c).Restore(c.Context.Context, c.Box, c.Args[1])
			},
		},
		{
			Name: "rename", Args: []string{"BOX", "NEW"},
			Summary: "rename a stopped box",
			Pre:     []Precondition{NeedsArgs, NeedsDaemon, NeedsBox, NeedsStopped},
			Action: func(c *Ctx) error {
				return boxes(c).Rename(c.Context.Context, c.Box, c.Args[1])
			},
		},
		{
			Name: "rm", Args: []string{"BOX"}, Synopsis: "[--force]",
			Summary: "delete a box and its snapshots",
			Pre:     []Precondition{NeedsArgs, NeedsDaemon, NeedsBox, Confirms},
			Prompt:  "Delete box %s and all its snapshots?", ConfirmFlag: "force",
			Flags:  []cli.Flag{&cli.BoolFlag{Name: "force", Usage: "do not ask"}},
			Action: func(c *Ctx) error { return boxes(c).Remove(c.Context.Context, c.Box) },
		},
		{
			Name: "incus", Args: []string{"BOX"}, Variadic: "ARGS...",
			Summary: "escape hatch: run the incus CLI on a box ({} is the box; warns when it could leave the isolation stack)",
			Pre:     boxPre,
			Action:  incusHatch,
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
		Processes: c.Int64("processes"), KeepFailed: c.Bool("keep-failed"),
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
		if err := applyTemplate(c, &o); err != nil {
			return err
		}
	}
	stopProgress := func() {}
	if c.Env.Terminal {
		o.Progress, stopProgress = terminalProgress(c)
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
	if c.Bool("verbose") {
		c.Out("time: launch %.1fs, cloud-init %.1fs (of which Claude install %.1fs)",
			timings.Launch.Seconds(), timings.FirstBoot.Seconds(), timings.ClaudeInstall.Seconds())
	}
	return nil
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

func listBoxes(c *Ctx) error {
	format, err := checkFormat(c, "table", "json", "yaml", "csv")
	if err != nil {
		return err
	}
	list, err := boxes(c).List(c.Context.Context)
	if err != nil {
		return err
	}
	switch format {
	case "json":
		return writeJSON(c, list)
	case "yaml":
		return yaml.NewEncoder(c.Env.Stdout).Encode(list)
	case "csv":
		w := csv.NewWriter(c.Env.Stdout)
		_ = w.Write([]string{"name", "state", "type", "ipv4", "snapshots", "created"})
		for _, b := range list {
			_ = w.Write([]string{b.Name, b.State, b.Type, strings.Join(b.IPv4, " "), fmt.Sprint(b.Snapshots), b.Created.UTC().Format(time.RFC3339)})
		}
		w.Flush()
		return w.Error()
	}
	tw := tabwriter.NewWriter(c.Env.Stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "NAME\tSTATE\tTYPE\tIPV4\tSNAPSHOTS\tCREATED")
	for _, b := range list {
		ip := strings.Join(b.IPv4, ", ")
		if ip == "" {
			ip = "-"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%d\t%s\n", b.Name, b.State, b.Type, ip, b.Snapshots, b.Created.UTC().Format("2006-01-02 15:04"))
	}
	return tw.Flush()
}

func writeJSON(c *Ctx, v any) error {
	enc := json.NewEncoder(c.Env.Stdout)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

func infoBox(c *Ctx) error {
	format, err := checkFormat(c, "text", "json", "yaml")
	if err != nil {
		return err
	}
	info, err := boxes(c).Info(c.Context.Context, c.Box)
	if err != nil {
		return err
	}
	switch format {
	case "json":
		return writeJSON(c, info)
	case "yaml":
		return yaml.NewEncoder(c.Env.Stdout).Encode(info)
	}
	c.Out("name:      %s", info.Name)
	c.Out("state:     %s", info.State)
	if info.State == boxcore.StateMinting {
		c.Out("           not ready: a 'claudebox new' is still making it, or died before it could clean up (then: claudebox rm %s --force)", info.Name)
	}
	c.Out("type:      %s", info.Type)
	c.Out("profiles:  %s", strings.Join(info.Profiles, ", "))
	c.Out("created:   %s", info.Created.UTC().Format(time.RFC3339))
	c.Out("limits:    %s", limitsLine(info.Limits))
	c.Out("addresses:")
	for _, a := range info.Addresses {
		c.Out("  %s", a)
	}
	c.Out("provenance:")
	for _, k := range []string{"origin", "from", "created", "version"} {
		if v, ok := info.Provenance[k]; ok {
			c.Out("  %s: %s", k, v)
		}
	}
	c.Out("snapshots: %d", len(info.Snapshots))
	for _, s := range info.Snapshots {
		c.Out("  %s  %s", s.Name, s.CreatedAt.UTC().Format(time.RFC3339))
	}
	c.Out("clone it:  %s", info.CloneLine)
	return nil
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

func shellBox(c *Ctx) error {
	if !c.Box.Running() || c.Box.Instance.Status != "Running" {
		return boxcore.Usagef("shell: box %s is %s: start it first: claudebox start %s", c.Box.Name, strings.ToLower(c.Box.Instance.Status), c.Box.Name)
	}
	cmd := boxes(c).LoginCommand(c.Context.Context, c.Box)
	return runInteractive(c, incus.ExecRequest{Command: cmd, Env: map[string]string{"TERM": termName()}}, true)
}

func execBox(c *Ctx) error {
	cmd := c.Args[1:]
	if len(cmd) > 0 && cmd[0] == "--" {
		cmd = cmd[1:]
	}
	if len(cmd) == 0 {
		return boxcore.Usagef("exec: no command (usage: claudebox exec BOX -- CMD...)")
	}
	if c.Box.Instance.Status != "Running" {
		return boxcore.Usagef("exec: box %s is %s: start it first: claudebox start %s", c.Box.Name, strings.ToLower(c.Box.Instance.Status), c.Box.Name)
	}
	tty := isTerminal(os.Stdin) && isTerminal(os.Stdout) && c.Env.Stdin == os.Stdin
	return runInteractive(c, incus.ExecRequest{Command: cmd}, tty)
}

func runInteractive(c *Ctx, req incus.ExecRequest, tty bool) error {
	w, h := 80, 24
	if tty {
		fd := int(os.Stdin.Fd())
		if cols, rows, err := term.GetSize(int(os.Stdout.Fd())); err == nil {
			w, h = cols, rows
		}
		if old, err := term.MakeRaw(fd); err == nil {
			defer term.Restore(fd, old)
		}
	}
	code, err := c.Client.ExecInteractive(c.Context.Context, c.Box.Name, req, c.Env.Stdin, c.Env.Stdout, c.Env.Stderr, tty, w, h)
	if err != nil {
		return err
	}
	if code != 0 {
		return exitError{code}
	}
	return nil
}

func isTerminal(f *os.File) bool { return term.IsTerminal(int(f.Fd())) }

func termName() string {
	if t := os.Getenv("TERM"); t != "" {
		return t
	}
	return "xterm-256color"
}
