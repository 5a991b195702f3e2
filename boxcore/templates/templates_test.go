package templates

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"maps"
	"math/big"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"gopkg.in/yaml.v3"
)

func TestListAndGet(t *testing.T) {
	if got, want := Names(), []string{"blank", "claude", "docker"}; !slices.Equal(got, want) {
		t.Fatalf("templates = %v, want %v", got, want)
	}
	def, err := Get("")
	if err != nil || def.Name != Default || Default != "claude" {
		t.Fatalf(`Get("") = %q, %v; want the default, claude`, def.Name, err)
	}
	for _, tp := range List() {
		if strings.Contains(tp.Description, "\n") || strings.TrimSpace(tp.Description) == "" {
			t.Errorf("%s: description must be one line: %q", tp.Name, tp.Description)
		}
		if tp.Image.Container == "" || tp.Image.VM == "" || tp.Resources.CPU < 1 {
			t.Errorf("%s: incomplete defaults: %+v %+v", tp.Name, tp.Image, tp.Resources)
		}
	}
}

func TestGetUnknownNamesTheTemplates(t *testing.T) {
	_, err := Get("nope")
	if err == nil {
		t.Fatal("Get(nope) succeeded")
	}
	for _, n := range []string{`"nope"`, "blank", "claude"} {
		if !strings.Contains(err.Error(), n) {
			t.Errorf("error %q does not mention %s", err, n)
		}
	}
}

