package boxcore

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/claudebox/claudebox/boxcore/incus"
	"github.com/claudebox/claudebox/boxcore/templates"
	"github.com/claudebox/claudebox/firewall"
)

// Provenance tags every box carries besides TagKey.
const (
	TagCreated = "user.claudebox.created"
	TagOrigin  = "user.claudebox.origin" // fresh | clone
	TagFrom    = "user.claudebox.from"   // the image ref, or the source box[/snapshot]
	TagVersion = "user.claudebox.version"
	// tagMint is a per-call token: a failed `new` deletes an instance only if it carries the
	// token of that very call, so two `new` racing for one name never delete each other's box.
	tagMint = "user.claudebox.mint"
	// mintMadeAtStart ends the token of a box that `new` has made once it has started and
	// whose port is bound (no first boot to run: an image without cloud-init, on a standalone
	// daemon): new writes nothing to it after the start, so the marker is never dropped; it
	// ends with the box's first start instead (Minting). That spares new an instance update on
	// its critical path (20-70 ms here: a third of its time past `incus launch`). A box with
	// anything after its start that takes time and can fail (a bake's lease, another member's
	// binding) keeps a plain token, dropped once that is done, so it never shows as made while
	// new may still remove it.
	mintMadeAtStart = "+start"
)

// Minting reports whether a box's config says its `new` has not finished (or died before it
// did): the mint marker is there and, for a box made once started, it never started. Incus
// sets volatile.last_state.power at a box's first start and keeps it (snapshots included).
func Minting(cfg map[string]string) bool {
	v, ok := cfg[tagMint]
	if !ok {
		return false
	}
	return !strings.HasSuffix(v, mintMadeAtStart) || cfg["volatile.last_state.power"] == ""
}

// Boxes works on the boxes of one daemon, on one stack.
type Boxes struct {
	Client  *incus.Client
	Stack   Stack
	Version string // recorded on every new box
	// HostLocked: the caller holds the network's lock (the drill, around its whole run), so
	// binding a started box's port must not take it again.
	HostLocked bool
	// Warn receives a line for the user (the memory budget warning of new and start, a
	// stop that had to kill); nil for silence.
	Warn func(string)
	// StopGrace is how long Stop waits for a clean shutdown; 0 is DefaultStopGrace.
	StopGrace time.Duration
}

// NewOptions are the choices of `new`.
type NewOptions struct {
	Name string
	VM   bool
	// Image is a ref: "ALIAS" (local) or "REMOTE:ALIAS" (a simplestreams or incus remote).
	Image  string
	CPU    string // limits.cpu
	Memory string // limits.memory
	Disk   string // root disk size
	// Processes is a container's limits.processes; 0 for the host-sized default.
	Processes int64
	// From is SRC or SRC/SNAP: clone a box instead of an image.
	From string
	// Config is extra instance config (cloud-init user-data, VM settings), set at create.
	Config map[string]string
	// Progress receives what `new` is doing; nil for silence.
	Progress func(Progress)
	// FirstBoot, when set, waits for cloud-init after start; its failure fails `new`.
	FirstBoot *FirstBoot
	// KeepFailed leaves a box whose first boot failed, for inspection.
	KeepFailed bool
	// Timings, when set, receives how long each part of the mint took.
	Timings *MintTimings
	// Type, when set ("container" or "virtual-machine"), is the type the user asked for
	// explicitly; a clone of a source of the other type is refused.
	Type string
	// Target is the cluster member to mint on; the default is Incus's placement (or this
	// member, with Here). On another member its agent binds the box's port: `new` waits
	// for that (AgentBindWait) and fails, removing the box, when no agent did.
	Target string
	Here   bool
}

// MintTimings splits a mint's wall time.
type MintTimings struct {
	Launch        time.Duration // create + start
	FirstBoot     time.Duration // cloud-init, Claude install included
	ClaudeInstall time.Duration // as the box's install record says; 0 when none
}

// Progress is one step of `new`.
type Progress struct {
	Stage   string // "download", "create", "start", "ready"
	Percent int    // -1 when unknown
	Text    string
}

