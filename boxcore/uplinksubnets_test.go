package boxcore

import (
	"net"
	"net/netip"
	"os"
	"slices"
	"testing"

	"github.com/vishvananda/netlink"
)

// An uplink's on-link subnets (its connected prefix, a scope-link route through it) join the
// firewall's blocked set; a /32 reached through a next hop on it (the drill's public decoy)
// does not, nor does a range already blocked, nor a default route.
func TestUplinkSubnets(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root")
	}
	l, peer := testVeth(t, "cbtup")
	name := l.Attrs().Name
	// Documentation ranges on a link to nowhere (the peer stays here, up): nothing is sent.
	a, _ := netlink.ParseAddr("198.51.100.249/30")
	if err := netlink.AddrAdd(l, a); err != nil {
		t.Fatal(err)
	}
	for _, x := range []netlink.Link{l, peer} {
		if err := netlink.LinkSetUp(x); err != nil {
			t.Fatal(err)
		}
	}
	_, onlink, _ := net.ParseCIDR("203.0.113.0/25")
	_, public, _ := net.ParseCIDR("203.0.113.200/32")
	_, tenNet, _ := net.ParseCIDR("10.99.0.0/16")
	for _, r := range []*netlink.Route{
		{LinkIndex: l.Attrs().Index, Dst: onlink, Scope: netlink.SCOPE_LINK},
		{LinkIndex: l.Attrs().Index, Dst: public, Gw: net.ParseIP("198.51.100.250")},
		{LinkIndex: l.Attrs().Index, Dst: tenNet, Scope: netlink.SCOPE_LINK},
	} {
		if err := netlink.RouteAdd(r); err != nil {
			t.Fatalf("route %v: %v", r.Dst, err)
		}
	}
	blocked := []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}
	_, bridgeNet, _ := net.ParseCIDR("10.87.0.0/24")
	got := uplinkSubnets([]string{name}, bridgeNet, blocked)
	for _, want := range []string{"198.51.100.248/30", "203.0.113.0/25"} {
		if !slices.Contains(got, netip.MustParsePrefix(want)) {
			t.Errorf("uplink subnets %v miss %s", got, want)
		}
	}
	for _, not := range []string{"203.0.113.200/32", "10.99.0.0/16"} {
		if slices.Contains(got, netip.MustParsePrefix(not)) {
			t.Errorf("uplink subnets %v hold %s (a next-hop route, or already blocked)", got, not)
		}
	}
	if got := uplinkSubnets([]string{"eth0"}, bridgeNet, blocked); slices.Contains(got, netip.MustParsePrefix("198.51.100.248/30")) {
		t.Errorf("a non-uplink's subnet counts as an uplink's: %v", got)
	}
}
