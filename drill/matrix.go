package drill

import (
	"context"
	"fmt"
	"net/netip"
	"strings"
	"sync"
	"time"

	"github.com/claudebox/claudebox/drill/probes"
)

// Matrix is one evaluation of every row.
type Matrix struct {
	Rows    []*Row        `json:"rows"`
	Elapsed time.Duration `json:"elapsed_ns"`
	// DecoyHits and DecoyQueries are what the decoy saw: the other end of "open" verdicts.
	DecoyHits    []probes.Hit            `json:"decoy_hits,omitempty"`
	DecoyQueries []string                `json:"decoy_queries,omitempty"`
	BoxHits      map[string][]probes.Hit `json:"box_hits,omitempty"`
}

// Counts tallies verdicts.
func (m *Matrix) Counts() (pass, fail, cf int) {
	for _, r := range m.Rows {
		switch r.Verdict {
		case Pass:
			pass++
		case Fail:
			fail++
		default:
			cf++
		}
	}
	return
}

// OK is true when every row passed.
func (m *Matrix) OK() bool {
	_, f, c := m.Counts()
	return m != nil && f == 0 && c == 0
}

type rowSet struct {
	rows []*Row
	ids  map[string]*Row
	t    time.Duration
}

func (s *rowSet) add(r *Row) *Row {
	if _, dup := s.ids[r.ID]; dup {
		return s.ids[r.ID]
	}
	if r.Probe.Timeout == 0 {
		r.Probe.Timeout = s.t
	}
	r.Probe.ID = r.ID
	r.Holds = HoldsFor(r.Claim, r.Kind)
	r.Layers = r.Holds.String()
	s.rows = append(s.rows, r)
	s.ids[r.ID] = r
	return r
}

func tcp(target netip.Addr, port int) probes.Spec {
	return probes.Spec{Kind: probes.KindTCP, Target: target.String(), Port: port}
}
func udp(target netip.Addr, port int) probes.Spec {
	return probes.Spec{Kind: probes.KindUDP, Target: target.String(), Port: port}
}
func icmp(target netip.Addr) probes.Spec {
	return probes.Spec{Kind: probes.KindICMP, Target: target.String()}
}
func dnsq(server netip.Addr, name, typ string) probes.Spec {
	return probes.Spec{Kind: probes.KindDNS, DNS: &probes.DNSQuery{Server: server.String(), Name: name, Type: typ}}
}

