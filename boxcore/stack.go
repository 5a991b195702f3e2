package boxcore

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"maps"
	"net"
	"net/netip"
	"sort"
	"strings"
)

// Stack names the host objects that isolate boxes. The product uses DefaultStack; tests use
// per-run names so that several stacks can live side by side on one daemon.
type Stack struct {
	Network string // NAT bridge the boxes attach to
	ACL     string // network ACL dropping private, CGNAT and link-local egress
	Profile string // the only profile a box carries
	Pool    string // storage pool of the profile's root disk and of every box's own root
	// MaxDisk caps a box's root disk size in bytes (the pool's size, see Boxes.DiskCap); 0
	// means no cap is known. Only the clone boundary reads it.
	MaxDisk int64
	// Unit is the systemd unit re-applying the firewall at boot; empty means none.
	Unit string
	// Marks are user.* keys put on the network when it is created (tests mark their stacks
	// with their run, so a later run can find and remove what a dead one left).
	Marks map[string]string
}

// DefaultStack is the stack of the seed design.
func DefaultStack() Stack {
	return Stack{
		Network: "claudenet",
		ACL:     "claude-isolate",
		Profile: "claude-dev",
		Pool:    PoolName,
		Unit:    "claudebox-firewall.service",
	}
}

// TagKey marks an instance as a box. Nothing without it is ever touched.
const TagKey = "user.claudebox"

// BlockedEgress are the ranges a box must never reach: RFC 1918, CGNAT, link-local.
var BlockedEgress = []string{
	"10.0.0.0/8",
	"172.16.0.0/12",
	"192.168.0.0/16",
	"100.64.0.0/10",
	"169.254.0.0/16",
}

// DefaultUpstreams are the resolvers the bridge's dnsmasq forwards to unless told otherwise.
var DefaultUpstreams = []string{"1.1.1.1", "9.9.9.9"}

// DefaultCPU is the profile's limits.cpu; `new` may override it per box. The profile's
// memory limit is sized from the host (DefaultLimits in limits.go).
const DefaultCPU = "2"

// DNSOptions are the dnsmasq lines that close name-based reconnaissance: with dns.mode=none
// dnsmasq still registers DHCP hostnames and serves /etc/hosts (measured, FACTS.md).
// domain-needed keeps plain (dotless) names from being forwarded upstream, and bogus-priv
// answers reverse lookups of private ranges locally, so a box cannot ask the host's own
// resolver for the names of the LAN.
// no-ident stops the CHAOS answers (servers.bind shows the upstream and its query counter,
// so one box could watch a sibling's DNS activity; version.bind the dnsmasq version).
// DHCPKnownOnly answers only clients with a dhcp-host entry (see DHCPKnownOnly).
// NoCache turns dnsmasq's shared cache off: with it a box saw the TTL of a name a sibling had
// just asked counted down, and no upstream query (found by the attacker: a box could watch
// what its siblings look up).
var DNSOptions = []string{"dhcp-ignore-names", "no-hosts", "no-resolv", "domain-needed", "bogus-priv", "no-ident", DHCPKnownOnly, NoCache}

// NoCache is the dnsmasq line that turns its cache off.
const NoCache = "cache-size=0"

// DHCPKnownOnly makes dnsmasq ignore DHCP from any client it has no dhcp-host entry for. NIC
// filtering checks a frame's Ethernet source only, so without it a box can ask a lease for a
// made-up chaddr (exhausting the range) from its own MAC; every box NIC has a static entry
// (Incus writes one per NIC, with the address ipv4_filtering pins), so boxes stay "known".
// Measured on Incus 6.0.4 in TestDHCPKnownOnly (dhcpknown_test.go).
const DHCPKnownOnly = "dhcp-ignore=tag:!known"

// NetworkConfig is the desired config of a bridge for a gateway/prefix and upstream resolvers.
// raw.dnsmasq also names the network's servers-file (forwarders set without a re-apply) and
// ends with the re-apply mark, at mark (the value the network has: see ReapplyMark).
func NetworkConfig(network string, gateway *net.IPNet, upstreams []string, acl, mark string) map[string]string {
	lines := append([]string{}, DNSOptions...)
	for _, u := range upstreams {
		lines = append(lines, "server="+u)
	}
	lines = append(lines, ServersFileOption(network), reapplyMarkPrefix+mark)
	return map[string]string{
		"ipv4.address":                         gateway.String(),
		"ipv4.nat":                             "true",
		"ipv4.dhcp":                            "true",
		"ipv6.address":                         "none",
		"dns.mode":                             "none",
		"raw.dnsmasq":                          strings.Join(lines, "\n"),
		"security.acls":                        acl,
		"security.acls.default.egress.action":  "allow",
		"security.acls.default.ingress.action": "drop",
	}
}

// ParseRawDNSMasq splits raw.dnsmasq into its upstream servers and every other line.
func ParseRawDNSMasq(raw string) (servers, other []string) {
	for _, l := range strings.Split(raw, "\n") {
		l = strings.TrimSpace(l)
		switch {
		case l == "":
		case strings.HasPrefix(l, "server="):
			servers = append(servers, strings.TrimPrefix(l, "server="))
		default:
			other = append(other, l)
		}
	}
	return servers, other
}

