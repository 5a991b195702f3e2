package cli

import (
	"strings"

	"github.com/urfave/cli/v2"
)

// permuteFlags moves a command's flags ahead of its positional arguments, so that
// `claudebox rm box --force` means what it says: urfave/cli v2 stops parsing flags at the
// first positional argument. It stops at "--", and for a row with trailing arguments
// (exec, incus) without a "--" once the row's own arguments are taken: what follows belongs
// to the box.
func permuteFlags(args []string) []string {
	if len(args) < 2 {
		return args
	}
	row, depth, ok := findRow(args[1:])
	if !ok || row.Passthrough {
		return args
	}
	head := args[:1+depth]
	rest := args[1+depth:]
	takesValue := map[string]bool{"remote": true}
	for _, f := range row.Flags {
		_, isBool := f.(*cli.BoolFlag)
		for _, n := range f.Names() {
			takesValue[n] = !isBool
		}
	}
	var flags, positional, tail []string
	for i := 0; i < len(rest); i++ {
		tok := rest[i]
		if tok == "--" {
			tail = rest[i:]
			break
		}
		// Past a variadic row's own arguments, the first word that is not one of the row's
		// own flags begins the box's part: a "--" further on is the box command's own
		// (`exec BOX git diff --stat -- f`), never claudebox's separator.
		if row.Variadic != "" && len(positional) >= len(row.Args) {
			name, _, _ := strings.Cut(strings.TrimLeft(tok, "-"), "=")
			if _, own := takesValue[name]; !own || !strings.HasPrefix(tok, "-") {
				tail = rest[i:]
				break
			}
		}
		if len(tok) > 1 && strings.HasPrefix(tok, "-") {
			flags = append(flags, tok)
			name, _, hasValue := strings.Cut(strings.TrimLeft(tok, "-"), "=")
			if takesValue[name] && !hasValue && i+1 < len(rest) {
				i++
				flags = append(flags, rest[i])
			}
			continue
		}
		positional = append(positional, tok)
	}
	out := append([]string{}, head...)
	out = append(out, flags...)
	out = append(out, positional...)
	return append(out, tail...)
}

// findRow finds the table row a command line names ("list", or "host init"), and how many
// words its name takes.
func findRow(words []string) (Command, int, bool) {
	for _, row := range Commands() {
		parts := strings.Fields(row.Name)
		if len(words) >= len(parts) && strings.Join(words[:len(parts)], " ") == row.Name {
			return row, len(parts), true
		}
	}
	return Command{}, 0, false
}
