package boxcore

import "testing"

// A member's own network keys are what its view has beyond the cluster-wide config; volatile.*
// and user.* are never counted. Rows list them as k=v, sorted, or "none".
func TestMemberOwnKeys(t *testing.T) {
	global := map[string]string{"ipv4.address": "10.87.0.1/24", "user.claudebox.uplinks": "eth0"}
	on := map[string]string{"ipv4.address": "10.87.0.1/24", "user.claudebox.uplinks": "eth0",
		"bridge.external_interfaces": "eth1", "volatile.bridge.hwaddr": "x", "bgp.ipv4.nexthop": "192.0.2.1"}
	if got, want := keyList(memberOwnKeys(on, global)), "bgp.ipv4.nexthop=192.0.2.1, bridge.external_interfaces=eth1"; got != want {
		t.Errorf("own keys %q, want %q", got, want)
	}
	if got := keyList(memberOwnKeys(global, global)); got != "none" {
		t.Errorf("own keys of the cluster-wide view itself: %q, want none", got)
	}
	want := map[string]string{"ipv4.address": "10.87.0.1/24"}
	if got := keyList(foreignKeys(on, want)); got != "bgp.ipv4.nexthop=192.0.2.1, bridge.external_interfaces=eth1" {
		t.Errorf("foreign keys %q", got)
	}
}
