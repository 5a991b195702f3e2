package probes

import (
	"context"
	"time"
)

// sleepCtx waits d or until ctx ends, whichever is first: no sleep in the
// agent may hold a cancellation (Ctrl-C, the probe's deadline) hostage.
func sleepCtx(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// backoff is the pause of a read loop after an error that is not "closed":
// it doubles from 10 ms up to 1 s so a persistent error (EMFILE, a vanished
// interface) does not spin a core, and resets after a good read.
type backoff struct{ d time.Duration }

func (b *backoff) wait(done <-chan struct{}) bool {
	switch {
	case b.d == 0:
		b.d = 10 * time.Millisecond
	case b.d < time.Second:
		b.d *= 2
	}
	t := time.NewTimer(b.d)
	defer t.Stop()
	select {
	case <-done:
		return false
	case <-t.C:
		return true
	}
}

func (b *backoff) reset() { b.d = 0 }
