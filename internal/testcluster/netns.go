package testcluster

import (
	"bufio"
	"crypto/rand"
	"errors"
	"fmt"
	"math/big"
	"net"
	"os"
	"os/exec"
	"strings"

	"github.com/claudebox/claudebox/internal/netdump"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/claudebox/claudebox/internal/mounts"
)

// routeProto marks the unreachable routes this package puts in the host namespace
// (rtnetlink protocol number, unassigned; claudebox's own flap guard uses 0xcb and
// boxcore.HostClaims skips only that one, so ours count as claimed ranges there).
const routeProto = 0xcc

// linkRange is where link and box subnets are picked from: RFC 2544's benchmarking range,
// never routed on the internet. Only 198.19.0.0/16 (the upper half) is used.
var linkRange = &net.IPNet{IP: net.IPv4(198, 19, 0, 0).To4(), Mask: net.CIDRMask(16, 32)}

// netnsDir is where `ip netns` keeps the named namespaces.
const netnsDir = "/run/netns"

// ipCmd runs `ip args...` and returns its error with its output.
func ipCmd(args ...string) error {
	out, err := exec.Command("ip", args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("ip %s: %v: %s", strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}

// addNetns creates a named network namespace (`ip netns add`) and brings its loopback up.
func addNetns(name string) error {
	if err := ipCmd("netns", "add", name); err != nil {
		return err
	}
	return withNs(name, func(h *netlink.Handle) error {
		lo, err := h.LinkByName("lo")
		if err != nil {
			return err
		}
		return h.LinkSetUp(lo)
	})
}

// withNs runs f with a netlink handle inside the named namespace.
func withNs(name string, f func(h *netlink.Handle) error) error {
	ns, err := netns.GetFromName(name)
	if err != nil {
		return fmt.Errorf("netns %s: %w", name, err)
	}
	defer ns.Close()
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		return fmt.Errorf("netlink in %s: %w", name, err)
	}
	defer h.Close()
	if err := f(h); err != nil {
		return fmt.Errorf("netns %s: %w", name, err)
	}
	return nil
}

// netnsInode returns the inode of a named namespace (what /proc/<pid>/ns/net points at).
func netnsInode(name string) (uint64, error) {
	var st unix.Stat_t
	if err := unix.Stat(netnsDir+"/"+name, &st); err != nil {
		return 0, err
	}
	return st.Ino, nil
}

// listNetns returns the names of the named network namespaces.
func listNetns() []string {
	ents, err := os.ReadDir(netnsDir)
	if err != nil {
		return nil
	}
	var out []string
	for _, e := range ents {
		out = append(out, e.Name())
	}
	return out
}

// buildLink creates the link namespace with bridge br0 and one veth per member namespace:
// "m<i>" on the bridge in the link namespace, "eth0" with addrs[i] in member i's namespace.
// Nothing is created in the host namespace.
func buildLink(linkNs string, memberNs []string, addrs []*net.IPNet) error {
	if err := addNetns(linkNs); err != nil {
		return err
	}
	lns, err := netns.GetFromName(linkNs)
	if err != nil {
		return err
	}
	defer lns.Close()
	return withNs(linkNs, func(h *netlink.Handle) error {
		br := &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: "br0"}}
		if err := h.LinkAdd(br); err != nil {
			return fmt.Errorf("adding br0: %w", err)
		}
		brl, err := h.LinkByName("br0")
		if err != nil {
			return err
		}
		if err := h.LinkSetUp(brl); err != nil {
			return err
		}
		for i, mns := range memberNs {
			if err := addNetns(mns); err != nil {
				return err
			}
			mh, err := netns.GetFromName(mns)
			if err != nil {
				return err
			}
			port := fmt.Sprintf("m%d", i+1)
			v := &netlink.Veth{
				LinkAttrs:     netlink.LinkAttrs{Name: port, MasterIndex: brl.Attrs().Index},
				PeerName:      "eth0",
				PeerNamespace: netlink.NsFd(int(mh)),
			}
			err = h.LinkAdd(v)
			mh.Close()
			if err != nil {
				return fmt.Errorf("adding veth %s: %w", port, err)
			}
			pl, err := h.LinkByName(port)
			if err != nil {
				return err
			}
			if err := h.LinkSetUp(pl); err != nil {
				return err
			}
			addr := addrs[i]
			if err := withNs(mns, func(mh *netlink.Handle) error {
				eth, err := mh.LinkByName("eth0")
				if err != nil {
					return err
				}
				if err := mh.AddrAdd(eth, &netlink.Addr{IPNet: addr}); err != nil {
					return err
				}
				return mh.LinkSetUp(eth)
			}); err != nil {
				return err
			}
		}
		return nil
	})
}

