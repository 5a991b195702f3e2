package boxcore

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"maps"
	"os"
	"strings"
	"time"

	"github.com/claudebox/claudebox/boxcore/incus"
	"github.com/claudebox/claudebox/boxcore/templates"
)

// Baked templates.
//
// A bake is a template's first boot (packages, Node, Claude Code, the global CLAUDE.md, user
// claude) done once, in a box minted the normal way (New: the stack's profile, tags, limits),
// then cleaned of what must be per box and published as a private local image under
// BakeAlias(template), with its recipe in the image's properties. A container `new` of that
// template on that base image then mints from the bake and runs no first boot at all: the
// per-box parts are Incus's image templates, rendered on create and copy (hostname, /etc/hosts,
// an empty machine-id that systemd fills at boot), and cloud-init is disabled in the bake —
// measured here, its four stages cost ~7 s of every boot even with nothing to do, which no
// "ready in 3 s" survives. What cloud-init did per box on a cold mint is either in the image
// (the network config for eth0, the host's extra CAs: part of the recipe) or per box by those
// templates. A baked box is ready when it has its DHCP lease.
//
// A bake never holds a credential: nobody has logged in to the builder, and the bake refuses
// to publish a builder in which a credential file or token is found anyway.
//
// Bakes are made only when asked (`claudebox templates bake`), never by `new` on first use:
// a bake costs a cold mint plus a publish, and a `new` that is sometimes a minute slower
// than the last is a surprise; the image it leaves on the host is the user's choice, as
// `image build`'s is.

// BakePrefix prefixes a bake's image alias; the template's name follows.
const BakePrefix = "claudebox/bake/"

// BakePrefixEnv names another prefix (tests use it to stay off the real aliases).
const BakePrefixEnv = "CLAUDEBOX_BAKE_PREFIX"

// BakeVersion changes whenever what Bake does to the builder changes: bakes of another
// version are stale.
const BakeVersion = "1"

// TagBake records the bake a box was minted from (or, for a clone, its source's).
const TagBake = "user.claudebox.bake"

// Image properties of a bake.
const (
	PropBakeRecipe     = "claudebox.bake.recipe"      // BakeRecipe.Hash
	PropBakeVersion    = "claudebox.bake.version"     // BakeVersion
	PropBakeTemplate   = "claudebox.bake.template"    // the template's name
	PropBakeUserData   = "claudebox.bake.user_data"   // SHA-256 of the template's rendered user-data
	PropBakeVendorData = "claudebox.bake.vendor_data" // SHA-256 of the vendor-data (the host's extra CAs)
	PropBakeBase       = "claudebox.bake.base"        // the base image ref
	PropBakeBaseFP     = "claudebox.bake.base_fingerprint"
	PropBakeClaude     = "claudebox.bake.claude" // the Claude Code version baked in ("" when none)
	PropBakeCreated    = "claudebox.bake.created"
)

// BakeAlias is the image alias of a template's bake.
func BakeAlias(template string) string {
	p := os.Getenv(BakePrefixEnv)
	if p == "" {
		p = BakePrefix
	}
	return p + template
}

// BakeRecipe is what a bake is made of: the template's rendered first boot, the environment's
// vendor-data and the base image. The Claude Code version is not in it: a template that says
// "latest" gets a newer one only when asked (templates bake --refresh).
type BakeRecipe struct {
	Template        string
	Base            string // the image ref the builder is minted from
	BaseFingerprint string // the base's image on this daemon; "" for a remote ref
	UserData        string
	VendorData      string
}

// Hash is the recipe's content hash.
func (r BakeRecipe) Hash() string {
	h := sha256.New()
	fmt.Fprintf(h, "claudebox bake %s\ntemplate %s\nbase %s\nbase-fingerprint %s\nuser-data %s\nvendor-data %s\n",
		BakeVersion, r.Template, r.Base, r.BaseFingerprint, sha(r.UserData), sha(r.VendorData))
	return hex.EncodeToString(h.Sum(nil))
}

