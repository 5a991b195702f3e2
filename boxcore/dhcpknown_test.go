package boxcore_test

import (
	"context"
	"encoding/binary"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/insomniacslk/dhcp/dhcpv4"
	"golang.org/x/sys/unix"

	"github.com/claudebox/claudebox/boxcore"
	"github.com/claudebox/claudebox/internal/testenv"
	"github.com/claudebox/claudebox/internal/teststack"
)

// dhcpReply is one BOOTREPLY dnsmasq sent out of the bridge.
type dhcpReply struct {
	Type   string
	YourIP string
	ChAddr string
	Msg    string
}

func (r dhcpReply) String() string {
	s := r.Type + " " + r.YourIP + " to " + r.ChAddr
	if r.Msg != "" {
		s += fmt.Sprintf(" (%q)", r.Msg)
	}
	return s
}

// dhcpReplies captures on the bridge while send runs (plus waitFor after it) and returns the
// DHCP replies whose transaction id is xid.
func dhcpReplies(t *testing.T, bridge string, xid dhcpv4.TransactionID, waitFor time.Duration, send func()) []dhcpReply {
	t.Helper()
	var out []dhcpReply
	captureWhile(t, bridge, waitFor, send, func(f []byte, _ *unix.SockaddrLinklayer) {
		if len(f) < 14+20+8 || binary.BigEndian.Uint16(f[12:]) != 0x0800 || f[14+9] != 17 {
			return
		}
		ihl := int(f[14]&0x0f) * 4
		udp := f[14+ihl:]
		if len(udp) < 8 || binary.BigEndian.Uint16(udp[0:]) != 67 || binary.BigEndian.Uint16(udp[2:]) != 68 {
			return
		}
		m, err := dhcpv4.FromBytes(udp[8:])
		if err != nil || m.OpCode != dhcpv4.OpcodeBootReply || m.TransactionID != xid {
			return
		}
		out = append(out, dhcpReply{m.MessageType().String(), m.YourIPAddr.String(), m.ClientHWAddr.String(), m.Message()})
	})
	return out
}

// dhcpFrame wraps a DHCP message in UDP/IPv4/Ethernet from a box's own MAC (NIC filtering
// checks only that) and source address, to dst.
func dhcpFrame(srcMAC net.HardwareAddr, src net.IP, dstMAC net.HardwareAddr, dst net.IP, m *dhcpv4.DHCPv4) frameCase {
	return frameCase{name: m.MessageType().String(), frame: ether(dstMAC, srcMAC, 0x0800, ipv4UDP(src, dst, 68, 67, m.ToBytes()))}
}

var bcastMAC = net.HardwareAddr{0xff, 0xff, 0xff, 0xff, 0xff, 0xff}

// leaseLines is dnsmasq's lease file for the stack, one line per lease.
func leaseLines(t *testing.T, network string) []string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(incusDir(), "networks", network, "dnsmasq.leases"))
	if err != nil {
		t.Fatal(err)
	}
	return strings.Fields(strings.ReplaceAll(strings.TrimSpace(string(b)), " ", "_"))
}

func incusDir() string {
	if d := os.Getenv("INCUS_DIR"); d != "" {
		return d
	}
	return "/var/lib/incus"
}

