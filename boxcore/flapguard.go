package boxcore

import (
	"errors"
	"fmt"
	"net"

	"github.com/claudebox/claudebox/internal/netdump"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// While Incus re-applies a network it removes the bridge's address for ~25 ms, and with it
// the connected route of the box subnet: the host's own packets to a box then follow the
// default route off the machine. An unreachable route for the subnet, with a metric no
// connected route reaches, catches them instead — in the routing table, apart from every
// nftables layer (the wall's rule for the same case can be switched off by a seeded hole).

// flapGuardProto marks the route as claudebox's (rtnetlink protocol number, unassigned).
const flapGuardProto = 0xcb

// flapGuardMetric is above any connected or configured route's.
const flapGuardMetric = 0xfffffff0

func flapGuardRoute(subnet *net.IPNet) *netlink.Route {
	return &netlink.Route{Dst: subnet, Type: unix.RTN_UNREACHABLE, Protocol: flapGuardProto,
		Priority: flapGuardMetric, Table: unix.RT_TABLE_MAIN}
}

// ensureFlapGuard installs (or keeps) the unreachable route for the box subnet.
func ensureFlapGuard(subnet *net.IPNet) error {
	if err := netlink.RouteReplace(flapGuardRoute(subnet)); err != nil {
		return fmt.Errorf("unreachable route for %s: %w", subnet, err)
	}
	return nil
}

// removeFlapGuard removes it (teardown).
func removeFlapGuard(subnet *net.IPNet) error {
	if err := netlink.RouteDel(flapGuardRoute(subnet)); err != nil && !errors.Is(err, unix.ESRCH) {
		return fmt.Errorf("removing the unreachable route for %s: %w", subnet, err)
	}
	return nil
}

// flapGuardPresent reports whether the route is there.
func flapGuardPresent(subnet *net.IPNet) bool {
	rs, err := netdump.RoutesFiltered(netlink.FAMILY_V4, &netlink.Route{Table: unix.RT_TABLE_MAIN, Dst: subnet},
		netlink.RT_FILTER_TABLE|netlink.RT_FILTER_DST)
	if err != nil {
		return false
	}
	for _, r := range rs {
		if r.Type == unix.RTN_UNREACHABLE && r.Protocol == flapGuardProto {
			return true
		}
	}
	return false
}
