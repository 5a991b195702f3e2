// Package addr4 is arithmetic on IPv4 addresses: stepping through a subnet, its last address.
package addr4

import "net/netip"

// Add is ip plus d (negative steps back), wrapping within IPv4.
func Add(ip netip.Addr, d int64) netip.Addr {
	b := ip.As4()
	v := int64(b[0])<<24 | int64(b[1])<<16 | int64(b[2])<<8 | int64(b[3])
	v += d
	return netip.AddrFrom4([4]byte{byte(v >> 24), byte(v >> 16), byte(v >> 8), byte(v)})
}

// Last is a prefix's last (broadcast) address.
func Last(p netip.Prefix) netip.Addr {
	return Add(p.Masked().Addr(), (int64(1)<<(32-p.Bits()))-1)
}
