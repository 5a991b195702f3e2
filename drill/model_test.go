package drill

import (
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/claudebox/claudebox/drill/probes"
)

// testTopology is a lab as the model sees it: two boxes with link-local addresses, one
// without, the gateway and one other host address, two host names, one decoy per range.
func testTopology() *Topology {
	box := func(n, v4, ll string) *Box {
		b := &Box{Name: n, IPv4: netip.MustParseAddr(v4), Hostname: n}
		if ll != "" {
			b.LL = netip.MustParseAddr(ll).WithZone("eth0")
		}
		return b
	}
	return &Topology{
		Soak: 20, Resources: true,
		Boxes:   []*Box{box("a", "10.87.0.10", "fe80::a"), box("b", "10.87.0.11", "fe80::b"), box("c", "10.87.0.12", "")},
		ResBox:  box("r", "10.87.0.20", ""),
		Gateway: netip.MustParsePrefix("10.87.0.1/24"), Domain: "incus",
		HostAddrs: []netip.Addr{netip.MustParseAddr("10.87.0.1"), netip.MustParseAddr("192.0.2.5")},
		HostNames: []string{"host1", "localhost"}, HostTCP: 4001, HostUDP: 4002,
		Decoys: []DecoyTarget{
			{Range: "10.0.0.0/8", Addr: netip.MustParseAddr("10.0.1.1"), Ports: []int{DecoyTCP}},
			{Range: "169.254.0.0/16", Addr: netip.MustParseAddr("169.254.169.254"), Ports: []int{DecoyTCP, DecoyHTTP}},
			{Range: "100.64.0.0/10", Addr: netip.MustParseAddr("100.64.0.1"), Ports: []int{DecoyTCP}},
			{Range: OtherNetRange, Addr: netip.MustParseAddr("198.18.0.20"), Ports: []int{DecoyTCP}},
			{Range: UplinkSubnetRange, Addr: netip.MustParseAddr("198.18.0.250"), Ports: []int{DecoyTCP}},
			{Range: "public", Addr: netip.MustParseAddr("198.18.0.10"), Ports: []int{DecoyTCP}},
		},
		Public: netip.MustParseAddr("198.18.0.10"), PublicName: "public.x.claudebox-drill.test",
		DecoyHostSide: netip.MustParseAddr("198.18.0.253"),
		Exposure:      netip.MustParseAddrPort("127.0.0.1:45123"), ExposedBox: "a",
		Nested: netip.MustParsePrefix("198.18.0.40/30"),
		Peers: []Endpoint{{Key: "member-m2", Label: "member m2 198.19.7.12", Addr: netip.MustParseAddr("198.19.7.12"), Port: 8443},
			{Key: "member-m3", Label: "member m3 198.19.7.13", Addr: netip.MustParseAddr("198.19.7.13"), Port: 8443}},
		Foreign: netip.MustParseAddr("10.87.0.254"), ForeignMAC: "02:00:00:00:00:fe",
	}
}

func plan(t *testing.T) []Case {
	t.Helper()
	cases, err := Plan(Claims, testTopology(), time.Second)
	if err != nil {
		t.Fatal(err)
	}
	return cases
}

func byRow(cases []Case) map[string][]Case {
	m := map[string][]Case{}
	for _, c := range cases {
		m[c.Row] = append(m[c.Row], c)
	}
	return m
}

