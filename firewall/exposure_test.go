package firewall

import (
	"errors"
	"net"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
)

// TestExposureRules: with a host port in Exposed, a listener on every address of the host
// (the exposure's own loopback listen switched off) answers at 127.0.0.1 and [::1] only; the
// control, without the port in Exposed, answers at the host's other address too.
func TestExposureRules(t *testing.T) {
	requireRoot(t)
	requireNft(t)
	ns := freshNS(t)
	h := handle(t, ns)
	link := &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: "cbexp0"}} // a bridge: not every kernel has the dummy driver
	must(t, h.LinkAdd(link))
	addr, _ := netlink.ParseAddr("10.77.12.1/24")
	must(t, h.AddrAdd(link, addr))
	must(t, h.LinkSetUp(link))
	l, err := net.Listen("tcp", ":0") // every address, both families
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	port := uint16(l.Addr().(*net.TCPAddr).Port)
	reach := func(host string) bool {
		c, err := net.DialTimeout("tcp", net.JoinHostPort(host, itoa(port)), 300*time.Millisecond)
		if err == nil {
			c.Close()
		}
		return err == nil
	}
	s := testSpec("cbexp0")
	apply(t, s, true)
	for _, host := range []string{"127.0.0.1", "::1", "10.77.12.1"} {
		if !reach(host) {
			t.Fatalf("control: %s:%d unreachable with no exposure rule", host, port)
		}
	}
	s.Exposed = []uint16{port}
	apply(t, s, true)
	requireClean(t, s)
	for host, want := range map[string]bool{"127.0.0.1": true, "::1": true, "10.77.12.1": false} {
		if got := reach(host); got != want {
			t.Errorf("exposed port %d at %s: reachable %v, want %v", port, host, got, want)
		}
	}
	// Refused (a reset), as when nothing listens there: the port looks closed either way.
	if _, err := net.DialTimeout("tcp", net.JoinHostPort("10.77.12.1", itoa(port)), 2*time.Second); !errors.Is(err, syscall.ECONNREFUSED) {
		t.Errorf("exposed port %d at 10.77.12.1: %v, want connection refused", port, err)
	}
}

func itoa(p uint16) string { return strconv.Itoa(int(p)) }
