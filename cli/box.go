package cli

func boxCommands() []Command {
	return nil
}
