package incus_test

import (
	"context"
	"testing"

	"github.com/claudebox/claudebox/boxcore/incus"
	"github.com/claudebox/claudebox/internal/testenv"
)

// BenchmarkInstancesList measures one full listing (recursion=2, state and snapshots)
// filtered by the test tag, as `claudebox ls` does, against the real daemon.
func BenchmarkInstancesList(b *testing.B) {
	f := newFixture(b)
	f.launch(b, f.prefix+"-bench-l1", true, nil)
	f.launch(b, f.prefix+"-bench-l2", false, nil)
	ctx := context.Background()
	b.ResetTimer()
	for b.Loop() {
		in, err := f.c.Instances(ctx, testenv.Tag(), true)
		if err != nil || len(in) < 2 {
			b.Fatal(len(in), err)
		}
	}
}

// BenchmarkExec measures a captured exec round trip (`/sbin/init echo hi`).
func BenchmarkExec(b *testing.B) {
	f := newFixture(b)
	name := f.launch(b, f.prefix+"-bench-e", true, nil)
	ctx := context.Background()
	req := incus.ExecRequest{Command: []string{"/sbin/init", "echo", "hi"}}
	b.ResetTimer()
	for b.Loop() {
		r, err := f.c.Exec(ctx, name, req)
		if err != nil || r.ExitCode != 0 || string(r.Stdout) != "hi\n" {
			b.Fatal(r, err)
		}
	}
}
