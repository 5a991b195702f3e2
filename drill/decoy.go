package drill

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"runtime"
	"strings"
	"sync"

	"github.com/miekg/dns"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/claudebox/claudebox/boxcore"
	"github.com/claudebox/claudebox/drill/probes"
	"github.com/claudebox/claudebox/internal/addr4"
)

// Names of what the decoy puts on the host. Everything carries the run id, and the prefixes
// are what --cleanup sweeps.
const (
	NetnsPrefix = "cbdrill-" // network namespace cbdrill-<run>
	VethPrefix  = "cbdr"     // veth pair cbdr<run>h (host side) / cbdr<run>n (namespace side)
)

// Decoy ports: TCP and UDP echo like the probe agent, and TCP 80 for the metadata address.
const (
	DecoyTCP  = probes.DefaultTCPPort
	DecoyUDP  = probes.DefaultUDPPort
	DecoyHTTP = 80
)

// TestDomain is the domain the decoy DNS server answers; the bridge's dnsmasq forwards it
// (and the other names the drill asks about) to the decoy during a run.
const TestDomain = "claudebox-drill.test"

// DecoyTarget is one address the decoy namespace holds.
type DecoyTarget struct {
	Range string     `json:"range"` // "10.0.0.0/8", ..., "public"
	Addr  netip.Addr `json:"addr"`
	Ports []int      `json:"tcp_ports"`
}

// Decoy is the namespace of hosts we own: LAN, CGNAT, link-local and "public" addresses,
// and one "other network" address outside every blocked range. It is joined to the host
// by two veth pairs: the public side (the only one a drill admits as an uplink, so boxes
// reach the "internet" through it) and the LAN side (every other target: a non-uplink
// interface, like a LAN, another bridge or a VPN would be).
type Decoy struct {
	Run    string
	NS     string
	LAN    DecoyLink // every target but the public one
	Uplink DecoyLink // the public decoy only
	Public netip.Addr
	Other  netip.Addr // outside every blocked range, on a non-uplink interface
	// Forged is a source address a spoofing box may claim: nobody owns it, and the decoy
	// namespace blackholes answers to it, so they never leave it.
	Forged     netip.Addr
	Targets    []DecoyTarget
	PublicName string

	ns        netns.NsHandle
	listeners *probes.Listeners
	dnsSrv    []*dns.Server
	mu        sync.Mutex
	queries   []string
}

// decoyRanges are the ranges a box must never reach; one address at each edge of each.
var decoyRanges = boxcore.BlockedEgress

// publicRange is where the "public" decoy and the transfer net come from: RFC 2544's
// benchmarking range, which no real host on the internet uses.
const publicRange = "198.18.0.0/15"

// avoid is what an address must not collide with: host routes (non-default), host
// addresses and their subnets, the host's resolvers (with their /24, to stay clear).
type avoid struct {
	nets []netip.Prefix
}

func readAvoid() (avoid, error) {
	var a avoid
	claims, err := boxcore.HostClaims()
	if err != nil {
		return a, err
	}
	for _, c := range claims {
		if p, ok := prefixOf(c.Net); ok {
			a.nets = append(a.nets, p)
		}
	}
	if rs, err := boxcore.HostResolvers(); err == nil {
		for _, r := range rs {
			if ip, err := netip.ParseAddr(r); err == nil && ip.Is4() {
				a.nets = append(a.nets, netip.PrefixFrom(ip, 24).Masked())
			}
		}
	}
	return a, nil
}

func prefixOf(n *net.IPNet) (netip.Prefix, bool) {
	ip, ok := netip.AddrFromSlice(n.IP.To4())
	if !ok {
		return netip.Prefix{}, false
	}
	ones, _ := n.Mask.Size()
	return netip.PrefixFrom(ip, ones).Masked(), true
}

func (a avoid) free(ip netip.Addr) bool {
	for _, n := range a.nets {
		if n.Contains(ip) {
			return false
		}
	}
	return true
}

