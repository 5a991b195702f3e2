package drill

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/claudebox/claudebox/boxcore"
	"github.com/claudebox/claudebox/drill/image"
	"github.com/claudebox/claudebox/internal/testenv"
	"github.com/claudebox/claudebox/internal/teststack"
)

// BenchmarkDrill measures the whole drill (container mode, full matrix) on the host's stack:
// goal <= 10 s for 2 boxes, and 8 boxes <= 2x that. `make bench` runs it with -benchtime 1x;
// scripts/bench-drill.sh measures the built binary the same way.
func BenchmarkDrill(b *testing.B) {
	c := testenv.RequireIncus(b)
	bin := teststack.Binary(b)
	defer teststack.RemoveBinary()
	// The probe image of a freshly built binary is made once, before the clock: the goal is
	// the drill of a host that has run it before, not the first import.
	if _, err := image.EnsureImage(context.Background(), c, bin, "claudebox-probe"); err != nil {
		b.Fatal(err)
	}
	walls := map[int]float64{}
	for _, n := range []int{2, 8} {
		b.Run(fmt.Sprintf("boxes=%d", n), func(b *testing.B) {
			var total float64
			for i := 0; i < b.N; i++ {
				rep, err := Run(context.Background(), Options{Client: c, Stack: boxcore.DefaultStack(), Boxes: n, Binary: bin, Version: "bench"})
				if err != nil {
					b.Fatal(err)
				}
				if !rep.OK {
					var m strings.Builder
					rep.PrintMatrix(&m)
					for _, l := range strings.Split(m.String(), "\n") {
						if strings.Contains(l, "check-failed") || strings.Contains(l, " FAIL") {
							b.Log(l)
						}
					}
					b.Fatalf("drill did not pass: %s", rep.Verdict)
				}
				total += rep.WallSeconds
			}
			walls[n] = total / float64(b.N)
			b.ReportMetric(walls[n], "wall-s")
			if n == 8 && walls[2] > 0 {
				b.ReportMetric(walls[8]/walls[2], "x-of-2-boxes")
			}
		})
	}
	fmt.Fprintf(os.Stderr, "drill wall: 2 boxes %.2fs (goal <= 10s), 8 boxes %.2fs (%.2fx, goal <= 2x)\n", walls[2], walls[8], walls[8]/walls[2])
}
