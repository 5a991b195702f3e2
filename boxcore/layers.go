package boxcore

import (
	"fmt"
	"slices"
	"strings"
)

// Layer is one isolation mechanism of the host stack. The drill's claims name the layers that
// hold them; host check reads them; SwitchOff turns them off for a seeded hole.
type Layer string

// The layers.
const (
	LayerNFTBridge    Layer = "nft-bridge-drop"   // bridge table claudebox_<B>: box-to-box forward drop
	LayerPortBinding  Layer = "port-binding"      // bridge table claudebox_<B> prerouting: each box port bound to its MAC/IPv4/chaddr
	LayerFDBPin       Layer = "fdb-pin"           // each box MAC a static, sticky FDB entry on its port; learning off on box ports
	LayerPortRPFilter Layer = "port-rp-filter"    // net.ipv4.conf.<port>.rp_filter=1 on every bound box port (link-local group path)
	LayerL2Ranges     Layer = "l2-ranges"         // bridge table claudebox_<B> input/output: blocked ranges and host→box at L2
	LayerBRNF         Layer = "br_netfilter"      // net.bridge.bridge-nf-call-iptables/ip6tables=1
	LayerPortIso      Layer = "port-isolation"    // brport/isolated on every box port
	LayerDNSModeNone  Layer = "dns.mode=none"     // no instance-name DNS records
	LayerIgnoreNames  Layer = "dhcp-ignore-names" // dnsmasq does not register DHCP hostnames
	LayerNoHosts      Layer = "no-hosts"          // dnsmasq does not serve /etc/hosts
	LayerNoIdent      Layer = "no-ident"          // dnsmasq does not answer CHAOS servers.bind/version.bind
	LayerNoCache      Layer = "no-cache"          // dnsmasq keeps no shared cache (cache-size=0): no box sees a sibling's lookups
	LayerDHCPKnown    Layer = "dhcp-known-only"   // dnsmasq answers DHCP only for MACs with a dhcp-host entry
	LayerACL          Layer = "acl"               // the Incus network ACL, as its rules are in the kernel
	LayerHostGuard    Layer = "host-input-guard"  // inet claudebox_<B>_guard input, output, inbound, egress: box→host, nothing new into a box, nothing un-NATed out
	LayerLocalAnswers Layer = "local-answers"     // inet claudebox_<B>_guard answers, dns_tcp: none of dnsmasq's own data reaches a box
	LayerWall         Layer = "wall"              // inet claudebox_<B>_wall: claudebox's own complete layer
	LayerNICFiltering Layer = "nic-filtering"     // security.mac/ipv4/ipv6_filtering on the box NIC
	LayerIPv6Off      Layer = "ipv6.address=none" // no IPv6 on the bridge
	LayerGuestAPIOff  Layer = "guest-api-off"     // security.guestapi=false: no /dev/incus in a box (a box could crash incusd through it)
	LayerNAT          Layer = "nat"               // ipv4.nat=true: Incus masquerades box egress (the wall's own masquerade and the guard's egress drop are the other layers)
)

// dnsmasqLine is the raw.dnsmasq line that is a layer ("" for layers that are not one).
func dnsmasqLine(l Layer) string {
	switch l {
	case LayerIgnoreNames, LayerNoHosts, LayerNoIdent:
		return string(l)
	case LayerDHCPKnown:
		return DHCPKnownOnly
	case LayerNoCache:
		return NoCache
	}
	return ""
}

// SwitchableLayers are the layers SwitchOff can turn off, in the order a self-test goes.
var SwitchableLayers = []Layer{LayerNFTBridge, LayerPortBinding, LayerFDBPin, LayerPortRPFilter, LayerL2Ranges, LayerBRNF, LayerPortIso, LayerDNSModeNone, LayerIgnoreNames,
	LayerNoHosts, LayerNoIdent, LayerNoCache, LayerLocalAnswers, LayerDHCPKnown, LayerACL, LayerHostGuard, LayerWall, LayerNICFiltering, LayerIPv6Off, LayerGuestAPIOff, LayerNAT}

// LayerState is one reading of one layer, from the kernel where the kernel holds it.
type LayerState struct {
	Layer Layer  `json:"layer"`
	On    bool   `json:"on"`
	What  string `json:"what"`
}

