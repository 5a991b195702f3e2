package probes

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strings"
	"syscall"
	"time"

	"github.com/miekg/dns"
)

// ResolvConf is read for the default DNS server.
var ResolvConf = "/etc/resolv.conf"

// probeDNS asks one question over UDP. The mapping is built for the engine's
// rule "no answer counts only when the resolver actually answered":
//
//	open         the resolver answered with records (Answer lists them)
//	refused      the resolver answered without records: NXDOMAIN, NOERROR
//	             with an empty answer, REFUSED, SERVFAIL (rcode in DNS.Rcode)
//	dropped      silence until the timeout (the engine treats this as
//	             check-failed for a "no answer" claim)
//	check-failed no resolver to ask, or ICMP port unreachable (nothing listens
//	             on the server's port: no resolver answered, so no verdict)
//
// DNS.Answered is true exactly when a DNS response arrived.
func probeDNS(ctx context.Context, s Spec, r *Result) {
	q := *s.DNS
	qtype := strings.ToUpper(q.Type)
	if qtype == "" {
		qtype = "A"
	}
	server, sa, err := dnsServer(q.Server)
	if err != nil {
		r.Outcome, r.Evidence = CheckFailed, err.Error()
		return
	}
	r.DNS = &DNSAnswer{Server: server}
	if _, err := routeCheck(sa, s.Iface); err != nil {
		r.Outcome, r.Evidence = CheckFailed, err.Error()
		return
	}
	name, m := dnsQuestion(q, qtype)
	start := time.Now()
	resp, err := exchangeDNS(ctx, m, server, s.Iface, q.TCP)
	if err != nil {
		dnsFailed(r, err, server, sa, s.Iface, start)
		return
	}
	r.RTT = time.Since(start)
	dnsAnswered(r, resp, name, qtype, server)
}

// dnsServer returns the server to ask as host:port, and its address. An empty
// server means the first nameserver of ResolvConf.
func dnsServer(given string) (string, netip.Addr, error) {
	server := given
	if server == "" {
		cfg, err := dns.ClientConfigFromFile(ResolvConf)
		if err != nil || len(cfg.Servers) == 0 {
			return "", netip.Addr{}, fmt.Errorf("no DNS server given and none in %s: %v", ResolvConf, err)
		}
		server = cfg.Servers[0]
	}
	if _, _, err := net.SplitHostPort(server); err != nil {
		server = net.JoinHostPort(strings.Trim(server, "[]"), "53")
	}
	host, _, _ := net.SplitHostPort(server)
	sa, err := netip.ParseAddr(host)
	if err != nil {
		return "", netip.Addr{}, fmt.Errorf("DNS server %q is not an IP address", given)
	}
	return server, sa.Unmap(), nil
}

// dnsQuestion builds the query and returns the name it asks about (for PTR
// of an IP literal, the reverse name).
func dnsQuestion(q DNSQuery, qtype string) (string, *dns.Msg) {
	name := q.Name
	if qtype == "PTR" {
		if ip, err := netip.ParseAddr(name); err == nil {
			name, _ = dns.ReverseAddr(ip.String())
		}
	}
	m := new(dns.Msg)
	m.SetQuestion(dns.Fqdn(name), dns.StringToType[qtype])
	m.RecursionDesired = true
	if c := strings.ToUpper(q.Class); c == "CH" || c == "CHAOS" {
		// servers.bind / version.bind: a resolver that says nothing about
		// itself answers REFUSED/NOTIMP or empty (refused), never records.
		m.Question[0].Qclass = dns.ClassCHAOS
		m.RecursionDesired = false
	}
	return name, m
}

// exchangeDNS sends m over UDP (or TCP) from iface. Two tries inside the window: one
// lost datagram must not make a positive control look like silence.
func exchangeDNS(ctx context.Context, m *dns.Msg, server, iface string, tcp bool) (*dns.Msg, error) {
	deadline, _ := ctx.Deadline()
	var resp *dns.Msg
	var err error
	for attempt := 0; attempt < 2; attempt++ {
		left := time.Until(deadline)
		if left <= 0 {
			break
		}
		if attempt == 0 {
			left = left * 6 / 10
		}
		d := &net.Dialer{Control: udpControl(iface, true)}
		cl := &dns.Client{Net: "udp", Timeout: left, Dialer: d}
		if tcp {
			cl.Net, d.Control = "tcp", bindControl(iface)
		}
		resp, _, err = cl.ExchangeContext(ctx, m, server)
		if err == nil || !isTimeout(err) {
			break
		}
	}
	if resp == nil && err == nil {
		// No time was left to ask at all: as silent as a timeout, never a nil answer.
		err = context.DeadlineExceeded
	}
	return resp, err
}

// dnsFailed records an exchange that got no DNS response.
func dnsFailed(r *Result, err error, server string, sa netip.Addr, iface string, start time.Time) {
	switch {
	case isTimeout(err):
		r.Outcome, r.Evidence = Dropped, fmt.Sprintf("no DNS response from %s before the timeout", server)
	case errors.Is(err, syscall.ECONNREFUSED):
		r.Outcome, r.Evidence = CheckFailed, fmt.Sprintf("ICMP port unreachable from %s: no DNS server listens there", server)
		r.RTT = time.Since(start)
	default:
		o, ev := classify(err, sa, iface)
		if o == Refused { // ICMP unreachable: still no resolver answer
			o = CheckFailed
		}
		r.Outcome, r.Evidence = o, "DNS: "+ev
	}
}

// dnsAnswered records a DNS response: open with records, refused without.
func dnsAnswered(r *Result, resp *dns.Msg, name, qtype, server string) {
	r.DNS.Answered = true
	r.DNS.Rcode = dns.RcodeToString[resp.Rcode]
	for i, rr := range resp.Answer {
		h := rr.Header()
		if i == 0 || h.Ttl < r.DNS.TTL {
			r.DNS.TTL = h.Ttl
		}
		data := strings.TrimSpace(strings.TrimPrefix(rr.String(), h.String()))
		r.DNS.Records = append(r.DNS.Records, fmt.Sprintf("%s %s %s", strings.TrimSuffix(h.Name, "."), dns.TypeToString[h.Rrtype], data))
	}
	if len(r.DNS.Records) > 0 {
		r.Outcome = Open
		r.Answer = strings.Join(r.DNS.Records, "; ")
		r.Evidence = fmt.Sprintf("%s %s: %s with %d record(s) from %s", name, qtype, r.DNS.Rcode, len(r.DNS.Records), server)
		return
	}
	r.Outcome = Refused
	r.Answer = r.DNS.Rcode
	r.Evidence = fmt.Sprintf("%s %s: resolver %s answered %s with no records", name, qtype, server, r.DNS.Rcode)
	if resp.Truncated {
		r.Evidence += " (truncated)"
	}
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.Is(err, context.DeadlineExceeded) || (errors.As(err, &ne) && ne.Timeout())
}
