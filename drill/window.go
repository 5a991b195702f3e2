package drill

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os/exec"
	"strings"
	"sync"
	"time"

	"github.com/claudebox/claudebox/boxcore"
	"github.com/claudebox/claudebox/drill/probes"
	"github.com/claudebox/claudebox/firewall"
)

// window runs the re-apply window; when Incus's re-apply outlasted the floods (a loaded
// host: up to several seconds), it runs them once more, twice as long, before the rows are
// left check-failed.
func (e *engine) window(ctx context.Context, rows []*Row, afterReapply func()) (err error) {
	e.cover(false, func() { err = e.windowOnce(ctx, rows, afterReapply, 1) })
	if err != nil || !e.reapplyOutlasted(rows) {
		return err
	}
	e.progress("  the re-apply outlasted the flood: once more, twice as long")
	e.cover(false, func() { err = e.windowOnce(ctx, rows, func() {}, 2) })
	return err
}

func (e *engine) reapplyOutlasted(rows []*Row) bool {
	for _, r := range rows {
		if r.Probe.Kind == KindLabReapply && r.Observed == CheckFailed && strings.Contains(r.Result.Evidence, "outlasted") {
			return true
		}
	}
	return false
}

// windowOnce runs the rows of the re-apply window: every flood starts at once, the lab makes
// Incus re-apply the network WindowLead later (a new value of its re-apply mark), and a
// watcher of nftables generations proves the re-apply began and ended inside the floods. Then conntrack is read for flows that got through.
//
// afterReapply runs once the re-apply returned (or at once when there is no window); each
// flood lasts stretch times its planned duration.
func (e *engine) windowOnce(ctx context.Context, rows []*Row, afterReapply func(), stretch int) error {
	if len(rows) == 0 {
		afterReapply()
		return nil
	}
	var floods, labRows []*Row
	for _, r := range rows {
		if strings.HasPrefix(r.Probe.Kind, "lab-") {
			labRows = append(labRows, r)
			continue
		}
		if f := r.Probe.Flood; f != nil && stretch > 1 {
			d := f.Duration.D()
			f.Duration = probes.Dur(d * time.Duration(stretch))
			r.Probe.Timeout += f.Duration.D() - d
		}
		floods = append(floods, r)
	}
	w, err := firewall.Watch()
	if err != nil {
		return err
	}
	start := time.Now()
	done := make(chan struct{})
	go func() { defer close(done); e.execute(ctx, floods) }()
	var reapplyErr error
	select {
	case <-ctx.Done():
	case <-time.After(WindowLead):
		e.windowGen++
		reapplyErr = e.reapply(ctx)
	}
	// Incus finishes a re-apply after the PUT returns (the ACL rules come last, dnsmasq
	// restarts): the window counts only once it has settled, and only if it settled
	// inside the floods.
	settled := make(chan time.Time, 1)
	go func() { settled <- e.settle(ctx, w) }()
	var settledAt time.Time
	select {
	case settledAt = <-settled:
		afterReapply()
		<-done
	case <-done:
		settledAt = <-settled
		afterReapply()
	}
	end := time.Now()
	gens := w.Stop()
	if settledAt.IsZero() || settledAt.After(end) {
		reapplyErr = errors.Join(reapplyErr, errOutlasted)
	}
	for _, r := range labRows {
		switch r.Probe.Kind {
		case KindLabReapply:
			r.Result = e.judgeReapply(gens, start, end, reapplyErr)
		case KindLabConntrackOut:
			r.Result = e.leftFlows(true)
		case KindLabConntrackIn:
			r.Result = e.leftFlows(false)
		}
		r.Result.Probe = r.Probe
		r.Observed = Observe(r.Case, r.Result)
	}
	return ctx.Err()
}

