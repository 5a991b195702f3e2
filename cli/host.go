package cli

import (
	"strings"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/claudebox/claudebox/boxcore"
)

func hostCommands() []Command {
	return []Command{
		{
			Name:        "host init",
			Examples:    []string{"sudo claudebox host init", "sudo claudebox host init --dns host --yes", "sudo claudebox host init --subnet 10.87.0.0/24 --dns 1.1.1.1,9.9.9.9"},
			Synopsis:    "[--subnet A.B.C.0/24] [--dns host|IP[,IP...]] [--yes]",
			Summary:     "create or repair the isolation stack: network, ACL, profile, firewall",
			Pre:         []Precondition{NeedsArgs, NeedsRoot, NeedsDaemon},
			Prompt:      "Apply these changes to the host?",
			ConfirmFlag: "yes",
			Flags: []cli.Flag{
				&cli.StringFlag{Name: "subnet", Usage: "the bridge's IPv4 /24 (default: keep the current one, or pick a free one)"},
				&cli.StringFlag{Name: "dns", Usage: "upstream resolvers for the boxes: 'host' (this host's) or IP[,IP...] (default: keep, or 1.1.1.1,9.9.9.9)"},
				&cli.BoolFlag{Name: "yes", Usage: "apply without asking"},
			},
			Action: hostInit,
		},
		{
			Name:     "host check",
			Examples: []string{"sudo claudebox host check", "sudo claudebox host check --format json"},
			Synopsis: "[--format table|json|yaml|csv]",
			Summary:  "read back every layer (Incus and the kernel) and compare; exit 1 on drift",
			Pre:      []Precondition{NeedsArgs, NeedsRoot, NeedsDaemon},
			Flags:    []cli.Flag{formatFlag()},
			Action:   hostCheck,
		},
		{
			Name:        "host teardown",
			Examples:    []string{"sudo claudebox host teardown", "sudo claudebox host teardown --yes --force"},
			Synopsis:    "[--yes] [--force]",
			Summary:     "remove the isolation stack (refuses while boxes use it unless --force)",
			Pre:         []Precondition{NeedsArgs, NeedsRoot, NeedsDaemon},
			Prompt:      "Remove these from the host?",
			ConfirmFlag: "yes",
			Flags: []cli.Flag{
				&cli.BoolFlag{Name: "yes", Usage: "remove without asking"},
				&cli.BoolFlag{Name: "force", Usage: "tear down even though boxes use the stack (they lose their network)"},
			},
			Action: hostTeardown,
		},
		{
			Name:     "host firewall",
			Examples: []string{"sudo claudebox host firewall"},
			Synopsis: "[--network NAME]",
			Summary:  "re-apply only the nftables rules (what the boot unit runs)",
			Pre:      []Precondition{NeedsArgs, NeedsRoot, NeedsDaemon},
			Flags:    []cli.Flag{&cli.StringFlag{Name: "network", Usage: "the bridge (default: the stack's)"}},
			Action: func(c *Ctx) error {
				changed, err := boxcore.NewHost(c.Client, flagStack(c)).ApplyFirewall(c.Context.Context)
				if err != nil {
					return err
				}
				c.Out("%s", map[bool]string{true: "firewall re-applied (it had drifted)", false: "no changes"}[changed])
				return nil
			},
		},
		{
			Name:     "host agent",
			Examples: []string{"sudo claudebox host agent"},
			Synopsis: "[--network NAME]",
			Summary:  "apply the firewall, then bind every box that starts on this host until stopped (what the boot unit runs)",
			Pre:      []Precondition{NeedsArgs, NeedsRoot, NeedsDaemon},
			Flags:    []cli.Flag{&cli.StringFlag{Name: "network", Usage: "the bridge (default: the stack's)"}},
			Action: func(c *Ctx) error {
				a := &boxcore.Agent{Client: c.Client, Stack: flagStack(c), Log: func(format string, args ...any) {
					c.Warn("%s "+format, append([]any{time.Now().UTC().Format(time.RFC3339)}, args...)...)
				}}
				return a.Run(c.Context.Context)
			},
		},
	}
}