// Every claim row plans cases on a full topology, with its expected number of cases.
func TestEveryRowPlans(t *testing.T) {
	want := map[string]int{
		"ctl/self-tcp": 3, "ctl/self-udp": 3, "ctl/self-tcp6ll": 2, "ctl/arp-gateway": 3, "ctl/lease": 3,
		"ctl/host-tcp": 2, "ctl/host-udp": 2, "ctl/decoy-tcp": 7, "ctl/decoy-udp": 6, "ctl/decoy-icmp": 6,
		"uplink-net/tcp": 3, "uplink-net/udp": 3, "uplink-net/icmp": 3,
		"other-net/tcp": 3, "other-net/udp": 3, "other-net/icmp": 3,
		"ctl/reapply": 1, "ctl/window-public": 3, "ctl/window-decoy": 1, "window/decoys": 3, "window/host": 3,
		"window/box": 6, "window/host-box": 3, "window/decoy-box": 3, "window/conntrack-out": 1, "window/conntrack-in": 1,
		"spoof/sibling-ip": 6, "spoof/any-ip": 3, "spoof/arp": 6, "spoof/mac": 6,
		"ctl/dhcp-renew": 3, "dhcp/fake-mac": 3, "dhcp/fake-chaddr": 3, "dhcp/release": 6, "dhcp/release-intact": 6,
		"frames/vlan0-ipv4": 6, "frames/vlan0-ipv6": 6, "frames/vlan0-dhcp-offer": 6, "frames/vlan0-ra": 6,
		"frames/ethertype": 6, "frames/arp-zero": 6, "box-host/ll0e": 6, "box-host/ll03-gw": 3, "box-host/ll03": 3, "spoof/ll-reflect": 6, "resolver/servers.bind": 3, "resolver/version.bind": 3,
		"internet/tcp": 3, "internet/dns": 3,
		"box-box/tcp": 6, "box-box/udp": 6, "box-box/icmp": 6, "box-box-l2/arp": 6, "box-box-l2/tcp6ll": 4,
		"box-box-name/dns-instance": 6, "box-box-name/dns-hostname": 6, "box-box-name/dns-hostname-fqdn": 6, "box-box-name/dns-ptr": 6,
		"host-names/dns": 6, "host-names/dns-tcp": 6, "box-box-name/dns-instance-tcp": 6, "resolver/servers.bind/tcp": 3,
		"ctl/cache-prime": 1, "resolver/cache": 1, "box-box-name/dns-exists": 6,
		"box-host/gateway-tcp": 3, "box-host/gateway-udp": 3, "box-host/addr-tcp": 3, "box-host/addr-udp": 3,
		"lan/tcp": 3, "lan/udp": 3, "lan/icmp": 3, "cgnat/tcp": 9, "cgnat/udp": 6, "cgnat/icmp": 6,
		"ipv6/facts": 3, "host-box/tcp": 3, "host-box/udp": 3,
		"ctl/soak": 1, "ctl/soak-public": 3, "soak/decoys": 3, "soak/host": 3, "soak/conntrack-out": 1,
		"dhcp/relay": 6, "frames/unknown-unicast": 3,
		"ctl/restarted": 1, "restart/sibling-ip": 2, "restart/release": 2, "restart/release-intact": 2,
		"ctl/exposed": 1, "exposure/host-addr": 2, "exposure/lan": 1, "exposure/box-gateway": 3, "exposure/box-host": 3,
		"ctl/stat-proc": 3, "res/guest-api": 3, "res/subvolume": 1,
		"res/limits": 4, "ctl/res-spawn": 1, "ctl/res-host-spawn": 1, "res/fork-bomb": 1,
		"ctl/res-alloc": 1, "ctl/res-host-alloc": 1, "res/mem-hog": 1, "ctl/res-write": 1, "res/disk-fill": 1,
		"nested/internet/tcp": 1, "nested/internet/dns": 1, "nested/box-box/tcp": 2, "nested/box-box/udp": 2, "nested/box-box/icmp": 2,
		"nested/box-box-name/dns-instance": 2, "nested/box-box-name/dns-ptr": 2, "nested/host-names/dns": 2,
		"nested/box-host/gateway-tcp": 1, "nested/box-host/gateway-udp": 1, "nested/box-host/addr-tcp": 1, "nested/box-host/addr-udp": 1,
		"nested/lan/tcp": 1, "nested/lan/udp": 1, "nested/lan/icmp": 1, "nested/cgnat/tcp": 3, "nested/cgnat/udp": 2, "nested/cgnat/icmp": 2,
		"nested/other-net/tcp": 1, "nested/other-net/udp": 1, "nested/uplink-net/tcp": 1, "nested/uplink-net/udp": 1, "nested/resolver/servers.bind": 1,
		"cluster/tcp": 6, "cluster/icmp": 6, "ctl/peer-tcp": 2, "nat/udp": 3, "nat/invalid": 3, "nat/ip-options": 3, "nat/related-error": 3, "ctl/decoy-host-tcp": 1, "lan-gateway/tcp": 1, "window/nat": 3,
		"res/latency-before": 1, "res/host-latency-before": 1, "res/latency-after": 1, "res/host-latency-after": 1, "res/cpu-burn": 1, "res/latency-during": 1, "res/host-latency-during": 1,
		"member-box/tcp": 3, "member-box/udp": 3, "member-box-in/tcp": 3, "member-box-in/udp": 3, "ctl/foreign-tcp": 1, "ctl/foreign-udp": 1,
		"member-box-frames/vlan0-ipv4": 3, "member-box-frames/vlan0-ipv6": 3, "member-box-frames/vlan0-dhcp-offer": 3, "member-box-frames/vlan0-ra": 3,
		"member-box-frames/ethertype": 3, "member-box-frames/arp-zero": 3,
		"member-host/arp": 1, "member-host/dns": 1, "member-host/dhcp": 1,
		"member-box-frames-in/vlan0-ipv4": 3, "member-box-frames-in/vlan0-ipv6": 3, "member-box-frames-in/ethertype": 3, "member-box-frames-in/arp-zero": 3,
	}
	got := byRow(plan(t))
	for _, r := range Claims {
		if _, ok := want[r.Key]; !ok {
			t.Errorf("row %s has no expected case count in this test: add it", r.Key)
		}
	}
	for k, n := range want {
		if len(got[k]) != n {
			t.Errorf("row %s: %d cases, want %d", k, len(got[k]), n)
		}
	}
}

