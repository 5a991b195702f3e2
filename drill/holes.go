package drill

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"maps"
	"net"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/google/nftables"

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

// Holes are the seeded holes of the self-test, one per layer, then all box→box layers at once.
var Holes = []Hole{
	{Name: "nft bridge drop removed", Off: []Layer{LayerNFTBridge}},
	{Name: "br_netfilter off", Off: []Layer{LayerBRNF}},
	{Name: "port isolation off", Off: []Layer{LayerPortIso}},
	{Name: "dns.mode=managed", Off: []Layer{LayerDNSModeNone}, Restart: true, Remint: true},
	{Name: "dhcp-ignore-names removed", Off: []Layer{LayerIgnoreNames}, Restart: true, Remint: true},
	{Name: "no-hosts removed", Off: []Layer{LayerNoHosts}},
	{Name: "ACL detached", Off: []Layer{LayerACL}},
	{Name: "host input guard removed", Off: []Layer{LayerHostGuard}},
	// No restart: the boxes are up when dnsmasq restarts with IPv6, and its start-up router
	// advertisement reaches them at once. (Restarted boxes depend on their router
	// solicitation, which the host input guard drops, and then on dnsmasq's next periodic RA:
	// measured both ways, that is timing, not a layer.)
	{Name: "IPv6 on the bridge", Off: []Layer{LayerIPv6Off}, Remint: true},
	{Name: "all box→box layers off", Off: []Layer{LayerPortIso, LayerNFTBridge, LayerBRNF}},
	{Name: "IPv6 on and host input guard removed", Off: []Layer{LayerIPv6Off, LayerHostGuard}, Remint: true},
}

// HoleResult is what one seeded hole showed.
type HoleResult struct {
	Name        string        `json:"name"`
	Off         []Layer       `json:"off"`
	ExpectedRed []string      `json:"expected_red"`
	ObservedRed []string      `json:"observed_red"`
	CheckFailed []string      `json:"check_failed,omitempty"`
	Missing     []string      `json:"expected_but_held,omitempty"`
	Unexpected  []string      `json:"red_but_not_attributed,omitempty"`
	OK          bool          `json:"as_attributed"`
	Restored    bool          `json:"host_restored"`
	RestoreErr  string        `json:"restore_error,omitempty"`
	Layers      []LayerState  `json:"layers_during"`
	Elapsed     time.Duration `json:"elapsed_ns"`
	Matrix      *Matrix       `json:"-"`
}

