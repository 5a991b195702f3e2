package cli

import (
	"os"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/claudebox/claudebox/boxcore"
	"github.com/claudebox/claudebox/drill"
)

func drillCommands() []Command {
	return []Command{{
		Name:     "drill",
		Examples: []string{"sudo claudebox drill", "sudo claudebox drill --format json", "sudo claudebox drill --self-test --yes", "sudo claudebox drill --soak 20 --yes", "sudo claudebox drill --cleanup"},
		Synopsis: "[--vm|--container] [--boxes N] [--image REF] [--record FILE] [--format table|json|yaml|csv] [--keep] [--cleanup] [--self-test --yes] [--soak N --yes] [--target MEMBER]",
		Summary:  "prove the isolation: real boxes, probes, decoy hosts, positive controls (and seeded holes with --self-test)",
		Pre:      []Precondition{NeedsArgs, NeedsRoot, NeedsDaemon},
		Flags: []cli.Flag{
			&cli.BoolFlag{Name: "vm", Usage: "virtual-machine boxes (needs --image with the Incus agent, and KVM)"},
			&cli.BoolFlag{Name: "container", Usage: "container boxes from the scratch probe image (default)"},
			&cli.IntFlag{Name: "boxes", Value: 2, Usage: "how many boxes (at least 2)"},
			&cli.StringFlag{Name: "image", Usage: "box image (default: the scratch probe image built from this binary)"},
			&cli.StringFlag{Name: "record", Usage: "append the run to this Markdown file (and its .jsonl sibling) (default: " + drill.DefaultRecord() + ")"},
			formatFlag(),
			// The old --json: --format json.
			&cli.BoolFlag{Name: "json", Usage: "the old name of --format json", Hidden: true},
			&cli.BoolFlag{Name: "keep", Usage: "leave the boxes running afterwards (--cleanup removes them)"},
			&cli.BoolFlag{Name: "cleanup", Usage: "only remove what dead drill runs left behind, then exit"},
			&cli.BoolFlag{Name: "self-test", Usage: "after the matrix, seed a hole per layer (CHANGES THE HOST STACK, restores it; needs --yes)"},
			&cli.StringSliceFlag{Name: "hole", Usage: "with --self-test: only this seeded hole (repeatable)"},
			&cli.IntFlag{Name: "soak", Usage: "also soak: N re-applies, an incusd restart (instances keep running) and a host init drift repair under one flood (RESTARTS INCUSD; needs --yes)"},
			&cli.BoolFlag{Name: "yes", Usage: "confirm --self-test or --soak"},
			&cli.DurationFlag{Name: "timeout", Value: time.Second, Usage: "the probes' shared timeout window"},
			&cli.StringFlag{Name: "target", Usage: "on an Incus cluster: the member to drill — the one claudebox runs on (the default: its kernel, its decoys); run the drill on each member"},
		},
		Action: runDrill,
	}}
}

func runDrill(c *Ctx) error {
	ctx := c.Context.Context
	if c.Bool("cleanup") {
		done, err := drill.Cleanup(ctx, c.Client)
		for _, d := range done {
			c.Out("removed %s", d)
		}
		if err != nil {
			return err
		}
		if len(done) == 0 {
			c.Out("nothing left by dead drill runs")
		}
		return nil
	}
	if c.Bool("vm") && c.Bool("container") {
		return boxcore.Usagef("drill: --vm and --container exclude each other")
	}
	if c.Bool("self-test") && !c.Bool("yes") {
		return boxcore.Usagef("drill --self-test switches each isolation layer off in turn on this host (and restores it): pass --yes to go ahead")
	}
	if c.Int("soak") < 0 {
		return boxcore.Usagef("drill: --soak takes a number of re-applies, 0 or more (20 is the contract's)")
	}
	if c.Int("soak") > 0 && !c.Bool("yes") {
		return boxcore.Usagef("drill --soak restarts incusd (instances keep running) and detaches the ACL for a host init to repair: pass --yes to go ahead")
	}
	if c.Int("boxes") < 2 {
		return boxcore.Usagef("drill: --boxes must be at least 2")
	}
	format, err := checkFormat(c)
	if err != nil {
		return err
	}
	if c.Bool("json") && !c.IsSet("format") {
		format = "json"
	}
	member, err := boxcore.LocalTarget(ctx, c.Client, "drill", c.String("target"))
	if err != nil {
		return err
	}
	bin, err := os.Executable()
	if err != nil {
		return err
	}
	rep, err := drill.Run(ctx, drill.Options{
		Client: c.Client, Stack: c.Env.Stack, Boxes: c.Int("boxes"), VM: c.Bool("vm"), Image: c.String("image"),
		Binary: bin, Keep: c.Bool("keep"), Version: Version, Progress: c.Env.Stderr, Timeout: c.Duration("timeout"),
		SelfTest: c.Bool("self-test"), Holes: c.StringSlice("hole"), Soak: c.Int("soak"),
	})
	if rep == nil {
		return err
	}
	if c.Bool("vm") {
		rep.InstanceType = "virtual-machine"
	}
	rep.Member = member
	// stdout holds only the chosen format; the matrix a person reads goes to stderr then.
	if format != "table" {
		rep.PrintMatrix(c.Env.Stderr)
	}
	if werr := writeDrill(c.Env.Stdout, format, rep); werr != nil {
		return werr
	}
	record := c.String("record")
	if record == "" {
		record = drill.DefaultRecord()
	}
	if aerr := rep.Append(record); aerr != nil {
		c.Warn("drill: could not append the record to %s: %v", record, aerr)
	} else {
		c.Warn("drill: recorded in %s and %s", record, drill.JSONLPath(record))
	}
	if err != nil {
		return err
	}
	if !rep.OK {
		return exitError{1}
	}
	return nil
}
