package firewall

import (
	"net"
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
	got := Desired(Spec{Bridge: "claudenet", Gateway: net.ParseIP("10.77.12.1")})
	want := []string{
		`bridge claudebox_claudenet forward: meta ibrname "claudenet" meta obrname "claudenet" drop`,
		`inet claudebox_claudenet_guard input: iifname "claudenet" ct state established,related accept`,
		`inet claudebox_claudenet_guard input: iifname "claudenet" meta nfproto ipv4 ip daddr 10.77.12.1 meta l4proto udp th dport 53 accept`,
		`inet claudebox_claudenet_guard input: iifname "claudenet" meta nfproto ipv4 ip daddr 10.77.12.1 meta l4proto tcp th dport 53 accept`,
		`inet claudebox_claudenet_guard input: iifname "claudenet" meta nfproto ipv4 ip daddr 10.77.12.1 meta l4proto udp th dport 67 accept`,
		`inet claudebox_claudenet_guard input: iifname "claudenet" meta nfproto ipv4 ip daddr 255.255.255.255 meta l4proto udp th dport 67 accept`,
		`inet claudebox_claudenet_guard input: iifname "claudenet" drop`,
	}
	if len(got) != len(want) {
		t.Fatalf("got %d rules, want %d", len(got), len(want))
	}
	for i := range want {
		if got[i].String() != want[i] {
			t.Errorf("rule %d:\n got %s\nwant %s", i, got[i], want[i])
		}
		if got[i].Why == "" {
			t.Errorf("rule %d has no Why", i)
		}
	}
	chains := DesiredChains(Spec{Bridge: "claudenet"})
	if h := chains[0].Header(); h != "type filter hook forward priority -200 policy accept" {
		t.Errorf("bridge chain: %s", h)
	}
	if h := chains[1].Header(); h != "type filter hook input priority -1 policy accept" {
		t.Errorf("guard chain: %s", h)
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
	s := Spec{Bridge: "claudenet", Gateway: net.ParseIP("10.77.12.1")}
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