func (e *engine) selfTest(ctx context.Context, rep *Report) error {
	if !rep.Matrix.OK() {
		return errors.New("seeded holes need a green matrix first: the baseline run did not pass")
	}
	if r, err := boxcore.NewHost(e.c, e.o.Stack).Check(ctx); err != nil {
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

// RunHole runs one seeded hole on a set-up engine (the suite uses it through Session).
func (e *engine) seed(ctx context.Context, h Hole) (*HoleResult, error) {
	t := time.Now()
	hr := &HoleResult{Name: h.Name, Off: h.Off}
	e.progress("seeded hole: %s (off: %v) ...", h.Name, h.Off)
	n, _, err := e.c.Network(ctx, e.o.Stack.Network)
	if err != nil {
		return nil, err
	}
	saved := maps.Clone(n.Config)
	nf4, nf6 := readSysctl(brnf4), readSysctl(brnf6)
	restore := func() error {
		var errs []error
		cur, etag, err := e.c.Network(ctx, e.o.Stack.Network)
		if err == nil && !maps.Equal(cur.Config, saved) {
			if err := updateNetwork(ctx, e.c, cur.Name, saved, cur.Description, etag); err != nil {
				errs = append(errs, err)
			}
		}
		_ = os.WriteFile(brnf4, []byte(nf4), 0o644)
		_ = os.WriteFile(brnf6, []byte(nf6), 0o644)
		if _, err := firewall.Apply(e.fwSpec()); err != nil {
			errs = append(errs, err)
		}
		for _, b := range e.boxes {
			if b.Veth != "" {
				_ = boxcore.LocalKernel().SetPortIsolated(b.Veth, true)
			}
		}
		if h.Remint {
			if err := e.remint(ctx); err != nil {
				errs = append(errs, err)
			}
		}
		return errors.Join(errs...)
	}
	applyErr := e.applyHole(ctx, h, saved)
	if applyErr == nil && h.Restart {
		applyErr = e.restartBoxes(ctx)
	}
	if applyErr == nil && slices.Contains(h.Off, LayerIPv6Off) {
		e.waitIPv6(ctx)
	}
	var m *Matrix
	if applyErr == nil {
		hr.Layers = ReadLayers(ctx, e.c, e.o.Stack, e.veths())
		m, applyErr = e.matrix(ctx, h.Off)
	}
	if rerr := restore(); rerr != nil {
		hr.RestoreErr = rerr.Error()
	}
	if r, err := boxcore.NewHost(e.c, e.o.Stack).Check(ctx); err == nil {
		hr.Restored = r.OK
		for _, d := range r.Drift() {
			hr.RestoreErr += fmt.Sprintf("drift %s %s: want %s, have %s; ", d.Layer, d.Item, d.Expected, d.Actual)
		}
	} else {
		hr.RestoreErr += err.Error()
	}
	hr.Elapsed = time.Since(t)
	if applyErr != nil {
		return hr, fmt.Errorf("seeded hole %q: %w", h.Name, applyErr)
	}
	hr.Matrix = m
	for _, r := range m.Rows {
		exp := r.Expected.Negative() && r.Holds.OpenWithout(h.Off)
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
		}
		if red && !exp {
			hr.Unexpected = append(hr.Unexpected, r.ID+" ("+string(r.Observed)+")")
		}
	}
	hr.OK = len(hr.Missing) == 0 && len(hr.Unexpected) == 0 && len(hr.CheckFailed) == 0 && hr.Restored
	if !hr.Restored {
		return hr, fmt.Errorf("seeded hole %q: the host was not restored: %s", h.Name, hr.RestoreErr)
	}
	return hr, nil
}

const (
	brnf4 = "/proc/sys/net/bridge/bridge-nf-call-iptables"
	brnf6 = "/proc/sys/net/bridge/bridge-nf-call-ip6tables"
)

func (e *engine) fwSpec() firewall.Spec {
	gw := e.gateway
	return boxcore.FirewallSpec(e.o.Stack.Network, &net.IPNet{IP: net.IP(gw.Addr().AsSlice()), Mask: net.CIDRMask(gw.Bits(), 32)})
}

func (e *engine) veths() []string {
	var out []string
	for _, b := range e.boxes {
		out = append(out, b.Veth)
	}
	return out
}

// applyHole switches the hole's layers off.
func (e *engine) applyHole(ctx context.Context, h Hole, cfg map[string]string) error {
	cfg = maps.Clone(cfg)
	netChanged := false
	bt, gt := firewall.TableNames(e.o.Stack.Network)
	for _, l := range h.Off {
		switch l {
		case LayerNFTBridge:
			cc, err := nftables.New()
			if err != nil {
				return err
			}
			cc.DelTable(&nftables.Table{Name: bt, Family: nftables.TableFamilyBridge})
			if err := cc.Flush(); err != nil {
				return fmt.Errorf("deleting table bridge %s: %w", bt, err)
			}
		case LayerHostGuard:
			cc, err := nftables.New()
			if err != nil {
				return err
			}
			cc.DelChain(&nftables.Chain{Name: firewall.InputChain, Table: &nftables.Table{Name: gt, Family: nftables.TableFamilyINet}})
			if err := cc.Flush(); err != nil {
				return fmt.Errorf("deleting chain inet %s input: %w", gt, err)
			}
		case LayerBRNF:
			if err := os.WriteFile(brnf4, []byte("0"), 0o644); err != nil {
				return err
			}
			if err := os.WriteFile(brnf6, []byte("0"), 0o644); err != nil {
				return err
			}
		case LayerPortIso:
			for _, b := range e.boxes {
				if err := boxcore.LocalKernel().SetPortIsolated(b.Veth, false); err != nil {
					return err
				}
			}
		case LayerDNSModeNone:
			cfg["dns.mode"] = "managed"
			netChanged = true
		case LayerIgnoreNames, LayerNoHosts:
			var keep []string
			for _, line := range strings.Split(cfg["raw.dnsmasq"], "\n") {
				if strings.TrimSpace(line) != string(l) {
					keep = append(keep, line)
				}
			}
			cfg["raw.dnsmasq"] = strings.Join(keep, "\n")
			netChanged = true
		case LayerACL:
			delete(cfg, "security.acls")
			delete(cfg, "security.acls.default.ingress.action")
			delete(cfg, "security.acls.default.egress.action")
			netChanged = true
		case LayerIPv6Off:
			r := make([]byte, 4)
			_, _ = rand.Read(r)
			cfg["ipv6.address"] = fmt.Sprintf("fd42:%x:%x::1/64", r[:2], r[2:])
			cfg["ipv6.nat"] = "true"
			netChanged = true
		}
	}
	if netChanged {
		n, etag, err := e.c.Network(ctx, e.o.Stack.Network)
		if err != nil {
			return err
		}
		if err := updateNetwork(ctx, e.c, n.Name, cfg, n.Description, etag); err != nil {
			return fmt.Errorf("seeding %s: %w", h.Name, err)
		}
	}
	return nil
}

// waitIPv6 waits (up to 45 s) until every box shows a global/ULA address. SLAAC takes a
// router advertisement and duplicate address detection; the boxes' router solicitations are
// dropped by the host input guard, so they wait for dnsmasq's unsolicited RAs, which come
// every 5-20 s in its first minute — the first one may leave before the bridge's own
// link-local address is usable. 15 s missed it once in CI; 45 s covers two more.
func (e *engine) waitIPv6(ctx context.Context) {
	deadline := time.Now().Add(45 * time.Second)
	for _, b := range e.boxes {
		for time.Now().Before(deadline) {
			res, err := e.runInBox(ctx, b, []probes.Spec{{Kind: probes.KindFacts}})
			if err == nil && res[0].Facts != nil && res[0].Facts.HasGlobalIPv6 {
				break
			}
			time.Sleep(300 * time.Millisecond)
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
