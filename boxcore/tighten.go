package boxcore

import (
	"context"
	"errors"
	"fmt"
	"maps"

	"github.com/claudebox/claudebox/boxcore/incus"
)

// Tighten is a temporary, live change of one running box's own limits: config keys
// (limits.processes, limits.memory, limits.cpu.allowance) and the root disk's size. Incus
// applies each to the running container's cgroup or quota at once. The drill uses it to put a
// stress against a limit just above what the box holds, so a bounded stress can show the limit
// stopping it without going anywhere near the host's own limits.
type Tighten struct {
	Config   map[string]string // keys to set; "" removes a key
	RootSize string            // the root disk's size ("" leaves it)
}

// TightenBox applies t to box and returns the function that puts the box's own config and
// devices back exactly as they were. Only tagged boxes are touched.
func (h *Host) TightenBox(ctx context.Context, box string, t Tighten) (restore func(context.Context) error, err error) {
	inst, etag, err := h.Client.Instance(ctx, box)
	if err != nil {
		return nil, err
	}
	if inst.Config[TagKey] != "1" {
		return nil, NoSuchBox(box)
	}
	saved := inst.Writable()
	saved.Config, saved.Devices = maps.Clone(inst.Config), cloneDevices(inst.Devices)
	put := inst.Writable()
	put.Config, put.Devices = maps.Clone(inst.Config), cloneDevices(inst.Devices)
	for k, v := range t.Config {
		if v == "" {
			delete(put.Config, k)
		} else {
			put.Config[k] = v
		}
	}
	if t.RootSize != "" {
		root, ok := put.Devices["root"]
		if !ok {
			return nil, fmt.Errorf("%s has no root disk of its own to resize (it uses the profile's)", box)
		}
		root["size"] = t.RootSize
	}
	if err := h.Client.UpdateInstance(ctx, box, put, etag); err != nil {
		return nil, fmt.Errorf("tightening %s: %w", box, err)
	}
	return func(ctx context.Context) error {
		cur, _, err := h.Client.Instance(ctx, box)
		if errors.Is(err, incus.ErrNotFound) {
			return nil
		} else if err != nil {
			return err
		}
		// Keep what Incus changed meanwhile (volatile.* after a restart), put back the rest.
		back := cur.Writable()
		back.Config = maps.Clone(cur.Config)
		for k := range t.Config {
			if v, ok := saved.Config[k]; ok {
				back.Config[k] = v
			} else {
				delete(back.Config, k)
			}
		}
		back.Devices = saved.Devices
		return h.Client.UpdateInstance(ctx, box, back, "")
	}, nil
}

func cloneDevices(d map[string]map[string]string) map[string]map[string]string {
	out := make(map[string]map[string]string, len(d))
	for k, v := range d {
		out[k] = maps.Clone(v)
	}
	return out
}