// judgeReapply: the window rows count only if the whole re-apply happened while the boxes
// flooded (a re-apply that outlasted the flood, or none at all, proves nothing).
func (e *engine) judgeReapply(gens []firewall.Generation, start, end time.Time, err error) probes.Result {
	if errors.Is(err, errOutlasted) {
		return probes.Result{Outcome: probes.CheckFailed, Evidence: "the re-apply outlasted the flood: it had not settled when the flood ended"}
	}
	if err != nil {
		return probes.Result{Outcome: probes.CheckFailed, Evidence: "triggering the re-apply: " + err.Error()}
	}
	ra, ok := firewall.ReapplyOf(gens, e.o.Stack.Network)
	switch {
	case !ok:
		return probes.Result{Outcome: probes.CheckFailed, Evidence: "no re-apply of " + e.o.Stack.Network + " was seen during the flood"}
	case ra.End.After(end):
		return probes.Result{Outcome: probes.CheckFailed, Evidence: fmt.Sprintf("the re-apply (%.2fs) outlasted the flood", ra.End.Sub(ra.Start).Seconds())}
	}
	return probes.Result{Outcome: probes.Open, RTT: ra.End.Sub(ra.Start),
		Evidence: fmt.Sprintf("Incus re-applied %s from +%.2fs to +%.2fs of a %.2fs flood", e.o.Stack.Network,
			ra.Start.Sub(start).Seconds(), ra.End.Sub(start).Seconds(), end.Sub(start).Seconds())}
}

var errOutlasted = errors.New("the re-apply outlasted the flood")

// settleQuiet is how long Incus must leave the network's chains alone for a re-apply to
// count as done; settleMax bounds the wait.
const (
	settleQuiet = 400 * time.Millisecond
	settleMax   = 15 * time.Second
)

// settle waits until the re-apply is done: no generation touched the network's chains in
// Incus's table for settleQuiet, and the bridge's dnsmasq answers the run's public name
// (it restarts with the new lines). It returns when that was first true (zero: never).
func (e *engine) settle(ctx context.Context, w *firewall.Watcher) time.Time {
	return e.settleWithin(ctx, w, settleMax)
}

