package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"time"

	"github.com/claudebox/claudebox/boxcore"
	"github.com/claudebox/claudebox/boxcore/incus"
)

// benchBake measures issue 12's targets side by side in one run, as medians of paired runs:
//
//	templates bake claude (first bake)           vs  a cold mint (btrfs, and dir as before)  goal ≤ 1.00×
//	new of a baked Claude box (container)        vs  a cold mint (--no-bake)   goal ≤ 3 s
//	snapshot                  claudebox (btrfs)  vs  incus (btrfs), incus (dir) goal ≤ 0.5 s
//	new --from BOX/SNAP, ready                   vs  incus copy+start (btrfs), incus copy (dir)   goal ≤ 2 s
//
// The bake goes under an alias of its own (CLAUDEBOX_BAKE_PREFIX), so a user's bake is never
// touched; the image and every box are removed at the end.
func benchBake(c *incus.Client, bin, prefix string, rounds int) {
	ctx := context.Background()
	if _, err := c.ImageAlias(ctx, boxcore.DefaultLocalImage()); err != nil {
		fmt.Printf("bake: skipped: no %s on this daemon (run 'claudebox image build')\n", boxcore.DefaultLocalImage())
		return
	}
	bakePrefix := prefix + "-bake/"
	must(os.Setenv(boxcore.BakePrefixEnv, bakePrefix))
	defer func() {
		if img, err := c.ImageByAlias(context.Background(), boxcore.BakeAlias("claude")); err == nil {
			_ = c.DeleteImage(context.Background(), img.Fingerprint)
		}
	}()

	t0 := time.Now()
	run(bin, "templates", "bake", "claude")
	firstBake := time.Since(t0)

	var baked, cold []time.Duration
	for i := 0; i < rounds; i++ {
		a, b := fmt.Sprintf("%s-bk%d", prefix, i), fmt.Sprintf("%s-cold%d", prefix, i)
		baked = append(baked, timed(func() { run(bin, "new", "--name", a, "--container") }))
		cold = append(cold, timed(func() { run(bin, "new", "--name", b, "--container", "--no-bake") }))
		checkClaude(a)
		remove(c, b)
		if i > 0 {
			remove(c, a)
		}
	}
	reportAs("new (claude)", "baked", "cold", [2][]time.Duration{baked, cold}, 1)
	goal("new of a baked Claude box", median(baked), 3*time.Second)
	// Today's cold mint, as the issue measured it: the same template's first boot on the dir
	// pool (the whole image unpacked for every box), by the incus CLI with new's config, its
	// port bound after the start as `new` did then (`host init`: a box started behind
	// claudebox's back has no host, so no DNS, until a round binds it).
	var dirCold []time.Duration
	for i := 0; i < rounds; i++ {
		n := fmt.Sprintf("%s-dircold%d", prefix, i)
		dirCold = append(dirCold, timed(func() {
			run("incus", append([]string{"launch", boxcore.DefaultLocalImage(), n, "--profile", boxcore.DefaultStack().Profile,
				"-s", "default"}, launchFlags(boxcore.DefaultLocalImage(), "claude")...)...)
			run(bin, "host", "init", "--yes")
			run("incus", "exec", n, "--", "cloud-init", "status", "--wait")
		}))
		remove(c, n)
	}
	for _, ref := range []struct {
		what string
		d    time.Duration
	}{{"cold mint (btrfs)", median(cold)}, {"cold mint (dir)", median(dirCold)}} {
		fmt.Printf("%-30s %7.1f s   vs %-17s %7.1f s   ratio %.2f× (goal ≤ 1.00×)\n", "first bake (templates bake)",
			firstBake.Seconds(), ref.what, ref.d.Seconds(), firstBake.Seconds()/ref.d.Seconds())
	}

	// Snapshot and clone of a baked box, on the stack's btrfs pool and, by the incus CLI, on
	// a copy of it in the dir pool "default".
	src := prefix + "-bk0"
	dir := prefix + "-dir"
	run("incus", "copy", src, dir, "-s", "default", "-c", "user.claudebox=0")
	var snapCB, snapIncus, snapDir, cloneCB, cloneIncus, cloneDir []time.Duration
	for i := 0; i < rounds; i++ {
		s := fmt.Sprintf("s%d", i)
		snapCB = append(snapCB, timed(func() { run(bin, "snapshot", src, s) }))
		snapIncus = append(snapIncus, timed(func() { run("incus", "snapshot", "create", src, "i"+s) }))
		snapDir = append(snapDir, timed(func() { run("incus", "snapshot", "create", dir, s) }))
		cl, ic, dc := fmt.Sprintf("%s-cl%d", prefix, i), fmt.Sprintf("%s-icl%d", prefix, i), fmt.Sprintf("%s-dcl%d", prefix, i)
		cloneCB = append(cloneCB, timed(func() { runShowingSlow(2*time.Second, bin, "new", "--name", cl, "--from", src+"/"+s) }))
		cloneIncus = append(cloneIncus, timed(func() {
			// Its own host-side port name (the source's is taken while it runs) and no static
			// address (the one new planned for the source is the source's).
			run("incus", "copy", src+"/"+s, ic, "-c", "user.claudebox=0", "-d", fmt.Sprintf("eth0,host_name=cbbi%d", i), "-d", "eth0,ipv4.address=")
			run("incus", "start", ic)
		}))
		cloneDir = append(cloneDir, timed(func() { run("incus", "copy", dir+"/"+s, dc, "-c", "user.claudebox=0") }))
		for _, n := range []string{cl, ic, dc} {
			remove(c, n)
		}
	}
	reportAs("snapshot", "claudebox (btrfs)", "incus (btrfs)", [2][]time.Duration{snapCB, snapIncus}, 1.15)
	reportAs("snapshot", "claudebox (btrfs)", "incus (dir)", [2][]time.Duration{snapCB, snapDir}, 1)
	goal("snapshot", median(snapCB), 500*time.Millisecond)
	reportAs("new --from", "claudebox (btrfs, to ready)", "incus copy+start (btrfs)", [2][]time.Duration{cloneCB, cloneIncus}, 1.15)
	reportAs("new --from", "claudebox (btrfs, to ready)", "incus copy (dir)", [2][]time.Duration{cloneCB, cloneDir}, 1)
	goal("new --from BOX/SNAP to ready", median(cloneCB), 2*time.Second)
	remove(c, dir)
}

