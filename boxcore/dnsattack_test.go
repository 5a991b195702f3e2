package boxcore_test

// DNS attack harness: what a hostile root in a box can learn through the gateway's dnsmasq,
// with the local-answers layer (inet claudebox_<B>_guard chains answers, dns_tcp) alone and
// with every layer on. Runs only with CLAUDEBOX_ATTACK=1 (never in `make test`), on a stack
// of its own (teststack "dnsatk") whose upstream is a fake resolver on a loopback address
// this test owns: nothing is forwarded off the machine. Queries go from the attacker box's
// network namespace (entered by its init PID) to the gateway only, and from the host to the
// gateway (dnsmasq's reply then leaves by lo: what dnsmasq says, before any chain).
//
//	CLAUDEBOX_ATTACK=1 go test ./boxcore -run TestDNSAttack -v -count=1 -timeout 15m

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/insomniacslk/dhcp/dhcpv4"
	"github.com/miekg/dns"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/claudebox/claudebox/boxcore"
	"github.com/claudebox/claudebox/boxcore/incus"
	"github.com/claudebox/claudebox/internal/testenv"
	"github.com/claudebox/claudebox/internal/teststack"
)

// fakeUpstream is the stack's only upstream: a resolver on 127.0.0.X:53 that answers
// *.pub.test (recursive-looking: RA, no AA, unless the name asks for AA) and NXDOMAIN else.
type fakeUpstream struct {
	ip      net.IP
	sibling string // the sibling box's name, for the CNAME games
	mu      sync.Mutex
	asked   map[string]int
	servers []*dns.Server
}

func (u *fakeUpstream) count(name string) int {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.asked[strings.ToLower(dns.Fqdn(name))]
}

func (u *fakeUpstream) ServeDNS(w dns.ResponseWriter, r *dns.Msg) {
	m := new(dns.Msg)
	m.SetReply(r)
	m.RecursionAvailable = true
	if len(r.Question) != 1 {
		m.Rcode = dns.RcodeFormatError
		_ = w.WriteMsg(m)
		return
	}
	q := r.Question[0]
	name := strings.ToLower(q.Name)
	u.mu.Lock()
	u.asked[name]++
	u.mu.Unlock()
	hdr := func(t uint16, ttl uint32) dns.RR_Header {
		return dns.RR_Header{Name: q.Name, Rrtype: t, Class: dns.ClassINET, Ttl: ttl}
	}
	a := func(ip string, ttl uint32) *dns.A { return &dns.A{Hdr: hdr(dns.TypeA, ttl), A: net.ParseIP(ip).To4()} }
	switch {
	case name == "aa.pub.test.": // an upstream that answers authoritatively (its own zone, a router's hosts)
		m.Authoritative = true
		if q.Qtype == dns.TypeA {
			m.Answer = append(m.Answer, a("198.18.7.7", 300))
		}
	case name == "many.pub.test.": // 40 addresses: > 512 bytes
		if q.Qtype == dns.TypeA {
			for i := range 40 {
				m.Answer = append(m.Answer, a(fmt.Sprintf("198.18.8.%d", i+1), 300))
			}
		}
	case name == "big.pub.test.": // ~2,000 bytes of TXT (DKIM/SPF-sized)
		if q.Qtype == dns.TypeTXT {
			for range 8 {
				m.Answer = append(m.Answer, &dns.TXT{Hdr: hdr(dns.TypeTXT, 300), Txt: []string{strings.Repeat("x", 250)}})
			}
		}
	case name == "cn.pub.test.": // a CNAME into the sibling's local name
		m.Answer = append(m.Answer, &dns.CNAME{Hdr: hdr(dns.TypeCNAME, 300), Target: dns.Fqdn(u.sibling)})
	case name == "cnvm.pub.test.": // a CNAME into a host name
		m.Answer = append(m.Answer, &dns.CNAME{Hdr: hdr(dns.TypeCNAME, 300), Target: "vm."})
	case strings.HasSuffix(name, ".pub.test."):
		if q.Qtype == dns.TypeA {
			m.Answer = append(m.Answer, a("198.18.9.9", 3600))
		}
	default:
		m.Rcode = dns.RcodeNameError
	}
	if _, ok := w.RemoteAddr().(*net.UDPAddr); ok {
		size := 512
		if o := r.IsEdns0(); o != nil {
			size = int(o.UDPSize())
		}
		m.Truncate(size)
	}
	_ = w.WriteMsg(m)
}

