package boxcore

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"net"
	"net/netip"
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
	// PoolSize is the size of the stack's pool when init creates it ("": half the free space
	// of INCUS_DIR's filesystem, clamped to [MinPoolSize, MaxPoolSize]).
	PoolSize string
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
	// Warnings are what the user must hear even when nothing changes: a dir pool (no disk
	// limits), a profile root Incus would not move.
	Warnings []string

	pool                       poolPlan
	state                      *StackState
	pinned                     bool // the subnet was the caller's choice: never re-picked
	networkConfig              map[string]string
	aclEgress                  []ACLRuleSpec
	networkChanged, aclChanged bool
	memberKeys                 bool // this member's own network keys go
	profileChanged             bool
	firewallDrift              bool
	bridgeNF                   bool
	unisolated                 []string
	staleNames                 bool
	unit                       *unitPlan
}

func (p *InitPlan) change(object, what string) { p.Changes = append(p.Changes, Change{object, what}) }

// PlanInit validates the options and reads the host to work out what init must change.
func (h *Host) PlanInit(ctx context.Context, opts InitOptions) (*InitPlan, error) {
	if err := h.Stack.Validate(); err != nil {
		return nil, err
	}
	pinned, upstreams, err := parseInitOptions(opts)
	if err != nil {
		return nil, err
	}
	p := &InitPlan{pinned: pinned != nil}
	if err := h.planPool(ctx, p, opts); err != nil {
		return nil, err
	}
	if p.state, err = h.Read(ctx); err != nil {
		return nil, err
	}
	st := p.state
	if st.Network != nil && st.Network.Type != "bridge" {
		return nil, Usagef("network %s exists but is a %s network, not a bridge: remove it or pick another host", h.Stack.Network, st.Network.Type)
	}
	if p.Gateway, err = h.planGateway(ctx, st, pinned); err != nil {
		return nil, err
	}
	p.Upstreams = planUpstreams(st, upstreams)
	mark := "0"
	if st.Network != nil {
		mark = ReapplyMark(st.Network.Config["raw.dnsmasq"])
	}
	p.networkConfig = NetworkConfig(h.Stack.Network, p.Gateway, p.Upstreams, h.Stack.ACL, mark)
	h.planIncus(p)
	if err := h.planKernel(p); err != nil {
		return nil, err
	}
	return p, nil
}

func parseInitOptions(opts InitOptions) (pinned *net.IPNet, upstreams []string, err error) {
	if opts.Subnet != "" {
		if pinned, err = ParseSubnet(opts.Subnet); err != nil {
			return nil, nil, err
		}
	}
	if opts.DNS != "" {
		if upstreams, err = ParseDNS(opts.DNS); err != nil {
			return nil, nil, err
		}
	}
	return pinned, upstreams, nil
}

// planGateway: the pinned subnet, else the one the network has, else a free one.
func (h *Host) planGateway(ctx context.Context, st *StackState, pinned *net.IPNet) (*net.IPNet, error) {
	claims, err := HostClaims()
	if err != nil {
		return nil, err
	}
	claims = append(claims, h.incusClaims(ctx)...)
	switch {
	case pinned != nil:
		if c := FindClaimant(pinned, claims, h.Stack.Network); c != nil {
			return nil, &SubnetTakenError{Subnet: pinned.String(), By: c.By}
		}
		return Gateway(pinned), nil
	case st.Gateway != nil:
		return st.Gateway, nil
	}
	subnet, err := PickSubnet(claims, h.Stack.Network)
	if err != nil {
		return nil, err
	}
	return Gateway(subnet), nil
}

func planUpstreams(st *StackState, upstreams []string) []string {
	if upstreams != nil {
		return upstreams
	}
	if st.Network != nil {
		if servers := upstreamServers(st.Network.Config["raw.dnsmasq"]); len(servers) > 0 {
			return servers
		}
	}
	return DefaultUpstreams
}

