package probes

// The test binary re-executes itself in a fresh network (and UTS) namespace,
// so every socket the probes open lives in a namespace made for the test and
// no packet can reach the host or any real network. From there it builds:
//
//	client (this process's namespace)   vc0 198.18.0.1/24 fe80::a  ── veth ──  vp0 198.18.0.2-.5/24 fe80::b   peer
//	box    (a PID-1 stand-in)           eth0 (DHCP)                ── veth ──  vp1 198.18.1.1/24 (dnsmasq)   peer
//
// Servers in the peer are created on a thread switched into it (sockets
// belong to the namespace they were created in), and child processes (nft,
// dnsmasq) are forked from such a thread, so they inherit it too.

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"syscall"
	"testing"
	"time"

	"github.com/miekg/dns"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

const reexecEnv = "CLAUDEBOX_PROBES_TEST_NETNS"

// topology is the shared test world, built once in TestMain.
var topo struct {
	peer, box  netns.NsHandle
	peerHits   string
	peerLis    *Listeners
	dir        string
	dnsmasq    *exec.Cmd
	dnsmasqLog string
	vp0MAC     string
}

func TestMain(m *testing.M) {
	if os.Getenv(detachedChild) == "1" && len(os.Args) > 1 && os.Args[1] == "probe" {
		// A detached run re-executes its binary: here, this test binary (TestDetachedRun).
		os.Exit(Main(os.Args[2:], os.Stdout, os.Stderr))
	}
	if os.Getenv(reexecEnv) != "1" {
		if os.Geteuid() != 0 {
			fmt.Println("drill/probes: tests need root (network namespaces); skipping")
			os.Exit(0)
		}
		cmd := exec.Command(os.Args[0], os.Args[1:]...)
		cmd.Env = append(os.Environ(), reexecEnv+"=1")
		cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
		cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWNET | syscall.CLONE_NEWUTS, Pdeathsig: syscall.SIGKILL}
		if err := cmd.Run(); err != nil {
			if ee, ok := err.(*exec.ExitError); ok {
				os.Exit(ee.ExitCode())
			}
			fmt.Fprintln(os.Stderr, "re-exec in a new network namespace:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	dir, err := os.MkdirTemp("", "cbprobe-test-")
	if err != nil {
		panic(err)
	}
	topo.dir = dir
	if err := setup(); err != nil {
		fmt.Fprintln(os.Stderr, "test topology:", err)
		teardown()
		os.Exit(1)
	}
	code := m.Run()
	teardown()
	os.Exit(code)
}

func teardown() {
	lanTeardown()
	if topo.dnsmasq != nil && topo.dnsmasq.Process != nil {
		_ = topo.dnsmasq.Process.Kill()
		_ = topo.dnsmasq.Wait()
	}
	if topo.peerLis != nil {
		_ = topo.peerLis.Close()
	}
	_ = os.RemoveAll(topo.dir)
}

// inNS runs f on a thread switched into ns. If switching back fails the
// thread stays locked, so Go retires it instead of reusing it elsewhere.
func inNS(ns netns.NsHandle, f func() error) error {
	runtime.LockOSThread()
	orig, err := netns.Get()
	if err != nil {
		runtime.UnlockOSThread()
		return err
	}
	defer orig.Close()
	if err := netns.Set(ns); err != nil {
		runtime.UnlockOSThread()
		return err
	}
	ferr := f()
	if err := netns.Set(orig); err != nil {
		return err
	}
	runtime.UnlockOSThread()
	return ferr
}

// newNS makes an anonymous namespace without leaving the caller in it.
func newNS() (netns.NsHandle, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	orig, err := netns.Get()
	if err != nil {
		return 0, err
	}
	defer orig.Close()
	ns, err := netns.New()
	if err != nil {
		return 0, err
	}
	if err := netns.Set(orig); err != nil {
		panic("cannot return to the test's namespace: " + err.Error())
	}
	return ns, nil
}

func writeSysctl(path, v string) error {
	return os.WriteFile(filepath.Join("/proc/sys", path), []byte(v), 0o644)
}

func addAddr(h *netlink.Handle, l netlink.Link, cidr string) error {
	a, err := netlink.ParseAddr(cidr)
	if err != nil {
		return err
	}
	if a.IP.To4() == nil {
		a.Flags = unix.IFA_F_NODAD // usable at once: no DAD wait in tests
	}
	return h.AddrAdd(l, a)
}

func setup() error {
	if err := unix.Sethostname([]byte("cbprobe-client")); err != nil {
		return err
	}
	var err error
	if topo.peer, err = newNS(); err != nil {
		return err
	}
	if topo.box, err = newNS(); err != nil {
		return err
	}
	h, _ := netlink.NewHandle()
	ph, err := netlink.NewHandleAt(topo.peer)
	if err != nil {
		return err
	}
	bh, err := netlink.NewHandleAt(topo.box)
	if err != nil {
		return err
	}
	for _, v := range []struct {
		name, peer string
		ns         netns.NsHandle
	}{{"vc0", "vp0", topo.peer}, {"eth0", "vp1", topo.peer}} {
		la := netlink.NewLinkAttrs()
		la.Name = v.name
		if err := h.LinkAdd(&netlink.Veth{LinkAttrs: la, PeerName: v.peer, PeerNamespace: netlink.NsFd(int(v.ns))}); err != nil {
			return fmt.Errorf("veth %s: %w", v.name, err)
		}
	}
	// eth0 goes into the box namespace, as Incus moves a NIC into a container.
	eth0, _ := h.LinkByName("eth0")
	if err := h.LinkSetNsFd(eth0, int(topo.box)); err != nil {
		return err
	}
	// dm0 stays down: an interface without an IPv6 link-local address. (A
	// veth, since this kernel has no dummy driver.)
	la := netlink.NewLinkAttrs()
	la.Name = "dm0"
	if err := h.LinkAdd(&netlink.Veth{LinkAttrs: la, PeerName: "dm1"}); err != nil {
		return fmt.Errorf("dm0: %w", err)
	}

	// Fast ARP/ND failure on the client side, so "nobody answers who-has" is
	// seen in ~0.3 s instead of 3 s.
	for _, p := range []string{"net/ipv4/neigh/vc0/retrans_time_ms", "net/ipv6/neigh/vc0/retrans_time_ms"} {
		if err := writeSysctl(p, "100"); err != nil {
			return err
		}
	}
	vc0, _ := h.LinkByName("vc0")
	for _, c := range []string{"198.18.0.1/24", "fe80::a/64", "fd00:cb::1/64"} {
		if err := addAddr(h, vc0, c); err != nil {
			return fmt.Errorf("vc0 %s: %w", c, err)
		}
	}
	lo, _ := h.LinkByName("lo")
	for _, l := range []netlink.Link{lo, vc0} {
		if err := h.LinkSetUp(l); err != nil {
			return err
		}
	}
	blo, _ := bh.LinkByName("lo")
	_ = bh.LinkSetUp(blo)

	vp0, _ := ph.LinkByName("vp0")
	topo.vp0MAC = vp0.Attrs().HardwareAddr.String()
	for _, c := range []string{"198.18.0.2/24", "198.18.0.3/24", "198.18.0.4/24", "198.18.0.5/24", "fe80::b/64"} {
		if err := addAddr(ph, vp0, c); err != nil {
			return fmt.Errorf("vp0 %s: %w", c, err)
		}
	}
	vp1, _ := ph.LinkByName("vp1")
	if err := addAddr(ph, vp1, "198.18.1.1/24"); err != nil {
		return err
	}
	plo, _ := ph.LinkByName("lo")
	for _, l := range []netlink.Link{plo, vp0, vp1} {
		if err := ph.LinkSetUp(l); err != nil {
			return err
		}
	}
	if err := inNS(topo.peer, startPeerServices); err != nil {
		return err
	}
	return waitIPv6Ready()
}

// waitIPv6Ready: a veth pair that has just come up does not carry IPv6 for
// a few hundred ms (addrconf waits for the link to be ready), so the first
// link-local probes of a short run failed. Wait until one connects.
func waitIPv6Ready() error {
	deadline := time.Now().Add(5 * time.Second)
	for {
		r := Run(context.Background(), Spec{Kind: KindTCP6LL, Target: "fe80::b", Port: 7001, Iface: "vc0", Timeout: 200 * time.Millisecond})
		if r.Outcome == Open {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("IPv6 link-local to the peer never came up: %s (%s)", r.Outcome, r.Evidence)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// peerRules: 7009 is silently dropped everywhere; 198.18.0.3 drops
// everything; 198.18.0.4 rejects everything with ICMP host-unreachable.
const peerRules = `table inet cbtest {
	chain input {
		type filter hook input priority 0; policy accept;
		tcp dport 7009 drop
		udp dport 7009 drop
		ip daddr 198.18.0.3 drop
		ip daddr 198.18.0.4 reject with icmp type host-unreachable
	}
}
`

// startPeerServices runs on a thread inside the peer namespace.
func startPeerServices() error {
	// ICMP errors are rate limited per destination; the batch sends many.
	for _, p := range []string{"net/ipv4/icmp_ratelimit", "net/ipv6/icmp/ratelimit"} {
		if err := writeSysctl(p, "0"); err != nil {
			return err
		}
	}
	nft := exec.Command("nft", "-f", "-")
	nft.Stdin = bytes.NewBufferString(peerRules)
	if out, err := nft.CombinedOutput(); err != nil {
		return fmt.Errorf("nft: %v: %s", err, out)
	}
	topo.peerHits = filepath.Join(topo.dir, "peer-hits.jsonl")
	ls, err := Serve(context.Background(), ListenerConfig{TCP: []int{7001}, UDP: []int{7002}, HitsFile: topo.peerHits})
	if err != nil {
		return err
	}
	topo.peerLis = ls

	// DNS: decoy.test A 198.18.0.50 (AAAA empty), refuse.test REFUSED, the
	// PTR of 198.18.0.50, NXDOMAIN otherwise; CHAOS: version.bind TXT,
	// servers.bind NOTIMP, other names REFUSED; port 5353 swallows queries.
	pc, err := net.ListenPacket("udp4", "198.18.0.2:53")
	if err != nil {
		return err
	}
	mux := dns.HandlerFunc(func(w dns.ResponseWriter, q *dns.Msg) {
		m := new(dns.Msg)
		m.SetReply(q)
		qq := q.Question[0]
		switch {
		case qq.Qclass == dns.ClassCHAOS && qq.Name == "version.bind.":
			rr, _ := dns.NewRR(`version.bind. 0 CH TXT "cbtest-1.0"`)
			m.Answer = append(m.Answer, rr)
		case qq.Qclass == dns.ClassCHAOS && qq.Name == "servers.bind.":
			m.Rcode = dns.RcodeNotImplemented // what dnsmasq's no-ident should look like
		case qq.Qclass == dns.ClassCHAOS:
			m.Rcode = dns.RcodeRefused
		case qq.Name == "decoy.test." && qq.Qtype == dns.TypeA:
			rr, _ := dns.NewRR("decoy.test. 60 IN A 198.18.0.50")
			m.Answer = append(m.Answer, rr)
		case qq.Name == "decoy.test.":
		case qq.Name == "50.0.18.198.in-addr.arpa." && qq.Qtype == dns.TypePTR:
			rr, _ := dns.NewRR("50.0.18.198.in-addr.arpa. 60 IN PTR decoy.test.")
			m.Answer = append(m.Answer, rr)
		case qq.Name == "refuse.test.":
			m.Rcode = dns.RcodeRefused
		default:
			m.Rcode = dns.RcodeNameError
		}
		_ = w.WriteMsg(m)
	})
	go func() { _ = (&dns.Server{PacketConn: pc, Handler: mux}).ActivateAndServe() }()
	silent, err := net.ListenPacket("udp4", "198.18.0.2:5353")
	if err != nil {
		return err
	}
	go func() {
		buf := make([]byte, 512)
		for {
			if _, _, err := silent.ReadFrom(buf); err != nil {
				return
			}
		}
	}()

	hl, err := net.Listen("tcp", "198.18.0.2:8080")
	if err != nil {
		return err
	}
	go func() {
		_ = http.Serve(hl, http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			_, _ = w.Write([]byte("decoy says hi"))
		}))
	}()

	// dnsmasq serves DHCP only (--port=0) on vp1 and logs the client's name.
	topo.dnsmasqLog = filepath.Join(topo.dir, "dnsmasq.log")
	dm := exec.Command("dnsmasq", "--no-daemon", "--conf-file=/dev/null", "--port=0",
		"--interface=vp1", "--bind-interfaces", "--except-interface=lo",
		"--dhcp-range=198.18.1.50,198.18.1.60,255.255.255.0,1h",
		"--dhcp-option=option:router,198.18.1.1", "--dhcp-option=option:dns-server,198.18.1.1",
		"--dhcp-option=option:domain-name,cbtest",
		"--dhcp-leasefile="+filepath.Join(topo.dir, "leases"),
		"--pid-file="+filepath.Join(topo.dir, "dnsmasq.pid"),
		"--log-dhcp", "--log-facility="+topo.dnsmasqLog, "--user=root", "--group=root")
	dm.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := dm.Start(); err != nil {
		return fmt.Errorf("dnsmasq: %w", err)
	}
	topo.dnsmasq = dm
	return nil
}

// waitFor polls cond until it holds or the time is up.
func waitFor(t *testing.T, within time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(within)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
