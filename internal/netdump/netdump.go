// Package netdump retries netlink dumps that the kernel interrupted.
//
// A dump (links, addresses, routes, neighbours) that overlaps a change of the
// same table comes back flagged NLM_F_DUMP_INTR, and vishvananda/netlink
// returns its partial result with ErrDumpInterrupted. A box's interfaces and
// the bridge's ports change all the time while boxes start, so one
// interrupted dump must mean "ask again", not "the probe failed".
package netdump

import (
	"errors"

	"github.com/vishvananda/netlink"
)

// attempts bounds the retries: a table that changes on every dump for this
// long is a real failure worth reporting.
const attempts = 10

// Retry calls dump until it returns without ErrDumpInterrupted, at most
// attempts times; the last interrupted result is returned with its error.
func Retry[T any](dump func() (T, error)) (T, error) {
	var (
		v   T
		err error
	)
	for i := 0; i < attempts; i++ {
		v, err = dump()
		if !errors.Is(err, netlink.ErrDumpInterrupted) {
			return v, err
		}
	}
	return v, err
}

// Links is netlink.LinkList, retried.
func Links() ([]netlink.Link, error) { return Retry(netlink.LinkList) }

// Addrs is netlink.AddrList, retried.
func Addrs(link netlink.Link, family int) ([]netlink.Addr, error) {
	return Retry(func() ([]netlink.Addr, error) { return netlink.AddrList(link, family) })
}

// Routes is netlink.RouteList, retried.
func Routes(link netlink.Link, family int) ([]netlink.Route, error) {
	return Retry(func() ([]netlink.Route, error) { return netlink.RouteList(link, family) })
}

// RoutesFiltered is netlink.RouteListFiltered, retried.
func RoutesFiltered(family int, filter *netlink.Route, mask uint64) ([]netlink.Route, error) {
	return Retry(func() ([]netlink.Route, error) { return netlink.RouteListFiltered(family, filter, mask) })
}

// Neighs is netlink.NeighList, retried.
func Neighs(linkIndex, family int) ([]netlink.Neigh, error) {
	return Retry(func() ([]netlink.Neigh, error) { return netlink.NeighList(linkIndex, family) })
}
