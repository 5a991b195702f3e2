package cloudimage_test

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/claudebox/claudebox/boxcore/incus"
	"github.com/claudebox/claudebox/boxcore/templates"
	"github.com/claudebox/claudebox/internal/cloudimage"
)

// The end-to-end proof of the claude template on a real daemon, without `new`: build (or
// reuse) the debootstrap image, launch a container from it on a throwaway NAT bridge whose
// dnsmasq forwards to the host's resolvers (so the box reaches Debian's mirror and the npm
// registry, and nothing else of ours), with cloud-init.user-data = the rendered template,
// wait for cloud-init and check what the box holds.

const (
	tagKey       = "user.claudebox.test"
	instPrefix   = "cbt-ci-"
	netPrefix    = "cbtci"
	sweepAge     = 15 * time.Minute
	cloudInitMax = 15 * time.Minute
)

func randID(n int) string {
	const abc = "abcdefghijklmnopqrstuvwxyz0123456789"
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		panic(err)
	}
	for i := range b {
		b[i] = abc[int(b[i])%len(abc)]
	}
	return string(b)
}

var runID = randID(5)

// description marks the networks this test creates: run id and creation time, so a later
// run can tell a dead run's leftovers from a live parallel run's.
func description() string {
	return fmt.Sprintf("claudebox-test run=%s at=%d", runID, time.Now().Unix())
}

func requireIncus(t *testing.T) *incus.Client {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("integration test against the real Incus daemon: needs root (CI runs it as root)")
	}
	c := incus.NewUnixClient(incus.LocalSocket())
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := c.Server(ctx); err != nil {
		t.Fatalf("running as root but the Incus daemon does not answer (CI starts it; locally run 'make setup'): %v", err)
	}
	return c
}

// sweep removes what dead runs of this test left: instances named cbt-ci-* carrying the
// test tag, and managed networks named cbtci* with this test's description, older than
// sweepAge. Nothing else is touched.
func sweep(t *testing.T, c *incus.Client) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	old := time.Now().Add(-sweepAge)
	insts, err := c.Instances(ctx, nil, false)
	if err != nil {
		t.Logf("sweep: %v", err)
		return
	}
	for _, in := range insts {
		run, tagged := in.Config[tagKey]
		if !tagged || run == runID || !strings.HasPrefix(in.Name, instPrefix) || in.CreatedAt.After(old) {
			continue
		}
		t.Logf("sweep: deleting instance %s left by run %s", in.Name, run)
		deleteInstance(ctx, t, c, in.Name)
	}
	nets, err := c.Networks(ctx)
	if err != nil {
		return
	}
	for _, n := range nets {
		f := strings.Fields(n.Description)
		if !n.Managed || !strings.HasPrefix(n.Name, netPrefix) || len(f) != 3 || f[0] != "claudebox-test" || f[1] == "run="+runID {
			continue
		}
		secs, err := strconv.ParseInt(strings.TrimPrefix(f[2], "at="), 10, 64)
		if err != nil || time.Unix(secs, 0).After(old) {
			continue
		}
		t.Logf("sweep: deleting network %s (%s)", n.Name, n.Description)
		if err := c.DeleteNetwork(ctx, n.Name); err != nil {
			t.Logf("sweep: %v", err)
		}
	}
}

func deleteInstance(ctx context.Context, t *testing.T, c *incus.Client, name string) {
	if err := c.SetState(ctx, name, "stop", true, 0); err != nil && !strings.Contains(err.Error(), "already stopped") {
		t.Logf("cleanup: stopping %s: %v", name, err)
	}
	if err := c.DeleteInstance(ctx, name); err != nil && !errors.Is(err, incus.ErrNotFound) {
		t.Errorf("cleanup: deleting %s: %v", name, err)
	}
}

