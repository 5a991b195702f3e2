package firewall

import (
	"fmt"
	"net"
	"net/netip"
	"strings"
	"testing"

	"github.com/vishvananda/netns"
)

func testSpec(bridge string) Spec {
	return Spec{Bridge: bridge, Gateway: net.IPv4(10, 77, 12, 1).To4()}
}

func apply(t testing.TB, s Spec, wantChanged bool) {
	t.Helper()
	changed, err := Apply(s)
	if err != nil {
		t.Fatalf("Apply: %v", err)
	}
	if changed != wantChanged {
		t.Fatalf("Apply changed=%v, want %v", changed, wantChanged)
	}
}

func check(t testing.TB, s Spec) []Drift {
	t.Helper()
	d, err := Check(s)
	if err != nil {
		t.Fatalf("Check: %v", err)
	}
	return d
}

func requireClean(t testing.TB, s Spec) {
	t.Helper()
	if d := check(t, s); len(d) != 0 {
		t.Fatalf("Check not clean: %v", d)
	}
}

func TestApplyIdempotent(t *testing.T) {
	t.Parallel()
	requireRoot(t)
	requireNft(t)
	ns := freshNS(t)
	s := testSpec("cbt0")

	if d := check(t, s); len(d) != 3 || d[0].Actual != absent || d[1].Actual != absent || d[2].Actual != absent {
		t.Fatalf("empty namespace: want three tables absent, got %v", d)
	}
	apply(t, s, true)
	before := nft(t, ns, "list", "ruleset")
	apply(t, s, false)
	after := nft(t, ns, "list", "ruleset")
	if before != after {
		t.Fatalf("ruleset changed on a converged Apply:\n%s\n---\n%s", before, after)
	}
	requireClean(t, s)
	t.Logf("nft list ruleset after Apply:\n%s", after)

	// What nft itself makes of our rules.
	bridgeRules := []string{`meta ibrname "cbt0" meta obrname "cbt0" drop`}
	if s.Resolved().L2 == L2Subnet {
		bridgeRules = []string{"ip saddr 10.77.12.0/24 drop", "ip daddr 10.77.12.0/24 drop",
			"arp saddr ip 10.77.12.0/24 drop", "arp daddr ip 10.77.12.0/24 drop"}
	}
	t.Logf("L2 mode on this kernel: %s", s.Resolved().L2)
	for _, want := range append(bridgeRules,
		"table bridge claudebox_cbt0 {",
		"type filter hook forward priority filter; policy accept;",
		"table inet claudebox_cbt0_guard {",
		"type filter hook forward priority filter - 1; policy accept;",
		`iifname "cbt0" oifname "cbt0" drop`,
		"type filter hook input priority filter - 1; policy accept;",
		`iifname "cbt0" ct state established,related accept`,
		`iifname "cbt0" ip daddr 10.77.12.1 udp dport 53 accept`,
		`iifname "cbt0" ip daddr 10.77.12.1 tcp dport 53 accept`,
		`iifname "cbt0" ip daddr 10.77.12.1 udp dport 67 accept`,
		`iifname "cbt0" ip daddr 255.255.255.255 udp dport 67 accept`,
		`iifname "cbt0" drop`,
	) {
		if !strings.Contains(after, want) {
			t.Errorf("nft list ruleset lacks %q", want)
		}
	}
}

// The summaries are nft syntax: loading them with nft must give a ruleset
// Check calls converged, which proves our expressions are the ones nft
// compiles (and that the renderer reads nft's rules the same way).
func TestSummariesAreWhatNftCompiles(t *testing.T) {
	t.Parallel()
	requireRoot(t)
	requireNft(t)
	ns := freshNS(t)
	for _, mode := range []L2Mode{L2BridgeName, L2Subnet} {
		if mode == L2BridgeName && !BridgeMetaSupported() {
			t.Logf("kernel lacks nft_meta_bridge: %s not loadable, skipped", mode)
			continue
		}
		for _, plen := range []int{24, 22} {
			s := testSpec(fmt.Sprintf("cbt1-%d", plen))
			s.L2, s.PrefixLen = mode, plen
			nftMatchesOurs(t, ns, s)
			// The wall with blocked ranges (byte-aligned or not) and uplinks.
			s.Bridge += "w"
			s.Uplinks = []string{"up0", "wg-1"}
			for _, p := range []string{"10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "169.254.0.0/16", "198.18.77.0/24"} {
				s.Blocked = append(s.Blocked, netip.MustParsePrefix(p))
			}
			nftMatchesOurs(t, ns, s)
			// Port bindings.
			s.Bridge += "p"
			s.Ports = []PortBinding{
				{Port: "veth0a1b2c3d", MAC: net.HardwareAddr{0x10, 0x66, 0x6a, 0xfd, 0xbb, 0x6c}, IPv4: netip.MustParseAddr("10.77.12.5")},
				{Port: "p2", MAC: net.HardwareAddr{0x02, 0, 0, 0, 0, 0x01}, IPv4: netip.MustParseAddr("10.77.12.254")},
			}
			nftMatchesOurs(t, ns, s)
			// Exposures.
			s.Bridge += "e"
			s.Exposed = []uint16{8080, 3000}
			nftMatchesOurs(t, ns, s)
		}
	}
}

