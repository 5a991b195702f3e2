// Package specs is the isolation drill as a Ginkgo suite: the whole matrix on the host's
// real stack (DefaultStack) as specs — a Describe per claim, an It per probe row — then the
// seeded holes (Ordered, Serial) with the host verified restored, then SIGKILL-and-cleanup.
//
//	ginkgo ./drill/...   or   go test ./drill/...   (root and a running Incus daemon)
//
// The run is appended to $CLAUDEBOX_DRILL_RECORD, else to the user's drill record
// (drill.DefaultRecord): never to the repository's RUNS.md, which `make drill` writes, so a
// test run leaves the tree clean. It skips when not root and fails when root and the daemon
// is down (testenv.RequireIncus).
package specs

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"

	"github.com/claudebox/claudebox/boxcore"
	"github.com/claudebox/claudebox/boxcore/incus"
	"github.com/claudebox/claudebox/drill"
	"github.com/claudebox/claudebox/internal/testenv"
	"github.com/claudebox/claudebox/internal/teststack"
)

var (
	client *incus.Client
	binary string
	report *drill.Report
	runErr error
)

// suiteRecord is where the suite appends its run.
func suiteRecord() string {
	if p := os.Getenv("CLAUDEBOX_DRILL_RECORD"); p != "" {
		return p
	}
	return drill.DefaultRecord()
}

// soakReapplies: the contract's soak (20 re-applies, an incusd restart, a drift repair) unless
// CLAUDEBOX_DRILL_NO_SOAK is set.
func soakReapplies() int {
	if os.Getenv("CLAUDEBOX_DRILL_NO_SOAK") != "" {
		return 0
	}
	return 20
}

func TestDrill(t *testing.T) {
	client = testenv.RequireIncus(t)
	binary = teststack.Binary(t)
	defer teststack.RemoveBinary()
	RegisterFailHandler(Fail)

	// The drill runs once, before the tree is built, because the rows (and so the Its) come
	// from the topology it measured: the matrix, then every seeded hole.
	stack := boxcore.DefaultStack()
	if os.Getenv("CLAUDEBOX_DRILL_NO_SELFTEST") == "" {
		// A self-test starts from the declared stack; make sure of it, as `make test` does.
		if _, err := boxcore.NewHost(client, stack).Init(context.Background(), boxcore.InitOptions{}); err != nil {
			t.Fatalf("host init on %s: %v", stack.Network, err)
		}
	}
	report, runErr = drill.Run(context.Background(), drill.Options{
		Client: client, Stack: stack, Boxes: 2, Binary: binary, Version: "suite",
		Progress: GinkgoWriter, SelfTest: os.Getenv("CLAUDEBOX_DRILL_NO_SELFTEST") == "",
		Soak: soakReapplies(),
	})
	if report != nil {
		if err := report.Append(suiteRecord()); err != nil {
			t.Logf("appending to %s: %v", suiteRecord(), err)
		} else {
			t.Logf("drill run recorded in %s", suiteRecord())
		}
	}
	declare()
	var failed []string
	ReportAfterSuite("digest", func(r Report) {
		for _, sr := range r.SpecReports {
			if sr.Failed() {
				failed = append(failed, fmt.Sprintf("%s: %s", sr.FullText(), firstLines(sr.Failure.Message, 4)))
			}
		}
	})
	RunSpecs(t, "claudebox isolation drill")
	// Ginkgo's own summary names the failed specs; CI shows only a log's tail, so the why of
	// each (and the drill's own error) ends the output too.
	if runErr != nil {
		t.Errorf("the drill: %v", runErr)
	}
	for _, f := range failed {
		t.Logf("failed: %s", f)
	}
}

// firstLines is s cut to its first n lines.
func firstLines(s string, n int) string {
	lines := strings.SplitN(s, "\n", n+1)
	if len(lines) > n {
		lines = append(lines[:n], "…")
	}
	return strings.Join(lines, " | ")
}

