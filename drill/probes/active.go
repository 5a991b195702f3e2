package probes

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strings"
	"time"

	"github.com/vishvananda/netlink"
)

// Dur is a duration that reads and writes JSON as a Go duration string
// ("1500ms") and also reads a number of nanoseconds.
type Dur time.Duration

// D is the plain time.Duration.
func (d Dur) D() time.Duration { return time.Duration(d) }

func (d Dur) MarshalJSON() ([]byte, error) { return json.Marshal(time.Duration(d).String()) }

func (d *Dur) UnmarshalJSON(b []byte) error {
	v, err := parseDurationJSON(b)
	*d = Dur(v)
	return err
}

// parseDurationJSON accepts a duration string, a number of nanoseconds, or null.
func parseDurationJSON(raw []byte) (time.Duration, error) {
	raw = bytes.TrimSpace(raw)
	switch {
	case len(raw) == 0 || string(raw) == "null":
		return 0, nil
	case raw[0] == '"':
		var str string
		if err := json.Unmarshal(raw, &str); err != nil || str == "" {
			return 0, err
		}
		return time.ParseDuration(str)
	default:
		var n int64
		if err := json.Unmarshal(raw, &n); err != nil {
			return 0, fmt.Errorf("want a duration string or nanoseconds: %w", err)
		}
		return time.Duration(n), nil
	}
}

// FloodSpec is the flood kind: for Duration, one UDP datagram every UDPEvery
// round-robin over UDP, and one TCP connect every TCPEvery round-robin over
// TCP (targets "addr:port"). Spec.Timeout defaults to Duration + 1s (the
// tail waits for late echoes and connects).
type FloodSpec struct {
	Duration Dur      `json:"duration"`
	UDP      []string `json:"udp,omitempty"`
	TCP      []string `json:"tcp,omitempty"`
	UDPEvery Dur      `json:"udp_every,omitempty"` // default 1ms
	TCPEvery Dur      `json:"tcp_every,omitempty"` // default 20ms
}

// SpoofSpec is spoof-udp, arp-spoof and mac-spoof. Each of them keeps sending
// for the whole Spec.Timeout while it captures on the interface.
type SpoofSpec struct {
	// SrcIP: spoof-udp sends from this address (a sibling's, or any).
	SrcIP   string `json:"src_ip,omitempty"`
	SrcPort int    `json:"src_port,omitempty"` // spoof-udp; default 40000
	// BadChecksum: spoof-udp sends a wrong UDP checksum. Conntrack calls such a packet
	// invalid, and no NAT chain ever sees an invalid packet: it leaves as it was sent.
	BadChecksum bool `json:"bad_checksum,omitempty"`
	// TimestampOption: spoof-udp's IPv4 header carries an empty timestamp option (flag 1):
	// every router on the way writes in the address it received the packet by.
	TimestampOption bool `json:"timestamp_option,omitempty"`
	// ErrorAbout: spoof-udp sends, instead of a datagram, an ICMP port unreachable about the
	// UDP flow it names ("SRC:PORT>DST:PORT", as the flow's peer would have sent it), the
	// marker after the quoted header.
	ErrorAbout string `json:"error_about,omitempty"`
	// VictimIP: arp-spoof claims it (is-at our MAC); mac-spoof also counts
	// frames to it. VictimMAC: mac-spoof sends from it and counts frames to it.
	VictimIP  string `json:"victim_ip,omitempty"`
	VictimMAC string `json:"victim_mac,omitempty"`
}

// DHCPSpec is dhcp-release, dhcp-steal and dhcp-fake-mac.
type DHCPSpec struct {
	// Server: the DHCP server's address (default: this box's IPv4 gateway).
	Server string `json:"server,omitempty"`
	// VictimIP, VictimMAC: the sibling's lease (release: both required;
	// steal: VictimIP). ClientID: hex of the victim's option 61, if it sends one.
	VictimIP  string `json:"victim_ip,omitempty"`
	VictimMAC string `json:"victim_mac,omitempty"`
	ClientID  string `json:"client_id,omitempty"`
	// AskMAC: chaddr of the request for the victim's address (release,
	// steal); default a fresh random MAC, a client the server never saw.
	AskMAC string `json:"ask_mac,omitempty"`
	// FakeMAC: dhcp-fake-mac's chaddr and frame source (default random).
	FakeMAC string `json:"fake_mac,omitempty"`
	// OwnFrame: dhcp-fake-mac sends from the box's own MAC, only the chaddr is fake (what
	// NIC filtering, which checks the frame's source, lets through).
	OwnFrame bool `json:"own_frame,omitempty"`
}

