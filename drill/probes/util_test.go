package probes

import (
	"bytes"
	"context"
	"encoding/binary"
	"net/netip"
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

// withTimestampOption grows the header by the option, keeps the packet's UDP part intact and
// gives the header a valid checksum.
func TestWithTimestampOption(t *testing.T) {
	src, dst := netip.MustParseAddrPort("10.87.0.11:40000"), netip.MustParseAddrPort("198.18.0.10:7002")
	plain := udpPacket(src, dst, []byte("marker"))
	pkt := withTimestampOption(plain)
	if ihl := int(pkt[0]&0x0f) * 4; ihl != 32 || len(pkt) != len(plain)+12 || int(binary.BigEndian.Uint16(pkt[2:])) != len(pkt) {
		t.Fatalf("header length %d, packet %d bytes (total length field %d), want 32 and %d", ihl, len(pkt), binary.BigEndian.Uint16(pkt[2:]), len(plain)+12)
	}
	if pkt[20] != 68 || pkt[21] != 12 || pkt[23]&0x0f != 1 {
		t.Errorf("option % x, want an empty timestamp option with flag 1", pkt[20:32])
	}
	if checksum(pkt[:32]) != 0 {
		t.Error("the header checksum does not verify")
	}
	if !bytes.Equal(pkt[32:], plain[20:]) {
		t.Error("the UDP part changed")
	}
}