// runShowingSlow is run, printing the command's own output when it took longer than slow:
// its progress lines say where the time went.
func runShowingSlow(slow time.Duration, name string, args ...string) {
	start := time.Now()
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		fail(fmt.Sprintf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out))
	}
	if d := time.Since(start); d > slow {
		fmt.Printf("bench: %s %s took %.1f s:\n%s", name, strings.Join(args, " "), d.Seconds(), out)
	}
}

func timed(f func()) time.Duration {
	start := time.Now()
	f()
	return time.Since(start)
}

func goal(what string, got, want time.Duration) {
	verdict := "ok"
	if got > want {
		verdict = "OVER GOAL"
	}
	fmt.Printf("%-30s median %7.1f ms   (goal ≤ %.1f s) %s\n", what, ms(got), want.Seconds(), verdict)
}

// checkClaude fails the bench when a baked box is not what it claims: Claude Code must run as
// user claude.
func checkClaude(box string) {
	out, err := exec.Command("incus", "exec", box, "--", "su", "-l", "claude", "-c", "claude --version").CombinedOutput()
	if err != nil || !strings.Contains(string(out), "Claude Code") {
		must(errors.New("claude --version in the baked box " + box + ": " + string(out)))
	}
}

func remove(c *incus.Client, name string) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	_ = c.SetState(ctx, name, "stop", true, 0)
	_ = c.DeleteInstance(ctx, name)
}
