package boxcore

import (
	"context"
	"fmt"
	"maps"
	"net"
	"net/netip"
	"slices"
	"strings"

	"github.com/claudebox/claudebox/internal/netdump"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/claudebox/claudebox/firewall"
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

// uplinks are the interfaces box egress may leave by: the default routes' and the admitted.
func (st *StackState) uplinks() []string {
	ups, _ := firewall.DefaultUplinks()
	return append(ups, st.AdmittedUplinks()...)
}

// otherRoutes are the IPv4 destinations the host routes through an interface that is neither
// an uplink, the bridge nor loopback — another bridge, a VPN, a LAN route, the drill's LAN-side
// decoy — and that blocked does not cover already. Boxes must never reach them: the wall's
// uplink rule drops them, and with them in the blocked set so do the L2 ranges.
func otherRoutes(bridge string, uplinks []string, blocked []netip.Prefix) []netip.Prefix {
	routes, err := netdump.RoutesFiltered(netlink.FAMILY_V4, &netlink.Route{Table: unix.RT_TABLE_MAIN}, netlink.RT_FILTER_TABLE)
	if err != nil {
		return nil
	}
	var out []netip.Prefix
	for _, r := range routes {
		if r.Dst == nil {
			continue
		}
		l, err := netlink.LinkByIndex(r.LinkIndex)
		if err != nil {
			continue
		}
		name := l.Attrs().Name
		if name == bridge || name == "lo" || slices.Contains(uplinks, name) {
			continue
		}
		ones, _ := r.Dst.Mask.Size()
		a, ok := netip.AddrFromSlice(r.Dst.IP.To4())
		if !ok {
			continue
		}
		p := netip.PrefixFrom(a, ones).Masked()
		if !covered(p, blocked) && !slices.Contains(out, p) {
			out = append(out, p)
		}
	}
	slices.SortFunc(out, func(a, b netip.Prefix) int { return strings.Compare(a.String(), b.String()) })
	return out
}

func covered(p netip.Prefix, by []netip.Prefix) bool {
	for _, b := range by {
		if b.Bits() <= p.Bits() && b.Contains(p.Addr()) {
			return true
		}
	}
	return false
}

// uplinkSubnets are the IPv4 prefixes on-link on an uplink — its connected subnets and any
// other scope-link route through it without a gateway (the host's LAN: its router's address,
// its neighbours) — that blocked does not cover already and that do not overlap the bridge's
// subnet. Default routes are not on-link prefixes. They join the firewall's blocked set, so the
// wall and the L2 ranges drop them as destinations; the default route's next hop stays usable
// (rules match destination addresses, never next hops), and so does a host reached through a
// next hop on such a subnet (the drill's public decoy behind its admitted uplink's /30).
func uplinkSubnets(uplinks []string, bridgeNet *net.IPNet, blocked []netip.Prefix) []netip.Prefix {
	routes, err := netdump.RoutesFiltered(netlink.FAMILY_V4, &netlink.Route{Table: unix.RT_TABLE_MAIN}, netlink.RT_FILTER_TABLE)
	if err != nil {
		return nil
	}
	var out []netip.Prefix
	for _, r := range routes {
		if r.Dst == nil || r.Scope != netlink.SCOPE_LINK || r.Gw != nil || len(r.MultiPath) > 0 || r.Type != unix.RTN_UNICAST {
			continue
		}
		l, err := netlink.LinkByIndex(r.LinkIndex)
		if err != nil || !slices.Contains(uplinks, l.Attrs().Name) {
			continue
		}
		ones, _ := r.Dst.Mask.Size()
		a, ok := netip.AddrFromSlice(r.Dst.IP.To4())
		if !ok || ones == 0 {
			continue
		}
		p := netip.PrefixFrom(a, ones).Masked()
		if bridgeNet != nil && (r.Dst.Contains(bridgeNet.IP) || bridgeNet.Contains(r.Dst.IP)) {
			continue
		}
		if !covered(p, blocked) && !slices.Contains(out, p) {
			out = append(out, p)
		}
	}
	slices.SortFunc(out, func(a, b netip.Prefix) int { return strings.Compare(a.String(), b.String()) })
	return out
}
