package probes

import (
	"errors"
	"fmt"
	"net"
	"os"
	"time"

	"golang.org/x/sys/unix"
)

// packetConn is an AF_PACKET socket on one interface that sees every frame
// (ETH_P_ALL) and sends whole Ethernet frames as given: the active probes
// forge source MACs, VLAN tags and ARP fields the kernel's stack never would.
// Promiscuous while open, so a frame the bridge forwards to us for another
// MAC (a poisoned FDB) is seen too.
type packetConn struct {
	f   *os.File
	ifi *net.Interface
}

// Frame direction as the kernel reports it (sll_pkttype).
const (
	pktHost      = unix.PACKET_HOST
	pktBroadcast = unix.PACKET_BROADCAST
	pktMulticast = unix.PACKET_MULTICAST
	pktOtherHost = unix.PACKET_OTHERHOST
	pktOutgoing  = unix.PACKET_OUTGOING
)

func htons(v uint16) uint16 { return v<<8 | v>>8 }

func openPacket(iface string) (*packetConn, error) {
	ifi, err := net.InterfaceByName(iface)
	if err != nil {
		return nil, fmt.Errorf("interface %q: %w", iface, err)
	}
	fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, int(htons(unix.ETH_P_ALL)))
	if err != nil {
		return nil, fmt.Errorf("packet socket on %s: %w", iface, err)
	}
	if err := unix.Bind(fd, &unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_ALL), Ifindex: ifi.Index}); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("binding packet socket to %s: %w", iface, err)
	}
	mr := unix.PacketMreq{Ifindex: int32(ifi.Index), Type: unix.PACKET_MR_PROMISC}
	if err := unix.SetsockoptPacketMreq(fd, unix.SOL_PACKET, unix.PACKET_ADD_MEMBERSHIP, &mr); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("promiscuous mode on %s: %w", iface, err)
	}
	// A non-blocking fd makes os.File use the runtime poller: deadlines work.
	return &packetConn{f: os.NewFile(uintptr(fd), "packet:"+iface), ifi: ifi}, nil
}

func (p *packetConn) Close() error { return p.f.Close() }

func (p *packetConn) setDeadline(t time.Time) error { return p.f.SetReadDeadline(t) }

// send writes one whole Ethernet frame (header included).
func (p *packetConn) send(frame []byte) error {
	rc, err := p.f.SyscallConn()
	if err != nil {
		return err
	}
	var serr error
	err = rc.Write(func(fd uintptr) bool {
		serr = unix.Sendto(int(fd), frame, 0, &unix.SockaddrLinklayer{Ifindex: p.ifi.Index, Halen: 6})
		return !errors.Is(serr, unix.EAGAIN)
	})
	if err != nil {
		return err
	}
	return serr
}

// recv reads one frame and its direction; it returns os.ErrDeadlineExceeded
// at the deadline and net.ErrClosed (wrapped) once closed.
func (p *packetConn) recv(buf []byte) (int, uint8, error) {
	rc, err := p.f.SyscallConn()
	if err != nil {
		return 0, 0, err
	}
	var (
		n    int
		from unix.Sockaddr
		rerr error
	)
	err = rc.Read(func(fd uintptr) bool {
		n, from, rerr = unix.Recvfrom(int(fd), buf, 0)
		return !errors.Is(rerr, unix.EAGAIN)
	})
	if err != nil {
		if errors.Is(err, os.ErrClosed) {
			return 0, 0, net.ErrClosed
		}
		return 0, 0, err
	}
	if rerr != nil {
		return 0, 0, rerr
	}
	var pt uint8
	if ll, ok := from.(*unix.SockaddrLinklayer); ok {
		pt = ll.Pkttype
	}
	return n, pt, nil
}

// isDeadline reports a read that ended at its deadline (the normal end of a
// capture window), as opposed to a broken socket.
func isDeadline(err error) bool {
	return errors.Is(err, os.ErrDeadlineExceeded)
}
