package incus_test

import (
	"bytes"
	"context"
	"io"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/claudebox/claudebox/boxcore/incus"
)

// TestTTYOutputKept: a quick command under a tty never loses its output (it did, about once
// in a few hundred, when the client closed the shared socket before the daemon's barrier).
// CLAUDEBOX_TTY_LOOPS sets the number of execs (default 100; the old race showed within 100).
func TestTTYOutputKept(t *testing.T) {
	f := newFixture(t)
	a := f.launch(t, f.prefix+"-tty", true, nil)
	n := 100
	if v, err := strconv.Atoi(os.Getenv("CLAUDEBOX_TTY_LOOPS")); err == nil && v > 0 {
		n = v
	}
	var slow time.Duration
	for i := 0; i < n; i++ {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		pr, pw := io.Pipe()
		var out bytes.Buffer
		start := time.Now()
		code, err := f.c.ExecInteractive(ctx, a, incus.ExecRequest{Command: []string{"/sbin/init", "tty"}}, pr, &out, nil, true, 80, 24)
		slow = max(slow, time.Since(start))
		pw.Close()
		cancel()
		if err != nil || code != 0 || !strings.Contains(out.String(), "/dev/pts/") {
			t.Fatalf("exec %d: code %d err %v out %q", i, code, err, out.String())
		}
	}
	t.Logf("%d tty execs kept their output; slowest %v", n, slow)
	if slow > 3*time.Second {
		t.Errorf("a tty exec took %v: the daemon's end-of-output barrier did not come", slow)
	}
}