func startUpstream(t *testing.T) *fakeUpstream {
	t.Helper()
	for range 30 {
		ip := net.IPv4(127, 0, byte(200+rand.IntN(50)), byte(2+rand.IntN(250))).To4()
		pc, err := net.ListenPacket("udp4", net.JoinHostPort(ip.String(), "53"))
		if err != nil {
			continue
		}
		l, err := net.Listen("tcp4", net.JoinHostPort(ip.String(), "53"))
		if err != nil {
			pc.Close()
			continue
		}
		u := &fakeUpstream{ip: ip, asked: map[string]int{}}
		su := &dns.Server{PacketConn: pc, Handler: u}
		st := &dns.Server{Listener: l, Handler: u}
		u.servers = []*dns.Server{su, st}
		go func() { _ = su.ActivateAndServe() }()
		go func() { _ = st.ActivateAndServe() }()
		t.Cleanup(func() { _ = su.Shutdown(); _ = st.Shutdown() })
		return u
	}
	t.Fatal("no free loopback address for the fake upstream")
	return nil
}

// dnsReply is one exchange's outcome.
type dnsReply struct {
	err  error
	msg  *dns.Msg
	size int
	took time.Duration
}

func (r dnsReply) String() string {
	if r.err != nil {
		return "SILENCE (" + shortErr(r.err) + ")"
	}
	m := r.msg
	var rrs []string
	for _, rr := range append(append(append([]dns.RR{}, m.Answer...), m.Ns...), m.Extra...) {
		if rr.Header().Rrtype == dns.TypeOPT {
			continue
		}
		s := strings.Join(strings.Fields(rr.String()), " ")
		if len(s) > 90 {
			s = s[:90] + "…"
		}
		rrs = append(rrs, s)
	}
	if len(rrs) > 4 {
		rrs = append(rrs[:4], fmt.Sprintf("…(+%d)", len(rrs)-4))
	}
	return fmt.Sprintf("%s aa=%v tc=%v ra=%v qd=%d an=%d ns=%d ar=%d %dB %v %v", dns.RcodeToString[m.Rcode], m.Authoritative, m.Truncated,
		m.RecursionAvailable, len(m.Question), len(m.Answer), len(m.Ns), len(m.Extra), r.size, r.took.Round(time.Millisecond), rrs)
}

func shortErr(err error) string {
	s := err.Error()
	if strings.Contains(s, "timeout") {
		return "timeout"
	}
	return s
}

// inNetns runs fn on a thread inside the network namespace of pid (0: the host's own).
// Sockets fn opens stay in that namespace.
func inNetns(t *testing.T, pid int, fn func()) {
	t.Helper()
	if pid == 0 {
		fn()
		return
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	orig, err := netns.Get()
	if err != nil {
		t.Fatal(err)
	}
	defer orig.Close()
	ns, err := netns.GetFromPid(pid)
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	if err := netns.Set(ns); err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := netns.Set(orig); err != nil {
			panic("cannot return to the host's netns: " + err.Error())
		}
	}()
	fn()
}

// exchangeRaw sends one DNS message over UDP to server and waits for the datagram with its ID.
func exchangeRaw(wire []byte, server string, timeout time.Duration) dnsReply {
	start := time.Now()
	c, err := net.Dial("udp4", server)
	if err != nil {
		return dnsReply{err: err}
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(timeout))
	if _, err := c.Write(wire); err != nil {
		return dnsReply{err: err}
	}
	buf := make([]byte, 65536)
	for {
		n, err := c.Read(buf)
		if err != nil {
			return dnsReply{err: err, took: time.Since(start)}
		}
		if n < 2 || buf[0] != wire[0] || buf[1] != wire[1] {
			continue
		}
		m := new(dns.Msg)
		if err := m.Unpack(buf[:n]); err != nil {
			// keep the header at least
			m = new(dns.Msg)
			if e2 := m.Unpack(buf[:12]); e2 != nil {
				return dnsReply{err: fmt.Errorf("unpack: %v", err), took: time.Since(start)}
			}
		}
		return dnsReply{msg: m, size: n, took: time.Since(start)}
	}
}

type dnsCase struct {
	label string
	wire  []byte
}

