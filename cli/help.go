package cli

import (
	"fmt"
	"sort"
	"strconv"
	"strings"

	"github.com/urfave/cli/v2"

	"github.com/claudebox/claudebox/boxcore"
)

// helpCommands are the rows about the command line itself: help, completion and the hidden
// __complete the completion scripts ask.
func helpCommands() []Command {
	return []Command{
		{
			// Passthrough: urfave would take `help --help` for the app's help; the action
			// shows this row's own.
			Name: "help", Optional: []string{"VERB", "SUBVERB"}, Passthrough: true,
			Summary:  "show the help of claudebox or of a verb (the same text as VERB --help)",
			Pre:      []Precondition{NeedsArgs},
			Examples: []string{"claudebox help", "claudebox help new", "claudebox help host init"},
			Action:   helpVerb,
		},
		{
			Name: "completion", Args: []string{"SHELL"},
			Summary: "print a shell completion script: bash, zsh or fish",
			Pre:     []Precondition{NeedsArgs},
			Examples: []string{
				"claudebox completion bash > /etc/bash_completion.d/claudebox",
				"claudebox completion zsh > \"${fpath[1]}/_claudebox\"",
				"claudebox completion fish > ~/.config/fish/completions/claudebox.fish",
			},
			Action: printCompletion,
		},
		{
			Name: "__complete", Variadic: "WORD...", Hidden: true, Passthrough: true,
			Summary: "the completion scripts' question: the candidates for the last of WORD... (the words typed so far, the program's name first)",
			Action:  complete,
		},
	}
}

// helpVerb prints exactly what `claudebox VERB [SUBVERB] --help` prints: it runs that.
func helpVerb(c *Ctx) error {
	var words []string
	self := false
	for _, w := range c.Args {
		if w == "--help" || w == "-h" {
			self = true
			continue
		}
		words = append(words, w)
	}
	if self && len(words) == 0 { // help --help: this row's help, as every row's
		return cli.ShowCommandHelp(c.Context.Lineage()[1], "help")
	}
	if len(words) > 0 {
		if _, err := resolveWords(words); err != nil {
			return err
		}
	}
	code := 0
	app := NewApp(c.Env, &code)
	if err := app.RunContext(c.Context.Context, append(append([]string{"claudebox"}, words...), "--help")); err != nil {
		return err
	}
	if code != 0 {
		return exitError{code}
	}
	return nil
}

// resolveWords checks that words name a verb, a group or a group's subverb, and says what
// was meant when they do not.
func resolveWords(words []string) (string, error) {
	if _, n, ok := findRow(words); ok && n == len(words) {
		return strings.Join(words, " "), nil
	}
	groups := groupNames()
	if len(words) >= 1 && groups[words[0]] {
		if len(words) == 1 {
			return words[0], nil
		}
		return "", unknownCommand(words[0]+" "+words[1], subverbs(words[0]))
	}
	return "", unknownCommand(words[0], verbs())
}

// verbs are the first words the help lists: visible verbs and groups.
func verbs() []string {
	seen := map[string]bool{}
	var out []string
	for _, row := range Commands() {
		if row.Hidden {
			continue
		}
		first, _, _ := strings.Cut(row.Name, " ")
		if !seen[first] {
			seen[first] = true
			out = append(out, first)
		}
	}
	sort.Strings(out)
	return out
}

// subverbs are a group's visible subcommands, whole ("host init").
func subverbs(group string) []string {
	var out []string
	for _, row := range Commands() {
		if g, _, nested := strings.Cut(row.Name, " "); nested && g == group && !row.Hidden {
			out = append(out, row.Name)
		}
	}
	sort.Strings(out)
	return out
}

func groupNames() map[string]bool {
	g := map[string]bool{}
	for _, row := range Commands() {
		if first, _, nested := strings.Cut(row.Name, " "); nested {
			g[first] = true
		}
	}
	return g
}

// unknownCommand is the usage error for a verb that does not exist, with the nearest one.
func unknownCommand(name string, candidates []string) error {
	if s := suggest(name, candidates); s != "" {
		return boxcore.Usagef("unknown command %q: did you mean %q? (see 'claudebox --help')", name, s)
	}
	return boxcore.Usagef("unknown command %q (see 'claudebox --help')", name)
}

// suggest is the candidate nearest to name: the only one it begins, or the closest by edit
// distance (a swap of two neighbours counts once) when that is close enough to be a typo.
func suggest(name string, candidates []string) string {
	var prefixed []string
	for _, c := range candidates {
		if strings.HasPrefix(c, name) && name != "" {
			prefixed = append(prefixed, c)
		}
	}
	if len(prefixed) == 1 {
		return prefixed[0]
	}
	best, bestD := "", 1<<30
	for _, c := range candidates {
		if d := editDistance(name, c); d < bestD {
			best, bestD = c, d
		}
	}
	limit := 2
	if len([]rune(name)) <= 3 {
		limit = 1
	}
	if bestD <= limit {
		return best
	}
	return ""
}

// editDistance is the optimal-string-alignment distance: insertions, deletions,
// substitutions and transpositions of adjacent characters, each 1.
func editDistance(a, b string) int {
	r, s := []rune(a), []rune(b)
	d := make([][]int, len(r)+1)
	for i := range d {
		d[i] = make([]int, len(s)+1)
		d[i][0] = i
	}
	for j := range d[0] {
		d[0][j] = j
	}
	for i := 1; i <= len(r); i++ {
		for j := 1; j <= len(s); j++ {
			cost := 1
			if r[i-1] == s[j-1] {
				cost = 0
			}
			d[i][j] = min(d[i-1][j]+1, d[i][j-1]+1, d[i-1][j-1]+cost)
			if i > 1 && j > 1 && r[i-1] == s[j-2] && r[i-2] == s[j-1] {
				d[i][j] = min(d[i][j], d[i-2][j-2]+1)
			}
		}
	}
	return d[len(r)][len(s)]
}

// flagUsage is the usage error of a row's flag parse; an unknown flag names the nearest of
// the row's own.
func flagUsage(row Command, err error) error {
	const undefined = "flag provided but not defined: -"
	if name, ok := strings.CutPrefix(err.Error(), undefined); ok {
		var names []string
		for n := range rowFlags(row) {
			names = append(names, n)
		}
		sort.Strings(names)
		if s := suggest(strings.TrimLeft(name, "-"), names); s != "" {
			return boxcore.Usagef("%s: unknown flag --%s: did you mean --%s? (see 'claudebox %s --help')", row.Name, strings.TrimLeft(name, "-"), s, row.Name)
		}
		return boxcore.Usagef("%s: unknown flag --%s (see 'claudebox %s --help')", row.Name, strings.TrimLeft(name, "-"), row.Name)
	}
	return boxcore.Usagef("%s: %v", row.Name, err)
}

// helpTemplate is urfave's command help with the row's examples after the options.
func helpTemplate(base string, examples []string) string {
	if len(examples) == 0 {
		return base
	}
	var b strings.Builder
	b.WriteString(base)
	b.WriteString("\nEXAMPLES:\n")
	for _, e := range examples {
		// Quoted as a template string literal: an example may hold "{{" or "{}".
		fmt.Fprintf(&b, "   {{%s}}\n", strconv.Quote(e))
	}
	return b.String()
}
