package drill

import (
	"fmt"
	"hash/fnv"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/claudebox/claudebox/drill/probes"
)

// The drill's model is pure: claim rows (data, claims.go) are planned against a Topology
// into Cases, observations are mapped to one vocabulary of Outcomes, and Judge sets
// verdicts. Nothing here needs root, Incus or a kernel; the lab (engine.go) only runs cases.

// Outcome is the one vocabulary of what a case observed and what it expects.
type Outcome string

// Outcomes. The first four are the probes' own; the others are what a DNS or facts probe's
// result means for its row.
const (
	Open        Outcome = "open"         // connected / answered
	Refused     Outcome = "refused"      // RST or ICMP unreachable: the packet arrived
	Dropped     Outcome = "dropped"      // silence until the timeout
	CheckFailed Outcome = "check-failed" // the probe itself could not run
	Answer      Outcome = "answer"       // DNS: the resolver answered with records
	NoAnswer    Outcome = "no-answer"    // DNS: the resolver answered without records
	Silence     Outcome = "silence"      // DNS: the resolver did not answer at all
	None        Outcome = "none"         // facts: no global/ULA IPv6 address, no v6 default route
	HasIPv6     Outcome = "ipv6"         // facts: the box has IPv6
	Lease       Outcome = "lease"        // facts: the box holds an IPv4 lease
	NoLease     Outcome = "no-lease"     // facts: it does not
	NoSuchName  Outcome = "nxdomain"     // DNS: the resolver answered that the name does not exist
	Exists      Outcome = "exists"       // DNS: it answered without records but without NXDOMAIN: the name exists
	Fresh       Outcome = "fresh"        // DNS: the answer came from upstream, its TTL whole
	Cached      Outcome = "cached"       // DNS: the answer came from a cache another box filled
	NATed       Outcome = "natted"       // the public decoy heard it from an address outside the box subnet
	UnNATed     Outcome = "un-natted"    // the public decoy heard it from the box subnet itself
)

// Negative reports whether an expectation is a "blocked" verdict that counts only when the
// case's positive controls passed.
func (o Outcome) Negative() bool {
	// Refused: the exposure rows, where both layers answer as a closed port does.
	return o == Dropped || o == Refused || o == NoAnswer || o == None || o == NoLease || o == Held || o == Fresh || o == NoSuchName || o == NATed
}

// Verdict of a case.
type Verdict string

// Verdicts: pass; FAIL (the claim does not hold: a hole, or a positive that failed);
// check-failed (the probe or a control established nothing: never a pass).
const (
	Pass    Verdict = "pass"
	Fail    Verdict = "FAIL"
	NoCheck Verdict = "check-failed"
)

// Endpoint is one side of a case: a box, the host, an address, a name.
type Endpoint struct {
	Key   string     // what the case ID uses: box name, "host", an address, a name
	Label string     // what the report's FROM/TO column shows
	Addr  netip.Addr // the address a probe aims at (zero for names)
	Port  int        // a decoy TCP port (decoy endpoints only)
	Name  string     // a DNS name to ask for
	Box   *Box       // when the endpoint is a box
}