func (r BakeRecipe) properties() map[string]string {
	return map[string]string{
		PropBakeRecipe: r.Hash(), PropBakeVersion: BakeVersion, PropBakeTemplate: r.Template,
		PropBakeUserData: sha(r.UserData), PropBakeVendorData: sha(r.VendorData),
		PropBakeBase: r.Base, PropBakeBaseFP: r.BaseFingerprint,
	}
}

func sha(s string) string {
	sum := sha256.Sum256([]byte(s))
	return hex.EncodeToString(sum[:])
}

// BakeState is a template's bake as it stands against what a bake would be made of now.
type BakeState struct {
	Alias  string
	Image  *incus.Image // nil: no bake
	Recipe BakeRecipe   // what a bake made now would be made of
	Stale  string       // why the bake no longer fits ("" when it fits or there is none)
}

// Current reports whether a bake exists and fits.
func (s BakeState) Current() bool { return s.Image != nil && s.Stale == "" }

// Claude is the Claude Code version baked in ("" when none or no bake).
func (s BakeState) Claude() string {
	if s.Image == nil {
		return ""
	}
	return s.Image.Properties[PropBakeClaude]
}

// Label is the bake as a box records it (TagBake) and `info` shows it.
func (s BakeState) Label() string {
	if s.Image == nil {
		return ""
	}
	l := fmt.Sprintf("%s (image %s", s.Alias, shortFP(s.Image.Fingerprint))
	if v := s.Claude(); v != "" {
		l += ", Claude Code " + v
	}
	if c := s.Image.Properties[PropBakeCreated]; c != "" {
		l += ", baked " + c
	}
	return l + ")"
}

func shortFP(fp string) string {
	if len(fp) > 12 {
		return fp[:12]
	}
	return fp
}

// bakeRecipe is the recipe of the cold container mint o describes (after ApplyTemplate):
// its template, user-data, vendor-data and base image, resolved on this daemon.
func (bs *Boxes) bakeRecipe(ctx context.Context, o NewOptions) (BakeRecipe, error) {
	r := BakeRecipe{Template: o.Config[TagTemplate], Base: o.Image,
		UserData: o.Config["cloud-init.user-data"], VendorData: o.Config["cloud-init.vendor-data"]}
	src, err := ResolveImage(o.Image)
	if err != nil || src.Server != "" {
		return r, err // a remote base is judged by its ref: the daemon resolves it at create
	}
	a, err := bs.Client.ImageAlias(ctx, src.Alias)
	if errors.Is(err, incus.ErrNotFound) {
		return r, missingImage(o.Image)
	}
	if err != nil {
		return r, err
	}
	r.BaseFingerprint = a.Target
	return r, nil
}

// BakeState reads the bake of o's template (o: a cold container mint after ApplyTemplate)
// and says whether it fits.
func (bs *Boxes) BakeState(ctx context.Context, o NewOptions) (BakeState, error) {
	r, err := bs.bakeRecipe(ctx, o)
	if err != nil {
		return BakeState{}, err
	}
	st := BakeState{Alias: BakeAlias(r.Template), Recipe: r}
	img, err := bs.Client.ImageByAlias(ctx, st.Alias)
	if errors.Is(err, incus.ErrNotFound) {
		return st, nil
	}
	if err != nil {
		return st, err
	}
	st.Image = &img
	st.Stale = staleness(img.Properties, r)
	return st, nil
}

// staleness says why a bake's properties do not fit a recipe, first reason first; "" when
// they fit.
func staleness(p map[string]string, r BakeRecipe) string {
	want := r.properties()
	switch {
	case p[PropBakeVersion] != BakeVersion:
		return fmt.Sprintf("made by another bake version (%q, this claudebox bakes %q)", p[PropBakeVersion], BakeVersion)
	case p[PropBakeTemplate] != r.Template:
		return fmt.Sprintf("it is a bake of template %q", p[PropBakeTemplate])
	case p[PropBakeUserData] != want[PropBakeUserData]:
		return "the template changed"
	case p[PropBakeBase] != r.Base:
		return fmt.Sprintf("the base image is now %s (baked on %s)", r.Base, p[PropBakeBase])
	case p[PropBakeBaseFP] != r.BaseFingerprint:
		return fmt.Sprintf("the base image %s changed (image %s, baked on %s)", r.Base, shortFP(r.BaseFingerprint), shortFP(p[PropBakeBaseFP]))
	case p[PropBakeVendorData] != want[PropBakeVendorData]:
		return "the host's extra CA certificates changed"
	case p[PropBakeRecipe] != want[PropBakeRecipe]:
		return "its recipe differs"
	}
	return ""
}