// hostClaims returns the IPv4 ranges the host namespace routes (any table, default routes
// aside) or has addresses in.
func hostClaims() ([]*net.IPNet, error) {
	var out []*net.IPNet
	routes, err := netdump.RoutesFiltered(netlink.FAMILY_V4, &netlink.Route{Table: unix.RT_TABLE_UNSPEC}, netlink.RT_FILTER_TABLE)
	if err != nil {
		return nil, fmt.Errorf("reading the routing table: %w", err)
	}
	for _, r := range routes {
		if r.Dst == nil {
			continue
		}
		if ones, _ := r.Dst.Mask.Size(); ones == 0 {
			continue
		}
		out = append(out, r.Dst)
	}
	addrs, err := netdump.Addrs(nil, netlink.FAMILY_V4)
	if err != nil {
		return nil, fmt.Errorf("reading host addresses: %w", err)
	}
	for _, a := range addrs {
		if a.IPNet != nil {
			out = append(out, &net.IPNet{IP: a.IP.Mask(a.Mask), Mask: a.Mask})
		}
	}
	return out, nil
}

func overlaps(a, b *net.IPNet) bool { return a.Contains(b.IP) || b.Contains(a.IP) }

// guardRoute is the unreachable route standing for a claimed /24 in the host namespace.
func guardRoute(n *net.IPNet) *netlink.Route {
	return &netlink.Route{Dst: n, Type: unix.RTN_UNREACHABLE, Protocol: routeProto, Table: unix.RT_TABLE_MAIN}
}

// claimSubnet picks a /24 of 198.19.0.0/16 the host routes nothing into, records it in the
// run's nets file first (so a concurrent Sweep never takes it for a dead run's), then adds
// the unreachable route for it in the host namespace. The route's exclusive add is the
// claim: another run that raced for the same /24 fails it and picks again.
func claimSubnet(r *runState) (*net.IPNet, error) {
	start, err := rand.Int(rand.Reader, big.NewInt(256))
	if err != nil {
		return nil, err
	}
	for k := 0; k < 256; k++ {
		third := byte((int(start.Int64()) + k) % 256)
		cand := &net.IPNet{IP: net.IPv4(198, 19, third, 0).To4(), Mask: net.CIDRMask(24, 32)}
		claims, err := hostClaims()
		if err != nil {
			return nil, err
		}
		taken := false
		for _, c := range claims {
			if overlaps(c, cand) {
				taken = true
				break
			}
		}
		if taken {
			continue
		}
		if err := r.addNet(cand); err != nil {
			return nil, err
		}
		if err := netlink.RouteAdd(guardRoute(cand)); err != nil {
			_ = r.removeNet(cand)
			if errors.Is(err, unix.EEXIST) {
				continue
			}
			return nil, fmt.Errorf("adding the unreachable route for %s: %w", cand, err)
		}
		return cand, nil
	}
	return nil, fmt.Errorf("no free /24 in %s: the host routes into all of them", linkRange)
}

// guardRoutes lists this package's unreachable routes in the host namespace.
func guardRoutes() []*net.IPNet {
	routes, err := netdump.RoutesFiltered(netlink.FAMILY_V4, &netlink.Route{Table: unix.RT_TABLE_MAIN}, netlink.RT_FILTER_TABLE)
	if err != nil {
		return nil
	}
	var out []*net.IPNet
	for _, r := range routes {
		if r.Type == unix.RTN_UNREACHABLE && r.Protocol == routeProto && r.Dst != nil && linkRange.Contains(r.Dst.IP) {
			out = append(out, r.Dst)
		}
	}
	return out
}

// delGuardRoute removes the unreachable route for n (absent is fine).
func delGuardRoute(n *net.IPNet) error {
	if err := netlink.RouteDel(guardRoute(n)); err != nil && !errors.Is(err, unix.ESRCH) {
		return fmt.Errorf("removing the unreachable route for %s: %w", n, err)
	}
	return nil
}

// cgroupMounts returns the host's mounts at and under /sys/fs/cgroup, in mount order, as
// (fstype, source, target, options) from /proc/self/mounts.
func cgroupMounts() ([][4]string, error) {
	f, err := os.Open("/proc/self/mounts")
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out [][4]string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fl := strings.Fields(sc.Text())
		if len(fl) < 4 {
			continue
		}
		target := mounts.Unescape(fl[1])
		if target != "/sys/fs/cgroup" && !strings.HasPrefix(target, "/sys/fs/cgroup/") {
			continue
		}
		out = append(out, [4]string{fl[2], mounts.Unescape(fl[0]), target, fl[3]})
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	if len(out) == 0 {
		return nil, errors.New("no cgroup mounts under /sys/fs/cgroup in /proc/self/mounts")
	}
	return out, nil
}

// shq quotes s for /bin/sh.
func shq(s string) string { return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'" }

// remountScript is the shell prelude that re-mounts the host's cgroup mounts inside the
// private mount namespace `ip netns exec` makes (it re-mounts /sys for the new network
// namespace, which hides /sys/fs/cgroup: an incusd started without this runs containers
// with no cgroup at all, silently).
func remountScript() (string, error) {
	ms, err := cgroupMounts()
	if err != nil {
		return "", err
	}
	var b strings.Builder
	b.WriteString("set -e\n")
	for _, m := range ms {
		fmt.Fprintf(&b, "mkdir -p %s && mount -t %s -o %s %s %s\n", shq(m[2]), shq(m[0]), shq(m[3]), shq(m[1]), shq(m[2]))
	}
	return b.String(), nil
}