// New mints a box: image or clone, profile exactly [stack profile], tags, started, first boot
// waited for. All or nothing: whatever fails — a bad flag, the create, the start, cloud-init,
// its timeout, or ctx ending (SIGINT, SIGTERM) — no instance of this call is left behind.
// The Incus operation in flight is cancelled or awaited, and the half-made instance removed
// with a context of its own, so an interrupt cannot cut the cleanup short. Until the mint
// is complete the box carries tagMint, and list/info show it as MINTING, never as ready.
func (bs *Boxes) New(ctx context.Context, o NewOptions) (*Box, error) {
	if err := validateNew(ctx, o); err != nil {
		return nil, err
	}
	// Two `new` of one name on this host: the second says so at once instead of racing the
	// first inside the daemon (where a losing create can take the winner down with it).
	unlock, err := lockMint(bs.Client.Remote(), o.Name)
	if err != nil {
		return nil, err
	}
	defer unlock()

	m := &minting{bs: bs, o: o, token: randomToken()}
	target, err := bs.placement(ctx, o.Target, o.Here)
	if err != nil {
		return nil, err
	}
	req, err := m.request(ctx)
	if err != nil {
		return nil, err
	}
	if made, err := m.madeAtStart(ctx, req); err != nil {
		return nil, err
	} else if made {
		m.token += mintMadeAtStart
		req.Config[tagMint] = m.token
	}
	// The budget warning lists every box: with dozens, that listing is the daemon's work and
	// ours (JSON), so it runs beside the create, not before it.
	warnMemory := m.memoryWarning(ctx, req.Config[KeyMemory])
	req.Target = target
	if err := interrupted(ctx, o.Name, "starting", false); err != nil {
		return nil, err
	}
	// The port's address and MAC chosen here let its rules go in while Incus creates and
	// starts the box (prebind.go), rather than after.
	plan, release, err := bs.planNIC(ctx, o.Name)
	if err != nil {
		return nil, err
	}
	if plan != nil {
		applyPlan(&req, plan)
	}
	m.plan, m.pre = plan, bs.preBind(ctx, o.Name, plan)
	started := time.Now()
	err = m.createInstance(ctx, req)
	if err == nil && plan != nil {
		err = m.checkPlan(ctx, plan)
	}
	release()
	warnMemory()
	if err != nil {
		return nil, err
	}
	if m.o.FirstBoot != nil && !m.o.FirstBoot.noCloudInit && plan != nil && req.Config["environment.PATH"] == "" && lacksCommand(o.Name, "cloud-init") {
		fb := *m.o.FirstBoot
		fb.noCloudInit = true
		m.o.FirstBoot = &fb
	}
	at, err := m.location(ctx, target)
	if err != nil {
		return nil, err
	}
	bound, err := m.start(ctx, at)
	if err != nil {
		return nil, err
	}
	// The box as we made it; no need to ask the daemon what it just told us.
	box := &Box{Name: o.Name, Instance: incus.Instance{Name: o.Name, Type: req.Type, Status: "Running", Config: req.Config, Profiles: req.Profiles, Devices: req.Devices, Location: at}}
	launched := time.Now()
	if o.Timings != nil {
		o.Timings.Launch = launched.Sub(started)
	}
	if err := m.firstBoot(ctx, box, launched, bound); err != nil {
		return nil, err
	}
	if !strings.HasSuffix(m.token, mintMadeAtStart) {
		if err := m.finish(ctx); err != nil {
			return nil, err
		}
	} else if ctx.Err() != nil {
		return nil, m.fail(ctx, "finishing", ctx.Err())
	}
	delete(box.Instance.Config, tagMint)
	m.progress(Progress{Stage: "ready", Percent: -1, Text: o.Name + " is ready"})
	return box, nil
}

// firstBootText is the first-boot status line: it names the template whose cloud-init runs.
func firstBootText(name, template string) string {
	if template == "" {
		return "waiting for cloud-init in " + name + " (first boot)"
	}
	return "waiting for cloud-init in " + name + ": the " + template + " template's first boot"
}

// validateNew refuses bad options, and a ctx already ended, before anything is locked or made.
func validateNew(ctx context.Context, o NewOptions) error {
	if err := ValidateName(o.Name); err != nil {
		return err
	}
	if o.From != "" && (o.Image != "" || o.CPU != "" || o.Memory != "" || o.Disk != "" || o.Processes != 0) {
		return Usagef("new: --from copies a box whole; it does not take --image, --template, --cpu, --memory, --processes or --disk")
	}
	if err := ValidateResources(o.CPU, o.Memory, o.Disk); err != nil {
		return err
	}
	if err := DefaultLimits().ValidateLimits(o.CPU, o.Memory, o.Processes, o.VM); err != nil {
		return err
	}
	if o.From != "" {
		if _, _, err := ParseFrom(o.From); err != nil {
			return err
		}
	}
	return interrupted(ctx, o.Name, "starting", false)
}

// minting is one call of New. Its token marks the instance this call makes, so that cleanup
// removes that instance and never a racing call's.
type minting struct {
	bs    *Boxes
	o     NewOptions // New's own copy: request may fill in FirstBoot for a clone
	token string
	clone bool
	pre   <-chan *preBound      // the bind before the start, until start hands it on
	plan  *firewall.PortBinding // the NIC new chose (nil: Incus chose it)
	image string                // the fingerprint of a local image source ("": a clone, a remote's image)
	// readAhead is the started box as finish reads it, read beside the port's binding.
	readAhead <-chan instanceRead
}

// madeAtStart reports whether the box is made once it has started, so that its mint marker
// ends with that start: on a standalone daemon, it has no first boot, or it comes from a
// local image whose volume in the pool, read on the host before the create, has no cloud-init
// on exec's PATH. FirstBoot is then told so (the box's own root is not read again), and a
// template asked for by name is refused before anything is made. A bake's box is not: its
// lease is waited for after the start, and a lease that never comes removes the box.
func (m *minting) madeAtStart(ctx context.Context, req incus.InstancesPost) (bool, error) {
	fb := m.o.FirstBoot
	if fb != nil && fb.Baked {
		return false, nil
	}
	if member, err := localMember(ctx, m.bs.Client); err != nil || member != "" {
		return false, nil // on a cluster the box may start on a member whose agent binds it
	}
	switch {
	case fb == nil:
		return true, nil
	case !localFingerprint(m.image) || req.Config["environment.PATH"] != "" || m.bs.Client.Remote() != "local":
		return false, nil // only this host's own daemon's pool is on this host to read
	}
	root := filepath.Join(incusDir(), "storage-pools", m.bs.Stack.Pool, "images", m.image, "rootfs")
	if !rootLacksCommand(root, "cloud-init") {
		return false, nil
	}
	if fb.Required {
		return false, noCloudInit(m.o.Image)
	}
	nfb := *fb
	nfb.noCloudInit = true
	m.o.FirstBoot = &nfb
	return true, nil
}

