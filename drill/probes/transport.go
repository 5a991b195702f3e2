package probes

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptrace"
	"net/netip"
	"net/url"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"
	"unicode/utf8"

	"github.com/claudebox/claudebox/internal/netdump"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// bindControl returns a Dialer.Control that pins the socket to iface, so a probe
// "from eth0" cannot leave by another interface.
func bindControl(iface string) func(network, address string, c syscall.RawConn) error {
	if iface == "" {
		return nil
	}
	return udpControl(iface, false)
}

// udpControl is bindControl plus, for UDP, IP_RECVERR/IPV6_RECVERR: without
// it Linux hides ICMP net/host unreachable from a UDP socket (they are "soft"
// errors; only port unreachable is reported), and a rejecting firewall would
// look like silence.
func udpControl(iface string, recvErr bool) func(network, address string, c syscall.RawConn) error {
	return func(network, _ string, c syscall.RawConn) error {
		var serr error
		err := c.Control(func(fd uintptr) {
			if iface != "" {
				if e := unix.SetsockoptString(int(fd), unix.SOL_SOCKET, unix.SO_BINDTODEVICE, iface); e != nil {
					serr = fmt.Errorf("bind to device %q: %w", iface, e)
					return
				}
			}
			if recvErr {
				if strings.HasSuffix(network, "6") {
					serr = unix.SetsockoptInt(int(fd), unix.SOL_IPV6, unix.IPV6_RECVERR, 1)
				} else {
					serr = unix.SetsockoptInt(int(fd), unix.SOL_IP, unix.IP_RECVERR, 1)
				}
			}
		})
		if err != nil {
			return err
		}
		return serr
	}
}

// routeCheck asks the kernel how it would send to dst. A destination the box
// has no route for (or a local unreachable/prohibit/blackhole route) means the
// probe could not even leave: check-failed, not a verdict about the network.
func routeCheck(dst netip.Addr, iface string) (netlink.Route, error) {
	opts := &netlink.RouteGetOptions{Oif: iface}
	if iface == "" && dst.Zone() != "" {
		opts.Oif = dst.Zone()
	}
	rs, err := netlink.RouteGetWithOptions(net.IP(dst.WithZone("").AsSlice()), opts)
	if err != nil {
		return netlink.Route{}, fmt.Errorf("no route to %s from this box: %w", dst, err)
	}
	if len(rs) == 0 {
		return netlink.Route{}, fmt.Errorf("no route to %s from this box", dst)
	}
	return rs[0], nil
}

// neighbourFailed says whether the next hop towards dst has a failed or
// incomplete ARP/ND entry. Linux reports an unanswered who-has to the socket as
// EHOSTUNREACH, exactly like an ICMP host-unreachable from a router, but it
// means nobody answered at L2: silence, so "dropped", not "refused".
func neighbourFailed(dst netip.Addr, iface string) (bool, string) {
	rt, err := routeCheck(dst, iface)
	if err != nil {
		return false, ""
	}
	hop := dst.WithZone("")
	if rt.Gw != nil {
		if a, ok := netip.AddrFromSlice(rt.Gw); ok {
			hop = a.Unmap()
		}
	}
	family := netlink.FAMILY_V4
	if hop.Is6() {
		family = netlink.FAMILY_V6
	}
	ns, err := netdump.Neighs(rt.LinkIndex, family)
	if err != nil {
		return false, ""
	}
	for _, n := range ns {
		a, ok := netip.AddrFromSlice(n.IP)
		if !ok || a.Unmap() != hop {
			continue
		}
		if n.State&(netlink.NUD_FAILED|netlink.NUD_INCOMPLETE) != 0 {
			return true, hop.String()
		}
	}
	return false, ""
}