func q1(name string, qtype uint16) dns.Question {
	return dns.Question{Name: dns.Fqdn(name), Qtype: qtype, Qclass: dns.ClassINET}
}

func qch(name string) dns.Question {
	return dns.Question{Name: dns.Fqdn(name), Qtype: dns.TypeTXT, Qclass: dns.ClassCHAOS}
}

// mkq packs a query with the given questions; edit may change the header or add EDNS.
func mkq(edit func(m *dns.Msg), qs ...dns.Question) []byte {
	m := new(dns.Msg)
	m.Id = dns.Id()
	m.RecursionDesired = true
	m.Question = qs
	if edit != nil {
		edit(m)
	}
	b, err := m.Pack()
	if err != nil {
		panic(err)
	}
	return b
}

func withEDNS(size uint16, do bool) func(*dns.Msg) {
	return func(m *dns.Msg) { m.SetEdns0(size, do) }
}

type dnsatk struct {
	t        *testing.T
	cl       *incus.Client
	gw       net.IP
	server   string
	a, b     boxNIC
	apid     int
	bpid     int
	up       *fakeUpstream
	leakSubs []string // strings whose presence in a reply is a leak
}

// run sends every case from pid's namespace (0: host) and returns the replies by label.
func (x *dnsatk) run(pid int, cases []dnsCase) map[string]dnsReply {
	out := map[string]dnsReply{}
	inNetns(x.t, pid, func() {
		for _, c := range cases {
			out[c.label] = exchangeRaw(c.wire, x.server, 1500*time.Millisecond)
		}
	})
	return out
}

// leaks names what in a reply gives the sibling, a host name or the resolver away.
func (x *dnsatk) leaks(r dnsReply) []string {
	if r.msg == nil {
		return nil
	}
	var got []string
	for _, rr := range append(append(append([]dns.RR{}, r.msg.Answer...), r.msg.Ns...), r.msg.Extra...) {
		if rr.Header().Rrtype == dns.TypeOPT {
			continue
		}
		s := strings.ToLower(rr.String())
		if strings.HasSuffix(strings.ToLower(rr.Header().Name), ".pub.test.") && rr.Header().Rrtype == dns.TypeCNAME {
			continue // the upstream's own CNAME (its target is the attacker's choice, not a leak)
		}
		for _, sub := range x.leakSubs {
			if strings.Contains(s, strings.ToLower(sub)) {
				got = append(got, sub)
			}
		}
		if rr.Header().Class == dns.ClassCHAOS {
			got = append(got, "CHAOS "+rr.Header().Name)
		}
	}
	return got
}