// localFingerprint: what the daemon names a local image by (64 hex digits), and so a path
// element of its pool volume that cannot climb out of it.
func localFingerprint(fp string) bool {
	if len(fp) != 64 {
		return false
	}
	for _, r := range fp {
		if !strings.ContainsRune("0123456789abcdef", r) {
			return false
		}
	}
	return true
}

// checkPlan: the create wrote the plan's reservation; no other NIC may hold its address or
// MAC (Incus checks a static address against static ones only: one it allocated at the same
// moment to a box started outside a plan would leave both ports unbindable).
func (m *minting) checkPlan(ctx context.Context, plan *firewall.PortBinding) error {
	if other := addressHeldBy(m.bs.Stack.Network, *plan); other != "" {
		return m.fail(ctx, "creating", fmt.Errorf("new: %s's address %s or MAC %s is also %s's: %w; try again",
			m.o.Name, plan.IPv4, plan.MAC, other, errAddressTaken))
	}
	return nil
}

// memoryWarning starts MemoryBudgetWarning for the box being made; the returned func waits
// for it and warns.
func (m *minting) memoryWarning(ctx context.Context, limit string) func() {
	if m.bs.Warn == nil {
		return func() {}
	}
	w := make(chan string, 1)
	go func() { w <- m.bs.MemoryBudgetWarning(ctx, m.o.Name, limit) }()
	return func() {
		if s := <-w; s != "" {
			m.bs.Warn(s)
		}
	}
}

// unbindPlanned drops the rules a bind made for a planned NIC whose box fail removed: waits
// for the bind before the start if it still runs, then binds what runs now. Best effort, with
// a context of its own (an interrupt must not leave a port's rules behind for the next round).
func (m *minting) unbindPlanned() {
	if m.plan == nil {
		return
	}
	if m.pre != nil {
		<-m.pre
		m.pre = nil
	}
	removePending(m.bs.Stack.Network, m.o.Name)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	_ = m.bs.bindPorts(ctx, "")
}

func (m *minting) progress(p Progress) {
	if m.o.Progress != nil {
		m.o.Progress(p)
	}
}

// fail removes what this call made and says why. When ctx ended, the why is the interrupt,
// whatever error the cut-short step returned.
func (m *minting) fail(ctx context.Context, stage string, err error) error {
	left := m.bs.discard(m.o.Name, m.token)
	m.unbindPlanned()
	if ierr := interrupted(ctx, m.o.Name, stage, left != nil); ierr != nil {
		return ierr
	}
	if left != nil {
		err = fmt.Errorf("%w\n(and the half-made box could not be removed: %v; remove it with: claudebox rm %s --force)", err, left, m.o.Name)
	}
	return err
}

// request builds the create request: tags, the stack's profile, and a source that is either
// a box to clone or an image; the caller's extra config goes on top.
func (m *minting) request(ctx context.Context) (incus.InstancesPost, error) {
	cfg := map[string]string{
		TagKey:     "1",
		TagCreated: time.Now().UTC().Format(time.RFC3339),
		TagVersion: m.bs.Version,
		tagMint:    m.token,
	}
	req := incus.InstancesPost{Name: m.o.Name, Profiles: []string{m.bs.Stack.Profile}, Type: "container"}
	if m.o.VM {
		req.Type = "virtual-machine"
	}
	var err error
	if m.o.From != "" {
		err = m.cloneSource(ctx, &req, cfg)
	} else {
		err = m.imageSource(ctx, &req, cfg)
	}
	if err != nil {
		return incus.InstancesPost{}, err
	}
	for k, v := range m.o.Config {
		cfg[k] = v
	}
	DefaultLimits().applyContainerKeys(req.Type, cfg, m.o.Processes)
	req.Config = cfg
	return req, nil
}

