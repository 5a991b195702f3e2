package boxcore

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"maps"
	"os"
	"slices"
	"strings"

	"github.com/claudebox/claudebox/boxcore/incus"
	"github.com/claudebox/claudebox/firewall"
)

// SwitchOff turns layers off, for a seeded hole, and returns the function that puts every one
// of them back as it was. boxes are the instances whose own ports and NICs are switched
// (port-isolation, port-rp-filter, fdb-pin, nic-filtering); nil means every box on the
// bridge. The network-wide layers (the network's config keys, sysctls, claudebox's nft
// tables) affect every box on the bridge.
//
// Network keys (dns.mode, the dnsmasq options, the ACL, IPv6) are written in one update, which
// makes Incus re-apply its firewall for the network (a re-apply window); the others touch no
// Incus object. If switching fails part-way, what was switched is restored before returning.
func (h *Host) SwitchOff(ctx context.Context, layers []Layer, boxes []string) (restore func(context.Context) error, err error) {
	st, err := h.Read(ctx)
	if err != nil {
		return nil, err
	}
	if st.Network == nil || st.Gateway == nil {
		return nil, &StackMissingError{Object: "network " + h.Stack.Network, Detail: "is missing or has no IPv4 address"}
	}
	forgetFullBind(h.Stack.Network)
	sw := &switcher{h: h, st: st, saved: maps.Clone(st.Network.Config), cfg: maps.Clone(st.Network.Config), layers: layers}
	for _, p := range st.portsOf(boxes) {
		sw.ports = append(sw.ports, p.Name)
		if p.Box != "" {
			sw.boxes = append(sw.boxes, p.Box)
		}
	}
	for _, l := range layers {
		if err := sw.off(ctx, l); err != nil {
			return nil, errors.Join(fmt.Errorf("switching %s off: %w", l, err), sw.restore(ctx))
		}
	}
	if sw.netChanged {
		if err := putNetwork(ctx, h.Client, h.Stack.Network, sw.cfg, st.ETags.Network); err != nil {
			return nil, errors.Join(err, sw.restore(ctx))
		}
	}
	return sw.restore, nil
}

type switcher struct {
	layers     []Layer // everything this hole switches off
	h          *Host
	st         *StackState
	saved, cfg map[string]string
	ports      []string
	boxes      []string

	netChanged, nftChanged bool
	brnf                   bool
	unisolated             []string
	rpFilter               map[string]int            // port → its own rp_filter before the switch
	unpinned               []firewall.PortBinding    // FDB pins removed (re-pinned on restore)
	nics                   map[string]incus.Instance // box → instance as it was, before the NIC override
	guestAPI               []string                  // boxes given /dev/incus back
}

