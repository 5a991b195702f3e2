package probes

import (
	"context"
	"strings"
	"testing"
	"time"
)

const lanWindow = 400 * time.Millisecond

func frameSpecs() []Spec {
	var out []Spec
	for _, v := range FrameVariants {
		// Unicast to B, as the drill aims at a sibling: a broadcast would
		// also reach (and be answered by) the gateway.
		if v == FrameLinkLocalUDP {
			continue // aimed at the host through a link-local group MAC, not at a sibling
		}
		f := &FrameSpec{Variant: v, DstMAC: macB}
		if v == FrameARPZero {
			f.TargetIP = lanB
		}
		out = append(out, Spec{ID: v, Kind: KindFrame, Iface: "la0", Frame: f, Timeout: lanWindow})
	}
	return out
}

// frameReplies: the variants whose delivery A itself can see (an echo, an
// ARP reply); the others are seen only in B's capture.
var frameReplies = map[string]bool{FrameVLAN0IPv4: true, FrameVLAN0IPv6: true, FrameARPZero: true}

// TestFramesBlockedThenOpen: with port isolation every odd frame is lost on
// the way to B (B's capture records no marker, A sees no answer); without
// it B records each one, answers those that have an answer, and takes the
// rogue RA's prefix and default route.
func TestFramesBlockedThenOpen(t *testing.T) {
	needLAN(t)
	t.Run("blocked by port isolation", func(t *testing.T) {
		withIsolation(t, true)
		for _, r := range RunMany(context.Background(), frameSpecs()) {
			if r.Outcome != Dropped || r.Counts.Sent < 2 {
				t.Errorf("%s: %s, sent %d (%s)", r.Probe.ID, r.Outcome, r.Counts.Sent, r.Evidence)
			}
			if hs := markerHits(lan.bLis.Hits(), r.Counts.Marker); len(hs) > 0 {
				t.Errorf("%s: B captured it through isolation: %+v", r.Probe.ID, hs[0])
			}
		}
		if f := factsOfB(t); f.HasGlobalIPv6 {
			t.Errorf("B has global IPv6 without an RA reaching it: %+v", f.IPv6)
		}
	})
	// The bridge table alone: nft's "ether type" sees the priority tag
	// (0x8100), so "ether type != { ip, arp }" stops every VLAN-0 frame and
	// the raw ethertype; the ARP sender-address rule stops ARP from 0.0.0.0.
	t.Run("blocked by the bridge table", func(t *testing.T) {
		withFilter(t, true)
		for _, r := range RunMany(context.Background(), frameSpecs()) {
			if r.Outcome != Dropped {
				t.Errorf("%s: %s (%s)", r.Probe.ID, r.Outcome, r.Evidence)
			}
			if capturedFrom(markerHits(lan.bLis.Hits(), r.Counts.Marker), macA) {
				t.Errorf("%s: B captured it through the bridge table", r.Probe.ID)
			}
		}
	})
	t.Run("open", func(t *testing.T) {
		for _, r := range RunMany(context.Background(), frameSpecs()) {
			want := Dropped
			if frameReplies[r.Probe.ID] {
				want = Open
			}
			if r.Outcome != want {
				t.Errorf("%s: %s, want %s (%s)", r.Probe.ID, r.Outcome, want, r.Evidence)
			}
			if !capturedFrom(markerHits(lan.bLis.Hits(), r.Counts.Marker), macA) {
				t.Errorf("%s: B's capture has no marker frame from A", r.Probe.ID)
			}
		}
		waitFor(t, 2*time.Second, "B to take the rogue RA", func() bool { return factsOfB(t).HasGlobalIPv6 })
		f := factsOfB(t)
		gained := ""
		for _, a := range f.IPv6 {
			if strings.HasPrefix(a.Addr, "2001:db8:cb00:") {
				gained = a.Addr
			}
		}
		if gained == "" {
			t.Errorf("B's IPv6 after the RA: %+v routes %+v", f.IPv6, f.DefaultRoutes)
		}
		t.Logf("B after the rogue RA: %s, default routes %+v", gained, f.DefaultRoutes)
	})
}

func capturedFrom(hs []Hit, mac string) bool {
	for _, h := range hs {
		if h.Frame != nil && h.Frame.SrcMAC == mac {
			return true
		}
	}
	return false
}

func factsOfB(t *testing.T) *Facts {
	t.Helper()
	var f *Facts
	if err := inNS(lan.b, func() error {
		var err error
		f, err = GatherFacts("lb0")
		return err
	}); err != nil {
		t.Fatal(err)
	}
	return f
}

// TestCaptureRecordsUnexpectedSource: a plain TCP connect from A to B shows
// in B's capture as a frame from A's MAC; G's frames (the gateway) do not.
func TestCaptureRecordsUnexpectedSource(t *testing.T) {
	needLAN(t)
	gTalksToB(t)
	// G's first frames can precede B's ARP entry for its gateway (they are
	// then "unexpected", as a box's DHCP offer is before its route exists),
	// and the capture asks the neighbour table again only after its throttle:
	// wait for the entry, then past the throttle, under any load (a fixed
	// 100 ms failed a loaded CI run).
	deadline := time.Now().Add(5 * time.Second)
	for bNeighbourOfG(t) != macG {
		if time.Now().After(deadline) {
			t.Fatalf("B never learnt its gateway G at %s", macG)
		}
		time.Sleep(10 * time.Millisecond)
	}
	time.Sleep(gatewayReread + 100*time.Millisecond)
	since := time.Now()
	r := Run(context.Background(), Spec{Kind: KindTCP, Target: lanB, Port: 7001, Iface: "la0", Timeout: quick})
	if r.Outcome != Open {
		t.Fatalf("A to B: %s (%s)", r.Outcome, r.Evidence)
	}
	var fromA, fromG int
	for _, h := range lan.bLis.Hits() {
		if h.Frame == nil || h.Frame.Reason != "unexpected-source" {
			continue
		}
		// The capture records one hit per source and destination every captureRepeat: an
		// earlier test's A→B frames within that window stand for this connect's.
		switch {
		case h.Frame.SrcMAC == macA && !h.Time.Before(since.Add(-captureRepeat)):
			fromA++
		case h.Frame.SrcMAC == macG && !h.Time.Before(since):
			fromG++
		}
	}
	if fromA == 0 || fromG != 0 {
		t.Errorf("unexpected-source hits: %d from A (want >0), %d from the gateway (want 0)", fromA, fromG)
	}
}
