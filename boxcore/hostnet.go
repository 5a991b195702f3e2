package boxcore

import (
	"bufio"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"

	"github.com/claudebox/claudebox/internal/netdump"
	"github.com/vishvananda/netlink"
)

// Claim is an IPv4 range something on the host already uses.
type Claim struct {
	Net *net.IPNet
	By  string // who holds it, for the error message: "route on eth0", "address on eth0", "Incus network x"
	Dev string // interface name, when the claim comes from the kernel
}

// HostClaims lists the IPv4 ranges the kernel routes or has addresses in. Default routes are
// not claims: they cover everything.
func HostClaims() ([]Claim, error) {
	var claims []Claim
	routes, err := netdump.RoutesFiltered(netlink.FAMILY_V4, &netlink.Route{Table: 0}, netlink.RT_FILTER_TABLE)
	if err != nil {
		return nil, fmt.Errorf("reading the routing table: %w", err)
	}
	for _, r := range routes {
		if r.Dst == nil || isDefault(r.Dst) || r.Dst.IP.IsLoopback() || r.Protocol == flapGuardProto {
			continue // claudebox's own unreachable route stands behind a subnet, claims none
		}
		dev := linkName(r.LinkIndex)
		claims = append(claims, Claim{Net: r.Dst, By: "route on " + dev, Dev: dev})
	}
	addrs, err := netdump.Addrs(nil, netlink.FAMILY_V4)
	if err != nil {
		return nil, fmt.Errorf("reading host addresses: %w", err)
	}
	for _, a := range addrs {
		if a.IPNet == nil || a.IP.IsLoopback() {
			continue
		}
		dev := linkName(a.LinkIndex)
		n := &net.IPNet{IP: a.IP.Mask(a.Mask), Mask: a.Mask}
		claims = append(claims, Claim{Net: n, By: "address " + a.IPNet.String() + " on " + dev, Dev: dev})
	}
	return claims, nil
}

func isDefault(n *net.IPNet) bool {
	ones, _ := n.Mask.Size()
	return ones == 0
}

func linkName(index int) string {
	if l, err := netlink.LinkByIndex(index); err == nil {
		return l.Attrs().Name
	}
	return fmt.Sprintf("if%d", index)
}

func overlaps(a, b *net.IPNet) bool {
	return a.Contains(b.IP) || b.Contains(a.IP)
}

// FindClaimant returns the first claim overlapping subnet, skipping claims held by the
// interface named self (our own bridge keeps its subnet).
func FindClaimant(subnet *net.IPNet, claims []Claim, self string) *Claim {
	for i := range claims {
		c := &claims[i]
		if self != "" && c.Dev == self {
			continue
		}
		if overlaps(subnet, c.Net) {
			return c
		}
	}
	return nil
}

// PickSubnet returns the first free /24 in 10.0.0.0/8, scanning from 10.87.0.0 so the choice is
// predictable but away from the low ranges home routers and VPNs favour.
func PickSubnet(claims []Claim, self string) (*net.IPNet, error) {
	for i := 0; i < 256*256; i++ {
		v := (87*256 + i) % (256 * 256)
		n := &net.IPNet{IP: net.IPv4(10, byte(v>>8), byte(v), 0).To4(), Mask: net.CIDRMask(24, 32)}
		if FindClaimant(n, claims, self) == nil {
			return n, nil
		}
	}
	return nil, &NoFreeSubnetError{}
}

// ParseSubnet accepts A.B.C.0/24 only: the bridge takes .1 and DHCP hands out the rest.
func ParseSubnet(s string) (*net.IPNet, error) {
	ip, n, err := net.ParseCIDR(s)
	if err != nil || ip.To4() == nil {
		return nil, &OptionError{Option: "subnet", Value: s, Want: "want an IPv4 /24 such as 10.87.0.0/24"}
	}
	if ones, _ := n.Mask.Size(); ones != 24 || !ip.Equal(n.IP) {
		return nil, &OptionError{Option: "subnet", Value: s, Want: fmt.Sprintf("want a /24 network address such as %s/24", n.IP.Mask(net.CIDRMask(24, 32)))}
	}
	n.IP = n.IP.To4()
	return n, nil
}

// Gateway returns the bridge address (.1) of a subnet, with its prefix.
func Gateway(subnet *net.IPNet) *net.IPNet {
	ip := make(net.IP, 4)
	copy(ip, subnet.IP.To4())
	ip[3] = 1
	return &net.IPNet{IP: ip, Mask: subnet.Mask}
}

// ParseDNS turns the dns option into upstream resolver addresses: "host" pins the host's current
// resolvers, otherwise a comma-separated list of IP addresses; empty means the defaults.
func ParseDNS(s string) ([]string, error) {
	switch strings.TrimSpace(s) {
	case "":
		return DefaultUpstreams, nil
	case "host":
		servers, err := HostResolvers()
		if err != nil {
			return nil, &OptionError{Option: "dns", Value: "host", Want: "the host's resolvers are unusable", Err: err}
		}
		return servers, nil
	}
	var out []string
	for _, f := range strings.Split(s, ",") {
		f = strings.TrimSpace(f)
		if net.ParseIP(f) == nil {
			return nil, &OptionError{Option: "dns", Value: s, Want: "want 'host' or IP addresses separated by commas"}
		}
		out = append(out, f)
	}
	return out, nil
}

// HostResolvers reads the host's nameservers. Behind systemd-resolved's stub it reads the real
// upstreams, since dnsmasq should not depend on the stub's own forwarding.
func HostResolvers() ([]string, error) {
	servers, err := readNameservers("/etc/resolv.conf")
	if err != nil {
		return nil, err
	}
	if len(servers) == 1 && servers[0] == "127.0.0.53" {
		if real, err := readNameservers("/run/systemd/resolve/resolv.conf"); err == nil && len(real) > 0 {
			servers = real
		}
	}
	if len(servers) == 0 {
		return nil, errors.New("no nameserver in /etc/resolv.conf")
	}
	return servers, nil
}

func readNameservers(path string) ([]string, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) >= 2 && fields[0] == "nameserver" && net.ParseIP(fields[1]) != nil {
			out = append(out, fields[1])
		}
	}
	return out, sc.Err()
}
