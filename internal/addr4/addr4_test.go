package addr4

import (
	"net/netip"
	"testing"
)

func TestAddLast(t *testing.T) {
	if b := Last(netip.MustParsePrefix("10.9.8.77/22")); b != netip.MustParseAddr("10.9.11.255") {
		t.Errorf("broadcast of 10.9.8.0/22: %v", b)
	}
	if a := Add(netip.MustParseAddr("10.9.8.255"), 1); a != netip.MustParseAddr("10.9.9.0") {
		t.Errorf("10.9.8.255 + 1: %v", a)
	}
	if a := Add(netip.MustParseAddr("10.9.9.0"), -1); a != netip.MustParseAddr("10.9.8.255") {
		t.Errorf("10.9.9.0 - 1: %v", a)
	}
}
