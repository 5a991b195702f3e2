package drill

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"strings"

	"github.com/claudebox/claudebox/boxcore"
	"github.com/claudebox/claudebox/drill/probes"
)

// The exposure claim: the first box's listener, exposed the way `claudebox expose` does it,
// answers at the host's loopback (the positive control, which must reach that box's own
// listener) and nowhere else: not at the host's other addresses, not from the LAN decoy.
// Two layers hold it: the proxy listens on loopback only (LayerExposeLoopback), and the guard
// answers the exposed port with a reset unless it is addressed to loopback (LayerHostGuard).
// Both give a reset, as a closed port does, so a row is red only when both are off. From a
// box, the layers that keep a box off the host drop it first; for the exposure a drop and a
// reset are the same verdict (the port was not reached), and only an answer is a hole.

// ClaimExposure is the exposure claim's name.
const ClaimExposure = "an exposed port reaches this host's loopback only"

// LayerExposeLoopback: the exposure's proxy listens on a loopback address only. It is the
// lab's own layer: its seeded hole is a listener of the lab's on the host's other addresses
// at the exposed port, which is what a proxy listening beyond loopback would be.
const LayerExposeLoopback Layer = "exposure-loopback"

// LabLayers are the layers the lab switches itself (no host state of the stack).
var LabLayers = []Layer{LayerExposeLoopback, LayerMembersApart}

func isLabLayer(l Layer) bool { return isResourceLayer(l) || slices.Contains(LabLayers, l) }

// Kinds of the exposure rows.
const (
	KindExposed        = "exposed"          // the control: the box's own listener, by its banner
	KindExposedBeyond  = "exposed-beyond"   // the exposed port at another address
	exposeBannerPrefix = "claudebox-probe " // what the box's listener greets with, then its name
)

var (
	// ToExposure is the exposure on the host's loopback.
	ToExposure = Selector{"the exposure on the host's loopback", func(t *Topology, _ Endpoint) []Endpoint {
		if !t.Exposure.IsValid() {
			return nil
		}
		return []Endpoint{{Key: "exposure", Label: fmt.Sprintf("%s's exposure on %s", t.ExposedBox, t.Exposure),
			Addr: t.Exposure.Addr(), Port: int(t.Exposure.Port())}}
	}}
	// ToExposureHostAddrs is the exposed port at every host address but loopback.
	ToExposureHostAddrs = Selector{"the exposed port at every host address", func(t *Topology, _ Endpoint) []Endpoint {
		return exposureAt(t, func(netip.Addr) bool { return true })
	}}
	// ToExposureGateway and ToExposureOtherHostAddrs split ToExposureHostAddrs for the
	// boxes' rows: a box reaches the gateway and the host's other addresses through
	// different layers.
	ToExposureGateway = Selector{"the exposed port at the gateway", func(t *Topology, _ Endpoint) []Endpoint {
		return exposureAt(t, func(a netip.Addr) bool { return a == t.Gateway.Addr() })
	}}
	ToExposureOtherHostAddrs = Selector{"the exposed port at every other host address", func(t *Topology, _ Endpoint) []Endpoint {
		return exposureAt(t, func(a netip.Addr) bool { return a != t.Gateway.Addr() })
	}}
	// ToExposureDecoySide is the exposed port at the host's address on the decoy's LAN side.
	ToExposureDecoySide = Selector{"the exposed port at the host's LAN-side address", func(t *Topology, _ Endpoint) []Endpoint {
		if !t.Exposure.IsValid() || !t.DecoyHostSide.IsValid() {
			return nil
		}
		return []Endpoint{{Key: "host", Label: fmt.Sprintf("host %s:%d", t.DecoyHostSide, t.Exposure.Port()), Addr: t.DecoyHostSide, Port: int(t.Exposure.Port())}}
	}}
	toExposedPort = func(_, to Endpoint, _ *Topology) probes.Spec {
		return tcp(to.Addr, to.Port)
	}
)

// exposureAt is the exposed port at the host addresses keep selects.
func exposureAt(t *Topology, keep func(netip.Addr) bool) []Endpoint {
	if !t.Exposure.IsValid() {
		return nil
	}
	var out []Endpoint
	for _, a := range t.HostAddrs {
		if keep(a) {
			out = append(out, Endpoint{Key: a.String(), Label: fmt.Sprintf("host %s:%d", a, t.Exposure.Port()), Addr: a, Port: int(t.Exposure.Port())})
		}
	}
	return out
}

