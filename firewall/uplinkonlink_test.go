package firewall

import (
	"net/netip"
	"testing"
)

// An uplink's own connected subnet (the host's LAN: its router and
// neighbours) is blocked like any other local network once it is in the
// spec's Blocked (boxcore adds every uplink's on-link prefixes): the wall
// alone and the L2 ranges alone each drop it, both ways, while egress
// through the next hop on that subnet keeps working (rules match
// destinations, never next hops). In the lab the uplink cbwup holds
// 198.51.100.1/24; wan (198.51.100.2) is its neighbour and the next hop to
// the public decoy 203.0.113.2.
func TestUplinkOnLinkBlocked(t *testing.T) {
	t.Parallel()
	l := newPortLab(t)
	l.extraBlocked = []netip.Prefix{netip.MustParsePrefix("198.51.100.0/24")}
	listenUDP(t, l.wan, hostPort(wlWan, 7300))
	listenUDP(t, l.wan, hostPort(wlPublic, 7300))
	ps := []wallProbe{
		{name: "box→uplink neighbour " + wlWan + " (udp echo)", run: func() string { return udpFrom(l.box, "udp4", "", hostPort(wlWan, 7300)) }, want: dropped},
		{name: "control: box→public decoy through that neighbour as next hop", run: func() string { return udpFrom(l.box, "udp4", "", hostPort(wlPublic, 7300)) }, want: open},
	}
	holeWant := func(p wallProbe) string { return open }
	want := func(p wallProbe) string { return p.want }

	l.noL2(t)
	l.noWall(t)
	runWall(t, "no layer", ps, holeWant)

	// The wall alone: on, the blocked-range rules out, on again.
	l.loadWallOnly(t)
	runWall(t, "wall alone", ps, want)
	l.loadWallOnly(t, wFwdBlockedDst, wFwdBlockedSrc)
	runWall(t, "wall without the blocked-range rules", ps, holeWant)
	l.loadWallOnly(t)
	runWall(t, "wall alone again", ps, want)

	// The L2 ranges alone (no wall): on, out, on again.
	l.noWall(t)
	l.loadL2(t)
	runWall(t, "L2 ranges alone", ps, want)
	l.loadL2(t, kL2BlockedDst, kL2BlockedSrc)
	runWall(t, "L2 without the blocked-range rules", ps, holeWant)
	l.loadL2(t)
	runWall(t, "L2 ranges alone again", ps, want)

	// And without the prefix in Blocked, the wall lets the neighbour through
	// (the hole boxcore's uplink subnets close).
	l.noL2(t)
	l.extraBlocked = nil
	l.loadWallOnly(t)
	runWall(t, "wall without the uplink's subnet in Blocked", ps, holeWant)
}
