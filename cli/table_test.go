package cli

import (
	"bytes"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"

	"github.com/urfave/cli/v2"
)

// helpCommands reads the COMMANDS section of a help text.
func helpListed(help string) []string {
	var names []string
	in := false
	for _, line := range strings.Split(help, "\n") {
		switch {
		case strings.HasPrefix(line, "COMMANDS:"):
			in = true
		case in && strings.TrimSpace(line) == "":
			in = false
		case in:
			f := strings.Fields(line)
			names = append(names, strings.TrimSuffix(f[0], ","))
		}
	}
	sort.Strings(names)
	return names
}

func runHelp(t *testing.T, args ...string) string {
	t.Helper()
	var out, errb bytes.Buffer
	env := &Env{Stdin: strings.NewReader(""), Stdout: &out, Stderr: &errb}
	if code := Run(env, append([]string{"claudebox"}, args...)); code != 0 {
		t.Fatalf("%v: exit %d: %s", args, code, errb.String())
	}
	return out.String()
}

// The table is the single source of truth: what help lists is exactly what dispatches, and
// what dispatches is exactly the table.
func TestHelpAndDispatchAgree(t *testing.T) {
	app := NewApp(&Env{}, new(int))
	var dispatched []string
	var walk func(prefix string, cmds []*cli.Command)
	walk = func(prefix string, cmds []*cli.Command) {
		for _, c := range cmds {
			if len(c.Subcommands) > 0 {
				walk(prefix+c.Name+" ", c.Subcommands)
				continue
			}
			if c.Action != nil {
				dispatched = append(dispatched, prefix+c.Name)
			}
		}
	}
	walk("", app.Commands)
	var table, visible []string
	for _, row := range Commands() {
		table = append(table, row.Name)
		if !row.Hidden {
			visible = append(visible, row.Name)
		}
	}
	sort.Strings(dispatched)
	sort.Strings(table)
	sort.Strings(visible)
	if !slices.Equal(dispatched, table) {
		t.Fatalf("dispatch %v != table %v", dispatched, table)
	}
	if len(visible) == len(table) {
		t.Fatalf("no hidden row (probe and __complete are hidden)")
	}

	// Every entry help shows dispatches, and every dispatching command is shown in help.
	var helped []string
	for _, name := range helpListed(runHelp(t, "--help")) {
		sub := helpListed(runHelp(t, name, "--help"))
		if len(sub) == 0 {
			helped = append(helped, name)
		}
		for _, s := range sub {
			helped = append(helped, name+" "+s)
		}
	}
	sort.Strings(helped)
	if !slices.Equal(helped, visible) {
		t.Fatalf("help lists %v, the table's visible rows are %v", helped, visible)
	}
	for _, name := range visible {
		text := runHelp(t, append(strings.Fields(name), "--help")...)
		row, _, _ := findRow(strings.Fields(name))
		if !strings.Contains(text, row.Summary) {
			t.Errorf("help of %q lacks its summary %q", name, row.Summary)
		}
	}
}

// Every flag a synopsis names exists on its command.
func TestSynopsisFlagsExist(t *testing.T) {
	flagRE := regexp.MustCompile(`--([a-z][a-z-]*)`)
	for _, row := range Commands() {
		have := map[string]bool{"help": true}
		for _, f := range row.Flags {
			for _, n := range f.Names() {
				have[n] = true
			}
		}
		if row.Has(NeedsDaemon) {
			have["remote"] = true
		}
		for _, m := range flagRE.FindAllStringSubmatch(row.Synopsis, -1) {
			if !have[m[1]] {
				t.Errorf("%s: synopsis names --%s, which the command does not have", row.Name, m[1])
			}
		}
		if row.Has(Confirms) && !have[row.ConfirmFlag] {
			t.Errorf("%s confirms but has no --%s flag", row.Name, row.ConfirmFlag)
		}
		if row.Has(Confirms) && row.Prompt == "" {
			t.Errorf("%s confirms without a prompt", row.Name)
		}
		if row.Has(NeedsBox) && (len(row.Args) == 0 || row.Args[0] != "BOX") {
			t.Errorf("%s needs a box but its first argument is not BOX", row.Name)
		}
		if row.Has(NeedsSnapshot) && (len(row.Args) < 2 || !row.Has(NeedsBox)) {
			t.Errorf("%s needs a snapshot but has no BOX SNAP arguments", row.Name)
		}
		if (row.Has(NeedsBox) || row.Has(NeedsSnapshot)) && !row.Has(NeedsDaemon) {
			t.Errorf("%s resolves a box without a daemon", row.Name)
		}
		if row.Action == nil {
			t.Errorf("%s has no action", row.Name)
		}
	}
}

