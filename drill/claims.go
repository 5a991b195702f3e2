package drill

import (
	"slices"
	"strings"

	"github.com/claudebox/claudebox/boxcore"
)

// Layer is one isolation mechanism of the host stack; boxcore defines them, reads them and
// switches them off for a seeded hole (the drill touches no layer itself).
type Layer = boxcore.Layer

// The layers the claims name.
const (
	LayerNFTBridge     = boxcore.LayerNFTBridge
	LayerBRNF          = boxcore.LayerBRNF
	LayerPortIso       = boxcore.LayerPortIso
	LayerDNSModeNone   = boxcore.LayerDNSModeNone
	LayerIgnoreNames   = boxcore.LayerIgnoreNames
	LayerNoHosts       = boxcore.LayerNoHosts
	LayerNoIdent       = boxcore.LayerNoIdent
	LayerLocalAnswers  = boxcore.LayerLocalAnswers
	LayerNoCache       = boxcore.LayerNoCache
	LayerACL           = boxcore.LayerACL
	LayerHostGuard     = boxcore.LayerHostGuard
	LayerWall          = boxcore.LayerWall
	LayerNICFiltering  = boxcore.LayerNICFiltering
	LayerIPv6Off       = boxcore.LayerIPv6Off
	LayerPortBinding   = boxcore.LayerPortBinding
	LayerFDBPin        = boxcore.LayerFDBPin
	LayerL2Ranges      = boxcore.LayerL2Ranges
	LayerDHCPKnownOnly = boxcore.LayerDHCPKnown
	LayerPortRPFilter  = boxcore.LayerPortRPFilter
	LayerNAT           = boxcore.LayerNAT
)

// AllLayers are the layers a seeded hole can remove, in the order the self-test goes.
var AllLayers = append(append(slices.Clone(boxcore.SwitchableLayers), ResourceLayers...), LabLayers...)

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
	ClaimWindow     = "every second (Incus re-apply)"
	ClaimSoak       = "every second, soaked (re-applies, incusd restart, drift repair)"
	ClaimSpoof      = "no spoofing"
	ClaimFrames     = "odd frames"
	ClaimResolver   = "resolver says nothing about itself"
	ClaimInternet   = "internet"
	ClaimControl    = "control"
)

// ClaimOrder is the order claims are printed in.
var ClaimOrder = []string{ClaimBoxBox, ClaimBoxBoxL2, ClaimBoxBoxName, ClaimHostNames, ClaimBoxHost,
	ClaimLAN, ClaimCGNAT, ClaimOtherNet, ClaimCluster, ClaimMemberBoxes, ClaimIPv6, ClaimHostBox, ClaimExposure, ClaimNested, ClaimWindow, ClaimSoak, ClaimSpoof, ClaimFrames, ClaimResolver, ClaimResources, ClaimNAT, ClaimInternet, ClaimControl}
