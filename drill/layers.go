package drill

import (
	"context"
	"fmt"
	"net"
	"os"
	"slices"
	"strings"

	"github.com/claudebox/claudebox/boxcore"
	"github.com/claudebox/claudebox/boxcore/incus"
	"github.com/claudebox/claudebox/firewall"
)

// LayerState is one reading of one layer, from the kernel where the kernel holds it.
type LayerState struct {
	Layer Layer  `json:"layer"`
	On    bool   `json:"on"`
	What  string `json:"what"`
}

// ReadLayers reads every layer's state. ports limits the port-isolation reading to those
// bridge ports (nil: every port of the bridge).
func ReadLayers(ctx context.Context, c *incus.Client, s boxcore.Stack, ports []string) []LayerState {
	k := boxcore.LocalKernel()
	var out []LayerState
	add := func(l Layer, on bool, format string, a ...any) {
		out = append(out, LayerState{l, on, fmt.Sprintf(format, a...)})
	}
	n, _, nerr := c.Network(ctx, s.Network)

	// nft tables, read over netlink.
	bt, gt := firewall.TableNames(s.Network)
	obs, err := firewall.Read(s.Network)
	bridgeOn, guardIn := false, false
	if err == nil {
		for _, t := range obs.Tables {
			if t.Name == bt && t.Present {
				bridgeOn = len(t.Chains) > 0
			}
			if t.Name == gt && t.Present {
				for _, ch := range t.Chains {
					if ch.Name == "input" {
						guardIn = true
					}
				}
			}
		}
	}
	mode := "subnet (IPv4+ARP; no nft_meta_bridge)"
	if firewall.BridgeMetaSupported() {
		mode = "bridge-name (every protocol)"
	}
	add(LayerNFTBridge, bridgeOn, "table bridge %s: %s, mode %s", bt, presence(bridgeOn), mode)
	v, ok := k.BridgeNFCallIPTables()
	v6 := readSysctl("/proc/sys/net/bridge/bridge-nf-call-ip6tables")
	add(LayerBRNF, ok && v == 1, "bridge-nf-call-iptables=%v ip6tables=%s (loaded %v)", v, v6, ok)
	bp, _ := k.BridgePorts(s.Network)
	var iso, not []string
	for _, p := range bp {
		if ports != nil && !slices.Contains(ports, p.Name) {
			continue
		}
		if p.Isolated {
			iso = append(iso, p.Name)
		} else {
			not = append(not, p.Name)
		}
	}
	add(LayerPortIso, len(not) == 0, "isolated: [%s] not isolated: [%s]", strings.Join(iso, " "), strings.Join(not, " "))
	dm, running := k.FindDNSMasq(s.Network)
	domainFlag := running && (dm.Flag("-s") || dm.Flag("--domain"))
	add(LayerDNSModeNone, nerr == nil && n.Config["dns.mode"] == "none" && !domainFlag, "dns.mode=%s, dnsmasq domain flag %v", n.Config["dns.mode"], domainFlag)
	add(LayerIgnoreNames, slices.Contains(dm.Options, "dhcp-ignore-names"), "dnsmasq (pid %d) option dhcp-ignore-names %s", dm.PID, presence(slices.Contains(dm.Options, "dhcp-ignore-names")))
	add(LayerNoHosts, slices.Contains(dm.Options, "no-hosts"), "dnsmasq option no-hosts %s", presence(slices.Contains(dm.Options, "no-hosts")))
	add(LayerACL, nerr == nil && n.Config["security.acls"] != "", "security.acls=%q default ingress=%s egress=%s", n.Config["security.acls"],
		n.Config["security.acls.default.ingress.action"], n.Config["security.acls.default.egress.action"])
	add(LayerHostGuard, guardIn, "table inet %s chain input %s", gt, presence(guardIn))
	off, _ := k.IPv6Disabled(s.Network)
	add(LayerIPv6Off, off && n.Config["ipv6.address"] == "none", "ipv6.address=%s, %s disable_ipv6=%v", n.Config["ipv6.address"], s.Network, off)
	add(LayerNAT, n.Config["ipv4.nat"] == "true", "ipv4.nat=%s", n.Config["ipv4.nat"])
	return out
}

func presence(b bool) string {
	if b {
		return "present"
	}
	return "absent"
}

func readSysctl(p string) string {
	b, err := os.ReadFile(p)
	if err != nil {
		return "?"
	}
	return strings.TrimSpace(string(b))
}

// HostInfo is what the record says about the machine.
type HostInfo struct {
	Hostname      string `json:"hostname"`
	Kernel        string `json:"kernel"`
	IncusVersion  string `json:"incus_version"`
	NFTBridgeMeta bool   `json:"nft_meta_bridge"`
}

func hostInfo(ctx context.Context, c *incus.Client) HostInfo {
	h := HostInfo{NFTBridgeMeta: firewall.BridgeMetaSupported()}
	h.Hostname, _ = os.Hostname()
	h.Kernel = readSysctl("/proc/sys/kernel/osrelease")
	if s, err := c.Server(ctx); err == nil {
		h.IncusVersion = s.Version
	}
	return h
}

func (e *engine) printLayers(title string, ls []LayerState) {
	e.progress("%s:", title)
	for _, l := range ls {
		mark := "on "
		if !l.On {
			mark = "OFF"
		}
		e.progress("  %s %-18s %s", mark, l.Layer, l.What)
	}
}

// unused guard for net import on some builds
var _ = net.IPv4len