// pickEdges returns the low and high edge of a range (first and last usable address),
// stepping inward by 256 while an address collides with the host.
func pickEdges(cidr string, a avoid) ([]netip.Addr, error) {
	p := netip.MustParsePrefix(cidr)
	var out []netip.Addr
	for _, start := range []struct {
		ip   netip.Addr
		step int64
	}{{addr4.Add(p.Addr(), 1), 256}, {addr4.Add(addr4.Last(p), -1), -256}} {
		ip := start.ip
		for i := 0; i < 4096 && p.Contains(ip); i++ {
			if a.free(ip) {
				out = append(out, ip)
				break
			}
			ip = addr4.Add(ip, start.step)
		}
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("decoy: no free address in %s (the host routes all of it)", cidr)
	}
	if len(out) == 2 && out[0] == out[1] {
		out = out[:1]
	}
	return out, nil
}

// PlanDecoy picks the decoy's addresses for a run: nothing is created.
func PlanDecoy(run string) (*Decoy, error) {
	a, err := readAvoid()
	if err != nil {
		return nil, err
	}
	d := &Decoy{Run: run, NS: NetnsPrefix + run,
		LAN:    DecoyLink{HostVeth: VethPrefix + run + "h", NSVeth: VethPrefix + run + "n"},
		Uplink: DecoyLink{HostVeth: VethPrefix + run + "p", NSVeth: VethPrefix + run + "q"}}
	for _, r := range decoyRanges {
		edges, err := pickEdges(r, a)
		if err != nil {
			return nil, err
		}
		for _, e := range edges {
			d.Targets = append(d.Targets, DecoyTarget{Range: r, Addr: e, Ports: []int{DecoyTCP}})
		}
	}
	md := netip.MustParseAddr("169.254.169.254")
	if a.free(md) {
		d.Targets = append(d.Targets, DecoyTarget{Range: "169.254.0.0/16 (metadata)", Addr: md, Ports: []int{DecoyTCP, DecoyHTTP}})
	}
	// One free /24 of 198.18.0.0/15: .10 is the public decoy, .20 the other network,
	// .248/30 and .252/30 the transfer nets of the uplink and LAN sides.
	pub := netip.MustParsePrefix(publicRange)
	for ip := pub.Addr(); pub.Contains(ip); ip = addr4.Add(ip, 256) {
		p24 := netip.PrefixFrom(ip, 24)
		if a.free(ip) && a.free(addr4.Add(ip, 255)) && overlapsNone(p24, a) {
			d.Public, d.Other, d.Forged = addr4.Add(ip, 10), addr4.Add(ip, 20), addr4.Add(ip, 30)
			d.Uplink.HostAddr, d.Uplink.NSAddr = addr4.Add(ip, 249), addr4.Add(ip, 250)
			d.LAN.HostAddr, d.LAN.NSAddr = addr4.Add(ip, 253), addr4.Add(ip, 254)
			break
		}
	}
	if !d.Public.IsValid() {
		return nil, errors.New("decoy: no free /24 in " + publicRange)
	}
	d.Targets = append(d.Targets, DecoyTarget{Range: OtherNetRange, Addr: d.Other, Ports: []int{DecoyTCP}},
		DecoyTarget{Range: UplinkSubnetRange, Addr: d.Uplink.NSAddr, Ports: []int{DecoyTCP}},
		DecoyTarget{Range: "public", Addr: d.Public, Ports: []int{DecoyTCP}})
	d.PublicName = "public." + run + "." + TestDomain
	return d, nil
}

func overlapsNone(p netip.Prefix, a avoid) bool {
	for _, n := range a.nets {
		if n.Overlaps(p) {
			return false
		}
	}
	return true
}

