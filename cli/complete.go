package cli

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"github.com/urfave/cli/v2"
	"gopkg.in/yaml.v3"

	"github.com/claudebox/claudebox/boxcore"
	"github.com/claudebox/claudebox/boxcore/incus"
	"github.com/claudebox/claudebox/boxcore/templates"
)

// The completion scripts know nothing of claudebox: each asks `claudebox __complete -- WORDS`
// (the program's name, the words before the cursor, the word under it, possibly empty) and
// offers the lines it prints. Everything comes from the command table, box and snapshot names
// from the daemon.
var completionScripts = map[string]string{
	"bash": `# bash completion for claudebox. Load it with: source <(claudebox completion bash)
# or install it: claudebox completion bash > /etc/bash_completion.d/claudebox
_claudebox() {
    local IFS=$'\n'
    COMPREPLY=($(claudebox __complete -- "${COMP_WORDS[@]:0:COMP_CWORD+1}" 2>/dev/null))
}
complete -o default -F _claudebox claudebox
`,
	"zsh": `#compdef claudebox
# zsh completion for claudebox. Load it (after compinit) with: source <(claudebox completion zsh)
# or install it as _claudebox in a directory of $fpath.
_claudebox() {
    local -a cands
    cands=("${(@f)$(claudebox __complete -- "${(@)words[1,CURRENT]}" 2>/dev/null)}")
    cands=(${cands:#})
    (( ${#cands} )) && compadd -- "${cands[@]}"
}
if [[ "${funcstack[1]}" == _claudebox ]]; then
    _claudebox "$@"
else
    compdef _claudebox claudebox
fi
`,
	"fish": `# fish completion for claudebox. Load it with: claudebox completion fish | source
# or install it: claudebox completion fish > ~/.config/fish/completions/claudebox.fish
function __claudebox_complete
    set -l words (commandline -opc)
    set -l cur (commandline -ct)
    claudebox __complete -- $words "$cur" 2>/dev/null
end
complete -c claudebox -f -a '(__claudebox_complete)'
`,
}

// completionShells are the shells completion prints a script for.
func completionShells() []string {
	var out []string
	for s := range completionScripts {
		out = append(out, s)
	}
	sort.Strings(out)
	return out
}

func printCompletion(c *Ctx) error {
	script, ok := completionScripts[c.Args[0]]
	if !ok {
		return boxcore.Usagef("completion: unknown shell %q (one of %s)", c.Args[0], strings.Join(completionShells(), ", "))
	}
	fmt.Fprint(c.Env.Stdout, script)
	return nil
}

// complete answers a completion script: one candidate a line.
func complete(c *Ctx) error {
	words := c.Args
	if len(words) > 0 && words[0] == "--" {
		words = words[1:]
	}
	for _, w := range candidates(c.Context.Context, words) {
		c.Out("%s", w)
	}
	return nil
}

// candidates are the completions of the last of words (words[0] is the program's name).
func candidates(ctx context.Context, words []string) []string {
	if len(words) > 0 {
		words = words[1:]
	}
	// bash splits "--format=json" at "=" (COMP_WORDBREAKS): the "=" words carry nothing.
	var ws []string
	for _, w := range words {
		if w != "=" {
			ws = append(ws, w)
		}
	}
	if len(words) > 0 && words[len(words)-1] == "=" {
		ws = append(ws, "")
	}
	if len(ws) == 0 {
		ws = []string{""}
	}
	cur, done := ws[len(ws)-1], ws[:len(ws)-1]
	if len(done) == 0 {
		if strings.HasPrefix(cur, "-") {
			return filter([]string{"--help", "--version"}, cur)
		}
		return filter(verbs(), cur)
	}
	if groupNames()[done[0]] && len(done) == 1 {
		if strings.HasPrefix(cur, "-") {
			return filter([]string{"--help"}, cur)
		}
		return filter(leaves(done[0]), cur)
	}
	row, n, ok := findRow(done)
	if !ok || row.Hidden {
		return nil
	}
	flags := rowFlags(row)
	var pos []string
	remote := ""
	rest := done[n:]
	for i := 0; i < len(rest); i++ {
		tok := rest[i]
		if tok == "--" {
			return nil // what follows belongs to the box's command
		}
		if strings.HasPrefix(tok, "-") && len(tok) > 1 {
			name, value, hasValue := strings.Cut(strings.TrimLeft(tok, "-"), "=")
			if flags[name] && !hasValue {
				if i+1 == len(rest) {
					return flagValues(ctx, name, cur, remote, "")
				}
				i++
				value = rest[i]
			}
			if name == "remote" {
				remote = value
			}
			continue
		}
		pos = append(pos, tok)
		if row.Variadic != "" && len(pos) > len(row.Args) {
			return nil
		}
	}
	if strings.HasPrefix(cur, "-") {
		if name, value, hasValue := strings.Cut(strings.TrimLeft(cur, "-"), "="); hasValue {
			return flagValues(ctx, name, value, remote, strings.TrimSuffix(cur, value))
		}
		var names []string
		for name := range flags {
			names = append(names, "--"+name)
		}
		sort.Strings(names)
		return filter(append(names, "--help"), cur)
	}
	i := len(pos)
	switch row.Name {
	case "help":
		if i == 0 {
			return filter(verbs(), cur)
		}
		if i == 1 && groupNames()[pos[0]] {
			return filter(leaves(pos[0]), cur)
		}
		return nil
	case "completion":
		if i == 0 {
			return filter(completionShells(), cur)
		}
		return nil
	}
	if i >= len(row.Args) {
		return nil
	}
	switch row.Args[i] {
	case "BOX":
		return filter(boxNames(ctx, remote), cur)
	case "SNAP":
		return filter(snapshotNames(ctx, remote, pos[0]), cur)
	}
	return nil
}

