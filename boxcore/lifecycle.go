package boxcore

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"strings"
	"time"

	"github.com/claudebox/claudebox/boxcore/incus"
	"github.com/claudebox/claudebox/boxcore/templates"
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
)

// Boxes works on the boxes of one daemon, on one stack.
type Boxes struct {
	Client  *incus.Client
	Stack   Stack
	Version string // recorded on every new box
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

// New mints a box: image or clone, profile exactly [stack profile], tags, started. Whatever
// fails, no half-made instance of this call is left behind.
func (bs *Boxes) New(ctx context.Context, o NewOptions) (*Box, error) {
	if err := ValidateName(o.Name); err != nil {
		return nil, err
	}
	if o.From != "" && (o.Image != "" || o.CPU != "" || o.Memory != "" || o.Disk != "") {
		return nil, Usagef("new: --from copies a box whole; it does not take --image, --template, --cpu, --memory or --disk")
	}
	// Neither the stack nor a free name is checked up front: the create fails on either, and
	// its failure is explained below. Every round trip counts in a verb typed all day.

	token := randomToken()
	now := time.Now().UTC().Format(time.RFC3339)
	cfg := map[string]string{
		TagKey:     "1",
		TagCreated: now,
		TagVersion: bs.Version,
		tagMint:    token,
	}
	req := incus.InstancesPost{Name: o.Name, Profiles: []string{bs.Stack.Profile}, Type: "container"}
	if o.VM {
		req.Type = "virtual-machine"
	}
	var cloneFrom *Box
	if o.From != "" {
		src, snap, err := bs.resolveSource(ctx, o.From)
		if err != nil {
			return nil, err
		}
		cloneFrom = src
		req.Type = src.Instance.Type
		for k, v := range src.Instance.Config {
			// Volatile keys carry the source's MAC addresses and ids: a clone regenerates them.
			if !strings.HasPrefix(k, "volatile.") && !strings.HasPrefix(k, "user.claudebox") && k != "image.architecture" {
				cfg[k] = v
			}
		}
		req.Devices = maps.Clone(src.Instance.Devices)
		source := src.Name
		if snap != "" {
			source += "/" + snap
		}
		req.Source = incus.InstanceSource{Type: "copy", Source: source, InstanceOnly: true}
		cfg[TagOrigin], cfg[TagFrom] = "clone", source
		if t := src.Instance.Config[TagTemplate]; t != "" {
			// A copy gets a new cloud-init instance-id, so cloud-init runs again: wait for it.
			cfg[TagTemplate] = t
			if o.FirstBoot == nil {
				o.FirstBoot = &FirstBoot{Timeout: DefaultFirstBootTimeout}
			}
		}
	} else {
		src, err := ResolveImage(o.Image)
		if err != nil {
			return nil, err
		}
		req.Source = src
		cfg[TagOrigin], cfg[TagFrom] = "fresh", o.Image
		if o.CPU != "" {
			cfg["limits.cpu"] = o.CPU
		}
		if o.Memory != "" {
			cfg["limits.memory"] = o.Memory
		}
		if o.Disk != "" {
			req.Devices = map[string]map[string]string{"root": {"type": "disk", "path": "/", "pool": bs.Stack.Pool, "size": o.Disk}}
		}
	}
	for k, v := range o.Config {
		cfg[k] = v
	}
	req.Config = cfg

	progress := func(p Progress) {
		if o.Progress != nil {
			o.Progress(p)
		}
	}
	started := time.Now()
	progress(Progress{Stage: "create", Percent: -1, Text: "creating " + o.Name})
	var onProgress func(incus.ProgressEvent)
	if o.Progress != nil { // polling for progress costs round trips: only when someone watches
		onProgress = func(ev incus.ProgressEvent) {
			progress(Progress{Stage: "download", Percent: ev.Percent, Text: ev.Text})
		}
	}
	err := bs.Client.CreateInstance(ctx, req, onProgress)
	if err != nil {
		bs.discard(o.Name, token)
		if errors.Is(err, incus.ErrConflict) || bs.heldByOther(o.Name, token) {
			return nil, Usagef("new: an instance named %s already exists: pick another --name", o.Name)
		}
		if serr := bs.checkStack(ctx); serr != nil {
			return nil, serr
		}
		return nil, fmt.Errorf("new: creating %s: %w", o.Name, err)
	}
	if cloneFrom != nil && req.Type == "container" {
		// Same machine-id, same DHCP client id, same lease: reset it so systemd makes a new one.
		if err := bs.resetMachineID(ctx, o.Name); err != nil {
			bs.discard(o.Name, token)
			return nil, err
		}
	}
	progress(Progress{Stage: "start", Percent: -1, Text: "starting " + o.Name})
	if err := bs.Client.SetState(ctx, o.Name, "start", false, 0); err != nil {
		bs.discard(o.Name, token)
		return nil, fmt.Errorf("new: starting %s: %w", o.Name, err)
	}
	// The box as we made it; no need to ask the daemon what it just told us.
	box := &Box{Name: o.Name, Instance: incus.Instance{Name: o.Name, Type: req.Type, Status: "Running", Config: cfg, Profiles: req.Profiles, Devices: req.Devices}}
	launched := time.Now()
	if o.Timings != nil {
		o.Timings.Launch = launched.Sub(started)
	}
	if o.FirstBoot != nil {
		progress(Progress{Stage: "first boot", Percent: -1, Text: "waiting for cloud-init in " + o.Name + " (packages, Claude Code)"})
		if err := bs.WaitFirstBoot(ctx, box, *o.FirstBoot); err != nil {
			if !o.KeepFailed || ctx.Err() != nil {
				bs.discard(o.Name, token)
			} else {
				err = fmt.Errorf("%w\n(kept for inspection: claudebox shell %s; remove with claudebox rm %s --force)", err, o.Name, o.Name)
			}
			return nil, err
		}
		if o.Timings != nil {
			o.Timings.FirstBoot = time.Since(launched)
			o.Timings.ClaudeInstall = bs.claudeInstallTime(ctx, o.Name)
		}
	}
	return box, nil
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

// discard deletes a half-made instance of this call, and only that. It runs detached from the
// caller's context, so an interrupted `new` still cleans up.
func (bs *Boxes) discard(name, token string) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	in, _, err := bs.Client.Instance(ctx, name)
	if err != nil || in.Config[tagMint] != token {
		return
	}
	if in.Status != "Stopped" {
		_ = bs.Client.SetState(ctx, name, "stop", true, 0)
	}
	_ = bs.Client.DeleteInstance(ctx, name)
}

// heldByOther reports whether the name is taken by an instance this call did not make: a
// racing `new` (the daemon then says "busy running a create operation"), or anything else.
func (bs *Boxes) heldByOther(name, token string) bool {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	in, _, err := bs.Client.Instance(ctx, name)
	return err == nil && in.Config[tagMint] != token
}

func (bs *Boxes) resetMachineID(ctx context.Context, name string) error {
	if _, err := bs.Client.PullFile(ctx, name, "/etc/machine-id"); err != nil {
		if errors.Is(err, incus.ErrNotFound) {
			return nil // an image without systemd has none
		}
		return fmt.Errorf("new: reading the clone's machine-id: %w", err)
	}
	if err := bs.Client.PushFile(ctx, name, "/etc/machine-id", strings.NewReader(""), 0o444, 0, 0); err != nil {
		return fmt.Errorf("new: resetting the clone's machine-id: %w", err)
	}
	return nil
}

// resolveSource resolves --from SRC[/SNAP]: the source must be a box, the snapshot must exist,
// and nothing in it may take the clone off the isolation stack.
func (bs *Boxes) resolveSource(ctx context.Context, from string) (*Box, string, error) {
	name, snap, _ := strings.Cut(from, "/")
	src, err := Resolve(ctx, bs.Client, name)
	if err != nil {
		return nil, "", err
	}
	if snap != "" {
		if _, err := bs.FindSnapshot(ctx, src, snap); err != nil {
			return nil, "", err
		}
	}
	if err := bs.cloneable(src); err != nil {
		return nil, "", err
	}
	return src, snap, nil
}

// cloneable refuses sources whose own config or devices would leave the stack: a NIC on
// another network, or any security.* setting. Copying them would clone the hole too.
func (bs *Boxes) cloneable(src *Box) error {
	for k := range src.Instance.Config {
		if strings.HasPrefix(k, "security.") || strings.HasPrefix(k, "raw.") {
			return Usagef("new --from %s: the source sets %s, which changes the isolation; claudebox will not copy it (remove it from the source with 'claudebox incus %s -- config unset {} %s')", src.Name, k, src.Name, k)
		}
	}
	for dev, d := range src.Instance.Devices {
		for k := range d {
			if strings.HasPrefix(k, "security.") {
				return Usagef("new --from %s: device %s sets %s; claudebox will not copy it", src.Name, dev, k)
			}
		}
		if d["type"] == "nic" && d["network"] != bs.Stack.Network {
			return Usagef("new --from %s: device %s attaches to %s, not %s; claudebox will not copy it", src.Name, dev, firstNonEmpty(d["network"], d["parent"], d["nictype"]), bs.Stack.Network)
		}
		if d["type"] == "proxy" || d["type"] == "unix-char" || d["type"] == "unix-block" || d["type"] == "gpu" || d["type"] == "usb" {
			return Usagef("new --from %s: device %s (%s) reaches outside the box; claudebox will not copy it", src.Name, dev, d["type"])
		}
	}
	return nil
}

func firstNonEmpty(s ...string) string {
	for _, x := range s {
		if x != "" {
			return x
		}
	}
	return "?"
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
