package firewall

import (
	"fmt"
	"net"
	"net/netip"
	"testing"
)

// A bridge full of boxes binds every port in one batch: the kernel echoes each rule of it
// back before Apply reads a byte, and that must fit the socket's receive buffer (an 8-box
// bridge overflowed the default: "netlink receive: recvmsg: no buffer space available"; 64
// overflowed the send buffer: "sendmsg: message too long").
// A /24 holds 253 boxes.
func TestApplyFullBridge(t *testing.T) {
	t.Parallel()
	requireRoot(t)
	requireNft(t)
	freshNS(t)
	for _, n := range []int{8, 64, 253} {
		s := testSpec("cbt0")
		for i := range n {
			s.Ports = append(s.Ports, PortBinding{
				Port: fmt.Sprintf("veth%08x", i),
				MAC:  net.HardwareAddr{0x10, 0x66, 0x6a, 0, byte(i >> 8), byte(i)},
				IPv4: netip.AddrFrom4([4]byte{10, 77, 12, byte(i + 2)}),
			})
		}
		if _, err := Apply(s); err != nil {
			t.Fatalf("%d ports: %v", n, err)
		}
		requireClean(t, s)
		t.Logf("%d ports: %d rules", n, len(Desired(s.Resolved())))
	}
}