// Topology is what the lab built: everything a claim row can select.
type Topology struct {
	Boxes      []*Box
	Gateway    netip.Prefix // the bridge's address and prefix
	Domain     string       // the bridge's DNS domain (dns.mode managed would use it)
	HostAddrs  []netip.Addr // the gateway first, then every other host address
	HostNames  []string     // the host's hostname and /etc/hosts names
	HostTCP    int          // the host's listener ports
	HostUDP    int
	Decoys     []DecoyTarget // LAN, CGNAT and link-local decoys (not the public one)
	Public     netip.Addr    // the "internet"
	PublicName string        // a name the decoy resolver answers with Public
	// DecoyHostSide is the host's address on the decoy's LAN side (where the decoy's own
	// flood control aims).
	DecoyHostSide netip.Addr
	// Forged is a source address nobody owns whose answers die in the decoy namespace.
	Forged netip.Addr
	// Round numbers the matrices of a run: markers differ per round, so what a listener
	// heard in an earlier matrix (a seeded hole) is never taken for this one's.
	Round int
	// Bridge is the stack's bridge (the host's frames onto it leave by this interface).
	Bridge string
	// Soak is how many re-applies the soak runs (0: no soak rows).
	Soak int
	// Resources: plan the resource rows (container boxes; the plain matrix and the resource
	// holes).
	Resources bool
	// ResBox is the box the resource stresses run on: its own, never a network row's end,
	// so the stresses run beside the network rows. Nil: no resource rows.
	ResBox *Box
	// Exposure is where the first box's listener is exposed on the host's loopback, and
	// ExposedBox that box (exposure.go). Invalid: no exposure rows (VM boxes).
	Exposure   netip.AddrPort
	ExposedBox string
	// Nested is the /30 of the first box's nested container (nested.go). Invalid: no nested
	// rows (VM boxes).
	Nested netip.Prefix
	// Peers are the other members of the Incus cluster this host is a member of, each at its
	// cluster address and API port (none on a standalone host: no cluster rows).
	Peers []Endpoint
	// HostFlow is the host's end of its own live UDP flow to the public decoy (invalid: none).
	HostFlow netip.AddrPort
	// Foreign is the address of the stand-in for another member's box (members.go; invalid:
	// no such rows).
	Foreign    netip.Addr
	ForeignMAC string
	// ForeignIface is the stand-in's interface (in its namespace): its frames leave by it.
	ForeignIface string
}

// Selector picks the endpoints of one side of a row. To-selectors get the row's source.
type Selector struct {
	Name string
	pick func(t *Topology, from Endpoint) []Endpoint
}

// End names, for control references: which endpoint of a case becomes which end of the
// control case.
type End int

// Ends of a case a control can be bound to.
const (
	EndSource   End = iota // the case's source
	EndTarget              // the case's target
	EndHost                // the host
	EndPublic              // the public decoy
	EndGateway             // the gateway
	EndFirstBox            // the first box (a control of a row that has no box end)
)

// Control is a positive control of a row: another row (by Key) planned for the ends given.
type Control struct {
	Row      string
	From, To End
}

// ClaimRow is one declarative row of the isolation contract: everything about it is here.
type ClaimRow struct {
	Key      string   // unique: "box-box/tcp"
	Claim    string   // the claim it proves (ClaimOrder)
	Kind     string   // the probe kind, as the report groups it
	ID       string   // case ID template: {from} {to} {port} are replaced
	From, To Selector // who probes whom
	Probe    func(from, to Endpoint, t *Topology) probes.Spec
	Expect   Outcome
	Controls []Control
	Holds    Holds // the layers that hold it (empty for positives)
	// Window marks rows whose probes must run outside the shared timeout window (a flood
	// while the lab re-applies Incus's firewall).
	Window string
}

// Case is one planned probe: a row for one (from, to).
type Case struct {
	ID       string      `json:"id"`
	Row      string      `json:"row"`
	Claim    string      `json:"claim"`
	Kind     string      `json:"kind"`
	From     string      `json:"from"` // box name, or "host"
	To       string      `json:"to"`
	Probe    probes.Spec `json:"probe"`
	Expected Outcome     `json:"expected"`
	Controls []string    `json:"controls,omitempty"`
	Holds    Holds       `json:"-"`
	Layers   string      `json:"layers"`
	Window   string      `json:"window,omitempty"`
}

// Row is a case with what was observed and judged: what the report and record show.
type Row struct {
	Case
	Result   probes.Result `json:"result"`
	Observed Outcome       `json:"observed"`
	Verdict  Verdict       `json:"verdict"`
	Why      string        `json:"why,omitempty"`
	Retried  bool          `json:"retried,omitempty"`
}