var exposureClaims = []ClaimRow{
	{Key: "ctl/exposed", Claim: ClaimControl, Kind: KindExposed, ID: "ctl/host>exposure", From: FromHost, To: ToExposure,
		Expect: Open, Probe: toExposedPort},
	{Key: "exposure/host-addr", Claim: ClaimExposure, Kind: KindExposedBeyond, ID: "exposure/host>{to}", From: FromHost, To: ToExposureHostAddrs,
		Expect: Refused, Probe: toExposedPort, Controls: []Control{{"ctl/exposed", EndHost, EndHost}},
		Holds: any1(LayerExposeLoopback, LayerHostGuard)},
	{Key: "exposure/lan", Claim: ClaimExposure, Kind: KindExposedBeyond, ID: "exposure/decoy>{to}", From: FromDecoy, To: ToExposureDecoySide,
		Expect: Refused, Probe: toExposedPort, Controls: []Control{{"ctl/exposed", EndHost, EndHost}},
		Holds: any1(LayerExposeLoopback, LayerHostGuard)},
	// From the boxes (the exposed one included: its own port at the host is no way back into
	// the host): a box reaches no host address anyway, and the exposed port is no exception.
	{Key: "exposure/box-gateway", Claim: ClaimExposure, Kind: KindExposedBeyond, ID: "exposure/{from}>{to}", From: FromBoxes, To: ToExposureGateway,
		Expect: Refused, Probe: toExposedPort, Controls: []Control{{"ctl/exposed", EndHost, EndHost}, inetTCP},
		Holds: any1(LayerExposeLoopback, LayerHostGuard, LayerACL, LayerWall)},
	{Key: "exposure/box-host", Claim: ClaimExposure, Kind: KindExposedBeyond, ID: "exposure/{from}>{to}", From: FromBoxes, To: ToExposureOtherHostAddrs,
		Expect: Refused, Probe: toExposedPort, Controls: []Control{{"ctl/exposed", EndHost, EndHost}, inetTCP},
		Holds: any1(LayerExposeLoopback, LayerHostGuard, LayerWall, LayerL2Ranges)},
}

// exposeFirstBox starts exposing the first network box's listener on a loopback port of the
// host the way `claudebox expose` does (the guard's rule with it); awaitExposure waits for
// it. Incus takes about a second to add a proxy device (measured: 1.04 s, the same at
// start), so it runs beside the window rows, which do not need it. The port is picked once
// per run; a re-minted first box gets the same one. A VM box is not exposed (expose refuses
// VMs).
func (e *engine) exposeFirstBox(ctx context.Context) error {
	if e.o.VM || len(e.boxes) == 0 {
		return nil
	}
	if !e.exposure.IsValid() {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return err
		}
		e.exposure = netip.MustParseAddrPort(l.Addr().String())
		l.Close()
	}
	box, err := boxcore.Resolve(ctx, e.c, e.boxes[0].Name)
	if err != nil {
		return err
	}
	bs := &boxcore.Boxes{Client: e.c, Stack: e.o.Stack, Version: e.o.Version, HostLocked: true}
	e.exposedBox = box.Name
	done := make(chan error, 1)
	e.exposing = done
	go func() {
		if _, err := bs.Expose(ctx, box, probes.DefaultTCPPort, e.exposure); err != nil {
			done <- fmt.Errorf("exposing %s: %w", box.Name, err)
		}
		close(done)
	}()
	return nil
}

// awaitExposure waits until the exposure exposeFirstBox started is in place (or failed).
func (e *engine) awaitExposure() error {
	if e.exposing == nil {
		return nil
	}
	err := <-e.exposing
	e.exposing = nil
	return err
}

// openBeyondLoopback is the hole of LayerExposeLoopback: the lab listens at the exposed port
// on every other host address (and the LAN-side one), as a proxy listening beyond loopback
// would. Each connection is accepted and closed.
func (e *engine) openBeyondLoopback() error {
	if !e.exposure.IsValid() {
		return nil
	}
	addrs := slices.Clone(e.hostAddrs)
	if e.decoy != nil && e.decoy.LAN.HostAddr.IsValid() && !slices.Contains(addrs, e.decoy.LAN.HostAddr) {
		addrs = append(addrs, e.decoy.LAN.HostAddr)
	}
	for _, a := range addrs {
		l, err := net.Listen("tcp", netip.AddrPortFrom(a, e.exposure.Port()).String())
		if err != nil {
			e.closeBeyondLoopback()
			return fmt.Errorf("the exposure hole's listener on %s: %w", a, err)
		}
		e.beyond = append(e.beyond, l)
		go func() {
			for {
				c, err := l.Accept()
				if err != nil {
					return
				}
				c.Close()
			}
		}()
	}
	return nil
}

func (e *engine) closeBeyondLoopback() {
	for _, l := range e.beyond {
		l.Close()
	}
	e.beyond = nil
}

// servedBy: the exposure control's connection was greeted by the exposed box's own listener
// (its banner names it; the case's target label starts with the box's name).
func servedBy(c Case, res probes.Result) bool {
	box, _, _ := strings.Cut(c.To, "'s exposure")
	return box != "" && strings.Contains(res.Evidence, "banner: "+exposeBannerPrefix+box+" ")
}
