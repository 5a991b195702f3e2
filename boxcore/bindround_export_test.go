package boxcore

import (
	"context"
	"time"
)

// BindRound runs one bind round as a box verb does (skipped when a round that read Incus
// after since bound every port): it reports whether the round ran.
func BindRound(ctx context.Context, h *Host, since time.Time) (ran bool, err error) {
	st, err := h.bindPorts(ctx, since)
	return st != nil, err
}
