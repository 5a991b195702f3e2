package firewall

import (
	"fmt"
	"net"
	"net/netip"
	"strings"
	"testing"

	"github.com/google/nftables/expr"
	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

func TestValidate(t *testing.T) {
	gw := net.ParseIP("10.77.12.1")
	for _, c := range []struct {
		name string
		spec Spec
		ok   bool
	}{
		{"ok", Spec{Bridge: "claudenet", Gateway: gw}, true},
		{"15 bytes", Spec{Bridge: "abcdefghijklmno", Gateway: gw}, true},
		{"dash", Spec{Bridge: "cbt-fw-1", Gateway: gw}, true},
		{"empty bridge", Spec{Bridge: "", Gateway: gw}, false},
		{"16 bytes", Spec{Bridge: "abcdefghijklmnop", Gateway: gw}, false},
		{"slash", Spec{Bridge: "a/b", Gateway: gw}, false},
		{"space", Spec{Bridge: "a b", Gateway: gw}, false},
		{"quote", Spec{Bridge: `a"b`, Gateway: gw}, false},
		{"no gateway", Spec{Bridge: "claudenet"}, false},
		{"ipv6 gateway", Spec{Bridge: "claudenet", Gateway: net.ParseIP("fd00::1")}, false},
		{"unspecified", Spec{Bridge: "claudenet", Gateway: net.IPv4zero}, false},
		{"broadcast", Spec{Bridge: "claudenet", Gateway: net.IPv4bcast}, false},
		{"garbage bytes", Spec{Bridge: "claudenet", Gateway: net.IP{1, 2, 3}}, false},
		{"prefix 22", Spec{Bridge: "claudenet", Gateway: gw, PrefixLen: 22}, true},
		{"prefix 31", Spec{Bridge: "claudenet", Gateway: gw, PrefixLen: 31}, false},
		{"prefix 4", Spec{Bridge: "claudenet", Gateway: gw, PrefixLen: 4}, false},
		{"mode", Spec{Bridge: "claudenet", Gateway: gw, L2: "magic"}, false},
		{"blocked", Spec{Bridge: "claudenet", Gateway: gw, Blocked: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8"), netip.MustParsePrefix("10.1.2.3/16")}}, true},
		{"blocked zero", Spec{Bridge: "claudenet", Gateway: gw, Blocked: []netip.Prefix{{}}}, false},
		{"blocked ipv6", Spec{Bridge: "claudenet", Gateway: gw, Blocked: []netip.Prefix{netip.MustParsePrefix("fd00::/8")}}, false},
		{"blocked 4in6", Spec{Bridge: "claudenet", Gateway: gw, Blocked: []netip.Prefix{netip.MustParsePrefix("::ffff:10.0.0.0/104")}}, false},
		{"blocked everything", Spec{Bridge: "claudenet", Gateway: gw, Blocked: []netip.Prefix{netip.MustParsePrefix("0.0.0.0/0")}}, false},
		{"uplinks", Spec{Bridge: "claudenet", Gateway: gw, Uplinks: []string{"eth0", "wg0"}}, true},
		{"uplink is bridge", Spec{Bridge: "claudenet", Gateway: gw, Uplinks: []string{"claudenet"}}, false},
		{"uplink twice", Spec{Bridge: "claudenet", Gateway: gw, Uplinks: []string{"eth0", "eth0"}}, false},
		{"uplink bad name", Spec{Bridge: "claudenet", Gateway: gw, Uplinks: []string{"eth*"}}, false},
		{"uplink empty", Spec{Bridge: "claudenet", Gateway: gw, Uplinks: []string{""}}, false},
	} {
		err := c.spec.Validate()
		if (err == nil) != c.ok {
			t.Errorf("%s: Validate(%+v) = %v, want ok=%v", c.name, c.spec, err, c.ok)
		}
	}
}

func TestTableNames(t *testing.T) {
	b, g := TableNames("claudenet")
	if b != "claudebox_claudenet" || g != "claudebox_claudenet_guard" {
		t.Fatalf("TableNames = %q, %q", b, g)
	}
}

// The rules as a reader sees them: this is the contract in one screen.
func TestDesiredGolden(t *testing.T) {
	guard := []string{
		`inet claudebox_claudenet_guard forward: iifname "claudenet" oifname "claudenet" drop`,
		`inet claudebox_claudenet_guard input: iifname "claudenet" ct state established,related accept`,
		`inet claudebox_claudenet_guard input: iifname "claudenet" meta nfproto ipv4 ip daddr 10.77.12.1 meta l4proto udp th dport 53 accept`,
		`inet claudebox_claudenet_guard input: iifname "claudenet" meta nfproto ipv4 ip daddr 10.77.12.1 meta l4proto tcp th dport 53 accept`,
		`inet claudebox_claudenet_guard input: iifname "claudenet" meta nfproto ipv4 ip daddr 10.77.12.1 meta l4proto udp th dport 67 accept`,
		`inet claudebox_claudenet_guard input: iifname "claudenet" meta nfproto ipv4 ip daddr 255.255.255.255 meta l4proto udp th dport 67 accept`,
		`inet claudebox_claudenet_guard input: iifname "claudenet" drop`,
		`inet claudebox_claudenet_guard output: oifname "claudenet" ct state new meta l4proto != udp drop`,
		`inet claudebox_claudenet_guard output: oifname "claudenet" ct state new meta l4proto udp th sport != 67 drop`,
		`inet claudebox_claudenet_guard output: oifname "claudenet" meta l4proto udp @th,0,32 0x00430043 drop`,
		`inet claudebox_claudenet_guard inbound: oifname "claudenet" ct state new drop`,
		`inet claudebox_claudenet_guard egress: oifname != "claudenet" oifname != "lo" meta nfproto ipv4 ip saddr 10.77.12.0/24 drop`,
		`inet claudebox_claudenet_guard egress: iifname "claudenet" oifname != "claudenet" meta nfproto ipv4 @nh,0,8 & 0x0f != 0x05 drop`,
		`inet claudebox_claudenet_guard answers: oifname "claudenet" meta l4proto udp th sport 53 @th,80,8 & 0x84 == 0x84 @th,112,16 != 0x0000 drop`,
		`inet claudebox_claudenet_guard dns_tcp: iifname "claudenet" meta l4proto tcp th dport 53 drop`,
	}
	gw := net.ParseIP("10.77.12.1")
	up := []string{"eth0"}
	// No ports bound, no blocked ranges: the subnet speaks to the host from no port, and the
	// L2 host→box rules.
	l2 := []string{
		`bridge claudebox_claudenet input: meta protocol ip ip saddr 10.77.12.0/24 drop`,
		`bridge claudebox_claudenet input: ether type arp arp saddr ip 10.77.12.0/24 drop`,
		`bridge claudebox_claudenet output: ether type ip ip daddr 10.77.12.0/24 meta l4proto tcp @th,104,8 & 0x12 == 0x02 drop`,
		`bridge claudebox_claudenet output: ether type ip ip saddr 10.77.12.1 meta l4proto udp th sport != 53 th sport != 67 drop`,
		`bridge claudebox_claudenet output: ether type ip ip daddr 10.77.12.0/24 meta l4proto icmp @th,0,8 0x08 drop`,
	}
	for _, c := range []struct {
		spec   Spec
		bridge []string
	}{
		{Spec{Bridge: "claudenet", Gateway: gw, L2: L2BridgeName, Uplinks: up}, []string{
			`bridge claudebox_claudenet forward: meta ibrname "claudenet" meta obrname "claudenet" drop`,
		}},
		{Spec{Bridge: "claudenet", Gateway: gw, L2: L2Subnet, Uplinks: up}, []string{
			`bridge claudebox_claudenet forward: meta protocol ip ip saddr 10.77.12.0/24 drop`,
			`bridge claudebox_claudenet forward: meta protocol ip ip daddr 10.77.12.0/24 drop`,
			`bridge claudebox_claudenet forward: ether type arp arp saddr ip 10.77.12.0/24 drop`,
			`bridge claudebox_claudenet forward: ether type arp arp daddr ip 10.77.12.0/24 drop`,
		}},
		{Spec{Bridge: "claudenet", Gateway: gw, L2: L2Subnet, PrefixLen: 22, Uplinks: up}, []string{
			`bridge claudebox_claudenet forward: meta protocol ip ip saddr 10.77.12.0/22 drop`,
			`bridge claudebox_claudenet forward: meta protocol ip ip daddr 10.77.12.0/22 drop`,
			`bridge claudebox_claudenet forward: ether type arp arp saddr ip 10.77.12.0/22 drop`,
			`bridge claudebox_claudenet forward: ether type arp arp daddr ip 10.77.12.0/22 drop`,
		}},
	} {
		plen := c.spec.PrefixLen
		if plen == 0 {
			plen = 24
		}
		wall := strings.Split(strings.ReplaceAll(wallGolden(nil, up), "/24", fmt.Sprintf("/%d", plen)), "\n")
		l2p := strings.Split(strings.ReplaceAll(strings.Join(l2, "\n"), "/24", fmt.Sprintf("/%d", plen)), "\n")
		guardp := strings.Split(strings.ReplaceAll(strings.Join(guard, "\n"), "/24", fmt.Sprintf("/%d", plen)), "\n")
		want := append(append(append(append([]string{}, c.bridge...), l2p...), guardp...), wall...)
		got := Desired(c.spec)
		var lines []string
		for _, r := range got {
			lines = append(lines, r.String())
			if r.Why == "" {
				t.Errorf("%s has no Why", r)
			}
		}
		if strings.Join(lines, "\n") != strings.Join(want, "\n") {
			t.Errorf("%s /%d:\n got:\n%s\nwant:\n%s", c.spec.L2, c.spec.PrefixLen, strings.Join(lines, "\n"), strings.Join(want, "\n"))
		}
	}
	var headers []string
	for _, c := range DesiredChains(Spec{Bridge: "claudenet"}) {
		headers = append(headers, fmt.Sprintf("%s %s %s: %s", c.Family, c.Table, c.Name, c.Header()))
	}
	wantH := []string{
		"bridge claudebox_claudenet forward: type filter hook forward priority -200 policy accept",
		"bridge claudebox_claudenet prerouting: type filter hook prerouting priority -200 policy accept",
		"bridge claudebox_claudenet input: type filter hook input priority -200 policy accept",
		"bridge claudebox_claudenet output: type filter hook output priority -200 policy accept",
		"inet claudebox_claudenet_guard forward: type filter hook forward priority -1 policy accept",
		"inet claudebox_claudenet_guard input: type filter hook input priority -1 policy accept",
		"inet claudebox_claudenet_guard output: type filter hook output priority -1 policy accept",
		"inet claudebox_claudenet_guard inbound: type filter hook forward priority -1 policy accept",
		"inet claudebox_claudenet_guard egress: type filter hook postrouting priority 200 policy accept",
		"inet claudebox_claudenet_guard answers: type filter hook output priority -1 policy accept",
		"inet claudebox_claudenet_guard dns_tcp: type filter hook input priority -1 policy accept",
		"inet claudebox_claudenet_wall prerouting: type filter hook prerouting priority -300 policy accept",
		"inet claudebox_claudenet_wall forward: type filter hook forward priority -1 policy accept",
		"inet claudebox_claudenet_wall output: type filter hook output priority -1 policy accept",
		"inet claudebox_claudenet_wall postrouting: type nat hook postrouting priority 110 policy accept",
	}
	if strings.Join(headers, "\n") != strings.Join(wantH, "\n") {
		t.Errorf("chains:\n%s", strings.Join(headers, "\n"))
	}
}

func rawOf(t *testing.T, e expr.Any) rawExpr {
	t.Helper()
	b, err := expr.Marshal(unix.NFPROTO_INET, e)
	if err != nil {
		t.Fatal(err)
	}
	r, err := rawFromElem(b)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// Anything the renderer does not fully understand must not read back as a
// desired rule.
func TestRenderStrangersStayStrange(t *testing.T) {
	s := Spec{Bridge: "claudenet", Gateway: net.ParseIP("10.77.12.1"), L2: L2BridgeName}
	desired := map[string]bool{}
	for _, r := range Desired(s) {
		desired[r.Summary] = true
	}
	drop := rawOf(t, &expr.Verdict{Kind: expr.VerdictDrop})
	ifn := ifname(expr.MetaKeyIIFNAME, "claudenet")
	base := []rawExpr{rawOf(t, ifn[0]), rawOf(t, ifn[1])}

	// A bitwise shift: the library would decode it as a plain mask.
	shift, _ := netlink.MarshalAttributes([]netlink.Attribute{
		{Type: unix.NFTA_BITWISE_SREG, Data: []byte{0, 0, 0, 1}},
		{Type: unix.NFTA_BITWISE_DREG, Data: []byte{0, 0, 0, 1}},
		{Type: unix.NFTA_BITWISE_LEN, Data: []byte{0, 0, 0, 16}},
		{Type: nftaBitwiseOp, Data: []byte{0, 0, 0, 1}},
	})
	cases := map[string][]rawExpr{
		"unknown expression": append(append([]rawExpr{}, base...), rawExpr{name: "last", data: []byte{1}}, drop),
		"counter":            append(append([]rawExpr{}, base...), rawOf(t, &expr.Counter{}), drop),
		"bitwise shift":      append(append([]rawExpr{}, base[0], rawExpr{name: "bitwise", data: shift}), base[1], drop),
		"prefix ifname":      {rawOf(t, ifn[0]), rawOf(t, &expr.Cmp{Register: 1, Data: []byte("claude")}), drop},
		"unused load":        append([]rawExpr{rawOf(t, &expr.Meta{Key: expr.MetaKeyMARK, Register: 2})}, append(base, drop)...),
	}
	for name, raws := range cases {
		got := renderRaw(raws, nil)
		if desired[got] || got == `iifname "claudenet" drop` {
			t.Errorf("%s rendered as a desired rule: %s", name, got)
		}
		t.Logf("%-18s %s", name, got)
	}
	if got := renderRaw(append(append([]rawExpr{}, base...), drop), []byte{1, 2}); desired[got] {
		t.Errorf("userdata hidden: %s", got)
	}
	if got := renderRaw(append(append([]rawExpr{}, base...), drop), nil); !desired[got] {
		t.Errorf("plain rule should equal desired, got %s", got)
	}
}

func TestDiffRulesAligns(t *testing.T) {
	d := diffRules("chain inet t input", []string{"a", "b", "c"}, []string{"x", "a", "c", "y"})
	var got []string
	for _, x := range d {
		got = append(got, x.String())
	}
	want := []string{
		"rule inet t input #1: expected absent, actual x",
		"rule inet t input #2: expected b, actual absent",
		"rule inet t input #4: expected absent, actual y",
	}
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Fatalf("diff:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}

// wallGolden is the wall for claudenet 10.77.12.1/24 as a reader sees it.
func wallGolden(blocked []string, uplinks []string) string {
	w := "inet claudebox_claudenet_wall "
	pre := w + `prerouting: iifname "claudenet" `
	lines := []string{
		w + `prerouting: iifname != "claudenet" iifname != "lo" meta nfproto ipv4 ip saddr 10.77.12.0/24 drop`,
		w + `prerouting: iifname != "claudenet" iifname != "lo" meta nfproto ipv4 ip daddr 10.77.12.0/24 drop`,
		pre + `meta nfproto ipv6 drop`,
		pre + `meta nfproto ipv4 ip saddr != 10.77.12.0/24 ip saddr != 0.0.0.0 drop`,
		pre + `meta nfproto ipv4 ip saddr 0.0.0.0 meta l4proto != udp drop`,
		pre + `meta nfproto ipv4 ip saddr 0.0.0.0 meta l4proto udp th sport != 68 drop`,
		pre + `meta nfproto ipv4 ip saddr 0.0.0.0 meta l4proto udp th dport != 67 drop`,
		pre + `meta nfproto ipv4 ip daddr 10.77.12.1 meta l4proto udp th dport 53 accept`,
		pre + `meta nfproto ipv4 ip daddr 10.77.12.1 meta l4proto tcp th dport 53 accept`,
		pre + `meta nfproto ipv4 ip daddr 10.77.12.1 meta l4proto udp th dport 67 accept`,
		pre + `meta nfproto ipv4 ip daddr 255.255.255.255 meta l4proto udp th dport 67 accept`,
		pre + `fib daddr type local drop`,
		pre + `fib daddr type broadcast drop`,
		pre + `fib daddr type multicast drop`,
		w + `forward: iifname "claudenet" meta nfproto ipv6 drop`,
		w + `forward: oifname "claudenet" meta nfproto ipv6 drop`,
		w + `forward: iifname "claudenet" meta nfproto ipv4 ip saddr != 10.77.12.0/24 drop`,
		w + `forward: iifname "claudenet" ct state invalid,untracked drop`,
		w + `forward: iifname "claudenet" ct state related ct status & 0x10 == 0x0 drop`,
		w + `forward: iifname "claudenet" meta nfproto ipv4 @nh,0,8 & 0x0f != 0x05 drop`,
	}
	for _, b := range blocked {
		lines = append(lines, w+`forward: iifname "claudenet" meta nfproto ipv4 ip daddr `+b+` drop`)
	}
	for _, b := range blocked {
		lines = append(lines, w+`forward: oifname "claudenet" meta nfproto ipv4 ip saddr `+b+` drop`)
	}
	ups := ""
	for _, u := range uplinks {
		ups += ` oifname != "` + u + `"`
	}
	lines = append(lines,
		w+`forward: oifname "claudenet" ct state new drop`,
		w+`forward: oifname != "claudenet" meta nfproto ipv4 ip daddr 10.77.12.0/24 drop`,
		w+`forward: iifname "claudenet"`+ups+` drop`,
		w+`output: oifname != "claudenet" oifname != "lo" meta nfproto ipv4 ip daddr 10.77.12.0/24 drop`,
		w+`output: oifname "claudenet" meta nfproto ipv6 drop`,
		w+`output: oifname "claudenet" ct state new meta l4proto != udp drop`,
		w+`output: oifname "claudenet" ct state new meta l4proto udp th sport != 67 drop`,
		w+`output: oifname "claudenet" meta l4proto udp @th,0,32 0x00430043 drop`,
		w+`postrouting: meta nfproto ipv4 ip saddr 10.77.12.0/24 oifname != "claudenet" oifname != "lo" masquerade`,
	)
	return strings.Join(lines, "\n")
}

func wallOf(s Spec) string {
	var lines []string
	for _, r := range Desired(s) {
		if r.Table == WallTableName(s.Bridge) {
			lines = append(lines, r.String())
		}
	}
	return strings.Join(lines, "\n")
}

// Blocked ranges are masked and deduplicated, in the caller's order; each
// uplink is one more `oifname !=`; no uplink means no egress.
func TestWallGolden(t *testing.T) {
	gw := net.ParseIP("10.77.12.1")
	blocked := []netip.Prefix{
		netip.MustParsePrefix("10.0.0.0/8"), netip.MustParsePrefix("172.16.0.0/12"),
		netip.MustParsePrefix("192.168.0.0/16"), netip.MustParsePrefix("100.64.0.0/10"),
		netip.MustParsePrefix("169.254.0.0/16"), netip.MustParsePrefix("198.18.5.1/24"),
		netip.MustParsePrefix("10.0.0.0/8"),
	}
	wantBlocked := []string{"10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "169.254.0.0/16", "198.18.5.0/24"}
	for _, c := range []struct {
		name string
		spec Spec
		want string
	}{
		{"blocked, two uplinks", Spec{Bridge: "claudenet", Gateway: gw, L2: L2Subnet, Blocked: blocked, Uplinks: []string{"eth0", "wg0"}},
			wallGolden(wantBlocked, []string{"eth0", "wg0"})},
		{"no uplink resolvable", Spec{Bridge: "claudenet", Gateway: gw, L2: L2Subnet, Uplinks: []string{"eth0"}},
			wallGolden(nil, []string{"eth0"})},
		{"two bound ports: nothing delivered on either port itself", Spec{Bridge: "claudenet", Gateway: gw, L2: L2Subnet, Uplinks: []string{"eth0"},
			Ports: []PortBinding{
				{Port: "veth1", MAC: net.HardwareAddr{2, 0, 0, 0, 0, 1}, IPv4: netip.MustParseAddr("10.77.12.11")},
				{Port: "veth2", MAC: net.HardwareAddr{2, 0, 0, 0, 0, 2}, IPv4: netip.MustParseAddr("10.77.12.12")},
			}},
			`inet claudebox_claudenet_wall prerouting: iifname "veth1" drop` + "\n" +
				`inet claudebox_claudenet_wall prerouting: iifname "veth2" drop` + "\n" +
				wallGolden(nil, []string{"eth0"})},
	} {
		if got := wallOf(c.spec); got != c.want {
			t.Errorf("%s:\n got:\n%s\nwant:\n%s", c.name, got, c.want)
		}
	}
	if WallTableName("claudenet") != "claudebox_claudenet_wall" {
		t.Fatalf("WallTableName = %q", WallTableName("claudenet"))
	}
}

// With no default route (an empty namespace) the wall allows no egress.
func TestWallNoUplinkNoEgress(t *testing.T) {
	freshNS(t)
	s := Spec{Bridge: "claudenet", Gateway: net.ParseIP("10.77.12.1"), L2: L2Subnet}
	if got, want := wallOf(s), wallGolden(nil, nil); got != want {
		t.Fatalf("got:\n%s\nwant:\n%s", got, want)
	}
}