// settleAround runs f (a change that may make Incus re-apply the network: a seeded hole
// or its restore) and waits until that re-apply has settled; with no re-apply at all
// within a second, it returns at once.
func (e *engine) settleAround(ctx context.Context, f func() error) error {
	w, err := firewall.Watch()
	if err != nil {
		return err
	}
	defer w.Stop()
	k := boxcore.LocalKernel()
	before, _ := k.FindDNSMasq(e.o.Stack.Network)
	if err := f(); err != nil {
		return err
	}
	if _, ok := firewall.ReapplyOf(w.Generations(), e.o.Stack.Network); !ok {
		select {
		case <-ctx.Done():
		case <-time.After(time.Second):
		}
		if _, ok := firewall.ReapplyOf(w.Generations(), e.o.Stack.Network); !ok {
			return nil
		}
	}
	if e.settleWithin(ctx, w, settleMax).IsZero() {
		return fmt.Errorf("the re-apply of %s did not settle within %s", e.o.Stack.Network, settleMax)
	}
	// Incus restarts dnsmasq with the new config late in a re-apply: boxes that take a lease
	// before that get it from the old one (a name it should have ignored). Wait for a new
	// dnsmasq; a change that does not restart it (an ACL) gives up after dnsmasqRestartWait.
	for deadline := time.Now().Add(dnsmasqRestartWait); time.Now().Before(deadline) && ctx.Err() == nil; {
		if now, ok := k.FindDNSMasq(e.o.Stack.Network); ok && now.PID != before.PID && e.dnsmasqAnswers(ctx) {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	return nil
}

// dnsmasqRestartWait bounds the wait for Incus to restart dnsmasq after a re-apply settled.
const dnsmasqRestartWait = 3 * time.Second

func (e *engine) settleWithin(ctx context.Context, w *firewall.Watcher, max time.Duration) time.Time {
	deadline := time.Now().Add(max)
	for time.Now().Before(deadline) && ctx.Err() == nil {
		last := time.Time{}
		if ra, ok := firewall.ReapplyOf(w.Generations(), e.o.Stack.Network); ok {
			last = ra.End
		}
		if !last.IsZero() && time.Since(last) >= settleQuiet && e.dnsmasqAnswers(ctx) {
			return time.Now()
		}
		select {
		case <-ctx.Done():
		case <-time.After(50 * time.Millisecond):
		}
	}
	return time.Time{}
}

// dnsmasqAnswers: the gateway's dnsmasq resolves the run's public name (asked from the host).
func (e *engine) dnsmasqAnswers(ctx context.Context) bool {
	res := probes.RunMany(ctx, []probes.Spec{{Kind: probes.KindDNS, Timeout: 300 * time.Millisecond,
		DNS: &probes.DNSQuery{Server: e.gateway.Addr().String(), Name: e.decoy.PublicName}}})
	return res[0].Outcome == probes.Open
}

// leftFlows: conntrack entries from a box to a blocked decoy (out), or from the host or the
// decoy into a box (in). A flow is confirmed once its first packet passed the IP stack's
// hooks, so any is a leak past the wall.
func (e *engine) leftFlows(out bool) probes.Result {
	var boxes, blocked []netip.Prefix
	for _, b := range e.boxes {
		boxes = append(boxes, netip.PrefixFrom(b.IPv4, 32))
	}
	outside := []netip.Prefix{netip.PrefixFrom(e.decoy.LAN.NSAddr, 32), netip.PrefixFrom(e.decoy.LAN.HostAddr, 32)}
	for _, t := range e.decoy.Targets {
		if t.Range != "public" {
			blocked = append(blocked, netip.PrefixFrom(t.Addr, 32))
		}
	}
	for _, h := range e.hostAddrs {
		outside = append(outside, netip.PrefixFrom(h, 32))
	}
	var left []firewall.Flow
	var err error
	if out {
		left, err = firewall.FlowsBetween(boxes, blocked)
	} else {
		var in []firewall.Flow
		in, err = firewall.FlowsBetween(append(blocked, outside...), boxes)
		for _, f := range in {
			// dnsmasq's DHCP offers and acks leave the gateway as flows of their own.
			if !(f.Src == e.gateway.Addr() && f.SrcPort == 67 && f.DstPort == 68) {
				left = append(left, f)
			}
		}
	}
	switch {
	case err != nil:
		return probes.Result{Outcome: probes.CheckFailed, Evidence: err.Error()}
	case len(left) > 0:
		var s []string
		for _, f := range left {
			s = append(s, f.Text)
		}
		return probes.Result{Outcome: probes.Open, Evidence: fmt.Sprintf("%d flow(s) left: %s", len(left), strings.Join(s, "; "))}
	}
	return probes.Result{Outcome: probes.Dropped, Evidence: "no such flow in conntrack"}
}

// spoofPhase runs the spoofing and odd-frame rows after the shared batch (a spoof that
// works disturbs its victim's traffic), and watches the host's side of the ARP and MAC
// spoofs while they run: the neighbour entry of each victim's address and the FDB entry of
// its MAC. A poisoning the victim's own traffic undoes a moment later still counts.
func (e *engine) spoofPhase(ctx context.Context, rows []*Row) {
	if len(rows) == 0 {
		return
	}
	// The MAC spoofs go last and alone: any other frame a victim sends (its own probes in
	// this phase) re-teaches the bridge its MAC within milliseconds and hides a poisoning.
	var mac, rest []*Row
	for _, r := range rows {
		if r.Probe.Kind == probes.KindMACSpoof {
			mac = append(mac, r)
		} else {
			rest = append(rest, r)
		}
	}
	moved := e.watchVictims(ctx, func() {
		e.execute(ctx, rest)
		e.execute(ctx, mac)
	})
	for _, r := range rows {
		if r.Observed == Open {
			continue
		}
		var key string
		switch r.Probe.Kind {
		case probes.KindARPSpoof:
			key = "neigh " + r.To
		case probes.KindMACSpoof:
			key = "fdb " + r.To
		}
		if ev, ok := moved[key]; ok && key != "" {
			r.Observed, r.Result.Evidence = Open, ev
		}
	}
}

// watchVictims runs f while polling, every 20 ms, where the host's neighbour table puts each
// box's address and on which port the bridge learnt each box's MAC. It returns what moved,
// keyed "neigh BOX" / "fdb BOX".
func (e *engine) watchVictims(ctx context.Context, f func()) map[string]string {
	k := boxcore.LocalKernel()
	moved := map[string]string{}
	ports := map[string]string{}
	for _, b := range e.boxes {
		if st, err := e.c.InstanceState(ctx, b.Name); err == nil {
			ports[b.Name] = st.Network["eth0"].HostName // the port now, not when it was minted
		}
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			for _, b := range e.boxes {
				if mac, err := k.NeighbourMAC(e.o.Stack.Network, b.IPv4); err == nil && mac != "" && mac != strings.ToLower(b.MAC) {
					moved["neigh "+b.Name] = fmt.Sprintf("the host's neighbour entry for %s moved to %s (the victim is %s)", b.IPv4, mac, b.MAC)
				}
				ps, err := k.FDBPorts(e.o.Stack.Network, b.MAC)
				for _, p := range ps {
					if err == nil && p != ports[b.Name] {
						moved["fdb "+b.Name] = fmt.Sprintf("the bridge learnt %s on %s (the victim's port is %s)", b.MAC, p, ports[b.Name])
					}
				}
			}
			select {
			case <-stop:
				return
			case <-time.After(20 * time.Millisecond):
			}
		}
	}()
	f()
	close(stop)
	wg.Wait()
	return moved
}

// leasesIntact turns a release row whose victim's lease vanished from dnsmasq into "open":
// the release reached the server as the victim's.
func (e *engine) leasesIntact(ctx context.Context, rows []*Row) {
	byName := map[string]*Box{}
	for _, b := range e.boxes {
		byName[b.Name] = b
	}
	k := boxcore.LocalKernel()
	for _, r := range rows {
		victim := byName[r.To]
		if r.Probe.Kind != KindLabLeaseIntact || victim == nil {
			continue
		}
		held, err := k.LeaseHeld(e.o.Stack.Network, victim.MAC, victim.IPv4)
		switch {
		case err != nil:
			r.Result = probes.Result{Probe: r.Probe, Outcome: probes.CheckFailed, Evidence: err.Error()}
		case held:
			r.Result = probes.Result{Probe: r.Probe, Outcome: probes.Dropped, Evidence: "dnsmasq still holds the victim's lease"}
		default:
			r.Result = probes.Result{Probe: r.Probe, Outcome: probes.Open, Evidence: "dnsmasq no longer holds the victim's lease " + victim.IPv4.String()}
		}
		r.Observed = Observe(r.Case, r.Result)
	}
}

// runInNS runs a batch inside a lab namespace (the decoy's, the stand-in's) (a child process: every socket the
// probes open must be opened in the namespace, on whatever thread runs them).
func (e *engine) runInNS(ctx context.Context, ns string, specs []probes.Spec) ([]probes.Result, error) {
	in, err := json.Marshal(specs)
	if err != nil {
		return nil, err
	}
	cmd := exec.CommandContext(ctx, "ip", "netns", "exec", ns, e.o.Binary, "probe", "run")
	cmd.Stdin = bytes.NewReader(in)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	raw, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("probe run in %s: %v: %s", ns, err, strings.TrimSpace(stderr.String()))
	}
	var out []probes.Result
	if err := json.Unmarshal(raw, &out); err != nil || len(out) != len(specs) {
		return nil, fmt.Errorf("probe run in %s: %d results for %d probes (%v)", ns, len(out), len(specs), err)
	}
	return out, nil
}

