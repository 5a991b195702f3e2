package probes

import (
	"context"
	"runtime"
	"strings"
	"testing"
	"time"
	"unicode/utf8"
)

func TestTruncateKeepsRunesWhole(t *testing.T) {
	s := strings.Repeat("é", 10) // 2 bytes each
	for n := 0; n < len(s); n++ {
		got := truncate(s, n)
		if !utf8.ValidString(got) {
			t.Fatalf("truncate(%d) = %q: not valid UTF-8", n, got)
		}
	}
	if got := truncate("abc", 3); got != "abc" {
		t.Errorf("truncate kept-whole = %q", got)
	}
}

func TestSleepCtxHonoursCancel(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	start := time.Now()
	if err := sleepCtx(ctx, time.Minute); err == nil || time.Since(start) > time.Second {
		t.Fatalf("sleepCtx ignored a cancelled context: %v after %v", err, time.Since(start))
	}
}

// TestServeLeavesNoGoroutine: Close with a context that never ends must not
// leave a goroutine parked on it (issue 10).
func TestServeLeavesNoGoroutine(t *testing.T) {
	before := runtime.NumGoroutine()
	for i := 0; i < 20; i++ {
		ls, err := Serve(context.Background(), ListenerConfig{TCP: []int{0}, UDP: []int{0}})
		if err != nil {
			t.Fatal(err)
		}
		if err := ls.Close(); err != nil {
			t.Fatal(err)
		}
	}
	deadline := time.Now().Add(2 * time.Second)
	for runtime.NumGoroutine() > before+2 {
		if time.Now().After(deadline) {
			t.Fatalf("goroutines: %d before, %d after 20 Serve/Close", before, runtime.NumGoroutine())
		}
		time.Sleep(10 * time.Millisecond)
	}
}
