package probes

import (
	"context"
	"strings"
	"testing"
	"time"
)

const (
	macV      = "02:cb:00:00:05:99" // the victim's DHCP identity
	macW      = "02:cb:00:00:05:98" // who asks for the victim's address
	victimDIP = "198.18.5.120"
)

func dhcpSpec(kind Kind, d DHCPSpec) Spec {
	d.Server = lanG
	return Spec{Kind: kind, Iface: "la0", DHCP: &d, Timeout: lanWindow * 2}
}

// TestDHCP walks one lease through the three kinds: V takes .120 (steal of a
// free address: open); W's steal of it is NAKed (refused); with the port
// filter (chaddr must be A's MAC) a release of V's lease and the follow-up
// request are dropped and V keeps it; without it the release frees the
// lease and W gets .120 (open); a fake-MAC discover is dropped by the
// filter and offered without it.
func TestDHCP(t *testing.T) {
	needLAN(t)
	ctx := context.Background()
	expect := func(name string, r Result, want Outcome) {
		t.Helper()
		if r.Outcome != want {
			t.Errorf("%s: %s, want %s (%s) reply %+v", name, r.Outcome, want, r.Evidence, r.DHCPReply)
		}
	}
	leaseOf := func(mac string) bool { return strings.Contains(readLeases(t), mac+" "+victimDIP) }

	r := Run(ctx, dhcpSpec(KindDHCPSteal, DHCPSpec{VictimIP: victimDIP, AskMAC: macV}))
	expect("V takes a free address", r, Open)
	if r.DHCPReply == nil || r.DHCPReply.Type != "ACK" || r.DHCPReply.YourIP != victimDIP {
		t.Fatalf("reply %+v", r.DHCPReply)
	}
	waitFor(t, time.Second, "V's lease in the lease file", func() bool { return leaseOf(macV) })

	expect("W steals V's leased address", Run(ctx, dhcpSpec(KindDHCPSteal, DHCPSpec{VictimIP: victimDIP, AskMAC: macW})), Refused)

	release := dhcpSpec(KindDHCPRelease, DHCPSpec{VictimIP: victimDIP, VictimMAC: macV, AskMAC: macW})
	t.Run("release blocked by the port filter", func(t *testing.T) {
		withFilter(t, true)
		expect("release", Run(ctx, release), Dropped)
		if !leaseOf(macV) {
			t.Errorf("V lost its lease through the filter:\n%s", readLeases(t))
		}
	})
	t.Run("release open", func(t *testing.T) {
		r := Run(ctx, release)
		expect("release", r, Open)
		waitFor(t, time.Second, "W holding .120", func() bool { return leaseOf(macW) })
	})

	fake := dhcpSpec(KindDHCPFakeMAC, DHCPSpec{})
	t.Run("fake MAC blocked by the port filter", func(t *testing.T) {
		withFilter(t, true)
		expect("fake-mac", Run(ctx, fake), Dropped)
	})
	t.Run("fake MAC open", func(t *testing.T) {
		r := Run(ctx, fake)
		expect("fake-mac", r, Open)
		if r.DHCPReply == nil || r.DHCPReply.Type != "OFFER" {
			t.Errorf("reply %+v", r.DHCPReply)
		}
	})
	// Only the chaddr invented, from our own MAC: the chaddr filter still stops it, and
	// without it the server offers to the invented client.
	fakeChaddr := dhcpSpec(KindDHCPFakeMAC, DHCPSpec{OwnFrame: true})
	t.Run("fake chaddr from our own MAC blocked by the port filter", func(t *testing.T) {
		withFilter(t, true)
		expect("fake-chaddr", Run(ctx, fakeChaddr), Dropped)
	})
	t.Run("fake chaddr from our own MAC open", func(t *testing.T) {
		r := Run(ctx, fakeChaddr)
		expect("fake-chaddr", r, Open)
		if r.DHCPReply == nil || r.DHCPReply.Type != "OFFER" || r.DHCPReply.ChAddr == "" {
			t.Errorf("reply %+v", r.DHCPReply)
		}
	})
}