// cloneSource makes req a copy of the box (or snapshot) o.From, with its type, devices and
// config, less what identifies the source.
func (m *minting) cloneSource(ctx context.Context, req *incus.InstancesPost, cfg map[string]string) error {
	o := &m.o
	src, snap, err := m.bs.resolveSource(ctx, o.From)
	if err != nil {
		return err
	}
	if o.Type != "" && o.Type != src.Instance.Type {
		flag := map[string]string{"virtual-machine": "--vm", "container": "--container"}[o.Type]
		return Usagef("new: %s asks for a %s, but %s is a %s and a clone keeps its source's type: drop %s (or clone a %s)",
			flag, typeWord(o.Type), src.Name, typeWord(src.Instance.Type), flag, typeWord(o.Type))
	}
	m.clone = true
	req.Type, req.Architecture = src.Instance.Type, src.Instance.Architecture
	for k, v := range src.Instance.Config {
		// Volatile keys carry the source's MAC addresses and ids: a clone regenerates them.
		if !strings.HasPrefix(k, "volatile.") && !strings.HasPrefix(k, "user.claudebox") && k != "image.architecture" {
			cfg[k] = v
		}
	}
	req.Devices = maps.Clone(src.Instance.Devices)
	if req.Devices == nil {
		req.Devices = map[string]map[string]string{}
	}
	req.Devices["eth0"] = BoxNIC(m.bs.Stack, o.Name) // its own port name, not its source's
	source := src.Name
	if snap != "" {
		source += "/" + snap
	}
	req.Source = incus.InstanceSource{Type: "copy", Source: source, InstanceOnly: true}
	cfg[TagOrigin], cfg[TagFrom] = "clone", source
	for _, k := range []string{TagTemplate, TagBake} {
		if v := src.Instance.Config[k]; v != "" {
			cfg[k] = v
		}
	}
	if o.FirstBoot == nil {
		o.FirstBoot = firstBootOf(src.Instance.Config)
	}
	return nil
}

// imageSource makes req a fresh box from the image o.Image, with the limits asked for.
func (m *minting) imageSource(ctx context.Context, req *incus.InstancesPost, cfg map[string]string) error {
	o := &m.o
	src, err := ResolveImage(o.Image)
	if err != nil {
		return err
	}
	if src.Server == "" {
		if a, err := m.bs.Client.ImageAlias(ctx, src.Alias); errors.Is(err, incus.ErrNotFound) {
			return missingImage(o.Image)
		} else if err != nil && ctx.Err() == nil {
			return err
		} else {
			m.image = a.Target
		}
		if localFingerprint(m.image) {
			// The image that madeAtStart reads is the one created from, should the alias move.
			src = incus.InstanceSource{Type: "image", Fingerprint: m.image}
		}
	} else if err := checkImageServer(ctx, o.Image, src); err != nil {
		return err
	}
	req.Source = src
	cfg[TagOrigin], cfg[TagFrom] = "fresh", o.Image
	if o.CPU != "" {
		cfg["limits.cpu"] = o.CPU
	}
	if o.Memory != "" {
		cfg["limits.memory"] = o.Memory
	}
	req.Devices = map[string]map[string]string{"eth0": BoxNIC(m.bs.Stack, o.Name)}
	// Every fresh box has its own root on the stack's pool with a size: on btrfs that is its
	// qgroup limit, visible on the box and tightened live by the drill (disk.go).
	disk, what := o.Disk, "--disk"
	if disk == "" {
		disk, what = DefaultDisk, "the default disk size"
	}
	if err := m.bs.checkDisk(ctx, disk, what); err != nil {
		return err
	}
	req.Devices["root"] = map[string]string{"type": "disk", "path": "/", "pool": m.bs.Stack.Pool, "size": disk}
	return nil
}

// createInstance creates the instance and, for a container clone, gives it its own
// machine-id.
func (m *minting) createInstance(ctx context.Context, req incus.InstancesPost) error {
	from := m.o.Image
	if m.clone {
		from = m.o.From
	}
	m.progress(Progress{Stage: "create", Percent: -1, Text: "creating " + m.o.Name + " from " + from})
	var onProgress func(incus.ProgressEvent)
	if m.o.Progress != nil { // polling for progress costs round trips: only when someone watches
		onProgress = func(ev incus.ProgressEvent) {
			m.progress(Progress{Stage: "download", Percent: ev.Percent, Text: ev.Text})
		}
	}
	if err := m.bs.create(ctx, req, onProgress); err != nil {
		return m.createFailed(ctx, err)
	}
	if m.clone && req.Type == "container" {
		// Same machine-id, same DHCP client id, same lease: give the clone its own.
		if err := m.bs.resetMachineID(ctx, m.o.Name); err != nil {
			return m.fail(ctx, "preparing", err)
		}
	}
	if _, exposed := withoutExposures(req.Devices); m.clone && exposed {
		// A clone does not inherit its source's exposures: they would listen where the
		// source's do (and the daemon adds the source's devices back to any request).
		if err := m.bs.setExposures(ctx, m.o.Name, nil); err != nil {
			return m.fail(ctx, "preparing", err)
		}
	}
	if ctx.Err() != nil {
		return m.fail(ctx, "creating", ctx.Err())
	}
	return nil
}

// createFailed cleans up after a failed create and says why it failed: the interrupt, the
// name taken, the stack missing, or the daemon's own error.
func (m *minting) createFailed(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return m.fail(ctx, "creating", err)
	}
	m.bs.discard(m.o.Name, m.token)
	m.unbindPlanned()
	if errors.Is(err, incus.ErrConflict) || m.bs.heldByOther(m.o.Name, m.token) {
		return Usagef("new: an instance named %s already exists: pick another --name", m.o.Name)
	}
	if serr := m.bs.checkStack(ctx); serr != nil {
		return serr
	}
	return fmt.Errorf("new: creating %s: %w", m.o.Name, err)
}