func nftMatchesOurs(t *testing.T, ns netns.NsHandle, s Spec) {
	t.Helper()

	var b strings.Builder
	for _, c := range DesiredChains(s) {
		fmt.Fprintf(&b, "table %s %s {\n chain %s {\n  type %s hook %s priority %d; policy %s;\n",
			c.Family, c.Table, c.Name, c.Type, c.Hook, c.Priority, c.Policy)
		for _, r := range Desired(s) {
			if r.Table == c.Table && r.Chain == c.Name {
				fmt.Fprintf(&b, "  %s\n", r.Summary)
			}
		}
		b.WriteString(" }\n}\n")
	}
	if out, err := nftStdin(ns, b.String()); err != nil {
		t.Fatalf("nft -f: %v\n%s\n%s", err, out, b.String())
	}
	if d := check(t, s); len(d) != 0 {
		t.Fatalf("nft-loaded ruleset differs from Desired: %v\nscript:\n%s", d, b.String())
	}
	apply(t, s, false)
	if _, err := Remove(s.Bridge); err != nil {
		t.Fatal(err)
	}
}

func TestDrift(t *testing.T) {
	t.Parallel()
	requireRoot(t)
	requireNft(t)
	ns := freshNS(t)
	s := testSpec("cbt2")
	bt, gt := TableNames(s.Bridge)
	apply(t, s, true)
	var first Rule
	var restMissing []Drift
	var bridgeRuleCmds string
	inputRules := 0
	for _, r := range Desired(s) {
		if r.Table == bt && r.Chain == ForwardChain {
			bridgeRuleCmds += "add rule bridge " + bt + " forward " + r.Summary + "\n"
		}
		switch {
		case r.Table == bt && r.Chain != ForwardChain:
		case r.Table == bt && first.Summary == "":
			first = r
		case r.Table == bt:
			restMissing = append(restMissing, Drift{What: fmt.Sprintf("rule bridge %s forward #%d", bt, len(restMissing)+2), Expected: r.Summary, Actual: absent})
		case r.Chain == InputChain:
			inputRules++
		}
	}

	cases := []struct {
		name   string
		tamper []string // nft argv
		want   []Drift
	}{
		{
			name:   "bridge table deleted",
			tamper: []string{"delete table bridge " + bt},
			want:   []Drift{{What: "table bridge " + bt, Expected: "present", Actual: absent}},
		},
		{
			name:   "guard table deleted",
			tamper: []string{"delete table inet " + gt},
			want:   []Drift{{What: "table inet " + gt, Expected: "present", Actual: absent}},
		},
		{
			name:   "foreign rule appended",
			tamper: []string{"add rule inet " + gt + " input tcp dport 22 accept"},
			want: []Drift{{What: "rule inet " + gt + " input #7", Expected: absent,
				Actual: "meta l4proto tcp th dport 22 accept"}},
		},
		{
			name:   "foreign rule inserted first",
			tamper: []string{`insert rule inet ` + gt + ` input iifname "cbt2" accept`},
			want: []Drift{{What: "rule inet " + gt + " input #1", Expected: absent,
				Actual: `iifname "cbt2" accept`}},
		},
		{
			name: "counter added to the first bridge rule",
			tamper: []string{"flush chain bridge " + bt + " forward",
				"add rule bridge " + bt + " forward " + strings.TrimSuffix(first.Summary, " drop") + " counter drop"},
			want: append([]Drift{
				{What: "rule bridge " + bt + " forward #1", Expected: absent, Actual: strings.TrimSuffix(first.Summary, " drop") + " <counter> drop"},
				{What: "rule bridge " + bt + " forward #1", Expected: first.Summary, Actual: absent},
			}, restMissing...),
		},
		{
			name:   "wildcard instead of the bridge name",
			tamper: []string{"flush chain inet " + gt + " forward", `add rule inet ` + gt + ` forward iifname "cbt*" oifname "cbt2" drop`},
			want: []Drift{
				{What: "rule inet " + gt + " forward #1", Expected: absent, Actual: `iifname 0x636274 oifname "cbt2" drop`},
				{What: "rule inet " + gt + " forward #1", Expected: `iifname "cbt2" oifname "cbt2" drop`, Actual: absent},
			},
		},
		{
			name:   "guard emptied",
			tamper: []string{"flush chain inet " + gt + " input"},
			want:   nil, // checked by count below
		},
		{
			name:   "policy flipped",
			tamper: []string{"add chain inet " + gt + " input { type filter hook input priority -1; policy drop; }"},
			want: []Drift{{What: "chain inet " + gt + " input", Expected: "type filter hook input priority -1 policy accept",
				Actual: "type filter hook input priority -1 policy drop"}},
		},
		{
			name:   "table made dormant",
			tamper: []string{"add table bridge " + bt + " { flags dormant; }"},
			want:   []Drift{{What: "table bridge " + bt + " flags", Expected: "none", Actual: "dormant"}},
		},
		{
			name: "chain at another priority",
			tamper: []string{"delete chain bridge " + bt + " forward",
				"add chain bridge " + bt + " forward { type filter hook forward priority 100; policy accept; }\n" +
					bridgeRuleCmds},
			want: []Drift{{What: "chain bridge " + bt + " forward", Expected: "type filter hook forward priority -200 policy accept",
				Actual: "type filter hook forward priority 100 policy accept"}},
		},
		{
			name:   "foreign chain in our table",
			tamper: []string{"add chain inet " + gt + " sneaky { type filter hook input priority -300; policy accept; }"},
			want: []Drift{{What: "chain inet " + gt + " sneaky", Expected: absent,
				Actual: "type filter hook input priority -300 policy accept"}},
		},
		{
			name:   "foreign set in our table",
			tamper: []string{"add set inet " + gt + " allow { type ipv4_addr; }"},
			want:   []Drift{{What: "set inet " + gt + " allow", Expected: absent, Actual: "present"}},
		},
	}
	for _, c := range cases {
		for _, cmd := range c.tamper {
			if out, err := nftStdin(ns, cmd); err != nil {
				t.Fatalf("%s: nft %s: %v\n%s", c.name, cmd, err, out)
			}
		}
		got := check(t, s)
		switch {
		case c.want == nil && len(got) != inputRules:
			t.Errorf("%s: want one missing rule per guard rule, got %v", c.name, got)
		case c.want != nil && fmt.Sprint(got) != fmt.Sprint(c.want):
			t.Errorf("%s:\n got %v\nwant %v", c.name, got, c.want)
		}
		apply(t, s, true) // repairs
		requireClean(t, s)
	}
}

