package boxcore

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strings"
)

// CheckRow is one expected-vs-actual reading of the stack.
type CheckRow struct {
	Layer    string `json:"layer"`
	Item     string `json:"item"`
	Expected string `json:"expected"`
	Actual   string `json:"actual"`
	OK       bool   `json:"ok"`
	// Member, on a cluster, is the other member whose `host init` repairs this row; "" for
	// this member's own.
	Member string `json:"member,omitempty"`
}

// CheckReport is every reading; OK only when all rows are.
type CheckReport struct {
	Rows []CheckRow `json:"rows"`
	OK   bool       `json:"ok"`
}

// RepairOn splits the drift by where `host init` repairs it: here (this member, or a
// standalone host) and the other members, sorted.
func (r CheckReport) RepairOn() (here bool, members []string) {
	for _, row := range r.Drift() {
		if row.Member == "" {
			here = true
		} else if !slices.Contains(members, row.Member) {
			members = append(members, row.Member)
		}
	}
	slices.Sort(members)
	return here, members
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
	c.rows = append(c.rows, CheckRow{Layer: layer, Item: item, Expected: expected, Actual: actual, OK: expected == actual})
}

// addOn is add for a row that member's own `host init` repairs.
func (c *checker) addOn(member, layer, item, expected, actual string) {
	c.add(layer, item, expected, actual)
	c.rows[len(c.rows)-1].Member = member
}

// note records a reading that is information, not a requirement.
func (c *checker) note(layer, item, actual string) {
	c.rows = append(c.rows, CheckRow{Layer: layer, Item: item, Expected: "-", Actual: actual, OK: true})
}

// Check reads back every piece of the stack, from Incus and from the kernel, against what
// init would make. Upstream resolvers are whatever the network holds: they are a choice, not
// a layer.
func (h *Host) Check(ctx context.Context) (CheckReport, error) {
	st, err := h.Read(ctx)
	if err != nil {
		return CheckReport{}, err
	}
	c := &checker{}
	c.network(st)
	c.acl(st)
	c.profile(st)
	c.nftables(st)
	c.ports(st)
	c.bindings(st)
	c.exposures(st)
	c.fdbPins(st)
	c.rpFilter(st)
	c.kernel(st)
	if err := h.checkLimits(ctx, c); err != nil {
		return CheckReport{}, err
	}
	h.checkUnit(c)
	h.checkPool(ctx, c)
	if err := h.checkCluster(ctx, c, st); err != nil {
		return CheckReport{}, err
	}
	r := CheckReport{Rows: c.rows, OK: true}
	for _, row := range r.Rows {
		r.OK = r.OK && row.OK
	}
	return r, nil
}

func (c *checker) network(st *StackState) {
	s := st.Stack
	switch {
	case st.Network == nil:
		c.add("network", s.Network, "exists", "missing")
		return
	case st.Gateway == nil:
		c.add("network", s.Network+" ipv4.address", "an IPv4 /24", st.Network.Config["ipv4.address"])
		return
	}
	cfg := st.Network.Config
	want := NetworkConfig(s.Network, st.Gateway, upstreamServers(cfg["raw.dnsmasq"]), s.ACL, ReapplyMark(cfg["raw.dnsmasq"]))
	for _, k := range sortedKeys(want) {
		if k != "raw.dnsmasq" {
			c.add("network", s.Network+" "+k, want[k], cfg[k])
		}
	}
	// init removes every key it does not set (configDiff): what it would remove is drift,
	// such as bridge.external_interfaces joining the boxes' bridge to another segment.
	c.add("network", s.Network+" keys claudebox does not set", "none", keyList(foreignKeys(cfg, want)))
	_, opts := ParseRawDNSMasq(cfg["raw.dnsmasq"])
	for _, o := range DNSOptions {
		c.add("network", s.Network+" raw.dnsmasq "+o, "present", presence(slices.Contains(opts, o)))
	}
	// Not a layer: where the drill puts its test-domain forwarder without a re-apply.
	c.add("network", s.Network+" raw.dnsmasq "+ServersFileOption(s.Network), "present", presence(NamesServersFile(cfg["raw.dnsmasq"], s.Network)))
	c.note("network", s.Network+" upstream resolvers", strings.Join(upstreamServers(cfg["raw.dnsmasq"]), ","))
}

// acl compares the ACL object with the declared rules, then Incus's ACL chains in the kernel
// with what that ACL must put there: a rule deleted by hand from `inet incus` is drift.
func (c *checker) acl(st *StackState) {
	s := st.Stack
	if st.ACL == nil {
		c.add("acl", s.ACL, "exists", "missing")
	} else {
		want, have := renderSpecs(ACLEgress(st)), renderRules(st.ACL.Egress)
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
		c.add("acl", s.ACL+" ingress rules", "0", fmt.Sprint(len(st.ACL.Ingress)))
	}
	if st.Network == nil {
		return
	}
	drift := st.ACLKernelDrift()
	if len(drift) == 0 {
		c.add("acl (kernel)", "inet incus acl."+s.Network+" and its hook chains", "as declared", "as declared")
	}
	for _, d := range drift {
		c.add("acl (kernel)", "inet incus "+d, "as declared", "drift")
	}
}

