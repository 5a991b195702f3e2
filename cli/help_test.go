package cli

import (
	"bytes"
	"fmt"
	"regexp"
	"strings"
	"testing"

	"github.com/urfave/cli/v2"
)

type run struct {
	code           int
	stdout, stderr string
}

func runCLI(args ...string) run {
	var out, errb bytes.Buffer
	env := &Env{Stdin: strings.NewReader(""), Stdout: &out, Stderr: &errb, Stack: StackFromEnv()}
	code := Run(env, append([]string{"claudebox"}, args...))
	return run{code, out.String(), errb.String()}
}

// `help W...` prints exactly what `W... --help` prints, for claudebox itself, every group
// and every row of the table (hidden ones too).
func TestHelpIsDashDashHelp(t *testing.T) {
	targets := [][]string{{}}
	for g := range groupNames() {
		targets = append(targets, []string{g})
	}
	for _, row := range Commands() {
		targets = append(targets, strings.Fields(row.Name))
	}
	for _, words := range targets {
		viaHelp := runCLI(append([]string{"help"}, words...)...)
		viaFlag := runCLI(append(append([]string{}, words...), "--help")...)
		if viaHelp != viaFlag {
			t.Errorf("help %s != %s --help:\n%+v\n%+v", strings.Join(words, " "), strings.Join(words, " "), viaHelp, viaFlag)
		}
		if viaHelp.code != 0 || viaHelp.stdout == "" {
			t.Errorf("help %s: exit %d, stdout %q, stderr %q", strings.Join(words, " "), viaHelp.code, viaHelp.stdout, viaHelp.stderr)
		}
	}
}

// A mistyped verb or subverb exits 2 and names the nearest; one far from every verb names none.
func TestUnknownVerbSuggests(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"lsit"}, `did you mean "list"?`},
		{[]string{"lisr"}, `did you mean "list"?`},
		{[]string{"snap", "work"}, `did you mean "snapshot"?`},
		{[]string{"restor", "work", "s"}, `did you mean "restore"?`},
		{[]string{"hots", "check"}, `did you mean "host"?`},
		{[]string{"host", "chek"}, `did you mean "host check"?`},
		{[]string{"help", "lsit"}, `did you mean "list"?`},
		{[]string{"help", "host", "int"}, `did you mean "host init"?`},
		{[]string{"hepl"}, `did you mean "help"?`},
		{[]string{"list", "--fromat", "json"}, `unknown flag --fromat: did you mean --format?`},
		{[]string{"rm", "x", "--forec"}, `unknown flag --forec: did you mean --force?`},
		{[]string{"host", "init", "--sbunet", "x"}, `did you mean --subnet?`},
	} {
		r := runCLI(tc.args...)
		if r.code != 2 || !strings.Contains(r.stderr, tc.want) || !strings.Contains(r.stderr, "unknown") {
			t.Errorf("%v: exit %d, stderr %q; want 2 and %q", tc.args, r.code, r.stderr, tc.want)
		}
	}
	for _, args := range [][]string{{"zzzzzzz"}, {"host", "qqqqqq"}, {"help", "zzzzzz"}} {
		r := runCLI(args...)
		if r.code != 2 || !strings.Contains(r.stderr, "unknown command") || strings.Contains(r.stderr, "did you mean") {
			t.Errorf("%v: exit %d, stderr %q; want 2, unknown command, no suggestion", args, r.code, r.stderr)
		}
	}
	// Hidden rows are never suggested.
	if s := suggest("prob", verbs()); s == "probe" {
		t.Errorf("suggested the hidden probe")
	}
}

func TestEditDistance(t *testing.T) {
	for _, tc := range []struct {
		a, b string
		d    int
	}{{"lsit", "list", 1}, {"list", "list", 0}, {"", "rm", 2}, {"kitten", "sitting", 3}, {"rm", "mr", 1}, {"stpo", "stop", 1}} {
		if got := editDistance(tc.a, tc.b); got != tc.d {
			t.Errorf("editDistance(%q, %q) = %d, want %d", tc.a, tc.b, got, tc.d)
		}
	}
}

// probe and __complete are hidden: not in help, never offered, but they still dispatch.
func TestHiddenRows(t *testing.T) {
	help := runCLI("--help").stdout
	for _, name := range []string{"probe", "__complete"} {
		row, _, ok := findRow([]string{name})
		if !ok || !row.Hidden {
			t.Errorf("%s: not a hidden row", name)
		}
		if regexp.MustCompile(`(?m)^\s+` + name + `\b`).MatchString(help) {
			t.Errorf("--help lists %s", name)
		}
		if slicesContains(candidates(t.Context(), []string{"claudebox", name[:2]}), name) {
			t.Errorf("completion offers %s", name)
		}
	}
	if r := runCLI("__complete", "--", "claudebox", "lis"); r.code != 0 || r.stdout != "list\n" {
		t.Errorf("__complete does not dispatch: %+v", r)
	}
}

func slicesContains(s []string, v string) bool {
	for _, x := range s {
		if x == v {
			return true
		}
	}
	return false
}

// Every visible row has examples, shown under EXAMPLES in its --help, and each example is a
// command line the table takes: its verb exists, every flag it passes is one of the verb's,
// flags that take a value get one, and it passes as many arguments as the verb takes.
func TestExamplesParse(t *testing.T) {
	for _, row := range Commands() {
		if row.Hidden {
			continue
		}
		if len(row.Examples) == 0 {
			t.Errorf("%s has no examples", row.Name)
			continue
		}
		help := runCLI(append(strings.Fields(row.Name), "--help")...).stdout
		if !strings.Contains(help, "\nEXAMPLES:\n") {
			t.Errorf("%s --help has no EXAMPLES section:\n%s", row.Name, help)
		}
		for _, ex := range row.Examples {
			if !strings.Contains(help, "   "+ex+"\n") {
				t.Errorf("%s --help lacks its example %q", row.Name, ex)
			}
			if err := checkExample(row, ex); err != nil {
				t.Errorf("%s: example %q: %v", row.Name, ex, err)
			}
		}
	}
}

