package incus

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"time"
)

// IsBridgeChildrenRace reports whether err is Incus 6.0.4's transient failure of a network
// update, "Failed to delete bridge children interfaces" (500), which happens when a box's veth
// leaves the bridge while Incus walks its ports. Matched on the typed status, not the text of
// the wrapped error.
func IsBridgeChildrenRace(err error) bool {
	var se *StatusError
	return errors.As(err, &se) && se.Code == http.StatusInternalServerError &&
		strings.Contains(se.Message, "Failed to delete bridge children interfaces")
}

// RetryBridgeChildrenRace runs update, retrying it (up to 4 tries, 200/400/600 ms apart) while
// it fails with IsBridgeChildrenRace. update must re-read what it writes on each try.
func RetryBridgeChildrenRace(ctx context.Context, update func() error) error {
	var err error
	for attempt := 0; attempt < 4; attempt++ {
		if err = update(); err == nil || !IsBridgeChildrenRace(err) {
			return err
		}
		select {
		case <-ctx.Done():
			return errors.Join(err, ctx.Err())
		case <-time.After(time.Duration(attempt+1) * 200 * time.Millisecond):
		}
	}
	return err
}
