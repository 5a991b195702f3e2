package incus

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"time"
)

// IsBridgeChildrenRace reports whether err is Incus 6.0.4's transient "Failed to delete bridge
// children interfaces" (500). Incus walks the host's interfaces whenever it brings a bridge up or
// down, and fails when a box's veth vanishes under it: on a network update (PUT), a create
// (POST /1.0/networks, which starts the bridge) and a delete (DELETE, which stops it) alike.
// Matched on the typed status, not the text of the wrapped error.
func IsBridgeChildrenRace(err error) bool {
	var se *StatusError
	return errors.As(err, &se) && se.Code == http.StatusInternalServerError &&
		strings.Contains(se.Message, "Failed to delete bridge children interfaces")
}

// bridgeRaceTries is how often RetryBridgeChildrenRace tries; the waits between tries grow by
// 200 ms (200, 400, ... 1000 ms: 3 s in all), enough for the veths of a batch of boxes stopping
// at once to go.
const bridgeRaceTries = 6

// RetryBridgeChildrenRace runs op, retrying it while it fails with IsBridgeChildrenRace (up to
// bridgeRaceTries tries). Client.CreateNetwork and Client.DeleteNetwork retry through it
// themselves; a network update must re-read what it writes on each try, so its caller wraps it.
func RetryBridgeChildrenRace(ctx context.Context, op func() error) error {
	var err error
	for attempt := 0; attempt < bridgeRaceTries; attempt++ {
		if err = op(); err == nil || !IsBridgeChildrenRace(err) {
			return err
		}
		if attempt == bridgeRaceTries-1 {
			break
		}
		select {
		case <-ctx.Done():
			return errors.Join(err, ctx.Err())
		case <-time.After(time.Duration(attempt+1) * 200 * time.Millisecond):
		}
	}
	return err
}