func (x *dnsatk) battery() []dnsCase {
	rev := func(ip net.IP) string { r, _ := dns.ReverseAddr(ip.String()); return r }
	b := x.b.name
	up := strings.ToUpper(b[:1]) + b[1:]
	cases := []dnsCase{
		// the three claims, one question each
		{"A sibling", mkq(nil, q1(b, dns.TypeA))},
		{"A sibling.incus", mkq(nil, q1(b+".incus", dns.TypeA))},
		{"A sibling, upper case", mkq(nil, q1(up, dns.TypeA))},
		{"A sibling, RD=0", mkq(func(m *dns.Msg) { m.RecursionDesired = false }, q1(b, dns.TypeA))},
		{"A sibling, CD+DO EDNS4096", mkq(func(m *dns.Msg) { m.CheckingDisabled = true; m.SetEdns0(4096, true) }, q1(b, dns.TypeA))},
		{"ANY sibling", mkq(nil, q1(b, dns.TypeANY))},
		{"AAAA sibling (oracle)", mkq(nil, q1(b, dns.TypeAAAA))},
		{"MX sibling (oracle)", mkq(nil, q1(b, dns.TypeMX))},
		{"TXT sibling (oracle)", mkq(nil, q1(b, dns.TypeTXT))},
		{"A no-such-box (oracle ctl)", mkq(nil, q1("cbt-nosuchbox", dns.TypeA))},
		{"AAAA no-such-box (oracle ctl)", mkq(nil, q1("cbt-nosuchbox", dns.TypeAAAA))},
		{"PTR sibling", mkq(nil, q1(rev(x.b.ip), dns.TypePTR))},
		{"A host 'vm'", mkq(nil, q1("vm", dns.TypeA))},
		{"A host 'runsc'", mkq(nil, q1("runsc", dns.TypeA))},
		{"A localhost", mkq(nil, q1("localhost", dns.TypeA))},
		{"PTR 127.0.0.1", mkq(nil, q1(rev(net.IPv4(127, 0, 0, 1)), dns.TypePTR))},
		{"CH servers.bind", mkq(nil, qch("servers.bind"))},
		{"CH version.bind", mkq(nil, qch("version.bind"))},
		{"CH id.server", mkq(nil, qch("id.server"))},
		{"CH hostname.bind", mkq(nil, qch("hostname.bind"))},
		{"CH cachesize.bind", mkq(nil, qch("cachesize.bind"))},
		{"CH misses.bind", mkq(nil, qch("misses.bind"))},
		{"CH authors.bind", mkq(nil, qch("authors.bind"))},
		// opcode games
		{"IQUERY sibling", mkq(func(m *dns.Msg) { m.Opcode = dns.OpcodeIQuery }, q1(b, dns.TypeA))},
		{"NOTIFY sibling", mkq(func(m *dns.Msg) { m.Opcode = dns.OpcodeNotify }, q1(b, dns.TypeA))},
		{"UPDATE sibling", mkq(func(m *dns.Msg) { m.Opcode = dns.OpcodeUpdate }, q1(b, dns.TypeA))},
		{"STATUS sibling", mkq(func(m *dns.Msg) { m.Opcode = dns.OpcodeStatus }, q1(b, dns.TypeA))},
		// two questions: dnsmasq answers all of them and clears AA when any one of them is not
		// "its own" (a CHAOS *.bind/*.server it has no TXT for -> NOTIMP, auth=0)
		{"QD2 A sibling + CH x.bind", mkq(nil, q1(b, dns.TypeA), qch("x.bind"))},
		{"QD2 CH x.bind + A sibling", mkq(nil, qch("x.bind"), q1(b, dns.TypeA))},
		{"QD2 A sibling.incus + CH id.server-less", mkq(nil, q1(b+".incus", dns.TypeA), qch("nope.server"))},
		{"QD2 PTR sibling + CH x.bind", mkq(nil, q1(rev(x.b.ip), dns.TypePTR), qch("x.bind"))},
		{"QD2 A vm + CH x.bind", mkq(nil, q1("vm", dns.TypeA), qch("x.bind"))},
		{"QD2 A runsc + CH x.bind", mkq(nil, q1("runsc", dns.TypeA), qch("x.bind"))},
		{"QD2 PTR 127.0.0.1 + CH x.bind", mkq(nil, q1(rev(net.IPv4(127, 0, 0, 1)), dns.TypePTR), qch("x.bind"))},
		{"QD2 CH servers.bind + CH x.bind", mkq(nil, qch("servers.bind"), qch("x.bind"))},
		{"QD2 CH version.bind + CH x.bind", mkq(nil, qch("version.bind"), qch("x.bind"))},
		{"QD3 CH servers.bind+version.bind + x.bind", mkq(nil, qch("servers.bind"), qch("version.bind"), qch("x.bind"))},
		{"QD2 A sibling + A sibling", mkq(nil, q1(b, dns.TypeA), q1(b, dns.TypeA))},
		{"QD2 A sibling + CH x.bind, EDNS DO", mkq(withEDNS(1232, true), q1(b, dns.TypeA), qch("x.bind"))},
	}
	return cases
}

// cachedCases need pub.test names in dnsmasq's cache (forwarded, AA=0) first.
func (x *dnsatk) cachedCases() []dnsCase {
	b := x.b.name
	return []dnsCase{
		{"QD2 A sibling + A cached pub name", mkq(nil, q1(b, dns.TypeA), q1("warm.pub.test", dns.TypeA))},
		{"QD2 A vm + A cached pub name", mkq(nil, q1("vm", dns.TypeA), q1("warm.pub.test", dns.TypeA))},
		{"CNAME game cn.pub.test (2nd ask)", mkq(nil, q1("cn.pub.test", dns.TypeA))},
		{"CNAME game cnvm.pub.test (2nd ask)", mkq(nil, q1("cnvm.pub.test", dns.TypeA))},
	}
}

