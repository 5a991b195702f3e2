package drill

import (
	"fmt"
	"net"
	"net/netip"
	"strings"
	"time"

	"github.com/claudebox/claudebox/drill/probes"
)

// ClaimNAT: whatever leaves the host from a box leaves with the host's address, never the
// box's own — onto the LAN, the uplink or a cluster network nothing learns the box subnet,
// and no reply can be routed to a box past the host's NAT. Three layers hold it: Incus's
// masquerade (ipv4.nat), the wall's own masquerade (which runs when Incus's did not), and the
// guard's egress drop of a box-subnet source past every NAT chain. In Incus's re-apply window
// its masquerade is gone by definition, so the window row is held by the other two.
//
// The verdict is the public decoy's: it records the source of every datagram carrying the
// row's marker. A source in the box subnet is un-NATed (a hole); another source is NATed;
// nothing heard establishes nothing (check-failed), while the control (the box reaches the
// public decoy over TCP) says egress works.
const ClaimNAT = "box egress is never un-NATed"

var (
	natLayers = any1(LayerNAT, LayerWall, LayerHostGuard)
	natRows   = []ClaimRow{
		{Key: "nat/udp", Claim: ClaimNAT, Kind: "udp", ID: "nat/{from}/udp", From: FromBoxes, To: ToPublic, Expect: NATed,
			Probe: toDecoyUDP, Controls: []Control{inetTCP}, Holds: natLayers},
		// A packet conntrack calls invalid (here a wrong UDP checksum) is seen by no NAT
		// chain: nothing may forward it, since it could only leave un-NATed.
		{Key: "nat/invalid", Claim: ClaimNAT, Kind: "spoof", ID: "nat/{from}/invalid-udp", From: FromBoxes, To: ToPublic, Expect: Dropped,
			Probe: func(from, to Endpoint, _ *Topology) probes.Spec {
				return probes.Spec{Kind: probes.KindSpoofUDP, Target: to.Addr.String(), Port: DecoyUDP,
					Spoof: &probes.SpoofSpec{SrcIP: from.Box.IPv4.String(), BadChecksum: true}}
			}, Controls: []Control{inetTCP}, Holds: any1(LayerWall, LayerHostGuard)},
		// An ICMP error a box makes about one of the host's own flows (here the host's live
		// UDP flow to the public decoy) is related to a flow without source NAT: no
		// masquerade rewrites it. Found by the attacker; the firewall lab proves the path.
		{Key: "nat/related-error", Claim: ClaimNAT, Kind: "spoof", ID: "nat/{from}/related-error", From: FromBoxes, To: ToPublic, Expect: Dropped,
			Probe: func(from, to Endpoint, t *Topology) probes.Spec {
				return probes.Spec{Kind: probes.KindSpoofUDP, Target: to.Addr.String(), Port: DecoyUDP,
					Spoof: &probes.SpoofSpec{SrcIP: from.Box.IPv4.String(),
						ErrorAbout: netip.AddrPortFrom(to.Addr, DecoyUDP).String() + ">" + t.HostFlow.String()}}
			}, Controls: []Control{inetTCP}, Holds: any1(LayerWall, LayerHostGuard)},
		// A router writes the address a packet came in by into an IPv4 timestamp option
		// (flag 1): the gateway's, past any NAT. Nothing with options leaves from a box.
		{Key: "nat/ip-options", Claim: ClaimNAT, Kind: "spoof", ID: "nat/{from}/ip-options", From: FromBoxes, To: ToPublic, Expect: Dropped,
			Probe: func(from, to Endpoint, _ *Topology) probes.Spec {
				return probes.Spec{Kind: probes.KindSpoofUDP, Target: to.Addr.String(), Port: DecoyUDP,
					Spoof: &probes.SpoofSpec{SrcIP: from.Box.IPv4.String(), TimestampOption: true}}
			}, Controls: []Control{inetTCP}, Holds: any1(LayerWall, LayerHostGuard)},
		// From outside (the decoy's LAN side, routed by the host), the box subnet answers
		// nothing: not even the gateway's address, which the host would answer from — out of
		// the LAN side with the box subnet as its source.
		{Key: "ctl/decoy-host-tcp", Claim: ClaimControl, Kind: "decoy", ID: "ctl/decoy>{to}/tcp", From: FromDecoy, To: ToDecoyHostSide,
			Expect: Open, Probe: func(_, to Endpoint, t *Topology) probes.Spec { return tcp(to.Addr, t.HostTCP) }},
		{Key: "lan-gateway/tcp", Claim: ClaimNAT, Kind: "tcp", ID: "lan-gateway/decoy>{to}/tcp", From: FromDecoy, To: ToGatewayAddr,
			Expect: Dropped, Probe: toHostTCP,
			Controls: []Control{{"ctl/decoy-host-tcp", EndSource, EndHost}, hostListener("tcp")}, Holds: any1(LayerWall, LayerHostGuard)},
		{Key: "window/nat", Claim: ClaimNAT, Kind: "flood", ID: "window/{from}>public/nat", From: FromBoxes, To: ToPublic, Expect: NATed,
			Probe: func(_, to Endpoint, _ *Topology) probes.Spec {
				return flood(udpTo(DecoyUDP, to.Addr), nil)
			}, Controls: windowControls, Holds: any1(LayerWall, LayerHostGuard), Window: WindowReapply},
	}
)

