package cli

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/claudebox/claudebox/boxcore/incus"
	"github.com/claudebox/claudebox/internal/testenv"
	"github.com/claudebox/claudebox/internal/teststack"
)

func cands(t *testing.T, line string) []string {
	t.Helper()
	words := strings.Split(line, " ")
	return candidates(context.Background(), words)
}

// Completion answers from the table: verbs, subverbs, flags, flag values.
func TestCompletionFromTable(t *testing.T) {
	for _, tc := range []struct {
		line string
		want []string // exactly
	}{
		{"claudebox li", []string{"list"}},
		{"claudebox ho", []string{"host"}},
		{"claudebox host ", leaves("host")},
		{"claudebox host ch", []string{"check"}},
		{"claudebox list --f", []string{"--format"}},
		{"claudebox list --format ", Formats},
		{"claudebox list --format j", []string{"json"}},
		{"claudebox list --format=y", []string{"--format=yaml"}},
		{"claudebox list --format = c", []string{"csv"}}, // bash splits at "="
		{"claudebox host check --format ", Formats},
		{"claudebox drill --format t", []string{"table"}},
		{"claudebox new --template ", []string{"blank", "claude", "docker"}},
		{"claudebox new --name x --template b", []string{"blank"}},
		{"claudebox rm --", []string{"--force", "--help", "--remote", "--yes"}},
		{"claudebox stop --", []string{"--help", "--kill", "--remote"}}, // the hidden --force is not offered
		{"claudebox help ", verbs()},
		{"claudebox help host i", []string{"init"}},
		{"claudebox completion ", []string{"bash", "fish", "zsh"}},
		{"claudebox list --remote lo", []string{"local"}},
		{"claudebox info --remote=lo", []string{"--remote=local"}},
		{"claudebox list extra ", nil},
		{"claudebox exec box -- ", nil},
		{"claudebox __complete ", nil},
		{"claudebox pro", nil}, // hidden
		{"claudebox nosuch ", nil},
	} {
		got := cands(t, tc.line)
		want := slices.Clone(tc.want)
		slices.Sort(got)
		slices.Sort(want)
		if !slices.Equal(got, want) {
			t.Errorf("%q: %q, want %q", tc.line, got, want)
		}
	}
	// Every visible verb is offered on an empty line, and nothing hidden.
	all := cands(t, "claudebox ")
	for _, row := range Commands() {
		first := strings.Fields(row.Name)[0]
		if slices.Contains(all, first) == row.Hidden {
			t.Errorf("%s (hidden %v): offered %v", row.Name, row.Hidden, slices.Contains(all, first))
		}
	}
}