func (x *dnsatk) report(phase string, who string, cases []dnsCase, got map[string]dnsReply, breaks *[]string) {
	t := x.t
	for _, c := range cases {
		r := got[c.label]
		l := x.leaks(r)
		tag := "held"
		if len(l) > 0 {
			tag = "LEAK " + strings.Join(l, ",")
			if who == "box" {
				*breaks = append(*breaks, fmt.Sprintf("[%s] %s: %s", phase, c.label, r))
			}
		}
		record(t, fmt.Sprintf("%s %s: %s", phase, who, c.label), "%-22s %s", tag, r)
	}
}

func TestDNSAttack(t *testing.T) {
	if os.Getenv("CLAUDEBOX_ATTACK") != "1" {
		t.Skip("attack harness: set CLAUDEBOX_ATTACK=1")
	}
	c := testenv.RequireIncus(t)
	ctx := context.Background()
	teststack.Sweep(t, c)
	up := startUpstream(t)
	s := teststack.Stack("dnsatk")
	t.Cleanup(func() { teststack.Remove(t, c, s) })
	h := boxcore.NewHost(c, s)
	if _, err := h.Init(ctx, boxcore.InitOptions{DNS: up.ip.String()}); err != nil {
		t.Fatalf("init %s: %v", s.Network, err)
	}
	bs := &boxcore.Boxes{Client: c, Stack: s, Version: "test"}
	img := teststack.ProbeImage(t, c)
	x := &dnsatk{t: t, up: up, cl: c}
	nics := mintTwo(t, ctx, bs, img, "cbt-dnsatk")
	x.a, x.b = nics[0], nics[1]
	up.sibling = x.b.name
	gwc := mustNetwork(t, c, s.Network).Config["ipv4.address"]
	gw, _, err := net.ParseCIDR(gwc)
	if err != nil {
		t.Fatal(err)
	}
	x.gw = gw.To4()
	x.server = net.JoinHostPort(x.gw.String(), "53")
	mustLocal(t, x.gw, s.Network)
	pidOf := func(name string) int {
		st, err := c.InstanceState(ctx, name)
		if err != nil || st.Pid <= 0 {
			t.Fatalf("pid of %s: %v %d", name, err, st.Pid)
		}
		return int(st.Pid)
	}
	x.apid, x.bpid = pidOf(x.a.name), pidOf(x.b.name)
	hn, _ := os.Hostname()
	x.leakSubs = []string{x.b.name, x.b.ip.String(), "127.0.0.1", "localhost", "runsc", "vm.", hn + "."}
	t.Logf("stack %s gw %s upstream %s; a %s %s; b %s %s", s.Network, x.gw, up.ip, x.a.name, x.a.ip, x.b.name, x.b.ip)
	requireLayer(t, h, boxcore.LayerLocalAnswers, true)

	var breaks []string
	phase := func(name string) {
		cases := x.battery()
		x.report(name, "host", cases, x.run(0, cases), &breaks)
		boxGot := x.run(x.apid, cases)
		x.report(name, "box", cases, boxGot, &breaks)
		x.oracles(name, boxGot)
		// warm the cache from the attacker itself (a forwarded answer, AA=0), then mix it in
		warm := []dnsCase{{"warm", mkq(nil, q1("warm.pub.test", dns.TypeA))},
			{"cn 1st", mkq(nil, q1("cn.pub.test", dns.TypeA))}, {"cnvm 1st", mkq(nil, q1("cnvm.pub.test", dns.TypeA))}}
		for l, r := range x.run(x.apid, warm) {
			record(t, name+" box: "+l, "%s", r)
		}
		cc := x.cachedCases()
		x.report(name, "box", cc, x.run(x.apid, cc), &breaks)
		x.ptrSweep(name)
		x.tcp(name)
	}

	// 1. every layer on.
	phase("ALL-ON")
	x.dhcpNames("ALL-ON", s.Network)
	x.costs("ALL-ON")
	x.cacheSnoop("ALL-ON")

	// 2. the dnsmasq options off, local-answers alone.
	restore, err := h.SwitchOff(ctx, []boxcore.Layer{boxcore.LayerDNSModeNone, boxcore.LayerIgnoreNames, boxcore.LayerNoHosts, boxcore.LayerNoIdent}, nil)
	if err != nil {
		t.Fatalf("switch off: %v", err)
	}
	restored := false
	t.Cleanup(func() {
		if !restored {
			_ = restore(context.Background())
		}
	})
	x.settle(s.Network)
	// re-lease b so its name is registered with the options off
	if err := c.SetState(ctx, x.b.name, "restart", true, 0); err != nil {
		t.Fatalf("restart b: %v", err)
	}
	x.b = nicOf(t, c, x.b.name)
	x.bpid = pidOf(x.b.name)
	if err := h.BindPorts(ctx); err != nil {
		t.Fatalf("bind: %v", err)
	}
	time.Sleep(2 * time.Second)
	requireLayer(t, h, boxcore.LayerLocalAnswers, true)
	raw := mustNetwork(t, c, s.Network).Config
	t.Logf("layer (b) alone: dns.mode=%q raw.dnsmasq=%q", raw["dns.mode"], raw["raw.dnsmasq"])
	phase("B-ALONE")
	x.dhcpNames("B-ALONE", s.Network)
	x.costs("B-ALONE")
	x.cacheSnoop("B-ALONE")

	// 3. positive control: local-answers off too, the box hears the names (the layer is what held).
	restoreLA, err := h.SwitchOff(ctx, []boxcore.Layer{boxcore.LayerLocalAnswers}, nil)
	if err != nil {
		t.Fatalf("switch off local answers: %v", err)
	}
	ctl := []dnsCase{{"A sibling", mkq(nil, q1(x.b.name, dns.TypeA))}, {"A host 'vm'", mkq(nil, q1("vm", dns.TypeA))},
		{"CH servers.bind", mkq(nil, qch("servers.bind"))}, {"PTR sibling", mkq(nil, q1(func() string { r, _ := dns.ReverseAddr(x.b.ip.String()); return r }(), dns.TypePTR))}}
	var ignore []string
	x.report("NOTHING (ctl)", "box", ctl, x.run(x.apid, ctl), &ignore)
	if err := restoreLA(ctx); err != nil {
		t.Fatalf("restore local answers: %v", err)
	}
	if err := restore(ctx); err != nil {
		t.Fatalf("restore: %v", err)
	}
	restored = true

	results.Lock()
	for _, r := range results.list {
		t.Logf("SUMMARY %-60s %s", r.attack, r.outcome)
	}
	results.Unlock()
	for _, b := range breaks {
		t.Errorf("BREAK %s", b)
	}
}