// Layers turns the state into one line per layer. boxes limits the per-port readings (port
// isolation, NIC filtering) to those instances' ports; nil means every port of the bridge.
func (st *StackState) Layers(boxes []string) []LayerState {
	var out []LayerState
	add := func(l Layer, on bool, format string, a ...any) {
		out = append(out, LayerState{l, on, fmt.Sprintf(format, a...)})
	}
	cfg := st.networkConfig()
	bt, gt := st.Tables.Bridge, st.Tables.Guard
	mode := "subnet (IPv4+ARP; no nft_meta_bridge)"
	if st.BridgeMeta {
		mode = "bridge-name (every protocol)"
	}
	add(LayerNFTBridge, st.Tables.BridgeOn, "table bridge %s: %s, mode %s", bt, presence(st.Tables.BridgeOn), mode)
	pbOn, pbWhat := st.portBindingOn()
	add(LayerPortBinding, pbOn, "%s", pbWhat)
	fpOn, fpWhat := st.fdbPinOn(boxes)
	add(LayerFDBPin, fpOn, "%s", fpWhat)
	rpOn, rpWhat := st.portRPFilterOn(boxes)
	add(LayerPortRPFilter, rpOn, "%s", rpWhat)
	add(LayerL2Ranges, st.Tables.L2RangesOn, "table bridge %s chains input, output: %s", bt, presence(st.Tables.L2RangesOn))
	add(LayerBRNF, st.BridgeNF4.Loaded && st.BridgeNF4.Value == 1, "bridge-nf-call-iptables=%d ip6tables=%d (loaded %v)",
		st.BridgeNF4.Value, st.BridgeNF6.Value, st.BridgeNF4.Loaded)

	ports := st.portsOf(boxes)
	var iso, notIso, filt, notFilt []string
	for _, p := range ports {
		if p.Isolated {
			iso = append(iso, p.Name)
		} else {
			notIso = append(notIso, p.Name)
		}
		if p.Filtered {
			filt = append(filt, p.Name)
		} else {
			notFilt = append(notFilt, p.Name)
		}
	}
	add(LayerPortIso, len(notIso) == 0, "isolated: [%s] not isolated: [%s]", strings.Join(iso, " "), strings.Join(notIso, " "))

	dm := st.DNSMasq
	domainFlag := st.DNSMasqRunning && (dm.Flag("-s") || dm.Flag("--domain"))
	add(LayerDNSModeNone, st.Network != nil && cfg["dns.mode"] == "none" && !domainFlag, "dns.mode=%s, dnsmasq domain flag %v", cfg["dns.mode"], domainFlag)
	for _, o := range []struct {
		l   Layer
		opt string
	}{{LayerIgnoreNames, "dhcp-ignore-names"}, {LayerNoHosts, "no-hosts"}, {LayerNoIdent, "no-ident"}, {LayerDHCPKnown, DHCPKnownOnly}, {LayerNoCache, NoCache}} {
		on := slices.Contains(dm.Options, o.opt)
		add(o.l, on, "dnsmasq (pid %d) option %s %s", dm.PID, o.opt, presence(on))
	}

	aclDrift := st.ACLKernelDrift()
	add(LayerACL, st.Network != nil && cfg["security.acls"] != "" && len(aclDrift) == 0,
		"security.acls=%q default ingress=%s egress=%s; kernel: %s", cfg["security.acls"],
		cfg["security.acls.default.ingress.action"], cfg["security.acls.default.egress.action"], driftSummary(aclDrift))
	add(LayerHostGuard, st.Tables.GuardInput, "table inet %s chains input, output, inbound, egress %s", gt, presence(st.Tables.GuardInput))
	add(LayerLocalAnswers, st.Tables.LocalAnswersOn, "table inet %s chains answers, dns_tcp: %s", gt, presence(st.Tables.LocalAnswersOn))
	add(LayerWall, st.Tables.WallOn, "table inet %s: %s", st.Tables.Wall, presence(st.Tables.WallOn))
	add(LayerNICFiltering, len(notFilt) == 0, "filtered: [%s] not filtered: [%s]", strings.Join(filt, " "), strings.Join(notFilt, " "))
	var api []string
	for _, p := range st.Ports {
		if p.Box != "" && p.GuestAPI && (boxes == nil || slices.Contains(boxes, p.Box)) {
			api = append(api, p.Box)
		}
	}
	profAPI := ""
	if st.Profile != nil {
		profAPI = st.Profile.Config[KeyGuestAPI]
	}
	add(LayerGuestAPIOff, profAPI == "false" && len(api) == 0, "profile %s=%q; /dev/incus in: [%s]", KeyGuestAPI, profAPI, strings.Join(api, " "))
	add(LayerIPv6Off, st.IPv6Disabled && cfg["ipv6.address"] == "none", "ipv6.address=%s, %s disable_ipv6=%v", cfg["ipv6.address"], st.Stack.Network, st.IPv6Disabled)
	add(LayerNAT, cfg["ipv4.nat"] == "true", "ipv4.nat=%s", cfg["ipv4.nat"])
	return out
}

func driftSummary(d []string) string {
	if len(d) == 0 {
		return "as declared"
	}
	return strings.Join(d, "; ")
}
