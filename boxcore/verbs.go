package boxcore

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"regexp"
	"sort"
	"strings"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/claudebox/claudebox/boxcore/incus"
)

// ResolveImage turns an image ref into an instance source: "ALIAS" is a local alias,
// "REMOTE:ALIAS" an image on a remote from the incus CLI's config (plus the built-in
// "images" simplestreams server).
func ResolveImage(ref string) (incus.InstanceSource, error) {
	if ref == "" {
		return incus.InstanceSource{}, Usagef("new: no image: pass --image REF (e.g. images:debian/12/cloud)")
	}
	remote, alias, ok := strings.Cut(ref, ":")
	if !ok {
		return incus.InstanceSource{Type: "image", Alias: ref}, nil
	}
	if remote == "" || alias == "" {
		return incus.InstanceSource{}, Usagef("new: invalid image ref %q: want ALIAS or REMOTE:ALIAS", ref)
	}
	addr, protocol, err := incus.ImageRemote(remote)
	if err != nil {
		return incus.InstanceSource{}, &UsageError{Msg: "new: " + err.Error()}
	}
	return incus.InstanceSource{Type: "image", Alias: alias, Server: addr, Protocol: protocol, Mode: "pull"}, nil
}

// Summary is a box as `list` shows it.
type Summary struct {
	Name      string    `json:"name" yaml:"name"`
	State     string    `json:"state" yaml:"state"`
	Type      string    `json:"type" yaml:"type"`
	IPv4      []string  `json:"ipv4" yaml:"ipv4"`           // plain: "10.87.0.10"
	Addresses []Address `json:"addresses" yaml:"addresses"` // every address, with its interface
	Snapshots int       `json:"snapshots" yaml:"snapshots"`
	Created   time.Time `json:"created" yaml:"created"` // UTC
	// Member is the cluster member the box lives on; empty on a standalone daemon.
	Member string `json:"member,omitempty" yaml:"member,omitempty"`
	// Limits are the box's effective limits (its own over its profile's).
	Limits BoxLimits `json:"limits" yaml:"limits"`
}

