package drill

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"net/url"
	"strconv"

	"github.com/claudebox/claudebox/boxcore/incus"
	"github.com/claudebox/claudebox/drill/probes"
)

// ClaimCluster: on an Incus cluster a box reaches none of the other members — not their
// cluster addresses, not the cluster API on them. The drill of each member aims its boxes at
// every other member's address and port (the peers' own listeners: this machine's, or the
// cluster's own hosts), with the control that the member itself reaches them. The wall drops
// box egress that is not to the uplink, and the L2 ranges drop it at the bridge. The ACL is
// not counted: a full self-test on the test cluster's first member measured the holes that
// leave it alone ("port binding + L2 ranges + host input guard + wall off", "wall + port
// rp_filter + L2 ranges off") turning these rows red.
const ClaimCluster = "box→other cluster members"

// clusterPeers reads the other members of the cluster and where each listens; none when the
// daemon is standalone.
func clusterPeers(ctx context.Context, c *incus.Client) ([]Endpoint, error) {
	srv, err := c.Server(ctx)
	if err != nil || !srv.Clustered {
		return nil, err
	}
	members, err := c.ClusterMembers(ctx)
	if err != nil {
		return nil, fmt.Errorf("cluster members: %w", err)
	}
	var out []Endpoint
	for _, m := range members {
		if m.Name == srv.ServerName {
			continue
		}
		u, err := url.Parse(m.URL)
		if err != nil {
			return nil, fmt.Errorf("cluster member %s: address %q: %w", m.Name, m.URL, err)
		}
		host, portS, err := net.SplitHostPort(u.Host)
		if err != nil {
			host, portS = u.Host, "8443"
		}
		addr, err := netip.ParseAddr(host)
		port, perr := strconv.Atoi(portS)
		if err != nil || perr != nil || !addr.Is4() {
			return nil, fmt.Errorf("cluster member %s: address %q is not IPv4:PORT", m.Name, m.URL)
		}
		out = append(out, Endpoint{Key: "member-" + m.Name, Label: "member " + m.Name + " " + addr.String(), Addr: addr, Port: port})
	}
	return out, nil
}

// ToPeers selects every other cluster member's API address.
var ToPeers = Selector{"every other cluster member's API address", func(t *Topology, _ Endpoint) []Endpoint { return t.Peers }}

var (
	peerControl = Control{"ctl/peer-tcp", EndHost, EndTarget}
	clusterRows = []ClaimRow{
		{Key: "cluster/tcp", Claim: ClaimCluster, Kind: "tcp", ID: "cluster/{from}>{to}/tcp{port}", From: FromBoxes, To: ToPeers,
			Expect: Dropped, Controls: []Control{peerControl}, Holds: any1(LayerWall, LayerL2Ranges),
			Probe: func(_, to Endpoint, _ *Topology) probes.Spec { return tcp(to.Addr, to.Port) }},
		{Key: "cluster/icmp", Claim: ClaimCluster, Kind: "icmp", ID: "cluster/{from}>{to}/icmp", From: FromBoxes, To: ToPeers,
			Expect: Dropped, Controls: []Control{peerControl}, Holds: any1(LayerWall, LayerL2Ranges),
			Probe: func(_, to Endpoint, _ *Topology) probes.Spec { return icmp(to.Addr) }},
		{Key: "ctl/peer-tcp", Claim: ClaimControl, Kind: "member", ID: "ctl/host>{to}/tcp{port}", From: FromHost, To: ToPeers,
			Expect: Open, Probe: func(_, to Endpoint, _ *Topology) probes.Spec { return tcp(to.Addr, to.Port) }},
	}
)
