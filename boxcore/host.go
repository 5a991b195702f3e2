package boxcore

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/claudebox/claudebox/boxcore/incus"
	"github.com/claudebox/claudebox/firewall"
)

// Host converges, checks and removes the isolation stack on one Incus host.
type Host struct {
	Client *incus.Client
	Stack  Stack
	// Kernel reads and writes the host's kernel state; tests may point it elsewhere.
	Kernel Kernel
}

// NewHost returns a Host for the given stack on the local kernel.
func NewHost(c *incus.Client, s Stack) *Host {
	return &Host{Client: c, Stack: s, Kernel: LocalKernel()}
}

// InitOptions are the choices of `host init`. Empty fields keep what an existing stack has,
// or take the defaults for a new one.
type InitOptions struct {
	Subnet string // A.B.C.0/24
	DNS    string // "host" or IP[,IP...]
}

// Change is one thing init or teardown changed (or, in a plan, would change).
type Change struct {
	Object string // "network claudenet"
	What   string // "create 10.87.0.1/24", "set raw.dnsmasq"
}

func (c Change) String() string { return c.Object + ": " + c.What }

// InitPlan is what init will do, computed from the host's state without writing anything.
type InitPlan struct {
	Changes   []Change
	Gateway   *net.IPNet
	Upstreams []string
	Pool      string

	networkExists, aclExists, profileExists bool
	networkConfig                           map[string]string
	networkETag, aclETag, profileETag       string
	firewallDrift                           bool
	bridgeNF                                bool
	unisolated                              []string
	staleNames                              bool
	unit                                    *unitPlan
}