// Up creates the namespace, the veth, the addresses and /32 routes, starts the responders
// and the DNS server inside the namespace, and verifies every decoy address is routed into
// the veth. On error whatever was made is removed.
func (d *Decoy) Up() (err error) {
	defer func() {
		if err != nil {
			d.Down()
		}
	}()
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	orig, err := netns.Get()
	if err != nil {
		return fmt.Errorf("decoy: current netns: %w", err)
	}
	defer orig.Close()
	ns, err := netns.NewNamed(d.NS) // switches this thread into it
	if err != nil {
		_ = netns.Set(orig)
		return fmt.Errorf("decoy: creating netns %s: %w", d.NS, err)
	}
	d.ns = ns
	if err := netns.Set(orig); err != nil {
		return fmt.Errorf("decoy: back to the host netns: %w", err)
	}

	nh, err := netlink.NewHandleAt(ns)
	if err != nil {
		return err
	}
	defer nh.Close()
	if lo, err := nh.LinkByName("lo"); err == nil {
		_ = nh.LinkSetUp(lo)
	}
	for _, l := range []DecoyLink{d.LAN, d.Uplink} {
		if err := l.up(ns, nh); err != nil {
			return err
		}
	}
	lan, _ := nh.LinkByName(d.LAN.NSVeth)
	for _, t := range d.Targets {
		if t.Range == UplinkSubnetRange {
			continue // the uplink side's own transfer address: on-link, no address or route to add
		}
		if err := nh.AddrAdd(lan, &netlink.Addr{IPNet: ipnet(t.Addr, 32)}); err != nil {
			return fmt.Errorf("decoy: address %s: %w", t.Addr, err)
		}
		if err := d.linkOf(t).route(t.Addr); err != nil {
			return err
		}
	}
	if err := nh.RouteAdd(&netlink.Route{Dst: ipnet(d.Forged, 32), Type: unix.RTN_BLACKHOLE}); err != nil {
		return fmt.Errorf("decoy: blackhole for the forged source %s: %w", d.Forged, err)
	}
	// Replies to what entered by either side: the LAN side is the default, the uplink's
	// transfer net is connected.
	if err := nh.RouteAdd(&netlink.Route{LinkIndex: lan.Attrs().Index, Gw: net.IP(d.LAN.HostAddr.AsSlice())}); err != nil {
		return fmt.Errorf("decoy: default route in %s: %w", d.NS, err)
	}

	// The public side's capture hears every frame the host forwards to the "internet": what
	// the NAT rows need (the source a packet left with, also for packets no socket accepts,
	// like a datagram with a wrong checksum). The host's end is that side's only sender.
	hostUp, err := netlink.LinkByName(d.Uplink.HostVeth)
	if err != nil {
		return fmt.Errorf("decoy: %s: %w", d.Uplink.HostVeth, err)
	}
	// Sockets are opened inside the namespace; the goroutines serving them run anywhere.
	if err := netns.Set(ns); err != nil {
		return err
	}
	err = d.serveInNS(hostUp.Attrs().HardwareAddr.String())
	if serr := netns.Set(orig); serr != nil {
		// This thread is in the wrong namespace: let it die with the lock held.
		panic(fmt.Sprintf("decoy: cannot return to the host netns: %v", serr))
	}
	if err != nil {
		return err
	}
	return d.VerifyRoutes()
}

func (d *Decoy) serveInNS(hostUplinkMAC string) error {
	tcp := []int{DecoyTCP, DecoyHTTP}
	ls, err := probes.Serve(context.Background(), probes.ListenerConfig{TCP: tcp, UDP: []int{DecoyUDP}, Banner: "claudebox-drill decoy",
		Capture: d.Uplink.NSVeth, CaptureAllow: []string{hostUplinkMAC}})
	if err != nil {
		return fmt.Errorf("decoy responders: %w", err)
	}
	d.listeners = ls
	pc, err := net.ListenPacket("udp4", net.JoinHostPort(d.Public.String(), "53"))
	if err != nil {
		return fmt.Errorf("decoy DNS: %w", err)
	}
	ln, err := net.Listen("tcp4", net.JoinHostPort(d.Public.String(), "53"))
	if err != nil {
		pc.Close()
		return fmt.Errorf("decoy DNS: %w", err)
	}
	h := dns.HandlerFunc(d.answer)
	for _, s := range []*dns.Server{{PacketConn: pc, Handler: h}, {Listener: ln, Handler: h}} {
		d.dnsSrv = append(d.dnsSrv, s)
		started := make(chan struct{})
		s.NotifyStartedFunc = func() { close(started) }
		go func() { _ = s.ActivateAndServe() }()
		<-started
	}
	return nil
}

// answer is the decoy resolver: the public test name has the public decoy address;
// everything else (the names the drill asks dnsmasq about) is NXDOMAIN. It answers the way
// the recursive resolver behind a real gateway does: not authoritative (dnsmasq passes the
// flag on, and the local-answers part drops authoritative answers to boxes).
func (d *Decoy) answer(w dns.ResponseWriter, req *dns.Msg) {
	m := new(dns.Msg)
	m.SetReply(req)
	m.RecursionAvailable = true
	found := false
	for _, q := range req.Question {
		d.mu.Lock()
		d.queries = append(d.queries, dns.TypeToString[q.Qtype]+" "+q.Name)
		d.mu.Unlock()
		if ttl, ok := d.publicTTL(q.Name); ok {
			found = true
			if q.Qtype == dns.TypeA {
				m.Answer = append(m.Answer, &dns.A{Hdr: dns.RR_Header{Name: q.Name, Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: ttl},
					A: net.IP(d.Public.AsSlice())})
			}
		}
	}
	if !found {
		m.Rcode = dns.RcodeNameError
	}
	_ = w.WriteMsg(m)
}

