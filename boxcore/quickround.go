package boxcore

import (
	"context"
	"encoding/json"
	"net"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/claudebox/claudebox/boxcore/incus"
	"github.com/claudebox/claudebox/firewall"
)

// A round reads Incus (the network, every instance) and the reservations: with 30 boxes that
// is about 45 ms of ours and 70 ms of the daemon's CPU, taken from the create it runs beside
// when `new` binds a planned port before the start. The round before it already read all of
// that and applied it; if nothing has applied since (its token is still the stamp's), the
// kernel holds exactly that round's spec, so the planned port is bound by applying that spec
// with the pending ports added: quickRound. It is the last round's rules plus the new ports,
// as fresh as the last round, which is what every port has between rounds anyway; a verb
// that changes Incus runs a full round of its own (a quick round keeps the stamp's read
// time, so it never stands in for one). What a quick round does not do is a full round's
// side effect: binding an instance started behind claudebox's back (the incus CLI) since
// the last round. That one stays unbound until the next full round or the agent binds it,
// as it would with no `new` run meanwhile.

// savedRound is the spec a round applied, and the veth of each port it bound that was
// plugged (its ifindex): a veth made again under the name since (a restart behind
// claudebox's back, maybe with another address) is not the one the spec was read for.
type savedRound struct {
	Token string
	Spec  firewall.Spec
	Index map[string]int
}

// savedRoundPath holds the last round's savedRound, beside its stamp and under the same lock.
func savedRoundPath(network string) string {
	return perDaemon("/run/claudebox-bound-" + network + ".spec")
}

func saveRound(network string, r savedRound) {
	b, err := json.Marshal(r)
	if err == nil {
		err = os.WriteFile(savedRoundPath(network), b, 0o600)
	}
	if err != nil {
		_ = os.Remove(savedRoundPath(network))
	}
}

// loadRound is the saved round if it is the stamp's (token), else false.
func loadRound(network, token string) (savedRound, bool) {
	var r savedRound
	b, err := os.ReadFile(savedRoundPath(network))
	if token == "" || err != nil || json.Unmarshal(b, &r) != nil || r.Token != token {
		return savedRound{}, false
	}
	return r, true
}

// bridgeIndex is the ifindex of each port on the stack's bridge now.
func (h *Host) bridgeIndex() (map[string]int, error) {
	ports, err := h.Kernel.BridgePorts(h.Stack.Network)
	if err != nil {
		return nil, err
	}
	onBridge := map[string]int{}
	for _, p := range ports {
		onBridge[p.Name] = p.Index
	}
	return onBridge, nil
}

// boundIndex is the saved round's Index: the veth of each of spec's ports that is plugged.
func boundIndex(spec firewall.Spec, onBridge map[string]int) map[string]int {
	index := map[string]int{}
	for _, b := range spec.Ports {
		if i := onBridge[b.Port]; i != 0 {
			index[b.Port] = i
		}
	}
	return index
}

// writeStamp records a round: when the Incus state it bound was read, and its token.
func writeStamp(network string, read time.Time, token string) {
	_ = os.WriteFile(boundStampPath(network), []byte(strconv.FormatInt(read.UnixNano(), 10)+" "+token), 0o600)
}

// quickRound binds the pending ports on top of the last round's spec (see above). ok is
// false when it cannot stand for a round, and then nothing was applied and the caller runs a
// full round: no saved spec of the stamp's round; the bridge's address not the spec's; a
// pending port the spec binds to another MAC or address (a box of that name before: only a
// read says which is current), or one on the bridge already though the spec does not bind
// it (an instance of that port name running unbound); a bound port gone from the bridge or
// on another veth than the one the spec was read for (stopped or restarted behind
// claudebox's back); two ports bound to one MAC or address.
func (h *Host) quickRound(ctx context.Context) (token string, ok bool, err error) {
	if os.Geteuid() != 0 {
		return "", false, ErrBindNeedsRoot
	}
	network := h.Stack.Network
	unlock, err := lockFile(ctx, bindLockPath(network), HostLockWait)
	if err != nil {
		return "", false, err
	}
	defer unlock()
	read, last := lastFullBind(boundStampPath(network))
	saved, ok := loadRound(network, last)
	if !ok {
		return "", false, nil
	}
	spec := saved.Spec
	resolved := spec.Resolved()
	if gw, ok := bridgeIPv4(network); !ok || !net.IP(gw.Addr().AsSlice()).Equal(resolved.Gateway.To4()) || gw.Bits() != resolved.PrefixLen {
		return "", false, nil
	}
	subnet := resolved.Subnet()
	if subnet == nil {
		return "", false, nil
	}
	onBridge, err := h.bridgeIndex()
	if err != nil {
		return "", false, err
	}
	pending := map[string]bool{}
	for _, p := range readPendings(network) {
		b := p.Binding
		pending[b.Port] = true
		i := slices.IndexFunc(spec.Ports, func(o firewall.PortBinding) bool { return o.Port == b.Port })
		switch {
		case i >= 0 && (!macEqual(spec.Ports[i].MAC, b.MAC) || spec.Ports[i].IPv4 != b.IPv4):
			return "", false, nil
		case i >= 0:
		case onBridge[b.Port] != 0 || !subnet.Contains(b.IPv4.AsSlice()):
			return "", false, nil
		default:
			spec.Ports = append(spec.Ports, b)
		}
	}
	slices.SortFunc(spec.Ports, func(a, b firewall.PortBinding) int { return strings.Compare(a.Port, b.Port) })
	unplugged := map[string]bool{}
	macs, addrs := map[string]bool{}, map[netip.Addr]bool{}
	for _, b := range spec.Ports {
		index, was := onBridge[b.Port], saved.Index[b.Port]
		switch {
		case pending[b.Port] && index == 0:
			unplugged[b.Port] = true
		case index == 0, was != index && !(was == 0 && pending[b.Port]):
			return "", false, nil
		}
		if macs[b.MAC.String()] || addrs[b.IPv4] {
			return "", false, nil
		}
		macs[b.MAC.String()], addrs[b.IPv4] = true, true
	}
	t := time.Now()
	defer incus.TraceStep("bind", "quick round (the last round's spec and the pending ports)", t)
	fresh := []firewall.PortBinding{}
	for _, b := range spec.Ports {
		if pending[b.Port] {
			fresh = append(fresh, b)
		}
	}
	if _, err := h.applyPorts(spec, unplugged, fresh); err != nil {
		return "", false, err
	}
	token = randomToken()
	saveRound(network, savedRound{Token: token, Spec: spec, Index: boundIndex(spec, onBridge)})
	writeStamp(network, read, token)
	return token, true, nil
}

// recordPlugged notes in the saved round, still the stamp's (token), the veth a pending port
// now has: the next quick round then knows it for the one bound.
func (h *Host) recordPlugged(token, port string) {
	r, ok := loadRound(h.Stack.Network, token)
	index := h.Kernel.Ifindex(port)
	if !ok || index == 0 {
		return
	}
	if r.Index == nil {
		r.Index = map[string]int{}
	}
	r.Index[port] = index
	saveRound(h.Stack.Network, r)
}