// PlanInit validates the options and reads the host to work out what init must change.
func (h *Host) PlanInit(ctx context.Context, opts InitOptions) (*InitPlan, error) {
	if err := h.Stack.Validate(); err != nil {
		return nil, err
	}
	var pinned *net.IPNet
	if opts.Subnet != "" {
		var err error
		if pinned, err = ParseSubnet(opts.Subnet); err != nil {
			return nil, &UsageError{Msg: err.Error()}
		}
	}
	var upstreams []string
	if opts.DNS != "" {
		var err error
		if upstreams, err = ParseDNS(opts.DNS); err != nil {
			return nil, &UsageError{Msg: err.Error()}
		}
	}
	p := &InitPlan{}
	s := h.Stack

	pool, err := h.pickPool(ctx)
	if err != nil {
		return nil, err
	}
	p.Pool = pool

	net0, netETag, err := h.Client.Network(ctx, s.Network)
	switch {
	case err == nil:
		p.networkExists, p.networkETag = true, netETag
	case errors.Is(err, incus.ErrNotFound):
	default:
		return nil, err
	}
	if p.networkExists && net0.Type != "bridge" {
		return nil, Usagef("network %s exists but is a %s network, not a bridge: remove it or pick another host", s.Network, net0.Type)
	}

	// The subnet: pinned, kept, or picked free.
	claims, err := HostClaims()
	if err != nil {
		return nil, err
	}
	claims = append(claims, h.incusClaims(ctx)...)
	var current *net.IPNet
	if p.networkExists {
		if ip, n, err := net.ParseCIDR(net0.Config["ipv4.address"]); err == nil {
			current = &net.IPNet{IP: ip.To4(), Mask: n.Mask}
		}
	}
	switch {
	case pinned != nil:
		if c := FindClaimant(pinned, claims, s.Network); c != nil {
			return nil, Usagef("subnet %s is already used by %s: pick another with --subnet", pinned, c.By)
		}
		p.Gateway = Gateway(pinned)
	case current != nil:
		p.Gateway = current
	default:
		subnet, err := PickSubnet(claims, s.Network)
		if err != nil {
			return nil, err
		}
		p.Gateway = Gateway(subnet)
	}

	switch {
	case upstreams != nil:
		p.Upstreams = upstreams
	case p.networkExists:
		if servers := upstreamServers(net0.Config["raw.dnsmasq"]); len(servers) > 0 {
			p.Upstreams = servers
		}
	}
	if p.Upstreams == nil {
		p.Upstreams = DefaultUpstreams
	}

	// ACL.
	acl, aclETag, err := h.Client.NetworkACL(ctx, s.ACL)
	switch {
	case err == nil:
		p.aclExists, p.aclETag = true, aclETag
		if !slices.Equal(renderRules(acl.Egress), renderSpecs(ACLEgress())) || len(acl.Ingress) > 0 {
			p.Changes = append(p.Changes, Change{"acl " + s.ACL, "rewrite rules"})
		}
	case errors.Is(err, incus.ErrNotFound):
		p.Changes = append(p.Changes, Change{"acl " + s.ACL, "create: drop egress to " + strings.Join(BlockedEgress, ", ")})
	default:
		return nil, err
	}

	// Network.
	p.networkConfig = NetworkConfig(p.Gateway, p.Upstreams, s.ACL)
	if !p.networkExists {
		p.Changes = append(p.Changes, Change{"network " + s.Network, "create NAT bridge " + p.Gateway.String()})
	} else {
		for _, k := range configDiff(net0.Config, p.networkConfig) {
			p.Changes = append(p.Changes, Change{"network " + s.Network, "set " + k})
		}
	}

	// Profile.
	prof, profETag, err := h.Client.Profile(ctx, s.Profile)
	wantDevices := ProfileDevices(Stack{Network: s.Network, Pool: pool})
	switch {
	case err == nil:
		p.profileExists, p.profileETag = true, profETag
		for _, k := range configDiff(prof.Config, ProfileConfig()) {
			p.Changes = append(p.Changes, Change{"profile " + s.Profile, "set " + k})
		}
		if !devicesEqual(prof.Devices, wantDevices) {
			p.Changes = append(p.Changes, Change{"profile " + s.Profile, "set devices eth0 (port isolation), root"})
		}
	case errors.Is(err, incus.ErrNotFound):
		p.Changes = append(p.Changes, Change{"profile " + s.Profile, "create: eth0 on " + s.Network + " with port isolation, root on " + pool})
	default:
		return nil, err
	}

	// Firewall: what the kernel holds now.
	drift, err := firewall.Check(FirewallSpec(s.Network, p.Gateway))
	if err != nil {
		return nil, fmt.Errorf("reading nftables: %w", err)
	}
	if len(drift) > 0 {
		p.firewallDrift = true
		bt, gt := firewall.TableNames(s.Network)
		p.Changes = append(p.Changes, Change{"nftables", "rebuild bridge " + bt + " (box-to-box drop) and inet " + gt + " (host input guard)"})
	}

	// Host names dnsmasq learnt while dhcp-ignore-names was off: they outlive the option.
	if d, ok := h.Kernel.FindDNSMasq(s.Network); ok {
		if names, err := LeaseNames(d.LeaseFile()); err == nil && len(names) > 0 {
			p.staleNames = true
			p.Changes = append(p.Changes, Change{"dnsmasq " + s.Network, "forget lease names " + strings.Join(names, ", ")})
		}
	}

	// Ports whose isolation flag was turned off behind Incus's back.
	ports, err := h.Kernel.BridgePorts(s.Network)
	if err != nil {
		return nil, err
	}
	for _, port := range ports {
		if !port.Isolated {
			p.unisolated = append(p.unisolated, port.Name)
			p.Changes = append(p.Changes, Change{"port " + port.Name, "isolate (brport/isolated=1)"})
		}
	}

	if v, ok := h.Kernel.BridgeNFCallIPTables(); ok && v != 1 {
		p.bridgeNF = true
		p.Changes = append(p.Changes, Change{"sysctl", "set net.bridge.bridge-nf-call-iptables=1"})
	}

	if s.Unit != "" && h.Kernel.SystemdIsInit() {
		up, err := h.planUnit()
		if err != nil {
			return nil, err
		}
		p.unit = up
		if up.write {
			p.Changes = append(p.Changes, Change{"systemd " + s.Unit, "install (re-applies the firewall at boot)"})
		}
	}
	return p, nil
}