// publicTTL: the public name answers with a TTL of 1 s (no cache carries it from one matrix
// to the next); a cache name (CacheName) with CacheTTL, so that a cache is seen counting down.
func (d *Decoy) publicTTL(name string) (uint32, bool) {
	pub := dns.Fqdn(d.PublicName)
	switch {
	case strings.EqualFold(name, pub):
		return 1, true
	case strings.HasSuffix(strings.ToLower(name), "."+strings.ToLower(pub)) && strings.HasPrefix(strings.ToLower(name), cacheLabel):
		return CacheTTL, true
	}
	return 0, false
}

// CacheTTL is the TTL of a cache name; a fresh answer carries it whole.
const CacheTTL = 3600

const cacheLabel = "cache-"

// CacheName is a name under the public name that no one has asked before in this matrix
// (round): the cache row's sibling asks it first.
func CacheName(publicName string, round int) string {
	return fmt.Sprintf("%sr%d.%s", cacheLabel, round, publicName)
}

// Queries returns what the decoy resolver was asked, for evidence.
func (d *Decoy) Queries() []string {
	d.mu.Lock()
	defer d.mu.Unlock()
	return append([]string(nil), d.queries...)
}

// Hits returns who reached the decoy responders.
func (d *Decoy) Hits() []probes.Hit {
	if d.listeners == nil {
		return nil
	}
	return d.listeners.Hits()
}

// VerifyRoutes asks the kernel, for every decoy address, where it would send a packet: it
// must be the decoy veth of its side. Network manners: no probe may ever leave this machine.
func (d *Decoy) VerifyRoutes() error {
	for _, t := range d.Targets {
		want := d.linkOf(t).HostVeth
		host, err := netlink.LinkByName(want)
		if err != nil {
			return fmt.Errorf("decoy: veth %s is gone: %w", want, err)
		}
		rs, err := netlink.RouteGet(net.IP(t.Addr.AsSlice()))
		if err != nil || len(rs) == 0 {
			return fmt.Errorf("decoy: the host has no route to %s: %v", t.Addr, err)
		}
		if rs[0].LinkIndex != host.Attrs().Index {
			return fmt.Errorf("decoy: the host routes %s via interface %d, not the decoy veth %s: refusing to probe it", t.Addr, rs[0].LinkIndex, want)
		}
	}
	return nil
}

// OtherNetRange labels the decoy outside every blocked range, behind a non-uplink interface.
const OtherNetRange = "other local network"

// UplinkSubnetRange labels the decoy on the uplink's own subnet (the uplink side's transfer
// address, on-link on the admitted uplink): a host's LAN neighbours, its router included.
const UplinkSubnetRange = "the uplink's own subnet"

// DecoyLink is one veth pair between the host and the decoy namespace, with its /30.
type DecoyLink struct {
	HostVeth string     `json:"host_veth"`
	NSVeth   string     `json:"ns_veth"`
	HostAddr netip.Addr `json:"host_addr"`
	NSAddr   netip.Addr `json:"ns_addr"`
}

func (d *Decoy) linkOf(t DecoyTarget) DecoyLink {
	if t.Range == "public" || t.Range == UplinkSubnetRange {
		return d.Uplink
	}
	return d.LAN
}