// UseBake makes o, a fresh container of a template (after ApplyTemplate), mint from the
// template's bake when one exists and fits. Everything else about the box — the stack's
// profile, tags, limits, the root disk — is New's as for any box. The returned state says
// what was found (a stale bake is not used: the caller may say so).
func (bs *Boxes) UseBake(ctx context.Context, o *NewOptions) (BakeState, error) {
	if o.VM || o.From != "" || o.Config[TagTemplate] == "" {
		return BakeState{}, nil
	}
	st, err := bs.BakeState(ctx, *o)
	if ie := interrupted(ctx, o.Name, "choosing the image of", false); ie != nil {
		return st, ie // nothing was made yet: say the interrupt, not the request it cut
	}
	if err != nil || !st.Current() {
		return st, err
	}
	applyBake(o, st)
	return st, nil
}

// applyBake turns a cold mint into a mint from the bake: its image, no user-data or
// vendor-data (cloud-init is off in a bake; both are in the image), and a wait for the lease
// instead of cloud-init.
func applyBake(o *NewOptions, st BakeState) {
	o.Image = st.Alias
	delete(o.Config, "cloud-init.user-data")
	delete(o.Config, "cloud-init.vendor-data")
	o.Config[TagBake] = st.Label()
	timeout := DefaultBakedBootTimeout
	if o.FirstBoot != nil && o.FirstBoot.Timeout > 0 && o.FirstBoot.Timeout < timeout {
		timeout = o.FirstBoot.Timeout
	}
	o.FirstBoot = &FirstBoot{Baked: true, Timeout: timeout}
}

// DefaultBakedBootTimeout bounds the wait for a baked box's lease.
const DefaultBakedBootTimeout = 2 * time.Minute

// firstBootOf is the wait a copy of a box with this config needs (a clone, an import): its
// lease when it came from a bake (cloud-init is off there), cloud-init when it has a template
// (a copy gets a new instance-id, so cloud-init runs again), else none.
func firstBootOf(cfg map[string]string) *FirstBoot {
	switch {
	case cfg[TagBake] != "":
		return &FirstBoot{Baked: true, Timeout: DefaultBakedBootTimeout}
	case cfg[TagTemplate] != "":
		return &FirstBoot{Timeout: DefaultFirstBootTimeout}
	}
	return nil
}

// BakeOptions are the choices of Bake.
type BakeOptions struct {
	// New is the cold container mint of the template (after ApplyTemplate) the builder is
	// made with; Bake names it. Extra Config (a test's tag) goes on the builder too.
	New NewOptions
	// Refresh bakes again even when the bake fits (a newer Claude Code for "latest").
	Refresh bool
	// Progress receives each step ("mint", "check", "clean", "stop", "publish", "alias") and
	// the builder's own mint steps; nil for silence.
	Progress func(Progress)
}

// BakeResult says what Bake did.
type BakeResult struct {
	State    BakeState // the bake as it is now
	UpToDate bool      // it fit already: nothing done
	Why      string    // why a bake was made: "no bake yet", the staleness, or "asked to refresh"
	Builder  string
	Replaced string // the image the alias named before
	Removed  bool   // and it was deleted (no other alias named it)
	Mint     time.Duration
	Publish  time.Duration
	Total    time.Duration
}