// planIncus compares the ACL, the network and the profile with what they must be.
func (h *Host) planIncus(p *InitPlan) {
	s, st := h.Stack, p.state
	p.aclEgress = ACLEgress(st)
	switch {
	case st.ACL == nil:
		p.change("acl "+s.ACL, "create: drop egress to "+strings.Join(st.Blocked(), ", "))
	case !slices.Equal(renderRules(st.ACL.Egress), renderSpecs(p.aclEgress)) || len(st.ACL.Ingress) > 0:
		p.aclChanged = true
		p.change("acl "+s.ACL, "rewrite rules")
	case st.Network != nil && len(st.ACLKernelDrift()) > 0:
		p.aclChanged = true
		p.change("acl "+s.ACL, "re-apply: the kernel's rules differ ("+strings.Join(st.ACLKernelDrift(), "; ")+")")
	}
	if st.Network == nil {
		p.change("network "+s.Network, "create NAT bridge "+p.Gateway.String())
	} else {
		for _, k := range configDiff(st.Network.Config, p.networkConfig) {
			p.networkChanged = true
			p.change("network "+s.Network, "set "+k)
		}
		for _, k := range sortedKeys(st.MemberKeys) {
			p.memberKeys = true
			p.change("network "+s.Network+" on member "+st.Member, "remove "+k+" (a key of this member's own)")
		}
	}
	wantDevices := ProfileDevices(Stack{Network: s.Network, Pool: p.Pool})
	if st.Profile == nil {
		p.change("profile "+s.Profile, "create: eth0 on "+s.Network+" with port isolation and anti-spoofing, root on "+p.Pool)
		return
	}
	for _, k := range configDiff(st.Profile.Config, ProfileConfig()) {
		p.profileChanged = true
		p.change("profile "+s.Profile, "set "+k)
	}
	if !devicesEqual(st.Profile.Devices, wantDevices) {
		p.profileChanged = true
		p.change("profile "+s.Profile, "set devices eth0 (port isolation, anti-spoofing), root")
	}
}

// planKernel compares what only the kernel holds: nftables, stale lease names, port flags,
// br_netfilter, the boot unit.
func (h *Host) planKernel(p *InitPlan) error {
	s, st := h.Stack, p.state
	drift, err := firewall.Check(h.firewallSpec(st, p.Gateway))
	if err != nil {
		return fmt.Errorf("reading nftables: %w", err)
	}
	if len(drift) > 0 || !st.NoLLLearn {
		p.firewallDrift = true
		p.change("nftables", "rebuild bridge "+st.Tables.Bridge+" (box-to-box drop), inet "+st.Tables.Guard+" (host input guard) and inet "+st.Tables.Wall+" (the wall)")
	}
	// Box MACs not pinned in the bridge's FDB (or ports still learning, or stale pins): the
	// apply pins them whatever the plan says; the plan says so.
	if on, what := st.fdbPinOn(nil); !on {
		p.change("bridge fdb "+s.Network, "pin box MACs (static, sticky), learning off on box ports: "+what)
	}
	// Host names dnsmasq learnt while dhcp-ignore-names was off: they outlive the option.
	if st.DNSMasqRunning && len(st.LeaseNames) > 0 {
		p.staleNames = true
		p.change("dnsmasq "+s.Network, "forget lease names "+strings.Join(st.LeaseNames, ", "))
	}
	// Ports whose isolation flag was turned off behind Incus's back.
	for _, port := range st.Ports {
		if !port.Isolated {
			p.unisolated = append(p.unisolated, port.Name)
			p.change("port "+port.Name, "isolate (brport/isolated=1)")
		}
	}
	// ip6tables too: Incus refuses to start a NIC with security.ipv6_filtering without it.
	if st.BridgeNF4.Loaded && (st.BridgeNF4.Value != 1 || st.BridgeNF6.Value != 1) {
		p.bridgeNF = true
		p.change("sysctl", "set net.bridge.bridge-nf-call-iptables=1, bridge-nf-call-ip6tables=1")
	}
	if s.Unit != "" && h.Kernel.SystemdIsInit() {
		up, err := h.planUnit()
		if err != nil {
			return err
		}
		p.unit = up
		if up.write {
			p.change("systemd "+s.Unit, "install (re-applies the firewall at boot)")
		}
	}
	return nil
}