// file returns an embedded template file's text.
func file(t *testing.T, name string) string {
	t.Helper()
	b, err := files.ReadFile(name)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func parse(name, text string) (Template, error) {
	md, _ := files.ReadFile("claude.md")
	script, _ := files.ReadFile("install-claude.sh.tmpl")
	return Parse(name, []byte(text), string(md), string(script))
}

func TestUnknownKeysAreErrors(t *testing.T) {
	claude := file(t, "claude.yaml")
	cases := map[string]string{
		"top level":  claude + "\nflavour: vanilla\n",
		"nested":     strings.Replace(claude, "  cpu: 2\n", "  cpu: 2\n  gpu: 1\n", 1),
		"deep":       strings.Replace(claude, "    registry: https://registry.npmjs.org\n", "    registry: https://registry.npmjs.org\n    mirror: x\n", 1),
		"misspelled": strings.Replace(claude, "user_data:", "userdata:", 1),
	}
	for name, text := range cases {
		t.Run(name, func(t *testing.T) {
			if text == claude {
				t.Fatal("the case did not change the template")
			}
			_, err := parse("x", text)
			if err == nil || !strings.Contains(err.Error(), "not found in type") && !strings.Contains(err.Error(), "required") {
				t.Fatalf("Parse = %v; want an unknown-field error", err)
			}
		})
	}
	if _, err := parse("claude", claude); err != nil {
		t.Fatalf("the unmodified template must parse: %v", err)
	}
}

func TestParseRejectsBadSettings(t *testing.T) {
	claude := file(t, "claude.yaml")
	blank := file(t, "blank.yaml")
	cases := map[string]string{
		"install method":         strings.Replace(claude, "install: npm", "install: pip", 1),
		"native without url":     strings.Replace(claude, "install: npm", "install: native", 1),
		"bad node sum":           strings.Replace(claude, "amd64: de38", "amd64: zz38", 1),
		"unknown node arch":      strings.Replace(claude, "arm64: 7b52", "mips: 7b52", 1),
		"claude version":         strings.Replace(claude, "version: latest", "version: newest", 1),
		"two-line description":   strings.Replace(claude, "description: Claude", "description: |\n  two\n  lines\n  Claude", 1),
		"no cpu":                 strings.Replace(claude, "cpu: 2", "cpu: 0", 1),
		"memory size":            strings.Replace(claude, "memory: 4GiB", "memory: lots", 1),
		"not cloud-config":       strings.Replace(claude, "  #cloud-config\n", "  #!/bin/sh\n", 1),
		"template syntax":        strings.Replace(claude, "{{.User}}", "{{.User", 1),
		"unknown field in data":  strings.Replace(claude, "{{.User}}", "{{.Password}}", 1),
		"vm_config user key":     strings.Replace(claude, "  security.secureboot:", "  user.foo: x\n  security.secureboot:", 1),
		"claude_md without tool": strings.Replace(blank, "user_data:", "claude_md: \"@claude.md\"\nuser_data:", 1),
		"secret in user-data":    strings.Replace(claude, "  package_update: true\n", "  package_update: true\n  password: hunter2\n", 1),
	}
	for name, text := range cases {
		t.Run(name, func(t *testing.T) {
			if text == claude || text == blank {
				t.Fatal("the case did not change the template")
			}
			if _, err := parse("x", text); err == nil {
				t.Fatal("Parse accepted it")
			} else {
				t.Log(err)
			}
		})
	}
}

func TestRenderHostname(t *testing.T) {
	tp, _ := Get("claude")
	// The shipped templates leave the hostname to Incus's meta-data (a clone keeps its
	// source's user-data; a hostname in it would follow the clone).
	for _, tp := range List() {
		s, err := tp.Render(Params{Hostname: "my-box1"})
		if err != nil || strings.Contains(s, "hostname") || strings.Contains(s, "my-box1") {
			t.Errorf("%s: Render = %v; the hostname must not be in the user-data:\n%s", tp.Name, err, s)
		}
	}
	// A template may use it.
	custom, err := parse("custom", strings.Replace(file(t, "blank.yaml"), "  #cloud-config\n", "  #cloud-config\n  {{- if .Hostname}}\n  hostname: {{.Hostname}}\n  {{- end}}\n", 1))
	if err != nil {
		t.Fatal(err)
	}
	if s, err := custom.Render(Params{Hostname: "my-box1"}); err != nil || !strings.Contains(s, "\nhostname: my-box1\n") {
		t.Errorf("custom: %v\n%s", err, s)
	}
	for _, bad := range []string{"a b", "x\nruncmd: [reboot]", "-x", "x-", strings.Repeat("a", 64), "a.b"} {
		if _, err := tp.Render(Params{Hostname: bad}); err == nil {
			t.Errorf("hostname %q accepted", bad)
		}
	}
}

// cfg is the part of rendered user-data the tests look into.
type cfg struct {
	Users []struct {
		Name       string `yaml:"name"`
		UID        int    `yaml:"uid"`
		Sudo       string `yaml:"sudo"`
		LockPasswd bool   `yaml:"lock_passwd"`
	} `yaml:"users"`
	Packages   []string `yaml:"packages"`
	WriteFiles []struct {
		Path    string `yaml:"path"`
		Owner   string `yaml:"owner"`
		Content string `yaml:"content"`
		Defer   bool   `yaml:"defer"`
	} `yaml:"write_files"`
	Runcmd [][]string `yaml:"runcmd"`
}

func render(t *testing.T, tp Template) (string, cfg) {
	t.Helper()
	s, err := tp.Render(Params{Hostname: "box"})
	if err != nil {
		t.Fatal(err)
	}
	var c cfg
	if err := yaml.Unmarshal([]byte(s), &c); err != nil {
		t.Fatalf("%s: rendered user-data is not the expected shape: %v\n%s", tp.Name, err, s)
	}
	return s, c
}

func (c cfg) file(path string) (content, owner string, deferred, ok bool) {
	for _, f := range c.WriteFiles {
		if f.Path == path {
			return f.Content, f.Owner, f.Defer, true
		}
	}
	return "", "", false, false
}

func TestClaudeTemplateContent(t *testing.T) {
	tp, _ := Get("claude")
	_, c := render(t, tp)
	if len(c.Users) != 1 || c.Users[0].Name != User || c.Users[0].UID != UserUID || !c.Users[0].LockPasswd || c.Users[0].Sudo != "ALL=(ALL) NOPASSWD:ALL" {
		t.Errorf("users = %+v; want one locked user claude, uid 1000, passwordless sudo", c.Users)
	}
	for _, p := range []string{"git", "curl", "ca-certificates", "tmux"} {
		if !slices.Contains(c.Packages, p) {
			t.Errorf("packages %v miss %s", c.Packages, p)
		}
	}
	md, owner, deferred, ok := c.file(Home + "/.claude/CLAUDE.md")
	if !ok || owner != "claude:claude" || !deferred {
		t.Fatalf("CLAUDE.md: present=%v owner=%q deferred=%v; want claude:claude, deferred (the user does not exist yet at write-files)", ok, owner, deferred)
	}
	flat := strings.ToLower(strings.Join(strings.Fields(md), " "))
	for _, p := range ClaudeMDPoints() {
		if !strings.Contains(flat, strings.ToLower(p)) {
			t.Errorf("CLAUDE.md misses %q", p)
		}
	}
	if _, _, _, ok := c.file(InstallScriptPath); !ok {
		t.Error("no install script")
	}
	if len(c.Runcmd) != 1 || !slices.Equal(c.Runcmd[0], []string{InstallScriptPath}) {
		t.Errorf("runcmd = %v; want the install script", c.Runcmd)
	}
	if tp.VMConfig["security.secureboot"] != "false" {
		t.Errorf("vm_config = %v; want security.secureboot=false", tp.VMConfig)
	}
	if tp.Claude == nil || tp.Claude.Install != "npm" {
		t.Errorf("claude install = %+v; the tested path is npm", tp.Claude)
	}
}

// The docker template is the claude template (it extends it) plus docker.io, user claude in
// group docker once the package made the group, and nesting on containers only.
func TestDockerTemplate(t *testing.T) {
	base, _ := Get("claude")
	tp, err := Get("docker")
	if err != nil {
		t.Fatal(err)
	}
	if tp.Extends != "claude" || tp.Claude == nil || tp.Claude.NPM.Node.Version != base.Claude.NPM.Node.Version || tp.ClaudeMD != base.ClaudeMD ||
		tp.Image != base.Image || tp.VMConfig["security.secureboot"] != "false" {
		t.Errorf("docker does not inherit claude's install, notes, images and vm_config: %+v", tp)
	}
	if tp.Resources.Disk != "30GiB" {
		t.Errorf("its own disk size lost: %+v", tp.Resources)
	}
	want := map[string]string{"security.nesting": "true"}
	if !maps.Equal(tp.ContainerConfig, want) || len(base.ContainerConfig) != 0 {
		t.Errorf("container_config: docker %v, claude %v; want %v on docker only", tp.ContainerConfig, base.ContainerConfig, want)
	}
	_, c := render(t, tp)
	if !slices.Contains(c.Packages, "docker.io") || !slices.Contains(c.Packages, "git") {
		t.Errorf("packages %v: want claude's and docker.io", c.Packages)
	}
	if content, owner, _, ok := c.file("/etc/docker/daemon.json"); !ok || owner != "root:root" || !strings.Contains(content, `"storage-driver": "overlay2"`) {
		t.Errorf("daemon.json: present %v owner %q content %q; want overlay2 (the btrfs driver's subvolumes are denied)", ok, owner, content)
	}
	if _, _, _, ok := func() (string, string, bool, bool) {
		_, cc := render(t, base)
		return cc.file("/etc/docker/daemon.json")
	}(); ok {
		t.Error("the claude template writes docker's daemon.json")
	}
	usermod := []string{"usermod", "--append", "--groups", "docker", User}
	if len(c.Runcmd) != 2 || !slices.Equal(c.Runcmd[0], usermod) || !slices.Equal(c.Runcmd[1], []string{InstallScriptPath}) {
		t.Errorf("runcmd = %v; want %v, then the install script", c.Runcmd, usermod)
	}
	for name, yml := range map[string]string{
		"no base":     "description: x\nextends: nosuch\n",
		"itself":      "description: x\nextends: self\n",
		"two levels":  "description: x\nextends: mid\n",
		"bad package": "extends: claude\npackages: [\"rm -rf\"]\n",
		"user key":    "extends: claude\ncontainer_config:\n  user.x: y\n",
		"file path":   "extends: claude\nfiles:\n  - {path: etc/x, permissions: \"0644\", content: x}\n",
		"file mode":   "extends: claude\nfiles:\n  - {path: /etc/x, permissions: \"644\", content: x}\n",
	} {
		files := map[string][]byte{"self": []byte(yml), "mid": []byte("extends: claude\n"), "claude": []byte(file(t, "claude.yaml"))}
		if _, err := parseOn("self", files, "notes", "#!/bin/sh\n"); err == nil {
			t.Errorf("%s: parsed", name)
		}
	}
}

func TestBlankTemplateIsPlain(t *testing.T) {
	tp, _ := Get("blank")
	s, c := render(t, tp)
	if tp.Claude != nil || tp.ClaudeMD != "" {
		t.Error("blank installs Claude or writes CLAUDE.md")
	}
	if len(c.Users) != 1 || c.Users[0].Name != User || c.Users[0].UID != UserUID {
		t.Errorf("users = %+v; want user claude", c.Users)
	}
	if strings.Contains(s, "claude-code") || strings.Contains(s, "CLAUDE.md") || len(c.Runcmd) > 0 {
		t.Errorf("blank does more than a plain box:\n%s", s)
	}
}

// The install script must at least be valid bash, for both methods.
func TestInstallScriptsParse(t *testing.T) {
	if _, err := exec.LookPath("bash"); err != nil {
		t.Skip("no bash")
	}
	tp, _ := Get("claude")
	native, err := parse("native", nativeVariant(t))
	if err != nil {
		t.Fatalf("the native variant must parse: %v", err)
	}
	for _, v := range []Template{tp, native} {
		_, c := render(t, v)
		script, _, _, ok := c.file(InstallScriptPath)
		if !ok {
			t.Fatalf("%s: no install script", v.Name)
		}
		p := filepath.Join(t.TempDir(), "install.sh")
		if err := os.WriteFile(p, []byte(script), 0o644); err != nil {
			t.Fatal(err)
		}
		if out, err := exec.Command("bash", "-n", p).CombinedOutput(); err != nil {
			t.Errorf("%s: bash -n: %v\n%s\n%s", v.Name, err, out, script)
		}
		if !strings.Contains(script, "ln -sfn \"$home/.local/bin/claude\" /usr/local/bin/claude") {
			t.Errorf("%s: claude is not linked onto the PATH of non-login shells", v.Name)
		}
	}
}

// nativeVariant is the claude template switched to the native installer.
func nativeVariant(t *testing.T) string {
	s := file(t, "claude.yaml")
	i := strings.Index(s, "  npm:\n    registry:")
	j := strings.Index(s, "# \"@claude.md\"")
	if i < 0 || j < 0 {
		t.Fatal("claude.yaml changed shape: update nativeVariant")
	}
	s = s[:i] + "  native:\n    url: https://claude.ai/install.sh\n\n" + s[j:]
	return strings.Replace(s, "install: npm", "install: native", 1)
}

func TestRenderedUserDataHoldsNoSecret(t *testing.T) {
	native, err := parse("native", nativeVariant(t))
	if err != nil {
		t.Fatal(err)
	}
	for _, tp := range append(List(), native) {
		s, _ := render(t, tp)
		if f := SecretFindings(s); len(f) > 0 {
			t.Errorf("%s: %v", tp.Name, f)
		}
		for _, word := range []string{"token:", "api_key", "apiKey", "ANTHROPIC_API_KEY", "GH_TOKEN", "GITHUB_TOKEN"} {
			if strings.Contains(s, word) {
				t.Errorf("%s: rendered user-data mentions %s", tp.Name, word)
			}
		}
	}
}

func TestSecretFindingsCatchesCredentials(t *testing.T) {
	samples := map[string]string{
		"anthropic":   "key: sk-ant-api03-abcdefghijklmnop",
		"github":      "x ghp_" + strings.Repeat("a", 36),
		"github pat":  "github_pat_" + strings.Repeat("B", 40),
		"aws":         "AKIA" + strings.Repeat("Q", 16),
		"private key": "-----BEGIN OPENSSH PRIVATE KEY-----",
		"password":    "users:\n  - name: x\n    plain_text_passwd: hunter2",
		"chpasswd":    "chpasswd:\n  list: x",
		"url creds":   "git clone https://user:s3cret@example.com/r.git",
		"ssh key":     "ssh_authorized_keys: [x]",
		"npmrc":       "//registry.npmjs.org/:_authToken=abc",
		"claude file": "cp x ~/.claude/.credentials.json",
	}
	for name, s := range samples {
		if len(SecretFindings(s)) == 0 {
			t.Errorf("%s: %q not flagged", name, s)
		}
	}
	for _, clean := range []string{"lock_passwd: true", "sha512: " + strings.Repeat("ab", 64), "https://registry.npmjs.org/npm/-/npm-11.21.2.tgz"} {
		if f := SecretFindings(clean); len(f) > 0 {
			t.Errorf("%q flagged: %v", clean, f)
		}
	}
}

// cloudInit returns the path of Debian's cloud-init (for `cloud-init schema`). Tests never
// install it: `make setup` does. As root (CI, `make test`) a missing cloud-init fails the test
// rather than hiding the check; otherwise the test is skipped.
func cloudInit(t *testing.T) string {
	t.Helper()
	p, err := exec.LookPath("cloud-init")
	if err == nil {
		return p
	}
	if os.Geteuid() == 0 {
		t.Fatalf("cloud-init is not installed: run 'sudo make setup' (it installs everything the tests use)")
	}
	t.Skip("cloud-init is not installed: run 'sudo make setup'")
	return ""
}

func schema(t *testing.T, userData string) (string, error) {
	p := filepath.Join(t.TempDir(), "user-data")
	if err := os.WriteFile(p, []byte(userData), 0o644); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(cloudInit(t), "schema", "--config-file", p).CombinedOutput()
	return string(out), err
}

// Every template's rendered user-data passes the real `cloud-init schema`, and the check
// is live: a broken config fails it.
func TestRenderedUserDataPassesCloudInitSchema(t *testing.T) {
	cloudInit(t)
	if out, err := schema(t, "#cloud-config\nusers:\n  - name: x\n    sudo: 5\n"); err == nil {
		t.Fatalf("cloud-init schema accepted an invalid config (is python3-jsonschema missing?):\n%s", out)
	}
	native, err := parse("native", nativeVariant(t))
	if err != nil {
		t.Fatal(err)
	}
	for _, tp := range append(List(), native) {
		for _, host := range []string{"", "box-1"} {
			s, err := tp.Render(Params{Hostname: host})
			if err != nil {
				t.Fatal(err)
			}
			if out, err := schema(t, s); err != nil {
				t.Errorf("%s (hostname %q): cloud-init schema: %v\n%s\n--- user-data ---\n%s", tp.Name, host, err, out, s)
			}
		}
	}
}

func testCA(t *testing.T) string {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "test egress CA"},
		NotBefore: time.Now(), NotAfter: time.Now().Add(time.Hour), IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageCertSign}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	return string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}))
}

