package boxcore

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
)

// UplinksKey lists, on the network, interfaces the wall admits as uplinks besides the
// default routes' (the drill admits its public decoy's side for a run). It lives on the
// network, where every apply reads it — init, BindPorts from a box verb, a hole's restore —
// so no apply drops an admission another part of the run made. A user.* key: writing it does
// not make Incus re-apply the network.
const UplinksKey = "user.claudebox.uplinks"

// AdmittedUplinks are the interfaces UplinksKey admits.
func (st *StackState) AdmittedUplinks() []string {
	if st.Network == nil {
		return nil
	}
	var out []string
	for _, u := range strings.Split(st.Network.Config[UplinksKey], ",") {
		if u = strings.TrimSpace(u); u != "" {
			out = append(out, u)
		}
	}
	return out
}

// SetAdmittedUplinks records ifaces as admitted uplinks (none: the key is removed) and
// applies the firewall.
func (h *Host) SetAdmittedUplinks(ctx context.Context, ifaces []string) error {
	n, etag, err := h.Client.Network(ctx, h.Stack.Network)
	if err != nil {
		return err
	}
	cfg := maps.Clone(n.Config)
	if len(ifaces) == 0 {
		delete(cfg, UplinksKey)
	} else {
		cfg[UplinksKey] = strings.Join(slices.Sorted(slices.Values(ifaces)), ",")
	}
	if !maps.Equal(cfg, n.Config) {
		if err := h.Client.UpdateNetwork(ctx, h.Stack.Network, cfg, n.Description, etag); err != nil {
			return fmt.Errorf("recording the admitted uplinks on %s: %w", h.Stack.Network, err)
		}
	}
	_, err = h.ApplyFirewall(ctx)
	return err
}