// ApplyInit carries out a plan. The firewall chains and the ACL are rewritten whole on every run
// (converge, never create-if-missing); the result lists what actually differed before.
func (h *Host) ApplyInit(ctx context.Context, p *InitPlan) ([]Change, error) {
	if err := h.applyPool(ctx, p); err != nil {
		return nil, err
	}
	if err := h.applyIncus(ctx, p); err != nil {
		return nil, err
	}
	// The boxes as they are now, not as the plan read them: a box started since (the CLI asks
	// before it applies) bound its port meanwhile, and an apply from the plan's read dropped
	// that binding, its FDB pin and its wall rule (measured). Under the stack's bind lock, so
	// that no bind reads and applies in between.
	unlock, err := lockFile(ctx, bindLockPath(h.Stack.Network), HostLockWait)
	if err != nil {
		return nil, err
	}
	defer unlock()
	if err := h.rereadBindings(ctx, p.state); err != nil {
		return nil, fmt.Errorf("reading port bindings: %w", err)
	}
	if _, err := h.applyL2(h.firewallSpec(p.state, p.Gateway), p.state.Unplugged); err != nil {
		return nil, fmt.Errorf("applying nftables rules: %w", err)
	}
	for _, port := range p.unisolated {
		// A port read as unisolated may have left the bridge since (an external interface
		// the network change above detached): nothing of it is left to isolate.
		if err := h.Kernel.SetPortIsolated(port, true); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return nil, fmt.Errorf("isolating port %s: %w", port, err)
		}
	}
	if p.bridgeNF {
		if err := errors.Join(h.Kernel.SetBridgeNFCallIPTables(1), h.Kernel.SetBridgeNFCallIP6Tables(1)); err != nil {
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

func (h *Host) applyIncus(ctx context.Context, p *InitPlan) error {
	s, st := h.Stack, p.state
	acl := incus.NetworkACL{Name: s.ACL, Description: "claudebox: boxes reach the public internet only", Egress: toRules(p.aclEgress), Ingress: []incus.ACLRule{}}
	if st.ACL != nil {
		if err := h.Client.UpdateNetworkACL(ctx, acl, st.ETags.ACL); err != nil {
			return fmt.Errorf("rewriting ACL %s: %w", s.ACL, changed("acl "+s.ACL, err))
		}
	} else if err := h.Client.CreateNetworkACL(ctx, acl); errors.Is(err, incus.ErrConflict) {
		// Read as missing, then there: another init made it meanwhile (or the daemon's read
		// missed it once, as one CI run saw). Converge it as found.
		_, etag, gerr := h.Client.NetworkACL(ctx, s.ACL)
		if gerr == nil {
			gerr = h.Client.UpdateNetworkACL(ctx, acl, etag)
		}
		if gerr != nil {
			return fmt.Errorf("creating ACL %s: %w (and rewriting the one found: %v)", s.ACL, err, gerr)
		}
	} else if err != nil {
		return fmt.Errorf("creating ACL %s: %w", s.ACL, err)
	}
	if st.Network == nil {
		if err := h.createNetwork(ctx, p); err != nil {
			return fmt.Errorf("creating network %s: %w", s.Network, err)
		}
	} else if p.networkChanged {
		if err := putNetwork(ctx, h.Client, s.Network, p.networkConfig, st.ETags.Network); err != nil {
			return err
		}
	}
	if p.memberKeys {
		if err := h.removeMemberKeys(ctx, st.Member); err != nil {
			return err
		}
	}
	if p.staleNames {
		if err := h.forgetLeaseNames(ctx); err != nil {
			return err
		}
	}
	prof := incus.Profile{Name: s.Profile, Description: "claudebox: the isolation stack of every box",
		Config: ProfileConfig(), Devices: ProfileDevices(Stack{Network: s.Network, Pool: p.Pool})}
	if st.Profile == nil {
		if err := h.Client.CreateProfile(ctx, prof); err != nil {
			return fmt.Errorf("creating profile %s: %w", s.Profile, err)
		}
	} else if p.profileChanged {
		err := h.Client.UpdateProfile(ctx, prof, st.ETags.Profile)
		if err != nil && rootMoveRefused(err) {
			// Instances on the profile keep their root where it is; new boxes get their own.
			p.Warnings = append(p.Warnings, keepProfileRoot(&prof, st.Profile, p.Pool))
			err = h.Client.UpdateProfile(ctx, prof, st.ETags.Profile)
		}
		if err != nil {
			return fmt.Errorf("updating profile %s: %w", s.Profile, changed("profile "+s.Profile, err))
		}
	}
	return nil
}

// SubnetLockPath is the lock every claudebox process on the host (the CLI, the test stacks, the
// drill) holds from reading the subnets in use to creating its network, so that two inits running
// at once never both take the same free /24. Incus does not refuse a second bridge with a subnet
// another already has: either the second's dnsmasq cannot bind the gateway and the create fails,
// or both come up and the gateway's unicast, DNS and DHCP renewals reach the wrong bridge. It is
// not HostLockPath, which a drill run holds for its whole run while test stacks are created
// beside it.
const SubnetLockPath = "/run/claudebox-subnet.lock"

// subnetLockWait bounds the wait for another init's pick-and-create (a second or two each).
const subnetLockWait = 2 * time.Minute

// createNetwork creates the stack's network under SubnetLockPath. The plan's subnet was read
// without the lock: it is checked again against what the host and Incus hold now, and a
// subnet someone took in between is re-picked (or, when pinned, refused). After the create no
// other Incus network may hold the same subnet (a process that created its network without the
// lock: an older claudebox, or a hand-made network); on such a clash ours goes and the pick is
// made again, so the other keeps what it had first.
func (h *Host) createNetwork(ctx context.Context, p *InitPlan) error {
	s := h.Stack
	unlock, err := lockFile(ctx, SubnetLockPath, subnetLockWait)
	if err != nil {
		return fmt.Errorf("subnet lock: %w", err)
	}
	defer unlock()
	for attempt := 1; ; attempt++ {
		claims, err := h.subnetClaims(ctx)
		if err != nil {
			return err
		}
		if c := FindClaimant(subnetOf(p.Gateway), claims, s.Network); c != nil {
			if p.pinned {
				return &SubnetTakenError{Subnet: subnetOf(p.Gateway).String(), By: c.By}
			}
			sub, err := PickSubnet(claims, s.Network)
			if err != nil {
				return err
			}
			p.setGateway(Gateway(sub), s)
		}
		cfg := maps.Clone(p.networkConfig)
		maps.Copy(cfg, s.Marks)
		members, err := h.clusterMembers(ctx)
		if err != nil {
			return err
		}
		err = createClustered(members,
			func(m string) error { return h.Client.CreateNetworkPending(ctx, m, s.Network, "bridge", nil) },
			func() error {
				return h.Client.CreateNetwork(ctx, s.Network, "bridge", cfg, "claudebox: isolated NAT bridge for boxes")
			},
			func() error { return h.Client.DeleteNetwork(context.WithoutCancel(ctx), s.Network) })
		if err != nil {
			return err
		}
		clash, err := h.subnetClash(ctx, p.Gateway)
		if err != nil || clash == "" {
			return err
		}
		if err := h.Client.DeleteNetwork(ctx, s.Network); err != nil && !errors.Is(err, incus.ErrNotFound) {
			return fmt.Errorf("subnet %s is also Incus network %s's, and removing ours again failed: %w", subnetOf(p.Gateway), clash, err)
		}
		if p.pinned || attempt == 3 {
			return &SubnetTakenError{Subnet: subnetOf(p.Gateway).String(), By: "Incus network " + clash}
		}
	}
}

// subnetClaims is what the kernel routes or addresses and what the other Incus networks hold,
// read for the pick under the subnet lock (errors count: a pick on half a view is no pick).
func (h *Host) subnetClaims(ctx context.Context) ([]Claim, error) {
	claims, err := HostClaims()
	if err != nil {
		return nil, err
	}
	nets, err := h.Client.Networks(ctx)
	if err != nil {
		return nil, fmt.Errorf("listing Incus networks: %w", err)
	}
	for _, n := range nets {
		if !n.Managed || n.Name == h.Stack.Network {
			continue
		}
		if _, sub, err := net.ParseCIDR(n.Config["ipv4.address"]); err == nil {
			claims = append(claims, Claim{Net: sub, By: "Incus network " + n.Name})
		}
	}
	return claims, nil
}

// subnetClash names another managed Incus network whose IPv4 subnet overlaps gw's, or "".
func (h *Host) subnetClash(ctx context.Context, gw *net.IPNet) (string, error) {
	nets, err := h.Client.Networks(ctx)
	if err != nil {
		return "", fmt.Errorf("listing Incus networks after creating %s: %w", h.Stack.Network, err)
	}
	for _, n := range nets {
		if !n.Managed || n.Name == h.Stack.Network {
			continue
		}
		if _, sub, err := net.ParseCIDR(n.Config["ipv4.address"]); err == nil && overlaps(sub, subnetOf(gw)) {
			return n.Name, nil
		}
	}
	return "", nil
}

// setGateway moves a plan that creates the network to another subnet.
func (p *InitPlan) setGateway(gw *net.IPNet, s Stack) {
	p.Gateway = gw
	p.networkConfig = maps.Clone(p.networkConfig)
	p.networkConfig["ipv4.address"] = gw.String()
	for i, c := range p.Changes {
		if c.Object == "network "+s.Network && strings.HasPrefix(c.What, "create NAT bridge ") {
			p.Changes[i].What = "create NAT bridge " + gw.String()
		}
	}
}

func subnetOf(gw *net.IPNet) *net.IPNet {
	return &net.IPNet{IP: gw.IP.Mask(gw.Mask), Mask: gw.Mask}
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
	// Read and apply with no bind in between (a box starting now keeps its binding).
	unlock, err := lockFile(ctx, bindLockPath(h.Stack.Network), HostLockWait)
	if err != nil {
		return false, err
	}
	defer unlock()
	st, err := h.Read(ctx)
	if err != nil {
		return false, err
	}
	if st.Network == nil {
		return false, &StackMissingError{Object: "network " + h.Stack.Network, Detail: "does not exist", AsUsage: true}
	}
	if st.Gateway == nil {
		return false, &StackMissingError{Object: "network " + h.Stack.Network, Detail: fmt.Sprintf("has no IPv4 address (%q)", st.Network.Config["ipv4.address"])}
	}
	// The boot unit runs this: drop_subtree_threshold is back to the kernel's default after
	// every mount of the pool, so it is set again here (best effort: host check reports it).
	h.ensurePoolQuota(ctx)
	return h.applyL2(h.FirewallSpec(st), st.Unplugged)
}

// FirewallSpec is the nftables spec of the stack as read (its gateway and the ranges boxes
// must not reach).
func (h *Host) FirewallSpec(st *StackState) firewall.Spec {
	return h.firewallSpec(st, st.Gateway)
}

// firewallSpec: the blocked ranges include every other Incus network's subnet; the uplinks
// are left to the firewall (the interfaces of the default routes).
func (h *Host) firewallSpec(st *StackState, gw *net.IPNet) firewall.Spec {
	spec := FirewallSpec(h.Stack.Network, gw)
	spec.Blocked = st.BlockedPrefixes()
	spec.Ports = st.bindingsIn(gw)
	spec.Exposed = st.Exposed
	ups := st.uplinks()
	// Routes through an interface that is neither an uplink nor the bridge (another bridge, a
	// VPN, the drill's LAN-side decoy) are other local networks: the wall's uplink rule drops
	// them, and in the blocked set the L2 ranges do too.
	spec.Blocked = append(spec.Blocked, otherRoutes(h.Stack.Network, ups, spec.Blocked)...)
	if len(st.AdmittedUplinks()) > 0 {
		spec.Uplinks = ups
	}
	return spec
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
	for _, k := range sortedKeys(foreignKeys(have, want)) {
		keys = append(keys, k+" (remove)")
	}
	return keys
}

// foreignKeys are the keys of have that want does not set, with their values (volatile.* and
// user.* are Incus's and the user's own, and kept).
func foreignKeys(have, want map[string]string) map[string]string {
	out := map[string]string{}
	for k, v := range have {
		if _, ok := want[k]; !ok && !keptKey(k) {
			out[k] = v
		}
	}
	return out
}

// keyList is "k=v, ..." sorted, or "none".
func keyList(kv map[string]string) string {
	var out []string
	for _, k := range sortedKeys(kv) {
		out = append(out, k+"="+kv[k])
	}
	return listOrNone(out)
}

func devicesEqual(a, b map[string]map[string]string) bool {
	return maps.EqualFunc(a, b, func(x, y map[string]string) bool { return maps.Equal(x, y) })
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

// FirewallSpec is the nftables spec for a bridge and its gateway address with prefix, blocking
// BlockedEgress only; Host.FirewallSpec adds the other Incus networks read from the host.
func FirewallSpec(bridge string, gateway *net.IPNet) firewall.Spec {
	ones, _ := gateway.Mask.Size()
	spec := firewall.Spec{Bridge: bridge, Gateway: gateway.IP, PrefixLen: ones}
	for _, c := range BlockedEgress {
		spec.Blocked = append(spec.Blocked, netip.MustParsePrefix(c))
	}
	return spec
}

// PutNetworkConfig writes a network's config, keeping the volatile.* and user.* keys it has
// now. The write carries the ETag of the read it is built on, so a writer in between makes it
// fail with a ChangedError instead of being overwritten. Incus 6.0.4 sometimes fails such a
// PUT with "Failed to delete bridge children interfaces" (500) when a box's veth vanishes at
// that moment: that race is retried (see incus.IsBridgeChildrenRace); any other error is
// returned at once.
func PutNetworkConfig(ctx context.Context, c *incus.Client, network string, want map[string]string) error {
	return putNetwork(ctx, c, network, want, "")
}

// putNetwork is PutNetworkConfig on the network as it was when etag was read ("": as it is
// now): if it changed since, ChangedError and no write. (A retried race compares with the
// fresh read: the failed PUT may have changed the ETag itself.)
func putNetwork(ctx context.Context, c *incus.Client, network string, want map[string]string, etag string) error {
	object := "network " + network
	err := incus.RetryBridgeChildrenRace(ctx, func() error {
		cur, curTag, err := c.Network(ctx, network)
		if err != nil {
			return err
		}
		if etag != "" && curTag != etag {
			return &ChangedError{Object: object}
		}
		etag = ""
		cfg := maps.Clone(want)
		for k, v := range cur.Config {
			if keptKey(k) {
				cfg[k] = v
			}
		}
		return changed(object, c.UpdateNetwork(ctx, network, cfg, cur.Description, curTag))
	})
	if err != nil {
		return fmt.Errorf("updating network %s: %w", network, err)
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
	n := h.Stack.Network
	cur, etag, err := h.Client.Network(ctx, n)
	if err != nil {
		return err
	}
	marked := maps.Clone(cur.Config)
	marked["raw.dnsmasq"] += "\n# claudebox: lease names cleared"
	if err := putNetwork(ctx, h.Client, n, marked, etag); err != nil {
		return err
	}
	// The second write goes back only over our own first one.
	after, etag, err := h.Client.Network(ctx, n)
	if err != nil {
		return err
	}
	if len(configDiff(after.Config, marked)) > 0 {
		return &ChangedError{Object: "network " + n}
	}
	return putNetwork(ctx, h.Client, n, cur.Config, etag)
}
