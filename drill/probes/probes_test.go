package probes

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"
)

type row struct {
	name    string
	spec    Spec
	want    Outcome
	check   func(t *testing.T, r Result) // optional extra assertions
	wantSub string                       // substring of Answer+Evidence
}

const quick = 500 * time.Millisecond

// slow covers ARP/ND failure (about 0.3 s with the test's retrans time) plus margin.
const slow = 1500 * time.Millisecond

func rows() []row {
	tcp := func(target string, port int) Spec {
		return Spec{Kind: KindTCP, Target: target, Port: port, Timeout: quick}
	}
	udp := func(target string, port int) Spec {
		return Spec{Kind: KindUDP, Target: target, Port: port, Timeout: quick}
	}
	icmp := func(target string) Spec { return Spec{Kind: KindICMP, Target: target, Timeout: quick} }
	ll := func(target string, port int) Spec {
		return Spec{Kind: KindTCP6LL, Target: target, Port: port, Iface: "vc0", Timeout: quick}
	}
	q := func(server, name, typ string) Spec {
		return Spec{Kind: KindDNS, DNS: &DNSQuery{Server: server, Name: name, Type: typ}, Timeout: quick}
	}
	chaos := func(server, name string) Spec {
		return Spec{Kind: KindDNS, DNS: &DNSQuery{Server: server, Name: name, Type: "TXT", Class: "CH"}, Timeout: quick}
	}
	web := func(target string, port int) Spec {
		return Spec{Kind: KindHTTP, Target: target, Port: port, Timeout: quick}
	}
	withT := func(s Spec, d time.Duration) Spec { s.Timeout = d; return s }
	dnsRcode := func(rcode string, answered bool) func(*testing.T, Result) {
		return func(t *testing.T, r Result) {
			if r.DNS == nil || r.DNS.Answered != answered || r.DNS.Rcode != rcode {
				t.Errorf("dns answer = %+v, want answered=%v rcode=%q", r.DNS, answered, rcode)
			}
		}
	}
	return []row{
		{name: "tcp open", spec: tcp("198.18.0.2", 7001), want: Open, wantSub: "claudebox-probe cbprobe-client tcp 7001"},
		{name: "tcp refused by RST", spec: tcp("198.18.0.2", 7003), want: Refused, wantSub: "refused"},
		{name: "tcp refused by ICMP host-unreachable", spec: tcp("198.18.0.4", 7001), want: Refused, wantSub: "no route to host"},
		{name: "tcp dropped by firewall", spec: tcp("198.18.0.2", 7009), want: Dropped},
		{name: "tcp dropped: nobody answers ARP", spec: withT(tcp("198.18.0.99", 7001), slow), want: Dropped, wantSub: "no ARP/ND reply from next hop 198.18.0.99"},
		{name: "tcp check-failed: no such interface", spec: Spec{Kind: KindTCP, Target: "198.18.0.2", Port: 7001, Iface: "nosuch0", Timeout: quick}, want: CheckFailed},
		{name: "tcp check-failed: bad target", spec: tcp("not/an/ip", 7001), want: CheckFailed},

		{name: "udp open", spec: udp("198.18.0.2", 7002), want: Open, wantSub: "echo matched"},
		{name: "udp open on a second address (reply from the right source)", spec: udp("198.18.0.5", 7002), want: Open, wantSub: "198.18.0.5:7002"},
		{name: "udp open over IPv6 link-local", spec: udp("fe80::b%vc0", 7002), want: Open, wantSub: "echo matched"},
		{name: "udp refused by port unreachable", spec: udp("198.18.0.2", 7003), want: Refused},
		{name: "udp refused by ICMP host-unreachable", spec: udp("198.18.0.4", 7002), want: Refused},
		{name: "udp dropped", spec: udp("198.18.0.2", 7009), want: Dropped},
		{name: "udp check-failed: bad port", spec: udp("198.18.0.2", 0), want: CheckFailed},

		{name: "icmp open", spec: icmp("198.18.0.2"), want: Open, wantSub: "198.18.0.2"},
		{name: "icmp open over IPv6 link-local", spec: icmp("fe80::b%vc0"), want: Open},
		{name: "icmp refused by host-unreachable", spec: icmp("198.18.0.4"), want: Refused, wantSub: "198.18.0.4"},
		{name: "icmp dropped", spec: icmp("198.18.0.3"), want: Dropped},
		{name: "icmp dropped: nobody answers ARP", spec: withT(icmp("198.18.0.99"), slow), want: Dropped},
		{name: "icmp check-failed", spec: icmp("not/an/ip"), want: CheckFailed},

		{name: "arp open", spec: Spec{Kind: KindARP, Target: "198.18.0.2", Timeout: quick}, want: Open, check: func(t *testing.T, r Result) {
			if r.Answer != topo.vp0MAC {
				t.Errorf("MAC = %q, want %q", r.Answer, topo.vp0MAC)
			}
		}},
		{name: "arp dropped", spec: Spec{Kind: KindARP, Target: "198.18.0.98", Iface: "vc0", Timeout: quick}, want: Dropped},
		{name: "arp check-failed: no such interface", spec: Spec{Kind: KindARP, Target: "198.18.0.2", Iface: "nosuch0", Timeout: quick}, want: CheckFailed},
		{name: "arp check-failed: IPv6 target", spec: Spec{Kind: KindARP, Target: "fe80::b", Timeout: quick}, want: CheckFailed},

		{name: "tcp6ll open", spec: ll("fe80::b", 7001), want: Open, wantSub: "[fe80::b%vc0]:7001"},
		{name: "tcp6ll refused", spec: ll("fe80::b", 7003), want: Refused},
		{name: "tcp6ll dropped", spec: ll("fe80::b", 7009), want: Dropped},
		{name: "tcp6ll dropped: nobody answers ND", spec: withT(ll("fe80::99", 7001), slow), want: Dropped, wantSub: "no ARP/ND reply"},
		{name: "tcp6ll check-failed: no link-local address", spec: Spec{Kind: KindTCP6LL, Target: "fe80::b", Port: 7001, Iface: "dm0", Timeout: quick}, want: CheckFailed, wantSub: "no IPv6 link-local address on dm0"},
		{name: "tcp6ll check-failed: not link-local", spec: ll("198.18.0.2", 7001), want: CheckFailed},

		{name: "dns open", spec: q("198.18.0.2", "decoy.test", "A"), want: Open, wantSub: "decoy.test A 198.18.0.50", check: dnsRcode("NOERROR", true)},
		{name: "dns open PTR", spec: q("198.18.0.2", "198.18.0.50", "PTR"), want: Open, wantSub: "PTR decoy.test."},
		{name: "dns refused: NXDOMAIN", spec: q("198.18.0.2", "sibling", "A"), want: Refused, check: dnsRcode("NXDOMAIN", true)},
		{name: "dns refused: NOERROR empty", spec: q("198.18.0.2", "decoy.test", "AAAA"), want: Refused, check: dnsRcode("NOERROR", true)},
		{name: "dns refused: REFUSED", spec: q("198.18.0.2", "refuse.test", "A"), want: Refused, check: dnsRcode("REFUSED", true)},
		{name: "dns dropped: silence", spec: q("198.18.0.2:5353", "decoy.test", "A"), want: Dropped, check: dnsRcode("", false)},
		{name: "dns check-failed: port unreachable", spec: q("198.18.0.2:5354", "decoy.test", "A"), want: CheckFailed, wantSub: "port unreachable", check: dnsRcode("", false)},
		{name: "dns CHAOS open: version.bind answers", spec: chaos("198.18.0.2", "version.bind"), want: Open, wantSub: "cbtest-1.0", check: dnsRcode("NOERROR", true)},
		{name: "dns CHAOS answered without records: NOTIMP", spec: chaos("198.18.0.2", "servers.bind"), want: Refused, check: dnsRcode("NOTIMP", true)},
		{name: "dns CHAOS answered without records: REFUSED", spec: chaos("198.18.0.2", "hostname.bind"), want: Refused, check: dnsRcode("REFUSED", true)},
		{name: "dns CHAOS silence is not an answer", spec: chaos("198.18.0.2:5353", "servers.bind"), want: Dropped, check: dnsRcode("", false)},
		{name: "dns check-failed: CH needs TXT", spec: Spec{Kind: KindDNS, DNS: &DNSQuery{Server: "198.18.0.2", Name: "version.bind", Type: "A", Class: "CH"}, Timeout: quick}, want: CheckFailed},
		{name: "dns check-failed: bad server", spec: q("nameserver", "decoy.test", "A"), want: CheckFailed},

		{name: "http open", spec: web("198.18.0.2", 8080), want: Open, wantSub: "200 OK"},
		{name: "http open by URL", spec: Spec{Kind: KindHTTP, Target: "http://198.18.0.2:8080/x", Timeout: quick}, want: Open, wantSub: "decoy says hi"},
		{name: "http refused", spec: web("198.18.0.2", 7003), want: Refused},
		{name: "http dropped", spec: web("198.18.0.2", 7009), want: Dropped},
		{name: "http check-failed: bad URL", spec: Spec{Kind: KindHTTP, Target: "http://", Timeout: quick}, want: CheckFailed},

		{name: "facts", spec: Spec{Kind: KindFacts, Iface: "vc0"}, want: Open, wantSub: "198.18.0.1/24"},
		{name: "unknown kind", spec: Spec{Kind: "smoke"}, want: CheckFailed},
	}
}

