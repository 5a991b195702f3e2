package drill

import (
	"slices"
	"strings"

	"github.com/claudebox/claudebox/drill/probes"
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
)

// AllLayers are the layers a seeded hole can remove, in the order the self-test goes.
var AllLayers = []Layer{LayerNFTBridge, LayerBRNF, LayerPortIso, LayerDNSModeNone, LayerIgnoreNames,
	LayerNoHosts, LayerACL, LayerHostGuard, LayerIPv6Off}

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

// Expect is what a row must observe.
type Expect string

// Expectations. A negative expectation (dropped, no-answer, none) counts only when the row's
// positive controls passed.
const (
	ExpectDropped  Expect = "dropped"   // silence: probes.Dropped
	ExpectNoAnswer Expect = "no-answer" // the resolver answered without records (probes.Refused + DNS.Answered)
	ExpectNone     Expect = "none"      // facts: no global/ULA IPv6 address, no IPv6 default route
	ExpectOpen     Expect = "open"      // positive claims and controls
	ExpectLease    Expect = "lease"     // facts: the box holds an IPv4 lease (a control)
	ExpectAnswer   Expect = "answer"    // DNS: the resolver answered with records
)

// Negative reports whether an expectation is a "blocked" verdict that needs its controls.
func (e Expect) Negative() bool { return e == ExpectDropped || e == ExpectNoAnswer || e == ExpectNone }

// Claim names, one per row of DESIGN.md's table (box→box at L2 and by name split out).
const (
	ClaimBoxBox     = "box→box"
	ClaimBoxBoxL2   = "box→box at L2"
	ClaimBoxBoxName = "box→box by name"
	ClaimHostNames  = "host's names"
	ClaimBoxHost    = "box→host"
	ClaimLAN        = "box→LAN"
	ClaimCGNAT      = "box→CGNAT, link-local"
	ClaimIPv6       = "IPv6"
	ClaimHostBox    = "host→box"
	ClaimInternet   = "internet"
	ClaimControl    = "control"
)

// ClaimOrder is the order claims are printed in.
var ClaimOrder = []string{ClaimBoxBox, ClaimBoxBoxL2, ClaimBoxBoxName, ClaimHostNames, ClaimBoxHost,
	ClaimLAN, ClaimCGNAT, ClaimIPv6, ClaimHostBox, ClaimInternet, ClaimControl}

// ClaimSpec is a claim's layer attribution, as data. The attribution below is what was
// MEASURED on this project's test machine (kernel without nft_meta_bridge, Incus 6.0.4),
// not what DESIGN.md guessed; docs/drill.md lists where the two differ. Probe rows name
// their claim and a "kind" key; the layers are looked up here.
type ClaimSpec struct {
	Claim string
	Kind  string // "tcp", "udp", "icmp", "arp", "tcp6ll", "dns-instance", ... "" = every kind
	Holds Holds
}

