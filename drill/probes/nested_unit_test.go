package probes

import (
	"net/netip"
	"testing"
)

// A nested container's host unreachable is its box's own ARP failure only when the box's
// neighbour entry for the next hop failed; a port unreachable, a reject, or a next hop that
// answered stays refused.
func TestBoxSideARPFailures(t *testing.T) {
	silent := netip.MustParseAddr("10.87.0.3") // the box's who-has for it went unanswered
	res := []Result{
		{Probe: Spec{Kind: KindUDP, Target: "10.87.0.3"}, Outcome: Refused,
			Evidence: "ICMP unreachable (a router or firewall rejected it): read udp 198.18.0.42:35195->10.87.0.3:7002: read: no route to host"},
		{Probe: Spec{Kind: KindICMP, Target: "10.87.0.3"}, Outcome: Refused, Evidence: "ICMP destination unreachable code 1 from 10.87.0.6"},
		{Probe: Spec{Kind: KindUDP, Target: "10.87.0.3"}, Outcome: Refused,
			Evidence: "connection refused (TCP RST or ICMP port unreachable): read udp 198.18.0.42:1->10.87.0.3:7002: read: connection refused"},
		{Probe: Spec{Kind: KindICMP, Target: "10.87.0.3"}, Outcome: Refused, Evidence: "ICMP destination unreachable code 13 from 10.87.0.1"},
		{Probe: Spec{Kind: KindICMP, Target: "10.87.0.4"}, Outcome: Refused, Evidence: "ICMP destination unreachable code 1 from 10.87.0.6"},
		{Probe: Spec{Kind: KindUDP, Target: "10.87.0.3"}, Outcome: Open},
	}
	boxSideARPFailures(res, func(dst netip.Addr) (bool, string) { return dst == silent, dst.String() })
	want := []Outcome{Dropped, Dropped, Refused, Refused, Refused, Open}
	for i, r := range res {
		if r.Outcome != want[i] {
			t.Errorf("result %d (%s): %s, want %s", i, r.Evidence, r.Outcome, want[i])
		}
	}
}