// BuildRows turns the claims table into probe rows for this topology.
func (e *engine) buildRows() []*Row {
	s := &rowSet{ids: map[string]*Row{}, t: e.o.Timeout}
	gw := e.gateway.Addr()
	d := e.decoy
	for _, a := range e.boxes {
		A := a.Name
		// Positive controls and the internet claim of A.
		s.add(&Row{ID: "ctl/" + A + "/self-tcp", Claim: ClaimControl, Kind: "self", From: A, To: A, Probe: tcp(a.IPv4, probes.DefaultTCPPort), Expected: ExpectOpen})
		s.add(&Row{ID: "ctl/" + A + "/self-udp", Claim: ClaimControl, Kind: "self", From: A, To: A, Probe: udp(a.IPv4, probes.DefaultUDPPort), Expected: ExpectOpen})
		if a.LL.IsValid() {
			s.add(&Row{ID: "ctl/" + A + "/self-tcp6ll", Claim: ClaimControl, Kind: "self", From: A, To: A,
				Probe: probes.Spec{Kind: probes.KindTCP6LL, Target: a.LL.String(), Port: probes.DefaultTCPPort}, Expected: ExpectOpen})
		}
		s.add(&Row{ID: "ctl/" + A + "/arp-gateway", Claim: ClaimControl, Kind: "arp", From: A, To: "gateway",
			Probe: probes.Spec{Kind: probes.KindARP, Target: gw.String()}, Expected: ExpectOpen})
		s.add(&Row{ID: "ctl/" + A + "/lease", Claim: ClaimControl, Kind: "lease", From: A, To: A,
			Probe: probes.Spec{Kind: probes.KindFacts}, Expected: ExpectLease})
		inetTCP := s.add(&Row{ID: "internet/" + A + "/tcp", Claim: ClaimInternet, Kind: "tcp", From: A, To: "public decoy " + d.Public.String(),
			Probe: tcp(d.Public, DecoyTCP), Expected: ExpectOpen}).ID
		inetDNS := s.add(&Row{ID: "internet/" + A + "/dns", Claim: ClaimInternet, Kind: "dns", From: A, To: "gateway DNS: " + d.PublicName,
			Probe: dnsq(gw, d.PublicName, "A"), Expected: ExpectAnswer}).ID

		for _, b := range e.boxes {
			if b == a {
				continue
			}
			B := b.Name
			selfTCP, selfUDP := "ctl/"+B+"/self-tcp", "ctl/"+B+"/self-udp"
			s.add(&Row{ID: "box-box/" + A + ">" + B + "/tcp", Claim: ClaimBoxBox, Kind: "tcp", From: A, To: B,
				Probe: tcp(b.IPv4, probes.DefaultTCPPort), Expected: ExpectDropped, Controls: []string{selfTCP, inetTCP}})
			s.add(&Row{ID: "box-box/" + A + ">" + B + "/udp", Claim: ClaimBoxBox, Kind: "udp", From: A, To: B,
				Probe: udp(b.IPv4, probes.DefaultUDPPort), Expected: ExpectDropped, Controls: []string{selfUDP, inetTCP}})
			s.add(&Row{ID: "box-box/" + A + ">" + B + "/icmp", Claim: ClaimBoxBox, Kind: "icmp", From: A, To: B,
				Probe: icmp(b.IPv4), Expected: ExpectDropped, Controls: []string{selfTCP, inetTCP}})
			s.add(&Row{ID: "box-box-l2/" + A + ">" + B + "/arp", Claim: ClaimBoxBoxL2, Kind: "arp", From: A, To: B,
				Probe: probes.Spec{Kind: probes.KindARP, Target: b.IPv4.String()}, Expected: ExpectDropped,
				Controls: []string{"ctl/" + A + "/arp-gateway"}})
			if b.LL.IsValid() {
				s.add(&Row{ID: "box-box-l2/" + A + ">" + B + "/tcp6ll", Claim: ClaimBoxBoxL2, Kind: "tcp6ll", From: A, To: B,
					Probe: probes.Spec{Kind: probes.KindTCP6LL, Target: b.LL.String(), Port: probes.DefaultTCPPort}, Expected: ExpectDropped,
					Controls: []string{"ctl/" + B + "/self-tcp6ll"}})
			}
			names := []struct{ kind, name, typ string }{
				{"dns-instance", B, "A"},
				{"dns-hostname", b.Hostname, "A"},
				{"dns-hostname-fqdn", b.Hostname + "." + e.domain, "A"},
				{"dns-ptr", b.IPv4.String(), "PTR"},
			}
			for _, n := range names {
				s.add(&Row{ID: "box-box-name/" + A + ">" + B + "/" + n.kind, Claim: ClaimBoxBoxName, Kind: n.kind, From: A, To: B,
					Probe: dnsq(gw, n.name, n.typ), Expected: ExpectNoAnswer, Controls: []string{inetDNS}})
			}
		}
		for _, hn := range e.hostNames {
			s.add(&Row{ID: "host-names/" + A + "/" + hn, Claim: ClaimHostNames, Kind: "dns", From: A, To: "host name " + hn,
				Probe: dnsq(gw, hn, "A"), Expected: ExpectNoAnswer, Controls: []string{inetDNS}})
		}
		for _, h := range e.hostAddrs {
			kind, to := "host-addr", "host "+h.String()
			if h == gw {
				kind, to = "gateway", "gateway "+h.String()
			}
			s.add(&Row{ID: "box-host/" + A + ">" + h.String() + "/tcp", Claim: ClaimBoxHost, Kind: kind, From: A, To: to,
				Probe: tcp(h, e.hostTCP), Expected: ExpectDropped, Controls: []string{"ctl/host>" + h.String() + "/tcp", inetDNS}})
			s.add(&Row{ID: "box-host/" + A + ">" + h.String() + "/udp", Claim: ClaimBoxHost, Kind: kind, From: A, To: to,
				Probe: udp(h, e.hostUDP), Expected: ExpectDropped, Controls: []string{"ctl/host>" + h.String() + "/udp", inetDNS}})
		}
		for _, t := range d.Targets {
			if t.Range == "public" {
				continue
			}
			claim := ClaimLAN
			if strings.HasPrefix(t.Range, "100.64") || strings.HasPrefix(t.Range, "169.254") {
				claim = ClaimCGNAT
			}
			ts := t.Addr.String()
			for _, port := range t.Ports {
				s.add(&Row{ID: fmt.Sprintf("decoy/%s>%s/tcp%d", A, ts, port), Claim: claim, Kind: "tcp", From: A, To: "decoy " + ts,
					Probe: tcp(t.Addr, port), Expected: ExpectDropped, Controls: []string{fmt.Sprintf("ctl/host>%s/tcp%d", ts, port)}})
			}
			s.add(&Row{ID: "decoy/" + A + ">" + ts + "/udp", Claim: claim, Kind: "udp", From: A, To: "decoy " + ts,
				Probe: udp(t.Addr, DecoyUDP), Expected: ExpectDropped, Controls: []string{"ctl/host>" + ts + "/udp"}})
			s.add(&Row{ID: "decoy/" + A + ">" + ts + "/icmp", Claim: claim, Kind: "icmp", From: A, To: "decoy " + ts,
				Probe: icmp(t.Addr), Expected: ExpectDropped, Controls: []string{"ctl/host>" + ts + "/icmp"}})
		}
		s.add(&Row{ID: "ipv6/" + A, Claim: ClaimIPv6, Kind: "facts", From: A, To: A,
			Probe: probes.Spec{Kind: probes.KindFacts}, Expected: ExpectNone, Controls: []string{"ctl/" + A + "/lease"}})
	}
	// From the host.
	for _, b := range e.boxes {
		B := b.Name
		s.add(&Row{ID: "host-box/host>" + B + "/tcp", Claim: ClaimHostBox, Kind: "tcp", From: "host", To: B,
			Probe: tcp(b.IPv4, probes.DefaultTCPPort), Expected: ExpectDropped, Controls: []string{"ctl/" + B + "/self-tcp"}})
		s.add(&Row{ID: "host-box/host>" + B + "/udp", Claim: ClaimHostBox, Kind: "udp", From: "host", To: B,
			Probe: udp(b.IPv4, probes.DefaultUDPPort), Expected: ExpectDropped, Controls: []string{"ctl/" + B + "/self-udp"}})
	}
	for _, h := range e.hostAddrs {
		s.add(&Row{ID: "ctl/host>" + h.String() + "/tcp", Claim: ClaimControl, Kind: "host-listener", From: "host", To: "host " + h.String(),
			Probe: tcp(h, e.hostTCP), Expected: ExpectOpen})
		s.add(&Row{ID: "ctl/host>" + h.String() + "/udp", Claim: ClaimControl, Kind: "host-listener", From: "host", To: "host " + h.String(),
			Probe: udp(h, e.hostUDP), Expected: ExpectOpen})
	}
	for _, t := range d.Targets {
		ts := t.Addr.String()
		for _, port := range t.Ports {
			s.add(&Row{ID: fmt.Sprintf("ctl/host>%s/tcp%d", ts, port), Claim: ClaimControl, Kind: "decoy", From: "host", To: "decoy " + ts,
				Probe: tcp(t.Addr, port), Expected: ExpectOpen})
		}
		s.add(&Row{ID: "ctl/host>" + ts + "/udp", Claim: ClaimControl, Kind: "decoy", From: "host", To: "decoy " + ts,
			Probe: udp(t.Addr, DecoyUDP), Expected: ExpectOpen})
		s.add(&Row{ID: "ctl/host>" + ts + "/icmp", Claim: ClaimControl, Kind: "decoy", From: "host", To: "decoy " + ts,
			Probe: icmp(t.Addr), Expected: ExpectOpen})
	}
	return s.rows
}