// Bake makes (or remakes) the bake of o.New's template: a builder box minted with New,
// checked (Claude Code runs as its user; no credential anywhere), cleaned of what must be
// per box, stopped, published as a private image with its recipe, aliased, and removed —
// the builder is removed whatever happens. A fitting bake is left alone unless o.Refresh.
func (bs *Boxes) Bake(ctx context.Context, o BakeOptions) (BakeResult, error) {
	start := time.Now()
	if o.New.VM || o.New.From != "" || o.New.Config[TagTemplate] == "" {
		return BakeResult{}, Usagef("bake: only a container mint of a template can be baked")
	}
	st, err := bs.BakeState(ctx, o.New)
	if err != nil {
		return BakeResult{}, err
	}
	res := BakeResult{State: st}
	switch {
	case st.Current() && !o.Refresh:
		res.UpToDate, res.Total = true, time.Since(start)
		return res, nil
	case st.Image == nil:
		res.Why = "no bake yet"
	case st.Stale != "":
		res.Why = st.Stale
	default:
		res.Why = "asked to refresh"
	}
	progress := func(stage, text string) {
		if o.Progress != nil {
			o.Progress(Progress{Stage: stage, Percent: -1, Text: text})
		}
	}
	b := o.New
	b.Name = "bake-" + st.Recipe.Template + "-" + randomToken()[:6]
	b.Config = maps.Clone(b.Config)
	// The builder runs the template's recipe once, at the user's asking, bounded by the
	// first boot's timeout: it gets every CPU of the host (a box's quota leaves one free).
	// Measured here (2 CPUs): the builder's first boot 15-18 s instead of 19-21 s.
	b.Config[KeyCPUAllowance] = DefaultLimits().HostAllowance()
	b.Progress = o.Progress
	b.Timings = nil
	b.Target, b.Here = "", true // built here, where its image's pool is warmed
	res.Builder = b.Name
	defer bs.removeBuilder(b.Name)

	progress("mint", fmt.Sprintf("minting the builder %s from %s (the %s template's first boot)", b.Name, b.Image, st.Recipe.Template))
	t0 := time.Now()
	if _, err := bs.New(ctx, b); err != nil {
		return res, fmt.Errorf("bake: minting the builder: %w", err)
	}
	res.Mint = time.Since(t0)
	progress("check", "checking the builder: no credential anywhere, and Claude Code (when the template installs it) runs as user "+templates.User)
	claude, err := bs.checkBuilder(ctx, b.Name)
	if err != nil {
		return res, err
	}
	progress("clean", "cleaning what must be per box (cloud-init state and logs, machine-id, SSH host keys, leases, caches)")
	if err := bs.cleanBuilder(ctx, b.Name); err != nil {
		return res, err
	}
	progress("stop", "stopping the builder")
	if err := bs.stopBuilder(ctx, b.Name); err != nil {
		return res, err
	}
	progress("publish", "publishing the builder as an image")
	t1 := time.Now()
	props := st.Recipe.properties()
	props[PropBakeClaude] = claude
	props[PropBakeCreated] = time.Now().UTC().Format(time.RFC3339)
	props["description"] = fmt.Sprintf("claudebox bake of template %s on %s", st.Recipe.Template, st.Recipe.Base)
	fp, err := bs.Client.PublishInstance(ctx, b.Name, incus.PublishOptions{Properties: props, Compression: "none"})
	if err != nil {
		return res, fmt.Errorf("bake: publishing the builder: %w", err)
	}
	res.Publish = time.Since(t1)
	// What is left is the daemon's I/O: the builder's and the replaced bake's removal go
	// beside the warm rather than after it (about a second of every bake here).
	removed := make(chan struct{})
	go func() { defer close(removed); bs.removeBuilder(b.Name) }()
	defer func() { <-removed }()
	progress("alias", "naming image "+shortFP(fp)+" "+st.Alias)
	if err := bs.Client.PointImageAlias(ctx, st.Alias, fp); err != nil {
		_ = bs.Client.DeleteImage(context.WithoutCancel(ctx), fp)
		return res, fmt.Errorf("bake: %w", err)
	}
	replaced := make(chan struct{})
	if st.Image != nil && st.Image.Fingerprint != fp {
		res.Replaced = st.Image.Fingerprint
		go func() {
			defer close(replaced)
			res.Removed, _ = bs.Client.DeleteImageIfUnaliased(ctx, st.Image.Fingerprint)
		}()
	} else {
		close(replaced)
	}
	progress("warm", "unpacking the image into pool "+bs.Stack.Pool+" once, so the first 'new' from it is as quick as the next")
	bs.warmPool(ctx, fp, b.Config)
	<-replaced
	img, err := bs.Client.Image(ctx, fp)
	if err != nil {
		return res, err
	}
	res.State = BakeState{Alias: st.Alias, Image: &img, Recipe: st.Recipe}
	res.Total = time.Since(start)
	return res, nil
}

