package boxcore

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"os"
	"slices"
	"strings"

	"github.com/claudebox/claudebox/boxcore/incus"
	"github.com/claudebox/claudebox/firewall"
)

// TeardownPlan is what teardown will remove, read before anything is touched.
type TeardownPlan struct {
	Boxes    []string // boxes that carry the profile and would lose their network
	Steps    []TeardownStep
	Blocking []string // instances we did not mint that use the stack: never touched, so teardown stops
}

// TeardownKind is what a teardown step removes.
type TeardownKind int

// The teardown steps, in the order they run.
const (
	DeleteProfile TeardownKind = iota + 1
	DeleteNetwork
	DeleteACL
	DeleteTables // claudebox's nftables tables of the network
)

// TeardownStep is one removal: Kind says what ApplyTeardown does, Name names the object.
type TeardownStep struct {
	Kind TeardownKind
	Name string
}

// Change is the step as shown to a person.
func (s TeardownStep) Change() Change {
	switch s.Kind {
	case DeleteProfile:
		return Change{"profile " + s.Name, "delete"}
	case DeleteNetwork:
		return Change{"network " + s.Name, "delete"}
	case DeleteACL:
		return Change{"acl " + s.Name, "delete"}
	case DeleteTables:
		return Change{"nftables", "delete claudebox tables of " + s.Name}
	}
	return Change{fmt.Sprintf("step %d", s.Kind), s.Name}
}

func (s TeardownStep) String() string { return s.Change().String() }

// PlanTeardown reads what teardown would do. Boxes on the stack refuse the teardown unless
// force is set (StackInUseError); instances claudebox did not mint always refuse it
// (ForeignUserError).
func (h *Host) PlanTeardown(ctx context.Context, force bool) (*TeardownPlan, error) {
	s := h.Stack
	p := &TeardownPlan{}
	if err := h.planProfileTeardown(ctx, p); err != nil {
		return nil, err
	}
	if len(p.Blocking) > 0 {
		return nil, &ForeignUserError{Object: "profile " + s.Profile, Instances: p.Blocking}
	}
	if len(p.Boxes) > 0 && !force {
		return nil, &StackInUseError{Boxes: p.Boxes}
	}
	if n, _, err := h.Client.Network(ctx, s.Network); err == nil {
		if direct := directUsers(n.UsedBy, p.Boxes); len(direct) > 0 {
			return nil, &ForeignUserError{Object: "network " + s.Network, Instances: direct}
		}
		p.Steps = append(p.Steps, TeardownStep{DeleteNetwork, s.Network})
	} else if !errors.Is(err, incus.ErrNotFound) {
		return nil, err
	}
	if _, _, err := h.Client.NetworkACL(ctx, s.ACL); err == nil {
		p.Steps = append(p.Steps, TeardownStep{DeleteACL, s.ACL})
	} else if !errors.Is(err, incus.ErrNotFound) {
		return nil, err
	}
	if obs, err := firewall.Read(s.Network); err == nil && anyTable(obs) {
		p.Steps = append(p.Steps, TeardownStep{DeleteTables, s.Network})
	}
	return p, nil
}

// planProfileTeardown sorts the profile's users into boxes and instances we did not mint.
func (h *Host) planProfileTeardown(ctx context.Context, p *TeardownPlan) error {
	s := h.Stack
	_, _, err := h.Client.Profile(ctx, s.Profile)
	if errors.Is(err, incus.ErrNotFound) {
		return nil
	} else if err != nil {
		return err
	}
	insts, err := h.Client.Instances(ctx, nil, false)
	if err != nil {
		return err
	}
	for _, in := range insts {
		if !slices.Contains(in.Profiles, s.Profile) {
			continue
		}
		if in.Config[TagKey] == "1" {
			p.Boxes = append(p.Boxes, in.Name)
		} else {
			p.Blocking = append(p.Blocking, in.Name)
		}
	}
	p.Steps = append(p.Steps, TeardownStep{DeleteProfile, s.Profile})
	return nil
}

// directUsers are the instances in a network's used_by that are not among boxes (they use
// the network directly, not through the profile).
func directUsers(usedBy, boxes []string) []string {
	var out []string
	for _, u := range usedBy {
		if !strings.Contains(u, "/instances/") {
			continue
		}
		name := u[strings.LastIndex(u, "/")+1:]
		if i := strings.IndexByte(name, '?'); i >= 0 {
			name = name[:i]
		}
		if !slices.Contains(boxes, name) {
			out = append(out, name)
		}
	}
	return out
}