// TestDHCPKnownOnly measures the DHCP abuse NIC filtering lets through (a box asking leases
// for made-up chaddrs from its own MAC; releasing a sibling's lease; asking for a sibling's
// address) with dhcp-ignore=tag:!known switched off, then with it on (port binding, which
// holds the same rows in the bridge, off for both); and that real boxes still get their leases
// with it on and every layer back, after a restart too.
func TestDHCPKnownOnly(t *testing.T) {
	c := testenv.RequireIncus(t)
	ctx := context.Background()
	s := teststack.New(t, c, "dhcpknown")
	bs := &boxcore.Boxes{Client: c, Stack: s, Version: "test"}
	img := teststack.ProbeImage(t, c)
	nics := mintTwo(t, ctx, bs, img, "cbt-dhcpk")
	a, b := nics[0], nics[1]
	h := boxcore.NewHost(c, s)
	requireLayer(t, h, boxcore.LayerDHCPKnown, true)
	hosts, _ := filepath.Glob(filepath.Join(incusDir(), "networks", s.Network, "dnsmasq.hosts", "*"))
	for _, f := range hosts {
		body, _ := os.ReadFile(f)
		t.Logf("dhcp-host %s: %s", filepath.Base(f), strings.TrimSpace(string(body)))
	}
	br, err := net.InterfaceByName(s.Network)
	if err != nil {
		t.Fatal(err)
	}
	gw := net.ParseIP(strings.Split(mustNetwork(t, c, s.Network).Config["ipv4.address"], "/")[0]).To4()
	fake := net.HardwareAddr{0x02, 0xcb, 0xde, 0xad, 0xbe, 0xef}
	t.Logf("a %s %s, b %s %s, fake chaddr %s, leases %v", a.mac, a.ip, b.mac, b.ip, fake, leaseLines(t, s.Network))

	// exchange sends m from box `from` (its own MAC; from 0.0.0.0 to broadcast, or unicast
	// to the gateway from its own address) and returns the replies.
	exchange := func(from boxNIC, m *dhcpv4.DHCPv4, unicast bool) []dhcpReply {
		f := dhcpFrame(from.mac, net.IPv4zero, bcastMAC, net.IPv4bcast, m)
		if unicast {
			f = dhcpFrame(from.mac, from.ip, br.HardwareAddr, gw, m)
		}
		return dhcpReplies(t, s.Network, m.TransactionID, 4*time.Second, func() { sendFrom(t, c, from.name, []frameCase{f}) })
	}
	discoverFake := func() []dhcpReply {
		m, err := dhcpv4.NewDiscovery(fake, dhcpv4.WithBroadcast(true))
		if err != nil {
			t.Fatal(err)
		}
		return exchange(a, m, false)
	}
	requestFor := func(chaddr net.HardwareAddr, ip net.IP) *dhcpv4.DHCPv4 {
		m, err := dhcpv4.New(dhcpv4.WithMessageType(dhcpv4.MessageTypeRequest), dhcpv4.WithHwAddr(chaddr),
			dhcpv4.WithBroadcast(true), dhcpv4.WithOption(dhcpv4.OptRequestedIPAddress(ip)),
			dhcpv4.WithOption(dhcpv4.OptServerIdentifier(gw)))
		if err != nil {
			t.Fatal(err)
		}
		return m
	}
	releaseOf := func(victim boxNIC) *dhcpv4.DHCPv4 {
		m, err := dhcpv4.New(dhcpv4.WithMessageType(dhcpv4.MessageTypeRelease), dhcpv4.WithHwAddr(victim.mac),
			dhcpv4.WithClientIP(victim.ip), dhcpv4.WithOption(dhcpv4.OptServerIdentifier(gw)))
		if err != nil {
			t.Fatal(err)
		}
		return m
	}
	// renewal is b's own RENEWING request: unicast from its address, ciaddr set.
	renewal := func(n boxNIC) *dhcpv4.DHCPv4 {
		m, err := dhcpv4.New(dhcpv4.WithMessageType(dhcpv4.MessageTypeRequest), dhcpv4.WithHwAddr(n.mac), dhcpv4.WithClientIP(n.ip))
		if err != nil {
			t.Fatal(err)
		}
		return m
	}
	hasType := func(rs []dhcpReply, typ string) bool {
		for _, r := range rs {
			if r.Type == typ {
				return true
			}
		}
		return false
	}
	leaseOf := func(mac net.HardwareAddr) string {
		for _, l := range leaseLines(t, s.Network) {
			if strings.Contains(l, mac.String()) {
				return l
			}
		}
		return "none"
	}

	// Port binding drops a DHCP request whose chaddr is not the port's MAC before dnsmasq sees
	// it, and the L2 ranges' input chain again before the host does: both are off for both
	// measurements, so they measure dhcp-known-only alone.
	unbind, err := h.SwitchOff(ctx, []boxcore.Layer{boxcore.LayerPortBinding, boxcore.LayerL2Ranges}, nil)
	if err != nil {
		t.Fatalf("switch port binding and L2 ranges off: %v", err)
	}
	requireLayer(t, h, boxcore.LayerPortBinding, false)
	requireLayer(t, h, boxcore.LayerL2Ranges, false)

	// Without the option: today's behaviour.
	restore, err := h.SwitchOff(ctx, []boxcore.Layer{boxcore.LayerDHCPKnown}, nil)
	if err != nil {
		t.Fatalf("switch off: %v", err)
	}
	requireLayer(t, h, boxcore.LayerDHCPKnown, false)
	time.Sleep(time.Second) // dnsmasq restarted by the re-apply
	off := discoverFake()
	t.Logf("option off: DISCOVER chaddr %s from a: %v", fake, off)
	if !hasType(off, "OFFER") {
		t.Errorf("control: with the option off a fake chaddr got no OFFER (%v): the probe does not measure", off)
	}
	var offered net.IP
	for _, r := range off {
		if r.Type == "OFFER" {
			offered = net.ParseIP(r.YourIP)
		}
	}
	if offered != nil {
		ack := exchange(a, requestFor(fake, offered), false)
		t.Logf("option off: REQUEST %s for chaddr %s: %v; lease: %s", offered, fake, ack, leaseOf(fake))
	}
	steal := exchange(a, requestFor(fake, b.ip), false)
	t.Logf("option off: REQUEST b's %s for chaddr %s: %v", b.ip, fake, steal)
	if hasType(steal, "ACK") {
		t.Errorf("option off: a fake chaddr was given b's address %s: %v", b.ip, steal)
	}
	t.Logf("option off: b's lease before a's spoofed RELEASE: %s", leaseOf(b.mac))
	rel := exchange(a, releaseOf(b), true)
	t.Logf("option off: RELEASE of b (%s %s) sent by a: replies %v; b's lease after: %s", b.mac, b.ip, rel, leaseOf(b.mac))
	steal = exchange(a, requestFor(fake, b.ip), false)
	t.Logf("option off: after the release, REQUEST b's %s for chaddr %s: %v", b.ip, fake, steal)
	if hasType(steal, "ACK") {
		t.Errorf("option off: after the release a fake chaddr was given b's address: %v", steal)
	}
	ren := exchange(b, renewal(b), true)
	t.Logf("option off: b's own renewal after the release: %v; b's lease: %s", ren, leaseOf(b.mac))
	if !hasType(ren, "ACK") {
		t.Errorf("option off: b's renewal after a's spoofed release got no ACK: %v", ren)
	}
	if err := restore(ctx); err != nil {
		t.Fatalf("restore: %v", err)
	}
	requireLayer(t, h, boxcore.LayerDHCPKnown, true)
	time.Sleep(time.Second)

	// With the option.
	on := discoverFake()
	t.Logf("option on: DISCOVER chaddr %s from a: %v", fake, on)
	if len(on) > 0 {
		t.Errorf("option on: a fake chaddr got replies: %v", on)
	}
	steal = exchange(a, requestFor(fake, b.ip), false)
	t.Logf("option on: REQUEST b's %s for chaddr %s: %v", b.ip, fake, steal)
	if len(steal) > 0 {
		t.Errorf("option on: a request for b's address with a fake chaddr got replies: %v", steal)
	}
	t.Logf("option on: b's lease before a's spoofed RELEASE: %s", leaseOf(b.mac))
	rel = exchange(a, releaseOf(b), true)
	t.Logf("option on: RELEASE of b sent by a: replies %v; b's lease after: %s", rel, leaseOf(b.mac))
	steal = exchange(a, requestFor(fake, b.ip), false)
	t.Logf("option on: after the release, REQUEST b's %s for chaddr %s: %v", b.ip, fake, steal)
	if len(steal) > 0 {
		t.Errorf("option on: after the release a fake chaddr got replies: %v", steal)
	}
	ren = exchange(b, renewal(b), true)
	t.Logf("option on: b's own renewal after the release: %v; b's lease: %s", ren, leaseOf(b.mac))
	if !hasType(ren, "ACK") {
		t.Errorf("option on: b's renewal after a's spoofed release got no ACK: %v", ren)
	}
	// A request from a for its own address (a real client re-binding) is answered.
	own := exchange(a, requestFor(a.mac, a.ip), false)
	t.Logf("option on: a's own REQUEST for %s: %v", a.ip, own)
	if !hasType(own, "ACK") {
		t.Errorf("option on: a's request for its own address got no ACK: %v", own)
	}

	if err := unbind(ctx); err != nil {
		t.Fatalf("restore port binding and L2 ranges: %v", err)
	}
	requireLayer(t, h, boxcore.LayerPortBinding, true)
	requireLayer(t, h, boxcore.LayerL2Ranges, true)

	// Real boxes still lease after a restart, through the box verbs: start binds the new veth
	// Incus gives the box (a bare Incus start would leave the port binding stale, which check
	// rightly reports).
	restart := func(name string) {
		for _, op := range []string{"stop", "start"} {
			box, err := boxcore.Resolve(ctx, c, name)
			if err != nil {
				t.Fatal(err)
			}
			if op == "stop" {
				err = bs.Stop(ctx, box, true)
			} else {
				err = bs.Start(ctx, box)
			}
			if err != nil {
				t.Fatalf("%s %s: %v", op, name, err)
			}
		}
	}
	restart(a.name)
	start := time.Now()
	again := nicOf(t, c, a.name)
	t.Logf("option on: a restarted, lease %s after %s", again.ip, time.Since(start).Round(time.Millisecond))
	if !again.ip.Equal(a.ip) {
		t.Errorf("a's address changed over a restart: %s, was %s", again.ip, a.ip)
	}
	if r := mustCheck(t, h); !r.OK {
		t.Fatalf("check drifts: %v", driftItems(r))
	}
}
