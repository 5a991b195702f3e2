package boxcore

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"

	"github.com/claudebox/claudebox/boxcore/incus"
	"github.com/claudebox/claudebox/firewall"
)

// TeardownPlan is what teardown will remove, read before anything is touched.
type TeardownPlan struct {
	Boxes    []string // boxes that carry the profile and would lose their network
	Objects  []Change
	Blocking []string // instances we did not mint that use the stack: never touched, so teardown stops
}

// PlanTeardown reads what teardown would do. Boxes on the stack refuse the teardown unless
// force is set; instances claudebox did not mint always refuse it.
func (h *Host) PlanTeardown(ctx context.Context, force bool) (*TeardownPlan, error) {
	s := h.Stack
	p := &TeardownPlan{}
	_, _, err := h.Client.Profile(ctx, s.Profile)
	profExists := err == nil
	if err != nil && !errors.Is(err, incus.ErrNotFound) {
		return nil, err
	}
	if profExists {
		insts, err := h.Client.Instances(ctx, nil, false)
		if err != nil {
			return nil, err
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
		p.Objects = append(p.Objects, Change{"profile " + s.Profile, "delete"})
	}
	if len(p.Blocking) > 0 {
		return nil, Usagef("profile %s is used by %s, which claudebox did not mint and will not touch: detach it with 'incus profile remove <instance> %s' first",
			s.Profile, strings.Join(p.Blocking, ", "), s.Profile)
	}
	if len(p.Boxes) > 0 && !force {
		return nil, Usagef("%d box(es) use the stack (%s): remove them with 'claudebox rm', or pass --force to tear down anyway (they lose their network)",
			len(p.Boxes), strings.Join(p.Boxes, ", "))
	}
	if n, _, err := h.Client.Network(ctx, s.Network); err == nil {
		for _, u := range n.UsedBy {
			if strings.Contains(u, "/instances/") {
				name := u[strings.LastIndex(u, "/")+1:]
				if i := strings.IndexByte(name, '?'); i >= 0 {
					name = name[:i]
				}
				if !slices.Contains(p.Boxes, name) {
					return nil, Usagef("network %s is used directly by instance %s: detach it first", s.Network, name)
				}
			}
		}
		p.Objects = append(p.Objects, Change{"network " + s.Network, "delete"})
	} else if !errors.Is(err, incus.ErrNotFound) {
		return nil, err
	}
	if _, _, err := h.Client.NetworkACL(ctx, s.ACL); err == nil {
		p.Objects = append(p.Objects, Change{"acl " + s.ACL, "delete"})
	} else if !errors.Is(err, incus.ErrNotFound) {
		return nil, err
	}
	if obs, err := firewall.Read(s.Network); err == nil && anyTable(obs) {
		p.Objects = append(p.Objects, Change{"nftables", "delete claudebox tables of " + s.Network})
	}
	return p, nil
}

// ApplyTeardown removes the stack. Boxes keep their disks: the profile's root device is copied
// into each box before the profile is detached, so only the network is lost.
func (h *Host) ApplyTeardown(ctx context.Context, p *TeardownPlan) ([]Change, error) {
	s := h.Stack
	var done []Change
	if len(p.Boxes) > 0 {
		prof, _, err := h.Client.Profile(ctx, s.Profile)
		if err != nil {
			return done, err
		}
		for _, name := range p.Boxes {
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
			profiles := slices.DeleteFunc(slices.Clone(in.Profiles), func(x string) bool { return x == s.Profile })
			put := incus.InstancePut{Config: in.Config, Devices: devices, Profiles: profiles, Description: in.Description, Ephemeral: in.Ephemeral, Architecture: in.Architecture}
			if err := h.Client.UpdateInstance(ctx, name, put, etag); err != nil {
				return done, fmt.Errorf("detaching box %s from %s: %w", name, s.Profile, err)
			}
			done = append(done, Change{"box " + name, "detached from " + s.Profile + " (no network now)"})
		}
	}
	for _, obj := range p.Objects {
		var err error
		switch {
		case obj.Object == "profile "+s.Profile:
			err = h.Client.DeleteProfile(ctx, s.Profile)
		case obj.Object == "network "+s.Network:
			err = h.Client.DeleteNetwork(ctx, s.Network)
		case obj.Object == "acl "+s.ACL:
			err = h.Client.DeleteNetworkACL(ctx, s.ACL)
		case obj.Object == "nftables":
			_, err = firewall.Remove(s.Network)
		}
		if err != nil && !errors.Is(err, incus.ErrNotFound) {
			return done, fmt.Errorf("%s: %w", obj.Object, err)
		}
		done = append(done, obj)
	}
	// Tables of a stack whose network is already gone still go.
	if removed, err := firewall.Remove(s.Network); err == nil && removed {
		done = append(done, Change{"nftables", "delete claudebox tables of " + s.Network})
	}
	if removed, err := h.removeUnit(); err != nil {
		return done, err
	} else if removed {
		done = append(done, Change{"systemd " + s.Unit, "remove"})
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