// Without --soak the soak rows plan nothing (and the seeded holes' matrices never soak).
func TestSoakRowsOnlyWhenSoaking(t *testing.T) {
	top := testTopology()
	top.Soak = 0
	cases, err := Plan(Claims, top, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range cases {
		if c.Window == WindowSoak || c.Window == WindowRestart {
			t.Errorf("%s planned without --soak", c.ID)
		}
	}
	for _, c := range plan(t) {
		if c.Window == WindowSoak && c.Probe.Flood != nil && c.Probe.Flood.Duration.D() < time.Minute {
			t.Errorf("%s: a soak flood of %s cannot outlast the soak", c.ID, c.Probe.Flood.Duration.D())
		}
	}
}

// Every negative row names its layers and its controls; positives have neither layers nor
// a negative expectation; every control is a positive row.
func TestEveryRowIsComplete(t *testing.T) {
	keys := map[string]ClaimRow{}
	for _, r := range Claims {
		keys[r.Key] = r
	}
	for _, r := range Claims {
		if r.Claim == "" || r.Kind == "" || r.ID == "" || r.Probe == nil || r.From.pick == nil || r.To.pick == nil {
			t.Errorf("row %s is missing a field", r.Key)
		}
		if !slices.Contains(ClaimOrder, r.Claim) {
			t.Errorf("row %s: claim %q is not in ClaimOrder (the report would not print it)", r.Key, r.Claim)
		}
		if r.Expect.Negative() != (len(r.Holds) > 0) {
			t.Errorf("row %s: expect %s with holds %s: negatives need layers, positives have none", r.Key, r.Expect, r.Holds)
		}
		if r.Expect.Negative() && len(r.Controls) == 0 {
			t.Errorf("row %s: a negative verdict needs a positive control", r.Key)
		}
		for _, c := range r.Controls {
			if keys[c.Row].Expect.Negative() {
				t.Errorf("row %s: control %s is itself a negative", r.Key, c.Row)
			}
		}
		for _, term := range r.Holds {
			for _, l := range term {
				if !slices.Contains(AllLayers, l) {
					t.Errorf("row %s: layer %q has no seeded hole (AllLayers)", r.Key, l)
				}
			}
		}
	}
}

// The case IDs the report and the record use are stable.
func TestCaseIDs(t *testing.T) {
	ids := map[string]Case{}
	for _, c := range plan(t) {
		ids[c.ID] = c
	}
	for id, want := range map[string]string{
		"ctl/a/self-tcp":                     "a",
		"ctl/a/arp-gateway":                  "gateway",
		"internet/a/tcp":                     "public decoy 198.18.0.10",
		"internet/a/dns":                     "gateway DNS: public.x.claudebox-drill.test",
		"box-box/a>b/tcp":                    "b",
		"box-box-l2/a>b/tcp6ll":              "b",
		"box-box-name/a>b/dns-hostname-fqdn": "b",
		"host-names/a/host1":                 "host name host1",
		"box-host/a>10.87.0.1/tcp":           "gateway 10.87.0.1",
		"box-host/a>192.0.2.5/udp":           "host 192.0.2.5",
		"decoy/a>169.254.169.254/tcp80":      "decoy 169.254.169.254",
		"decoy/a>10.0.1.1/icmp":              "decoy 10.0.1.1",
		"ipv6/a":                             "a",
		"host-box/host>c/udp":                "c",
		"ctl/host>192.0.2.5/tcp":             "host 192.0.2.5",
		"ctl/host>198.18.0.10/tcp7001":       "decoy 198.18.0.10",
	} {
		if c, ok := ids[id]; !ok || c.To != want {
			t.Errorf("case %s: to %q (planned %v), want %q", id, c.To, ok, want)
		}
	}
	if _, ok := ids["box-box-l2/a>c/tcp6ll"]; ok {
		t.Error("a box without a link-local address got a tcp6ll case")
	}
	c := ids["box-box/a>b/tcp"]
	if !slices.Equal(c.Controls, []string{"ctl/b/self-tcp", "internet/a/tcp"}) {
		t.Errorf("box-box/a>b/tcp controls = %v", c.Controls)
	}
	if c := ids["decoy/a>169.254.169.254/tcp80"]; !slices.Equal(c.Controls, []string{"ctl/host>169.254.169.254/tcp80"}) || c.Probe.Port != 80 {
		t.Errorf("metadata case = %+v", c)
	}
	if c := ids["box-box-name/a>b/dns-hostname-fqdn"]; c.Probe.DNS.Name != "b.incus" || c.Probe.DNS.Server != "10.87.0.1" {
		t.Errorf("fqdn probe = %+v", c.Probe.DNS)
	}
	if c := ids["box-host/a>10.87.0.1/tcp"]; c.Kind != "gateway" || c.Layers != "host-input-guard | acl | wall" {
		t.Errorf("gateway case: kind %s layers %s", c.Kind, c.Layers)
	}
	if c := ids["box-host/a>192.0.2.5/tcp"]; c.Kind != "host-addr" || c.Layers != "host-input-guard | wall | l2-ranges" {
		t.Errorf("host-addr case: kind %s layers %s", c.Kind, c.Layers)
	}
	w := ids["window/a>decoys"]
	if w.Probe.Flood == nil || len(w.Probe.Flood.UDP) != 5 || len(w.Probe.Flood.TCP) != 6 || !strings.HasPrefix(w.Probe.Payload, probes.MarkerPrefix) {
		t.Errorf("window flood to the blocked decoys = %+v %+v", w.Probe, w.Probe.Flood)
	}
	if w.Window != WindowReapply || !slices.Equal(w.Controls, []string{"ctl/a/window-public", "ctl/reapply"}) {
		t.Errorf("window case: window %q controls %v", w.Window, w.Controls)
	}
	if c := ids["window/decoy>b"]; !slices.Contains(c.Controls, "ctl/decoy>host/window") || c.From != "decoy" {
		t.Errorf("decoy→box window case = %+v", c)
	}
	if c.Probe.Timeout != time.Second {
		t.Errorf("timeout not defaulted: %v", c.Probe.Timeout)
	}
}

// Every nested row that expects a block has the nested container's own positive control: a
// container whose network is broken drops everything (measured: the decoy rows passed with
// the container unable to reach its gateway, their host-side controls green).
func TestNestedRowsHaveTheirOwnControl(t *testing.T) {
	for _, c := range plan(t) {
		if _, nested := nestedBox(c.From); !nested || !c.Expected.Negative() {
			continue
		}
		own := false
		for _, ctl := range c.Controls {
			own = own || strings.HasPrefix(ctl, "internet/") && strings.Contains(ctl, NestedSuffix)
		}
		if !own {
			t.Errorf("%s: controls %v lack the nested container's own", c.ID, c.Controls)
		}
	}
}

// A typo'd control or a duplicate row is refused, never silently unchecked.
func TestPlanRefusesBrokenTables(t *testing.T) {
	bad := slices.Clone(Claims)
	bad[len(bad)-1].Controls = []Control{{"ctl/self-tpc", EndTarget, EndTarget}}
	if _, err := Plan(bad, testTopology(), 0); err == nil || !strings.Contains(err.Error(), "ctl/self-tpc") {
		t.Errorf("typo'd control: %v", err)
	}
	if _, err := Plan(append(slices.Clone(Claims), Claims[0]), testTopology(), 0); err == nil {
		t.Error("a duplicate row was accepted")
	}
	unplanned := slices.Clone(Claims)
	for i := range unplanned {
		if unplanned[i].Key == "ctl/self-tcp6ll" {
			unplanned[i].To = ToSelf // would plan for c too; then drop a's control case:
			unplanned[i].From = Selector{"only c", func(t *Topology, _ Endpoint) []Endpoint { return boxEnds(t.Boxes[2:], nil) }}
		}
	}
	if _, err := Plan(unplanned, testTopology(), 0); err == nil || !strings.Contains(err.Error(), "is not planned") {
		t.Errorf("a control case nobody planned: %v", err)
	}
}

func TestJudge(t *testing.T) {
	row := func(id string, exp, obs Outcome, ctl ...string) *Row {
		return &Row{Case: Case{ID: id, Expected: exp, Controls: ctl}, Observed: obs}
	}
	ctl, badCtl := row("c", Open, Open), row("bc", Open, Dropped)
	neg, negBadCtl := row("n", Dropped, Dropped, "c"), row("n2", Dropped, Dropped, "bc")
	hole, refused := row("h", Dropped, Open, "bc"), row("r", Dropped, Refused, "c")
	silent, dnsDropped := row("d", NoAnswer, Silence, "c"), row("dd", NoAnswer, Dropped, "c")
	silentBadCtl := row("dbc", NoAnswer, Silence, "bc")
	answered := row("a", NoAnswer, Answer, "c")
	cf, ghost := row("x", Dropped, CheckFailed, "c"), row("g", Dropped, Dropped, "nosuch")
	v6, v6ok := row("6", None, HasIPv6, "c"), row("6ok", None, None, "c")
	lease := row("l", Lease, NoLease)
	rows := []*Row{ctl, badCtl, neg, negBadCtl, hole, refused, silent, silentBadCtl, dnsDropped, answered, cf, ghost, v6, v6ok, lease}
	Judge(rows)
	for _, c := range []struct {
		r    *Row
		want Verdict
	}{{ctl, Pass}, {badCtl, Fail}, {neg, Pass}, {negBadCtl, NoCheck}, {hole, Fail}, {refused, Fail}, {silent, Pass}, {silentBadCtl, NoCheck},
		{dnsDropped, NoCheck}, {answered, Fail}, {cf, NoCheck}, {ghost, NoCheck}, {v6, Fail}, {v6ok, Pass}, {lease, Fail}} {
		if c.r.Verdict != c.want {
			t.Errorf("%s: verdict %s, want %s (%s)", c.r.ID, c.r.Verdict, c.want, c.r.Why)
		}
	}
}

// Observe maps every probe kind's results into the one vocabulary.
func TestObserve(t *testing.T) {
	dns := Case{Probe: probes.Spec{Kind: probes.KindDNS}, Expected: NoAnswer}
	facts := Case{Probe: probes.Spec{Kind: probes.KindFacts}, Expected: None}
	lease := Case{Probe: probes.Spec{Kind: probes.KindFacts}, Expected: Lease}
	host := Case{From: "host", Probe: probes.Spec{Kind: probes.KindUDP}, Expected: Dropped}
	box := Case{From: "a", Probe: probes.Spec{Kind: probes.KindUDP}, Expected: Dropped}
	eperm := probes.Result{Outcome: probes.CheckFailed, Evidence: "write: operation not permitted"}
	for i, c := range []struct {
		c    Case
		r    probes.Result
		want Outcome
	}{
		{dns, probes.Result{Outcome: probes.Open}, Answer},
		{dns, probes.Result{Outcome: probes.Refused, DNS: &probes.DNSAnswer{Answered: true, Rcode: "NXDOMAIN"}}, NoAnswer},
		{dns, probes.Result{Outcome: probes.Refused}, Refused},
		{dns, probes.Result{Outcome: probes.Dropped}, Silence},
		{dns, probes.Result{Outcome: probes.CheckFailed}, CheckFailed},
		{facts, probes.Result{Outcome: probes.Open, Facts: &probes.Facts{HasGlobalIPv6: true}}, HasIPv6},
		{facts, probes.Result{Outcome: probes.Open, Facts: &probes.Facts{}}, None},
		{facts, probes.Result{Outcome: probes.CheckFailed}, CheckFailed},
		{lease, probes.Result{Outcome: probes.Open, Facts: &probes.Facts{IPv4: []string{"10.87.0.10/24"}}}, Lease},
		{lease, probes.Result{Outcome: probes.Open, Facts: &probes.Facts{}}, NoLease},
		{host, eperm, Dropped},
		{box, eperm, CheckFailed},
		{box, probes.Result{Outcome: probes.Refused}, Refused},
	} {
		if got := Observe(c.c, c.r); got != c.want {
			t.Errorf("%d: observe = %s, want %s", i, got, c.want)
		}
	}
}

// The truth table is complete only when every planned case was observed once and judged.
func TestComplete(t *testing.T) {
	cases := plan(t)
	rows := RowsOf(cases)
	if err := Complete(cases, rows); err == nil {
		t.Fatal("unjudged rows passed the completeness check")
	}
	for _, r := range rows {
		r.Observed = r.Expected
	}
	Judge(rows)
	if err := Complete(cases, rows); err != nil {
		t.Fatal(err)
	}
	for _, r := range rows {
		if r.Verdict != Pass {
			t.Fatalf("%s observed as expected but judged %s: %s", r.ID, r.Verdict, r.Why)
		}
	}
	if err := Complete(cases, rows[1:]); err == nil || !strings.Contains(err.Error(), rows[0].ID) {
		t.Fatalf("a missing observation: %v", err)
	}
}

// The rows one layer alone holds: every other row names at least two layers, so switching
// any single layer off leaves it green. docs/drill.md says why each of these cannot be doubled.
var singleLayerRows = map[string]Layer{
	// A shared cache tells one box what another asked; only turning it off stops that.
	"resolver/cache": LayerNoCache,
	// Whether a name exists: only the dnsmasq options hide it (both needed: conjunctive).
	"box-box-name/dns-exists": "",
	// A box's limits are one kernel mechanism each (docs/drill.md: no second layer).
	"res/fork-bomb": LayerBoxPids, "res/mem-hog": LayerBoxMemory, "res/disk-fill": LayerBoxDisk, "res/cpu-burn": LayerBoxCPU,
	"res/subvolume": LayerBoxSubvolDeny,
	// The guest API is one Incus key; nothing else can keep a unix socket out of a box.
	"res/guest-api": LayerGuestAPIOff,
}

// A single layer off opens only the rows listed above; every negative row opens in at least
// one seeded hole of the self-test (the drill can show every claim failing).
func TestHoles(t *testing.T) {
	rows := RowsOf(plan(t))
	for _, l := range AllLayers {
		for _, id := range ExpectedRed(rows, []Layer{l}) {
			var r *Row
			for _, x := range rows {
				if x.ID == id {
					r = x
				}
			}
			want, listed := singleLayerRows[r.Row]
			if !listed || (want != "" && want != l) {
				t.Errorf("%s alone opens %s (holds %s): a claim held by one layer", l, id, r.Layers)
			}
		}
	}
	for _, r := range rows {
		if !r.Expected.Negative() {
			continue
		}
		opened := false
		for _, h := range Holes {
			opened = opened || r.Holds.OpenWithout(h.Off)
		}
		if !opened {
			t.Errorf("no seeded hole opens %s (holds %s): nothing shows it can fail", r.ID, r.Layers)
		}
	}
	if got := ExpectedRed(rows, []Layer{LayerPortIso, LayerNFTBridge, LayerBRNF}); len(got) == 0 {
		t.Error("the three box→box layers off open nothing")
	}
}

// A hole is as attributed only when exactly the rows its layers hold alone turn red.
func TestHoleAttribution(t *testing.T) {
	rows := RowsOf(plan(t))
	judge := func(off []Layer, red func(*Row) bool) *HoleResult {
		for _, r := range rows {
			r.Verdict = Pass
			if red(r) {
				r.Verdict = Fail
			}
		}
		hr := &HoleResult{Off: off, Restored: true}
		hr.attribute(rows)
		return hr
	}
	acl := []Layer{LayerACL, LayerWall, LayerL2Ranges}
	exact := func(r *Row) bool { return r.Expected.Negative() && r.Holds.OpenWithout(acl) }
	if hr := judge(acl, exact); !hr.OK || len(hr.ObservedRed) == 0 {
		t.Errorf("exactly the attributed rows red: %+v", hr)
	}
	if hr := judge(acl, func(r *Row) bool { return exact(r) && r.Claim != ClaimCGNAT }); hr.OK || len(hr.Missing) == 0 {
		t.Error("a row expected red that held must make the hole not as attributed")
	}
	if hr := judge(acl, func(r *Row) bool { return exact(r) || r.Claim == ClaimBoxBox }); hr.OK || len(hr.Unexpected) == 0 {
		t.Error("a red row the layers do not hold alone must make the hole not as attributed")
	}
	noHosts := []Layer{LayerNoHosts, LayerLocalAnswers}
	hostNames := func(r *Row) bool { return strings.HasPrefix(strings.TrimPrefix(r.Row, "nested/"), "host-names/") }
	if hr := judge(noHosts, hostNames); !hr.OK {
		t.Errorf("no-hosts and local answers off open exactly the host-name rows: missing %v, unexpected %v", hr.Missing, hr.Unexpected)
	}
	if hr := judge(noHosts[:1], hostNames); hr.OK {
		t.Error("no-hosts alone must not open the host-name rows (the local-answers part holds them too)")
	}
	if hr := judge([]Layer{LayerWall}, func(r *Row) bool { return r.Row == "window/conntrack-in" }); hr.OK {
		t.Error("the wall alone must not open window/conntrack-in (the guard holds it too)")
	}
}

// TestRunnerKilled: only a probe run its box SIGKILLed (exit 137, the memory stress's
// second OOM kill) makes a stress step run again; another exit or a verdict never does.
func TestRunnerKilled(t *testing.T) {
	for _, c := range []struct {
		outcome  probes.Outcome
		evidence string
		want     bool
	}{
		{probes.CheckFailed, "cbdrill-x-r: probe run exited 137: ", true},
		{probes.CheckFailed, "cbdrill-x-r: probe run exited 1: bad spec", false},
		{probes.CheckFailed, "cbdrill-x-r: probe run exited 1370: ", false},
		{probes.Refused, "cbdrill-x-r: probe run exited 137: ", false},
		{probes.Open, "", false},
	} {
		r := &Row{Result: probes.Result{Outcome: c.outcome, Evidence: c.evidence}}
		if got := runnerKilled(r); got != c.want {
			t.Errorf("runnerKilled(%s, %q) = %v, want %v", c.outcome, c.evidence, got, c.want)
		}
	}
}

// natSeen judges by the source the public decoy heard with the row's marker: the box
// subnet is a hole, another address is NATed, nothing heard establishes nothing. Judge
// counts NATed only with its control.
func TestNATSeen(t *testing.T) {
	since := time.Now()
	boxNet := netip.MustParsePrefix("10.87.0.0/24")
	row := func(id, marker string, ctl ...string) *Row {
		return &Row{Case: Case{ID: id, Expected: NATed, Controls: ctl, Probe: probes.Spec{Kind: probes.KindUDP, Payload: marker}}, Observed: Open}
	}
	ctl := &Row{Case: Case{ID: "c", Expected: Open}, Observed: Open}
	natted, unnatted, unheard, old := row("n", "m-1", "c"), row("u", "m-2", "c"), row("x", "m-3", "c"), row("o", "m-4", "c")
	frameNATed, frameUnNATed := row("fn", "m-5", "c"), row("fu", "m-6", "c")
	hits := []probes.Hit{
		{Time: since.Add(time.Millisecond), Proto: "udp", Peer: "198.18.0.249:40001", Payload: "m-1"},
		{Time: since.Add(time.Millisecond), Proto: "udp", Peer: "198.18.0.249:40002", Payload: "m-2"},
		{Time: since.Add(time.Millisecond), Proto: "udp", Peer: "10.87.0.23:40003", Payload: "m-2"},
		{Time: since.Add(-time.Second), Proto: "udp", Peer: "10.87.0.23:40004", Payload: "m-4"}, // an earlier matrix's
		// What the decoy's capture heard (a packet no socket accepts): "MAC IP".
		{Time: since.Add(time.Millisecond), Proto: "frame", Peer: "0a:1b:2c:3d:4e:5f 198.18.0.249", Payload: "m-5"},
		{Time: since.Add(time.Millisecond), Proto: "frame", Peer: "0a:1b:2c:3d:4e:5f 10.87.0.23", Payload: "m-6"},
	}
	rows := []*Row{ctl, natted, unnatted, unheard, old, frameNATed, frameUnNATed}
	natSeen(rows, hits, boxNet, since)
	heard(rows, map[string][]probes.Hit{"decoy": hits}, since)
	Judge(rows)
	for _, c := range []struct {
		r        *Row
		observed Outcome
		verdict  Verdict
	}{{natted, NATed, Pass}, {unnatted, UnNATed, Fail}, {unheard, CheckFailed, NoCheck}, {old, CheckFailed, NoCheck},
		{frameNATed, NATed, Pass}, {frameUnNATed, UnNATed, Fail}} {
		if c.r.Observed != c.observed || c.r.Verdict != c.verdict {
			t.Errorf("%s: observed %s verdict %s, want %s %s (%s)", c.r.ID, c.r.Observed, c.r.Verdict, c.observed, c.verdict, c.r.Why)
		}
	}
	bad := row("b", "m-1", "nosuch")
	natSeen([]*Row{bad}, hits, boxNet, since)
	Judge([]*Row{bad})
	if bad.Verdict != NoCheck {
		t.Errorf("NATed without a passing control: %s, want check-failed", bad.Verdict)
	}
}