// heard turns a negative row whose marker reached any receiver (the decoy, the host's
// listener, a box's) into "open": the other end's view outranks the sender's silence. (A row
// expecting NATed is the decoy's to judge, by the source it heard: natSeen.)
func heard(rows []*Row, hits map[string][]probes.Hit, since time.Time) {
	for _, r := range rows {
		if !r.Expected.Negative() || r.Expected == NATed || r.Probe.Payload == "" || !activeKind(r.Probe.Kind) {
			continue
		}
		var seen []string
		for where, hs := range hits {
			if where == foreignEnd.Key && r.Claim != ClaimMemberBoxes {
				// The stand-in is the join itself: it hears what the bridge floods to a port
				// that is no box's (the host's unknown unicast, a spoof's broadcast), which
				// another member's box port would not. It is a receiver of its own rows only.
				continue
			}
			for _, h := range hs {
				if h.Time.Before(since) {
					continue // an earlier matrix's
				}
				if strings.Contains(h.Payload, r.Probe.Payload) || h.Frame != nil && h.Frame.Marker == r.Probe.Payload {
					seen = append(seen, fmt.Sprintf("%s heard %s from %s", where, h.Proto, h.Peer))
				}
			}
		}
		if len(seen) > 0 {
			r.Observed = Open
			r.Result.Evidence = strings.Join(uniq(seen), ", ")
		}
	}
}

func uniq(xs []string) []string {
	var out []string
	seen := map[string]bool{}
	for _, x := range xs {
		if !seen[x] {
			seen[x] = true
			out = append(out, x)
		}
	}
	return out
}

// allHits collects what every receiver recorded: the decoy, the host's listener, each box.
func (e *engine) allHits(ctx context.Context) map[string][]probes.Hit {
	out := map[string][]probes.Hit{"decoy": e.decoy.Hits(), foreignEnd.Key: e.foreign.Hits()}
	if e.hostL != nil {
		out["host"] = e.hostL.Hits()
	}
	var mu sync.Mutex
	var wg sync.WaitGroup
	for _, b := range e.boxes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			h := e.hits(ctx, b)
			mu.Lock()
			out[b.Name] = h
			mu.Unlock()
		}()
	}
	wg.Wait()
	return out
}