// The scripts are valid in their shell, and each, run by its shell against the real binary,
// completes a verb. zsh and fish are installed by scripts/setup.sh (test_tools).
func TestCompletionScripts(t *testing.T) {
	bin := teststack.Binary(t)
	path := filepath.Dir(bin) + ":" + os.Getenv("PATH")
	dir := t.TempDir()
	check := map[string][]string{"bash": {"-n"}, "zsh": {"-n"}, "fish": {"--no-execute"}}
	for _, sh := range completionShells() {
		r := runCLI("completion", sh)
		if r.code != 0 || r.stdout == "" {
			t.Fatalf("completion %s: %+v", sh, r)
		}
		if _, err := exec.LookPath(sh); err != nil {
			t.Errorf("%s is not installed: scripts/setup.sh installs it (test_tools); run make setup", sh)
			continue
		}
		file := filepath.Join(dir, "claudebox."+sh)
		if err := os.WriteFile(file, []byte(r.stdout), 0o644); err != nil {
			t.Fatal(err)
		}
		if out, err := exec.Command(sh, append(check[sh], file)...).CombinedOutput(); err != nil {
			t.Errorf("%s %v: %v\n%s", sh, check[sh], err, out)
		}
	}
	if r := runCLI("completion", "tcsh"); r.code != 2 || !strings.Contains(r.stderr, "bash, fish, zsh") {
		t.Errorf("completion tcsh: %+v", r)
	}
	// Run them: the shell asks the binary, which answers from the table.
	runs := map[string]string{
		"bash": `source ` + filepath.Join(dir, "claudebox.bash") + `; COMP_WORDS=(claudebox list --format j); COMP_CWORD=3; _claudebox; printf '%s\n' "${COMPREPLY[@]}"; COMP_WORDS=(claudebox hos); COMP_CWORD=1; _claudebox; printf '%s\n' "${COMPREPLY[@]}"`,
		"fish": `source ` + filepath.Join(dir, "claudebox.fish") + `; complete -C 'claudebox list --format j'; complete -C 'claudebox hos'`,
		// Outside a completion widget compadd does not work: a stand-in prints what it is
		// given; compdef is compinit's, checked below.
		"zsh": `compdef() { :; }; source ` + filepath.Join(dir, "claudebox.zsh") + `; compadd() { shift; print -rl -- "$@"; }; words=(claudebox list --format j); CURRENT=4; _claudebox; words=(claudebox hos); CURRENT=2; _claudebox`,
	}
	for sh, script := range runs {
		if _, err := exec.LookPath(sh); err != nil {
			continue // reported above
		}
		cmd := exec.Command(sh, "-c", script)
		cmd.Env = append(os.Environ(), "PATH="+path, "HOME="+dir, "XDG_CONFIG_HOME="+dir, "XDG_DATA_HOME="+dir)
		out, err := cmd.CombinedOutput()
		lines := strings.Fields(string(out))
		if err != nil || !slices.Contains(lines, "json") || !slices.Contains(lines, "host") {
			t.Errorf("%s completion: %v, got %q", sh, err, out)
		}
	}
	// zsh: after compinit, the script registers itself for claudebox.
	if _, err := exec.LookPath("zsh"); err == nil {
		cmd := exec.Command("zsh", "-fc", `autoload -Uz compinit && compinit -u -D; source `+filepath.Join(dir, "claudebox.zsh")+`; print -r -- ${_comps[claudebox]}`)
		cmd.Env = append(os.Environ(), "HOME="+dir)
		if out, err := cmd.CombinedOutput(); err != nil || strings.TrimSpace(string(out)) != "_claudebox" {
			t.Errorf("zsh: the script does not register _claudebox: %v %q", err, out)
		}
	}
}

// Box names, snapshots and --from BOX/SNAP come from the daemon, and only boxes: an
// instance claudebox did not mint is never offered.
func TestCompletionBoxNames(t *testing.T) {
	h := newHarness(t)
	box, other := h.name("cpl"), h.name("cplx")
	h.removeLater(box)
	if r := h.newBox(box); r.code != 0 {
		t.Fatalf("new: %d %s", r.code, r.stderr)
	}
	h.tagForSweep(box)
	h.expect(0, "authed", "snapshot", box, "authed")
	// An untagged instance of a similar name: not a box.
	h.removeLater(other)
	ctx := context.Background()
	if err := h.c.CreateInstance(ctx, incus.InstancesPost{
		Name: other, Profiles: []string{h.stack.Profile}, Config: testenv.Tag(),
		Source: incus.InstanceSource{Type: "image", Alias: h.image},
	}, nil); err != nil {
		t.Fatal(err)
	}
	if err := h.c.CreateSnapshot(ctx, other, "s1"); err != nil {
		t.Fatal(err)
	}
	prefix := box[:len(box)-1]
	for _, tc := range []struct {
		line string
		want []string
	}{
		{"claudebox info " + prefix, []string{box}},
		{"claudebox rm --yes " + prefix, []string{box}},
		{"claudebox restore " + box + " ", []string{"authed"}},
		{"claudebox restore " + box + " au", []string{"authed"}},
		{"claudebox new --name y --from " + prefix, []string{box, box + "/authed"}},
		{"claudebox new --from " + box + "/", []string{box + "/authed"}},
		{"claudebox restore " + other + " ", nil},
		{"claudebox info " + other, nil},
	} {
		got := cands(t, tc.line)
		if !slices.Equal(got, tc.want) {
			t.Errorf("%q: %q, want %q", tc.line, got, tc.want)
		}
	}
	// Through the hidden verb, as the scripts ask.
	r := h.run("__complete", "--", "claudebox", "restore", box, "")
	if r.code != 0 || r.stdout != "authed\n" {
		t.Errorf("__complete: %+v", r)
	}
}
