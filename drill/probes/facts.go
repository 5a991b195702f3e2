package probes

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"strings"

	"github.com/claudebox/claudebox/internal/netdump"
	"github.com/miekg/dns"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// MachineIDFile is read for Facts.MachineID when present.
var MachineIDFile = "/etc/machine-id"

// Facts is what the box knows about itself, for the IPv6 claim ("no global or
// ULA address, no IPv6 default route") and to tell the engine which address
// the box got from DHCP.
type Facts struct {
	Hostname  string `json:"hostname"`
	MachineID string `json:"machine_id,omitempty"`
	// Iface is the interface the lease lives on (eth0 unless the spec says).
	Iface string `json:"iface"`
	// IPv4 lists Iface's IPv4 addresses in CIDR form: the lease.
	IPv4 []string `json:"ipv4"`
	// IPv6 lists every IPv6 address on every interface but lo, with its scope.
	IPv6          []IPv6Addr `json:"ipv6"`
	DefaultRoutes []Route    `json:"default_routes"`
	// HasGlobalIPv6 is true if any address is global or ULA, or an IPv6
	// default route exists: the things ipv6.address=none must prevent.
	HasGlobalIPv6 bool     `json:"has_global_ipv6"`
	Nameservers   []string `json:"nameservers,omitempty"`
	Interfaces    []Iface  `json:"interfaces"`
}

// IPv6Addr is one IPv6 address and its scope: "global", "ula", "link-local"
// or "loopback"/"other".
type IPv6Addr struct {
	Iface string   `json:"iface"`
	Addr  string   `json:"addr"` // CIDR
	Scope string   `json:"scope"`
	Flags []string `json:"flags,omitempty"` // tentative, dadfailed, deprecated, dynamic
}

// Route is a default route.
type Route struct {
	Family  string `json:"family"` // "ipv4" or "ipv6"
	Gateway string `json:"gateway,omitempty"`
	Iface   string `json:"iface,omitempty"`
}

// Iface is one interface's state.
type Iface struct {
	Name  string   `json:"name"`
	MAC   string   `json:"mac,omitempty"`
	Up    bool     `json:"up"`
	Addrs []string `json:"addrs,omitempty"`
}

func probeFacts(s Spec, r *Result) {
	f, err := GatherFacts(s.Iface)
	r.Facts = f
	if err != nil {
		r.Outcome, r.Evidence = CheckFailed, err.Error()
		return
	}
	r.Outcome = Open
	r.Answer = strings.Join(f.IPv4, ",")
	r.Evidence = fmt.Sprintf("%d IPv4 on %s, %d IPv6, %d default route(s)", len(f.IPv4), f.Iface, len(f.IPv6), len(f.DefaultRoutes))
}

// GatherFacts reads addresses and routes from the kernel. iface defaults to
// eth0; its absence is not an error (Facts then shows no lease), but a kernel
// that cannot be asked is.
func GatherFacts(iface string) (*Facts, error) {
	if iface == "" {
		iface = DefaultIface
	}
	f := &Facts{Iface: iface, IPv4: []string{}, IPv6: []IPv6Addr{}, DefaultRoutes: []Route{}}
	f.Hostname, _ = os.Hostname()
	if b, err := os.ReadFile(MachineIDFile); err == nil {
		f.MachineID = strings.TrimSpace(string(b))
	}
	if cfg, err := dns.ClientConfigFromFile(ResolvConf); err == nil {
		f.Nameservers = cfg.Servers
	}
	names, err := f.gatherInterfaces()
	if err != nil {
		return f, err
	}
	if err := f.gatherDefaultRoutes(names); err != nil {
		return f, err
	}
	if len(f.Interfaces) == 0 {
		return f, errors.New("no interfaces visible")
	}
	return f, nil
}