func TestTrustCAVendorData(t *testing.T) {
	dir := t.TempDir()
	ca := testCA(t)
	if err := os.MkdirAll(filepath.Join(dir, "sub"), 0o755); err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(dir, "a.crt"), []byte(ca), 0o644)
	os.WriteFile(filepath.Join(dir, "sub", "b.crt"), []byte(ca), 0o644)
	os.WriteFile(filepath.Join(dir, "notes.txt"), []byte("not a cert"), 0o644)
	cas, err := HostExtraCAs(dir)
	if err != nil || len(cas) != 2 {
		t.Fatalf("HostExtraCAs = %d certs, %v; want 2", len(cas), err)
	}
	vd, err := TrustCAVendorData(cas)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Count(vd, "BEGIN CERTIFICATE") != 1 || !strings.HasPrefix(vd, "#cloud-config\nca_certs:\n") {
		t.Errorf("vendor-data (duplicates must collapse):\n%s", vd)
	}
	if out, err := schema(t, vd); err != nil {
		t.Errorf("cloud-init schema: %v\n%s\n%s", err, out, vd)
	}
	if s, err := TrustCAVendorData(nil); s != "" || err != nil {
		t.Errorf("no CAs: %q, %v; want empty", s, err)
	}
	if none, err := HostExtraCAs(filepath.Join(dir, "missing")); err != nil || len(none) != 0 {
		t.Errorf("missing dir: %v, %v", none, err)
	}

	// A key must never travel, even if someone drops one next to the certificates.
	key := "-----BEGIN PRIVATE KEY-----\nMIGHAgEAMBMGByqGSM49AgEGCCqGSM49AwEHBG0wawIBAQQg\n-----END PRIVATE KEY-----\n"
	os.WriteFile(filepath.Join(dir, "leak.crt"), []byte(ca+key), 0o644)
	if _, err := HostExtraCAs(dir); err == nil {
		t.Error("a .crt holding a private key was accepted")
	}
	if _, err := TrustCAVendorData([]string{key}); err == nil {
		t.Error("a private key was accepted as a CA")
	}
}