// start starts the instance, then binds its port in the background: the bind overlaps the
// first boot's wait, and firstBoot waits for its outcome on the returned channel. (Binding
// while the start was still under way made a start fail once in a purged CI run: LXC's
// pre-start hook timed out after 30 s while the bind read the starting instance's state.)
func (m *minting) start(ctx context.Context, at string) (<-chan error, error) {
	elsewhere, err := m.bs.startedElsewhere(ctx, at)
	if err != nil {
		return nil, m.fail(ctx, "starting", err)
	}
	if elsewhere != "" {
		if err := m.bs.agentReady(ctx, m.o.Name, elsewhere); err != nil {
			return nil, m.fail(ctx, "starting", fmt.Errorf("new: %w", err)) // removed, never started
		}
		m.progress(Progress{Stage: "start", Percent: -1, Text: "starting " + m.o.Name + " on cluster member " + elsewhere})
	} else {
		m.progress(Progress{Stage: "start", Percent: -1, Text: "starting " + m.o.Name})
	}
	// The start is awaited even when ctx ends meanwhile (a start takes a second): the
	// instance is then removed from a known state rather than mid-start.
	sctx, scancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Minute)
	if elsewhere == "" {
		m.bs.clearStalePort(m.o.Name)
	}
	err = m.bs.Client.SetState(sctx, m.o.Name, "start", false, 0)
	scancel()
	if err != nil {
		return nil, m.fail(ctx, "starting", fmt.Errorf("new: starting %s: %w", m.o.Name, err))
	}
	if ctx.Err() != nil {
		return nil, m.fail(ctx, "starting", ctx.Err())
	}
	if !strings.HasSuffix(m.token, mintMadeAtStart) { // finish drops the marker
		m.readAhead = m.bs.readAhead(ctx, m.o.Name)
	}
	bound := make(chan error, 1)
	if elsewhere != "" {
		go func() { bound <- m.bs.awaitBound(ctx, m.o.Name, elsewhere) }()
	} else {
		pre := m.pre
		m.pre = nil // completeBind has it
		go func() { bound <- m.bs.completeBind(ctx, m.o.Name, pre) }()
	}
	return bound, nil
}

// location is the member the new instance landed on: target when one was asked for, else
// where Incus placed it ("" on a standalone daemon).
func (m *minting) location(ctx context.Context, target string) (string, error) {
	if target != "" || m.bs.Client.Remote() != "local" {
		return target, nil
	}
	if local, err := localMember(ctx, m.bs.Client); err != nil || local == "" {
		return "", err
	}
	in, _, err := m.bs.Client.Instance(ctx, m.o.Name)
	if err != nil {
		return "", m.fail(ctx, "creating", fmt.Errorf("new: reading where %s was placed: %w", m.o.Name, err))
	}
	return in.Location, nil
}

// firstBoot waits for cloud-init when asked to, and for the port's binding. A failed first
// boot is cleaned up unless KeepFailed says to keep the box; an interrupt and a failed
// binding are cleaned up regardless.
func (m *minting) firstBoot(ctx context.Context, box *Box, launched time.Time, bound <-chan error) error {
	o := m.o
	bindFailed := func() error {
		if err := <-bound; err != nil {
			return m.fail(ctx, "binding the port of", fmt.Errorf("new: %w", err))
		}
		return nil
	}
	if o.FirstBoot == nil {
		return bindFailed()
	}
	text := firstBootText(o.Name, box.Instance.Config[TagTemplate])
	if o.FirstBoot.Baked {
		text = "waiting for the lease of " + o.Name + " (from a bake: no first boot to run)"
	}
	m.progress(Progress{Stage: "first boot", Percent: -1, Text: text})
	ran, err := m.bs.waitFirstBoot(ctx, box, *o.FirstBoot)
	if berr := bindFailed(); berr != nil {
		return berr
	}
	if err != nil {
		if ctx.Err() != nil || !o.KeepFailed {
			return m.fail(ctx, "waiting for the first boot of", err)
		}
		return fmt.Errorf("%w\n(kept for inspection: claudebox shell %s; remove with claudebox rm %s --force)", err, o.Name, o.Name)
	}
	if o.Timings != nil {
		o.Timings.FirstBoot = time.Since(launched)
		if ran { // a bake's install record is the bake's, not this box's; no template, none
			o.Timings.ClaudeInstall = m.bs.claudeInstallTime(ctx, o.Name)
		}
	}
	return nil
}

// finish drops the mint marker. From here the box is a box like any other.
func (m *minting) finish(ctx context.Context) error {
	if ctx.Err() != nil {
		return m.fail(ctx, "finishing", ctx.Err())
	}
	if err := m.bs.finishMint(ctx, m.o.Name, m.token, m.readAhead); err != nil {
		return m.fail(ctx, "finishing", err)
	}
	return nil
}