// checkBuilder proves the builder is what a bake may hold: Claude Code (when the template
// installed it) runs as user claude, and no credential file or token exists. It returns the
// Claude Code version ("" when the template installs none).
func (bs *Boxes) checkBuilder(ctx context.Context, name string) (string, error) {
	if found, err := bs.credentialScan(ctx, name); err != nil {
		return "", err
	} else if found != "" {
		return "", fmt.Errorf("bake: the builder holds what looks like a credential, so it is not published:\n%s", found)
	}
	rec, err := bs.Client.Exec(ctx, name, incus.ExecRequest{Command: []string{"test", "-e", templates.InstallRecord}})
	if err != nil {
		return "", fmt.Errorf("bake: checking the builder: %w", err)
	}
	if rec.ExitCode != 0 {
		return "", nil // the template installs no Claude Code
	}
	res, err := bs.Client.Exec(ctx, name, incus.ExecRequest{Command: []string{"su", "-l", templates.User, "-c", "claude --version"}})
	if err != nil {
		return "", fmt.Errorf("bake: checking the builder: %w", err)
	}
	out := strings.TrimSpace(string(res.Stdout))
	if res.ExitCode != 0 || !strings.Contains(out, "Claude Code") {
		return "", fmt.Errorf("bake: claude --version as user %s in the builder: exit %d: %s%s", templates.User, res.ExitCode, out, res.Stderr)
	}
	v, _, _ := strings.Cut(out, " ")
	return v, nil
}

// CredentialScanScript prints every credential-like file and every file holding a token in
// the places a login writes to (homes, /root, /etc, /var/lib/cloud), skipping installed
// program trees (Claude Code's own bundle names token prefixes). Empty output: clean.
const CredentialScanScript = `set -u
for d in /root /home /etc /var/lib/cloud /tmp /var/tmp; do
  [ -d "$d" ] || continue
  find "$d" -xdev \( -name node_modules -o -name .npm -o -path '*/.local/lib' -o -path '*/.local/share/claude' \) -prune -o \
    -type f \( -name .credentials.json -o -name .git-credentials -o -name .netrc -o -name hosts.yml -o -name '.npmrc' \) -print
  grep -rIlE --exclude-dir=node_modules --exclude-dir=.npm --exclude-dir=lib --exclude-dir=share \
    'sk-ant-[A-Za-z0-9_-]{8,}|gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,}|"oauthAccount"|"accessToken"|_authToken' "$d" 2>/dev/null
done
exit 0
`

// credentialScan runs CredentialScanScript in a box and returns what it found.
func (bs *Boxes) credentialScan(ctx context.Context, name string) (string, error) {
	res, err := bs.Client.Exec(ctx, name, incus.ExecRequest{Command: []string{"sh", "-c", CredentialScanScript}})
	if err != nil {
		return "", fmt.Errorf("bake: scanning the builder for credentials: %w", err)
	}
	if res.ExitCode != 0 {
		return "", fmt.Errorf("bake: scanning the builder for credentials: exit %d: %s", res.ExitCode, res.Stderr)
	}
	return strings.TrimSpace(string(res.Stdout)), nil
}

