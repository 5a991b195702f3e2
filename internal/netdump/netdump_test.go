package netdump

import (
	"errors"
	"testing"

	"github.com/vishvananda/netlink"
)

func TestRetryAsksAgainOnlyWhenInterrupted(t *testing.T) {
	calls := 0
	v, err := Retry(func() (int, error) {
		calls++
		if calls < 3 {
			return -1, netlink.ErrDumpInterrupted
		}
		return 7, nil
	})
	if err != nil || v != 7 || calls != 3 {
		t.Fatalf("got %d, %v after %d calls; want 7, nil after 3", v, err, calls)
	}

	calls = 0
	other := errors.New("permission denied")
	if _, err := Retry(func() (int, error) { calls++; return 0, other }); !errors.Is(err, other) || calls != 1 {
		t.Fatalf("a real error must come back at once: %v after %d calls", err, calls)
	}

	calls = 0
	if _, err := Retry(func() (int, error) { calls++; return 0, netlink.ErrDumpInterrupted }); !errors.Is(err, netlink.ErrDumpInterrupted) || calls != attempts {
		t.Fatalf("a table that never settles must fail after %d calls: %v after %d", attempts, err, calls)
	}
}

// TestRetryRealDump reads this machine's links through the retry.
func TestRetryRealDump(t *testing.T) {
	links, err := Retry(netlink.LinkList)
	if err != nil || len(links) == 0 {
		t.Fatalf("LinkList: %d links, %v", len(links), err)
	}
}