func caseID(tmpl string, from, to Endpoint) string {
	port := ""
	if to.Port != 0 {
		port = strconv.Itoa(to.Port)
	}
	return strings.NewReplacer("{from}", from.Key, "{to}", to.Key, "{port}", port).Replace(tmpl)
}

// Plan turns the claim rows into cases for a topology. It fails on a row whose control
// names no row, or whose control was not planned for the ends it binds (a typo'd key or a
// selector that does not cover the control's case): a claim never counts without its control.
func Plan(rows []ClaimRow, t *Topology, timeout time.Duration) ([]Case, error) {
	byKey := map[string]*ClaimRow{}
	for i := range rows {
		if _, dup := byKey[rows[i].Key]; dup {
			return nil, fmt.Errorf("claim row %q declared twice", rows[i].Key)
		}
		byKey[rows[i].Key] = &rows[i]
	}
	var cases []Case
	seen := map[string]bool{}
	for _, r := range rows {
		for _, from := range r.From.pick(t, Endpoint{}) {
			for _, to := range r.To.pick(t, from) {
				c := Case{ID: caseID(r.ID, from, to), Row: r.Key, Claim: r.Claim, Kind: r.Kind, From: from.Key,
					To: to.Label, Probe: r.Probe(from, to, t), Expected: r.Expect, Holds: r.Holds, Window: r.Window}
				c.Layers = c.Holds.String()
				if c.Probe.Timeout == 0 {
					c.Probe.Timeout = timeout
				}
				c.Probe.ID = c.ID
				if c.Probe.Payload == "" && activeKind(c.Probe.Kind) {
					c.Probe.Payload = markerFor(fmt.Sprintf("%s#%d", c.ID, t.Round))
				}
				for _, ctl := range r.Controls {
					cr := byKey[ctl.Row]
					if cr == nil {
						return nil, fmt.Errorf("row %q: control %q is no row", r.Key, ctl.Row)
					}
					c.Controls = append(c.Controls, caseID(cr.ID, t.end(ctl.From, from, to), t.end(ctl.To, from, to)))
				}
				if seen[c.ID] {
					return nil, fmt.Errorf("row %q plans case %q twice", r.Key, c.ID)
				}
				seen[c.ID] = true
				cases = append(cases, c)
			}
		}
	}
	for _, c := range cases {
		for _, ctl := range c.Controls {
			if !seen[ctl] {
				return nil, fmt.Errorf("case %q: control %q is not planned", c.ID, ctl)
			}
		}
	}
	return cases, nil
}

// activeKind: probes whose frames carry a marker the receivers record.
func activeKind(k string) bool {
	switch k {
	case probes.KindUDP, probes.KindFlood, probes.KindSpoofUDP, probes.KindFrame, probes.KindMACSpoof, probes.KindARPSpoof, probes.KindDHCPRelay:
		return true
	}
	return false
}

// markerFor is a case's marker: stable, short enough for a listener's payload prefix.
func markerFor(id string) string {
	h := fnv.New64a()
	h.Write([]byte(id))
	return fmt.Sprintf("%s%016x", probes.MarkerPrefix, h.Sum64())
}

func (t *Topology) end(e End, from, to Endpoint) Endpoint {
	switch e {
	case EndSource:
		return from
	case EndTarget:
		return to
	case EndHost:
		return hostEnd
	case EndPublic:
		return t.publicEnd()
	case EndFirstBox:
		if bs := boxEnds(t.Boxes[:min(1, len(t.Boxes))], nil); len(bs) > 0 {
			return bs[0]
		}
		return Endpoint{Key: "no-box"}
	default:
		return t.gatewayEnd()
	}
}

var (
	hostEnd  = Endpoint{Key: "host", Label: "host"}
	decoyEnd = Endpoint{Key: "decoy", Label: "the decoy's LAN side"}
)