// TestOutcomes proves every outcome of every probe kind against the peer
// namespace, in one RunMany batch: the whole matrix shares one window.
func TestOutcomes(t *testing.T) {
	rs := rows()
	specs := make([]Spec, len(rs))
	for i, r := range rs {
		specs[i] = r.spec
		specs[i].ID = r.name
	}
	start := time.Now()
	results := RunMany(context.Background(), specs)
	elapsed := time.Since(start)
	t.Logf("%d probes in %v", len(specs), elapsed)
	if elapsed > slow+time.Second {
		t.Errorf("batch took %v: probes did not share the timeout window", elapsed)
	}
	for i, r := range rs {
		res := results[i]
		t.Run(r.name, func(t *testing.T) {
			if res.Probe.ID != r.name {
				t.Fatalf("result %d belongs to %q", i, res.Probe.ID)
			}
			if res.Outcome != r.want {
				t.Errorf("outcome = %s, want %s (evidence %q, answer %q)", res.Outcome, r.want, res.Evidence, res.Answer)
			}
			if r.wantSub != "" && !strings.Contains(res.Answer+" | "+res.Evidence, r.wantSub) {
				t.Errorf("answer/evidence %q lacks %q", res.Answer+" | "+res.Evidence, r.wantSub)
			}
			if r.check != nil {
				r.check(t, res)
			}
			if res.Outcome == Dropped && res.Elapsed < res.Probe.Timeout/2 && !strings.Contains(res.Evidence, "ARP/ND") {
				t.Errorf("dropped after only %v of %v", res.Elapsed, res.Probe.Timeout)
			}
		})
	}
}