func TestCheckExampleCatches(t *testing.T) {
	rm, _, _ := findRow([]string{"rm"})
	list, _, _ := findRow([]string{"list"})
	for _, tc := range []struct {
		row Command
		ex  string
	}{
		{rm, "claudebox rm"},                    // missing BOX
		{rm, "claudebox rm a b"},                // one too many
		{rm, "claudebox rm a --nosuch"},         // no such flag
		{rm, "claudebox remove a"},              // no such verb
		{list, "claudebox list --format"},       // flag without its value
		{list, "claudebox rm a"},                // another row's line
		{list, "claudebox list --format=xml"},   // not a format
		{list, "claudebox list --format bogus"}, // not a format
	} {
		if err := checkExample(tc.row, tc.ex); err == nil {
			t.Errorf("checkExample(%s, %q) passed", tc.row.Name, tc.ex)
		}
	}
}

// checkExample parses an example command line against the table.
func checkExample(row Command, ex string) error {
	words, err := shellWords(ex)
	if err != nil {
		return err
	}
	if len(words) > 0 && words[0] == "sudo" {
		words = words[1:]
	}
	if len(words) == 0 || words[0] != "claudebox" {
		return errorf("does not start with claudebox")
	}
	got, n, ok := findRow(words[1:])
	if !ok || got.Name != row.Name {
		return errorf("names %v, not the row %q", words[1:], row.Name)
	}
	flags := rowFlags(row)
	flags["help"] = false
	var pos []string
	rest := words[1+n:]
	for i := 0; i < len(rest); i++ {
		tok := rest[i]
		if tok == "--" || (row.Variadic != "" && len(pos) == len(row.Args) && !strings.HasPrefix(tok, "-")) {
			pos = append(pos, rest[i:]...)
			break
		}
		if strings.HasPrefix(tok, "-") && tok != "-" { // "-" alone is stdin or stdout
			name, value, hasValue := strings.Cut(strings.TrimLeft(tok, "-"), "=")
			takes, exists := flags[name]
			if !exists {
				return errorf("no flag --%s", name)
			}
			if takes && !hasValue {
				if i+1 == len(rest) || strings.HasPrefix(rest[i+1], "-") {
					return errorf("--%s without its value", name)
				}
				i++
				value = rest[i]
			}
			if name == "format" && !slicesContains(Formats, value) {
				return errorf("--format %q is none of %v", value, Formats)
			}
			continue
		}
		pos = append(pos, tok)
	}
	if len(pos) < len(row.Args) {
		return errorf("%d arguments, the verb takes %d", len(pos), len(row.Args))
	}
	if row.Variadic == "" && len(pos) > len(row.Args)+len(row.Optional) {
		return errorf("%d arguments, the verb takes at most %d", len(pos), len(row.Args)+len(row.Optional))
	}
	if row.Variadic != "" && len(pos) == len(row.Args) {
		return errorf("no %s", row.Variadic)
	}
	return nil
}

// shellWords splits a line as a shell does for the examples' needs: blanks, and single or
// double quotes.
func shellWords(s string) ([]string, error) {
	var out []string
	var cur strings.Builder
	in, quote := false, rune(0)
	for _, r := range s {
		switch {
		case quote != 0 && r == quote:
			quote = 0
		case quote != 0:
			cur.WriteRune(r)
		case r == '"' || r == '\'':
			quote, in = r, true
		case r == ' ':
			if in {
				out = append(out, cur.String())
				cur.Reset()
				in = false
			}
		case r == '>' || r == '<' || r == '|': // a redirection or pipe ends the command line
			if in {
				out = append(out, cur.String())
			}
			return out, nil
		default:
			cur.WriteRune(r)
			in = true
		}
	}
	if quote != 0 {
		return nil, errorf("unterminated quote")
	}
	if in {
		out = append(out, cur.String())
	}
	return out, nil
}

func errorf(format string, a ...any) error { return fmt.Errorf(format, a...) }

// --force means only "even if running"; --yes answers every prompt.
func TestForceAndYes(t *testing.T) {
	for _, row := range Commands() {
		for _, f := range row.Flags {
			bf, ok := f.(*cli.BoolFlag)
			if !ok {
				continue
			}
			if bf.Name == "force" && !bf.Hidden && !strings.Contains(bf.Usage, "even") {
				t.Errorf("%s: --force means %q, not \"even if running\"", row.Name, bf.Usage)
			}
		}
		if row.Has(Confirms) || row.Prompt != "" {
			if row.ConfirmFlag != "yes" || !hasFlag(row, "yes") {
				t.Errorf("%s asks but --yes does not answer (confirm flag %q)", row.Name, row.ConfirmFlag)
			}
		}
	}
	for _, name := range []string{"rm", "restore"} {
		row, _, _ := findRow([]string{name})
		if !row.Has(NeedsForceIfRunning) || !hasFlag(row, "force") || !hasFlag(row, "yes") {
			t.Errorf("%s: a running box must need --force (pre %v)", name, row.Pre)
		}
	}
}

func hasFlag(row Command, name string) bool {
	for _, f := range row.Flags {
		if slicesContains(f.Names(), name) {
			return true
		}
	}
	return false
}
