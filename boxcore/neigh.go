package boxcore

import (
	"fmt"
	"net"
	"net/netip"
	"strings"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// NeighbourMAC is the MAC the host's neighbour table holds for ip on bridge ("" if none): a
// box answering ARP for a sibling's address would move it to its own MAC.
func (k Kernel) NeighbourMAC(bridge string, ip netip.Addr) (string, error) {
	l, err := netlink.LinkByName(bridge)
	if err != nil {
		return "", err
	}
	ns, err := netlink.NeighList(l.Attrs().Index, netlink.FAMILY_V4)
	if err != nil {
		return "", fmt.Errorf("neighbours of %s: %w", bridge, err)
	}
	for _, n := range ns {
		if a, ok := netip.AddrFromSlice(n.IP.To4()); ok && a == ip && n.HardwareAddr != nil {
			return strings.ToLower(n.HardwareAddr.String()), nil
		}
	}
	return "", nil
}

// FDBPorts are the bridge ports on which bridge has learnt mac: a box sending with a
// sibling's MAC would move it to its own port, and the host's frames for the sibling with it.
func (k Kernel) FDBPorts(bridge, mac string) ([]string, error) {
	br, err := netlink.LinkByName(bridge)
	if err != nil {
		return nil, err
	}
	hw, err := net.ParseMAC(mac)
	if err != nil {
		return nil, err
	}
	ns, err := netlink.NeighList(0, unix.AF_BRIDGE)
	if err != nil {
		return nil, fmt.Errorf("fdb of %s: %w", bridge, err)
	}
	var out []string
	for _, n := range ns {
		if n.MasterIndex != br.Attrs().Index || n.HardwareAddr.String() != hw.String() {
			continue
		}
		if l, err := netlink.LinkByIndex(n.LinkIndex); err == nil {
			out = append(out, l.Attrs().Name)
		}
	}
	return out, nil
}
