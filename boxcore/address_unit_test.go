package boxcore

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/claudebox/claudebox/boxcore/incus"
	"github.com/claudebox/claudebox/firewall"
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
}

// fakeNetworkN1 points INCUS_DIR at a temporary tree holding network n1's dnsmasq.hosts/;
// write puts a file under n1's directory.
func fakeNetworkN1(t *testing.T) (write func(rel, content string)) {
	dir := filepath.Join(t.TempDir(), "networks", "n1")
	t.Setenv("INCUS_DIR", filepath.Dir(filepath.Dir(dir)))
	if err := os.MkdirAll(filepath.Join(dir, "dnsmasq.hosts"), 0o755); err != nil {
		t.Fatal(err)
	}
	return func(rel, content string) {
		t.Helper()
		if err := os.WriteFile(filepath.Join(dir, rel), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

// The reservations and leases Incus's dnsmasq holds are the addresses and MACs in use.
func TestAddressesInUse(t *testing.T) {
	write := fakeNetworkN1(t)
	write("dnsmasq.hosts/a.eth0", "10:66:6a:00:00:01,10.9.8.5\n")
	write("dnsmasq.hosts/proj_b.eth0", "10:66:6a:00:00:02,10.9.8.6,b\n")
	write("dnsmasq.leases", "1796469458 10:66:6a:00:00:03 10.9.8.7 * *\nduid 00:01:00:01\n")
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
		if err := os.WriteFile(p, []byte(fmt.Sprintf(content, now.UnixNano())), 0o600); err != nil {
			t.Fatal(err)
		}
		if at, tok := lastFullBind(p); !at.Equal(time.Unix(0, now.UnixNano())) || tok != want {
			t.Errorf("stamp %q: %v %q, want %v %q", content, at, tok, now, want)
		}
	}
}

// A reservation holding the plan's address for another MAC (or its MAC for another address)
// is another NIC's; the plan's own is not.
func TestAddressHeldBy(t *testing.T) {
	hosts := fakeNetworkN1(t)
	write := func(name, line string) { hosts("dnsmasq.hosts/"+name, line) }
	b := firewall.PortBinding{Port: "cbx1", MAC: net.HardwareAddr{0x10, 0x66, 0x6a, 0, 0, 1}, IPv4: netip.MustParseAddr("10.9.8.5")}
	write("mine.eth0", "10:66:6a:00:00:01,10.9.8.5\n")
	write("other.eth0", "10:66:6a:00:00:02,10.9.8.6\n")
	if by := addressHeldBy("n1", b); by != "" {
		t.Errorf("only its own reservation: held by %q", by)
	}
	write("other.eth0", "10:66:6a:00:00:02,10.9.8.5\n")
	if by := addressHeldBy("n1", b); by != "other" {
		t.Errorf("another MAC on its address: held by %q, want other", by)
	}
	write("other.eth0", "10:66:6a:00:00:01,10.9.8.9\n")
	if by := addressHeldBy("n1", b); by != "other" {
		t.Errorf("its MAC on another address: held by %q, want other", by)
	}
}

// Pending records: a live mint's is read, a dead one's is removed; a pending NIC never
// displaces a running NIC of another MAC on its port, and is unplugged until its veth is on
// the bridge.
func TestPending(t *testing.T) {
	network := "cbtunit" + strconv.Itoa(os.Getpid())
	t.Cleanup(func() { os.RemoveAll(pendingDir(network)) })
	b := firewall.PortBinding{Port: "cbxaaaa", MAC: net.HardwareAddr{0x10, 0x66, 0x6a, 0, 0, 1}, IPv4: netip.MustParseAddr("10.9.8.5")}
	if err := writePending(network, "live", b); err != nil {
		t.Fatal(err)
	}
	dead := filepath.Join(pendingDir(network), "dead")
	if err := os.WriteFile(dead, []byte("cbxbbbb 10:66:6a:00:00:02 10.9.8.6 999999999 1\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	got := readPendings(network)
	if len(got) != 1 || got[0].Box != "live" || got[0].Binding.String() != b.String() {
		t.Errorf("pendings %+v, want the live one alone", got)
	}
	if _, err := os.Stat(dead); !os.IsNotExist(err) {
		t.Errorf("a dead mint's record is still there (%v)", err)
	}

	st := &StackState{NICs: []NICBinding{{Box: "holder", Binding: firewall.PortBinding{Port: "cbxaaaa", MAC: net.HardwareAddr{0x10, 0x66, 0x6a, 9, 9, 9}, IPv4: netip.MustParseAddr("10.9.8.7")}}}}
	st.mergePending(got, map[string]bool{"cbxaaaa": true})
	if len(st.NICs) != 1 || st.NICs[0].Box != "holder" {
		t.Errorf("a pending NIC displaced a running one of another MAC: %+v", st.NICs)
	}
	st = &StackState{}
	st.mergePending(got, map[string]bool{})
	if len(st.NICs) != 1 || !st.Unplugged["cbxaaaa"] {
		t.Errorf("a pending NIC before its veth: %+v, unplugged %v", st.NICs, st.Unplugged)
	}
	removePending(network, "live")
	if got := readPendings(network); len(got) != 0 {
		t.Errorf("after the mint's end: %+v", got)
	}
}

// A verb's own NIC left unbound because it shares its address is the verb's error.
func TestOwnBindErrorShared(t *testing.T) {
	st := &StackState{NICs: []NICBinding{{Box: "a", Device: "eth0", Problem: "shares its MAC or address with b"}, {Box: "b", Device: "eth0", Problem: "shares its MAC or address with a"}}}
	if err := ownBindError(st, "a", nil); err == nil || !strings.Contains(err.Error(), "shares") {
		t.Errorf("own NIC sharing: %v, want an error", err)
	}
	if err := ownBindError(st, "c", nil); err != nil {
		t.Errorf("another box's NICs: %v", err)
	}
}

// A create whose wait is answered "Operation not found" has ended (the daemon keeps every
// running operation on record): it succeeded if the instance carries this mint's token.
func TestCreateOperationGone(t *testing.T) {
	token := "tok-mine"
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch {
		case r.Method == http.MethodPost && r.URL.Path == "/1.0/instances":
			w.WriteHeader(http.StatusAccepted)
			json.NewEncoder(w).Encode(map[string]any{"type": "async", "status": "Operation created", "status_code": 100, "operation": "/1.0/operations/op1", "metadata": map[string]any{"id": "op1"}})
		case strings.HasPrefix(r.URL.Path, "/1.0/operations/op1/wait"):
			w.WriteHeader(http.StatusNotFound)
			json.NewEncoder(w).Encode(map[string]any{"type": "error", "error": "Operation not found", "error_code": 404})
		case r.URL.Path == "/1.0/instances/mine":
			json.NewEncoder(w).Encode(map[string]any{"type": "sync", "status": "Success", "status_code": 200, "metadata": incus.Instance{Name: "mine", Config: map[string]string{tagMint: token}}})
		case r.URL.Path == "/1.0/instances/other":
			json.NewEncoder(w).Encode(map[string]any{"type": "sync", "status": "Success", "status_code": 200, "metadata": incus.Instance{Name: "other", Config: map[string]string{tagMint: "someone else's"}}})
		default:
			w.WriteHeader(http.StatusNotFound)
			json.NewEncoder(w).Encode(map[string]any{"type": "error", "error": "not found", "error_code": 404})
		}
	}))
	defer srv.Close()
	bs := &Boxes{Client: incus.NewHTTPClient(srv.URL, srv.Client())}
	ctx := context.Background()
	req := func(name string) incus.InstancesPost {
		return incus.InstancesPost{Name: name, Config: map[string]string{tagMint: token}}
	}
	if err := bs.create(ctx, req("mine"), nil); err != nil {
		t.Errorf("the instance with this mint's token: %v, want the create done", err)
	}
	for _, name := range []string{"other", "gone"} {
		if err := bs.create(ctx, req(name), nil); err == nil {
			t.Errorf("%s: the create reported done, want the wait's error", name)
		}
	}
}

// finishMint removes the marker with one PATCH conditional on the read that found it this
// mint's: a box changed since a read made ahead, or a read with no ETag, is read again once;
// a marker not this mint's is never removed.
func TestFinishMint(t *testing.T) {
	token := "tok-mine"
	var mu sync.Mutex
	etag, patches := "v1", map[string][]string{}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		defer mu.Unlock()
		name := strings.TrimPrefix(r.URL.Path, "/1.0/instances/")
		mint := map[string]string{"mine": token, "changed": token, "other": "someone else's"}[name]
		switch r.Method {
		case http.MethodGet:
			w.Header().Set("ETag", etag)
			json.NewEncoder(w).Encode(map[string]any{"type": "sync", "status": "Success", "status_code": 200, "metadata": incus.Instance{Name: name, Config: map[string]string{tagMint: mint}}})
		case http.MethodPatch:
			patches[name] = append(patches[name], r.Header.Get("If-Match"))
			if r.Header.Get("If-Match") != etag {
				w.WriteHeader(http.StatusPreconditionFailed)
				json.NewEncoder(w).Encode(map[string]any{"type": "error", "error": "ETag doesn't match", "error_code": 412})
				return
			}
			json.NewEncoder(w).Encode(map[string]any{"type": "sync", "status": "Success", "status_code": 200, "metadata": map[string]any{}})
		}
	}))
	defer srv.Close()
	bs := &Boxes{Client: incus.NewHTTPClient(srv.URL, srv.Client())}
	ctx := context.Background()
	stale := func(etag string) <-chan instanceRead {
		c := make(chan instanceRead, 1)
		c <- instanceRead{in: incus.Instance{Config: map[string]string{tagMint: token}}, etag: etag}
		return c
	}
	if err := bs.finishMint(ctx, "mine", token, bs.readAhead(ctx, "mine")); err != nil {
		t.Errorf("read ahead, unchanged: %v", err)
	}
	if err := bs.finishMint(ctx, "changed", token, stale("v0")); err != nil {
		t.Errorf("changed since the read ahead: %v, want it read again and finished", err)
	}
	if err := bs.finishMint(ctx, "mine", token, stale("")); err != nil {
		t.Errorf("a read ahead with no ETag: %v, want it read again and finished", err)
	}
	if err := bs.finishMint(ctx, "other", token, nil); err == nil {
		t.Error("another mint's marker: finished, want refused")
	}
	want := map[string][]string{"mine": {"v1", "v1"}, "changed": {"v0", "v1"}}
	if fmt.Sprint(patches) != fmt.Sprint(want) {
		t.Errorf("PATCH If-Match per box: %v, want %v", patches, want)
	}
}