func TestListenersRecordHits(t *testing.T) {
	token := "hits-" + token()
	results := RunMany(context.Background(), []Spec{
		{Kind: KindTCP, Target: "198.18.0.2", Port: 7001, Timeout: quick},
		{Kind: KindUDP, Target: "198.18.0.5", Port: 7002, Payload: token, Timeout: quick},
		{Kind: KindTCP6LL, Target: "fe80::b", Port: 7001, Iface: "vc0", Timeout: quick},
	})
	for _, r := range results {
		if r.Outcome != Open {
			t.Fatalf("%s %s: %s (%s)", r.Probe.Kind, r.Probe.Target, r.Outcome, r.Evidence)
		}
	}
	want := map[string]func(Hit) bool{
		"tcp from 198.18.0.1": func(h Hit) bool {
			return h.Proto == "tcp" && strings.HasPrefix(h.Peer, "198.18.0.1:") && h.Local == "198.18.0.2:7001"
		},
		"udp token to .5": func(h Hit) bool {
			return h.Proto == "udp" && h.Payload == token && strings.HasPrefix(h.Peer, "198.18.0.1:") && h.Local == "198.18.0.5:7002"
		},
		// Zone names are resolved in whichever namespace the listener's
		// goroutine runs (here the client's), so only the address is checked.
		"tcp over link-local": func(h Hit) bool {
			return h.Proto == "tcp" && strings.HasPrefix(h.Peer, "[fe80::") && strings.HasPrefix(h.Local, "[fe80::b%") && h.Port == 7001
		},
	}
	check := func(src string, hs []Hit) {
		for name, ok := range want {
			found := false
			for _, h := range hs {
				found = found || ok(h)
			}
			if !found {
				t.Errorf("%s: no hit %q in %+v", src, name, hs)
			}
		}
	}
	check("Hits()", topo.peerLis.Hits())
	fromFile, err := ReadHits(topo.peerHits)
	if err != nil {
		t.Fatal(err)
	}
	check("hits file", fromFile)

	// The engine's view: `probe hits --file F` prints the same as JSON.
	var out, errb strings.Builder
	if code := Main([]string{"hits", "--file", topo.peerHits}, &out, &errb); code != 0 {
		t.Fatalf("probe hits: exit %d: %s", code, errb.String())
	}
	var viaMain []Hit
	if err := json.Unmarshal([]byte(out.String()), &viaMain); err != nil {
		t.Fatal(err)
	}
	check("probe hits", viaMain)
}

