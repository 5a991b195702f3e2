package drill

import (
	"bytes"
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/netip"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/insomniacslk/dhcp/dhcpv4"

	"github.com/claudebox/claudebox/boxcore"
	"github.com/claudebox/claudebox/boxcore/incus"
	"github.com/claudebox/claudebox/drill/probes"
)

// DrillTag marks every instance a drill mints; its value is the run id.
const DrillTag = "user.claudebox.drill"

// Agent paths: the scratch image's init is the binary; in a VM the binary is pushed here.
const (
	ContainerAgent = "/sbin/init"
	VMAgent        = "/usr/local/bin/claudebox-probe"
)

// Box is one drill box as the engine sees it after it is ready.
type Box struct {
	Name     string     `json:"name"`
	IPv4     netip.Addr `json:"ipv4"`
	Prefix   int        `json:"prefix"`
	Gateway  netip.Addr `json:"gateway"`
	LL       netip.Addr `json:"ipv6_link_local,omitzero"`
	Hostname string     `json:"dhcp_hostname"` // what the agent sent as DHCP option 12
	Veth     string     `json:"host_veth"`
	MAC      string     `json:"mac"`
	agent    string
	pid      int64 // the box's init, as Incus reported it when the box got ready
}

// BoxName is the name of the i-th box of a run's gen-th set: cbdrill-<run>-a, -b, ...;
// later sets (fresh boxes after a seeded DNS hole) are cbdrill-<run>-2a, ...
func BoxName(run string, gen, i int) string {
	if gen == 0 {
		return fmt.Sprintf("%s%s-%c", NetnsPrefix, run, 'a'+i)
	}
	return fmt.Sprintf("%s%s-%d%c", NetnsPrefix, run, gen+1, 'a'+i)
}

// mintBoxes creates the run's network boxes (the gen-th set) through mint.
func (e *engine) mintBoxes(ctx context.Context) ([]*Box, error) {
	return e.mint(ctx, e.networkBoxNames())
}

// networkBoxNames are the names of the gen-th set of network boxes.
func (e *engine) networkBoxNames() []string {
	names := make([]string, e.o.Boxes)
	for i := range names {
		names[i] = BoxName(e.run, e.gen, i)
	}
	return names
}

// nextResBoxName is the name of the next resource box of the run.
func (e *engine) nextResBoxName() string {
	e.resGen++
	return ResBoxName(e.run, e.resGen)
}

// ResBoxName is the name of the run's n-th resource box: cbdrill-<run>-r, -r2, ...
func ResBoxName(run string, n int) string {
	if n <= 1 {
		return fmt.Sprintf("%s%s-r", NetnsPrefix, run)
	}
	return fmt.Sprintf("%s%s-r%d", NetnsPrefix, run, n)
}

// wantsResBox: the resource rows run in container mode with a sibling to watch them.
func (e *engine) wantsResBox() bool { return !e.o.VM && e.o.Boxes >= 2 }

// mintResBox mints the box the resource stresses run on, when there is none. It is the
// resource rows' own: the network rows never probe it, so its stresses can run beside them.
func (e *engine) mintResBox(ctx context.Context) error {
	if e.resBox != nil {
		return nil
	}
	bs, err := e.mint(ctx, []string{e.nextResBoxName()})
	if len(bs) == 1 {
		e.resBox = bs[0]
	}
	return err
}

// dropResBox deletes the resource box. A self-test does it after each matrix that ran the
// resource rows: the holes after it must not see a box they do not measure (a name hole
// would register its name).
func (e *engine) dropResBox(ctx context.Context) {
	if e.resBox == nil {
		return
	}
	name := e.resBox.Name
	e.resBox = nil
	if _, err := deleteTagged(ctx, e.c, func(in incus.Instance) bool { return in.Name == name }); err != nil {
		e.progress("  %v (the teardown tries again)", err)
	}
	e.waitNamesReleased(ctx, map[string]bool{name: true})
	// Its port's binding goes with it, as the box verbs do: a stale one is drift.
	if err := e.host.BindPorts(ctx); err != nil {
		e.progress("  unbinding %s's port: %v", name, err)
	}
}