// rowFlags are a row's visible flags as completion offers them: name → takes a value.
func rowFlags(row Command) map[string]bool {
	out := map[string]bool{}
	all := append([]cli.Flag{}, row.Flags...)
	if row.Has(NeedsDaemon) {
		all = append(all, remoteFlag)
	}
	for _, f := range all {
		if v, ok := f.(cli.VisibleFlag); ok && !v.IsVisible() {
			continue
		}
		_, isBool := f.(*cli.BoolFlag)
		for _, n := range f.Names() {
			out[n] = !isBool
		}
	}
	return out
}

// flagValues completes a flag's value; prefix goes before each ("--format=").
func flagValues(ctx context.Context, flag, cur, remote, prefix string) []string {
	var vals []string
	switch flag {
	case "format":
		vals = Formats
	case "remote":
		vals = remoteNames()
	case "template":
		for _, t := range templates.List() {
			vals = append(vals, t.Name)
		}
	case "from":
		box, _, hasSnap := strings.Cut(cur, "/")
		if hasSnap {
			for _, s := range snapshotNames(ctx, remote, box) {
				vals = append(vals, box+"/"+s)
			}
			break
		}
		names := filter(boxNames(ctx, remote), cur)
		vals = names
		if len(names) == 1 { // one box left: its snapshots too, so SRC/SNAP is a tab away
			for _, s := range snapshotNames(ctx, remote, names[0]) {
				vals = append(vals, names[0]+"/"+s)
			}
		}
	}
	out := filter(vals, cur)
	for i := range out {
		out[i] = prefix + out[i]
	}
	return out
}

// leaves are a group's visible subcommands' own names ("init").
func leaves(group string) []string {
	var out []string
	for _, s := range subverbs(group) {
		out = append(out, strings.TrimPrefix(s, group+" "))
	}
	return out
}

func filter(cands []string, prefix string) []string {
	var out []string
	for _, c := range cands {
		if strings.HasPrefix(c, prefix) {
			out = append(out, c)
		}
	}
	return out
}

// completionTimeout bounds what a completion asks the daemon: a tab never hangs.
const completionTimeout = 3 * time.Second

// remoteNames are "local" and the incus CLI's remotes that can hold boxes (protocol incus).
func remoteNames() []string {
	out := []string{"local"}
	b, err := os.ReadFile(filepath.Join(incus.ConfigDir(), "config.yml"))
	if err != nil {
		return out
	}
	var cfg struct {
		Remotes map[string]struct {
			Protocol string `yaml:"protocol"`
		} `yaml:"remotes"`
	}
	if yaml.Unmarshal(b, &cfg) != nil {
		return out
	}
	for name, r := range cfg.Remotes {
		if name != "local" && (r.Protocol == "" || r.Protocol == "incus") {
			out = append(out, name)
		}
	}
	sort.Strings(out[1:])
	return out
}

func boxNames(ctx context.Context, remote string) []string {
	ctx, cancel := context.WithTimeout(ctx, completionTimeout)
	defer cancel()
	cl, err := incus.Connect(ctx, remote)
	if err != nil {
		return nil
	}
	list, err := (&boxcore.Boxes{Client: cl}).List(ctx)
	if err != nil {
		return nil
	}
	var out []string
	for _, b := range list {
		out = append(out, b.Name)
	}
	return out
}

func snapshotNames(ctx context.Context, remote, box string) []string {
	ctx, cancel := context.WithTimeout(ctx, completionTimeout)
	defer cancel()
	cl, err := incus.Connect(ctx, remote)
	if err != nil {
		return nil
	}
	b, err := boxcore.Resolve(ctx, cl, box) // the tag boundary: no snapshots of non-boxes
	if err != nil {
		return nil
	}
	snaps, err := cl.Snapshots(ctx, b.Name)
	if err != nil {
		return nil
	}
	var out []string
	for _, s := range snaps {
		out = append(out, s.Name)
	}
	sort.Strings(out)
	return out
}