// settle waits until dnsmasq answers the host again after a re-apply.
func (x *dnsatk) settle(network string) {
	time.Sleep(3 * time.Second)
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		r := exchangeRaw(mkq(nil, qch("x.bind")), x.server, 500*time.Millisecond)
		if r.err == nil {
			time.Sleep(time.Second)
			return
		}
		time.Sleep(300 * time.Millisecond)
	}
	x.t.Fatalf("dnsmasq on %s did not come back", network)
}

// ptrSweep: PTR of every address near the sibling's: what the replies tell apart.
func (x *dnsatk) ptrSweep(phase string) {
	var cases []dnsCase
	base := x.b.ip.To4()
	for i := 1; i <= 12; i++ {
		ip := net.IPv4(base[0], base[1], base[2], byte(i)).To4()
		r, _ := dns.ReverseAddr(ip.String())
		cases = append(cases, dnsCase{ip.String(), mkq(nil, q1(r, dns.TypePTR))})
	}
	got := x.run(x.apid, cases)
	var line []string
	for _, c := range cases {
		r := got[c.label]
		v := "silence"
		if r.err == nil {
			v = dns.RcodeToString[r.msg.Rcode]
			if len(r.msg.Answer) > 0 {
				v += "+ANSWER"
			}
		}
		mark := ""
		switch c.label {
		case x.a.ip.String():
			mark = "(a)"
		case x.b.ip.String():
			mark = "(b)"
		case x.gw.String():
			mark = "(gw)"
		}
		line = append(line, c.label+mark+"="+v)
	}
	record(x.t, phase+" box: PTR sweep (existence oracle)", "%s", strings.Join(line, " "))
}

