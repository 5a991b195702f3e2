package boxcore

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"strings"

	"github.com/claudebox/claudebox/boxcore/incus"
	"github.com/claudebox/claudebox/firewall"
)

// CheckRow is one expected-vs-actual reading of the stack.
type CheckRow struct {
	Layer    string `json:"layer"`
	Item     string `json:"item"`
	Expected string `json:"expected"`
	Actual   string `json:"actual"`
	OK       bool   `json:"ok"`
}

// CheckReport is every reading; OK only when all rows are.
type CheckReport struct {
	Rows []CheckRow `json:"rows"`
	OK   bool       `json:"ok"`
}

// Drift lists the rows that do not match.
func (r CheckReport) Drift() []CheckRow {
	var out []CheckRow
	for _, row := range r.Rows {
		if !row.OK {
			out = append(out, row)
		}
	}
	return out
}

type checker struct{ rows []CheckRow }

func (c *checker) add(layer, item, expected, actual string) {
	c.rows = append(c.rows, CheckRow{layer, item, expected, actual, expected == actual})
}

// note records a reading that is information, not a requirement.
func (c *checker) note(layer, item, actual string) {
	c.rows = append(c.rows, CheckRow{layer, item, "-", actual, true})
}

// Check reads back every piece of the stack, from Incus and from the kernel, against what
// init would make. Upstream resolvers are whatever the network holds: they are a choice, not
// a layer.
func (h *Host) Check(ctx context.Context) (CheckReport, error) {
	s := h.Stack
	c := &checker{}

	// Network.
	n, _, err := h.Client.Network(ctx, s.Network)
	var gw *net.IPNet
	switch {
	case errors.Is(err, incus.ErrNotFound):
		c.add("network", s.Network, "exists", "missing")
	case err != nil:
		return CheckReport{}, err
	default:
		if ip, sub, err := net.ParseCIDR(n.Config["ipv4.address"]); err == nil {
			gw = &net.IPNet{IP: ip.To4(), Mask: sub.Mask}
		}
		if gw == nil {
			c.add("network", s.Network+" ipv4.address", "an IPv4 /24", n.Config["ipv4.address"])
		} else {
			want := NetworkConfig(gw, upstreamServers(n.Config["raw.dnsmasq"]), s.ACL)
			for _, k := range sortedKeys(want) {
				if k == "raw.dnsmasq" {
					continue
				}
				c.add("network", s.Network+" "+k, want[k], n.Config[k])
			}
			_, opts := ParseRawDNSMasq(n.Config["raw.dnsmasq"])
			for _, o := range DNSOptions {
				c.add("network", s.Network+" raw.dnsmasq "+o, "present", presence(slices.Contains(opts, o)))
			}
			c.note("network", s.Network+" upstream resolvers", strings.Join(upstreamServers(n.Config["raw.dnsmasq"]), ","))
		}
	}

	// ACL.
	acl, _, err := h.Client.NetworkACL(ctx, s.ACL)
	switch {
	case errors.Is(err, incus.ErrNotFound):
		c.add("acl", s.ACL, "exists", "missing")
	case err != nil:
		return CheckReport{}, err
	default:
		want, have := renderSpecs(ACLEgress()), renderRules(acl.Egress)
		for i, w := range want {
			got := "missing"
			if i < len(have) {
				got = have[i]
			}
			c.add("acl", fmt.Sprintf("%s egress rule %d", s.ACL, i+1), w, got)
		}
		for i := len(want); i < len(have); i++ {
			c.add("acl", fmt.Sprintf("%s egress rule %d", s.ACL, i+1), "none", have[i])
		}
		c.add("acl", s.ACL+" ingress rules", "0", fmt.Sprint(len(acl.Ingress)))
	}

	// Profile.
	prof, _, err := h.Client.Profile(ctx, s.Profile)
	switch {
	case errors.Is(err, incus.ErrNotFound):
		c.add("profile", s.Profile, "exists", "missing")
	case err != nil:
		return CheckReport{}, err
	default:
		pool := "?"
		if root, ok := prof.Devices["root"]; ok {
			pool = root["pool"]
		}
		for name, want := range ProfileDevices(Stack{Network: s.Network, Pool: pool}) {
			c.add("profile", s.Profile+" device "+name, renderDevice(want), renderDevice(prof.Devices[name]))
		}
		for _, name := range sortedKeys(prof.Devices) {
			if name != "eth0" && name != "root" {
				c.add("profile", s.Profile+" device "+name, "absent", renderDevice(prof.Devices[name]))
			}
		}
		for k, v := range ProfileConfig() {
			c.add("profile", s.Profile+" "+k, v, prof.Config[k])
		}
	}

	// nftables, read over netlink.
	if gw != nil {
		drift, err := firewall.Check(FirewallSpec(s.Network, gw))
		if err != nil {
			return CheckReport{}, fmt.Errorf("reading nftables: %w", err)
		}
		bt, gt := firewall.TableNames(s.Network)
		if len(drift) == 0 {
			c.add("nftables", "tables "+bt+", "+gt, "as declared", "as declared")
		}
		for _, d := range drift {
			c.add("nftables", d.What, d.Expected, d.Actual)
		}
	}

	// Kernel: every port isolated, br_netfilter, dnsmasq as started, IPv6 off.
	ports, err := h.Kernel.BridgePorts(s.Network)
	if err != nil {
		return CheckReport{}, err
	}
	for _, p := range ports {
		c.add("port isolation", p.Name, "isolated", isolated(p.Isolated))
	}
	if len(ports) == 0 {
		c.note("port isolation", s.Network, "no ports (no running box)")
	}
	if v, ok := h.Kernel.BridgeNFCallIPTables(); ok {
		c.add("br_netfilter", "net.bridge.bridge-nf-call-iptables", "1", fmt.Sprint(v))
	} else {
		c.note("br_netfilter", "net.bridge.bridge-nf-call-iptables", "module not loaded (the ACL does not see box-to-box frames)")
	}
	if n.Name != "" {
		if d, ok := h.Kernel.FindDNSMasq(s.Network); !ok {
			c.add("dnsmasq", s.Network, "running", "not running")
		} else {
			for _, o := range DNSOptions {
				c.add("dnsmasq", "option "+o, "present", presence(slices.Contains(d.Options, o)))
			}
			c.add("dnsmasq", "instance-name domain (dns.mode)", "absent", presence(d.Flag("-s") || d.Flag("--domain")))
			names, err := LeaseNames(d.LeaseFile())
			if err != nil {
				c.add("dnsmasq", "names in leases", "none", "unreadable: "+err.Error())
			} else {
				c.add("dnsmasq", "names in leases", "none", listOrNone(names))
			}
		}
		if off, err := h.Kernel.IPv6Disabled(s.Network); err == nil {
			c.add("ipv6", s.Network+" disable_ipv6", "1", boolDigit(off))
		} else {
			c.add("ipv6", s.Network+" disable_ipv6", "1", "unreadable: "+err.Error())
		}
	}

	if s.Unit != "" {
		if h.Kernel.SystemdIsInit() {
			up, err := h.planUnit()
			if err == nil {
				c.add("boot", s.Unit, "installed", map[bool]string{true: "missing or stale", false: "installed"}[up.write])
			}
		} else {
			c.note("boot", s.Unit, "no systemd as PID 1: re-run 'claudebox host init' after a reboot")
		}
	}

	r := CheckReport{Rows: c.rows, OK: true}
	for _, row := range r.Rows {
		r.OK = r.OK && row.OK
	}
	return r, nil
}

func presence(b bool) string {
	if b {
		return "present"
	}
	return "absent"
}

func isolated(b bool) string {
	if b {
		return "isolated"
	}
	return "not isolated"
}

func boolDigit(b bool) string {
	if b {
		return "1"
	}
	return "0"
}

func renderDevice(d map[string]string) string {
	if d == nil {
		return "absent"
	}
	parts := make([]string, 0, len(d))
	for _, k := range sortedKeys(d) {
		parts = append(parts, k+"="+d[k])
	}
	return strings.Join(parts, " ")
}

func listOrNone(xs []string) string {
	if len(xs) == 0 {
		return "none"
	}
	return strings.Join(xs, ", ")
}
