// Command rawsend writes raw Ethernet frames on an interface: the tests push it into a box to
// send what a hostile root in a box could (spoofed sources, VLAN tags, odd ethertypes).
//
//	rawsend IFACE HEXFRAME...   each frame is sent 5 times, 20 ms apart
package main

import (
	"encoding/hex"
	"fmt"
	"net"
	"os"
	"time"

	"golang.org/x/sys/unix"
)

func main() {
	if len(os.Args) < 3 {
		fmt.Fprintln(os.Stderr, "usage: rawsend IFACE HEXFRAME...")
		os.Exit(2)
	}
	ifi, err := net.InterfaceByName(os.Args[1])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW, 0) // protocol 0: send only
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	to := &unix.SockaddrLinklayer{Ifindex: ifi.Index, Halen: 6}
	for i := 0; i < 5; i++ {
		for _, h := range os.Args[2:] {
			b, err := hex.DecodeString(h)
			if err != nil {
				fmt.Fprintln(os.Stderr, err)
				os.Exit(2)
			}
			if err := unix.Sendto(fd, b, 0, to); err != nil {
				fmt.Fprintln(os.Stderr, err)
				os.Exit(1)
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
}