// execute runs rows grouped by where they run: one batch per box (its agent runs the batch
// concurrently) and the host's batch in-process, all at once on a bounded pool, so every
// probe of the batch shares one timeout window.
func (e *engine) execute(ctx context.Context, rows []*Row) {
	byFrom := map[string][]*Row{}
	var order []string
	for _, r := range rows {
		if _, ok := byFrom[r.From]; !ok {
			order = append(order, r.From)
		}
		byFrom[r.From] = append(byFrom[r.From], r)
	}
	boxes := map[string]*Box{}
	for _, b := range e.boxes {
		boxes[b.Name] = b
	}
	var wg sync.WaitGroup
	sem := make(chan struct{}, 16)
	for _, from := range order {
		batch := byFrom[from]
		wg.Add(1)
		go func() {
			defer wg.Done()
			sem <- struct{}{}
			defer func() { <-sem }()
			specs := make([]probes.Spec, len(batch))
			for i, r := range batch {
				specs[i] = r.Probe
			}
			var res []probes.Result
			var err error
			if from == "host" {
				res = probes.RunMany(ctx, specs)
			} else if b := boxes[from]; b != nil {
				res, err = e.runInBox(ctx, b, specs)
			} else {
				err = fmt.Errorf("no box %s", from)
			}
			for i, r := range batch {
				if err != nil {
					r.Result = probes.Result{Probe: r.Probe, Outcome: probes.CheckFailed, Evidence: err.Error()}
				} else {
					r.Result = res[i]
				}
				r.Observed = observe(r)
			}
		}()
	}
	wg.Wait()
}