// ApplyTeardown removes the stack. Boxes keep their disks: the profile's root device is copied
// into each box before the profile is detached, so only the network is lost.
func (h *Host) ApplyTeardown(ctx context.Context, p *TeardownPlan) ([]Change, error) {
	s := h.Stack
	var subnet *net.IPNet
	if n, _, err := h.Client.Network(ctx, s.Network); err == nil {
		if _, sn, err := net.ParseCIDR(n.Config["ipv4.address"]); err == nil {
			subnet = sn
		}
	}
	// The boot unit first: its agent binds on every box event, and a round that read the
	// network before it went could apply the tables again after they went.
	var done []Change
	if removed, err := h.removeUnit(); err != nil {
		return done, err
	} else if removed {
		done = append(done, Change{"systemd " + s.Unit, "remove"})
	}
	more, err := h.detachBoxes(ctx, p.Boxes)
	done = append(done, more...)
	if err != nil {
		return done, err
	}
	for _, step := range p.Steps {
		var err error
		switch step.Kind {
		case DeleteProfile:
			err = h.Client.DeleteProfile(ctx, step.Name)
		case DeleteNetwork:
			err = h.Client.DeleteNetwork(ctx, step.Name)
		case DeleteACL:
			err = h.Client.DeleteNetworkACL(ctx, step.Name)
		case DeleteTables:
			forgetFullBind(step.Name)
			_, err = firewall.Remove(step.Name)
		default:
			err = fmt.Errorf("unknown teardown step %d", step.Kind)
		}
		if err != nil && !errors.Is(err, incus.ErrNotFound) {
			return done, fmt.Errorf("%s: %w", step.Change().Object, err)
		}
		done = append(done, step.Change())
	}
	if subnet != nil && flapGuardPresent(subnet) {
		if err := removeFlapGuard(subnet); err != nil {
			return done, err
		}
		done = append(done, Change{"route unreachable " + subnet.String(), "remove"})
	}
	// Tables of a stack whose network is already gone still go, and so do its pending NICs
	// and its last round's spec.
	forgetFullBind(s.Network)
	_ = os.RemoveAll(pendingDir(s.Network))
	_ = os.Remove(savedRoundPath(s.Network))
	if removed, err := firewall.Remove(s.Network); err == nil && removed {
		done = append(done, TeardownStep{DeleteTables, s.Network}.Change())
	}
	return done, nil
}

// detachBoxes takes the profile off each box, copying its root device into the box first.
// Each box is written with the ETag it was read with.
func (h *Host) detachBoxes(ctx context.Context, boxes []string) ([]Change, error) {
	s := h.Stack
	var done []Change
	if len(boxes) == 0 {
		return nil, nil
	}
	prof, _, err := h.Client.Profile(ctx, s.Profile)
	if err != nil {
		return done, err
	}
	for _, name := range boxes {
		in, etag, err := h.Client.Instance(ctx, name)
		if err != nil {
			return done, err
		}
		devices := maps.Clone(in.Devices)
		if devices == nil {
			devices = map[string]map[string]string{}
		}
		if _, ok := devices["root"]; !ok {
			if root, ok := prof.Devices["root"]; ok {
				devices["root"] = maps.Clone(root)
			}
		}
		if d, ok := devices["eth0"]; ok && d["network"] == s.Network {
			// The box's own eth0 (BoxNIC: the stack's NIC with its fixed port name) goes
			// with the profile: the network is being removed.
			delete(devices, "eth0")
		}
		profiles := slices.DeleteFunc(slices.Clone(in.Profiles), func(x string) bool { return x == s.Profile })
		put := incus.InstancePut{Config: in.Config, Devices: devices, Profiles: profiles, Description: in.Description, Ephemeral: in.Ephemeral, Architecture: in.Architecture}
		if err := h.Client.UpdateInstance(ctx, name, put, etag); err != nil {
			return done, fmt.Errorf("detaching box %s from %s: %w", name, s.Profile, changed("box "+name, err))
		}
		done = append(done, Change{"box " + name, "detached from " + s.Profile + " (no network now)"})
	}
	return done, nil
}

func anyTable(o firewall.Observed) bool {
	for _, t := range o.Tables {
		if t.Present {
			return true
		}
	}
	return false
}