func (sw *switcher) off(ctx context.Context, l Layer) error {
	switch l {
	case LayerNFTBridge:
		sw.nftChanged = true
		return firewall.RemovePart(sw.h.FirewallSpec(sw.st), firewall.PartBridge)
	case LayerPortBinding:
		sw.nftChanged = true
		return firewall.RemovePart(sw.h.FirewallSpec(sw.st), firewall.PartPorts)
	case LayerL2Ranges:
		sw.nftChanged = true
		return firewall.RemovePart(sw.h.FirewallSpec(sw.st), firewall.PartL2Ranges)
	case LayerLocalAnswers:
		sw.nftChanged = true
		return firewall.RemovePart(sw.h.FirewallSpec(sw.st), firewall.PartLocalAnswers)
	case LayerHostGuard:
		sw.nftChanged = true
		return firewall.RemovePart(sw.h.FirewallSpec(sw.st), firewall.PartGuard)
	case LayerWall:
		sw.nftChanged = true
		return firewall.RemovePart(sw.h.FirewallSpec(sw.st), firewall.PartWall)
	case LayerBRNF:
		sw.brnf = true
		return errors.Join(sw.h.Kernel.SetBridgeNFCallIPTables(0), sw.h.Kernel.SetBridgeNFCallIP6Tables(0))
	case LayerPortRPFilter:
		return sw.rpFilterOff()
	case LayerFDBPin:
		return sw.fdbPinOff()
	case LayerPortIso:
		for _, p := range sw.ports {
			if err := sw.h.Kernel.SetPortIsolated(p, false); err != nil {
				return err
			}
			sw.unisolated = append(sw.unisolated, p)
		}
		return nil
	case LayerNICFiltering:
		return sw.nicFilteringOff(ctx)
	case LayerGuestAPIOff:
		return sw.guestAPIOn(ctx)
	case LayerDNSModeNone:
		sw.cfg["dns.mode"] = "managed"
	case LayerIgnoreNames, LayerNoHosts, LayerNoIdent, LayerDHCPKnown, LayerNoCache:
		var keep []string
		for _, line := range strings.Split(sw.cfg["raw.dnsmasq"], "\n") {
			if strings.TrimSpace(line) != dnsmasqLine(l) {
				keep = append(keep, line)
			}
		}
		sw.cfg["raw.dnsmasq"] = strings.Join(keep, "\n")
	case LayerACL:
		delete(sw.cfg, "security.acls")
		delete(sw.cfg, "security.acls.default.ingress.action")
		delete(sw.cfg, "security.acls.default.egress.action")
	case LayerNAT:
		sw.cfg["ipv4.nat"] = "false"
	case LayerIPv6Off:
		r := make([]byte, 4)
		_, _ = rand.Read(r)
		sw.cfg["ipv6.address"] = fmt.Sprintf("fd42:%x:%x::1/64", r[:2], r[2:])
		sw.cfg["ipv6.nat"] = "true"
	default:
		return fmt.Errorf("layer %q cannot be switched off", l)
	}
	sw.netChanged = true
	return nil
}

// rpFilterOff sets rp_filter=0 on the boxes' ports. The kernel applies the larger of the
// port's and conf.all's value: with conf.all above 0 the layer cannot be switched off per port,
// and that is an error, not a silent no-op.
func (sw *switcher) rpFilterOff() error {
	if sw.rpFilter == nil {
		sw.rpFilter = map[string]int{}
	}
	for _, p := range sw.ports {
		eff, own, err := firewall.PortRPFilter(p)
		if err != nil {
			return err
		}
		if eff != own {
			return fmt.Errorf("port %s: net.ipv4.conf.all.rp_filter=%d applies whatever the port's value", p, eff)
		}
		if err := firewall.SetPortRPFilter(p, 0); err != nil {
			return err
		}
		if _, ok := sw.rpFilter[p]; !ok {
			sw.rpFilter[p] = own
		}
	}
	return nil
}

// fdbPinOff deletes the boxes' static FDB entries and turns learning back on on their ports:
// the bridge learns their MACs from whatever frame comes in, as it does without the layer.
func (sw *switcher) fdbPinOff() error {
	for _, b := range sw.st.Bindings() {
		if !slices.Contains(sw.ports, b.Port) || slices.ContainsFunc(sw.unpinned, func(u firewall.PortBinding) bool { return u.Port == b.Port }) {
			continue
		}
		if err := sw.h.Kernel.UnpinFDB(sw.h.Stack.Network, b); err != nil {
			return err
		}
		sw.unpinned = append(sw.unpinned, b)
	}
	return nil
}

// portGone: a port whose box stopped meanwhile has no sysctl left to restore.
func portGone(p string) bool {
	_, _, err := firewall.PortRPFilter(p)
	return err != nil && errors.Is(err, os.ErrNotExist)
}