func declare() {
	It("ran the drill", func() {
		Expect(runErr).NotTo(HaveOccurred())
		Expect(report).NotTo(BeNil())
		Expect(report.Matrix).NotTo(BeNil())
		AddReportEntry("verdict", report.Verdict)
		AddReportEntry("wall", fmt.Sprintf("%.2fs", report.WallSeconds))
	})
	It("opened no re-apply window it did not measure", func() {
		Expect(report).NotTo(BeNil())
		AddReportEntry("re-applies", report.Reapplies.String())
		Expect(report.Reapplies.UnderFlood).To(BeNumerically(">=", 1), "no window was measured: %s", report.Reapplies)
		Expect(report.Reapplies.Unmeasured).To(BeZero(), "%s", report.Reapplies)
		Expect(report.Reapplies.WatchLost).To(BeZero(), "%s", report.Reapplies)
	})
	if report == nil || report.Matrix == nil {
		return
	}
	for _, claim := range drill.ClaimOrder {
		var rows []*drill.Row
		for _, r := range report.Matrix.Rows {
			if r.Claim == claim {
				rows = append(rows, r)
			}
		}
		if len(rows) == 0 {
			continue
		}
		Describe("claim "+claim, func() {
			for _, r := range rows {
				It(fmt.Sprintf("%s → %s %s: expect %s [%s]", r.From, r.To, r.ProbeLabel(), r.Expected, r.Layers), func() {
					Expect(r.Verdict).To(Equal(drill.Pass),
						"observed %s (%s); %s; evidence: %s", r.Observed, r.Verdict, r.Why, r.Result.Evidence)
				})
			}
		})
	}
	Describe("seeded holes", Ordered, Serial, func() {
		if os.Getenv("CLAUDEBOX_DRILL_NO_SELFTEST") != "" {
			return
		}
		byName := map[string]*drill.HoleResult{}
		for _, h := range report.Holes {
			byName[h.Name] = h
		}
		for _, h := range drill.Holes {
			It(fmt.Sprintf("%s: exactly the rows it alone holds turn red, then the host is restored", h.Name), func() {
				hr := byName[h.Name]
				Expect(hr).NotTo(BeNil(), "the hole did not run: %v", runErr)
				Expect(hr.Missing).To(BeEmpty(), "expected red but held")
				Expect(hr.Unexpected).To(BeEmpty(), "red but not attributed to %v", h.Off)
				Expect(hr.CheckFailed).To(BeEmpty())
				Expect(hr.Restored).To(BeTrue(), "host check after restore: %s", hr.RestoreErr)
			})
		}
		It("box→box: removing any one layer leaves it blocked, removing all opens it", func() {
			for _, name := range []string{"nft bridge drop removed", "br_netfilter off", "port isolation off"} {
				Expect(byName[name]).NotTo(BeNil())
				for _, id := range byName[name].ObservedRed {
					Expect(id).NotTo(HavePrefix("box-box"), "%s opened box→box", name)
				}
			}
			all := byName["all box→box layers off"]
			Expect(all).NotTo(BeNil())
			Expect(strings.Join(all.ObservedRed, " ")).To(ContainSubstring("box-box/"))
		})
		It("leaves the host stack as declared", func() {
			r, err := boxcore.NewHost(client, boxcore.DefaultStack()).Check(context.Background())
			Expect(err).NotTo(HaveOccurred())
			Expect(r.Drift()).To(BeEmpty())
		})
	})
	Describe("SIGKILL, then claudebox drill --cleanup", Serial, func() {
		for _, phase := range []string{"decoy-up", "minting", "probing"} {
			It("leaves nothing behind when killed at "+phase, func() {
				killAt(phase)
			})
		}
	})
}

// killAt runs the built binary's drill until it parks at phase, SIGKILLs it, runs
// --cleanup, and asserts no drill instance, netns, veth, route or dnsmasq line is left.
func killAt(phase string) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, binary, "drill", "--record", filepath.Join(GinkgoT().TempDir(), "RUNS.md"))
	cmd.Env = append(os.Environ(), "CLAUDEBOX_DRILL_PAUSE="+phase, "CLAUDEBOX_STACK=")
	stderr, err := cmd.StderrPipe()
	Expect(err).NotTo(HaveOccurred())
	Expect(cmd.Start()).To(Succeed())
	paused := make(chan bool, 1)
	var mu sync.Mutex
	var tail []string // the drill's last lines: why it ended, when it did
	go func() {
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			fmt.Fprintln(GinkgoWriter, sc.Text())
			mu.Lock()
			tail = append(tail, sc.Text())
			if len(tail) > 6 {
				tail = tail[1:]
			}
			mu.Unlock()
			if strings.Contains(sc.Text(), "paused at "+phase) {
				paused <- true
			}
		}
		close(paused)
	}()
	lastLines := func() string { mu.Lock(); defer mu.Unlock(); return strings.Join(tail, " | ") }
	select {
	case ok := <-paused:
		if !ok {
			_ = cmd.Wait()
		}
		Expect(ok).To(BeTrue(), "the drill ended (%v) before pausing at %s: %s", cmd.ProcessState, phase, lastLines())
	case <-time.After(90 * time.Second):
		Fail("the drill never paused at " + phase + ": " + lastLines())
	}
	// What the run has made is listed before the kill (the control: Leftovers sees it), so
	// the cleanup follows the kill at once: at probing, the first box's exposure is still
	// being written, and a daemon still busy with it must not make the cleanup skip the box.
	left, err := drill.Leftovers(ctx, client)
	Expect(err).NotTo(HaveOccurred())
	Expect(left).NotTo(BeEmpty(), "killing at %s should leave something to clean", phase)
	Expect(cmd.Process.Signal(syscall.SIGKILL)).To(Succeed())
	_ = cmd.Wait()

	out, err := exec.CommandContext(ctx, binary, "drill", "--cleanup").CombinedOutput()
	Expect(err).NotTo(HaveOccurred(), "%s", out)
	fmt.Fprintf(GinkgoWriter, "cleanup after kill at %s:\n%s", phase, out)
	left, err = drill.Leftovers(ctx, client)
	Expect(err).NotTo(HaveOccurred())
	Expect(left).To(BeEmpty())
	r, err := boxcore.NewHost(client, boxcore.DefaultStack()).Check(ctx)
	Expect(err).NotTo(HaveOccurred())
	Expect(r.Drift()).To(BeEmpty())
}