// classify maps a socket error to an outcome. The order matters: timeouts are
// silence; ECONNREFUSED is an RST or ICMP port-unreachable; EHOSTUNREACH and
// ENETUNREACH came from an ICMP unreachable (refused: the packet reached a
// router or a rejecting firewall) unless the kernel raised them itself because
// the next hop never answered ARP/ND (dropped); everything else means the
// probe itself broke (check-failed).
func classify(err error, dst netip.Addr, iface string) (Outcome, string) {
	var ne net.Error
	switch {
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, os.ErrDeadlineExceeded),
		errors.As(err, &ne) && ne.Timeout():
		if dst.IsValid() {
			if failed, hop := neighbourFailed(dst, iface); failed {
				return Dropped, fmt.Sprintf("no answer before the timeout; no ARP/ND reply from next hop %s", hop)
			}
		}
		return Dropped, "no answer before the timeout"
	case errors.Is(err, syscall.ECONNREFUSED):
		return Refused, "connection refused (TCP RST or ICMP port unreachable): " + err.Error()
	case errors.Is(err, syscall.EHOSTUNREACH), errors.Is(err, syscall.ENETUNREACH):
		if dst.IsValid() {
			if failed, hop := neighbourFailed(dst, iface); failed {
				return Dropped, fmt.Sprintf("no ARP/ND reply from next hop %s (%v)", hop, err)
			}
		}
		return Refused, "ICMP unreachable (a router or firewall rejected it): " + err.Error()
	case errors.Is(err, context.Canceled):
		return CheckFailed, "cancelled: " + err.Error()
	default:
		return CheckFailed, err.Error()
	}
}

func token() string {
	b := make([]byte, 8)
	_, _ = rand.Read(b)
	return "claudebox-probe-" + hex.EncodeToString(b)
}

func probeTCP(ctx context.Context, s Spec, r *Result) {
	dst, err := resolveTarget(ctx, s.Target, false)
	if err != nil {
		r.Outcome, r.Evidence = CheckFailed, err.Error()
		return
	}
	tcpConnect(ctx, s, dst, r)
}

// probeTCP6LL is TCP to an IPv6 link-local peer. The box must own a usable
// link-local address on the interface first: without one (IPv6 disabled) the
// probe cannot be made at all, which is check-failed with the reason; the
// engine decides what that means for the claim.
func probeTCP6LL(ctx context.Context, s Spec, r *Result) {
	dst, err := netip.ParseAddr(s.Target)
	if err != nil || !dst.Is6() || !dst.IsLinkLocalUnicast() {
		r.Outcome, r.Evidence = CheckFailed, fmt.Sprintf("target %q is not an IPv6 link-local address", s.Target)
		return
	}
	iface := s.Iface
	if iface == "" {
		iface = dst.Zone()
	}
	if iface == "" {
		iface = DefaultIface
	}
	if z := dst.Zone(); z != "" && z != iface {
		r.Outcome, r.Evidence = CheckFailed, fmt.Sprintf("target zone %q differs from iface %q", z, iface)
		return
	}
	dst = dst.WithZone(iface)
	if _, err := linkLocalOn(ctx, iface); err != nil {
		r.Outcome, r.Evidence = CheckFailed, err.Error()
		return
	}
	tcpConnect(ctx, s, dst, r)
}

