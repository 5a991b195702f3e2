package cli

func miscCommands() []Command {
	return []Command{
		{
			Name:    "version",
			Summary: "print claudebox's version",
			Pre:     []Precondition{NeedsArgs},
			Action: func(c *Ctx) error {
				c.Out("claudebox %s", Version)
				return nil
			},
		},
	}
}
