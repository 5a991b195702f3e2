package boxcore

import (
	"net"
	"net/netip"
	"os"
	"slices"
	"testing"

	"github.com/vishvananda/netlink"
)

// A route through an interface that is neither an uplink nor the bridge is an "other local
// network": it joins the blocked set unless a blocked range covers it already.
func TestOtherRoutes(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root")
	}
	l, _ := testVeth(t, "cbtdum")
	name := l.Attrs().Name
	if err := netlink.LinkSetUp(l); err != nil {
		t.Fatal(err)
	}
	// Documentation ranges, on a link to nowhere: nothing is ever sent.
	for _, cidr := range []string{"198.51.100.0/26", "10.99.0.0/16"} {
		_, n, _ := net.ParseCIDR(cidr)
		if err := netlink.RouteAdd(&netlink.Route{LinkIndex: l.Attrs().Index, Dst: n}); err != nil {
			t.Fatal(err)
		}
	}
	blocked := []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}
	got := otherRoutes("claudenet", []string{"eth0"}, blocked)
	if !slices.Contains(got, netip.MustParsePrefix("198.51.100.0/26")) {
		t.Errorf("other routes %v miss the dummy link's 198.51.100.0/26", got)
	}
	if slices.Contains(got, netip.MustParsePrefix("10.99.0.0/16")) {
		t.Errorf("other routes %v repeat a range 10/8 already blocks", got)
	}
	if got := otherRoutes("claudenet", []string{"eth0", name}, blocked); slices.Contains(got, netip.MustParsePrefix("198.51.100.0/26")) {
		t.Errorf("an admitted uplink's routes count as another network: %v", got)
	}
}

// testVeth makes a veth pair with both ends in this namespace (this kernel has no dummy
// driver), removed when the test ends: a link to nowhere for routes that are never used.
func testVeth(t *testing.T, prefix string) (link, peer netlink.Link) {
	t.Helper()
	name := prefix + randomToken()[:6]
	if err := netlink.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: name}, PeerName: name + "p"}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if l, err := netlink.LinkByName(name); err == nil {
			_ = netlink.LinkDel(l)
		}
	})
	link, _ = netlink.LinkByName(name)
	peer, _ = netlink.LinkByName(name + "p")
	return link, peer
}