// flagStack is the stack with the bridge --network names (the boot unit's verbs).
func flagStack(c *Ctx) boxcore.Stack {
	s := c.Env.Stack
	if n := c.String("network"); n != "" {
		s.Network = n
	}
	return s
}

// lockHost takes the host lock for a verb that changes the stack (init, teardown): a drill
// run holds it too, so neither changes what the other is reading. Held from the plan through
// the apply (and the confirmation in between).
func lockHost(c *Ctx) (func(), error) {
	return boxcore.LockHost(c.Context.Context)
}

func hostInit(c *Ctx) error {
	unlock, err := lockHost(c)
	if err != nil {
		return err
	}
	defer unlock()
	h := boxcore.NewHost(c.Client, c.Env.Stack)
	plan, err := h.PlanInit(c.Context.Context, boxcore.InitOptions{Subnet: c.String("subnet"), DNS: c.String("dns")})
	if err != nil {
		return err
	}
	for _, w := range plan.Warnings {
		c.Warn("%s", w)
	}
	warned := len(plan.Warnings)
	if len(plan.Changes) > 0 && !c.Bool("yes") {
		for _, ch := range plan.Changes {
			c.Warn("  %s", ch)
		}
		if err := c.confirm(c.Cmd.Prompt); err != nil {
			return err
		}
	}
	changes, err := h.ApplyInit(c.Context.Context, plan)
	for _, w := range plan.Warnings[warned:] {
		c.Warn("%s", w)
	}
	if err != nil {
		return err
	}
	if len(changes) == 0 {
		c.Out("no changes (%s on %s, upstream DNS %v)", c.Env.Stack.Network, plan.Gateway, plan.Upstreams)
		return nil
	}
	for _, ch := range changes {
		c.Out("%s", ch)
	}
	return nil
}

func hostCheck(c *Ctx) error {
	format, err := checkFormat(c)
	if err != nil {
		return err
	}
	r, err := boxcore.NewHost(c.Client, c.Env.Stack).Check(c.Context.Context)
	if err != nil {
		return err
	}
	if err := writeCheck(c.Env.Stdout, format, r); err != nil {
		return err
	}
	if !r.OK {
		n := len(r.Drift())
		here, members := r.RepairOn()
		switch {
		case len(members) == 0:
			c.Warn("drift: %d item(s) differ; 'claudebox host init' repairs them", n)
		case here:
			c.Warn("drift: %d item(s) differ; 'claudebox host init' here repairs this member's, and run on %s repairs theirs", n, strings.Join(members, ", "))
		default:
			c.Warn("drift: %d item(s) differ, all on other members; 'claudebox host init' run on %s repairs them", n, strings.Join(members, ", "))
		}
		return exitError{1}
	}
	if format == "table" {
		c.Out("ok: the stack is as declared")
	}
	return nil
}

func hostTeardown(c *Ctx) error {
	unlock, err := lockHost(c)
	if err != nil {
		return err
	}
	defer unlock()
	h := boxcore.NewHost(c.Client, c.Env.Stack)
	plan, err := h.PlanTeardown(c.Context.Context, c.Bool("force"))
	if err != nil {
		return err
	}
	if len(plan.Steps) == 0 && len(plan.Boxes) == 0 {
		if _, err := h.ApplyTeardown(c.Context.Context, plan); err != nil { // stray nft tables, unit
			return err
		}
		c.Out("nothing to remove")
		return nil
	}
	if !c.Bool("yes") {
		for _, o := range plan.Steps {
			c.Warn("  %s", o)
		}
		if len(plan.Boxes) > 0 {
			c.Warn("  %d box(es) lose their network: %v", len(plan.Boxes), plan.Boxes)
		}
		if err := c.confirm(c.Cmd.Prompt); err != nil {
			return err
		}
	}
	done, err := h.ApplyTeardown(c.Context.Context, plan)
	for _, ch := range done {
		c.Out("%s", ch)
	}
	if err != nil {
		return err
	}
	if len(plan.Boxes) > 0 {
		c.Warn("%d box(es) lost their network: %v", len(plan.Boxes), plan.Boxes)
	}
	return nil
}