func TestFacts(t *testing.T) {
	f, err := GatherFacts("vc0")
	if err != nil {
		t.Fatal(err)
	}
	if f.Hostname != "cbprobe-client" {
		t.Errorf("hostname %q", f.Hostname)
	}
	if len(f.IPv4) != 1 || f.IPv4[0] != "198.18.0.1/24" {
		t.Errorf("ipv4 %v", f.IPv4)
	}
	scopes := map[string]string{}
	for _, a := range f.IPv6 {
		scopes[a.Addr] = a.Scope
	}
	if scopes["fe80::a/64"] != "link-local" || scopes["fd00:cb::1/64"] != "ula" {
		t.Errorf("ipv6 scopes %v", scopes)
	}
	if !f.HasGlobalIPv6 {
		t.Error("a ULA address must count as global IPv6")
	}
	if _, err := json.Marshal(f); err != nil {
		t.Fatal(err)
	}
}

func TestSpecJSON(t *testing.T) {
	in := Spec{ID: "x", Kind: KindDNS, Timeout: 1500 * time.Millisecond, DNS: &DNSQuery{Server: "198.18.0.2", Name: "a.test", Type: "AAAA"}}
	b, err := json.Marshal(in)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(b), `"timeout":"1.5s"`) {
		t.Errorf("timeout not a duration string: %s", b)
	}
	var out Spec
	if err := json.Unmarshal(b, &out); err != nil {
		t.Fatal(err)
	}
	if out.Timeout != in.Timeout || out.DNS.Type != "AAAA" || out.ID != "x" {
		t.Errorf("round trip: %+v", out)
	}
	var n Spec
	if err := json.Unmarshal([]byte(`{"kind":"tcp","timeout":250000000}`), &n); err != nil || n.Timeout != 250*time.Millisecond {
		t.Errorf("nanoseconds: %v %v", n.Timeout, err)
	}
	if err := json.Unmarshal([]byte(`{"kind":"tcp","tagret":"x"}`), &n); err == nil {
		t.Error("unknown field accepted")
	}
	r := Result{Probe: in, Outcome: Refused, RTT: time.Millisecond}
	b, _ = json.Marshal(r)
	var r2 Result
	if err := json.Unmarshal(b, &r2); err != nil || r2.Outcome != Refused || r2.RTT != time.Millisecond || r2.Probe.Timeout != in.Timeout {
		t.Errorf("result round trip: %+v %v", r2, err)
	}
}