func TestStatusParsing(t *testing.T) {
	// `cloud-init status --wait --format json` of Debian 12's cloud-init 22.4, as seen in a box.
	failed := []byte(`{
  "_schema_version": "1",
  "boot_status_code": "enabled-by-generator",
  "datasource": "nocloud",
  "detail": "DataSourceNoCloud [seed=/var/lib/cloud/seed/nocloud-net][dsmode=net]",
  "errors": [
    "('scripts-user', RuntimeError('Runparts: 1 failures (runcmd) in 1 attempted commands'))"
  ],
  "last_update": "Wed, 02 Dec 2026 11:12:58 +0000",
  "status": "error"
}`)
	st, err := ParseStatus(failed)
	if err != nil || !st.Failed() || !st.Finished() || !strings.Contains(st.Summary(), "scripts-user") {
		t.Errorf("failed status: %+v %v %q", st, err, st.Summary())
	}
	ok, err := ParseStatus([]byte(`{"status": "done", "errors": [], "datasource": "nocloud"}`))
	if err != nil || ok.Failed() || !ok.Finished() {
		t.Errorf("done status: %+v %v", ok, err)
	}
	for _, s := range []string{`{"status": "disabled", "errors": []}`, `{"status": "running", "errors": []}`} {
		if st, _ := ParseStatus([]byte(s)); !st.Failed() {
			t.Errorf("%s counts as success", s)
		}
	}
	if _, err := ParseStatus([]byte("cloud-init: command not found")); err == nil {
		t.Error("non-JSON accepted")
	}

	stages := []byte(`{"v1": {"datasource": "DataSourceNoCloud", "stage": null,
	  "init-local": {"errors": [], "finished": 1.5, "recoverable_errors": {}, "start": 1.0},
	  "init": {"errors": [], "finished": 3.0, "start": 2.0},
	  "modules-config": {"errors": [], "finished": 4.0, "start": 3.5},
	  "modules-final": {"errors": ["('scripts-user', RuntimeError('Runparts: 1 failures'))"], "finished": 9.0, "start": 4.5}}}`)
	s, found, err := FailingStage(stages)
	if err != nil || !found || s.Name != "modules-final" || len(s.Errors) != 1 {
		t.Errorf("FailingStage = %+v %v %v", s, found, err)
	}
	clean := strings.Replace(string(stages), `["('scripts-user', RuntimeError('Runparts: 1 failures'))"]`, "[]", 1)
	if s, found, _ := FailingStage([]byte(clean)); found {
		t.Errorf("clean stages: found %+v", s)
	}
	running := strings.Replace(clean, `"finished": 9.0`, `"finished": null`, 1)
	if s, found, _ := FailingStage([]byte(running)); !found || s.Name != "modules-final" {
		t.Errorf("unfinished stage not reported: %+v %v", s, found)
	}
}