// Windows: rows that run in a lab phase of their own rather than in the shared batch.
const (
	WindowReapply = "reapply" // while Incus re-applies the network's firewall
	WindowSpoof   = "spoof"   // after the shared batch: a spoof that works disturbs its victim
	WindowDHCP    = "dhcp"    // once dnsmasq is back from the re-apply, beside everything else
	WindowLeases  = "leases"  // read from dnsmasq once the DHCP rows are done
	WindowCache   = "cache"   // a sibling asks a name first, a box asks it a second later
	WindowSoak    = "soak"    // --soak: many re-applies, an incusd restart and a drift repair under one flood
	WindowRestart = "restart" // --soak: the first box restarted behind claudebox's back, before anything binds it
)

// Kinds the lab observes itself.
const (
	KindLabReapply      = "lab-reapply"       // the watcher saw Incus re-apply the network inside the flood
	KindLabConntrackOut = "lab-conntrack-out" // conntrack holds a flow from a box to a blocked decoy
	KindLabConntrackIn  = "lab-conntrack-in"  // conntrack holds a flow into a box from the host or the decoy
	KindLabLeaseIntact  = "lab-lease-intact"  // dnsmasq lost a box's lease (after a sibling's spoofed release)
	KindLabSoak         = "lab-soak"          // the soak's re-applies, restart and repair all happened inside the flood
	KindLabRestarted    = "lab-restarted"     // the first box restarted (a new veth) and runs again
)

func (t *Topology) publicEnd() Endpoint {
	return Endpoint{Key: t.Public.String(), Label: "public decoy " + t.Public.String(), Addr: t.Public, Port: DecoyTCP}
}

func (t *Topology) gatewayEnd() Endpoint {
	g := t.Gateway.Addr()
	return Endpoint{Key: g.String(), Label: "gateway", Addr: g}
}

// Observe maps a probe result to the outcome its case compares with its expectation.
func Observe(c Case, res probes.Result) Outcome {
	if c.Kind == KindExposed && res.Outcome == probes.Open && !servedBy(c, res) {
		// The proxy took the connection but the box's listener never greeted through it:
		// the path to the box is not there.
		return Refused
	}
	if c.Kind == KindExposedBeyond && res.Outcome == probes.Dropped {
		return Refused // not reached either way: only an answer opens the exposure claim
	}
	switch c.Probe.Kind {
	case probes.KindDNS:
		if c.Expected == NoSuchName && res.DNS != nil && res.DNS.Answered {
			// An empty NOERROR (or records) tells that the name exists; only NXDOMAIN does not.
			if res.DNS.Rcode == "NXDOMAIN" {
				return NoSuchName
			}
			return Exists
		}
		if c.Expected == Fresh && res.Outcome == probes.Open && res.DNS != nil {
			if res.DNS.TTL < CacheTTL {
				return Cached
			}
			return Fresh
		}
		switch {
		case res.Outcome == probes.Open:
			return Answer
		case res.Outcome == probes.Refused && res.DNS != nil && res.DNS.Answered:
			return NoAnswer
		case res.Outcome == probes.Dropped:
			return Silence
		}
	case probes.KindDHCPFakeMAC, probes.KindDHCPSteal, probes.KindDHCPRelease:
		// A NAK or another address is as much "no lease" as silence: what matters is that
		// the address asked for (or any, for a fake client) was not given.
		switch res.Outcome {
		case probes.Open:
			return Lease
		case probes.Refused, probes.Dropped:
			return NoLease
		}
	case probes.KindFacts:
		if res.Outcome != probes.Open || res.Facts == nil {
			break
		}
		if c.Expected == Lease {
			if len(res.Facts.IPv4) > 0 {
				return Lease
			}
			return NoLease
		}
		if res.Facts.HasGlobalIPv6 {
			return HasIPv6
		}
		return None
	}
	if c.From == hostEnd.Key && res.Outcome == probes.CheckFailed && strings.Contains(res.Evidence, "operation not permitted") {
		// The host's own netfilter dropped the packet on output: sendmsg returns EPERM.
		// Nothing left the host towards the target, which is what "dropped" claims.
		return Dropped
	}
	return Outcome(res.Outcome)
}