// natSeen judges the rows that expect NATed by what the public decoy heard with their marker
// since the matrix began; boxNet is the box subnet.
func natSeen(rows []*Row, decoy []probes.Hit, boxNet netip.Prefix, since time.Time) {
	for _, r := range rows {
		if r.Expected != NATed {
			continue
		}
		var inside, outside []string
		for _, h := range decoy {
			if h.Time.Before(since) || r.Probe.Payload == "" || !strings.Contains(h.Payload, r.Probe.Payload) {
				continue
			}
			src, ok := peerIP(h)
			switch {
			case ok && boxNet.Contains(src):
				inside = append(inside, src.String())
			case ok:
				outside = append(outside, src.String())
			default:
				outside = append(outside, h.Peer)
			}
		}
		switch {
		case len(inside) > 0:
			r.Observed = UnNATed
			r.Result.Evidence = "the public decoy heard the box subnet's own address " + strings.Join(uniq(inside), ", ")
		case len(outside) > 0:
			r.Observed = NATed
			r.Result.Evidence = "the public decoy heard it from " + strings.Join(uniq(outside), ", ")
		default:
			r.Observed = CheckFailed
			r.Result.Evidence = "the public decoy heard nothing with this row's marker: the source it leaves with is unobserved (" + r.Result.Evidence + ")"
		}
	}
}

// peerIP is the source address of a hit: a socket's peer ("198.18.0.249:40001") or a
// captured frame's ("0a:1b:2c:3d:4e:5f 198.18.0.249").
func peerIP(h probes.Hit) (netip.Addr, bool) {
	s := h.Peer
	if h.Proto == "frame" {
		f := strings.Fields(s)
		if len(f) < 2 {
			return netip.Addr{}, false
		}
		s = f[len(f)-1]
	} else if host, _, err := net.SplitHostPort(s); err == nil {
		s = host
	}
	a, err := netip.ParseAddr(s)
	return a.Unmap(), err == nil
}

// hostFlow is a UDP flow of the host's own to the public decoy, kept alive (a datagram every
// half second) so that conntrack holds it for the whole run.
type hostFlow struct {
	conn  *net.UDPConn
	local netip.AddrPort
	done  chan struct{}
}

func startHostFlow(public netip.Addr) (*hostFlow, error) {
	c, err := net.DialUDP("udp4", nil, net.UDPAddrFromAddrPort(netip.AddrPortFrom(public, DecoyUDP)))
	if err != nil {
		return nil, fmt.Errorf("the host's own flow to the public decoy: %w", err)
	}
	f := &hostFlow{conn: c, local: c.LocalAddr().(*net.UDPAddr).AddrPort(), done: make(chan struct{})}
	go func() {
		t := time.NewTicker(500 * time.Millisecond)
		defer t.Stop()
		for {
			_, _ = c.Write([]byte("claudebox-drill host flow"))
			select {
			case <-f.done:
				return
			case <-t.C:
			}
		}
	}()
	return f, nil
}

func (f *hostFlow) stop() {
	close(f.done)
	_ = f.conn.Close()
}