// linkLocalOn returns a usable (non-tentative) link-local address on iface,
// waiting out DAD within the probe's deadline.
func linkLocalOn(ctx context.Context, iface string) (netip.Addr, error) {
	link, err := netlink.LinkByName(iface)
	if err != nil {
		return netip.Addr{}, fmt.Errorf("interface %q: %w", iface, err)
	}
	for {
		addrs, err := netdump.Addrs(link, netlink.FAMILY_V6)
		if err != nil {
			return netip.Addr{}, fmt.Errorf("listing IPv6 addresses of %s: %w", iface, err)
		}
		tentative := false
		for _, a := range addrs {
			ip, ok := netip.AddrFromSlice(a.IP)
			if !ok || !ip.IsLinkLocalUnicast() {
				continue
			}
			if a.Flags&(unix.IFA_F_TENTATIVE|unix.IFA_F_DADFAILED) != 0 {
				tentative = tentative || a.Flags&unix.IFA_F_TENTATIVE != 0
				continue
			}
			return ip.WithZone(iface), nil
		}
		if !tentative {
			return netip.Addr{}, fmt.Errorf("no IPv6 link-local address on %s (IPv6 disabled?): cannot probe link-local", iface)
		}
		select {
		case <-ctx.Done():
			return netip.Addr{}, fmt.Errorf("IPv6 link-local address on %s still tentative (DAD): cannot probe link-local", iface)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

func tcpConnect(ctx context.Context, s Spec, dst netip.Addr, r *Result) {
	if _, err := routeCheck(dst, s.Iface); err != nil {
		r.Outcome, r.Evidence = CheckFailed, err.Error()
		return
	}
	d := net.Dialer{Control: bindControl(s.Iface)}
	addr := netip.AddrPortFrom(dst, uint16(s.Port)).String()
	start := time.Now()
	c, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		r.Outcome, r.Evidence = classify(err, dst, s.Iface)
		if r.Outcome != Dropped {
			r.RTT = time.Since(start)
		}
		return
	}
	defer c.Close()
	r.RTT = time.Since(start)
	r.Outcome, r.Answer, r.Local = Open, c.RemoteAddr().String(), c.LocalAddr().String()
	r.Evidence = "connected"
	// A claudebox listener greets with a banner naming itself; read it briefly
	// as extra evidence of who answered, without waiting on silent servers.
	dl := time.Now().Add(150 * time.Millisecond)
	if d, ok := ctx.Deadline(); ok && d.Before(dl) {
		dl = d
	}
	_ = c.SetReadDeadline(dl)
	buf := make([]byte, 256)
	if n, _ := c.Read(buf); n > 0 {
		r.Evidence = "connected; banner: " + strings.TrimSpace(string(buf[:n]))
	}
}

// probeUDP sends a token and waits for the same bytes back. It resends a few
// times within the window because a single lost datagram must not turn a
// positive control into "dropped".
func probeUDP(ctx context.Context, s Spec, r *Result) {
	dst, err := routableTarget(ctx, s.Target, s.Iface)
	if err != nil {
		r.Outcome, r.Evidence = CheckFailed, err.Error()
		return
	}
	d := net.Dialer{Control: udpControl(s.Iface, true)}
	c, err := d.DialContext(ctx, "udp", netip.AddrPortFrom(dst, uint16(s.Port)).String())
	if err != nil {
		r.Outcome, r.Evidence = CheckFailed, err.Error()
		return
	}
	defer c.Close()
	r.Local = c.LocalAddr().String()
	payload := s.Payload
	if payload == "" {
		payload = token()
	}
	deadline, _ := ctx.Deadline()
	_ = c.SetReadDeadline(deadline)
	start := time.Now()
	send := func() error { _, err := c.Write([]byte(payload)); return err }
	if err := send(); err != nil {
		r.Outcome, r.Evidence = classify(err, dst, s.Iface)
		return
	}
	// Resend from a side goroutine; the reader owns the verdict.
	defer resendUntil(s.Timeout, func() { _ = send() })()
	buf := make([]byte, 2048)
	for {
		n, err := c.Read(buf)
		if err != nil {
			r.Outcome, r.Evidence = classify(err, dst, s.Iface)
			if r.Outcome != Dropped {
				r.RTT = time.Since(start)
			}
			return
		}
		r.RTT = time.Since(start)
		r.Answer = c.RemoteAddr().String()
		r.Outcome = Open
		if string(buf[:n]) == payload {
			r.Evidence = "echo matched"
		} else {
			r.Evidence = fmt.Sprintf("reply did not echo the token: %q", truncate(string(buf[:n]), 80))
		}
		return
	}
}

func resendInterval(timeout time.Duration) time.Duration {
	iv := timeout / 4
	if iv < 50*time.Millisecond {
		iv = 50 * time.Millisecond
	}
	return iv
}

// truncate keeps at most n bytes of s, cut on a rune boundary so evidence
// stays valid UTF-8.
func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n] + "..."
}