// tcp: DNS over TCP from the box to the gateway, and a SYN with data via TCP fast open.
func (x *dnsatk) tcp(phase string) {
	inNetns(x.t, x.apid, func() {
		start := time.Now()
		cn, err := net.DialTimeout("tcp4", x.server, 1500*time.Millisecond)
		if err != nil {
			record(x.t, phase+" box: TCP connect gw:53", "no connection after %v (%s)", time.Since(start).Round(time.Millisecond), shortErr(err))
			return
		}
		defer cn.Close()
		cl := &dns.Conn{Conn: cn}
		m := new(dns.Msg)
		m.SetQuestion(dns.Fqdn(x.b.name), dns.TypeA)
		_ = cn.SetDeadline(time.Now().Add(1500 * time.Millisecond))
		err = cl.WriteMsg(m)
		var r *dns.Msg
		if err == nil {
			r, err = cl.ReadMsg()
		}
		if err != nil {
			record(x.t, phase+" box: TCP connect gw:53", "CONNECTED; A sibling: %v", err)
			return
		}
		record(x.t, phase+" box: TCP connect gw:53", "CONNECTED; A sibling: %s", dnsReply{msg: r})
	})
}

// costs: what normal DNS a box needs still works (forwarded answers through the layer).
func (x *dnsatk) costs(phase string) {
	cases := []dnsCase{
		{"A fwd plain (198.18.9.9)", mkq(nil, q1("plain.pub.test", dns.TypeA))},
		{"A fwd upstream AA=1", mkq(nil, q1("aa.pub.test", dns.TypeA))},
		{"A fwd upstream AA=1 (2nd ask, cached)", mkq(nil, q1("aa.pub.test", dns.TypeA))},
		{"A fwd 40 addrs, no EDNS", mkq(nil, q1("many.pub.test", dns.TypeA))},
		{"A fwd 40 addrs, EDNS 1232", mkq(withEDNS(1232, false), q1("many.pub.test", dns.TypeA))},
		{"TXT fwd 2kB, EDNS 4096", mkq(withEDNS(4096, false), q1("big.pub.test", dns.TypeTXT))},
		{"A fwd NXDOMAIN", mkq(nil, q1("nosuch.example.test", dns.TypeA))},
	}
	x.report(phase, "box", cases, x.run(x.apid, cases), new([]string))
	// TCP retry of the truncated answers
	inNetns(x.t, x.apid, func() {
		for _, n := range []string{"many.pub.test", "big.pub.test"} {
			qt := dns.TypeA
			if strings.HasPrefix(n, "big") {
				qt = dns.TypeTXT
			}
			m := new(dns.Msg)
			m.SetQuestion(dns.Fqdn(n), qt)
			cl := &dns.Client{Net: "tcp", Timeout: 1500 * time.Millisecond}
			start := time.Now()
			r, _, err := cl.Exchange(m, x.server)
			if err != nil {
				record(x.t, phase+" box: TCP retry "+n, "FAILS after %v: %s", time.Since(start).Round(time.Millisecond), shortErr(err))
			} else {
				record(x.t, phase+" box: TCP retry "+n, "%s", dnsReply{msg: r})
			}
		}
	})
}

// cacheSnoop: the sibling resolves a name; does the attacker learn that it did? dnsmasq
// forwards RD=0 queries (no snooping that way), but an RD=1 answer from its cache carries the
// remaining TTL: below the upstream's 3600 means some box asked it that many seconds ago.
func (x *dnsatk) cacheSnoop(phase string) {
	name := fmt.Sprintf("secret-%s-%d.pub.test", strings.ToLower(phase), rand.IntN(1e6))
	ctlName := fmt.Sprintf("unasked-%s-%d.pub.test", strings.ToLower(phase), rand.IntN(1e6))
	inNetns(x.t, x.bpid, func() { _ = exchangeRaw(mkq(nil, q1(name, dns.TypeA)), x.server, 1500*time.Millisecond) })
	time.Sleep(3 * time.Second)
	before := x.up.count(name)
	got := x.run(x.apid, []dnsCase{
		{"rd1", mkq(nil, q1(name, dns.TypeA))},
		{"rd1-ctl", mkq(nil, q1(ctlName, dns.TypeA))},
	})
	after := x.up.count(name)
	ttl := func(r dnsReply) string {
		if r.msg != nil && len(r.msg.Answer) > 0 {
			return fmt.Sprint(r.msg.Answer[0].Header().Ttl)
		}
		return "-"
	}
	record(x.t, phase+" box: cache snoop of sibling's lookup (3 s before)",
		"asked-by-sibling name: ttl %s, %v | never-asked name: ttl %s, %v | upstream asked for the sibling's name %d→%d times",
		ttl(got["rd1"]), got["rd1"].took.Round(time.Microsecond), ttl(got["rd1-ctl"]), got["rd1-ctl"].took.Round(time.Microsecond), before, after)
}