func TestRemove(t *testing.T) {
	t.Parallel()
	requireRoot(t)
	requireNft(t)
	ns := freshNS(t)
	s, other := testSpec("cbt3"), testSpec("cbt3b")
	nft(t, ns, "add", "table", "inet", "someone_else")
	apply(t, s, true)
	apply(t, other, true)

	removed, err := Remove(s.Bridge)
	if err != nil || !removed {
		t.Fatalf("Remove = %v, %v; want true, nil", removed, err)
	}
	obs, err := Read(s.Bridge)
	must(t, err)
	for _, ts := range obs.Tables {
		if ts.Present {
			t.Errorf("%s still present after Remove", tableWhat(ts))
		}
	}
	removed, err = Remove(s.Bridge)
	if err != nil || removed {
		t.Fatalf("second Remove = %v, %v; want false, nil", removed, err)
	}
	// Another bridge's stack and foreign tables are untouched.
	requireClean(t, other)
	if out := nft(t, ns, "list", "tables"); !strings.Contains(out, "table inet someone_else") {
		t.Fatalf("foreign table gone:\n%s", out)
	}
	if _, err := Remove("bad/name"); err == nil {
		t.Fatal("Remove accepted an invalid bridge name")
	}
}

// Half-present stacks (one table only) converge too.
func TestApplyFromPartial(t *testing.T) {
	t.Parallel()
	requireRoot(t)
	requireNft(t)
	ns := freshNS(t)
	s := testSpec("cbt4")
	bt, _ := TableNames(s.Bridge)
	nft(t, ns, "add", "table", "bridge", bt)
	d := check(t, s)
	if len(d) != 6 || d[0].What != "chain bridge "+bt+" forward" || d[3].What != "chain bridge "+bt+" output" ||
		d[4].Actual != absent || d[5].Actual != absent {
		t.Fatalf("partial: %v", d)
	}
	apply(t, s, true)
	requireClean(t, s)
}

func BenchmarkApplyConverged(b *testing.B) {
	requireRoot(b)
	freshNS(b)
	s := testSpec("cbtb")
	if _, err := Apply(s); err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		changed, err := Apply(s)
		if err != nil || changed {
			b.Fatalf("Apply = %v, %v", changed, err)
		}
	}
}

func BenchmarkCheck(b *testing.B) {
	requireRoot(b)
	freshNS(b)
	s := testSpec("cbtc")
	if _, err := Apply(s); err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if d, err := Check(s); err != nil || len(d) != 0 {
			b.Fatalf("Check = %v, %v", d, err)
		}
	}
}