// Preconditions have one fixed order, and every kind appears in it once.
func TestPreconditionOrderIsComplete(t *testing.T) {
	seen := map[Precondition]bool{}
	for _, p := range preconditionOrder {
		if seen[p] {
			t.Fatalf("%v twice in the order", p)
		}
		seen[p] = true
	}
	for p := NeedsArgs; p <= Confirms; p++ {
		if !seen[p] {
			t.Fatalf("%v missing from the order", p)
		}
	}
	// Arguments are checked before anything talks to a daemon, boxes before confirmation.
	idx := func(p Precondition) int { return slices.Index(preconditionOrder, p) }
	if !(idx(NeedsArgs) < idx(NeedsDaemon) && idx(NeedsDaemon) < idx(NeedsBox) && idx(NeedsBox) < idx(NeedsSnapshot) && idx(NeedsSnapshot) < idx(Confirms) &&
		idx(NeedsBox) < idx(NeedsForceIfRunning) && idx(NeedsForceIfRunning) < idx(Confirms)) {
		t.Fatalf("order %v", preconditionOrder)
	}
}

func TestPermuteFlags(t *testing.T) {
	cases := []struct{ in, want string }{
		{"claudebox rm box --force", "claudebox rm --force box"},
		{"claudebox restore box snap --force --remote r", "claudebox restore --force --remote r box snap"},
		{"claudebox exec box -- ls -la", "claudebox exec box -- ls -la"},
		{"claudebox exec box ls -la", "claudebox exec box ls -la"},
		{"claudebox exec --remote r box -- ls", "claudebox exec --remote r box -- ls"},
		{"claudebox exec box --remote r -- ls", "claudebox exec --remote r box -- ls"},
		{"claudebox exec box ls --remote r", "claudebox exec box ls --remote r"},
		{"claudebox incus box --remote r -- config show {}", "claudebox incus --remote r box -- config show {}"},
		{"claudebox host init --yes --dns host", "claudebox host init --yes --dns host"},
		{"claudebox new --name x --container", "claudebox new --name x --container"},
		{"claudebox list --format=json", "claudebox list --format=json"},
		{"claudebox probe run --x", "claudebox probe run --x"},
		{"claudebox nosuch a --b", "claudebox nosuch a --b"},
		// A "--" later in the box's command is the command's, not claudebox's separator.
		{"claudebox exec box git diff --stat -- f", "claudebox exec box git diff --stat -- f"},
		{"claudebox exec box --remote r git diff --stat -- f", "claudebox exec --remote r box git diff --stat -- f"},
		{"claudebox exec box -- git diff --stat -- f", "claudebox exec box -- git diff --stat -- f"},
		{"claudebox incus box config set {} user.x=1 -- --force", "claudebox incus box config set {} user.x=1 -- --force"},
	}
	for _, tc := range cases {
		if got := strings.Join(permuteFlags(strings.Fields(tc.in)), " "); got != tc.want {
			t.Errorf("permuteFlags(%q) = %q, want %q", tc.in, got, tc.want)
		}
	}
}

func TestUsageErrorsExit2(t *testing.T) {
	for _, args := range [][]string{
		{"nosuchverb"},
		{"list", "--nosuchflag"},
		{"list", "extra"},
		{"rm"},
		{"new"},
		{"list", "--format", "xml"},
	} {
		var out, errb bytes.Buffer
		env := &Env{Stdin: strings.NewReader(""), Stdout: &out, Stderr: &errb, Stack: StackFromEnv()}
		code := Run(env, append([]string{"claudebox"}, args...))
		if code != 2 {
			t.Errorf("%v: exit %d, want 2 (stderr %q)", args, code, errb.String())
		}
		if strings.Count(strings.TrimSpace(errb.String()), "\n") > 0 && !strings.Contains(errb.String(), "Usage") {
			t.Logf("%v: stderr %q", args, errb.String())
		}
	}
}
