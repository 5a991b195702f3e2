package drill

import (
	"net/netip"
	"strings"
	"testing"

	"github.com/claudebox/claudebox/drill/probes"
)

func TestHoldsOpenWithout(t *testing.T) {
	bb := HoldsFor(ClaimBoxBox, "tcp")
	for _, l := range []Layer{LayerPortIso, LayerNFTBridge, LayerBRNF} {
		if bb.OpenWithout([]Layer{l}) {
			t.Errorf("box→box opens without %s alone; want it held by the others", l)
		}
	}
	if !bb.OpenWithout([]Layer{LayerPortIso, LayerNFTBridge, LayerBRNF}) {
		t.Error("box→box must open with all three layers off")
	}
	name := HoldsFor(ClaimBoxBoxName, "dns-instance")
	if !name.OpenWithout([]Layer{LayerIgnoreNames}) || !name.OpenWithout([]Layer{LayerDNSModeNone}) {
		t.Error("the instance-name row needs both dns.mode=none and dhcp-ignore-names")
	}
	if HoldsFor(ClaimInternet, "tcp").OpenWithout(AllLayers) {
		t.Error("a positive claim has no layers to open")
	}
}

func TestEveryRowKindHasAttribution(t *testing.T) {
	for _, c := range []struct{ claim, kind string }{
		{ClaimBoxBox, "udp"}, {ClaimBoxBoxL2, "arp"}, {ClaimBoxBoxL2, "tcp6ll"}, {ClaimBoxBoxName, "dns-ptr"},
		{ClaimHostNames, "dns"}, {ClaimBoxHost, "gateway"}, {ClaimBoxHost, "host-addr"}, {ClaimLAN, "icmp"},
		{ClaimCGNAT, "tcp"}, {ClaimIPv6, "facts"}, {ClaimHostBox, "tcp"},
	} {
		if len(HoldsFor(c.claim, c.kind)) == 0 {
			t.Errorf("%s/%s has no layers", c.claim, c.kind)
		}
	}
}

func TestPickEdgesSkipsClaims(t *testing.T) {
	a := avoid{nets: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/24"), netip.MustParsePrefix("10.255.255.0/24")}}
	got, err := pickEdges("10.0.0.0/8", a)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 || got[0] != netip.MustParseAddr("10.0.1.1") || got[1] != netip.MustParseAddr("10.255.254.254") {
		t.Fatalf("edges = %v", got)
	}
	if _, err := pickEdges("192.168.0.0/16", avoid{nets: []netip.Prefix{netip.MustParsePrefix("192.168.0.0/16")}}); err == nil {
		t.Fatal("a fully routed range must be refused")
	}
}

func TestForwarderLine(t *testing.T) {
	l := ForwarderLine("incus", netip.MustParsePrefix("10.87.1.1/24"), netip.MustParseAddr("198.18.0.10"))
	if l != "server=/claudebox-drill.test/incus//1.87.10.in-addr.arpa/198.18.0.10" {
		t.Fatalf("line = %q", l)
	}
	if !IsForwarderLine(l) || IsForwarderLine("server=10.255.255.53") {
		t.Fatal("IsForwarderLine")
	}
	got := stripForwarder("no-hosts\n" + l + "\nserver=1.1.1.1")
	if strings.Join(got, ",") != "no-hosts,server=1.1.1.1" {
		t.Fatalf("strip = %v", got)
	}
}

func TestJudge(t *testing.T) {
	ctl := &Row{ID: "c", Expected: ExpectOpen, Observed: "open"}
	badCtl := &Row{ID: "bc", Expected: ExpectOpen, Observed: "dropped"}
	neg := &Row{ID: "n", Expected: ExpectDropped, Observed: "dropped", Controls: []string{"c"}}
	negBadCtl := &Row{ID: "n2", Expected: ExpectDropped, Observed: "dropped", Controls: []string{"bc"}}
	hole := &Row{ID: "h", Expected: ExpectDropped, Observed: "open", Controls: []string{"bc"}}
	silent := &Row{ID: "d", Expected: ExpectNoAnswer, Observed: "silence", Controls: []string{"c"}}
	cf := &Row{ID: "x", Expected: ExpectDropped, Observed: "check-failed", Controls: []string{"c"}}
	judge([]*Row{ctl, badCtl, neg, negBadCtl, hole, silent, cf})
	for _, c := range []struct {
		r    *Row
		want Verdict
	}{{ctl, Pass}, {badCtl, Fail}, {neg, Pass}, {negBadCtl, CheckFailed}, {hole, Fail}, {silent, CheckFailed}, {cf, CheckFailed}} {
		if c.r.Verdict != c.want {
			t.Errorf("%s: verdict %s, want %s (%s)", c.r.ID, c.r.Verdict, c.want, c.r.Why)
		}
	}
}

func TestObserveDNSNeedsAnAnswer(t *testing.T) {
	r := &Row{Probe: probes.Spec{Kind: probes.KindDNS}, Expected: ExpectNoAnswer,
		Result: probes.Result{Outcome: probes.Refused, DNS: &probes.DNSAnswer{Answered: true, Rcode: "NXDOMAIN"}}}
	if observe(r) != "no-answer" {
		t.Fatal(observe(r))
	}
	r.Result = probes.Result{Outcome: probes.Dropped}
	if observe(r) != "silence" {
		t.Fatal(observe(r))
	}
	h := &Row{From: "host", Probe: probes.Spec{Kind: probes.KindUDP}, Result: probes.Result{Outcome: probes.CheckFailed, Evidence: "write: operation not permitted"}}
	if observe(h) != "dropped" {
		t.Fatal(observe(h))
	}
}

func TestVMAgentCommands(t *testing.T) {
	cmds := VMAgentCommands()
	if len(cmds) != 1 || !strings.Contains(cmds[0][2], VMAgent+" probe serve") || !strings.HasSuffix(cmds[0][2], "&") {
		t.Fatalf("VM agent commands = %v", cmds)
	}
}

func TestBoxNames(t *testing.T) {
	if BoxName("abc123", 0, 1) != "cbdrill-abc123-b" || BoxName("abc123", 1, 0) != "cbdrill-abc123-2a" {
		t.Fatal(BoxName("abc123", 0, 1), BoxName("abc123", 1, 0))
	}
	if JSONLPath("/x/RUNS.md") != "/x/RUNS.jsonl" {
		t.Fatal(JSONLPath("/x/RUNS.md"))
	}
}