// List returns every box. One filtered request with state (recursion=2) finds the boxes. Incus
// leaves out of that answer — or reports with an empty config — an instance in the middle of
// a state change (measured on 6.0.4: it collects the state and fails). A second request,
// run alongside, lists every instance without state (recursion=1, which shows the config even
// then); a box found only there is listed with its status and whatever state it gives, so
// a box that is starting or stopping is shown instead of vanishing.
func (bs *Boxes) List(ctx context.Context) ([]Summary, error) {
	var all []incus.Instance
	var allErr error
	done := make(chan struct{})
	go func() {
		defer close(done)
		all, allErr = bs.Client.Instances(ctx, nil, false)
	}()
	insts, err := bs.Client.Instances(ctx, map[string]string{TagKey: "1"}, true)
	<-done
	if err != nil {
		return nil, err
	}
	out := make([]Summary, 0, len(insts))
	seen := map[string]bool{}
	for _, in := range insts {
		if !IsBox(in) { // the server filtered; this guards a daemon that ignored the filter
			continue
		}
		seen[in.Name] = true
		out = append(out, summarize(in))
	}
	if allErr == nil {
		for _, in := range all {
			if seen[in.Name] || !IsBox(in) {
				continue
			}
			if st, err := bs.Client.InstanceState(ctx, in.Name); err == nil {
				in.State = &st
			}
			out = append(out, summarize(in))
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, nil
}

// StateMinting is the state list and info show for a box whose `new` has not finished (or
// died before it could clean up): never a ready box.
const StateMinting = "MINTING"

// Address is one address of a box, each part in its own field.
type Address struct {
	Interface string `json:"interface" yaml:"interface"`
	Family    string `json:"family" yaml:"family"` // inet, inet6
	Address   string `json:"address" yaml:"address"`
	Netmask   string `json:"netmask" yaml:"netmask"`
	Scope     string `json:"scope" yaml:"scope"`
}

func summarize(in incus.Instance) Summary {
	s := Summary{Name: in.Name, State: strings.ToUpper(in.Status), Type: in.Type, Snapshots: len(in.Snapshots), Created: in.CreatedAt.UTC(), IPv4: []string{}, Addresses: []Address{}, Limits: LimitsOf(in)}
	if Minting(in.Config) {
		s.State = StateMinting
	}
	if in.Location != "none" { // a standalone daemon says "none"
		s.Member = in.Location
	}
	if in.State != nil {
		s.IPv4, s.Addresses = addresses(*in.State)
	}
	return s
}

// addresses are a state's addresses (loopback left out): the IPv4 ones plain, and all of them
// with their interface.
func addresses(st incus.InstanceState) (ipv4 []string, all []Address) {
	ipv4, all = []string{}, []Address{}
	for _, iface := range sortedKeys(st.Network) {
		if iface == "lo" {
			continue
		}
		for _, a := range st.Network[iface].Addresses {
			if a.Family == "inet" {
				ipv4 = append(ipv4, a.Address)
			}
			all = append(all, Address{Interface: iface, Family: a.Family, Address: a.Address, Netmask: a.Netmask, Scope: a.Scope})
		}
	}
	return ipv4, all
}

// Info is what `info` shows of a box.
// It is flat in every format: the Summary's fields sit beside its own.
type Info struct {
	Summary    `yaml:",inline"`
	Provenance map[string]string `json:"provenance" yaml:"provenance"`
	Profiles   []string          `json:"profiles" yaml:"profiles"`
	Snapshots  []incus.Snapshot  `json:"snapshot_list" yaml:"snapshot_list"`
	CloneLine  string            `json:"clone_command" yaml:"clone_command"`
	Exposures  []Exposure        `json:"exposures" yaml:"exposures"`
}

// Info reads a box's state, addresses, provenance and snapshots.
func (bs *Boxes) Info(ctx context.Context, b *Box) (Info, error) {
	st, err := bs.Client.InstanceState(ctx, b.Name)
	if err != nil {
		return Info{}, err
	}
	snaps, err := bs.Client.Snapshots(ctx, b.Name)
	if err != nil {
		return Info{}, err
	}
	in := b.Instance
	in.State, in.Snapshots = &st, snaps
	for i := range snaps {
		snaps[i].CreatedAt = snaps[i].CreatedAt.UTC()
	}
	info := Info{Summary: summarize(in), Provenance: map[string]string{}, Profiles: in.Profiles, Snapshots: snaps,
		Exposures: Exposures(in.Devices)}
	for k, v := range in.Config {
		if strings.HasPrefix(k, "user.claudebox.") && k != tagMint {
			info.Provenance[strings.TrimPrefix(k, "user.claudebox.")] = v
		}
	}
	from := b.Name
	if len(snaps) > 0 {
		latest := snaps[0]
		for _, s := range snaps {
			if s.CreatedAt.After(latest.CreatedAt) {
				latest = s
			}
		}
		from += "/" + latest.Name
	}
	info.CloneLine = fmt.Sprintf("claudebox new --name %s-2 --from %s", b.Name, from)
	return info, nil
}

// Start starts a box (already running is fine).
func (bs *Boxes) Start(ctx context.Context, b *Box) error {
	if b.Instance.Status == "Running" {
		return nil
	}
	if Minting(b.Instance.Config) {
		// While its `new` runs (it holds the name's lock) a start would race it. Once that
		// `new` is gone, a box made once started would be called made by a start (its marker
		// ends there): it was never finished. Any other such box (kept by --keep-failed, or
		// left by a killed new) may start, and still shows as MINTING.
		unlock, err := lockMint(bs.Client.Remote(), b.Name)
		if err != nil {
			return Usagef("start: %s is still being minted by a 'claudebox new' running now: wait for it", b.Name)
		}
		defer unlock()
		if strings.HasSuffix(b.Instance.Config[tagMint], mintMadeAtStart) {
			return Usagef("start: %s is still being minted (its new died before starting it): remove it with: claudebox rm %s --force", b.Name, b.Name)
		}
	}
	if bs.Warn != nil {
		if w := bs.MemoryBudgetWarning(ctx, b.Name, LimitsOf(b.Instance).Memory); w != "" {
			bs.Warn(w)
		}
	}
	return bs.startBound(ctx, b.Name, b.Instance.Location)
}

// startBound starts a stopped box and returns once its port is bound: here by binding it,
// on another cluster member (at) by waiting for that member's agent. A box the agent did not
// bind in time is stopped again: it does not run with its port's layers missing.
func (bs *Boxes) startBound(ctx context.Context, name, at string) error {
	elsewhere, err := bs.startedElsewhere(ctx, at)
	if err != nil {
		return err
	}
	if elsewhere == "" {
		bs.clearStalePort(name)
	} else if err := bs.agentReady(ctx, name, elsewhere); err != nil {
		return err // nothing started
	}
	// The start and the bind are not cut short by an interrupt: a box Incus is starting
	// is bound (or, elsewhere, stopped again) rather than left running unbound.
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Minute)
	defer cancel()
	if err := bs.Client.SetState(sctx, name, "start", false, 0); err != nil {
		return err
	}
	if elsewhere == "" {
		return bs.bindPorts(sctx, name)
	}
	if err := bs.awaitBound(ctx, name, elsewhere); err != nil {
		kctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
		defer cancel()
		if kerr := bs.kill(kctx, name); kerr != nil {
			return fmt.Errorf("%w (and stopping it again: %v)", err, kerr)
		}
		return fmt.Errorf("%w; stopped it again", err)
	}
	return nil
}

// kill stops a running box at once (restore and rm discard its state anyway); one that
// stopped meanwhile is no error.
func (bs *Boxes) kill(ctx context.Context, name string) error {
	err := whileBusy(ctx, func() error { return bs.Client.SetState(ctx, name, "stop", true, 0) })
	if err != nil && !strings.Contains(err.Error(), "already stopped") {
		return err
	}
	return nil
}

// busyWait bounds whileBusy: the daemon drops an operation's lock within its own 30 s
// timeout at the latest.
const busyWait = 35 * time.Second

// whileBusy runs call until the daemon stops answering that the instance is busy running
// another operation (an update a killed client left in flight, a racing verb's start), for
// at most busyWait.
func whileBusy(ctx context.Context, call func() error) error {
	deadline := time.Now().Add(busyWait)
	for {
		err := call()
		if !errors.Is(err, incus.ErrBusy) || time.Now().After(deadline) {
			return err
		}
		select {
		case <-ctx.Done():
			return err
		case <-time.After(250 * time.Millisecond):
		}
	}
}

// DefaultStopGrace is how long Stop waits for a clean shutdown before it kills the box.
const DefaultStopGrace = 30 * time.Second

// Stop stops a box; kill skips the clean shutdown. A box that has not shut down cleanly
// within its grace (StopGrace, else DefaultStopGrace) is killed, as docker stop does, and
// Warn says so: an init that has not yet set up its signal handlers, just after a start,
// never sees the shutdown signal, and a stop that gives up leaves the box running.
func (bs *Boxes) Stop(ctx context.Context, b *Box, kill bool) error {
	if b.Instance.Status == "Stopped" {
		return nil
	}
	if kill {
		return bs.kill(ctx, b.Name)
	}
	grace := cmp.Or(bs.StopGrace, DefaultStopGrace)
	err := whileBusy(ctx, func() error { return bs.Client.SetState(ctx, b.Name, "stop", false, grace) })
	if err == nil || strings.Contains(err.Error(), "already stopped") {
		return nil
	}
	in, _, ierr := bs.Client.Instance(ctx, b.Name)
	if ierr != nil || in.Status != "Running" {
		return err // not a shutdown that ran out of time: say what failed
	}
	if kerr := bs.kill(ctx, b.Name); kerr != nil {
		return fmt.Errorf("%w; and killing it: %v", err, kerr)
	}
	if bs.Warn != nil {
		bs.Warn(fmt.Sprintf("%s did not shut down within %s: killed it", b.Name, grace))
	}
	return nil
}

var snapRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$`)

// Snapshot checkpoints a box; an empty label becomes a time-based one. It returns the label.
func (bs *Boxes) Snapshot(ctx context.Context, b *Box, label string) (string, error) {
	if label == "" {
		// The time to the second, and a random suffix: two snapshots within one second
		// (or from two processes) never collide.
		label = "snap-" + time.Now().UTC().Format("20060102-150405") + "-" + randomToken()[:6]
	}
	if !snapRE.MatchString(label) {
		return "", Usagef("snapshot: invalid label %q: letters, digits, '.', '_' and '-', up to 63", label)
	}
	if _, err := bs.FindSnapshot(ctx, b, label); err == nil {
		return "", Usagef("snapshot: box %s already has a snapshot %q", b.Name, label)
	}
	if err := bs.Client.CreateSnapshot(ctx, b.Name, label); err != nil {
		if errors.Is(err, incus.ErrConflict) {
			return "", Usagef("snapshot: box %s already has a snapshot %q", b.Name, label)
		}
		return "", err
	}
	return label, nil
}

// Restore rolls a box back to a snapshot. Exposures are not a snapshot's to give back: the
// box keeps the ones it has now (an imported box's snapshots still hold its old host's). So a
// running box is stopped first, restored stopped, given its own exposures back, then started:
// a snapshot's exposure never listens, not even for the moment a restore restarts the box.
func (bs *Boxes) Restore(ctx context.Context, b *Box, snap string) error {
	if _, err := bs.FindSnapshot(ctx, b, snap); err != nil {
		return err
	}
	in, _, err := bs.Client.Instance(ctx, b.Name)
	if err != nil {
		return err
	}
	running := in.Status != "Stopped"
	if running {
		if elsewhere, err := bs.startedElsewhere(ctx, in.Location); err != nil {
			return err
		} else if elsewhere != "" {
			if err := bs.agentReady(ctx, b.Name, elsewhere); err != nil {
				return err // it could not be started again there: nothing is changed
			}
		}
		if err := bs.kill(ctx, b.Name); err != nil {
			return err
		}
	}
	if err := bs.Client.RestoreSnapshot(ctx, b.Name, snap); err != nil {
		return err
	}
	if err := bs.setExposures(ctx, b.Name, Exposures(in.Devices)); err != nil {
		return err
	}
	if running {
		// The restarted box's port is a new one; the guard follows the exposures.
		return bs.startBound(ctx, b.Name, in.Location)
	}
	return bs.bindPorts(ctx, b.Name)
}

// Rename renames a stopped box.
func (bs *Boxes) Rename(ctx context.Context, b *Box, newName string) error {
	if err := ValidateName(newName); err != nil {
		return err
	}
	if b.Running() {
		return Usagef("box '%s' is running — stop it first: claudebox stop %s", b.Name, b.Name)
	}
	if _, _, err := bs.Client.Instance(ctx, newName); err == nil {
		return Usagef("rename: an instance named %s already exists", newName)
	} else if !errors.Is(err, incus.ErrNotFound) {
		return err
	}
	if err := bs.Client.RenameInstance(ctx, b.Name, newName); err != nil {
		if errors.Is(err, incus.ErrConflict) {
			return Usagef("rename: an instance named %s already exists", newName)
		}
		return err
	}
	return bs.renamePort(ctx, b.Name, newName)
}

// renamePort gives a renamed box's NIC the port name of its new name. Kept, the old name's
// port would be the renamed box's: a later box of the old name would start on it (removing
// the renamed box's veth as a stale one) and be taken for bound while the port's rules still
// named the renamed box's MAC and address.
func (bs *Boxes) renamePort(ctx context.Context, oldName, newName string) error {
	in, etag, err := bs.Client.Instance(ctx, newName)
	if err != nil {
		return fmt.Errorf("rename: renamed to %s, but reading it: %w", newName, err)
	}
	eth0, ok := in.Devices["eth0"]
	if !ok || eth0["host_name"] != HostName(oldName) {
		return nil
	}
	eth0["host_name"] = HostName(newName)
	if err := bs.Client.UpdateInstance(ctx, newName, in.Writable(), etag); err != nil {
		return fmt.Errorf("rename: renamed to %s, but renaming its port: %w", newName, err)
	}
	return nil
}

// Remove deletes a box and its snapshots, stopping it first, then unbinds its port and drops
// its exposures' guard rules (without root that waits for the next bind or host init: the
// stale rules only block more).
func (bs *Boxes) Remove(ctx context.Context, b *Box) error {
	if err := bs.Discard(ctx, b); err != nil {
		return err
	}
	if err := bs.bindPorts(ctx, ""); err != nil && !errors.Is(err, ErrBindNeedsRoot) {
		return fmt.Errorf("rm %s: the box is gone, but re-binding the ports: %w", b.Name, err)
	}
	return nil
}

// Discard deletes a box's instance (killed first when running) and leaves the host's port
// bindings as they are: for a caller that removes a batch and converges once after it (the
// drill). An instance still busy with another operation (one a killed client left running)
// is tried again until the daemon lets it go.
func (bs *Boxes) Discard(ctx context.Context, b *Box) error {
	if b.Instance.Status != "Stopped" {
		if err := bs.kill(ctx, b.Name); err != nil {
			return err
		}
	}
	return whileBusy(ctx, func() error { return bs.Client.DeleteInstance(ctx, b.Name) })
}

// clearStalePort removes a leftover veth carrying the box's fixed port name (HostName): Incus
// leaves it behind when a start fails after creating it, and would then refuse every later
// start ("File exists"). Nothing else uses the name, and the box is not running when this is
// called (before a start, after a removal). Only for the local daemon; errors are ignored
// (without root the start reports the real problem).
func (bs *Boxes) clearStalePort(box string) {
	if r := bs.Client.Remote(); r != "local" && r != "" {
		return
	}
	if l, err := netlink.LinkByName(HostName(box)); err == nil && l.Type() == "veth" {
		_ = netlink.LinkDel(l)
	}
}
