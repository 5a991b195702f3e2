package probes

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strings"
	"sync"
	"time"
)

// Outcome is what one probe observed. The four values are the drill's vocabulary
// (DESIGN.md): the engine compares them with the claim's expected outcome.
type Outcome string

const (
	// Open: connected, echoed, answered (for DNS: answered with records).
	Open Outcome = "open"
	// Refused: something on the path answered "no" (RST, ICMP unreachable, or for
	// DNS a resolver answer without records): the packet arrived somewhere.
	Refused Outcome = "refused"
	// Dropped: silence until the timeout (for ARP/ND: nobody answered who-has).
	Dropped Outcome = "dropped"
	// CheckFailed: the probe itself could not run (bad spec, no interface, no
	// route, socket error). Never a pass.
	CheckFailed Outcome = "check-failed"
)

// Kind names a probe. An alias of string for now, so the engine's code that
// prints or compares kinds as strings keeps building; the constants below are
// the only values Validate accepts.
type Kind = string

// Probe kinds accepted in Spec.Kind.
const (
	KindTCP    Kind = "tcp"
	KindUDP    Kind = "udp"
	KindICMP   Kind = "icmp"
	KindARP    Kind = "arp"
	KindTCP6LL Kind = "tcp6ll"
	KindDNS    Kind = "dns"
	KindHTTP   Kind = "http"
	KindFacts  Kind = "facts"

	// The active kinds (spoofing, odd frames, the re-apply window): see doc.go.
	KindFlood       Kind = "flood"
	KindSpoofUDP    Kind = "spoof-udp"
	KindARPSpoof    Kind = "arp-spoof"
	KindMACSpoof    Kind = "mac-spoof"
	KindDHCPRelease Kind = "dhcp-release"
	KindDHCPSteal   Kind = "dhcp-steal"
	KindDHCPFakeMAC Kind = "dhcp-fake-mac"
	KindDHCPRelay   Kind = "dhcp-relay"
	KindFrame       Kind = "frame"

	// The resource kinds (issue 14: stresses against the box's limits, and their
	// controls): see doc.go and resource.go.
	KindForkBomb Kind = "fork-bomb"
	KindSpawn    Kind = "spawn"
	KindMemHog   Kind = "mem-hog"
	KindAlloc    Kind = "alloc"
	KindDiskFill Kind = "disk-fill"
	KindWrite    Kind = "write"
	KindCPUBurn  Kind = "cpu-burn"
	KindLatency  Kind = "latency"

	// What a box may ask beyond its limits: see boundary.go.
	KindStat      Kind = "stat"
	KindSubvolume Kind = "subvolume"
)

// AllKinds lists every kind, in the order of doc.go.
var AllKinds = []Kind{KindTCP, KindUDP, KindICMP, KindARP, KindTCP6LL, KindDNS, KindHTTP, KindFacts,
	KindFlood, KindSpoofUDP, KindARPSpoof, KindMACSpoof, KindDHCPRelease, KindDHCPSteal, KindDHCPFakeMAC, KindDHCPRelay, KindFrame,
	KindForkBomb, KindSpawn, KindMemHog, KindAlloc, KindDiskFill, KindWrite, KindCPUBurn, KindLatency, KindStat, KindSubvolume}

// DefaultTimeout applies when Spec.Timeout is zero.
const DefaultTimeout = 2 * time.Second

// DefaultIface is the box's only NIC under Incus.
const DefaultIface = "eth0"

// Spec describes one probe as data, so the engine can ship a batch as JSON.
type Spec struct {
	// ID is the engine's label for the row; echoed back untouched.
	ID   string `json:"id,omitempty"`
	Kind Kind   `json:"kind"`
	// Target: an IP literal (IPv6 may carry a %zone), or a host name for
	// tcp/udp/http (resolved first; a failed lookup is check-failed), or a full
	// http:// URL for http. Unused for dns (see DNS.Server) and facts.
	Target string `json:"target,omitempty"`
	Port   int    `json:"port,omitempty"`
	// Timeout bounds the whole probe. JSON: a Go duration string ("500ms"),
	// or a number of nanoseconds.
	Timeout time.Duration `json:"timeout,omitempty"`
	// Iface binds the probe to an interface (SO_BINDTODEVICE); arp and tcp6ll
	// default to the route's interface / eth0, facts reports it as "the lease".
	Iface string    `json:"iface,omitempty"`
	DNS   *DNSQuery `json:"dns,omitempty"`
	// Payload: UDP datagram to echo (default: a random token), HTTP path for
	// http when Target is not a URL; for the active kinds the marker their
	// frames carry (MarkerPrefix is added when missing; default random).
	Payload string `json:"payload,omitempty"`

	// One sub-struct per family of active kinds.
	Flood *FloodSpec `json:"flood,omitempty"`
	Spoof *SpoofSpec `json:"spoof,omitempty"`
	DHCP  *DHCPSpec  `json:"dhcp,omitempty"`
	Frame *FrameSpec `json:"frame,omitempty"`
	// Resource tunes the resource kinds (nil: the defaults).
	Resource *ResourceSpec `json:"resource,omitempty"`
}