// Frame variants (FrameSpec.Variant).
const (
	FrameVLAN0IPv4      = "vlan0-ipv4"       // priority-tagged IPv4 UDP broadcast to Port
	FrameVLAN0IPv6      = "vlan0-ipv6"       // priority-tagged IPv6 UDP to ff02::1, Port
	FrameVLAN0DHCPOffer = "vlan0-dhcp-offer" // priority-tagged rogue DHCPOFFER, broadcast
	FrameVLAN0RA        = "vlan0-ra"         // priority-tagged router advertisement, 2001:db8:cb00::/64
	FrameEthertype      = "ethertype"        // EtherExperimental (0x88B5) with the marker
	FrameLinkLocalUDP   = "ll-udp"           // IPv4 UDP to TargetIP:Port in a frame to an 802.1 link-local group MAC
	FrameARPZero        = "arp-zero"         // ARP who-has TargetIP from sender 0.0.0.0
)

// FrameVariants lists the variants in doc order.
var FrameVariants = []string{FrameVLAN0IPv4, FrameVLAN0IPv6, FrameVLAN0DHCPOffer, FrameVLAN0RA, FrameEthertype, FrameARPZero, FrameLinkLocalUDP}

// FrameSpec is the frame kind: one variant, sent a few times to DstMAC.
type FrameSpec struct {
	Variant string `json:"variant"`
	// DstMAC: the frame's destination (default broadcast; RA/IPv6 use the
	// all-nodes group MAC when empty).
	DstMAC string `json:"dst_mac,omitempty"`
	// TargetIP: arp-zero's who-has; vlan0-dhcp-offer's yiaddr.
	TargetIP string `json:"target_ip,omitempty"`
	// Port: UDP destination of vlan0-ipv4/ipv6 and ll-udp (default DefaultUDPPort, the
	// listeners' echo port, so an echo proves delivery).
	Port int `json:"port,omitempty"`
	// SrcIP: ll-udp's and vlan0-ipv4's IPv4 source (default our own address): a sibling's,
	// to reflect a host service's answer into it, or one outside the box subnet.
	SrcIP string `json:"src_ip,omitempty"`
}

// Counts is what an active kind sent and saw.
type Counts struct {
	Marker     string `json:"marker,omitempty"`
	Sent       int    `json:"sent"`
	SendErrors int    `json:"send_errors,omitempty"`
	// flood
	TCPAttempts  int `json:"tcp_attempts,omitempty"`
	TCPConnected int `json:"tcp_connected,omitempty"`
	TCPRefused   int `json:"tcp_refused,omitempty"`
	UDPEchoes    int `json:"udp_echoes,omitempty"`
	// Through lists the flood targets that connected or echoed.
	Through []string `json:"through,omitempty"`
	// Replies: frames carrying our marker (or answering our ARP) that came
	// back to this box (spoof-udp, frame).
	Replies int `json:"replies,omitempty"`
	// Captured: frames for the victim (its IP or MAC) seen on our interface
	// (arp-spoof, mac-spoof).
	Captured int `json:"captured,omitempty"`
	// FirstSeen describes the first reply/captured frame.
	FirstSeen string `json:"first_seen,omitempty"`
}

// DHCPReply is the deciding DHCP reply.
type DHCPReply struct {
	Type    string `json:"type"`              // OFFER, ACK, NAK
	YourIP  string `json:"your_ip,omitempty"` // yiaddr
	ChAddr  string `json:"chaddr"`
	Server  string `json:"server,omitempty"` // option 54
	Message string `json:"message,omitempty"`
}

