package testcluster

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/claudebox/claudebox/boxcore/incus"
	"github.com/claudebox/claudebox/drill/image"
	"github.com/claudebox/claudebox/internal/netdump"
	"github.com/claudebox/claudebox/internal/testenv"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// rssKB returns VmRSS of a process in kB (0 when gone).
func rssKB(pid int) int {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) >= 2 && f[0] == "VmRSS:" {
			n, _ := strconv.Atoi(f[1])
			return n
		}
	}
	return 0
}

// ppid returns a process's parent.
func ppid(pid int) int {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	i := bytes.LastIndexByte(b, ')')
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 2 {
		return 0
	}
	n, _ := strconv.Atoi(f[1])
	return n
}

func netnsOf(pid int) uint64 {
	var st unix.Stat_t
	if unix.Stat(fmt.Sprintf("/proc/%d/ns/net", pid), &st) != nil {
		return 0
	}
	return st.Ino
}

func TestClusterUp(t *testing.T) {
	Gate(t)
	c := Up(t, 3)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	run := c.Run
	t.Logf("cluster %s up in %.1f s", run, c.UpTime.Seconds())

	// Every member sees three members, all Online.
	for i, m := range c.Members() {
		ms, err := c.ClusterMembers(ctx, i)
		if err != nil {
			t.Fatalf("%s: cluster members: %v", m.Name, err)
		}
		if len(ms) != 3 {
			t.Fatalf("%s sees %d members: %+v", m.Name, len(ms), ms)
		}
		for _, x := range ms {
			if x.Status != "Online" {
				t.Errorf("%s sees %s %s (%s)", m.Name, x.ServerName, x.Status, x.Message)
			}
		}
	}

	// The layout's guards: no default route in a member, nothing of the link in the host
	// namespace, and the host's packets to a member address fail at once (unreachable route).
	for _, m := range c.Members() {
		if err := withNs(m.Netns, func(h *netlink.Handle) error {
			rs, err := h.RouteList(nil, netlink.FAMILY_ALL)
			if err != nil {
				return err
			}
			for _, r := range rs {
				if r.Dst == nil || r.Dst.IP.IsUnspecified() {
					return fmt.Errorf("default route %v", r)
				}
			}
			return nil
		}); err != nil {
			t.Errorf("%s: %v", m.Name, err)
		}
	}
	addrs, err := netdump.Addrs(nil, netlink.FAMILY_V4)
	if err != nil {
		t.Fatal(err)
	}
	for _, a := range addrs {
		if c.LinkNet.Contains(a.IP) || c.BoxNet.Contains(a.IP) {
			t.Errorf("host namespace has address %s", a.IPNet)
		}
	}
	t0 := time.Now()
	conn, err := net.DialTimeout("tcp", net.JoinHostPort(c.Members()[0].Address, "8443"), 3*time.Second)
	if err == nil {
		conn.Close()
		t.Errorf("the host namespace reached member m1 at %s", c.Members()[0].Address)
	} else if !errors.Is(err, unix.EHOSTUNREACH) {
		t.Errorf("dialing m1 from the host namespace: %v (%.2f s), want no route to host at once", err, time.Since(t0).Seconds())
	}

	// Memory per idle member: its incusd and every other process in its namespace.
	for _, m := range c.Members() {
		ino, err := netnsInode(m.Netns)
		if err != nil {
			t.Fatal(err)
		}
		total, procs := 0, 0
		ents, _ := os.ReadDir("/proc")
		for _, e := range ents {
			pid, err := strconv.Atoi(e.Name())
			if err != nil || netnsOf(pid) != ino {
				continue
			}
			total += rssKB(pid)
			procs++
		}
		t.Logf("%s (%s): incusd RSS %d MB; %d processes in its namespace, %d MB together", m.Name, m.Address, rssKB(m.PID)/1024, procs, total/1024)
	}

	// A tiny image, imported on m1; a container on m2, created through m1.
	bin := testenv.BuildTestInit(t, run)
	alias, err := image.EnsureImage(ctx, c.Client(0), bin, run)
	if err != nil {
		t.Fatalf("importing the image: %v", err)
	}
	name := run + "-c1"
	t0 = time.Now()
	op, err := c.API(ctx, 0, http.MethodPost, "/1.0/instances?target="+url.QueryEscape("m2"), incus.InstancesPost{
		Name: name, Profiles: []string{"default"}, Start: true,
		Source: incus.InstanceSource{Type: "image", Alias: alias},
	}, nil)
	if err != nil {
		t.Fatalf("creating %s on m2: %v", name, err)
	}
	if op != "" {
		if _, err := c.Client(0).WaitOperation(ctx, op, nil); err != nil {
			t.Fatalf("creating %s on m2: %v", name, err)
		}
	}
	t.Logf("launch on m2 through m1: %.2f s", time.Since(t0).Seconds())
	deleted := false
	defer func() {
		if !deleted {
			_ = c.Client(0).SetState(context.Background(), name, "stop", true, 0)
			_ = c.Client(0).DeleteInstance(context.Background(), name)
		}
	}()

	inst, _, err := c.Client(2).Instance(ctx, name) // asked of m3: the cluster knows it
	if err != nil {
		t.Fatal(err)
	}
	if inst.Location != "m2" || inst.Status != "Running" {
		t.Fatalf("%s: location %q status %q, want m2 Running", name, inst.Location, inst.Status)
	}
	st, err := c.Client(1).InstanceState(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	if st.Pid <= 0 {
		t.Fatalf("%s: no init pid: %+v", name, st)
	}
	// Counted from its cgroup: -1 means the container has none (the cgroup remount failed).
	if st.Processes <= 0 {
		t.Errorf("%s: processes = %d: the container has no cgroup", name, st.Processes)
	}
	// Its init's parent (the lxc monitor) lives in m2's network namespace.
	m2ns, err := netnsInode(c.Members()[1].Netns)
	if err != nil {
		t.Fatal(err)
	}
	if mon := ppid(int(st.Pid)); netnsOf(mon) != m2ns {
		t.Errorf("%s: the monitor (pid %d) of init %d is not in m2's namespace", name, mon, st.Pid)
	}
	cg, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", st.Pid))
	if !strings.Contains(string(cg), "lxc.payload."+name) {
		t.Errorf("%s: init's cgroups do not name lxc.payload.%s:\n%s", name, name, cg)
	}

	t0 = time.Now()
	if err := c.Client(0).SetState(ctx, name, "stop", true, 0); err != nil {
		t.Fatalf("stopping %s: %v", name, err)
	}
	if err := c.Client(0).DeleteInstance(ctx, name); err != nil {
		t.Fatalf("deleting %s: %v", name, err)
	}
	deleted = true
	t.Logf("stop+delete on m2 through m1: %.2f s", time.Since(t0).Seconds())

	// Down now (the cleanup would do it later): then nothing of the run may be left.
	t0 = time.Now()
	if err := c.Down(); err != nil {
		t.Fatalf("down: %v", err)
	}
	t.Logf("teardown %.1f s", time.Since(t0).Seconds())
	if left := Leftovers(run); len(left) > 0 {
		t.Errorf("left after Down:\n%s", strings.Join(left, "\n"))
	}
	for _, r := range GuardRoutes() {
		if r == c.LinkNet.String() || r == c.BoxNet.String() {
			t.Errorf("unreachable route %s still in the host namespace", r)
		}
	}
}