// matrix builds the rows, verifies the decoy routes, runs everything in one window, retries
// failed positive controls once (never a negative), collects the other ends' evidence and
// judges every row.
func (e *engine) matrix(ctx context.Context, _ []Layer) (*Matrix, error) {
	t := time.Now()
	if err := e.decoy.VerifyRoutes(); err != nil {
		return nil, err
	}
	m := &Matrix{Rows: e.buildRows()}
	e.execute(ctx, m.Rows)
	var retry []*Row
	for _, r := range m.Rows {
		if !r.Expected.Negative() && r.Observed != string(r.Expected) {
			retry = append(retry, r)
		}
	}
	if len(retry) > 0 {
		e.execute(ctx, retry)
		for _, r := range retry {
			r.Retried = true
		}
	}
	judge(m.Rows)
	m.DecoyHits = e.decoy.Hits()
	m.DecoyQueries = e.decoy.Queries()
	m.BoxHits = map[string][]probes.Hit{}
	var mu sync.Mutex
	var wg sync.WaitGroup
	for _, b := range e.boxes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			h := e.hits(ctx, b)
			mu.Lock()
			m.BoxHits[b.Name] = h
			mu.Unlock()
		}()
	}
	wg.Wait()
	e.annotate(m)
	m.Elapsed = time.Since(t)
	return m, nil
}

// judge sets every row's verdict. Positives pass when they saw what they expect. A negative
// passes only when it saw its expectation AND every control passed; a negative that saw
// something else is a FAIL (a hole), except silence or a probe that could not run, which
// establish nothing (check-failed).
func judge(rows []*Row) {
	byID := map[string]*Row{}
	for _, r := range rows {
		byID[r.ID] = r
	}
	for _, r := range rows {
		if !r.Expected.Negative() {
			switch {
			case r.Observed == string(r.Expected):
				r.Verdict = Pass
			case r.Observed == string(probes.CheckFailed):
				r.Verdict, r.Why = CheckFailed, r.Result.Evidence
			default:
				r.Verdict, r.Why = Fail, "expected "+string(r.Expected)+": "+r.Result.Evidence
			}
		}
	}
	for _, r := range rows {
		if !r.Expected.Negative() {
			continue
		}
		switch {
		case r.Observed == string(r.Expected):
			r.Verdict = Pass
			for _, c := range r.Controls {
				cr := byID[c]
				if cr == nil || cr.Verdict != Pass {
					r.Verdict, r.Why = CheckFailed, "control "+c+" did not pass"
					break
				}
			}
		case r.Observed == string(probes.CheckFailed) || r.Observed == "silence" || r.Observed == string(probes.Dropped) && r.Expected == ExpectNoAnswer:
			r.Verdict, r.Why = CheckFailed, "no verdict: "+r.Observed+": "+r.Result.Evidence
		default:
			r.Verdict, r.Why = Fail, "HOLE: observed "+r.Observed+" ("+r.Result.Evidence+")"
		}
	}
}

// annotate adds the other end's view to open verdicts: the decoy's or the box's hits.
func (e *engine) annotate(m *Matrix) {
	for _, r := range m.Rows {
		if r.Observed != string(probes.Open) || r.Expected == ExpectOpen {
			continue
		}
		port := r.Probe.Port
		var seen []string
		check := func(hs []probes.Hit) {
			for _, h := range hs {
				if h.Port == port && strings.Contains(h.Local, strings.Trim(r.Probe.Target, "[]")) {
					seen = append(seen, h.Proto+" from "+h.Peer)
				}
			}
		}
		check(m.DecoyHits)
		if hs, ok := m.BoxHits[r.To]; ok {
			check(hs)
		}
		if len(seen) > 0 {
			r.Why += "; the target saw " + strings.Join(seen, ", ")
		}
	}
}
