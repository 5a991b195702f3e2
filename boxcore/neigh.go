package boxcore

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"slices"
	"strings"

	"github.com/claudebox/claudebox/internal/netdump"
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
	ns, err := netdump.Neighs(l.Attrs().Index, netlink.FAMILY_V4)
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
	ns, err := netdump.Neighs(0, unix.AF_BRIDGE)
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

// ForgetLearnt deletes what the bridge and the host learnt about these boxes — the FDB
// entries of their MACs (dynamic ones: learnt, never the bridge's own) and the host's
// neighbour entries of their addresses — so a poisoning a seeded hole let through does not
// outlive it: the next frames are learnt again from the boxes themselves.
func (k Kernel) ForgetLearnt(bridge string, macs []string, ips []netip.Addr) error {
	br, err := netlink.LinkByName(bridge)
	if err != nil {
		return err
	}
	fdb, err := netdump.Neighs(0, unix.AF_BRIDGE)
	if err != nil {
		return err
	}
	var errs []error
	for _, n := range fdb {
		if n.MasterIndex != br.Attrs().Index || n.State&netlink.NUD_PERMANENT != 0 || n.State&netlink.NUD_NOARP != 0 {
			continue
		}
		for _, m := range macs {
			if strings.EqualFold(n.HardwareAddr.String(), m) {
				if err := netlink.NeighDel(&n); err != nil && !errors.Is(err, unix.ENOENT) {
					errs = append(errs, fmt.Errorf("fdb %s: %w", m, err))
				}
			}
		}
	}
	neigh, err := netdump.Neighs(br.Attrs().Index, netlink.FAMILY_V4)
	if err != nil {
		return errors.Join(append(errs, err)...)
	}
	for _, n := range neigh {
		if a, ok := netip.AddrFromSlice(n.IP.To4()); ok && slices.Contains(ips, a) {
			if err := netlink.NeighDel(&n); err != nil && !errors.Is(err, unix.ENOENT) {
				errs = append(errs, fmt.Errorf("neighbour %s: %w", a, err))
			}
		}
	}
	return errors.Join(errs...)
}

// LeaseHeld reports whether the bridge's running dnsmasq holds a lease of ip for mac in its
// lease file. (Incus's lease list also shows static allocations, which outlive a released
// lease: only the file says whether dnsmasq still holds it.)
func (k Kernel) LeaseHeld(bridge, mac string, ip netip.Addr) (bool, error) {
	d, ok := k.FindDNSMasq(bridge)
	if !ok || d.LeaseFile() == "" {
		return false, fmt.Errorf("no dnsmasq running for %s", bridge)
	}
	b, err := os.ReadFile(d.LeaseFile())
	if err != nil {
		return false, err
	}
	for _, l := range strings.Split(string(b), "\n") {
		f := strings.Fields(l) // expiry mac ip name client-id
		if len(f) >= 3 && strings.EqualFold(f[1], mac) && f[2] == ip.String() {
			return true, nil
		}
	}
	return false, nil
}