// ACLEgress is the desired egress rule list of the isolation ACL: a drop for every range in
// BlockedEgress, then for every other managed Incus network those ranges do not cover (st may
// be nil: the fixed ranges only). Ingress is empty: the network's default ingress action
// (drop) holds it.
func ACLEgress(st *StackState) []ACLRuleSpec {
	var rules []ACLRuleSpec
	for _, cidr := range BlockedEgress {
		rules = append(rules, ACLRuleSpec{Action: "drop", Destination: cidr, State: "enabled",
			Description: "claudebox: no " + rangeName(cidr)})
	}
	if st != nil {
		for _, o := range st.Others {
			if !coveredBy(o.Subnet, BlockedEgress) {
				rules = append(rules, ACLRuleSpec{Action: "drop", Destination: o.Subnet.String(), State: "enabled",
					Description: "claudebox: no Incus network " + o.Name})
			}
		}
	}
	return rules
}

// ACLRuleSpec is one ACL rule as we declare it.
type ACLRuleSpec struct {
	Action, Destination, State, Description string
}

func rangeName(cidr string) string {
	switch cidr {
	case "100.64.0.0/10":
		return "CGNAT"
	case "169.254.0.0/16":
		return "link-local"
	}
	return "private range " + cidr
}

// NICFiltering are the anti-spoofing keys of the box NIC. Incus turns them into per-port
// chains in its bridge table (`table bridge incus`, chains in.<dev> and fwd.<dev>): frames
// whose source MAC is not the NIC's, ARP and IPv4 whose sender is not the box's address,
// every IPv6 frame (the network has no IPv6, so the allowance is empty), and every ethertype
// but ARP/IPv4/IPv6 (VLAN-tagged frames included) are dropped as they enter the bridge.
// ipv4_filtering pins the box's address: Incus writes a static DHCP host entry (MAC -> IP)
// for the NIC when it starts. Measured on Incus 6.0.4 in TestNICFiltering (nicfilter_test.go).
var NICFiltering = map[string]string{
	"security.mac_filtering":  "true",
	"security.ipv4_filtering": "true",
	"security.ipv6_filtering": "true",
}

// ProfileDevices is the desired device set of the box profile.
func ProfileDevices(s Stack) map[string]map[string]string {
	eth0 := map[string]string{
		"type":                    "nic",
		"name":                    "eth0",
		"network":                 s.Network,
		"security.port_isolation": "true",
	}
	maps.Copy(eth0, NICFiltering)
	return map[string]map[string]string{
		"eth0": eth0,
		"root": {
			"type": "disk",
			"path": "/",
			"pool": s.Pool,
			"size": DefaultDisk,
		},
	}
}

// BoxNIC is the eth0 a box gets as its own device: the profile's, with a host-side veth name
// fixed for the box (HostName). Incus names a veth at random on every start, and a box can
// restart itself (reboot inside it): with a random name its new port would be unbound — no
// port binding, no per-port DHCP binding, no wall rule for its port — until claudebox bound
// it again. A fixed name keeps every rule that names the port matching the new veth.
func BoxNIC(s Stack, box string) map[string]string {
	eth0 := maps.Clone(ProfileDevices(s)["eth0"])
	eth0["host_name"] = HostName(box)
	return eth0
}

// HostName is the host-side veth name of a box's eth0: "cbx" and 12 hex digits of a hash of
// the box's name (15 characters, the kernel's limit).
func HostName(box string) string {
	sum := sha256.Sum256([]byte(box))
	return "cbx" + hex.EncodeToString(sum[:6])
}

// IsBoxNIC reports whether d is the eth0 claudebox gives box on stack s (BoxNIC), with the
// host name of any box when box is "" (a clone's source keeps its own name until rewritten).
//
// The NIC may pin an IPv4 address (ipv4.address): `new` picks one so that the port's binding
// is known before the box starts (address.go). Incus holds it to the network's subnet and to
// no other NIC's address; the binding reads it like any reservation.
func IsBoxNIC(d map[string]string, s Stack, box string) bool {
	want := BoxNIC(s, box)
	if box == "" {
		if hn := d["host_name"]; len(hn) != 15 || !strings.HasPrefix(hn, "cbx") {
			return false
		}
		want["host_name"] = d["host_name"]
	}
	if v, ok := d["ipv4.address"]; ok {
		if a, err := netip.ParseAddr(v); err != nil || !a.Is4() {
			return false
		}
		want["ipv4.address"] = v
	}
	return maps.Equal(d, want)
}

// ProfileConfig is the desired config of the box profile. limits.processes and
// limits.cpu.allowance are container-only in Incus, so they go on each container box's own
// config (`new`), never here: a VM on this profile would share them.
func ProfileConfig() map[string]string {
	return map[string]string{
		"limits.cpu":    DefaultCPU,
		"limits.memory": DefaultLimits().MemoryValue(),
		// Each box gets its own host uid/gid range: root in one box is not the uid of root
		// in a sibling (the host's /etc/subuid must hold 65536 ids per box).
		"security.idmap.isolated": "true",
		// No /dev/incus in a box: measured, 8 threads asking it at once crashed incusd 6.0.4
		// ("concurrent map read and map write" in its handler), and no box needs it (cloud-init
		// reads the NoCloud seed Incus writes into the image).
		KeyGuestAPI: "false",
	}
}

// sortedKeys returns a map's keys in order, for stable output.
func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// ValidateStackName rejects names Incus or the kernel would refuse later.
func (s Stack) Validate() error {
	if s.Network == "" || len(s.Network) > 15 {
		return fmt.Errorf("network name %q must be 1-15 characters (it is a kernel interface name)", s.Network)
	}
	if s.ACL == "" || s.Profile == "" || s.Pool == "" {
		return fmt.Errorf("stack needs an ACL, a profile and a storage pool name")
	}
	return nil
}

// NamedStack is a complete stack named after one prefix, for tests and side-by-side stacks.
// It installs no boot unit, and its pool is "default" (the one make setup makes).
func NamedStack(name string) Stack {
	return Stack{Network: name, ACL: name + "-isolate", Profile: name + "-dev", Pool: "default"}
}