// DNSQuery is the dns probe's question.
type DNSQuery struct {
	// Server is "addr" or "addr:port" (port 53 by default); empty means the
	// first nameserver of /etc/resolv.conf.
	Server string `json:"server,omitempty"`
	// Name to ask about; for PTR an IP literal is turned into its reverse name.
	Name string `json:"name"`
	// Type is A (default), AAAA, PTR or TXT.
	Type string `json:"type,omitempty"`
	// Class is IN (default) or CH (CHAOS: servers.bind, version.bind; CH
	// takes TXT only).
	Class string `json:"class,omitempty"`
	// TCP asks over TCP (one connection, one exchange) instead of UDP.
	TCP bool `json:"tcp,omitempty"`
}

// DNSAnswer is what the resolver said, kept apart from Outcome so the engine can
// require "the resolver actually answered" for a no-answer verdict.
type DNSAnswer struct {
	// Answered is true only when a DNS response came back (any rcode).
	Answered bool `json:"answered"`
	// Rcode is the response code name (NOERROR, NXDOMAIN, REFUSED, SERVFAIL...).
	Rcode   string   `json:"rcode,omitempty"`
	Records []string `json:"records,omitempty"`
	// TTL is the lowest TTL of the answer records (0 without records): an answer from a
	// resolver's cache has its TTL counted down.
	TTL uint32 `json:"ttl,omitempty"`
	// Server is the address that was asked.
	Server string `json:"server,omitempty"`
}

// Result is one probe's observation.
type Result struct {
	Probe   Spec    `json:"probe"`
	Outcome Outcome `json:"outcome"`
	// Evidence is human-readable: the error text, the ICMP type, the rcode.
	Evidence string `json:"evidence,omitempty"`
	// RTT is the time from first send to the deciding answer (zero when dropped).
	RTT time.Duration `json:"rtt_ns,omitempty"`
	// Answer: who answered and what — the peer address (tcp/udp/icmp, or the
	// router that sent the ICMP error), the MAC (arp), "A 1.2.3.4 ..." (dns),
	// the status line (http).
	Answer string `json:"answer,omitempty"`
	// Local is the local address the probe used, when known.
	Local string     `json:"local,omitempty"`
	DNS   *DNSAnswer `json:"dns_answer,omitempty"`
	Facts *Facts     `json:"facts,omitempty"`
	// Counts: what an active kind sent and saw (nil for the others).
	Counts *Counts `json:"counts,omitempty"`
	// DHCPReply: the deciding DHCP reply of a dhcp-* kind.
	DHCPReply *DHCPReply `json:"dhcp_reply,omitempty"`
	// Resource: what a resource kind did (nil for the others).
	Resource *ResourceResult `json:"resource,omitempty"`
	// Started is when the probe began (UTC) and Elapsed how long it ran.
	Started time.Time     `json:"started"`
	Elapsed time.Duration `json:"elapsed_ns"`
}

type specAlias Spec

// MarshalJSON writes Timeout as a duration string so hand-written and
// machine-written specs look alike.
func (s Spec) MarshalJSON() ([]byte, error) {
	var t string
	if s.Timeout != 0 {
		t = s.Timeout.String()
	}
	return json.Marshal(struct {
		specAlias
		Timeout string `json:"timeout,omitempty"`
	}{specAlias(s), t})
}

// UnmarshalJSON accepts Timeout as a duration string or nanoseconds and
// rejects unknown fields, so a typo in the engine fails loudly instead of
// silently probing the wrong thing.
func (s *Spec) UnmarshalJSON(b []byte) error {
	aux := struct {
		*specAlias
		Timeout json.RawMessage `json:"timeout,omitempty"`
	}{specAlias: (*specAlias)(s)}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&aux); err != nil {
		return err
	}
	d, err := parseDurationJSON(aux.Timeout)
	if err != nil {
		return fmt.Errorf("timeout: %w", err)
	}
	s.Timeout = d
	return nil
}