// ApplyInit carries out a plan. The firewall chains and the ACL are rewritten whole on every run
// (converge, never create-if-missing); the result lists what actually differed before.
func (h *Host) ApplyInit(ctx context.Context, p *InitPlan) ([]Change, error) {
	s := h.Stack
	acl := incus.NetworkACL{Name: s.ACL, Description: "claudebox: boxes reach the public internet only", Egress: toRules(ACLEgress()), Ingress: []incus.ACLRule{}}
	if p.aclExists {
		if err := h.Client.UpdateNetworkACL(ctx, acl, ""); err != nil {
			return nil, fmt.Errorf("rewriting ACL %s: %w", s.ACL, err)
		}
	} else if err := h.Client.CreateNetworkACL(ctx, acl); err != nil {
		return nil, fmt.Errorf("creating ACL %s: %w", s.ACL, err)
	}

	if !p.networkExists {
		cfg := maps.Clone(p.networkConfig)
		maps.Copy(cfg, s.Marks)
		if err := h.Client.CreateNetwork(ctx, s.Network, "bridge", cfg, "claudebox: isolated NAT bridge for boxes"); err != nil {
			return nil, fmt.Errorf("creating network %s: %w", s.Network, err)
		}
	} else if hasChange(p.Changes, "network "+s.Network) {
		if err := h.putNetwork(ctx, p.networkConfig); err != nil {
			return nil, err
		}
	}

	if p.staleNames {
		if err := h.forgetLeaseNames(ctx); err != nil {
			return nil, err
		}
	}

	prof := incus.Profile{Name: s.Profile, Description: "claudebox: the isolation stack of every box",
		Config: ProfileConfig(), Devices: ProfileDevices(Stack{Network: s.Network, Pool: p.Pool})}
	if !p.profileExists {
		if err := h.Client.CreateProfile(ctx, prof); err != nil {
			return nil, fmt.Errorf("creating profile %s: %w", s.Profile, err)
		}
	} else if hasChange(p.Changes, "profile "+s.Profile) {
		if err := h.Client.UpdateProfile(ctx, prof, ""); err != nil {
			return nil, fmt.Errorf("updating profile %s: %w", s.Profile, err)
		}
	}

	if _, err := firewall.Apply(FirewallSpec(s.Network, p.Gateway)); err != nil {
		return nil, fmt.Errorf("applying nftables rules: %w", err)
	}
	for _, port := range p.unisolated {
		if err := h.Kernel.SetPortIsolated(port, true); err != nil {
			return nil, fmt.Errorf("isolating port %s: %w", port, err)
		}
	}
	if p.bridgeNF {
		if err := h.Kernel.SetBridgeNFCallIPTables(1); err != nil {
			return nil, err
		}
	}
	if p.unit != nil {
		if err := h.applyUnit(p.unit); err != nil {
			return nil, err
		}
	}
	return p.Changes, nil
}

// Init plans and applies in one go.
func (h *Host) Init(ctx context.Context, opts InitOptions) ([]Change, error) {
	p, err := h.PlanInit(ctx, opts)
	if err != nil {
		return nil, err
	}
	return h.ApplyInit(ctx, p)
}

// ApplyFirewall re-applies only the nftables rules, reading the gateway from the network;
// the boot unit runs this.
func (h *Host) ApplyFirewall(ctx context.Context) (bool, error) {
	n, _, err := h.Client.Network(ctx, h.Stack.Network)
	if err != nil {
		if errors.Is(err, incus.ErrNotFound) {
			return false, Usagef("network %s does not exist: run 'claudebox host init' first", h.Stack.Network)
		}
		return false, err
	}
	ip, sub, err := net.ParseCIDR(n.Config["ipv4.address"])
	if err != nil {
		return false, fmt.Errorf("network %s has no IPv4 address (%q): run 'claudebox host init'", h.Stack.Network, n.Config["ipv4.address"])
	}
	return firewall.Apply(FirewallSpec(h.Stack.Network, &net.IPNet{IP: ip, Mask: sub.Mask}))
}

// pickPool prefers the stack's pool, else the first pool the daemon has.
func (h *Host) pickPool(ctx context.Context) (string, error) {
	pools, err := h.Client.StoragePools(ctx)
	if err != nil {
		return "", err
	}
	if len(pools) == 0 {
		return "", fmt.Errorf("Incus has no storage pool: run 'make setup' (or 'incus storage create default dir')")
	}
	names := make([]string, 0, len(pools))
	for _, p := range pools {
		if p.Name == h.Stack.Pool {
			return p.Name, nil
		}
		names = append(names, p.Name)
	}
	slices.Sort(names)
	return names[0], nil
}

// incusClaims are the IPv4 subnets other Incus networks hold, whether or not their bridge is up.
func (h *Host) incusClaims(ctx context.Context) []Claim {
	nets, err := h.Client.Networks(ctx)
	if err != nil {
		return nil
	}
	var out []Claim
	for _, n := range nets {
		if !n.Managed || n.Name == h.Stack.Network {
			continue
		}
		if _, sub, err := net.ParseCIDR(n.Config["ipv4.address"]); err == nil {
			out = append(out, Claim{Net: sub, By: "Incus network " + n.Name})
		}
	}
	return out
}

// upstreamServers are the plain upstream resolvers of a raw.dnsmasq (domain-scoped servers,
// such as the drill's test-domain forwarder, are not upstreams).
func upstreamServers(raw string) []string {
	servers, _ := ParseRawDNSMasq(raw)
	var out []string
	for _, s := range servers {
		if !strings.HasPrefix(s, "/") {
			out = append(out, s)
		}
	}
	return out
}

