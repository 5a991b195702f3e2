// Package testcluster builds a real Incus cluster of several members on this one machine,
// beside the host's own daemon, for tests, and removes all of it afterwards.
//
// Layout of a run named <run> (RunPrefix + 6 random characters):
//
//   - StateRoot/<run>/owner names the test process; StateRoot/<run>/nets the /24s claimed.
//   - Network namespace <run>-br holds bridge br0, the link between members. Nothing of the
//     link is in the host namespace.
//   - Network namespace <run>-m<i> holds member i: eth0 (veth to br0) with 198.19.L.(10+i)/24,
//     no default route; its incusd (INCUS_DIR=StateRoot/<run>/m<i>/incus, log
//     StateRoot/<run>/m<i>/incusd.log), and the bridge, dnsmasq and nftables tables its
//     incusd makes for the cluster's managed network (198.19.B.1/24, no NAT, no upstream DNS).
//   - The link /24 (198.19.L.0/24) and box /24 (198.19.B.0/24) are picked at run time
//     among the /24s of 198.19.0.0/16 (RFC 2544) the host routes nothing into, and an
//     unreachable route for each is put in the host namespace first: a packet the host
//     sends there by mistake fails at once instead of leaving by the default route.
//
// Each incusd is started through `ip netns exec`, which gives it a private mount namespace
// and re-mounts /sys for the member's network namespace; that hides /sys/fs/cgroup, so the
// host's cgroup mounts are mounted again there before incusd is exec'd (without them
// containers run with no cgroup at all, silently).
//
// incus CLI calls for a member (CLI) run inside the member's namespace with its INCUS_DIR,
// INCUS_CONF and --force-local: a CLI in the host namespace would send a join's TLS to a
// member address by the host's routes. Clients over the unix sockets (Client, API) work from
// anywhere.
//
// Up registers Down with t.Cleanup: when every member answers, `incus admin shutdown` to all
// of them at once (the last one standing has lost quorum and hangs on its database: it gets
// 2 s, then SIGKILL), else SIGKILL at once; then every process of the run is killed
// (leftover dnsmasq, lxc monitors, containers) and the namespaces, the state directory and
// the unreachable routes are removed. Sweep, called by Up first, does the same for runs
// whose test process is gone (found by name: state directories, namespaces, and processes
// by namespace, by the state directory in their command line or environment, or by a
// container cgroup lxc.payload.<run>-*).
package testcluster

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/claudebox/claudebox/boxcore/incus"
)

// Pool and Network are the names of the cluster's storage pool (driver dir) and managed
// bridge network; the default profile uses both.
const (
	Pool    = "local"
	Network = "cbclnet"
)

// Member is one cluster member.
type Member struct {
	Name    string // cluster member name: "m1", "m2", ...
	Address string // link address, e.g. "198.19.37.11" (the API listens on :8443)
	Socket  string // the member's unix socket, usable from the host namespace
	Dir     string // its INCUS_DIR
	Netns   string // its network namespace, "<run>-m<i>"
	PID     int    // its incusd
}

// Cluster is a running test cluster.
type Cluster struct {
	Run     string     // run name, the prefix of everything the run creates
	Dir     string     // StateRoot/<run>
	LinkNet *net.IPNet // the members' link /24
	BoxNet  *net.IPNet // the managed network's /24 (inside every member)
	// UpTime is how long Up took from its start (after Sweep) to all members Online.
	UpTime time.Duration

	members []Member
	clients []*incus.Client
	waits   []chan struct{} // closed when member i's incusd has exited
	logf    func(string, ...any)
	incusd  string
	cli     string

	downOnce sync.Once
	downErr  error
}

// Members returns the members, m1 first.
func (c *Cluster) Members() []Member { return append([]Member(nil), c.members...) }

// Client returns a client for member i (0-based) over its unix socket.
func (c *Cluster) Client(i int) *incus.Client { return c.clients[i] }

// findIncusd returns the daemon binary: /usr/libexec/incus/incusd, else incusd on PATH.
func findIncusd() (string, error) {
	if fi, err := os.Stat("/usr/libexec/incus/incusd"); err == nil && !fi.IsDir() {
		return "/usr/libexec/incus/incusd", nil
	}
	return exec.LookPath("incusd")
}

// Gate skips a test unless CLAUDEBOX_CLUSTER_TESTS=1 (make test sets it): a cluster takes
// three daemons and ~15 s.
func Gate(t testing.TB) {
	t.Helper()
	if os.Getenv("CLAUDEBOX_CLUSTER_TESTS") != "1" {
		t.Skip("cluster tests run with CLAUDEBOX_CLUSTER_TESTS=1: make test-cluster")
	}
}