// up creates the pair, moves one end into ns and addresses both ends.
func (l DecoyLink) up(ns netns.NsHandle, nh *netlink.Handle) error {
	veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: l.HostVeth}, PeerName: l.NSVeth}
	if err := netlink.LinkAdd(veth); err != nil {
		return fmt.Errorf("decoy: creating veth %s: %w", l.HostVeth, err)
	}
	peer, err := netlink.LinkByName(l.NSVeth)
	if err != nil {
		return err
	}
	if err := netlink.LinkSetNsFd(peer, int(ns)); err != nil {
		return fmt.Errorf("decoy: moving %s into the decoy netns: %w", l.NSVeth, err)
	}
	host, err := netlink.LinkByName(l.HostVeth)
	if err != nil {
		return err
	}
	if err := netlink.LinkSetAlias(host, VethAlias+" "+l.HostVeth); err != nil {
		return fmt.Errorf("decoy: marking %s: %w", l.HostVeth, err)
	}
	if err := netlink.AddrAdd(host, &netlink.Addr{IPNet: ipnet(l.HostAddr, 30)}); err != nil {
		return fmt.Errorf("decoy: address on %s: %w", l.HostVeth, err)
	}
	if err := netlink.LinkSetUp(host); err != nil {
		return err
	}
	// No IPv6 on the host side: it would only add link-local noise.
	_ = os.WriteFile("/proc/sys/net/ipv6/conf/"+l.HostVeth+"/disable_ipv6", []byte("1"), 0o644)
	nl, err := nh.LinkByName(l.NSVeth)
	if err != nil {
		return err
	}
	if err := nh.AddrAdd(nl, &netlink.Addr{IPNet: ipnet(l.NSAddr, 30)}); err != nil {
		return fmt.Errorf("decoy: transfer address: %w", err)
	}
	return nh.LinkSetUp(nl)
}

// route sends the host's traffic for addr into this side of the decoy.
func (l DecoyLink) route(addr netip.Addr) error {
	host, err := netlink.LinkByName(l.HostVeth)
	if err != nil {
		return err
	}
	r := &netlink.Route{LinkIndex: host.Attrs().Index, Dst: ipnet(addr, 32), Gw: net.IP(l.NSAddr.AsSlice())}
	if err := netlink.RouteAdd(r); err != nil {
		return fmt.Errorf("decoy: host route %s: %w", addr, err)
	}
	return nil
}

// Down stops the responders and removes the namespace and the veth (its routes go with it).
func (d *Decoy) Down() {
	for _, s := range d.dnsSrv {
		_ = s.Shutdown()
	}
	d.dnsSrv = nil
	if d.listeners != nil {
		_ = d.listeners.Close()
		d.listeners = nil
	}
	for _, v := range []string{d.LAN.HostVeth, d.Uplink.HostVeth} {
		if l, err := netlink.LinkByName(v); err == nil {
			_ = netlink.LinkDel(l)
		}
	}
	if d.ns != 0 {
		_ = d.ns.Close()
		d.ns = 0
	}
	_ = netns.DeleteNamed(d.NS)
}

func ipnet(ip netip.Addr, bits int) *net.IPNet {
	return &net.IPNet{IP: net.IP(ip.AsSlice()), Mask: net.CIDRMask(bits, 32)}
}

// ForwarderLine is the one line a run puts in the network's dnsmasq servers-file
// (boxcore.ServersFile; no re-apply): the test domain, the bridge's own
// DNS domain, unqualified names (//) and the bridge subnet's reverse zone go to the decoy
// resolver, so every name the drill asks about is answered on this machine (never by a
// real upstream), while dnsmasq still answers first from whatever it holds itself.
func ForwarderLine(domain string, subnet netip.Prefix, resolver netip.Addr) string {
	b := subnet.Masked().Addr().As4()
	rev := fmt.Sprintf("%d.%d.%d.in-addr.arpa", b[2], b[1], b[0])
	return fmt.Sprintf("server=/%s/%s//%s/%s", TestDomain, domain, rev, resolver)
}

// WindowMark is the value of the network's re-apply mark (boxcore.WithReapplyMark) that
// opens a window: a comment to dnsmasq, unique per window so the write is a real change. It
// stays after the run: changing it back would be a re-apply no flood measures.
func WindowMark(run string, gen int) string {
	return fmt.Sprintf("drill %s window %d", run, gen)
}

// windowLinePrefix started the window comment of older versions, which added it (and the
// forwarder) to raw.dnsmasq and removed both at the end: cleanup still removes them.
const windowLinePrefix = "# claudebox-drill"

// IsForwarderLine recognises the drill's lines (of any run): the forwarder, and the window
// comment older versions left in raw.dnsmasq.
func IsForwarderLine(l string) bool {
	l = strings.TrimSpace(l)
	return strings.HasPrefix(l, "server=/"+TestDomain+"/") || strings.HasPrefix(l, windowLinePrefix+" ")
}
