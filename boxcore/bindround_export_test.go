package boxcore

import (
	"context"
	"time"

	"github.com/claudebox/claudebox/boxcore/incus"
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
