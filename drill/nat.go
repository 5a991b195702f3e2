package drill

import (
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
			host, _, err := net.SplitHostPort(h.Peer)
			if err != nil {
				host = h.Peer
			}
			src, err := netip.ParseAddr(host)
			if err == nil && boxNet.Contains(src.Unmap()) {
				inside = append(inside, src.String())
			} else {
				outside = append(outside, host)
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