// dhcpNames: the attacker renews its own lease and sends an INFORM, asking for every option
// that can carry a name (12 host name, 15 domain, 81 FQDN, 119 search, 252 WPAD, 66/67 boot
// server/file); what dnsmasq puts in its replies.
func (x *dnsatk) dhcpNames(phase, bridge string) {
	t := x.t
	br, err := net.InterfaceByName(bridge)
	if err != nil {
		t.Fatal(err)
	}
	prl := dhcpv4.WithRequestedOptions(dhcpv4.OptionSubnetMask, dhcpv4.OptionRouter, dhcpv4.OptionDomainNameServer,
		dhcpv4.OptionHostName, dhcpv4.OptionDomainName, dhcpv4.OptionFQDN, dhcpv4.OptionDNSDomainSearchList,
		dhcpv4.GenericOptionCode(252), dhcpv4.OptionTFTPServerName, dhcpv4.OptionBootfileName)
	for _, kind := range []dhcpv4.MessageType{dhcpv4.MessageTypeRequest, dhcpv4.MessageTypeInform} {
		m, err := dhcpv4.New(dhcpv4.WithMessageType(kind), dhcpv4.WithHwAddr(x.a.mac), dhcpv4.WithClientIP(x.a.ip), prl)
		if err != nil {
			t.Fatal(err)
		}
		xid := m.TransactionID
		var got []string
		captureWhile(t, bridge, time.Second, func() {
			sendFrom(t, x.c(), x.a.name, []frameCase{dhcpFrame(x.a.mac, x.a.ip, br.HardwareAddr, x.gw, m)})
		}, func(f []byte, _ *unix.SockaddrLinklayer) {
			if len(f) < 14+28 || f[12] != 8 || f[13] != 0 || f[14+9] != 17 {
				return
			}
			ihl := int(f[14]&0x0f) * 4
			udp := f[14+ihl:]
			if len(udp) < 8 || udp[0] != 0 || udp[1] != 67 {
				return
			}
			r, err := dhcpv4.FromBytes(udp[8:])
			if err != nil || r.TransactionID != xid || r.OpCode != dhcpv4.OpcodeBootReply {
				return
			}
			var opts []string
			for code, v := range r.Options {
				switch code {
				case 12, 15, 81, 119, 252, 66, 67:
					opts = append(opts, fmt.Sprintf("opt%d=%q", code, v))
				}
			}
			got = append(got, fmt.Sprintf("%s yiaddr=%s sname=%q file=%q %v", r.MessageType(), r.YourIPAddr, r.ServerHostName, r.BootFileName, opts))
		})
		record(t, phase+" box: DHCP "+kind.String()+" name options", "%v", got)
	}
}

func (x *dnsatk) c() *incus.Client { return x.cl }

// shape is what a client can tell of a reply without its records: silence, or rcode/AA/counts.
func shape(r dnsReply) string {
	if r.err != nil {
		return "silence"
	}
	return fmt.Sprintf("%s/aa=%v/an=%d", dns.RcodeToString[r.msg.Rcode], r.msg.Authoritative, len(r.msg.Answer))
}

// oracles: does a reply about something that exists differ from one about something that
// does not? (Documented, not judged: the drill's name rows accept silence.)
func (x *dnsatk) oracles(phase string, got map[string]dnsReply) {
	pairs := [][2]string{
		{"A sibling", "A no-such-box (oracle ctl)"},
		{"AAAA sibling (oracle)", "AAAA no-such-box (oracle ctl)"},
		{"MX sibling (oracle)", "A no-such-box (oracle ctl)"},
		{"A host 'vm'", "A no-such-box (oracle ctl)"},
		{"CH servers.bind", "CH id.server"},
		{"CH version.bind", "CH hostname.bind"},
	}
	for _, p := range pairs {
		a, b := shape(got[p[0]]), shape(got[p[1]])
		v := "indistinguishable"
		if a != b {
			v = "ORACLE (tells existence)"
		}
		record(x.t, fmt.Sprintf("%s box: oracle %s vs %s", phase, p[0], p[1]), "%s: %s vs %s", v, a, b)
	}
}