// gatherInterfaces fills in every interface and its addresses, and returns the
// interface names by index (for the routes).
func (f *Facts) gatherInterfaces() (map[int]string, error) {
	links, err := netdump.Links()
	if err != nil {
		return nil, fmt.Errorf("listing interfaces: %w", err)
	}
	names := map[int]string{}
	for _, l := range links {
		a := l.Attrs()
		names[a.Index] = a.Name
		fi := Iface{Name: a.Name, Up: a.Flags&net.FlagUp != 0}
		if len(a.HardwareAddr) > 0 {
			fi.MAC = a.HardwareAddr.String()
		}
		addrs, err := netdump.Addrs(l, netlink.FAMILY_ALL)
		if err != nil {
			return nil, fmt.Errorf("listing addresses of %s: %w", a.Name, err)
		}
		for _, ad := range addrs {
			f.recordAddr(&fi, ad)
		}
		f.Interfaces = append(f.Interfaces, fi)
	}
	return names, nil
}

// recordAddr records one address of interface fi: on fi, and as the lease (IPv4
// on f.Iface) or an IPv6 address (any but loopback).
func (f *Facts) recordAddr(fi *Iface, ad netlink.Addr) {
	ip, ok := netip.AddrFromSlice(ad.IP)
	if !ok {
		return
	}
	ones, _ := ad.Mask.Size()
	cidr := netip.PrefixFrom(ip.Unmap(), ones).String()
	fi.Addrs = append(fi.Addrs, cidr)
	if ip.Unmap().Is4() {
		if fi.Name == f.Iface {
			f.IPv4 = append(f.IPv4, cidr)
		}
		return
	}
	if ip.IsLoopback() {
		return
	}
	v6 := IPv6Addr{Iface: fi.Name, Addr: cidr, Scope: v6Scope(ip), Flags: addrFlags(ad.Flags)}
	if v6.Scope == "global" || v6.Scope == "ula" {
		f.HasGlobalIPv6 = true
	}
	f.IPv6 = append(f.IPv6, v6)
}

// gatherDefaultRoutes fills in the unicast default routes of both families;
// any IPv6 one counts as global IPv6.
func (f *Facts) gatherDefaultRoutes(names map[int]string) error {
	for _, fam := range []int{netlink.FAMILY_V4, netlink.FAMILY_V6} {
		rs, err := netdump.Routes(nil, fam)
		if err != nil {
			return fmt.Errorf("listing routes: %w", err)
		}
		for _, rt := range rs {
			if rt.Dst != nil {
				if ones, _ := rt.Dst.Mask.Size(); ones != 0 {
					continue
				}
			}
			if rt.Type != unix.RTN_UNICAST && rt.Type != 0 {
				continue
			}
			dr := Route{Family: "ipv4", Iface: names[rt.LinkIndex]}
			if fam == netlink.FAMILY_V6 {
				dr.Family = "ipv6"
				f.HasGlobalIPv6 = true
			}
			if rt.Gw != nil {
				dr.Gateway = rt.Gw.String()
			}
			f.DefaultRoutes = append(f.DefaultRoutes, dr)
		}
	}
	return nil
}

func v6Scope(ip netip.Addr) string {
	switch {
	case ip.IsLoopback():
		return "loopback"
	case ip.IsLinkLocalUnicast():
		return "link-local"
	case ip.IsPrivate(): // fc00::/7
		return "ula"
	case ip.IsGlobalUnicast():
		return "global"
	default:
		return "other"
	}
}

func addrFlags(fl int) []string {
	var out []string
	for _, f := range []struct {
		bit  int
		name string
	}{
		{unix.IFA_F_TENTATIVE, "tentative"},
		{unix.IFA_F_DADFAILED, "dadfailed"},
		{unix.IFA_F_DEPRECATED, "deprecated"},
		{unix.IFA_F_PERMANENT, "permanent"},
	} {
		if fl&f.bit != 0 {
			out = append(out, f.name)
		}
	}
	if fl&unix.IFA_F_PERMANENT == 0 {
		out = append(out, "dynamic")
	}
	return out
}