// probeHTTP does one GET without proxies or redirects: the status line is the
// answer. A connection that opened but got no response in time is still open
// (the packet arrived and was accepted), with that fact in the evidence.
func probeHTTP(ctx context.Context, s Spec, r *Result) {
	u := s.Target
	if !strings.Contains(u, "://") {
		path := s.Payload
		if path == "" || path[0] != '/' {
			path = "/" + path
		}
		host := s.Target
		if a, err := netip.ParseAddr(host); err == nil && a.Is6() {
			host = "[" + a.String() + "]"
		}
		u = "http://" + host + ":" + strconv.Itoa(s.Port) + path
	}
	pu, err := url.Parse(u)
	if err != nil || pu.Host == "" || (pu.Scheme != "http" && pu.Scheme != "https") {
		r.Outcome, r.Evidence = CheckFailed, fmt.Sprintf("bad URL %q", u)
		return
	}
	host := pu.Hostname()
	dst, err := routableTarget(ctx, host, s.Iface)
	if err != nil {
		r.Outcome, r.Evidence = CheckFailed, err.Error()
		return
	}
	port := pu.Port()
	if port == "" {
		port = map[string]string{"http": "80", "https": "443"}[pu.Scheme]
	}
	dialAddr := net.JoinHostPort(dst.String(), port)
	var connected atomic.Value
	d := &net.Dialer{Control: bindControl(s.Iface)}
	tr := &http.Transport{
		Proxy:             nil, // a proxy would answer for the target
		DisableKeepAlives: true,
		DialContext: func(ctx context.Context, network, _ string) (net.Conn, error) {
			return d.DialContext(ctx, network, dialAddr)
		},
	}
	defer tr.CloseIdleConnections()
	cl := &http.Client{
		Transport:     tr,
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
	}
	trace := &httptrace.ClientTrace{
		GotConn: func(i httptrace.GotConnInfo) {
			connected.Store(i.Conn.RemoteAddr().String() + " " + i.Conn.LocalAddr().String())
		},
	}
	req, err := http.NewRequestWithContext(httptrace.WithClientTrace(ctx, trace), http.MethodGet, u, nil)
	if err != nil {
		r.Outcome, r.Evidence = CheckFailed, err.Error()
		return
	}
	req.Header.Set("User-Agent", "claudebox-probe")
	start := time.Now()
	resp, err := cl.Do(req)
	if c, ok := connected.Load().(string); ok {
		remote, local, _ := strings.Cut(c, " ")
		r.Answer, r.Local = remote, local
	}
	if err != nil {
		if r.Answer != "" {
			r.Outcome, r.RTT = Open, time.Since(start)
			r.Evidence = "TCP connected but no HTTP response: " + err.Error()
			return
		}
		r.Outcome, r.Evidence = classify(err, dst, s.Iface)
		if r.Outcome != Dropped {
			r.RTT = time.Since(start)
		}
		return
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 200))
	r.RTT = time.Since(start)
	r.Outcome = Open
	r.Answer = resp.Proto + " " + resp.Status
	r.Evidence = fmt.Sprintf("from %s; body: %q", dialAddr, truncate(string(body), 120))
}

// resendUntil calls send every resendInterval(timeout) from a side goroutine until the
// returned stop is called, so one lost packet cannot make a positive control look dropped.
func resendUntil(timeout time.Duration, send func()) (stop func()) {
	done := make(chan struct{})
	go func() {
		t := time.NewTicker(resendInterval(timeout))
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-t.C:
				send()
			}
		}
	}()
	return func() { close(done) }
}
