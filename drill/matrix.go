package drill

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/claudebox/claudebox/drill/probes"
	"github.com/claudebox/claudebox/firewall"
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
	if rb := e.resBox; rb != nil {
		boxes[rb.Name] = rb
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
			if from == hostEnd.Key {
				res = probes.RunMany(ctx, specs)
			} else if from == decoyEnd.Key {
				res, err = e.runInNS(ctx, e.decoy.NS, specs)
			} else if from == foreignEnd.Key && e.foreign != nil {
				res, err = e.runInNS(ctx, e.foreign.NS, specs)
			} else if b := boxes[from]; b != nil {
				res, err = e.runInBox(ctx, b, specs)
			} else if name, ok := nestedBox(from); ok && boxes[name] != nil {
				res, err = e.runInBox(ctx, boxes[name], specs, "--nested", nestedPrefix(e.decoy).String())
			} else {
				err = fmt.Errorf("no box %s", from)
			}
			for i, r := range batch {
				if err != nil {
					r.Result = probes.Result{Probe: r.Probe, Outcome: probes.CheckFailed, Evidence: err.Error()}
				} else {
					r.Result = res[i]
				}
				r.Observed = Observe(r.Case, r.Result)
			}
		}()
	}
	wg.Wait()
}

// matrix plans the claim rows on what the lab built, runs the re-apply window, then every
// other row in one batch (re-run if another writer touched nftables meanwhile), retries
// failed positive controls once (never a negative), reads what every receiver heard and
// judges every row.
func (e *engine) matrix(ctx context.Context) (*Matrix, error) {
	t := time.Now()
	if err := e.decoy.VerifyRoutes(); err != nil {
		return nil, err
	}
	if err := e.foreignClash(); err != nil {
		return nil, err
	}
	e.rounds++
	if e.plansResources() {
		if err := e.mintResBox(ctx); err != nil {
			return nil, err
		}
	}
	topo := e.topology()
	cases, err := Plan(Claims, topo, e.o.Timeout)
	if err != nil {
		return nil, err
	}
	m := &Matrix{Rows: RowsOf(cases)}
	phase := map[string][]*Row{}
	for _, r := range m.Rows {
		phase[r.Window] = append(phase[r.Window], r)
	}
	batch := phase[""]
	// The DHCP rows start once dnsmasq is back from the window's re-apply and run beside
	// the rest (they wait out dnsmasq's ping before an offer).
	dhcpDone := make(chan struct{})
	startDHCP := func() {
		go func() {
			defer close(dhcpDone)
			// The boxes' own renewals first: one after a sibling's spoofed release would
			// put the released lease back before it is read.
			var own, abuse []*Row
			for _, r := range phase[WindowDHCP] {
				if r.Claim == ClaimControl {
					own = append(own, r)
				} else {
					abuse = append(abuse, r)
				}
			}
			e.execute(ctx, own)
			e.execute(ctx, abuse)
		}()
	}
	// The resource rows run on their own box beside the network rows: nothing they do
	// reaches the network. The CPU step waits for the window's floods to end, and its work
	// units are judged against the slower of just before and just after the burn (the
	// network rows load the host too: with 8 boxes a unit took 4.3x its time before the
	// burn, the burner not the cause). The disk step waits for the network rows: beside
	// them, incusd stalled for 10 s and more in 2 runs of about 12 (every exec into the
	// boxes timed out; the step fills a btrfs quota and resizes the root through Incus);
	// after them, 10 runs of 10 were clean. A hole that restarts the box for its step
	// (seccomp applies at start) would re-bind ports under the network rows: it runs last.
	windowDone, networkDone := make(chan struct{}), make(chan struct{})
	endWindow := sync.OnceFunc(func() { close(windowDone) })
	endNetwork := sync.OnceFunc(func() { close(networkDone) })
	gates := map[string]<-chan struct{}{WindowResCPU: windowDone, WindowResDisk: networkDone}
	resDone := make(chan struct{})
	resAlongside := !slices.Contains(e.holeOff, LayerBoxSubvolDeny)
	if resAlongside {
		go func() { defer close(resDone); e.resourcePhase(ctx, phase, gates) }()
	}
	// However the matrix ends, the gates open and a resource phase running alongside has
	// ended (put its limits back) before it returns.
	defer func() {
		endWindow()
		endNetwork()
		if resAlongside {
			<-resDone
		}
	}()
	err = e.window(ctx, phase[WindowReapply], startDHCP)
	endWindow()
	// The cache rows once dnsmasq is back from the re-apply (a restart empties its cache),
	// beside the rest.
	cacheDone := make(chan struct{})
	go func() { defer close(cacheDone); e.cachePhase(ctx, phase[WindowCache]) }()
	defer func() { <-cacheDone }()
	if err != nil {
		<-dhcpDone
		return nil, err
	}
	e.awaitDAD(ctx)
	if err := e.awaitExposure(); err != nil {
		<-dhcpDone
		return nil, err
	}
	if err := e.undisturbed(ctx, batch); err != nil {
		<-dhcpDone
		return nil, err
	}
	var retry []*Row
	for _, r := range batch {
		if !r.Expected.Negative() && r.Observed != r.Expected {
			retry = append(retry, r)
		}
	}
	if len(retry) > 0 {
		if err := e.undisturbed(ctx, retry); err != nil {
			return nil, err
		}
		for _, r := range retry {
			r.Retried = true
		}
	}
	// The spoofs move the host's neighbour entries when a hole lets them (an ARP is-at for a
	// sibling's address): a DNS answer to that sibling then goes to the spoofer. The cache
	// rows must be over first (a self-test once saw one of them get silence that way).
	<-cacheDone
	e.spoofPhase(ctx, phase[WindowSpoof])
	<-dhcpDone
	e.leasesIntact(ctx, phase[WindowLeases])
	e.soak(ctx, phase[WindowSoak])
	saved := e.restartPhase(ctx, phase[WindowRestart])
	endNetwork()
	if resAlongside {
		<-resDone
	} else {
		e.resourcePhase(ctx, phase, gates)
	}
	<-cacheDone
	hits := e.allHits(ctx)
	for name, hs := range saved {
		hits[name] = append(hs, hits[name]...)
	}
	natSeen(m.Rows, hits["decoy"], topo.Gateway.Masked(), t)
	heard(m.Rows, hits, t)
	Judge(m.Rows)
	if err := Complete(cases, m.Rows); err != nil {
		return nil, err
	}
	m.DecoyHits, m.DecoyQueries, m.BoxHits = hits["decoy"], e.decoy.Queries(), map[string][]probes.Hit{}
	for _, b := range e.boxes {
		m.BoxHits[b.Name] = hits[b.Name]
	}
	e.annotate(m)
	if e.o.SelfTest {
		e.dropResBox(ctx)
	}
	m.Elapsed = time.Since(t)
	return m, nil
}