// freeSubnet picks 10.88.x.0/24 (x from 0) that overlaps no IPv4 route of the host and no
// Incus network's ipv4.address.
func freeSubnet(t *testing.T, c *incus.Client) string {
	var taken []*net.IPNet
	f, err := os.Open("/proc/net/route")
	if err != nil {
		t.Fatalf("reading the routing table: %v", err)
	}
	sc := bufio.NewScanner(f)
	sc.Scan() // header
	for sc.Scan() {
		fs := strings.Fields(sc.Text())
		if len(fs) < 8 {
			continue
		}
		dst, err1 := strconv.ParseUint(fs[1], 16, 32)
		mask, err2 := strconv.ParseUint(fs[7], 16, 32)
		if err1 != nil || err2 != nil || mask == 0 {
			continue // the default route overlaps everything by design
		}
		ip, m := make(net.IP, 4), make(net.IPMask, 4)
		binary.LittleEndian.PutUint32(ip, uint32(dst))
		binary.LittleEndian.PutUint32(m, uint32(mask))
		taken = append(taken, &net.IPNet{IP: ip, Mask: m})
	}
	f.Close()
	nets, err := c.Networks(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range nets {
		if _, in, err := net.ParseCIDR(n.Config["ipv4.address"]); err == nil {
			taken = append(taken, in)
		}
	}
	for x := 0; x < 256; x++ {
		_, cand, _ := net.ParseCIDR(fmt.Sprintf("10.88.%d.0/24", x))
		clash := false
		for _, tk := range taken {
			if tk.Contains(cand.IP) || cand.Contains(tk.IP) {
				clash = true
				break
			}
		}
		if !clash {
			return fmt.Sprintf("10.88.%d.1/24", x)
		}
	}
	t.Fatal("no free /24 in 10.88.0.0/16")
	return ""
}

// hostResolvers returns the nameservers of the host's /etc/resolv.conf.
func hostResolvers(t *testing.T) []string {
	b, err := os.ReadFile("/etc/resolv.conf")
	if err != nil {
		t.Fatalf("reading /etc/resolv.conf: %v", err)
	}
	var out []string
	for _, l := range strings.Split(string(b), "\n") {
		f := strings.Fields(l)
		if len(f) >= 2 && f[0] == "nameserver" && net.ParseIP(f[1]).To4() != nil && !net.ParseIP(f[1]).IsLoopback() {
			out = append(out, f[1])
		}
	}
	if len(out) == 0 {
		t.Fatal("the host's /etc/resolv.conf names no usable IPv4 nameserver for the test bridge to forward to")
	}
	return out
}

type box struct {
	t    *testing.T
	c    *incus.Client
	name string
}

func (b box) exec(ctx context.Context, req incus.ExecRequest) incus.ExecResult {
	b.t.Helper()
	res, err := b.c.Exec(ctx, b.name, req)
	if err != nil {
		b.t.Fatalf("exec %v: %v", req.Command, err)
	}
	return res
}

func (b box) sh(ctx context.Context, script string) (string, int) {
	b.t.Helper()
	res := b.exec(ctx, incus.ExecRequest{Command: []string{"sh", "-c", script}})
	return string(res.Stdout) + string(res.Stderr), res.ExitCode
}

func TestClaudeTemplateInRealBox(t *testing.T) {
	c := requireIncus(t)
	ctx, cancel := context.WithTimeout(context.Background(), 40*time.Minute)
	defer cancel()
	sweep(t, c)

	// The image: built once per recipe, cached on disk and in the daemon.
	t0 := time.Now()
	img, err := cloudimage.Ensure(ctx, c, cloudimage.Default(), testLog{t})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("image %s: built=%v (%s) imported=%v (%s), total %s", img.Alias, img.Built, img.BuildTime.Round(time.Second),
		img.Imported, img.ImportTime.Round(100*time.Millisecond), time.Since(t0).Round(100*time.Millisecond))

	// The throwaway bridge.
	netName := netPrefix + runID
	cidr := freeSubnet(t, c)
	var dnsmasq strings.Builder
	for _, r := range hostResolvers(t) {
		fmt.Fprintf(&dnsmasq, "server=%s\n", r)
	}
	if err := c.CreateNetwork(ctx, netName, "bridge", map[string]string{
		"ipv4.address": cidr, "ipv4.nat": "true", "ipv6.address": "none", "raw.dnsmasq": dnsmasq.String(),
	}, description()); err != nil {
		t.Fatalf("creating network %s: %v", netName, err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		if err := c.DeleteNetwork(ctx, netName); err != nil && !errors.Is(err, incus.ErrNotFound) {
			t.Errorf("cleanup: deleting network %s: %v", netName, err)
		}
	})

	tpl, err := templates.Get("claude")
	if err != nil {
		t.Fatal(err)
	}
	name := instPrefix + runID
	userData, err := tpl.Render(templates.Params{Hostname: name})
	if err != nil {
		t.Fatal(err)
	}
	// This host's egress may intercept TLS with its own CA: the box must trust what the
	// host trusts beyond Debian's bundle, through vendor-data (the user-data stays as rendered).
	cas, err := templates.HostExtraCAs(templates.HostCADir)
	if err != nil {
		t.Fatal(err)
	}
	vendorData, err := templates.TrustCAVendorData(cas)
	if err != nil {
		t.Fatal(err)
	}
	config := map[string]string{tagKey: runID, "cloud-init.user-data": userData}
	if vendorData != "" {
		config["cloud-init.vendor-data"] = vendorData
		t.Logf("vendor-data: trusting the host's %d extra CA certificate(s) from %s", len(cas), templates.HostCADir)
	}
	pools, err := c.StoragePools(ctx)
	if err != nil || len(pools) == 0 {
		t.Fatalf("no storage pool (run 'make setup'): %v", err)
	}
	pool := pools[0].Name
	for _, p := range pools {
		if p.Name == "default" {
			pool = p.Name
		}
	}

	t1 := time.Now()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		deleteInstance(ctx, t, c, name)
	})
	err = c.CreateInstance(ctx, incus.InstancesPost{
		Name: name, Type: "container", Profiles: []string{},
		Config: config,
		Devices: map[string]map[string]string{
			"root": {"type": "disk", "path": "/", "pool": pool},
			"eth0": {"type": "nic", "network": netName, "name": "eth0"},
		},
		Source: incus.InstanceSource{Type: "image", Alias: img.Alias},
		Start:  true,
	}, nil)
	if err != nil {
		t.Fatalf("launching %s: %v", name, err)
	}
	launch := time.Since(t1)
	b := box{t: t, c: c, name: name}

	// Wait for cloud-init the way `new` should: `cloud-init status --wait`, then the JSON.
	t2 := time.Now()
	wctx, wcancel := context.WithTimeout(ctx, cloudInitMax)
	res, err := c.Exec(wctx, name, incus.ExecRequest{Command: templates.WaitCommand()})
	wcancel()
	cloudInit := time.Since(t2)
	st, serr := templates.ParseStatus(res.Stdout)
	if err != nil || serr != nil || st.Failed() {
		stage := "unknown"
		if raw := b.exec(ctx, incus.ExecRequest{Command: templates.StageCommand()}); raw.ExitCode == 0 {
			if s, ok, _ := templates.FailingStage(raw.Stdout); ok {
				stage = fmt.Sprintf("%s: %v", s.Name, s.Errors)
			}
		}
		tail, _ := b.sh(ctx, strings.Join(templates.LogTailCommand(60), " "))
		t.Fatalf("cloud-init did not finish cleanly after %s (wait: exit %d, %v; %s, %v)\nfailing stage: %s\n--- %s (tail) ---\n%s",
			cloudInit.Round(time.Second), res.ExitCode, err, st.Summary(), serr, stage, templates.CloudInitOutputLog, tail)
	}
	var rec struct {
		Method, Claude, Node string
		Seconds              int
	}
	if raw, err := c.PullFile(ctx, name, templates.InstallRecord); err != nil {
		t.Errorf("no install record %s: %v", templates.InstallRecord, err)
	} else if err := json.Unmarshal(raw, &rec); err != nil {
		t.Errorf("install record %q: %v", raw, err)
	}
	t.Logf("TIMING launch=%s cloud-init=%s (of which Claude install=%ds; method %s, claude %s, node %s)",
		launch.Round(100*time.Millisecond), cloudInit.Round(100*time.Millisecond), rec.Seconds, rec.Method, rec.Claude, rec.Node)
	if stages, err := b.sh(ctx, "cloud-init analyze show 2>/dev/null | grep -E '^(Finished stage|Total Time)' || true"); err == 0 {
		t.Logf("cloud-init analyze:\n%s", stages)
	}

	version := regexp.MustCompile(`^\d+\.\d+\.\d+ \(Claude Code\)\s*$`)
	// Login shell.
	if out, code := b.sh(ctx, "su - claude -c 'claude --version'"); code != 0 || !version.MatchString(out) {
		t.Errorf("su - claude -c 'claude --version': exit %d, %q", code, out)
	} else {
		t.Logf("login shell: %s", strings.TrimSpace(out))
	}
	// Non-login, as uid 1000 the way `incus exec --user 1000 --env HOME=...` runs it.
	r := b.exec(ctx, incus.ExecRequest{Command: []string{"claude", "--version"}, User: templates.UserUID, Group: templates.UserUID,
		Env: map[string]string{"HOME": templates.Home}})
	if r.ExitCode != 0 || !version.Match(r.Stdout) {
		t.Errorf("exec --user 1000 claude --version: exit %d, %q %q", r.ExitCode, r.Stdout, r.Stderr)
	}

	// The global CLAUDE.md holds every point.
	md, err := c.PullFile(ctx, name, templates.Home+"/.claude/CLAUDE.md")
	if err != nil {
		t.Fatalf("pulling CLAUDE.md: %v", err)
	}
	flat := strings.ToLower(strings.Join(strings.Fields(string(md)), " "))
	for _, p := range templates.ClaudeMDPoints() {
		if !strings.Contains(flat, strings.ToLower(p)) {
			t.Errorf("~/.claude/CLAUDE.md misses %q", p)
		}
	}

	// No credential anywhere under the user's home.
	if out, code := b.sh(ctx, `cd /home/claude && for f in .claude/.credentials.json .git-credentials .config/gh/hosts.yml .npmrc .netrc; do [ -e "$f" ] && echo "present: $f"; done;
		[ -e .claude.json ] && grep -il oauth .claude.json; find . \( -name '.credentials.json' -o -name '.git-credentials' -o -name 'hosts.yml' \) -print; true`); code != 0 || strings.TrimSpace(out) != "" {
		t.Errorf("credential files under /home/claude: %q (exit %d)", out, code)
	}

	// The rest of the template's promises.
	checks := []struct{ what, script, want string }{
		{"~/.claude owned by claude", "stat -c %U:%G /home/claude/.claude /home/claude/.claude/CLAUDE.md", "claude:claude\nclaude:claude"},
		{"uid of claude", "id -u claude", "1000"},
		{"passwordless sudo", "su - claude -c 'sudo -n true' && echo ok", "ok"},
		{"packages", "command -v git tmux curl >/dev/null && dpkg -s ca-certificates >/dev/null && echo ok", "ok"},
		{"node on PATH", "su - claude -c 'node --version'", ""},
		{"hostname", "hostname", name},
	}
	for _, ck := range checks {
		out, code := b.sh(ctx, ck.script)
		if code != 0 || (ck.want != "" && strings.TrimSpace(out) != ck.want) {
			t.Errorf("%s: exit %d, got %q, want %q", ck.what, code, strings.TrimSpace(out), ck.want)
		}
	}

	// A clone (snapshot → copy), the way `new --from` makes one: the image's templates run
	// again on copy, so the clone gets a new instance-id (cloud-init re-runs its per-instance
	// modules: the install script must be idempotent), its own hostname and machine id, and
	// keeps the source's files.
	if t.Failed() {
		return
	}
	if _, code := b.sh(ctx, "su - claude -c 'mkdir -p ~/work && echo kept > ~/work/marker'"); code != 0 {
		t.Fatal("writing the marker")
	}
	srcID, _ := b.sh(ctx, "cat /etc/machine-id")
	if err := c.CreateSnapshot(ctx, name, "s1"); err != nil {
		t.Fatalf("snapshot: %v", err)
	}
	cloneName := name + "c"
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		deleteInstance(ctx, t, c, cloneName)
	})
	src, _, err := c.Instance(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	ccfg := map[string]string{}
	for k, v := range src.Config {
		if !strings.HasPrefix(k, "volatile.") {
			ccfg[k] = v
		}
	}
	t3 := time.Now()
	if err := c.CreateInstance(ctx, incus.InstancesPost{
		Name: cloneName, Type: "container", Profiles: []string{}, Config: ccfg, Devices: src.Devices,
		Source: incus.InstanceSource{Type: "copy", Source: name + "/s1", InstanceOnly: true}, Start: true,
	}, nil); err != nil {
		t.Fatalf("copying %s/s1: %v", name, err)
	}
	cloneLaunch := time.Since(t3)
	cb := box{t: t, c: c, name: cloneName}
	t4 := time.Now()
	wctx, wcancel = context.WithTimeout(ctx, cloudInitMax)
	res, err = c.Exec(wctx, cloneName, incus.ExecRequest{Command: templates.WaitCommand()})
	wcancel()
	if st, serr := templates.ParseStatus(res.Stdout); err != nil || serr != nil || st.Failed() {
		tail, _ := cb.sh(ctx, strings.Join(templates.LogTailCommand(40), " "))
		t.Fatalf("clone: cloud-init: %v %v %s\n%s", err, serr, st.Summary(), tail)
	}
	t.Logf("TIMING clone: copy+start=%s cloud-init=%s", cloneLaunch.Round(100*time.Millisecond), time.Since(t4).Round(100*time.Millisecond))
	cloneID, _ := cb.sh(ctx, "cat /etc/machine-id")
	if strings.TrimSpace(cloneID) == "" || cloneID == srcID {
		t.Errorf("clone machine-id %q, source %q: want a new one", cloneID, srcID)
	}
	for _, ck := range []struct{ what, script, want string }{
		{"hostname", "hostname", cloneName},
		{"instance-id", "cloud-init query instance_id", cloneName},
		{"kept work", "cat /home/claude/work/marker", "kept"},
		{"claude", "su - claude -c 'claude --version' >/dev/null && echo ok", "ok"},
	} {
		if out, code := cb.sh(ctx, ck.script); code != 0 || strings.TrimSpace(out) != ck.want {
			t.Errorf("clone %s: exit %d, got %q, want %q", ck.what, code, strings.TrimSpace(out), ck.want)
		}
	}
}

type testLog struct{ t *testing.T }

func (l testLog) Write(p []byte) (int, error) {
	for _, line := range strings.Split(strings.TrimRight(string(p), "\n"), "\n") {
		if strings.HasPrefix(line, "cloudimage:") {
			l.t.Log(line)
		}
	}
	return len(p), nil
}
