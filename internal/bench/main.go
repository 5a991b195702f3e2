// Command bench compares claudebox with the incus CLI doing the same work, as medians of
// paired runs (A then B, alternating, so drift in the machine hits both alike):
//
//	claudebox list            vs  incus list user.claudebox=1     goal ≤ 1.00×
//	claudebox new --container vs  incus launch (same image, profile, config)  goal ≤ 1.15×
//
// and, in bake.go, the baked template's targets (issue 12).
//
// It runs against the host's real stack (make bench runs setup first) with the scratch probe
// image built from the claudebox binary, and removes every box it made.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"sort"
	"strings"
	"time"

	"github.com/claudebox/claudebox/boxcore"
	"github.com/claudebox/claudebox/boxcore/incus"
	"github.com/claudebox/claudebox/boxcore/templates"
	"github.com/claudebox/claudebox/drill/image"
)

func main() {
	bin := flag.String("bin", "bin/claudebox", "the claudebox binary")
	rounds := flag.Int("n", 15, "paired runs per comparison")
	bakeRounds := flag.Int("bake-n", 3, "paired runs per comparison of the baked-template section (a cold mint takes ~40 s)")
	only := flag.String("only", "", "run one section only: incus or bake")
	flag.Parse()
	defer exitOnFailure()
	ctx := context.Background()
	c, err := incus.Connect(ctx, "")
	must(err)
	image, err := image.EnsureImage(ctx, c, *bin, "claudebox-probe")
	must(err)
	stack := boxcore.DefaultStack()
	prefix := fmt.Sprintf("cbbench-%d", time.Now().Unix()%100000)
	defer cleanup(c, prefix)

	if *only != "incus" {
		benchBake(c, *bin, prefix, *bakeRounds)
	}
	if *only == "bake" {
		return
	}
	// A few boxes so list has something to list.
	for i := 0; i < 3; i++ {
		run(*bin, "new", "--name", fmt.Sprintf("%s-seed%d", prefix, i), "--container", "--image", image)
	}
	report("list", paired(*rounds,
		func(int) { run(*bin, "list") },
		func(int) { run("incus", "list", "user.claudebox=1") },
	), 1.0)

	tags := launchFlags(image, "")
	report("new --container", paired(*rounds,
		func(i int) {
			run(*bin, "new", "--name", fmt.Sprintf("%s-a%d", prefix, i), "--container", "--image", image)
		},
		func(i int) {
			run("incus", append([]string{"launch", image, fmt.Sprintf("%s-b%d", prefix, i), "--profile", stack.Profile}, tags...)...)
		},
	), 1.15)
}

// launchFlags are the incus launch flags that give an instance exactly the config new gives a
// box of template (the default when ""): tags, the template's user-data, vendor-data and
// limits, and the root disk size.
func launchFlags(image, template string) []string {
	o := boxcore.NewOptions{Name: "bench", Image: image}
	tmpl, err := templates.Get(template)
	must(err)
	cas, err := templates.HostExtraCAs(templates.HostCADir)
	must(err)
	must(boxcore.ApplyTemplate(&o, boxcore.TemplateChoice{Template: tmpl, HostCAs: cas}))
	cfg := map[string]string{"user.claudebox": "1", "user.claudebox.origin": "fresh", "user.claudebox.from": image,
		"user.claudebox.version": "bench", "user.claudebox.created": time.Now().UTC().Format(time.RFC3339),
		"user.claudebox.mint": "0", "limits.cpu": o.CPU, "limits.memory": o.Memory}
	for k, v := range o.Config {
		cfg[k] = v
	}
	flags := []string{"-d", "root,size=" + o.Disk}
	for k, v := range cfg {
		flags = append(flags, "-c", k+"="+v)
	}
	return flags
}

func paired(n int, a, b func(int)) [2][]time.Duration {
	var out [2][]time.Duration
	for i := 0; i < n; i++ {
		for j, f := range []func(int){a, b} {
			start := time.Now()
			f(i)
			out[j] = append(out[j], time.Since(start))
		}
	}
	return out
}

func median(d []time.Duration) time.Duration {
	s := append([]time.Duration{}, d...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	return s[len(s)/2]
}

func report(what string, t [2][]time.Duration, goal float64) {
	reportAs(what, "claudebox", "incus", t, goal)
}

// reportAs is report with its own names for the two sides.
func reportAs(what, nameA, nameB string, t [2][]time.Duration, goal float64) {
	a, b := median(t[0]), median(t[1])
	ratio := float64(a) / float64(b)
	verdict := "ok"
	if ratio > goal {
		verdict = "OVER GOAL"
	}
	fmt.Printf("%-18s %s %7.1f ms   %s %7.1f ms   ratio %.2f× (goal ≤ %.2f×) %s   [median of %d paired runs]\n",
		what, nameA, ms(a), nameB, ms(b), ratio, goal, verdict, len(t[0]))
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

func run(name string, args ...string) {
	cmd := exec.Command(name, args...)
	if out, err := cmd.CombinedOutput(); err != nil {
		fail(fmt.Sprintf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out))
	}
}

func cleanup(c *incus.Client, prefix string) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	insts, err := c.Instances(ctx, map[string]string{boxcore.TagKey: "1"}, false)
	if err != nil {
		return
	}
	for _, in := range insts {
		if strings.HasPrefix(in.Name, "cbbench-") {
			_ = c.SetState(ctx, in.Name, "stop", true, 0)
			_ = c.DeleteInstance(ctx, in.Name)
		}
	}
}

func must(err error) {
	if err != nil {
		fail(err.Error())
	}
}

// benchFailure ends the bench through main's deferred calls, so the boxes and the bake it
// made are removed on a failure too (os.Exit would skip them).
type benchFailure string

func fail(msg string) { panic(benchFailure(msg)) }

// exitOnFailure, deferred first in main, runs last: after every cleanup.
func exitOnFailure() {
	if r := recover(); r != nil {
		f, ok := r.(benchFailure)
		if !ok {
			panic(r)
		}
		fmt.Fprintln(os.Stderr, "bench:", string(f))
		os.Exit(1)
	}
}