// create sends the create request and waits for its operation. The request itself is sent
// with a context that does not end with ctx (a POST cut off mid-flight may still create the
// instance, with no operation id to follow). When ctx ends during the wait, the operation is
// cancelled if the daemon allows it, and awaited either way, so that the instance is removed
// only once nothing is still making it.
func (bs *Boxes) create(ctx context.Context, req incus.InstancesPost, progress func(incus.ProgressEvent)) error {
	pctx, pcancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
	id, err := bs.Client.StartCreateInstance(pctx, req)
	pcancel()
	if err != nil || id == "" {
		return err
	}
	err = bs.awaitOrCancel(ctx, id, progress)
	var se *incus.StatusError
	if ctx.Err() == nil && errors.As(err, &se) && se.Operation == "" && errors.Is(err, incus.ErrNotFound) {
		// The wait found no such operation: once in about 90 creates in the bench (Incus
		// 6.0.4; the cause is not known). The daemon keeps an operation on record from its
		// creation until 5 s after it ends, so this create has ended: what it made says how.
		if in, _, gerr := bs.Client.Instance(ctx, req.Name); gerr == nil && in.Config[tagMint] == req.Config[tagMint] {
			return nil
		}
	}
	return err
}

// awaitOrCancel waits for a creating operation (a create, an import). When ctx ends first,
// it cancels the operation if the daemon allows it and waits for it either way, so whatever
// removes the half-made instance afterwards runs only once nothing is still making it.
func (bs *Boxes) awaitOrCancel(ctx context.Context, id string, progress func(incus.ProgressEvent)) error {
	_, err := bs.Client.WaitOperation(ctx, id, progress)
	if ctx.Err() == nil {
		return err
	}
	wctx, wcancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer wcancel()
	_ = bs.Client.CancelOperation(wctx, id)
	_, _ = bs.Client.WaitOperation(wctx, id, nil)
	return ctx.Err()
}

// finishMint drops the mint marker of this call's box, in one PATCH conditional on the read
// that finds the marker still this call's. ahead, when not nil, is that read made earlier
// (beside the port's binding, off new's critical path); should the box have changed since,
// it is read again.
func (bs *Boxes) finishMint(ctx context.Context, name, token string, ahead <-chan instanceRead) error {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
	defer cancel()
	for again := false; ; again = true {
		var r instanceRead
		if ahead != nil && !again {
			r = <-ahead
		} else {
			r.in, r.etag, r.err = bs.Client.Instance(ctx, name)
		}
		if r.err != nil {
			return fmt.Errorf("new: finishing %s: %w", name, r.err)
		}
		if r.in.Config[tagMint] != token {
			return fmt.Errorf("new: finishing %s: the instance is no longer this mint's", name)
		}
		if r.etag == "" { // the PATCH would not be conditional on this read
			if again {
				return fmt.Errorf("new: finishing %s: the daemon gave no ETag", name)
			}
			continue
		}
		err := bs.Client.UnsetInstanceConfig(ctx, name, []string{tagMint}, r.etag)
		if err == nil {
			return nil
		}
		if !incus.IsPreconditionFailed(err) || again {
			return fmt.Errorf("new: finishing %s: %w", name, err)
		}
	}
}

// instanceRead is one read of an instance, with its ETag.
type instanceRead struct {
	in   incus.Instance
	etag string
	err  error
}

// readAhead reads an instance in the background.
func (bs *Boxes) readAhead(ctx context.Context, name string) <-chan instanceRead {
	out := make(chan instanceRead, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
		defer cancel()
		var r instanceRead
		r.in, r.etag, r.err = bs.Client.Instance(ctx, name)
		out <- r
	}()
	return out
}

// InterruptedError says `new` was stopped by its context ending (SIGINT, SIGTERM: the
// Cause), and what became of the half-made box.
type InterruptedError struct {
	Name  string
	Stage string // "creating", "starting", "waiting for the first boot of", ...
	Cause error
	Left  bool // the half-made box could not be removed
}

func (e *InterruptedError) Error() string {
	msg := fmt.Sprintf("new: interrupted (%v) while %s %s", e.Cause, e.Stage, e.Name)
	if e.Left {
		return msg + "; the half-made box could not be removed: claudebox rm " + e.Name + " --force"
	}
	return msg + "; nothing was left behind"
}

func (e *InterruptedError) Unwrap() error { return e.Cause }

// interrupted returns an *InterruptedError when ctx has ended, else nil.
func interrupted(ctx context.Context, name, stage string, left bool) error {
	if ctx.Err() == nil {
		return nil
	}
	return &InterruptedError{Name: name, Stage: stage, Cause: context.Cause(ctx), Left: left}
}

func typeWord(t string) string {
	if t == "virtual-machine" {
		return "VM"
	}
	return t
}

// checkStack refuses to mint onto a host without the isolation stack: a box without its
// profile would be an ordinary, unisolated instance.
func (bs *Boxes) checkStack(ctx context.Context) error {
	if _, _, err := bs.Client.Profile(ctx, bs.Stack.Profile); err != nil {
		if errors.Is(err, incus.ErrNotFound) {
			return fmt.Errorf("the isolation stack is missing (no profile %s): run 'sudo claudebox host init' first", bs.Stack.Profile)
		}
		return err
	}
	return nil
}

