package firewall

import (
	"fmt"
	"net"
	"net/netip"

	"github.com/vishvananda/netlink"
)

// Flow is one IPv4 conntrack entry, original direction.
type Flow struct {
	Proto            uint8      `json:"proto"`
	Src, Dst         netip.Addr `json:"-"`
	SrcPort, DstPort uint16     `json:"-"`
	Text             string     `json:"flow"`
}

// FlowsBetween lists the conntrack entries whose original direction goes from an address
// in from to an address in to. A flow is only in the table once the kernel confirmed it,
// i.e. once its first packet got past every hook: a dropped packet leaves no entry.
func FlowsBetween(from, to []netip.Prefix) ([]Flow, error) {
	flows, err := netlink.ConntrackTableList(netlink.ConntrackTable, netlink.FAMILY_V4)
	if err != nil {
		return nil, fmt.Errorf("reading conntrack: %w", err)
	}
	var out []Flow
	for _, f := range flows {
		s, _ := netip.AddrFromSlice(f.Forward.SrcIP.To4())
		d, _ := netip.AddrFromSlice(f.Forward.DstIP.To4())
		if inAny(s, from) && inAny(d, to) {
			out = append(out, Flow{Proto: f.Forward.Protocol, Src: s, Dst: d, SrcPort: f.Forward.SrcPort, DstPort: f.Forward.DstPort, Text: f.String()})
		}
	}
	return out, nil
}

// ForgetFlows deletes every conntrack entry to or from an address in ps, so no flow opened
// while a layer was off outlives it.
func ForgetFlows(ps []netip.Prefix) (uint, error) {
	var filters []netlink.CustomConntrackFilter
	for _, p := range ps {
		n := &net.IPNet{IP: net.IP(p.Masked().Addr().AsSlice()), Mask: net.CIDRMask(p.Bits(), 32)}
		for _, t := range []netlink.ConntrackFilterType{netlink.ConntrackOrigSrcIP, netlink.ConntrackOrigDstIP} {
			f := &netlink.ConntrackFilter{}
			if err := f.AddIPNet(t, n); err != nil {
				return 0, err
			}
			filters = append(filters, f)
		}
	}
	if len(filters) == 0 {
		return 0, nil
	}
	return netlink.ConntrackDeleteFilters(netlink.ConntrackTable, netlink.FAMILY_V4, filters...)
}

func inAny(a netip.Addr, ps []netip.Prefix) bool {
	for _, p := range ps {
		if p.Contains(a) {
			return true
		}
	}
	return false
}