// Validate reports a spec the engine should never have built.
func (s Spec) Validate() error {
	if s.Timeout < 0 || (s.Timeout != 0 && s.Timeout < time.Millisecond) {
		return fmt.Errorf("timeout %v: want >= 1ms (a JSON number is nanoseconds)", s.Timeout)
	}
	needPort := func() error {
		if s.Port < 1 || s.Port > 65535 {
			return fmt.Errorf("%s probe: port %d out of range", s.Kind, s.Port)
		}
		return nil
	}
	needTarget := func() error {
		if s.Target == "" {
			return fmt.Errorf("%s probe: target is empty", s.Kind)
		}
		return nil
	}
	switch s.Kind {
	case KindTCP, KindUDP, KindTCP6LL:
		if err := needTarget(); err != nil {
			return err
		}
		return needPort()
	case KindICMP, KindARP:
		return needTarget()
	case KindHTTP:
		if err := needTarget(); err != nil {
			return err
		}
		if strings.Contains(s.Target, "://") {
			return nil
		}
		return needPort()
	case KindDNS:
		if s.DNS == nil || s.DNS.Name == "" {
			return errors.New("dns probe: dns.name is empty")
		}
		switch strings.ToUpper(s.DNS.Type) {
		case "", "A", "AAAA", "PTR", "TXT":
		default:
			return fmt.Errorf("dns probe: type %q: want A, AAAA, PTR or TXT", s.DNS.Type)
		}
		switch strings.ToUpper(s.DNS.Class) {
		case "", "IN":
		case "CH", "CHAOS":
			if strings.ToUpper(s.DNS.Type) != "TXT" {
				return fmt.Errorf("dns probe: class CH takes type TXT, not %q", s.DNS.Type)
			}
		default:
			return fmt.Errorf("dns probe: class %q: want IN or CH", s.DNS.Class)
		}
		return nil
	case KindFacts, KindSubvolume:
		return nil
	case KindStat:
		return needTarget()
	case KindFlood, KindSpoofUDP, KindARPSpoof, KindMACSpoof, KindDHCPRelease, KindDHCPSteal, KindDHCPFakeMAC, KindDHCPRelay, KindFrame:
		return s.validateActive()
	case KindForkBomb, KindSpawn, KindMemHog, KindAlloc, KindDiskFill, KindWrite, KindCPUBurn, KindLatency:
		return s.validateResource()
	case "":
		return errors.New("probe kind is empty")
	default:
		return fmt.Errorf("unknown probe kind %q (want one of %s)", s.Kind, strings.Join(AllKinds, ", "))
	}
}

func (s Spec) withDefaults() Spec {
	if s.Timeout == 0 {
		s.Timeout = defaultTimeout(s)
		if IsResourceKind(s.Kind) {
			s.Timeout = resourceTimeout(s)
		}
	}
	return s
}

// Run executes one probe and never panics or returns an error: anything that
// stops the probe from running is a CheckFailed result with the reason.
func Run(ctx context.Context, s Spec) (r Result) {
	s = s.withDefaults()
	r = Result{Probe: s, Started: time.Now().UTC()}
	defer func() {
		if p := recover(); p != nil {
			r.Outcome, r.Evidence = CheckFailed, fmt.Sprintf("probe panicked: %v", p)
		}
		r.Elapsed = time.Since(r.Started)
	}()
	if err := s.Validate(); err != nil {
		r.Outcome, r.Evidence = CheckFailed, err.Error()
		return r
	}
	if err := ctx.Err(); err != nil {
		r.Outcome, r.Evidence = CheckFailed, "not started: "+err.Error()
		return r
	}
	ctx, cancel := context.WithTimeout(ctx, s.Timeout)
	defer cancel()
	switch s.Kind {
	case KindTCP:
		probeTCP(ctx, s, &r)
	case KindTCP6LL:
		probeTCP6LL(ctx, s, &r)
	case KindUDP:
		probeUDP(ctx, s, &r)
	case KindICMP:
		probeICMP(ctx, s, &r)
	case KindARP:
		probeARP(ctx, s, &r)
	case KindDNS:
		probeDNS(ctx, s, &r)
	case KindHTTP:
		probeHTTP(ctx, s, &r)
	case KindFacts:
		probeFacts(s, &r)
	case KindStat:
		probeStat(s, &r)
	case KindSubvolume:
		probeSubvolume(s, &r)
	case KindForkBomb, KindSpawn, KindMemHog, KindAlloc, KindDiskFill, KindWrite, KindCPUBurn, KindLatency:
		runResource(ctx, s, &r)
	default:
		runActive(ctx, s, &r)
	}
	return r
}

// RunMany runs every spec concurrently, so all of them share one timeout window
// (the batch takes about as long as its slowest probe). Results keep the
// order of specs.
func RunMany(ctx context.Context, specs []Spec) []Result {
	out := make([]Result, len(specs))
	var wg sync.WaitGroup
	for i := range specs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			out[i] = Run(ctx, specs[i])
		}()
	}
	wg.Wait()
	return out
}

// resolveTarget turns Target into one address. Host names are looked up first,
// within the probe's deadline, and a failed lookup is the probe's own failure
// (check-failed), never "dropped".
// routableTarget resolves a target and asks the kernel for a route to it: a probe that
// could not leave is check-failed, never dropped.
func routableTarget(ctx context.Context, target, iface string) (netip.Addr, error) {
	dst, err := resolveTarget(ctx, target, false)
	if err != nil {
		return dst, err
	}
	_, err = routeCheck(dst, iface)
	return dst, err
}

func resolveTarget(ctx context.Context, target string, want4 bool) (netip.Addr, error) {
	if a, err := netip.ParseAddr(target); err == nil {
		return a.Unmap(), nil
	}
	if strings.ContainsAny(target, ":%/") {
		return netip.Addr{}, fmt.Errorf("target %q is not an IP address or host name", target)
	}
	addrs, err := net.DefaultResolver.LookupNetIP(ctx, "ip", target)
	if err != nil {
		return netip.Addr{}, fmt.Errorf("resolving %q: %w", target, err)
	}
	for _, a := range addrs {
		if !want4 || a.Unmap().Is4() {
			return a.Unmap(), nil
		}
	}
	return netip.Addr{}, fmt.Errorf("resolving %q: no usable address in %v", target, addrs)
}
