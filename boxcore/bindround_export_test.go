package boxcore

import (
	"context"
	"time"

	"github.com/claudebox/claudebox/boxcore/incus"
	"github.com/claudebox/claudebox/firewall"
)

// BindRound runs one bind round as a box verb does (skipped when a round that read Incus
// after since bound every port): it reports whether the round ran.
func BindRound(ctx context.Context, h *Host, since time.Time) (ran bool, err error) {
	st, err := h.bindPorts(ctx, since)
	return st != nil, err
}

// OtherNetworks is the bind's cheap listing of the networks but the stack's own.
func OtherNetworks(ctx context.Context, h *Host) ([]incus.Network, error) {
	return h.otherNetworks(ctx)
}

// PlanNIC is new's choice of a box's NIC before the create (nil: none made), with the
// address lock's release.
func PlanNIC(ctx context.Context, bs *Boxes, box string) (*firewall.PortBinding, func(), error) {
	return bs.planNIC(ctx, box)
}

// PreBind runs the bind before a start for box's planned NIC b and returns its token.
func PreBind(ctx context.Context, bs *Boxes, box string, b firewall.PortBinding) (string, error) {
	pb := <-bs.preBind(ctx, box, &b)
	return pb.token, pb.err
}

// CompleteBind is the step after the start for a bind before it that gave token.
func CompleteBind(ctx context.Context, h *Host, box string, b firewall.PortBinding, token string) (bool, error) {
	return h.completeBind(ctx, &preBound{nic: NICBinding{Box: box, Device: "eth0", Binding: b}, token: token})
}

// DropPending removes box's pending record, as the end of its mint does.
func DropPending(bs *Boxes, box string) { removePending(bs.Stack.Network, box) }

// PendingDir is where network's pending NICs are recorded.
func PendingDir(network string) string { return pendingDir(network) }

// QuickRound is the bind before a start on top of the last round's spec (ok false: it could
// not stand for a round, and applied nothing).
func QuickRound(ctx context.Context, h *Host) (ok bool, err error) {
	_, ok, err = h.quickRound(ctx)
	return ok, err
}

// WritePending records box's planned NIC b as pending, as new does before its create.
func WritePending(bs *Boxes, box string, b firewall.PortBinding) error {
	return writePending(bs.Stack.Network, box, b)
}

// SavedRoundPath holds the spec the last round applied, with its token.
func SavedRoundPath(network string) string { return savedRoundPath(network) }