func parseMAC(name, v string, required bool) error {
	if v == "" {
		if required {
			return fmt.Errorf("%s is empty", name)
		}
		return nil
	}
	if m, err := net.ParseMAC(v); err != nil || len(m) != 6 {
		return fmt.Errorf("%s %q is not an Ethernet MAC", name, v)
	}
	return nil
}

func parseIPv4(name, v string, required bool) error {
	if v == "" {
		if required {
			return fmt.Errorf("%s is empty", name)
		}
		return nil
	}
	if a, err := netip.ParseAddr(v); err != nil || !a.Unmap().Is4() {
		return fmt.Errorf("%s %q is not an IPv4 address", name, v)
	}
	return nil
}

func (s Spec) validateActive() error {
	err := s.validateActiveFields()
	if err != nil {
		return fmt.Errorf("%s probe: %w", s.Kind, err)
	}
	return nil
}

func (s Spec) validateActiveFields() error {
	switch s.Kind {
	case KindFlood:
		return s.Flood.validate(s.Timeout)
	case KindSpoofUDP, KindARPSpoof, KindMACSpoof:
		return s.validateSpoof()
	case KindDHCPRelease, KindDHCPSteal, KindDHCPFakeMAC, KindDHCPRelay:
		return s.validateDHCP()
	case KindFrame:
		return s.validateFrame()
	}
	return errors.New("not an active kind")
}

func (f *FloodSpec) validate(timeout time.Duration) error {
	if f == nil || f.Duration <= 0 {
		return errors.New("flood.duration must be > 0")
	}
	if len(f.UDP)+len(f.TCP) == 0 {
		return errors.New("flood has no udp or tcp targets")
	}
	for _, t := range append(append([]string{}, f.UDP...), f.TCP...) {
		if _, err := netip.ParseAddrPort(t); err != nil {
			return fmt.Errorf("flood target %q: want addr:port", t)
		}
	}
	if f.UDPEvery < 0 || f.TCPEvery < 0 {
		return errors.New("flood intervals must be >= 0")
	}
	if timeout != 0 && timeout <= f.Duration.D() {
		return fmt.Errorf("timeout %v must exceed flood.duration %v", timeout, f.Duration.D())
	}
	return nil
}

func (s Spec) validateSpoof() error {
	sp := s.Spoof
	if sp == nil {
		return errors.New("spoof is empty")
	}
	switch s.Kind {
	case KindSpoofUDP:
		if s.Target == "" || s.Port < 1 || s.Port > 65535 {
			return errors.New("want target and port (the UDP echo to send to)")
		}
		if err := parseIPv4("target", s.Target, true); err != nil {
			return err
		}
		if sp.SrcPort < 0 || sp.SrcPort > 65535 {
			return fmt.Errorf("spoof.src_port %d out of range", sp.SrcPort)
		}
		return parseIPv4("spoof.src_ip", sp.SrcIP, true)
	case KindARPSpoof:
		if err := parseIPv4("target (whom to tell)", s.Target, false); err != nil {
			return err
		}
		return parseIPv4("spoof.victim_ip", sp.VictimIP, true)
	default: // mac-spoof
		if err := parseIPv4("spoof.victim_ip", sp.VictimIP, false); err != nil {
			return err
		}
		return parseMAC("spoof.victim_mac", sp.VictimMAC, true)
	}
}

func (s Spec) validateDHCP() error {
	d := s.DHCP
	if d == nil {
		return errors.New("dhcp is empty")
	}
	if err := parseIPv4("dhcp.server", d.Server, false); err != nil {
		return err
	}
	for _, m := range []struct{ n, v string }{{"dhcp.ask_mac", d.AskMAC}, {"dhcp.fake_mac", d.FakeMAC}, {"dhcp.victim_mac", d.VictimMAC}} {
		if err := parseMAC(m.n, m.v, false); err != nil {
			return err
		}
	}
	switch s.Kind {
	case KindDHCPRelease:
		if err := parseMAC("dhcp.victim_mac", d.VictimMAC, true); err != nil {
			return err
		}
		return parseIPv4("dhcp.victim_ip", d.VictimIP, true)
	case KindDHCPSteal, KindDHCPRelay:
		return parseIPv4("dhcp.victim_ip", d.VictimIP, true)
	}
	return nil
}

