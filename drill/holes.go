package drill

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/claudebox/claudebox/boxcore"
	"github.com/claudebox/claudebox/drill/probes"
	"github.com/claudebox/claudebox/firewall"
)

// Hole is one seeded hole: layers switched off on purpose.
type Hole struct {
	Name string
	Off  []Layer
	// Restart: boxes must take a new lease to see it (dnsmasq names).
	Restart bool
	// Remint: after the restore the boxes are replaced by fresh ones, so no name or address
	// of the hole outlives it (set whenever the hole touches names or addresses).
	Remint bool
}

// Holes are the seeded holes of the self-test (names without commas: --hole takes a list): every layer alone (every claim must stay
// green: each is held by another layer too), then the layers of each claim together (its
// rows must turn red: the drill can fail).
var Holes = append(singleHoles(),
	hole("all box→box layers off", LayerPortIso, LayerNFTBridge, LayerBRNF, LayerNICFiltering, LayerPortBinding),
	hole("wall + ACL + L2 ranges off", LayerWall, LayerACL, LayerL2Ranges),
	hole("wall + host input guard + ACL + L2 ranges off", LayerWall, LayerHostGuard, LayerACL, LayerL2Ranges),
	hole("NIC filtering + port binding + wall off", LayerNICFiltering, LayerPortBinding, LayerWall),
	hole("NIC filtering + port binding + dhcp-known-only + L2 ranges off", LayerNICFiltering, LayerPortBinding, LayerDHCPKnownOnly, LayerL2Ranges),
	hole("port binding + fdb pin off", LayerPortBinding, LayerFDBPin),
	hole("fdb pin + L2 ranges off", LayerFDBPin, LayerL2Ranges),
	hole("port binding + L2 ranges + host input guard + wall off", LayerPortBinding, LayerL2Ranges, LayerHostGuard, LayerWall),
	hole("IPv6 on and wall off", LayerIPv6Off, LayerWall),
	hole("ipv4.nat=false + wall + host input guard off", LayerNAT, LayerWall, LayerHostGuard),
	hole("wall + port rp_filter + L2 ranges off", LayerWall, LayerPortRPFilter, LayerL2Ranges),
	hole("dns.mode=managed and dhcp-ignore-names removed", LayerDNSModeNone, LayerIgnoreNames),
	hole("dns.mode=managed + dhcp-ignore-names + local answers removed", LayerDNSModeNone, LayerIgnoreNames, LayerLocalAnswers),
	hole("no-hosts and local answers removed", LayerNoHosts, LayerLocalAnswers),
	hole("no-ident and local answers removed", LayerNoIdent, LayerLocalAnswers),
	hole("exposure beyond loopback + host input guard removed", LayerExposeLoopback, LayerHostGuard),
	hole("exposure beyond loopback + wall + host input guard + ACL + L2 ranges off", LayerExposeLoopback, LayerWall, LayerHostGuard, LayerACL, LayerL2Ranges),
	hole("bridges joined + nft bridge drop + br_netfilter off", LayerMembersApart, LayerNFTBridge, LayerBRNF),
	hole("bridges joined + nft bridge drop off", LayerMembersApart, LayerNFTBridge),
	hole("bridges joined + L2 ranges off", LayerMembersApart, LayerL2Ranges),
	hole("bridges joined + dhcp-known-only removed", LayerMembersApart, LayerDHCPKnownOnly),
	hole("bridges joined + NIC filtering + port binding + nft bridge drop off", LayerMembersApart, LayerNICFiltering, LayerPortBinding, LayerNFTBridge),
	hole("bridges joined + NIC filtering + nft bridge drop off", LayerMembersApart, LayerNICFiltering, LayerNFTBridge),
	hole("bridges joined + port binding + nft bridge drop off", LayerMembersApart, LayerPortBinding, LayerNFTBridge),
	hole("port isolation + NIC filtering + nft bridge drop off", LayerPortIso, LayerNICFiltering, LayerNFTBridge),
	hole("port isolation + port binding + nft bridge drop off", LayerPortIso, LayerPortBinding, LayerNFTBridge),
	hole("port isolation + NIC filtering + port binding off", LayerPortIso, LayerNICFiltering, LayerPortBinding),
)