func (c *checker) profile(st *StackState) {
	s := st.Stack
	if st.Profile == nil {
		c.add("profile", s.Profile, "exists", "missing")
		return
	}
	prof := st.Profile
	pool := "?"
	if root, ok := prof.Devices["root"]; ok {
		pool = root["pool"]
	}
	want := ProfileDevices(Stack{Network: s.Network, Pool: pool})
	for _, name := range sortedKeys(want) {
		c.add("profile", s.Profile+" device "+name, renderDevice(want[name]), renderDevice(prof.Devices[name]))
	}
	for _, name := range sortedKeys(prof.Devices) {
		if name != "eth0" && name != "root" {
			c.add("profile", s.Profile+" device "+name, "absent", renderDevice(prof.Devices[name]))
		}
	}
	cfg := ProfileConfig()
	for _, k := range sortedKeys(cfg) {
		c.add("profile", s.Profile+" "+k, cfg[k], prof.Config[k])
	}
}

func (c *checker) nftables(st *StackState) {
	if st.Gateway == nil {
		return
	}
	if len(st.FirewallDrift) == 0 {
		c.add("nftables", "tables "+st.Tables.Bridge+", "+st.Tables.Guard+", "+st.Tables.Wall, "as declared", "as declared")
	}
	for _, d := range st.FirewallDrift {
		c.add("nftables", d.What, d.Expected, d.Actual)
	}
}

// exposures: every proxy device of a box is an exposure (loopback only); one that is not is
// drift (its host port stays guarded meanwhile: see readBindings).
func (c *checker) exposures(st *StackState) {
	for _, p := range st.OddProxies {
		c.add("exposures", p, "only claudebox's exposures (loopback)", "a proxy claudebox never makes: remove it (claudebox incus BOX -- config device remove {} DEVICE) or use claudebox expose")
	}
	if len(st.OddProxies) == 0 {
		c.note("exposures", st.Stack.Network, fmt.Sprintf("%d exposed host port(s), each guarded", len(slices.Compact(slices.Sorted(slices.Values(st.Exposed))))))
	}
}

// ports: every box port isolated, and Incus's anti-spoofing chains in the kernel for it.
func (c *checker) ports(st *StackState) {
	for _, p := range st.Ports {
		c.add("port isolation", p.Name, "isolated", isolated(p.Isolated))
	}
	for _, p := range st.Ports {
		c.add("nic filtering", p.Name+portOwner(p), "filtered", map[bool]string{true: "filtered", false: "not filtered"}[p.Filtered])
	}
	if len(st.Ports) == 0 {
		c.note("port isolation", st.Stack.Network, "no ports (no running box)")
	}
}

func portOwner(p PortState) string {
	if p.Box == "" {
		return ""
	}
	return " (" + p.Box + ")"
}

// kernel: br_netfilter, dnsmasq as started, IPv6 off.
func (c *checker) kernel(st *StackState) {
	s := st.Stack
	if st.BridgeNF4.Loaded {
		c.add("br_netfilter", "net.bridge.bridge-nf-call-iptables", "1", fmt.Sprint(st.BridgeNF4.Value))
		c.add("br_netfilter", "net.bridge.bridge-nf-call-ip6tables", "1", fmt.Sprint(st.BridgeNF6.Value))
	} else {
		c.note("br_netfilter", "net.bridge.bridge-nf-call-iptables", "module not loaded (the ACL does not see box-to-box frames)")
	}
	if st.Network == nil {
		return
	}
	if !st.DNSMasqRunning {
		c.add("dnsmasq", s.Network, "running", "not running")
	} else {
		d := st.DNSMasq
		for _, o := range DNSOptions {
			c.add("dnsmasq", "option "+o, "present", presence(slices.Contains(d.Options, o)))
		}
		c.add("dnsmasq", "instance-name domain (dns.mode)", "absent", presence(d.Flag("-s") || d.Flag("--domain")))
		if st.LeaseErr != nil {
			c.add("dnsmasq", "names in leases", "none", "unreadable: "+st.LeaseErr.Error())
		} else {
			c.add("dnsmasq", "names in leases", "none", listOrNone(st.LeaseNames))
		}
	}
	if st.IPv6Err == nil {
		c.add("ipv6", s.Network+" disable_ipv6", "1", boolDigit(st.IPv6Disabled))
	} else {
		c.add("ipv6", s.Network+" disable_ipv6", "1", "unreadable: "+st.IPv6Err.Error())
	}
	c.note("apparmor", "confinement of the boxes' processes", appArmorState(appArmorEnabledFile))
}

// appArmorEnabledFile says whether the kernel's AppArmor is on ("Y").
var appArmorEnabledFile = "/sys/module/apparmor/parameters/enabled"

// appArmorState is host check's reading of AppArmor. Incus confines every container with an
// AppArmor profile where the kernel has it; where it does not (this project's machines), the
// boxes run unconfined: nothing claudebox can switch on, but one protection fewer under the
// namespaces and cgroups, which the attacker of the docker template noted. Information, not
// drift.
func appArmorState(path string) string {
	b, err := os.ReadFile(path)
	switch {
	case err != nil:
		return "not in this kernel: boxes run unconfined (user namespaces, cgroups, seccomp and the network layers still hold)"
	case strings.TrimSpace(string(b)) == "Y":
		return "enabled: Incus confines each box with its own profile"
	}
	return "disabled (" + strings.TrimSpace(string(b)) + "): boxes run unconfined (user namespaces, cgroups, seccomp and the network layers still hold)"
}

func (h *Host) checkUnit(c *checker) {
	s := h.Stack
	if s.Unit == "" {
		return
	}
	if !h.Kernel.SystemdIsInit() {
		c.note("boot", s.Unit, "no systemd as PID 1: nothing re-applies the firewall at boot (host init does)")
		return
	}
	if up, err := h.planUnit(); err == nil {
		c.add("boot", s.Unit, "installed", map[bool]string{true: "missing or stale", false: "installed"}[up.write])
	}
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