// cleanScript removes what must be per box from the builder before it is published, and
// turns cloud-init off (see the package comment on bakes). The machine-id is emptied (systemd
// makes one at boot; the image's template empties it on create and copy too); hostname and
// /etc/hosts are rendered by the image's templates on create and copy.
const cleanScript = `set -eu
cloud-init clean --logs
touch /etc/cloud/cloud-init.disabled
truncate -s 0 /etc/machine-id
if [ -f /var/lib/dbus/machine-id ] && [ ! -L /var/lib/dbus/machine-id ]; then rm -f /var/lib/dbus/machine-id; fi
rm -f /etc/ssh/ssh_host_* /var/lib/systemd/random-seed
rm -rf /var/lib/dhcp/* /var/lib/apt/lists/* /tmp/* /var/tmp/* /root/.npm /home/*/.npm
rm -f /root/.bash_history /home/*/.bash_history /home/*/.claude.json /home/*/.claude.json.backup
apt-get clean
journalctl --rotate >/dev/null 2>&1 || true
journalctl --vacuum-time=1s >/dev/null 2>&1 || true
find /var/log -type f \( -name '*.gz' -o -name '*.[0-9]' -o -name '*.old' \) -delete
find /var/log -type f -exec truncate -s 0 {} +
sync
`

func (bs *Boxes) cleanBuilder(ctx context.Context, name string) error {
	res, err := bs.Client.Exec(ctx, name, incus.ExecRequest{Command: []string{"sh", "-c", cleanScript}})
	if err != nil {
		return fmt.Errorf("bake: cleaning the builder: %w", err)
	}
	if res.ExitCode != 0 {
		return fmt.Errorf("bake: cleaning the builder: exit %d: %s%s", res.ExitCode, res.Stdout, res.Stderr)
	}
	if found, err := bs.credentialScan(ctx, name); err != nil || found != "" {
		if err == nil {
			err = fmt.Errorf("bake: the cleaned builder holds what looks like a credential, so it is not published:\n%s", found)
		}
		return err
	}
	return nil
}

// stopBuilder stops the cleaned builder at once. A forced stop loses nothing the image
// needs: the clean ended with a sync, and a container's writes are in the host's page cache
// anyway. A clean shutdown took 2-3 s of every bake here, for nothing the image keeps.
func (bs *Boxes) stopBuilder(ctx context.Context, name string) error {
	if err := bs.Client.SetState(ctx, name, "stop", true, 0); err != nil && !strings.Contains(err.Error(), "already stopped") {
		return fmt.Errorf("bake: stopping the builder: %w", err)
	}
	return nil
}

// removeBuilder deletes the builder, with a context of its own: an interrupted bake still
// cleans up.
func (bs *Boxes) removeBuilder(name string) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if _, _, err := bs.Client.Instance(ctx, name); err != nil {
		return
	}
	_ = bs.Client.SetState(ctx, name, "stop", true, 0)
	if err := bs.Client.DeleteInstance(ctx, name); err == nil {
		bs.clearStalePort(name)
	}
}

// warmPool makes the daemon unpack the image into the stack's pool now (an instance created
// and deleted at once: the image's volume stays in the pool), so that the first box from it
// does not pay for that (~4 s here for a 1 GB image). It is not a box: never tagged as one,
// and gone before Bake returns. The builder's user.* keys but TagKey (a test's tag among them) go
// on it too.
// A failure only costs the first `new` that time, so it is not reported.
func (bs *Boxes) warmPool(ctx context.Context, fp string, cfg map[string]string) {
	name := "bake-warm-" + randomToken()[:6]
	marks := map[string]string{}
	for k, v := range cfg {
		if strings.HasPrefix(k, "user.") && k != TagKey { // without TagKey it is no box
			marks[k] = v
		}
	}
	req := incus.InstancesPost{Name: name, Type: "container", Profiles: []string{}, Config: marks,
		Devices: map[string]map[string]string{"root": {"type": "disk", "path": "/", "pool": bs.Stack.Pool}},
		Source:  incus.InstanceSource{Type: "image", Fingerprint: fp}}
	// On a cluster the image volume is per member: warm this one's, where `new` mints.
	if target, err := bs.placement(ctx, "", true); err == nil {
		req.Target = target
	}
	if err := bs.Client.CreateInstance(ctx, req, nil); err != nil {
		return
	}
	dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
	defer cancel()
	_ = bs.Client.DeleteInstance(dctx, name)
}
