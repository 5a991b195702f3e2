package cli

import "github.com/claudebox/claudebox/drill/probes"

func miscCommands() []Command {
	return []Command{
		{
			Name:     "version",
			Examples: []string{"claudebox version"},
			Summary:  "print claudebox's version",
			Pre:      []Precondition{NeedsArgs},
			Action: func(c *Ctx) error {
				c.Out("claudebox %s", Version)
				return nil
			},
		},
		{
			Name: "probe", Variadic: "run|facts|hits|status|serve ...",
			Hidden:      true, // the drill runs it inside a box; nobody types it
			Summary:     "the drill's probe agent (runs inside a box): probes, listeners, facts",
			Passthrough: true,
			Action: func(c *Ctx) error {
				if len(c.Args) == 0 || c.Args[0] == "--help" || c.Args[0] == "-h" {
					c.Out("claudebox probe - %s", c.Cmd.Summary)
				}
				if code := probes.Main(c.Args, c.Env.Stdout, c.Env.Stderr); code != 0 {
					return exitError{code}
				}
				return nil
			},
		},
	}
}