// Up builds a cluster of n members (n ≥ 1; use 3 for anything about failover) and
// registers its removal with t.Cleanup. It skips the test when not root and fails it when
// Incus (incusd, the incus CLI) or ip is missing.
func Up(t testing.TB, n int) *Cluster {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("testcluster: needs root (network namespaces, incusd)")
	}
	incusd, err := findIncusd()
	if err != nil {
		t.Fatalf("testcluster: the Incus daemon binary is missing (/usr/libexec/incus/incusd, incusd on PATH): %v", err)
	}
	cli, err := exec.LookPath("incus")
	if err != nil {
		t.Fatalf("testcluster: the incus CLI is missing: %v", err)
	}
	if _, err := exec.LookPath("ip"); err != nil {
		t.Fatalf("testcluster: ip (iproute2) is missing: %v", err)
	}
	if n < 1 || n > 200 {
		t.Fatalf("testcluster: %d members (1 to 200)", n)
	}
	if err := Sweep(t.Logf); err != nil {
		t.Logf("testcluster: sweep: %v", err)
	}
	c, err := up(n, incusd, cli, t.Logf)
	if c != nil {
		t.Cleanup(func() {
			if err := c.Down(); err != nil {
				t.Errorf("testcluster: removing %s: %v", c.Run, err)
			}
		})
	}
	if err != nil {
		t.Fatalf("testcluster: %v", err)
	}
	return c
}

func up(n int, incusd, cli string, logf func(string, ...any)) (*Cluster, error) {
	start := time.Now()
	run := newRunName()
	rs, err := createRun(run)
	if err != nil {
		return nil, fmt.Errorf("state directory: %w", err)
	}
	c := &Cluster{Run: run, Dir: rs.dir, logf: logf, incusd: incusd, cli: cli}
	if c.LinkNet, err = claimSubnet(rs); err != nil {
		return c, err
	}
	if c.BoxNet, err = claimSubnet(rs); err != nil {
		return c, err
	}
	var nsNames []string
	var addrs []*net.IPNet
	for i := 1; i <= n; i++ {
		ip := net.IPv4(c.LinkNet.IP[0], c.LinkNet.IP[1], c.LinkNet.IP[2], byte(10+i)).To4()
		m := Member{
			Name:    fmt.Sprintf("m%d", i),
			Address: ip.String(),
			Dir:     filepath.Join(rs.dir, fmt.Sprintf("m%d", i), "incus"),
			Netns:   fmt.Sprintf("%s-m%d", run, i),
		}
		m.Socket = filepath.Join(m.Dir, "unix.socket")
		c.members = append(c.members, m)
		c.clients = append(c.clients, incus.NewUnixClient(m.Socket))
		c.waits = append(c.waits, nil)
		nsNames = append(nsNames, m.Netns)
		addrs = append(addrs, &net.IPNet{IP: ip, Mask: net.CIDRMask(24, 32)})
	}
	if err := buildLink(run+"-br", nsNames, addrs); err != nil {
		return c, fmt.Errorf("link: %w", err)
	}
	script, err := remountScript()
	if err != nil {
		return c, err
	}
	// Members start in parallel; joins are sequential.
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i := range c.members {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			errs[i] = c.startMember(i, script)
		}(i)
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return c, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	if err := c.bootstrap(ctx); err != nil {
		return c, fmt.Errorf("%w\nm1's incusd.log ends:\n%s", err, c.logTail(0))
	}
	for i := 1; i < n; i++ {
		if err := c.join(ctx, i); err != nil {
			return c, fmt.Errorf("%w\n%s's incusd.log ends:\n%s\nm1's incusd.log ends:\n%s", err, c.members[i].Name, c.logTail(i), c.logTail(0))
		}
	}
	if err := c.waitOnline(ctx); err != nil {
		return c, err
	}
	c.UpTime = time.Since(start)
	logf("testcluster: %s up: %d members on %s, box network %s, in %.1f s", run, n, c.LinkNet, c.BoxNet, c.UpTime.Seconds())
	return c, nil
}

// memberEnv is the environment for member i's incusd and CLI calls.
func (c *Cluster) memberEnv(i int) []string {
	var env []string
	for _, e := range os.Environ() {
		if !strings.HasPrefix(e, "INCUS_") {
			env = append(env, e)
		}
	}
	m := c.members[i]
	return append(env, "INCUS_DIR="+m.Dir, "INCUS_CONF="+filepath.Join(filepath.Dir(m.Dir), "client"))
}