// mint creates boxes in parallel through boxcore (profile exactly [stack profile],
// user.claudebox=1, and the drill tag), then waits for each to be ready.
func (e *engine) mint(ctx context.Context, names []string) ([]*Box, error) {
	bs := &boxcore.Boxes{Client: e.c, Stack: e.o.Stack, Version: e.o.Version, HostLocked: true}
	boxes := make([]*Box, len(names))
	errs := make([]error, len(names))
	var wg sync.WaitGroup
	var created atomic.Int32
	sem := make(chan struct{}, 4)
	for i, name := range names {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sem <- struct{}{}
			cfg := map[string]string{DrillTag: e.run}
			if !e.o.VM && name == e.networkBoxNames()[0] {
				maps.Copy(cfg, nestingConfig()) // the nested container's box (nested.go)
			}
			_, err := bs.New(ctx, boxcore.NewOptions{Name: name, VM: e.o.VM, Image: e.image, Config: cfg, Here: true})
			<-sem
			if err != nil {
				errs[i] = fmt.Errorf("minting %s: %w", name, err)
				return
			}
			if created.Add(1) == int32(len(boxes)) {
				e.pause("minting") // every box exists: a kill now leaves them all
			}
			b, err := e.waitReady(ctx, name)
			if err != nil {
				errs[i] = err
				return
			}
			boxes[i] = b
		}()
	}
	wg.Wait()
	return compact(boxes), errors.Join(errs...)
}

// compact drops the boxes that never got ready: a run goes on (or tears down) with the
// boxes it has, never with holes in the list.
func compact(bs []*Box) []*Box {
	out := bs[:0:0]
	for _, b := range bs {
		if b != nil {
			out = append(out, b)
		}
	}
	return out
}

// waitReady polls the agent until the box holds a lease, then reads its link-local address
// and host-side veth from Incus.
func (e *engine) waitReady(ctx context.Context, name string) (*Box, error) {
	ctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	b := &Box{Name: name, agent: ContainerAgent}
	if e.o.VM {
		b.agent = VMAgent
		if err := e.startVMAgent(ctx, name); err != nil {
			return nil, err
		}
	}
	var st probes.Status
	for {
		var raw []byte
		var err error
		if e.o.VM {
			var r incus.ExecResult
			r, err = e.c.Exec(ctx, name, incus.ExecRequest{Command: []string{b.agent, "probe", "facts"}})
			raw = r.Stdout
			if err == nil {
				var f probes.Facts
				if json.Unmarshal(raw, &f) == nil && len(f.IPv4) > 0 {
					st = probes.Status{Ready: true, IPv4: f.IPv4[0], Hostname: f.Hostname}
					for _, dr := range f.DefaultRoutes {
						if dr.Family == "ipv4" {
							st.Gateway = dr.Gateway
						}
					}
				}
			}
		} else {
			raw, err = e.c.PullFile(ctx, name, probes.DefaultStatusFile)
			if err == nil {
				_ = json.Unmarshal(raw, &st)
			}
		}
		if st.Ready {
			break
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("%s never got ready (phase %q, error %q): %w", name, st.Phase, st.Error, ctx.Err())
		case <-time.After(40 * time.Millisecond):
		}
	}
	p, err := netip.ParsePrefix(st.IPv4)
	if err != nil {
		return nil, fmt.Errorf("%s: bad lease %q", name, st.IPv4)
	}
	b.IPv4, b.Prefix, b.Hostname = p.Addr(), p.Bits(), st.Hostname
	b.Gateway, _ = netip.ParseAddr(st.Gateway)
	if err := e.readNIC(ctx, b); err != nil {
		return nil, err
	}
	return b, nil
}

