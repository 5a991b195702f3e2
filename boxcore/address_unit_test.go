package boxcore

import (
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// new's address pick: the lowest host address that is neither the gateway nor reserved nor
// leased; none when the subnet is full.
func TestFreeAddress(t *testing.T) {
	gw := netip.MustParsePrefix("10.9.8.1/24")
	used := map[netip.Addr]bool{netip.MustParseAddr("10.9.8.2"): true, netip.MustParseAddr("10.9.8.4"): true}
	if a, ok := freeAddress(gw, used); !ok || a != netip.MustParseAddr("10.9.8.3") {
		t.Errorf("free: %v %v, want 10.9.8.3", a, ok)
	}
	small := netip.MustParsePrefix("10.9.8.2/30") // hosts .1 and .2; .0 and .3 are not hosts
	if a, ok := freeAddress(small, map[netip.Addr]bool{netip.MustParseAddr("10.9.8.1"): true}); ok {
		t.Errorf("a full /30: got %v, want none", a)
	}
	if a, ok := freeAddress(small, nil); !ok || a != netip.MustParseAddr("10.9.8.1") {
		t.Errorf("a /30 with its gateway at .2: %v %v, want 10.9.8.1", a, ok)
	}
	if b := lastAddr(netip.MustParsePrefix("10.9.8.77/22")); b != netip.MustParseAddr("10.9.11.255") {
		t.Errorf("broadcast of 10.9.8.0/22: %v", b)
	}
}

// The reservations and leases Incus's dnsmasq holds are the addresses and MACs in use.
func TestAddressesInUse(t *testing.T) {
	dir := t.TempDir()
	t.Setenv("INCUS_DIR", dir)
	hosts := filepath.Join(dir, "networks", "n1", "dnsmasq.hosts")
	if err := os.MkdirAll(hosts, 0o755); err != nil {
		t.Fatal(err)
	}
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.WriteFile(filepath.Join(hosts, "a.eth0"), []byte("10:66:6a:00:00:01,10.9.8.5\n"), 0o644))
	must(os.WriteFile(filepath.Join(hosts, "proj_b.eth0"), []byte("10:66:6a:00:00:02,10.9.8.6,b\n"), 0o644))
	must(os.WriteFile(filepath.Join(dir, "networks", "n1", "dnsmasq.leases"),
		[]byte("1796469458 10:66:6a:00:00:03 10.9.8.7 * *\nduid 00:01:00:01\n"), 0o644))
	ips, macs := addressesInUse("n1")
	for _, a := range []string{"10.9.8.5", "10.9.8.6", "10.9.8.7"} {
		if !ips[netip.MustParseAddr(a)] {
			t.Errorf("%s not in use: %v", a, ips)
		}
	}
	for _, m := range []string{"10:66:6a:00:00:01", "10:66:6a:00:00:02", "10:66:6a:00:00:03"} {
		if !macs[m] {
			t.Errorf("%s not in use: %v", m, macs)
		}
	}
	if m, err := freeMAC(macs); err != nil || macs[m.String()] || m[0] != 0x10 || m[1] != 0x66 || m[2] != 0x6a {
		t.Errorf("free MAC %v %v", m, err)
	}
}

// A box's eth0 may pin an IPv4 address (new's plan) and nothing else beyond the stack's NIC.
func TestIsBoxNICWithAddress(t *testing.T) {
	s := DefaultStack()
	d := BoxNIC(s, "b")
	d["ipv4.address"] = "10.87.0.9"
	if !IsBoxNIC(d, s, "b") || !IsBoxNIC(d, s, "") {
		t.Error("the box NIC with an IPv4 address is not the box NIC")
	}
	for _, bad := range []string{"", "fd00::9", "10.87.0.0/24", "nonsense"} {
		d["ipv4.address"] = bad
		if IsBoxNIC(d, s, "b") {
			t.Errorf("ipv4.address %q passes as the box NIC", bad)
		}
	}
}

// The bind stamp: its read time, and the token of the round that wrote it (older stamps
// carry none).
func TestBindStamp(t *testing.T) {
	p := filepath.Join(t.TempDir(), "stamp")
	if at, tok := lastFullBind(p); !at.IsZero() || tok != "" {
		t.Errorf("no stamp: %v %q", at, tok)
	}
	now := time.Now()
	for content, want := range map[string]string{"%d": "", "%d tok1": "tok1", "%d tok2\n": "tok2"} {
		if err := os.WriteFile(p, []byte(fmtInt(content, now.UnixNano())), 0o600); err != nil {
			t.Fatal(err)
		}
		if at, tok := lastFullBind(p); !at.Equal(time.Unix(0, now.UnixNano())) || tok != want {
			t.Errorf("stamp %q: %v %q, want %v %q", content, at, tok, now, want)
		}
	}
}

func fmtInt(format string, n int64) string {
	return strings.Replace(format, "%d", strconv.FormatInt(n, 10), 1)
}
