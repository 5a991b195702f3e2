package boxcore

import (
	"context"
	"crypto/rand"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"

	"github.com/claudebox/claudebox/boxcore/incus"
	"github.com/claudebox/claudebox/firewall"
	"github.com/claudebox/claudebox/internal/addr4"
	"github.com/claudebox/claudebox/internal/netdump"
	"github.com/vishvananda/netlink"
)

// A box's NIC planned before it exists. Incus gives a NIC its MAC at create and its address
// at start (ipv4_filtering's DHCP reservation), so the port could only be bound once the start
// was over: the whole bind round (Incus reads, the nftables apply) came after it, most of what
// `new` took beyond `incus launch`. When `new` picks both itself — the MAC as the NIC's
// volatile hwaddr, the address as its ipv4.address (a static reservation Incus writes at
// create and checks against every other NIC's at start) — the port's binding is known before
// the box runs: the round binds it while Incus creates and starts the box, and only the
// port's own kernel state (its FDB pin, rp_filter) waits for the veth (prebind.go).

// addrLockPath serialises choosing an address with creating the instance that reserves it:
// two `new` picking the same free address would both fail at start (Incus refuses a static
// address another NIC defines, and it refuses both).
func addrLockPath(network string) string {
	return perDaemon("/run/claudebox-addr-" + network + ".lock")
}

// planNIC picks a free IPv4 address on the stack's bridge and an unused MAC for box — the
// plan: box's eth0 as its port will be bound — holding the address lock until release is
// called (after the create). It plans nothing (nil, no error) where the port is not this
// kernel's to bind (a remote daemon, a cluster: the member's agent binds) or the bridge has
// no IPv4 address this moment: Incus then allocates at start, and the box is bound after it,
// as before. Without root nothing binds at all (bindPorts says so).
func (bs *Boxes) planNIC(ctx context.Context, box string) (plan *firewall.PortBinding, release func(), err error) {
	release = func() {}
	if bs.Client.Remote() != "local" || os.Geteuid() != 0 {
		return nil, release, nil
	}
	if member, err := localMember(ctx, bs.Client); err != nil || member != "" {
		return nil, release, err
	}
	gw, ok := bridgeIPv4(bs.Stack.Network)
	if !ok {
		return nil, release, nil
	}
	if _, err := os.Stat(filepath.Join(incusDir(), "networks", bs.Stack.Network)); err != nil {
		// Not where this daemon keeps the network's dnsmasq files (another INCUS_DIR): what
		// is reserved cannot be read, and a pick could meet an address in use.
		return nil, release, nil
	}
	unlock, err := lockFile(ctx, addrLockPath(bs.Stack.Network), HostLockWait)
	if err != nil {
		return nil, release, err
	}
	usedIP, usedMAC := addressesInUse(bs.Stack.Network)
	ip, ok := freeAddress(gw, usedIP)
	if !ok {
		unlock() // a full subnet: Incus says so at start, in its own words
		return nil, release, nil
	}
	mac, err := freeMAC(usedMAC)
	if err != nil {
		unlock()
		return nil, release, err
	}
	return &firewall.PortBinding{Port: HostName(box), MAC: mac, IPv4: ip}, unlock, nil
}

// applyPlan puts plan on the create request: the NIC's static address and its MAC.
func applyPlan(req *incus.InstancesPost, plan *firewall.PortBinding) {
	req.Devices["eth0"]["ipv4.address"] = plan.IPv4.String()
	req.Config["volatile.eth0.hwaddr"] = plan.MAC.String()
}

// bridgeIPv4 is the bridge's IPv4 address and prefix as the kernel has it now.
func bridgeIPv4(bridge string) (netip.Prefix, bool) {
	l, err := netlink.LinkByName(bridge)
	if err != nil {
		return netip.Prefix{}, false
	}
	addrs, err := netdump.Addrs(l, netlink.FAMILY_V4)
	if err != nil {
		return netip.Prefix{}, false
	}
	for _, a := range addrs {
		ip, ok := netip.AddrFromSlice(a.IP.To4())
		ones, bits := a.Mask.Size()
		if ok && bits == 32 && ones >= 8 && ones <= 30 {
			return netip.PrefixFrom(ip, ones), true
		}
	}
	return netip.Prefix{}, false
}

// addressesInUse are the IPv4 addresses and MACs a new NIC on network must not take: every
// reservation Incus has written (dnsmasq.hosts: a static ipv4.address's from its create, an
// allocated one's from the NIC's first start, kept while the instance exists) and every
// lease dnsmasq recorded, read under the address lock. Listing the instances as well would
// add a NIC never started with a MAC of its own (1 in 2^24 to meet) at a listing's cost
// (25 ms with 36 instances) on new's critical path.
func addressesInUse(network string) (map[netip.Addr]bool, map[string]bool) {
	ips, macs := map[netip.Addr]bool{}, map[string]bool{}
	for _, h := range readDNSMasqHosts(network) {
		ips[h.ip], macs[h.mac.String()] = true, true
	}
	leases, _ := Leases(filepath.Join(incusDir(), "networks", network, "dnsmasq.leases"))
	for _, l := range leases {
		if l.IP.IsValid() {
			ips[l.IP] = true
		}
		if m, err := net.ParseMAC(l.MAC); err == nil {
			macs[m.String()] = true
		}
	}
	return ips, macs
}

// freeAddress is the lowest host address of gw's subnet that is neither the gateway nor in
// used (Incus's own allocator also takes the lowest; the drill's stand-in takes the highest).
func freeAddress(gw netip.Prefix, used map[netip.Addr]bool) (netip.Addr, bool) {
	sn := gw.Masked()
	last := addr4.Last(sn)
	for a := sn.Addr().Next(); a.IsValid() && a.Less(last); a = a.Next() {
		if a != gw.Addr() && !used[a] {
			return a, true
		}
	}
	return netip.Addr{}, false
}

// freeMAC is a random MAC in Incus's own range (10:66:6a) that no NIC has.
func freeMAC(used map[string]bool) (net.HardwareAddr, error) {
	for range 64 {
		m := net.HardwareAddr{0x10, 0x66, 0x6a, 0, 0, 0}
		if _, err := rand.Read(m[3:]); err != nil {
			return nil, err
		}
		if !used[m.String()] {
			return m, nil
		}
	}
	return nil, fmt.Errorf("new: no unused MAC address found")
}