// readNIC fills the box's IPv6 link-local address and host-side veth from Incus's state.
// The link-local address may still be tentative right after boot (duplicate address
// detection takes about a second): awaitDAD waits for it before the rows that use it, so
// minting does not.
func (e *engine) readNIC(ctx context.Context, b *Box) error {
	deadline := time.Now().Add(3 * time.Second)
	for {
		st, err := e.c.InstanceState(ctx, b.Name)
		if err != nil {
			return err
		}
		if n, ok := st.Network["eth0"]; ok {
			b.Veth, b.MAC = n.HostName, n.Hwaddr
			for _, a := range n.Addresses {
				if a.Family == "inet6" && a.Scope == "link" {
					if ip, err := netip.ParseAddr(a.Address); err == nil {
						b.LL = ip.WithZone("eth0")
					}
				}
			}
		}
		if (b.LL.IsValid() && b.Veth != "") || time.Now().After(deadline) {
			b.pid = st.Pid
			return nil
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// tentative reads, from the host, whether the box's link-local address is still in
// duplicate address detection (IFA_F_TENTATIVE in /proc/<pid>/net/if_inet6): probing
// link-local before DAD ends can only check-fail.
func tentative(pid int64, ll netip.Addr) bool {
	if pid <= 0 {
		return false
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/net/if_inet6", pid))
	if err != nil {
		return false
	}
	want := hex.EncodeToString(ll.WithZone("").AsSlice())
	for _, l := range strings.Split(string(b), "\n") {
		f := strings.Fields(l)
		if len(f) >= 6 && f[0] == want {
			flags, _ := strconv.ParseUint(f[4], 16, 32)
			return flags&0x40 != 0
		}
	}
	return true
}

// awaitDAD waits (up to 3 s in all) until no network box's link-local address is still
// tentative: probing link-local before duplicate address detection ends can only
// check-fail. By the time the rows that use it run (after the re-apply window) it has
// usually ended.
func (e *engine) awaitDAD(ctx context.Context) {
	deadline := time.Now().Add(3 * time.Second)
	for _, b := range e.boxes {
		for b.LL.IsValid() && tentative(b.pid, b.LL) && time.Now().Before(deadline) {
			select {
			case <-ctx.Done():
				return
			case <-time.After(50 * time.Millisecond):
			}
		}
	}
}

// VMAgentCommands are what VM mode runs in the guest (through the Incus agent) after the
// binary is pushed to VMAgent: the listeners, detached, so they outlive the exec.
func VMAgentCommands() [][]string {
	return [][]string{
		{"/bin/sh", "-c", "mkdir -p " + probes.StateDir + " && nohup " + VMAgent + " probe serve >" + probes.StateDir + "/serve.log 2>&1 &"},
	}
}

// startVMAgent waits for the guest's Incus agent, pushes the running binary and starts the
// listeners. It needs a VM image with the Incus agent (cloud images have it).
func (e *engine) startVMAgent(ctx context.Context, name string) error {
	bs := &boxcore.Boxes{Client: e.c, Stack: e.o.Stack}
	if r, err := bs.ExecWhenReady(ctx, name, []string{"true"}); err != nil || r.ExitCode != 0 {
		return fmt.Errorf("%s: the Incus agent never answered: %v", name, err)
	}
	if err := e.c.PushFile(ctx, name, VMAgent, bytes.NewReader(e.binary), 0o755, 0, 0); err != nil {
		return fmt.Errorf("%s: pushing the probe agent: %w", name, err)
	}
	for _, cmd := range VMAgentCommands() {
		r, err := e.c.Exec(ctx, name, incus.ExecRequest{Command: cmd})
		if err != nil || r.ExitCode != 0 {
			return fmt.Errorf("%s: starting the probe agent: %v %s", name, err, strings.TrimSpace(string(r.Stderr)))
		}
	}
	return nil
}

// probeRunExited starts the error of a probe run that ended with a non-zero exit code.
const probeRunExited = "probe run exited"

// runnerKilled: the row could not run because its box's probe runner was SIGKILLed (exit
// 128+9), which the memory stress's OOM kills can do (see resourceStep).
func runnerKilled(r *Row) bool {
	return r.Result.Outcome == probes.CheckFailed && strings.Contains(r.Result.Evidence, fmt.Sprintf("%s %d:", probeRunExited, 128+9))
}

// runInBox ships a batch of specs to a box's agent and returns the results in order.
func (e *engine) runInBox(ctx context.Context, b *Box, specs []probes.Spec, runArgs ...string) ([]probes.Result, error) {
	in, err := json.Marshal(specs)
	if err != nil {
		return nil, err
	}
	cmd := append([]string{b.agent, "probe", "run"}, runArgs...)
	r, err := e.c.Exec(ctx, b.Name, incus.ExecRequest{Command: cmd, Stdin: bytes.NewReader(in)})
	if err != nil {
		return nil, fmt.Errorf("%s: probe run: %w", b.Name, err)
	}
	if r.ExitCode != 0 {
		return nil, fmt.Errorf("%s: %s %d: %s", b.Name, probeRunExited, r.ExitCode, strings.TrimSpace(string(r.Stderr)))
	}
	var out []probes.Result
	if err := json.Unmarshal(r.Stdout, &out); err != nil {
		return nil, fmt.Errorf("%s: probe run output: %w", b.Name, err)
	}
	if len(out) != len(specs) {
		return nil, fmt.Errorf("%s: probe run returned %d results for %d probes", b.Name, len(out), len(specs))
	}
	return out, nil
}

// hits reads who reached a box's listeners.
func (e *engine) hits(ctx context.Context, b *Box) []probes.Hit {
	if b.agent == ContainerAgent {
		raw, err := e.c.PullFile(ctx, b.Name, probes.DefaultHitsFile)
		if err != nil {
			return nil
		}
		var out []probes.Hit
		for _, l := range bytes.Split(raw, []byte("\n")) {
			var h probes.Hit
			if json.Unmarshal(l, &h) == nil {
				out = append(out, h)
			}
		}
		return out
	}
	r, err := e.c.Exec(ctx, b.Name, incus.ExecRequest{Command: []string{b.agent, "probe", "hits"}})
	if err != nil {
		return nil
	}
	var out []probes.Hit
	_ = json.Unmarshal(r.Stdout, &out)
	return out
}

// restartBoxes restarts boxes (a seeded hole that only new leases see) and waits for them.
func (e *engine) restartBoxes(ctx context.Context) error {
	var wg sync.WaitGroup
	errs := make([]error, len(e.boxes))
	for i, b := range e.boxes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := e.c.SetState(ctx, b.Name, "restart", true, 0); err != nil {
				errs[i] = fmt.Errorf("restarting %s: %w", b.Name, err)
				return
			}
			nb, err := e.waitReady(ctx, b.Name)
			if err != nil {
				errs[i] = err
				return
			}
			e.boxes[i] = nb
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return err
	}
	// A restart gives every box a new port: bind them, as the box verbs do.
	return e.host.BindPorts(ctx)
}

// remint replaces the boxes with fresh ones under new names. Deleting a box makes Incus
// release its lease, and with it any name dnsmasq learnt for it during a seeded hole:
// restarting is not enough (measured: a renewed lease keeps its name).
func (e *engine) remint(ctx context.Context) error {
	_ = e.awaitExposure() // never delete a box under its exposure's write
	old := map[string]bool{}
	for _, b := range e.boxes {
		old[b.Name] = true
	}
	if _, err := deleteTagged(ctx, e.c, func(in incus.Instance) bool { return old[in.Name] }); err != nil {
		return err // a box left would answer to its old name
	}
	e.waitNamesReleased(ctx, old)
	e.gen++
	bs, err := e.mintBoxes(ctx)
	e.boxes = bs
	if err != nil {
		return err
	}
	// Awaited here: the seeded hole that follows may write the same box (ETag conflict).
	if err := e.exposeFirstBox(ctx); err != nil {
		return err
	}
	return e.awaitExposure()
}

// waitNamesReleased waits (up to namesReleaseWait) until dnsmasq's lease file holds none of
// the deleted boxes' names: Incus releases a deleted box's lease on its own time, and a host
// check right after the re-mint saw an old box's name still there (once in a full run).
//
// Incus sends its release once, from the host to dnsmasq; one sent while dnsmasq restarts
// after a hole's restore is lost, and the name stays for good (measured: a full self-test
// failed its restore check on it). Halfway through the wait the drill sends the same release
// itself, for each lease still named after a deleted box.
func (e *engine) waitNamesReleased(ctx context.Context, old map[string]bool) {
	start := time.Now()
	released := false
	for ctx.Err() == nil && time.Since(start) < namesReleaseWait {
		d, ok := boxcore.LocalKernel().FindDNSMasq(e.o.Stack.Network)
		if !ok {
			return
		}
		leases, err := boxcore.NamedLeases(d.LeaseFile())
		if err != nil {
			return
		}
		var held []boxcore.Lease
		for _, l := range leases {
			if old[l.Name] {
				held = append(held, l)
			}
		}
		if len(held) == 0 {
			return
		}
		if !released && time.Since(start) > namesReleaseWait/2 {
			released = true
			for _, l := range held {
				if err := releaseLease(e.gateway.Addr(), l); err != nil {
					e.progress("  releasing %s's lease (%s %s) ourselves: %v", l.Name, l.MAC, l.IP, err)
				} else {
					e.progress("  Incus's release of %s's lease (%s %s) did not land: released it ourselves", l.Name, l.MAC, l.IP)
				}
			}
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// releaseLease sends dnsmasq the DHCPRELEASE Incus sends for a deleted instance's lease:
// from the host, to the gateway's port 67, for the lease's MAC and address.
func releaseLease(gateway netip.Addr, l boxcore.Lease) error {
	mac, err := net.ParseMAC(l.MAC)
	if err != nil {
		return err
	}
	m, err := dhcpv4.New(dhcpv4.WithMessageType(dhcpv4.MessageTypeRelease), dhcpv4.WithHwAddr(mac),
		dhcpv4.WithClientIP(net.IP(l.IP.AsSlice())), dhcpv4.WithOption(dhcpv4.OptServerIdentifier(net.IP(gateway.AsSlice()))))
	if err != nil {
		return err
	}
	c, err := net.DialUDP("udp4", nil, net.UDPAddrFromAddrPort(netip.AddrPortFrom(gateway, 67)))
	if err != nil {
		return err
	}
	defer c.Close()
	_, err = c.Write(m.ToBytes())
	return err
}

// namesReleaseWait bounds waitNamesReleased.
const namesReleaseWait = 15 * time.Second

// deleteTagged removes drill boxes (found by tag, so a half-minted one goes too) in
// parallel and returns the names removed, and what kept any other from going: a cleanup
// never says done while a box is left. The host's port bindings are the caller's to
// converge, once (Discard).
func deleteTagged(ctx context.Context, c *incus.Client, match func(incus.Instance) bool) ([]string, error) {
	insts, err := c.Instances(ctx, map[string]string{boxcore.TagKey: "1"}, false)
	if err != nil {
		return nil, fmt.Errorf("listing the drill's boxes: %w", err)
	}
	bs := &boxcore.Boxes{Client: c}
	var wg sync.WaitGroup
	var mu sync.Mutex
	var gone []string
	var errs []error
	for _, in := range insts {
		if _, ok := in.Config[DrillTag]; !ok || !match(in) {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			err := bs.Discard(ctx, &boxcore.Box{Name: in.Name, Instance: in})
			mu.Lock()
			defer mu.Unlock()
			if err == nil || errors.Is(err, incus.ErrNotFound) {
				gone = append(gone, in.Name)
			} else {
				errs = append(errs, fmt.Errorf("removing %s: %w", in.Name, err))
			}
		}()
	}
	wg.Wait()
	sort.Strings(gone)
	return gone, errors.Join(errs...)
}
