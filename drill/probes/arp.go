package probes

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"time"

	"github.com/mdlayher/arp"
	"github.com/vishvananda/netlink"
)

// probeARP broadcasts who-has Target on the interface (default: the one the
// route to Target uses, else eth0) and waits for a reply from that address.
// There is no "refused" at L2: a reply is open, silence is dropped.
func probeARP(ctx context.Context, s Spec, r *Result) {
	dst, err := netip.ParseAddr(s.Target)
	if err != nil || !dst.Unmap().Is4() {
		r.Outcome, r.Evidence = CheckFailed, fmt.Sprintf("arp target %q is not an IPv4 address", s.Target)
		return
	}
	dst = dst.Unmap()
	iface := s.Iface
	if iface == "" {
		iface = DefaultIface
		if rt, err := routeCheck(dst, ""); err == nil {
			if l, err := netlink.LinkByIndex(rt.LinkIndex); err == nil {
				iface = l.Attrs().Name
			}
		}
	}
	ifi, err := net.InterfaceByName(iface)
	if err != nil {
		r.Outcome, r.Evidence = CheckFailed, fmt.Sprintf("interface %q: %v", iface, err)
		return
	}
	c, err := arp.Dial(ifi)
	if err != nil {
		r.Outcome, r.Evidence = CheckFailed, fmt.Sprintf("ARP socket on %s: %v", iface, err)
		return
	}
	defer c.Close()
	deadline, _ := ctx.Deadline()
	_ = c.SetReadDeadline(deadline)
	start := time.Now()
	if err := c.Request(dst); err != nil {
		r.Outcome, r.Evidence = CheckFailed, fmt.Sprintf("sending who-has %s on %s: %v", dst, iface, err)
		return
	}
	defer resendUntil(s.Timeout, func() { _ = c.Request(dst) })()
	for {
		p, _, err := c.Read()
		if err != nil {
			var ne net.Error
			if errors.Is(err, os.ErrDeadlineExceeded) || (errors.As(err, &ne) && ne.Timeout()) || ctx.Err() != nil {
				r.Outcome, r.Evidence = Dropped, fmt.Sprintf("no ARP reply for %s on %s", dst, iface)
				return
			}
			var oe *net.OpError
			if errors.As(err, &oe) || errors.Is(err, net.ErrClosed) {
				r.Outcome, r.Evidence = CheckFailed, err.Error()
				return
			}
			continue // a malformed frame on the wire is not our failure
		}
		if p.Operation != arp.OperationReply || p.SenderIP != dst {
			continue
		}
		r.Outcome, r.RTT, r.Answer = Open, time.Since(start), p.SenderHardwareAddr.String()
		r.Local = iface
		r.Evidence = fmt.Sprintf("%s is-at %s", dst, p.SenderHardwareAddr)
		return
	}
}