var holeNames = map[Layer]string{
	LayerNFTBridge: "nft bridge drop removed", LayerBRNF: "br_netfilter off", LayerPortIso: "port isolation off",
	LayerDNSModeNone: "dns.mode=managed", LayerIgnoreNames: "dhcp-ignore-names removed", LayerNoHosts: "no-hosts removed",
	LayerNoIdent: "no-ident removed", LayerLocalAnswers: "local answers removed", LayerNoCache: "no-cache removed", LayerACL: "ACL detached", LayerHostGuard: "host input guard removed",
	LayerWall: "wall removed", LayerNICFiltering: "NIC filtering off", LayerIPv6Off: "IPv6 on the bridge",
	LayerPortBinding: "port binding removed", LayerL2Ranges: "L2 ranges removed", LayerDHCPKnownOnly: "dhcp-known-only removed",
	LayerPortRPFilter: "port rp_filter off", LayerFDBPin: "fdb pin removed",
	LayerBoxPids: "box pids limit off", LayerBoxMemory: "box memory limit off", LayerBoxDisk: "box disk quota off",
	LayerBoxCPU: "box CPU quota off", LayerBoxSubvolDeny: "box subvolume deny off", LayerGuestAPIOff: "guest API on",
	LayerExposeLoopback: "exposure listening beyond loopback", LayerNAT: "ipv4.nat=false",
	LayerMembersApart: "bridges joined (another member's box on this bridge)",
}

func singleHoles() []Hole {
	var out []Hole
	for _, l := range AllLayers {
		name := holeNames[l]
		if name == "" {
			name = string(l) + " off"
		}
		out = append(out, hole(name, l))
	}
	return out
}

// hole derives what a hole needs around it from its layers: names are learnt only with a
// new lease (restart), and no name or address of the hole may outlive it (remint). IPv6 is
// switched on while the boxes are up: dnsmasq's start-up router advertisement reaches them
// at once (restarted boxes would wait for its next periodic one: timing, not a layer).
func hole(name string, off ...Layer) Hole {
	h := Hole{Name: name, Off: off}
	for _, r := range Claims {
		// A frame or spoof that gets through changes the victim box itself (a rogue router
		// advertisement gives it IPv6 and a route): fresh boxes after such a hole.
		if (r.Claim == ClaimFrames || r.Claim == ClaimSpoof) && r.Holds.OpenWithout(off) {
			h.Remint = true
		}
	}
	for _, l := range off {
		switch l {
		case LayerDNSModeNone, LayerIgnoreNames:
			h.Restart, h.Remint = true, true
		case LayerIPv6Off:
			h.Remint = true
		}
	}
	return h
}

// HoleResult is what one seeded hole showed.
type HoleResult struct {
	Name        string   `json:"name"`
	Off         []Layer  `json:"off"`
	ExpectedRed []string `json:"expected_red"`
	ObservedRed []string `json:"observed_red"`
	CheckFailed []string `json:"check_failed,omitempty"`
	Missing     []string `json:"expected_but_held,omitempty"`
	Unexpected  []string `json:"red_but_not_attributed,omitempty"`
	Details     []string `json:"details,omitempty"` // what each row off its attribution observed
	// FirstAttempt: the first matrix's disagreements, when it was measured once more.
	FirstAttempt []string      `json:"first_attempt,omitempty"`
	OK           bool          `json:"as_attributed"`
	Restored     bool          `json:"host_restored"`
	RestoreErr   string        `json:"restore_error,omitempty"`
	Layers       []LayerState  `json:"layers_during"`
	Elapsed      time.Duration `json:"elapsed_ns"`
	Matrix       *Matrix       `json:"-"`
}

