package boxcore

import (
	"context"
	"encoding/json"
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

// savedRound is the spec a round applied.
type savedRound struct {
	Token string
	Spec  firewall.Spec
}

// savedRoundPath holds the last round's savedRound, beside its stamp and under the same lock.
func savedRoundPath(network string) string {
	return perDaemon("/run/claudebox-bound-" + network + ".spec")
}

func saveRound(network, token string, spec firewall.Spec) {
	b, err := json.Marshal(savedRound{Token: token, Spec: spec})
	if err == nil {
		err = os.WriteFile(savedRoundPath(network), b, 0o600)
	}
	if err != nil {
		_ = os.Remove(savedRoundPath(network))
	}
}

// writeStamp records a round: when the Incus state it bound was read, and its token.
func writeStamp(network string, read time.Time, token string) {
	_ = os.WriteFile(boundStampPath(network), []byte(strconv.FormatInt(read.UnixNano(), 10)+" "+token), 0o600)
}

// quickRound binds the pending ports on top of the last round's spec (see above). ok is
// false when it cannot stand for a round: no saved spec of the stamp's round; a pending port
// the last round bound to another MAC or address (a box of that name before: only a read
// says which is current); a bound port gone from the bridge since. Then nothing was
// applied, and the caller runs a full round.
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
	var saved savedRound
	if b, err := os.ReadFile(savedRoundPath(network)); last == "" || err != nil || json.Unmarshal(b, &saved) != nil || saved.Token != last {
		return "", false, nil
	}
	spec := saved.Spec
	gw := spec.Resolved().Subnet()
	pending := map[string]bool{}
	for _, p := range readPendings(network) {
		b := p.Binding
		pending[b.Port] = true
		i := slices.IndexFunc(spec.Ports, func(o firewall.PortBinding) bool { return o.Port == b.Port })
		switch {
		case i >= 0 && (!macEqual(spec.Ports[i].MAC, b.MAC) || spec.Ports[i].IPv4 != b.IPv4):
			return "", false, nil
		case i < 0 && (gw == nil || !gw.Contains(b.IPv4.AsSlice())):
			return "", false, nil
		case i < 0:
			spec.Ports = append(spec.Ports, b)
		}
	}
	slices.SortFunc(spec.Ports, func(a, b firewall.PortBinding) int { return strings.Compare(a.Port, b.Port) })
	// Every bound port must still be on the bridge, but for pending ones not plugged yet: a
	// veth gone since is a box stopped outside a round (the incus CLI), whose rules only a
	// read may drop. A veth come since (an instance started outside a round) is left as the
	// last round left it, unbound: the next full round, or the agent, binds it.
	ports, err := h.Kernel.BridgePorts(network)
	if err != nil {
		return "", false, err
	}
	onBridge := map[string]bool{}
	for _, p := range ports {
		onBridge[p.Name] = true
	}
	unplugged := map[string]bool{}
	for _, b := range spec.Ports {
		switch {
		case pending[b.Port] && !onBridge[b.Port]:
			unplugged[b.Port] = true
		case !onBridge[b.Port]:
			return "", false, nil
		}
	}
	t := time.Now()
	defer incus.TraceStep("bind", "quick round (the last round's spec and the pending ports)", t)
	if _, err := h.applyL2(spec, unplugged); err != nil {
		return "", false, err
	}
	token = randomToken()
	saveRound(network, token, spec)
	writeStamp(network, read, token)
	return token, true, nil
}