func (s Spec) validateFrame() error {
	f := s.Frame
	if f == nil {
		return errors.New("frame is empty")
	}
	known := false
	for _, v := range FrameVariants {
		known = known || v == f.Variant
	}
	if !known {
		return fmt.Errorf("frame.variant %q: want one of %s", f.Variant, strings.Join(FrameVariants, ", "))
	}
	if err := parseMAC("frame.dst_mac", f.DstMAC, false); err != nil {
		return err
	}
	if f.Port < 0 || f.Port > 65535 {
		return fmt.Errorf("frame.port %d out of range", f.Port)
	}
	if err := parseIPv4("frame.src_ip", f.SrcIP, false); err != nil {
		return err
	}
	return parseIPv4("frame.target_ip", f.TargetIP, f.Variant == FrameARPZero || f.Variant == FrameLinkLocalUDP)
}

// defaultTimeout: DefaultTimeout, except that a flood runs Duration plus a
// second's tail and the DHCP kinds wait out dnsmasq's ~3 s ping before an offer.
func defaultTimeout(s Spec) time.Duration {
	switch s.Kind {
	case KindFlood:
		if s.Flood != nil {
			return s.Flood.Duration.D() + time.Second
		}
	case KindDHCPRelease, KindDHCPSteal, KindDHCPFakeMAC, KindDHCPRelay:
		return 5 * time.Second
	}
	return DefaultTimeout
}

func runActive(ctx context.Context, s Spec, r *Result) {
	r.Counts = &Counts{Marker: markerOf(s)}
	switch s.Kind {
	case KindFlood:
		probeFlood(ctx, s, r)
	case KindSpoofUDP:
		probeSpoofUDP(ctx, s, r)
	case KindARPSpoof:
		probeARPSpoof(ctx, s, r)
	case KindMACSpoof:
		probeMACSpoof(ctx, s, r)
	case KindDHCPRelease, KindDHCPSteal, KindDHCPFakeMAC, KindDHCPRelay:
		probeDHCP(ctx, s, r)
	case KindFrame:
		probeFrame(ctx, s, r)
	}
}

// linkFor is the interface an L2 probe works on: Iface, else the one the
// route to dst uses (when dst is valid), else eth0; with its first IPv4
// address (invalid when it has none).
func linkFor(iface string, dst netip.Addr) (*net.Interface, netip.Addr, error) {
	if iface == "" && dst.IsValid() {
		if rt, err := routeCheck(dst, ""); err == nil {
			if l, err := netlink.LinkByIndex(rt.LinkIndex); err == nil {
				iface = l.Attrs().Name
			}
		}
	}
	if iface == "" {
		iface = DefaultIface
	}
	ifi, err := net.InterfaceByName(iface)
	if err != nil {
		return nil, netip.Addr{}, fmt.Errorf("interface %q: %w", iface, err)
	}
	if len(ifi.HardwareAddr) != 6 {
		return nil, netip.Addr{}, fmt.Errorf("interface %q has no Ethernet MAC", iface)
	}
	addrs, _ := ifi.Addrs()
	for _, a := range addrs {
		if n, ok := a.(*net.IPNet); ok {
			if ip, ok := netip.AddrFromSlice(n.IP); ok && ip.Unmap().Is4() {
				return ifi, ip.Unmap(), nil
			}
		}
	}
	return ifi, netip.Addr{}, nil
}

// outcomeOfSightings is the shared verdict of the sending kinds: nothing
// sent is check-failed; something seen is open; else dropped.
func outcomeOfSightings(c *Counts, seen int, firstErr error, what string) (Outcome, string) {
	if c.Sent == 0 {
		msg := "nothing could be sent"
		if firstErr != nil {
			msg += ": " + firstErr.Error()
		}
		return CheckFailed, msg
	}
	if seen > 0 {
		return Open, fmt.Sprintf("%d %s (first: %s); %d sent", seen, what, c.FirstSeen, c.Sent)
	}
	return Dropped, fmt.Sprintf("no %s; %d sent", what, c.Sent)
}