func (e *engine) selfTest(ctx context.Context, rep *Report) error {
	if !rep.Matrix.OK() {
		return errors.New("seeded holes need a green matrix first: the baseline run did not pass")
	}
	if r, err := e.host.Check(ctx); err != nil {
		return err
	} else if !r.OK {
		return fmt.Errorf("the host stack has drifted before the self-test (%d item(s)): run 'claudebox host init' first, a seeded hole must start from the declared stack", len(r.Drift()))
	}
	for _, h := range Holes {
		if len(e.o.Holes) > 0 && !slices.Contains(e.o.Holes, h.Name) {
			continue
		}
		hr, err := e.seed(ctx, h)
		if hr != nil {
			rep.Holes = append(rep.Holes, hr)
			e.printHole(hr)
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// HoleMarker exists while a seeded hole has layers switched off.
const HoleMarker = "/run/claudebox-drill.hole"

// seed runs one seeded hole: boxcore switches the hole's layers off (for this run's boxes
// where a layer is per box), the matrix runs, boxcore restores them, conntrack forgets the
// boxes' flows (none opened in the hole may outlive it), and host check must be green again.
func (e *engine) seed(ctx context.Context, h Hole) (*HoleResult, error) {
	t := time.Now()
	hr := &HoleResult{Name: h.Name, Off: h.Off}
	e.progress("seeded hole: %s (off: %v) ...", h.Name, h.Off)
	if what := h.reachesEveryBox(); what != "" {
		if others := e.foreignBoxes(ctx); len(others) > 0 {
			return nil, fmt.Errorf("seeded hole %q would %s boxes that are not the drill's (%s): stop them or skip the hole", h.Name, what, strings.Join(others, ", "))
		}
	}
	restoreLayers, applyErr := e.openHole(ctx, h)
	var m *Matrix
	if applyErr == nil {
		hr.Layers, _ = e.host.ReadLayers(ctx, e.boxNames())
		m, applyErr = e.matrix(ctx)
	}
	if applyErr == nil {
		// A matrix that disagrees with the attribution is measured once more, the layers
		// still off: a real disagreement stays, a transient one (two cores still busy with
		// the window's floods) does not. Both attempts are in the record.
		first := &HoleResult{Off: h.Off, Restored: true}
		if first.attribute(m.Rows); !first.OK {
			e.progress("  not as attributed (%s): measuring once more", strings.Join(append(first.Missing, first.Unexpected...), ", "))
			hr.FirstAttempt = first.Details
			if h.Remint {
				// What the first matrix let through changed the boxes (a rogue router
				// advertisement gave them IPv6): close the hole, re-mint, open it again.
				if applyErr = e.closeHole(ctx, h, restoreLayers); applyErr == nil {
					restoreLayers, applyErr = e.openHole(ctx, h)
				} else {
					restoreLayers = nil
				}
			}
			if applyErr == nil {
				m, applyErr = e.matrix(ctx)
			}
		}
	}
	rerr := e.closeHole(ctx, h, restoreLayers)
	e.hole, e.holeOff = nil, nil
	if rerr != nil {
		hr.RestoreErr = rerr.Error()
	}
	e.checkRestored(ctx, hr)
	hr.Elapsed = time.Since(t)
	if applyErr != nil {
		return hr, fmt.Errorf("seeded hole %q: %w", h.Name, applyErr)
	}
	if rerr != nil {
		// A failed restore or re-mint ends the self-test: the next hole would start from a
		// host (or a set of boxes) that is not the one it is meant to test.
		return hr, fmt.Errorf("seeded hole %q: restoring: %w", h.Name, rerr)
	}
	hr.Matrix = m
	hr.attribute(m.Rows)
	if !hr.Restored {
		return hr, fmt.Errorf("seeded hole %q: the host was not restored: %s", h.Name, hr.RestoreErr)
	}
	return hr, nil
}

// openHole switches the hole's layers off through boxcore and waits for the re-apply that
// causes to settle (boxes restarted or probed before it would see the old stack), then
// restarts the boxes or waits for IPv6 where the hole needs it. While layers are off a
// marker says so: a run killed then leaves it, and the next sweep converges the stack.
func (e *engine) openHole(ctx context.Context, h Hole) (restore func(context.Context) error, err error) {
	if err := os.WriteFile(HoleMarker, []byte(e.run+" "+h.Name+"\n"), 0o600); err != nil {
		return nil, err
	}
	e.hole, e.holeOff = &h, nil
	var stackOff []Layer
	for _, l := range h.Off {
		if isLabLayer(l) {
			e.holeOff = append(e.holeOff, l) // the lab's own: it does not tighten these, or opens them itself
		} else {
			stackOff = append(stackOff, l)
		}
	}
	if slices.Contains(h.Off, LayerExposeLoopback) {
		if err := e.openBeyondLoopback(); err != nil {
			return nil, err
		}
	}
	if slices.Contains(h.Off, LayerMembersApart) && e.foreign != nil {
		if err := e.foreign.Join(e.o.Stack.Network); err != nil {
			return nil, err
		}
	}
	if len(stackOff) == 0 {
		return nil, nil // nothing of the stack to switch (or to restore)
	}
	e.cover(true, func() {
		err = e.settleAround(ctx, func() (err error) {
			restore, err = e.host.SwitchOff(ctx, stackOff, e.boxNames())
			return err
		})
	})
	if err == nil && h.Restart {
		err = e.restartBoxes(ctx)
		// A restart binds the boxes' new ports, which converges claudebox's firewall, the
		// pins and rp_filter again: the hole's own layers among them go off once more (the
		// first restore puts everything back).
		var again []Layer
		for _, l := range stackOff {
			if slices.Contains(rebound, l) {
				again = append(again, l)
			}
		}
		if err == nil && len(again) > 0 {
			_, err = e.host.SwitchOff(ctx, again, e.boxNames())
		}
	}
	if err == nil && slices.Contains(h.Off, LayerIPv6Off) {
		e.waitIPv6(ctx)
	}
	return restore, err
}

// rebound are the layers binding a box's port converges (boxcore.BindPorts: the whole
// firewall, the fdb pins, rp_filter).
var rebound = []Layer{LayerNFTBridge, LayerPortBinding, LayerL2Ranges, LayerHostGuard, LayerLocalAnswers, LayerWall,
	LayerFDBPin, LayerPortRPFilter}

// closeHole restores the layers (and waits for that re-apply to settle), forgets what the
// hole let the kernel learn — the boxes' conntrack flows, their FDB and neighbour entries (a
// spoof the hole let through would otherwise mislead the next one) — and re-mints the boxes
// when the hole touched names, addresses, frames or spoofs.
func (e *engine) closeHole(ctx context.Context, h Hole, restoreLayers func(context.Context) error) error {
	e.closeBeyondLoopback()
	var errs []error
	if slices.Contains(h.Off, LayerMembersApart) && e.foreign != nil {
		errs = append(errs, e.foreign.Part())
	}
	if restoreLayers != nil {
		e.cover(true, func() { errs = append(errs, e.settleAround(ctx, func() error { return restoreLayers(ctx) })) })
		// Until every switched layer reads back on (dnsmasq restarted with its options, the
		// ports isolated), a fresh box could take a lease from the old dnsmasq and keep a
		// name it should never have had.
		errs = append(errs, e.waitLayersOn(ctx, h.Off))
	}
	if _, err := firewall.ForgetFlows(e.boxPrefixes()); err != nil {
		errs = append(errs, err)
	}
	var macs []string
	for _, b := range e.boxes {
		macs = append(macs, b.MAC)
	}
	if err := boxcore.LocalKernel().ForgetLearnt(e.o.Stack.Network, macs, e.boxAddrs()); err != nil {
		errs = append(errs, err)
	}
	if errors.Join(errs...) == nil {
		_ = os.Remove(HoleMarker)
	}
	if h.Remint {
		errs = append(errs, e.remint(ctx))
	}
	return errors.Join(errs...)
}

// waitLayersOn waits (up to restoreWait) until boxcore reads every one of layers back as on.
func (e *engine) waitLayersOn(ctx context.Context, layers []Layer) error {
	deadline := time.Now().Add(restoreWait)
	var off []string
	for {
		states, err := e.host.ReadLayers(ctx, e.boxNames())
		if err != nil {
			return err
		}
		off = off[:0]
		for _, st := range states {
			if slices.Contains(layers, st.Layer) && !st.On {
				off = append(off, string(st.Layer)+" ("+st.What+")")
			}
		}
		if len(off) == 0 {
			return nil
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return fmt.Errorf("still off %s after the restore: %s", restoreWait, strings.Join(off, "; "))
		}
		select {
		case <-ctx.Done():
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// restoreWait bounds waitLayersOn.
const restoreWait = 20 * time.Second

// checkRestored: after a hole, host check must pass; its drift is the restore's error text.
func (e *engine) checkRestored(ctx context.Context, hr *HoleResult) {
	r, err := e.host.Check(ctx)
	if err != nil {
		hr.RestoreErr += err.Error()
		return
	}
	hr.Restored = r.OK
	for _, d := range r.Drift() {
		hr.RestoreErr += fmt.Sprintf("drift %s %s: want %s, have %s; ", d.Layer, d.Item, d.Expected, d.Actual)
	}
}

// attribute compares what turned red with what the hole's layers hold alone: as attributed
// when exactly the rows whose every holding term lost a layer are red, none check-failed,
// and the host was restored.
func (hr *HoleResult) attribute(rows []*Row) {
	for _, r := range rows {
		exp := r.Expected.Negative() && r.Holds.OpenWithout(hr.Off)
		red := r.Verdict == Fail
		if exp {
			hr.ExpectedRed = append(hr.ExpectedRed, r.ID)
		}
		if red {
			hr.ObservedRed = append(hr.ObservedRed, r.ID)
		}
		if r.Verdict == NoCheck {
			hr.CheckFailed = append(hr.CheckFailed, r.ID+": "+r.Why)
		}
		if exp && !red {
			hr.Missing = append(hr.Missing, r.ID)
			hr.Details = append(hr.Details, fmt.Sprintf("%s held: %s (%s)", r.ID, r.Observed, r.Result.Evidence))
		}
		if red && !exp {
			hr.Unexpected = append(hr.Unexpected, r.ID+" ("+string(r.Observed)+")")
			hr.Details = append(hr.Details, fmt.Sprintf("%s red: %s (%s)", r.ID, r.Observed, r.Result.Evidence))
		}
	}
	hr.OK = len(hr.Missing) == 0 && len(hr.Unexpected) == 0 && len(hr.CheckFailed) == 0 && hr.Restored
}

func (e *engine) boxNames() []string {
	var out []string
	for _, b := range e.boxes {
		if b != nil {
			out = append(out, b.Name)
		}
	}
	return out
}

func (e *engine) boxAddrs() []netip.Addr {
	var out []netip.Addr
	for _, b := range e.boxes {
		if b != nil && b.IPv4.IsValid() {
			out = append(out, b.IPv4)
		}
	}
	return out
}

func (e *engine) boxPrefixes() []netip.Prefix {
	var out []netip.Prefix
	for _, b := range e.boxes {
		if b != nil && b.IPv4.IsValid() {
			out = append(out, netip.PrefixFrom(b.IPv4, 32))
		}
	}
	return out
}

// reachesEveryBox says what a hole would do to every box on the bridge, the drill's or not:
// give them IPv6, or register their names with dnsmasq (a box that renews its lease during a
// name hole keeps its name in the lease file after it). "" when it touches only the drill's.
func (h Hole) reachesEveryBox() string {
	for _, r := range Claims {
		if r.Claim == ClaimIPv6 && r.Holds.OpenWithout(h.Off) {
			return "give IPv6 to"
		}
	}
	if h.Restart {
		return "register with dnsmasq the names of"
	}
	return ""
}

// foreignBoxes are running instances on the stack's profile that this run did not mint.
func (e *engine) foreignBoxes(ctx context.Context) []string {
	insts, err := e.c.Instances(ctx, nil, false)
	if err != nil {
		return []string{"(cannot list instances: " + err.Error() + ")"}
	}
	var out []string
	for _, in := range insts {
		if in.Status != "Stopped" && in.Config[DrillTag] != e.run && slices.Contains(in.Profiles, e.o.Stack.Profile) {
			out = append(out, in.Name)
		}
	}
	return out
}

// waitIPv6 waits (up to 45 s) until every box shows a global/ULA address. SLAAC takes a
// router advertisement and duplicate address detection; the boxes' router solicitations are
// dropped by the host input guard, so they wait for dnsmasq's unsolicited RAs, which come
// every 5-20 s in its first minute — the first one may leave before the bridge's own
// link-local address is usable. 15 s missed it once in CI; 45 s covers two more.
func (e *engine) waitIPv6(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, 45*time.Second)
	defer cancel()
	for _, b := range e.boxes {
		for ctx.Err() == nil {
			res, err := e.runInBox(ctx, b, []probes.Spec{{Kind: probes.KindFacts}})
			if err == nil && res[0].Facts != nil && res[0].Facts.HasGlobalIPv6 {
				break
			}
			select {
			case <-ctx.Done():
			case <-time.After(300 * time.Millisecond):
			}
		}
	}
}

func (e *engine) printHole(h *HoleResult) {
	status := "as attributed"
	if !h.OK {
		status = "NOT as attributed"
	}
	e.progress("  %s: %s; expected red %d, observed red %d, restored %v (%.1fs)", h.Name, status, len(h.ExpectedRed), len(h.ObservedRed), h.Restored, h.Elapsed.Seconds())
	e.progress("    turned red: %s", summarize(h.ObservedRed))
	for _, m := range h.Missing {
		e.progress("    expected red but held: %s", m)
	}
	for _, u := range h.Unexpected {
		e.progress("    red but not attributed to %v: %s", h.Off, u)
	}
	for _, c := range h.CheckFailed {
		e.progress("    check-failed: %s", c)
	}
	if h.RestoreErr != "" {
		e.progress("    restore: %s", h.RestoreErr)
	}
}

// summarize groups row IDs by their claim part and kind: "box-box/tcp x2".
func summarize(ids []string) string {
	count := map[string]int{}
	var order []string
	for _, id := range ids {
		parts := strings.Split(id, "/")
		key := parts[0]
		if len(parts) > 2 {
			key += "/" + parts[len(parts)-1]
		}
		if count[key] == 0 {
			order = append(order, key)
		}
		count[key]++
	}
	var out []string
	for _, k := range order {
		out = append(out, fmt.Sprintf("%s x%d", k, count[k]))
	}
	if len(out) == 0 {
		return "nothing"
	}
	return strings.Join(out, ", ")
}