// startMember starts member i's incusd in its namespace (cgroups re-mounted first) and
// waits until it answers.
func (c *Cluster) startMember(i int, remount string) error {
	m := &c.members[i]
	mdir := filepath.Dir(m.Dir)
	for _, d := range []string{m.Dir, filepath.Join(mdir, "client"), filepath.Join(mdir, "pool")} {
		if err := os.MkdirAll(d, 0o711); err != nil {
			return err
		}
	}
	logf, err := os.OpenFile(filepath.Join(mdir, "incusd.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	defer logf.Close()
	cmd := exec.Command("ip", "netns", "exec", m.Netns, "/bin/sh", "-c", remount+"exec "+shq(c.incusd)+" --group root")
	cmd.Env = c.memberEnv(i)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.Dir = "/"
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("%s: starting incusd: %w", m.Name, err)
	}
	m.PID = cmd.Process.Pid
	done := make(chan struct{})
	c.waits[i] = done
	go func() { _ = cmd.Wait(); close(done) }()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	for {
		select {
		case <-done:
			return fmt.Errorf("%s: incusd exited at start; its log ends:\n%s", m.Name, c.logTail(i))
		default:
		}
		pctx, pcancel := context.WithTimeout(ctx, 2*time.Second)
		_, err := c.clients[i].Server(pctx)
		pcancel()
		if err == nil {
			return nil
		}
		if ctx.Err() != nil {
			return fmt.Errorf("%s: incusd does not answer after 60 s: %v", m.Name, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// logTail returns the end of member i's incusd log.
func (c *Cluster) logTail(i int) string {
	return tail(filepath.Join(filepath.Dir(c.members[i].Dir), "incusd.log"))
}

func tail(path string) string {
	b, _ := os.ReadFile(path)
	if len(b) > 2000 {
		b = b[len(b)-2000:]
	}
	return strings.TrimSpace(string(b))
}

// Command is prog args... run in member i's (0-based) network and mount namespaces — its
// incusd's own, so it sees the mounts that daemon made (a pool's loop file) — with its
// INCUS_DIR and INCUS_CONF: a claudebox there talks to that member's daemon and converges
// that member's kernel state (its nftables tables, routes, bridge ports).
func (c *Cluster) Command(ctx context.Context, i int, prog string, args ...string) *exec.Cmd {
	pid := strconv.Itoa(c.members[i].PID)
	cmd := exec.CommandContext(ctx, "nsenter", append([]string{"--target", pid, "--mount", "--net", "--", prog}, args...)...)
	cmd.Env = c.memberEnv(i)
	return cmd
}

// CLI runs `incus --force-local args...` for member i (0-based) inside its network
// namespace with its INCUS_DIR and INCUS_CONF, stdin as its input; it returns stdout.
func (c *Cluster) CLI(ctx context.Context, i int, stdin string, args ...string) (string, error) {
	m := c.members[i]
	full := append([]string{"netns", "exec", m.Netns, c.cli, "--force-local"}, args...)
	cmd := exec.CommandContext(ctx, "ip", full...)
	cmd.Env = c.memberEnv(i)
	cmd.Stdin = strings.NewReader(stdin)
	var out, errb strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Run(); err != nil {
		return out.String(), fmt.Errorf("%s: incus %s: %v: %s", m.Name, strings.Join(args, " "), err, strings.TrimSpace(errb.String()))
	}
	return out.String(), nil
}

func (c *Cluster) poolSource(i int) string {
	return filepath.Join(filepath.Dir(c.members[i].Dir), "pool")
}

// bootstrap makes member 1 the cluster's first member, with the pool, network and the
// default profile.
func (c *Cluster) bootstrap(ctx context.Context) error {
	m := c.members[0]
	gw := net.IPv4(c.BoxNet.IP[0], c.BoxNet.IP[1], c.BoxNet.IP[2], 1)
	preseed := fmt.Sprintf(`config:
  core.https_address: "%[1]s:8443"
  cluster.https_address: "%[1]s:8443"
  images.auto_update_interval: "0"
storage_pools:
- name: %[2]s
  driver: dir
  config:
    source: "%[3]s"
networks:
- name: %[4]s
  type: bridge
  config:
    ipv4.address: "%[5]s/24"
    ipv4.nat: "false"
    ipv6.address: none
    raw.dnsmasq: "no-resolv"
profiles:
- name: default
  devices:
    root:
      type: disk
      path: /
      pool: %[2]s
    eth0:
      type: nic
      name: eth0
      network: %[4]s
cluster:
  server_name: %[6]s
  enabled: true
`, m.Address, Pool, c.poolSource(0), Network, gw, m.Name)
	if _, err := c.CLI(ctx, 0, preseed, "admin", "init", "--preseed"); err != nil {
		return fmt.Errorf("bootstrapping %s: %w", m.Name, err)
	}
	return nil
}

// join adds member i to the cluster with a token from member 1.
func (c *Cluster) join(ctx context.Context, i int) error {
	m := c.members[i]
	out, err := c.CLI(ctx, 0, "", "cluster", "add", m.Name, "--quiet")
	if err != nil {
		return fmt.Errorf("join token for %s: %w", m.Name, err)
	}
	lines := strings.Fields(strings.TrimSpace(out))
	if len(lines) == 0 {
		return fmt.Errorf("join token for %s: empty output", m.Name)
	}
	token := lines[len(lines)-1]
	preseed := fmt.Sprintf(`cluster:
  enabled: true
  server_name: %s
  server_address: "%s:8443"
  cluster_token: "%s"
  member_config:
  - entity: storage-pool
    name: %s
    key: source
    value: "%s"
`, m.Name, m.Address, token, Pool, c.poolSource(i))
	if _, err := c.CLI(ctx, i, preseed, "admin", "init", "--preseed"); err != nil {
		return fmt.Errorf("joining %s: %w", m.Name, err)
	}
	return nil
}

// waitOnline waits until every member reports every member Online.
func (c *Cluster) waitOnline(ctx context.Context) error {
	var last string
	for {
		ok := true
		for i := range c.members {
			ms, err := c.ClusterMembers(ctx, i)
			if err != nil {
				ok, last = false, err.Error()
				break
			}
			online := 0
			for _, m := range ms {
				if m.Status == "Online" {
					online++
				} else {
					last = fmt.Sprintf("%s is %s: %s", m.ServerName, m.Status, m.Message)
				}
			}
			if online != len(c.members) || len(ms) != len(c.members) {
				ok = false
				if last == "" {
					last = fmt.Sprintf("%s sees %d members", c.members[i].Name, len(ms))
				}
				break
			}
		}
		if ok {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("members not all Online: %s", last)
		case <-time.After(250 * time.Millisecond):
		}
	}
}

// exited reports whether member i's incusd has exited.
func (c *Cluster) exited(i int) bool {
	if c.waits[i] == nil {
		return true
	}
	select {
	case <-c.waits[i]:
		return true
	default:
		return false
	}
}

// lastGrace is how long the last member standing may take to stop before it is killed.
const lastGrace = 2 * time.Second

// Down stops the cluster and removes everything of the run; Up registers it with
// t.Cleanup, and calling it earlier (to measure, or to check the machine after) is fine:
// it runs once.
func (c *Cluster) Down() error {
	c.downOnce.Do(func() { c.downErr = c.down() })
	return c.downErr
}

func (c *Cluster) down() error {
	start := time.Now()
	graceful := len(c.members) > 0
	for i := range c.members {
		if c.exited(i) {
			graceful = false
			continue
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_, err := c.clients[i].Server(ctx)
		cancel()
		if err != nil {
			graceful = false
		}
	}
	how := "killed"
	var wg sync.WaitGroup
	if graceful {
		// Every member is asked at once. The last one standing has lost quorum: its shutdown
		// waits on the database (measured: 7 to 30 s, or until killed), so it gets lastGrace
		// and then SIGKILL; its dnsmasq is killed with the rest of the run below.
		for i := range c.members {
			wg.Add(1)
			go func(i int) {
				defer wg.Done()
				ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
				defer cancel()
				if _, err := c.CLI(ctx, i, "", "admin", "shutdown", "--timeout", "25"); err != nil && !c.exited(i) {
					c.logf("testcluster: %v", err)
				}
			}(i)
		}
		deadline := time.Now().Add(30 * time.Second)
		var alone time.Time
		for {
			var alive []int
			for i := range c.members {
				if !c.exited(i) {
					alive = append(alive, i)
				}
			}
			if len(alive) == 0 {
				how = "stopped"
				break
			}
			if len(alive) == 1 && len(c.members) > 1 {
				if alone.IsZero() {
					alone = time.Now()
				}
				if time.Since(alone) > lastGrace {
					_ = syscall.Kill(c.members[alive[0]].PID, syscall.SIGKILL)
					how = fmt.Sprintf("stopped (the last, %s, without quorum: killed)", c.members[alive[0]].Name)
					break
				}
			}
			if time.Now().After(deadline) {
				how = fmt.Sprintf("stopped (%d did not stop in 30 s: killed)", len(alive))
				break
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	stopped := time.Since(start)
	err := removeRun(c.Run, []*net.IPNet{c.LinkNet, c.BoxNet}, c.logf)
	wg.Wait() // the shutdown calls end with their daemons (or were killed with the run)
	c.logf("testcluster: %s %s in %.1f s, removed in %.1f s", c.Run, how, stopped.Seconds(), time.Since(start).Seconds())
	return err
}
