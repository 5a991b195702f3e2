package probes

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/claudebox/claudebox/internal/netdump"
	"github.com/vishvananda/netlink"
)

// TestSpoofUDP: A sends from B's address to G's echo. Open: G records a
// datagram "from B" with the marker and echoes it to B, whose capture
// records it; A sees no reply (it went to B). Blocked by the port filter:
// neither G nor B sees anything. Sending from an address A owns shows what
// open means in A's own result: the reply came back here.
func TestSpoofUDP(t *testing.T) {
	needLAN(t)
	spec := func(src string) Spec {
		return Spec{Kind: KindSpoofUDP, Target: lanG, Port: 7002, Iface: "la0", Spoof: &SpoofSpec{SrcIP: src}, Timeout: lanWindow}
	}
	fromB := func(r Result) (atG, atB bool) {
		for _, h := range markerHits(lan.gLis.Hits(), r.Counts.Marker) {
			atG = atG || strings.HasPrefix(h.Peer, lanB+":")
		}
		for _, h := range markerHits(lan.bLis.Hits(), r.Counts.Marker) {
			atB = atB || (h.Frame != nil && h.Frame.SrcMAC == macG)
		}
		return atG, atB
	}
	t.Run("blocked by the port filter", func(t *testing.T) {
		withFilter(t, true)
		r := Run(context.Background(), spec(lanB))
		if r.Outcome != Dropped || r.Counts.Sent < 2 {
			t.Fatalf("%s sent %d (%s)", r.Outcome, r.Counts.Sent, r.Evidence)
		}
		if atG, atB := fromB(r); atG || atB {
			t.Errorf("forged datagram seen: at G %v, echo at B %v", atG, atB)
		}
	})
	t.Run("open", func(t *testing.T) {
		r := Run(context.Background(), spec(lanB))
		if r.Outcome != Dropped {
			t.Errorf("A's own view: %s (%s), want dropped (the echo went to B)", r.Outcome, r.Evidence)
		}
		if atG, atB := fromB(r); !atG || !atB {
			t.Errorf("forged datagram: at G %v, echo captured at B %v; want both", atG, atB)
		}
	})
	t.Run("reply reaches us", func(t *testing.T) {
		r := Run(context.Background(), spec(lanA2))
		if r.Outcome != Open || r.Counts.Replies == 0 {
			t.Errorf("%s (%s) %+v", r.Outcome, r.Evidence, r.Counts)
		}
	})
}

// TestARPSpoof: A tells G that B's address is at A's MAC while G talks to B.
// Open: G's neighbour entry moves to A and A captures B's traffic. Blocked
// by the port filter (ARP sender address must be A's): G keeps B's MAC and
// A captures nothing.
func TestARPSpoof(t *testing.T) {
	needLAN(t)
	gTalksToB(t)
	spec := Spec{Kind: KindARPSpoof, Target: lanG, Iface: "la0", Spoof: &SpoofSpec{VictimIP: lanB}, Timeout: lanWindow}
	t.Cleanup(func() { forgetB(t) })
	t.Run("blocked by the port filter", func(t *testing.T) {
		withFilter(t, true)
		r := Run(context.Background(), spec)
		if r.Outcome != Dropped || r.Counts.Captured != 0 || r.Counts.Sent < 2 {
			t.Errorf("%s (%s) %+v", r.Outcome, r.Evidence, r.Counts)
		}
		if m := gNeighbourOfB(t); m != macB {
			t.Errorf("G's entry for B: %q, want B's %s", m, macB)
		}
	})
	t.Run("open", func(t *testing.T) {
		r := Run(context.Background(), spec)
		if r.Outcome != Open || r.Counts.Captured == 0 {
			t.Errorf("%s (%s) %+v", r.Outcome, r.Evidence, r.Counts)
		}
		if m := gNeighbourOfB(t); m != macA {
			t.Errorf("G's entry for B: %q, want A's %s", m, macA)
		}
		t.Logf("%s", r.Evidence)
	})
}

// forgetB drops G's neighbour entry for B so later tests resolve B afresh.
func forgetB(t *testing.T) {
	_ = inNS(lan.g, func() error {
		l, err := netlink.LinkByName("lg0")
		if err != nil {
			return err
		}
		ns, _ := netdump.Neighs(l.Attrs().Index, netlink.FAMILY_V4)
		for _, n := range ns {
			if n.IP.String() == lanB {
				_ = netlink.NeighDel(&n)
			}
		}
		return nil
	})
}

// TestMACSpoof: A sends frames from B's MAC while G talks to B. Open: the
// bridge learns B's MAC on A's port and forwards G's frames for B to A.
// Blocked by the port filter (source MAC must be A's, dropped before the
// bridge learns): A captures nothing.
func TestMACSpoof(t *testing.T) {
	needLAN(t)
	gTalksToB(t)
	spec := Spec{Kind: KindMACSpoof, Iface: "la0", Spoof: &SpoofSpec{VictimMAC: macB}, Timeout: lanWindow}
	t.Run("blocked by the port filter", func(t *testing.T) {
		withFilter(t, true)
		r := Run(context.Background(), spec)
		if r.Outcome != Dropped || r.Counts.Captured != 0 || r.Counts.Sent < 2 {
			t.Errorf("%s (%s) %+v", r.Outcome, r.Evidence, r.Counts)
		}
	})
	t.Run("open", func(t *testing.T) {
		r := Run(context.Background(), spec)
		if r.Outcome != Open || r.Counts.Captured == 0 {
			t.Errorf("%s (%s) %+v", r.Outcome, r.Evidence, r.Counts)
		}
		t.Logf("%s", r.Evidence)
	})
	time.Sleep(50 * time.Millisecond) // B's own frames re-teach the bridge
}