// Judge sets every row's verdict. Positives pass when they saw what they expect. A negative
// passes only when it saw its expectation AND every control passed; a negative that saw
// something else is a FAIL (a hole), except silence where an answer was due or a probe
// that could not run, which establish nothing (check-failed).
func Judge(rows []*Row) {
	byID := map[string]*Row{}
	for _, r := range rows {
		byID[r.ID] = r
	}
	for _, r := range rows {
		if r.Expected.Negative() {
			continue
		}
		switch r.Observed {
		case r.Expected:
			r.Verdict, r.Why = Pass, ""
		case CheckFailed:
			r.Verdict, r.Why = NoCheck, r.Result.Evidence
		default:
			r.Verdict, r.Why = Fail, "expected "+string(r.Expected)+": "+r.Result.Evidence
		}
	}
	for _, r := range rows {
		if !r.Expected.Negative() {
			continue
		}
		switch {
		// A resolver that said nothing about a name, while the same resolver answered the
		// control, kept the answer from the box (the local-answers part drops dnsmasq's
		// own data): no answer reached it, which is the claim.
		case r.Observed == r.Expected || r.Observed == Silence && r.Expected == NoAnswer:
			r.Verdict, r.Why = Pass, ""
			for _, c := range r.Controls {
				if cr := byID[c]; cr == nil || cr.Verdict != Pass {
					r.Verdict, r.Why = NoCheck, "control "+c+" did not pass"
					break
				}
			}
		case r.Observed == CheckFailed || r.Observed == Silence || r.Observed == Dropped && r.Expected == NoAnswer:
			r.Verdict, r.Why = NoCheck, "no verdict: "+string(r.Observed)+": "+r.Result.Evidence
		default:
			r.Verdict, r.Why = Fail, "HOLE: observed "+string(r.Observed)+" ("+r.Result.Evidence+")"
		}
	}
}

// Complete checks a judged table: every planned case observed once, every row judged.
func Complete(cases []Case, rows []*Row) error {
	got := map[string]int{}
	for _, r := range rows {
		got[r.ID]++
		if r.Verdict == "" {
			return fmt.Errorf("case %s was not judged", r.ID)
		}
	}
	var missing []string
	for _, c := range cases {
		if got[c.ID] != 1 {
			missing = append(missing, fmt.Sprintf("%s (observed %d times)", c.ID, got[c.ID]))
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("truth table incomplete: %s", strings.Join(missing, ", "))
	}
	if len(rows) != len(cases) {
		return fmt.Errorf("truth table has %d rows for %d planned cases", len(rows), len(cases))
	}
	return nil
}

// RowsOf returns unobserved rows for cases, in plan order.
func RowsOf(cases []Case) []*Row {
	out := make([]*Row, len(cases))
	for i, c := range cases {
		out[i] = &Row{Case: c}
	}
	return out
}

// ExpectedRed is what a seeded hole must turn red: the negative rows every one of whose
// holding terms lost a layer.
func ExpectedRed(rows []*Row, off []Layer) []string {
	var ids []string
	for _, r := range rows {
		if r.Expected.Negative() && r.Holds.OpenWithout(off) {
			ids = append(ids, r.ID)
		}
	}
	return ids
}

// LayersOf lists every layer the rows name, sorted.
func LayersOf(rows []ClaimRow) []Layer {
	var ls []Layer
	for _, r := range rows {
		for _, t := range r.Holds {
			for _, l := range t {
				if !slices.Contains(ls, l) {
					ls = append(ls, l)
				}
			}
		}
	}
	slices.Sort(ls)
	return ls
}
