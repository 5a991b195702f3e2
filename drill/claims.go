package drill

import (
	"slices"
	"strings"
)

// Layer is one isolation mechanism the host stack holds.
type Layer string

// The layers, as the seeded holes name them.
const (
	LayerNFTBridge   Layer = "nft-bridge-drop"   // bridge table claudebox_<B> forward drop
	LayerBRNF        Layer = "br_netfilter"      // net.bridge.bridge-nf-call-iptables=1
	LayerPortIso     Layer = "port-isolation"    // brport/isolated on every box port
	LayerDNSModeNone Layer = "dns.mode=none"     // no instance-name DNS records
	LayerIgnoreNames Layer = "dhcp-ignore-names" // dnsmasq does not register DHCP hostnames
	LayerNoHosts     Layer = "no-hosts"          // dnsmasq does not serve /etc/hosts
	LayerACL         Layer = "acl"               // security.acls on the network
	LayerHostGuard   Layer = "host-input-guard"  // inet claudebox_<B>_guard input chain
	LayerIPv6Off     Layer = "ipv6.address=none" // no IPv6 on the bridge
	LayerNAT         Layer = "nat"               // what lets boxes out at all
	LayerWall        Layer = "wall"              // inet claudebox_<B>_wall: claudebox's own complete layer
)

// AllLayers are the layers a seeded hole can remove, in the order the self-test goes.
var AllLayers = []Layer{LayerNFTBridge, LayerBRNF, LayerPortIso, LayerDNSModeNone, LayerIgnoreNames,
	LayerNoHosts, LayerACL, LayerHostGuard, LayerIPv6Off, LayerWall}

// Holds says which layers hold a claim: it holds while ANY term holds, and a term holds
// only while ALL its layers are in place. {{port-isolation}, {nft-bridge-drop}, {acl, br_netfilter}}
// reads "port isolation, or the nft bridge drop, or the ACL while br_netfilter shows it
// bridged frames". Empty means no layer blocks it (positive claims).
type Holds [][]Layer

// OpenWithout reports whether removing the layers in off opens the claim: every term lost
// at least one of its layers.
func (h Holds) OpenWithout(off []Layer) bool {
	if len(h) == 0 {
		return false
	}
	for _, term := range h {
		lost := false
		for _, l := range term {
			if slices.Contains(off, l) {
				lost = true
			}
		}
		if !lost {
			return false
		}
	}
	return true
}

func (h Holds) String() string {
	var parts []string
	for _, t := range h {
		ss := make([]string, len(t))
		for i, l := range t {
			ss[i] = string(l)
		}
		parts = append(parts, strings.Join(ss, "+"))
	}
	if len(parts) == 0 {
		return "-"
	}
	return strings.Join(parts, " | ")
}

func any1(ls ...Layer) Holds {
	h := Holds{}
	for _, l := range ls {
		h = append(h, []Layer{l})
	}
	return h
}

// Claim names, one per row of DESIGN.md's table (box→box at L2 and by name split out).
const (
	ClaimBoxBox     = "box→box"
	ClaimBoxBoxL2   = "box→box at L2"
	ClaimBoxBoxName = "box→box by name"
	ClaimHostNames  = "host's names"
	ClaimBoxHost    = "box→host"
	ClaimLAN        = "box→LAN"
	ClaimCGNAT      = "box→CGNAT, link-local"
	ClaimOtherNet   = "box→other local networks"
	ClaimIPv6       = "IPv6"
	ClaimHostBox    = "host→box"
	ClaimInternet   = "internet"
	ClaimControl    = "control"
)

// ClaimOrder is the order claims are printed in.
var ClaimOrder = []string{ClaimBoxBox, ClaimBoxBoxL2, ClaimBoxBoxName, ClaimHostNames, ClaimBoxHost,
	ClaimLAN, ClaimCGNAT, ClaimOtherNet, ClaimIPv6, ClaimHostBox, ClaimInternet, ClaimControl}