// discard deletes a half-made instance of this call, and only that, and returns nil once no
// instance of this call exists. It runs detached from the caller's context, so an interrupted
// `new` still cleans up; an instance still busy with an operation is retried for a while.
func (bs *Boxes) discard(name, token string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var last error
	for attempt := 0; ; attempt++ {
		in, _, err := bs.Client.Instance(ctx, name)
		if errors.Is(err, incus.ErrNotFound) {
			return nil
		}
		if err == nil && in.Config[tagMint] != token {
			return nil // not ours (a racing mint's, or anything else): never touched
		}
		if err == nil {
			if in.Status != "Stopped" {
				_ = bs.Client.SetState(ctx, name, "stop", true, 0)
			}
			err = bs.Client.DeleteInstance(ctx, name)
			if err == nil || errors.Is(err, incus.ErrNotFound) {
				bs.clearStalePort(name)
				return nil
			}
		}
		last = err
		select {
		case <-ctx.Done():
			return last
		case <-time.After(time.Duration(attempt+1) * 250 * time.Millisecond):
		}
	}
}

// heldByOther reports whether the name is taken by an instance this call did not make: a
// racing `new` (the daemon then says "busy running a create operation"), or anything else.
func (bs *Boxes) heldByOther(name, token string) bool {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	in, _, err := bs.Client.Instance(ctx, name)
	return err == nil && in.Config[tagMint] != token
}

// lockMint takes this host's lock on minting a name (per remote), without waiting: a second
// `new` of the same name is told at once. The lock lives in /run/lock (a tmpfs, sticky and
// world-writable) and dies with the process. Where no lock can be taken, the daemon's own
// name check is what remains.
func lockMint(remote, name string) (func(), error) {
	dir := "/run/lock"
	if st, err := os.Stat(dir); err != nil || !st.IsDir() {
		dir = os.TempDir()
	}
	if remote == "" {
		remote = "local"
	}
	path := filepath.Join(dir, "claudebox-new-"+strings.Map(func(r rune) rune {
		if r == '/' || r == ':' {
			return '_'
		}
		return r
	}, remote)+"-"+name+".lock")
	// Not O_CREAT on a file someone else made: fs.protected_regular forbids that in sticky
	// directories.
	f, err := os.Open(path)
	if errors.Is(err, os.ErrNotExist) {
		f, err = os.OpenFile(path, os.O_CREATE|os.O_EXCL|os.O_RDONLY, 0o644)
		if errors.Is(err, os.ErrExist) {
			f, err = os.Open(path)
		}
	}
	if err != nil {
		return func() {}, nil
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		f.Close()
		if errors.Is(err, syscall.EWOULDBLOCK) {
			return nil, Usagef("new: another 'claudebox new' is making %s right now: pick another --name (or wait for it: claudebox list)", name)
		}
		return func() {}, nil
	}
	return func() { _ = syscall.Flock(int(f.Fd()), syscall.LOCK_UN); f.Close() }, nil
}

func (bs *Boxes) resetMachineID(ctx context.Context, name string) error {
	if _, err := bs.Client.PullFile(ctx, name, "/etc/machine-id"); err != nil {
		if errors.Is(err, incus.ErrNotFound) {
			return nil // an image without systemd has none
		}
		return fmt.Errorf("new: reading the clone's machine-id: %w", err)
	}
	// A new random id, not an empty file: an empty one makes systemd treat the boot as the
	// first (ConditionFirstBoot units, preset-all over what the box's user enabled) and
	// costs the clone's first start time; a clone is not a first boot.
	id := make([]byte, 16)
	if _, err := rand.Read(id); err != nil {
		return err
	}
	if err := bs.Client.PushFile(ctx, name, "/etc/machine-id", strings.NewReader(hex.EncodeToString(id)+"\n"), 0o444, 0, 0); err != nil {
		return fmt.Errorf("new: resetting the clone's machine-id: %w", err)
	}
	return nil
}

// ParseFrom splits --from SRC[/SNAP].
func ParseFrom(from string) (src, snap string, err error) {
	src, snap, hasSnap := strings.Cut(from, "/")
	if src == "" || (hasSnap && (snap == "" || strings.Contains(snap, "/"))) {
		return "", "", Usagef("new: --from %q: want a box, or a box and one of its snapshots: --from BOX or --from BOX/SNAP (e.g. --from work/authed)", from)
	}
	return src, snap, nil
}

// resolveSource resolves --from SRC[/SNAP]: the source must be a box, the snapshot must exist,
// and what the clone would inherit — the snapshot's config and devices when a snapshot is
// named, not the live box's — must be what claudebox itself puts on a box.
func (bs *Boxes) resolveSource(ctx context.Context, from string) (*Box, string, error) {
	name, snap, err := ParseFrom(from)
	if err != nil {
		return nil, "", err
	}
	src, err := Resolve(ctx, bs.Client, name)
	if err != nil {
		return nil, "", err
	}
	if Minting(src.Instance.Config) {
		return nil, "", Usagef("new --from %s: %s is still being minted (or its mint died): clone a finished box", from, src.Name)
	}
	cfg, devices := src.Instance.Config, src.Instance.Devices
	if snap != "" {
		s, err := bs.FindSnapshot(ctx, src, snap)
		if err != nil {
			return nil, "", err
		}
		cfg, devices = s.Config, s.Devices
		if Minting(cfg) { // taken while the box was still being made
			return nil, "", Usagef("new --from %s: the snapshot was taken while %s was still being minted: clone a snapshot of the finished box", from, src.Name)
		}
	}
	s := bs.Stack
	if s.MaxDisk == 0 {
		s.MaxDisk, _ = bs.DiskCap(ctx) // unreadable: 0, no cap (the daemon's own checks hold)
	}
	if off := OffBoundary(cfg, devices, s); len(off) > 0 {
		return nil, "", Usagef("new --from %s: the source carries what claudebox never puts on a box, so a clone would inherit a hole:\n  %s\nnothing was created. Clone a box (or snapshot) without them; on a live box, remove them with 'claudebox incus %s -- config unset {} KEY' or '... config device remove {} DEVICE'",
			from, strings.Join(off, "\n  "), src.Name)
	}
	src.Instance.Config, src.Instance.Devices = cfg, devices
	return src, snap, nil
}