// Attribution is the layer data of every claim row kind.
var Attribution = []ClaimSpec{
	// Box→box over IPv4: port isolation, the nft bridge drop (subnet mode covers IPv4+ARP),
	// and the ACL/guard forward chain while br_netfilter hands bridged frames to inet.
	{ClaimBoxBox, "", Holds{{LayerPortIso}, {LayerNFTBridge}, {LayerBRNF}}},
	{ClaimBoxBoxL2, "arp", any1(LayerPortIso, LayerNFTBridge)},
	// IPv6 link-local: the nft fallback (subnet mode) does not see IPv6; br_netfilter's
	// ip6tables hook hands it to the guard forward chain.
	{ClaimBoxBoxL2, "tcp6ll", Holds{{LayerPortIso}, {LayerBRNF}}},
	// Measured: dns.mode=managed registers the instance name (unqualified, .<domain>, PTR);
	// without dhcp-ignore-names dnsmasq registers the DHCP hostname (unqualified and PTR;
	// the qualified form needs the domain only dns.mode gives). The scratch agent sends the
	// instance name as its DHCP hostname, so the unqualified rows need both layers.
	{ClaimBoxBoxName, "dns-instance", Holds{{LayerDNSModeNone, LayerIgnoreNames}}},
	{ClaimBoxBoxName, "dns-hostname", Holds{{LayerDNSModeNone, LayerIgnoreNames}}},
	{ClaimBoxBoxName, "dns-hostname-fqdn", any1(LayerDNSModeNone)},
	{ClaimBoxBoxName, "dns-ptr", Holds{{LayerDNSModeNone, LayerIgnoreNames}}},
	{ClaimHostNames, "", any1(LayerNoHosts)},
	{ClaimBoxHost, "gateway", any1(LayerHostGuard, LayerACL)},
	{ClaimBoxHost, "", any1(LayerHostGuard)},
	{ClaimLAN, "", any1(LayerACL)},
	{ClaimCGNAT, "", any1(LayerACL)},
	// The host input guard drops the boxes' router solicitations, which delays SLAAC until
	// dnsmasq's next advertisement, but does not stop it (measured both ways): not a layer.
	{ClaimIPv6, "", any1(LayerIPv6Off)},
	{ClaimHostBox, "", any1(LayerACL)},
	{ClaimInternet, "", nil},
	{ClaimControl, "", nil},
}

// HoldsFor returns the attribution of a row.
func HoldsFor(claim, kind string) Holds {
	for _, c := range Attribution {
		if c.Claim == claim && (c.Kind == kind || c.Kind == "") {
			return c.Holds
		}
	}
	return nil
}

// Row is one probe of the matrix: a claim, who probes whom with what, what must be seen.
type Row struct {
	ID       string      `json:"id"`
	Claim    string      `json:"claim"`
	Kind     string      `json:"kind"` // attribution key
	From     string      `json:"from"` // box name, or "host"
	To       string      `json:"to"`   // box name, "host", "gateway", decoy label
	Probe    probes.Spec `json:"probe"`
	Expected Expect      `json:"expected"`
	Controls []string    `json:"controls,omitempty"` // IDs of the rows that must pass first
	Holds    Holds       `json:"-"`
	Layers   string      `json:"layers"`

	Result   probes.Result `json:"result"`
	Observed string        `json:"observed"`
	Verdict  Verdict       `json:"verdict"`
	Why      string        `json:"why,omitempty"`
	Retried  bool          `json:"retried,omitempty"`
}

// Verdict of a row.
type Verdict string

// Verdicts: pass, FAIL (the claim does not hold: a hole, or a positive that failed),
// check-failed (the probe or its control could not establish anything: never a pass).
const (
	Pass        Verdict = "pass"
	Fail        Verdict = "FAIL"
	CheckFailed Verdict = "check-failed"
)

// observe turns a probe result into what the row compares with its expectation.
func observe(r *Row) string {
	res := r.Result
	switch r.Probe.Kind {
	case probes.KindDNS:
		switch {
		case res.Outcome == probes.Open:
			return "answer"
		case res.Outcome == probes.Refused && res.DNS != nil && res.DNS.Answered:
			return "no-answer"
		case res.Outcome == probes.Dropped:
			return "silence"
		}
		return string(res.Outcome)
	case probes.KindFacts:
		if res.Outcome != probes.Open || res.Facts == nil {
			return string(res.Outcome)
		}
		if r.Expected == ExpectLease {
			if len(res.Facts.IPv4) > 0 {
				return "lease"
			}
			return "no-lease"
		}
		if res.Facts.HasGlobalIPv6 {
			return "ipv6"
		}
		return "none"
	}
	if r.From == "host" && res.Outcome == probes.CheckFailed && strings.Contains(res.Evidence, "operation not permitted") {
		// The host's own netfilter dropped the packet on output: sendmsg returns EPERM.
		// Nothing left the host towards the target, which is what "dropped" claims.
		return string(probes.Dropped)
	}
	return string(res.Outcome)
}