// nicFilteringOff gives each box a local eth0 that overrides the profile's, with the
// filtering keys off (Incus applies it to the running NIC: same veth, same address).
func (sw *switcher) nicFilteringOff(ctx context.Context) error {
	prof := sw.st.Profile
	if prof == nil || prof.Devices["eth0"] == nil {
		return fmt.Errorf("profile %s has no eth0", sw.h.Stack.Profile)
	}
	if sw.nics == nil {
		sw.nics = map[string]incus.Instance{}
	}
	for _, b := range sw.boxes {
		in, etag, err := sw.h.Client.Instance(ctx, b)
		if err != nil {
			return err
		}
		eth0 := maps.Clone(prof.Devices["eth0"])
		if hn := in.Devices["eth0"]["host_name"]; hn != "" {
			eth0["host_name"] = hn // the box's fixed port name: the same veth, the same rules
		}
		for k := range NICFiltering {
			eth0[k] = "false"
		}
		// Keep the box's DHCP reservation (ipv4_filtering is what makes Incus pin one) unless
		// dhcp-known-only goes too: without the reservation that option would stop the box
		// renewing its lease. With both off, the reservation goes with the filtering.
		if ip := sw.st.boxIPv4(b); ip.IsValid() && !slices.Contains(sw.layers, LayerDHCPKnown) {
			eth0["ipv4.address"] = ip.String()
		}
		put := in.Writable()
		put.Devices = maps.Clone(in.Devices)
		if put.Devices == nil {
			put.Devices = map[string]map[string]string{}
		}
		put.Devices["eth0"] = eth0
		if err := sw.h.Client.UpdateInstance(ctx, b, put, etag); err != nil {
			return fmt.Errorf("box %s: %w", b, err)
		}
		sw.nics[b] = in
	}
	return nil
}

// restore puts back everything switched, in the order that leaves no layer missing longer
// than it must; it goes on after an error and returns them all.
func (sw *switcher) restore(ctx context.Context) error {
	var errs []error
	h := sw.h
	if sw.netChanged {
		if cur, _, err := h.Client.Network(ctx, h.Stack.Network); err != nil {
			errs = append(errs, err)
		} else if !maps.Equal(cur.Config, sw.saved) {
			errs = append(errs, PutNetworkConfig(ctx, h.Client, h.Stack.Network, sw.saved))
		}
	}
	if sw.brnf {
		errs = append(errs, restoreSysctl(sw.st.BridgeNF4, h.Kernel.SetBridgeNFCallIPTables),
			restoreSysctl(sw.st.BridgeNF6, h.Kernel.SetBridgeNFCallIP6Tables))
	}
	if sw.nftChanged {
		forgetFullBind(h.Stack.Network) // back to the state SwitchOff read, not to the last round's
		if _, err := firewall.Apply(h.FirewallSpec(sw.st)); err != nil {
			errs = append(errs, err)
		}
	}
	for _, p := range sw.unisolated {
		errs = append(errs, h.Kernel.SetPortIsolated(p, true))
	}
	for _, p := range slices.Sorted(maps.Keys(sw.rpFilter)) {
		if err := firewall.SetPortRPFilter(p, sw.rpFilter[p]); err != nil && !portGone(p) {
			errs = append(errs, err)
		}
	}
	var repin []firewall.PortBinding
	for _, b := range sw.unpinned {
		if !linkMissing(b.Port) {
			repin = append(repin, b)
		}
	}
	if _, err := h.Kernel.PinFDB(h.Stack.Network, repin); err != nil {
		errs = append(errs, err)
	}
	for _, b := range slices.Sorted(maps.Keys(sw.nics)) {
		errs = append(errs, sw.restoreNIC(ctx, b))
	}
	for _, b := range sw.guestAPI {
		errs = append(errs, sw.restoreGuestAPI(ctx, b))
	}
	return errors.Join(errs...)
}

func (sw *switcher) restoreNIC(ctx context.Context, box string) error {
	was := sw.nics[box]
	in, etag, err := sw.h.Client.Instance(ctx, box)
	if err != nil {
		return err
	}
	put := in.Writable()
	put.Devices = maps.Clone(in.Devices)
	if dev, ok := was.Devices["eth0"]; ok {
		put.Devices["eth0"] = dev
	} else {
		delete(put.Devices, "eth0")
	}
	if err := sw.h.Client.UpdateInstance(ctx, box, put, etag); err != nil {
		return fmt.Errorf("restoring box %s's NIC: %w", box, err)
	}
	return nil
}

func restoreSysctl(was Sysctl, set func(int) error) error {
	if !was.Loaded {
		return nil
	}
	return set(was.Value)
}

// ReadLayers reads the stack and returns one line per layer (see StackState.Layers).
func (h *Host) ReadLayers(ctx context.Context, boxes []string) ([]LayerState, error) {
	st, err := h.Read(ctx)
	if err != nil {
		return nil, err
	}
	return st.Layers(boxes), nil
}
