package boxcore

import (
	"net"
	"slices"
	"strings"
	"testing"
)

func cidr(s string) *net.IPNet { _, n, _ := net.ParseCIDR(s); return n }

func TestParseSubnet(t *testing.T) {
	for _, ok := range []string{"10.87.0.0/24", "192.168.5.0/24"} {
		if _, err := ParseSubnet(ok); err != nil {
			t.Errorf("ParseSubnet(%q): %v", ok, err)
		}
	}
	for _, bad := range []string{"", "10.87.0.1/24", "10.87.0.0/16", "10.87.0.0", "fd00::/64", "banana", "300.1.1.0/24"} {
		if _, err := ParseSubnet(bad); err == nil {
			t.Errorf("ParseSubnet(%q) accepted", bad)
		}
	}
	if g := Gateway(cidr("10.87.3.0/24")); g.String() != "10.87.3.1/24" {
		t.Errorf("Gateway = %s", g)
	}
}

func TestPickSubnetAvoidsClaims(t *testing.T) {
	claims := []Claim{
		{Net: cidr("10.87.0.0/24"), By: "route on a", Dev: "a"},
		{Net: cidr("10.87.2.0/23"), By: "route on b", Dev: "b"},
		{Net: cidr("10.87.1.5/32"), By: "address on c", Dev: "c"},
	}
	n, err := PickSubnet(claims, "")
	if err != nil || n.String() != "10.87.4.0/24" {
		t.Fatalf("PickSubnet = %v, %v; want 10.87.4.0/24", n, err)
	}
	// Our own bridge's claim does not count against it.
	n, _ = PickSubnet(claims, "a")
	if n.String() != "10.87.0.0/24" {
		t.Fatalf("PickSubnet(self=a) = %v", n)
	}
	if c := FindClaimant(cidr("10.87.2.0/24"), claims, ""); c == nil || c.By != "route on b" {
		t.Fatalf("FindClaimant = %+v", c)
	}
	// A claim covering all of 10/8 leaves nothing.
	if _, err := PickSubnet([]Claim{{Net: cidr("10.0.0.0/8"), By: "vpn"}}, ""); err == nil {
		t.Fatal("PickSubnet found a subnet inside a claimed 10/8")
	}
}

func TestParseDNS(t *testing.T) {
	got, err := ParseDNS("")
	if err != nil || !slices.Equal(got, DefaultUpstreams) {
		t.Fatalf("default = %v %v", got, err)
	}
	got, err = ParseDNS("192.0.2.53, 2001:db8::53")
	if err != nil || !slices.Equal(got, []string{"192.0.2.53", "2001:db8::53"}) {
		t.Fatalf("list = %v %v", got, err)
	}
	for _, bad := range []string{"nope", "1.1.1.1,", "1.1.1.1;2.2.2.2", "host,1.1.1.1"} {
		if _, err := ParseDNS(bad); err == nil || !strings.Contains(err.Error(), "invalid dns") {
			t.Errorf("ParseDNS(%q) = %v", bad, err)
		}
	}
	if got, err := ParseDNS("host"); err != nil || len(got) == 0 {
		t.Fatalf("host = %v %v", got, err)
	}
}

func TestNetworkConfigAndRawDNSMasq(t *testing.T) {
	cfg := NetworkConfig("net0", Gateway(cidr("10.87.0.0/24")), []string{"192.0.2.53", "/drill.test/198.18.0.9"}, "acl", "r1 3")
	servers, other := ParseRawDNSMasq(cfg["raw.dnsmasq"])
	wantOther := append(slices.Clone(DNSOptions), "servers-file="+ServersDir+"/net0.servers", reapplyMarkPrefix+"r1 3")
	if !slices.Equal(servers, []string{"192.0.2.53", "/drill.test/198.18.0.9"}) || !slices.Equal(other, wantOther) {
		t.Fatalf("raw.dnsmasq parsed to %v / %v", servers, other)
	}
	if m := ReapplyMark(cfg["raw.dnsmasq"]); m != "r1 3" {
		t.Fatalf("ReapplyMark = %q", m)
	}
	if m := ReapplyMark(WithReapplyMark("no-hosts", "x")); m != "x" || ReapplyMark("no-hosts") != "0" {
		t.Fatalf("WithReapplyMark/ReapplyMark: %q", m)
	}
	if again := WithReapplyMark(cfg["raw.dnsmasq"], "r1 4"); strings.Count(again, reapplyMarkPrefix) != 1 || ReapplyMark(again) != "r1 4" {
		t.Fatalf("WithReapplyMark twice: %q", again)
	}
	if got := upstreamServers(cfg["raw.dnsmasq"]); !slices.Equal(got, []string{"192.0.2.53"}) {
		t.Fatalf("upstreams = %v", got)
	}
	for k, want := range map[string]string{"ipv6.address": "none", "dns.mode": "none", "ipv4.nat": "true", "security.acls": "acl", "security.acls.default.ingress.action": "drop"} {
		if cfg[k] != want {
			t.Errorf("%s = %q, want %q", k, cfg[k], want)
		}
	}
	if d := configDiff(map[string]string{"a": "1", "volatile.x": "y", "user.t": "z", "stray": "s"}, map[string]string{"a": "1"}); !slices.Equal(d, []string{"stray (remove)"}) {
		t.Fatalf("configDiff = %v", d)
	}
}

// SetServers takes only server= lines, one per entry: dnsmasq reads nothing else from a
// servers-file, and a line break would smuggle a second option in. Refused before any write.
func TestSetServersRefusesOtherLines(t *testing.T) {
	k := Kernel{Proc: t.TempDir()}
	for _, bad := range [][]string{{"no-hosts"}, {"server=/x/1.2.3.4\naddress=/y/5.6.7.8"}, {"address=/x/1.2.3.4"}} {
		if err := k.SetServers("cbt-none", bad); err == nil || !strings.Contains(err.Error(), "only one server=") {
			t.Errorf("SetServers(%q) = %v", bad, err)
		}
	}
}