// cachePhase: the primes (a sibling asks a name nobody asked) first, then, once a whole
// second has passed (a cached TTL counts down in seconds), the rows that ask it again.
func (e *engine) cachePhase(ctx context.Context, rows []*Row) {
	if len(rows) == 0 {
		return
	}
	var primes, rest []*Row
	for _, r := range rows {
		if r.Claim == ClaimControl {
			primes = append(primes, r)
		} else {
			rest = append(rest, r)
		}
	}
	e.execute(ctx, primes)
	select {
	case <-ctx.Done():
	case <-time.After(1100 * time.Millisecond):
	}
	e.execute(ctx, rest)
}

// undisturbed runs a batch under a watch of nftables: a batch during which another process
// committed a ruleset generation (Incus re-applying a network, an admin, another tool) is
// re-run instead of judged; after three disturbed runs its rows are check-failed.
func (e *engine) undisturbed(ctx context.Context, rows []*Row) error {
	for try := 1; ; try++ {
		w, err := firewall.Watch()
		if err != nil {
			return err
		}
		e.execute(ctx, rows)
		others := e.relevant(firewall.ByOthers(w.Stop()))
		if len(others) == 0 {
			return nil
		}
		g := others[0]
		why := fmt.Sprintf("%s (pid %d) changed nftables during the batch: %s", g.Comm, g.PID, strings.Join(g.Changes, ", "))
		if try == 3 {
			for _, r := range rows {
				r.Result = probes.Result{Probe: r.Probe, Outcome: probes.CheckFailed, Evidence: "disturbed three times; last: " + why}
				r.Observed = CheckFailed
			}
			return nil
		}
		e.progress("  %s: re-running the batch", why)
	}
}

// relevant keeps the generations that could change what this run's boxes can reach:
// anything but Incus's own chains of other networks and instances and other stacks'
// claudebox tables (other stacks of a test suite come and go on the same daemon).
func (e *engine) relevant(gens []firewall.Generation) []firewall.Generation {
	var out []firewall.Generation
	for _, g := range gens {
		var keep []string
		for _, c := range g.Changes {
			if e.concerns(c) {
				keep = append(keep, c)
			}
		}
		if len(keep) > 0 {
			g.Changes = keep
			out = append(out, g)
		}
	}
	return out
}

// concerns reads one change ("delchain inet incus fwd.claudenet") as this run's or not.
func (e *engine) concerns(change string) bool {
	f := strings.Fields(change)
	if len(f) < 3 {
		return true
	}
	table, obj := f[2], ""
	if len(f) > 3 {
		obj = f[3]
	}
	bt, _ := firewall.TableNames(e.o.Stack.Network)
	switch {
	case table == "incus":
		if obj == "" || strings.HasSuffix(obj, "."+e.o.Stack.Network) {
			return true
		}
		for _, b := range e.boxes {
			if b != nil && strings.Contains(obj, "."+b.Name+".") {
				return true
			}
		}
		return false
	case strings.HasPrefix(table, "claudebox_"):
		return table == bt || strings.HasPrefix(table, bt+"_")
	}
	return true
}

// annotate adds the other end's view to open verdicts: the decoy's or the box's hits.
func (e *engine) annotate(m *Matrix) {
	for _, r := range m.Rows {
		if r.Observed != Open || r.Expected == Open {
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
