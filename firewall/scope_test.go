package firewall

import (
	"net"
	"net/netip"
	"strings"
	"testing"
)

// Bridge-family rules see every bridge's frames on kernels without nft_meta_bridge: each
// routed-range rule must name this bridge's subnet, or it would cut other bridges' boxes
// off from their own gateways (another Incus network in 10/8, a test stack).
func TestL2RangeRulesAreScopedToTheSubnet(t *testing.T) {
	s := Spec{Bridge: "br0", Gateway: net.ParseIP("10.77.12.1"), PrefixLen: 24, L2: L2Subnet, Uplinks: []string{"eth0"},
		Blocked: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8"), netip.MustParsePrefix("192.168.0.0/16")}}
	n := 0
	for _, r := range Desired(s) {
		if r.Family != FamilyBridge || (r.Chain != InputChain && r.Chain != OutputChain) {
			continue
		}
		n++
		if !strings.Contains(r.Summary, "10.77.12.0/24") && !strings.Contains(r.Summary, "10.77.12.1") {
			t.Errorf("bridge %s rule not scoped to the box subnet or its gateway: %s", r.Chain, r.Summary)
		}
	}
	if n == 0 {
		t.Fatal("no L2 range rules rendered")
	}
}