// configDiff lists the keys whose value differs between have and want, ignoring volatile keys
// Incus manages itself and user.* keys, which are their owner's notes, not isolation.
func configDiff(have, want map[string]string) []string {
	var keys []string
	for _, k := range sortedKeys(want) {
		if have[k] != want[k] {
			keys = append(keys, k)
		}
	}
	for _, k := range sortedKeys(have) {
		if _, ok := want[k]; !ok && !keptKey(k) {
			keys = append(keys, k+" (remove)")
		}
	}
	return keys
}

func devicesEqual(a, b map[string]map[string]string) bool {
	return maps.EqualFunc(a, b, func(x, y map[string]string) bool { return maps.Equal(x, y) })
}

func hasChange(changes []Change, object string) bool {
	for _, c := range changes {
		if c.Object == object {
			return true
		}
	}
	return false
}

func toRules(specs []ACLRuleSpec) []incus.ACLRule {
	out := make([]incus.ACLRule, len(specs))
	for i, s := range specs {
		out[i] = incus.ACLRule{Action: s.Action, Destination: s.Destination, State: s.State, Description: s.Description}
	}
	return out
}

func renderSpecs(specs []ACLRuleSpec) []string { return renderRules(toRules(specs)) }

// renderRules turns ACL rules into comparable one-liners; any field we do not set shows up.
func renderRules(rules []incus.ACLRule) []string {
	out := make([]string, len(rules))
	for i, r := range rules {
		parts := []string{r.Action}
		for _, f := range []struct{ k, v string }{
			{"source", r.Source}, {"destination", r.Destination}, {"protocol", r.Protocol},
			{"source_port", r.SourcePort}, {"destination_port", r.DestinationPort},
			{"icmp_type", r.ICMPType}, {"icmp_code", r.ICMPCode}, {"state", r.State},
		} {
			if f.v != "" {
				parts = append(parts, f.k+"="+f.v)
			}
		}
		out[i] = strings.Join(parts, " ")
	}
	return out
}

// RequireRoot is the first precondition of every host verb.
func RequireRoot() error {
	if os.Geteuid() != 0 {
		return Usagef("this needs root (it changes the host's network and firewall): run it with sudo")
	}
	return nil
}

// keptKey is a config key converge leaves alone.
func keptKey(k string) bool {
	return strings.HasPrefix(k, "volatile.") || strings.HasPrefix(k, "user.")
}

// FirewallSpec is the nftables spec for a bridge and its gateway address with prefix.
func FirewallSpec(bridge string, gateway *net.IPNet) firewall.Spec {
	ones, _ := gateway.Mask.Size()
	return firewall.Spec{Bridge: bridge, Gateway: gateway.IP, PrefixLen: ones}
}

// putNetwork writes the network's config (keeping volatile.* and user.* keys). Incus 6.0.4
// sometimes fails such a PUT with "Failed to delete bridge children interfaces" when a box's
// veth vanishes at that moment; that race is retried.
func (h *Host) putNetwork(ctx context.Context, want map[string]string) error {
	var err error
	for attempt := 0; attempt < 4; attempt++ {
		var cur incus.Network
		cur, _, err = h.Client.Network(ctx, h.Stack.Network)
		if err != nil {
			return err
		}
		cfg := maps.Clone(want)
		for k, v := range cur.Config {
			if keptKey(k) {
				cfg[k] = v
			}
		}
		err = h.Client.UpdateNetwork(ctx, h.Stack.Network, cfg, cur.Description, "")
		if err == nil || !strings.Contains(err.Error(), "bridge children") {
			break
		}
		time.Sleep(time.Duration(attempt+1) * 200 * time.Millisecond)
	}
	if err != nil {
		return fmt.Errorf("updating network %s: %w", h.Stack.Network, err)
	}
	return nil
}

// forgetLeaseNames clears the names dnsmasq holds: stop it, blank the names in its lease
// file, then have Incus start it again (a config change restarts it; the marker line is
// removed by the second write).
func (h *Host) forgetLeaseNames(ctx context.Context) error {
	// The dnsmasq running now: a network update earlier in this init may have restarted it.
	d, ok := h.Kernel.FindDNSMasq(h.Stack.Network)
	if !ok {
		return fmt.Errorf("clearing dnsmasq lease names: no dnsmasq runs for %s", h.Stack.Network)
	}
	if err := h.Kernel.ForgetLeaseNames(d); err != nil {
		return fmt.Errorf("clearing dnsmasq lease names: %w", err)
	}
	cur, _, err := h.Client.Network(ctx, h.Stack.Network)
	if err != nil {
		return err
	}
	marked := maps.Clone(cur.Config)
	marked["raw.dnsmasq"] += "\n# claudebox: lease names cleared"
	if err := h.putNetwork(ctx, marked); err != nil {
		return err
	}
	return h.putNetwork(ctx, cur.Config)
}
