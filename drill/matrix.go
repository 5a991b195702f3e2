package drill

import (
	"context"
	"fmt"
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
				r.Observed = Observe(r.Case, r.Result)
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
	cases, err := Plan(Claims, e.topology(), e.o.Timeout)
	if err != nil {
		return nil, err
	}
	m := &Matrix{Rows: RowsOf(cases)}
	e.execute(ctx, m.Rows)
	var retry []*Row
	for _, r := range m.Rows {
		if !r.Expected.Negative() && r.Observed != r.Expected {
			retry = append(retry, r)
		}
	}
	if len(retry) > 0 {
		e.execute(ctx, retry)
		for _, r := range retry {
			r.Retried = true
		}
	}
	Judge(m.Rows)
	if err := Complete(cases, m.Rows); err != nil {
		return nil, err
	}
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
