package firewall

import "testing"

// TestEgressGuardAlone proves the guard's egress chain as a layer of its own: with no NAT
// anywhere in the lab (no Incus, no wall) a box's datagram reaches the public decoy with the
// box's own address (the control: the probe sees un-NATed egress); with the guard's egress
// chain alone it never leaves; with the wall's masquerade beside it the decoy sees the
// uplink address (the guard drops nothing NATed).
func TestEgressGuardAlone(t *testing.T) {
	t.Parallel()
	l := newWallLab(t)
	public := listenRecorder(t, l.wan, "udp4", hostPort(wlPublic, 7100))
	seen := func() string {
		tok := token("egress")
		if err := sendUDP(l.box, "udp4", "", hostPort(wlPublic, 7100), tok); err != nil {
			return "check-failed: " + err.Error()
		}
		return public.wait(tok)
	}
	s := l.spec().Resolved()
	egressOnly := func() {
		t.Helper()
		must(t, RemovePart(s, PartGuard))
		obs, err := Read(s.Bridge)
		must(t, err)
		_, gt := TableNames(s.Bridge)
		var guardOnly Observed
		for _, ts := range obs.Tables {
			if ts.Name == gt {
				guardOnly.Tables = append(guardOnly.Tables, ts)
			}
		}
		var rules []Rule
		for _, r := range Desired(s) {
			if r.Table == gt && r.Chain == EgressChain {
				rules = append(rules, r)
			}
		}
		if len(rules) != 1 {
			t.Fatalf("the guard's egress chain has %d rules, want 1", len(rules))
		}
		must(t, applyRules(s, guardOnly, rules))
		l.flushConntrack(t)
	}

	l.noWall(t)
	must(t, RemovePart(s, PartGuard))
	if got := seen(); got != wlBox {
		t.Fatalf("control, no NAT and no guard: the decoy saw %q, want the box's own %s", got, wlBox)
	}
	egressOnly()
	if got := seen(); got != dropped {
		t.Errorf("the guard's egress chain alone: the decoy saw %q, want %s (un-NATed egress never leaves)", got, dropped)
	}
	l.loadWall(t)
	l.flushConntrack(t)
	if got := seen(); got != wlUp {
		t.Errorf("wall and guard egress: the decoy saw %q, want the uplink %s (NATed egress passes the guard)", got, wlUp)
	}
	must(t, RemovePart(s, PartGuard))
	l.loadWall(t, wNATMasq)
	l.flushConntrack(t)
	if got := seen(); got != wlBox {
		t.Errorf("hole, the wall without its masquerade and no guard: the decoy saw %q, want the box's own %s", got, wlBox)
	}
}