// FindSnapshot returns a box's snapshot by name, or "no snapshot" as a usage error.
func (bs *Boxes) FindSnapshot(ctx context.Context, b *Box, snap string) (incus.Snapshot, error) {
	snaps, err := bs.Client.Snapshots(ctx, b.Name)
	if err != nil {
		return incus.Snapshot{}, err
	}
	names := make([]string, 0, len(snaps))
	for _, s := range snaps {
		if s.Name == snap {
			return s, nil
		}
		names = append(names, s.Name)
	}
	have := "it has none"
	if len(names) > 0 {
		have = "it has: " + strings.Join(names, ", ")
	}
	return incus.Snapshot{}, Usagef("box %s has no snapshot %q (%s)", b.Name, snap, have)
}

// claudeInstallTime reads the install record the claude template leaves in the box.
func (bs *Boxes) claudeInstallTime(ctx context.Context, name string) time.Duration {
	res, err := bs.Client.Exec(ctx, name, incus.ExecRequest{Command: []string{"cat", templates.InstallRecord}})
	if err != nil || res.ExitCode != 0 {
		return 0
	}
	var rec struct {
		Seconds float64 `json:"seconds"`
	}
	if json.Unmarshal(res.Stdout, &rec) != nil {
		return 0
	}
	return time.Duration(rec.Seconds * float64(time.Second))
}

func randomToken() string {
	b := make([]byte, 8)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// bindPorts binds the running boxes' bridge ports to their MAC and address (claudebox's own
// anti-spoofing layer beside Incus's NIC filtering). Incus gives a box a new veth on every
// start, so every verb that starts one calls it. On a remote daemon the kernel is not ours:
// that host's own `claudebox host init` (and its boot unit) binds its boxes.
//
// box is the box the verb is about ("" for none: rm). A port of another box that cannot be
// pinned this moment (a sibling's veth not yet on the bridge, or one rebooting itself) is
// that box's verb's error or the agent's next round, not this verb's: a purged CI run had a
// `new` fail on a sibling's port.
func (bs *Boxes) bindPorts(ctx context.Context, box string) error {
	if bs.Client.Remote() != "local" {
		return nil
	}
	if os.Geteuid() != 0 {
		return ErrBindNeedsRoot // before the network's lock, which needs root too
	}
	since := time.Now() // the verb's change is made: a round that reads after now includes it
	if !bs.HostLocked {
		// A drill holds its network's lock while it has layers switched off: a re-apply now
		// would undo its seeded hole. Wait for it.
		unlock, err := bs.lockNetwork(ctx)
		if err != nil {
			return err
		}
		defer unlock()
	}
	st, err := NewHost(bs.Client, bs.Stack).bindPorts(ctx, since)
	return ownBindError(st, box, err)
}

// ownBindError is what of a bind round's err is box's: all of it unless every failure is a
// port pin (st then says which box each port is), else the pins of box's own ports.
func ownBindError(st *StackState, box string, err error) error {
	if st != nil && box != "" {
		// A NIC that shares its address or MAC is left unbound with the other: the verb
		// says so rather than leave the box running without its binding unremarked.
		for _, n := range st.NICs {
			if n.Box == box && strings.HasPrefix(n.Problem, problemShared) {
				return errors.Join(fmt.Errorf("%s %s cannot be bound: it %s", box, n.Device, n.Problem), err)
			}
		}
	}
	failed := unpinned(err)
	if err == nil || st == nil || len(failed) == 0 {
		return err
	}
	var own []string
	for _, n := range st.NICs {
		if box != "" && n.Box == box && failed[n.Binding.Port] {
			own = append(own, n.Device+" (port "+n.Binding.Port+")")
		}
	}
	if len(own) > 0 {
		return fmt.Errorf("%s %s could not be pinned: %w", box, strings.Join(own, ", "), err)
	}
	return nil
}

// verbLockWait is how long a box verb waits for its network's lock: a drill holds it for its
// whole run (a minute or two), and eight verbs binding at once queue behind each other.
const verbLockWait = 5 * time.Minute

// lockNetwork takes the network's lock for a verb, saying so (Warn) when it has to wait.
func (bs *Boxes) lockNetwork(ctx context.Context) (func(), error) {
	path := netLockPath(bs.Stack.Network)
	unlock, err := lockFile(ctx, path, 2*time.Second)
	var held *HostLockedError
	if !errors.As(err, &held) {
		return unlock, err
	}
	if bs.Warn != nil {
		bs.Warn(fmt.Sprintf("waiting for %s (held by %s: a drill, host init or other boxes binding)", path, cmp.Or(held.Holder, "another process")))
	}
	return lockFile(ctx, path, verbLockWait)
}
