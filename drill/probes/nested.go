package probes

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"time"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"github.com/vishvananda/netlink"
	"golang.org/x/net/ipv4"
	"golang.org/x/sys/unix"
)

// A nested container, built the way Docker's default bridge network builds one: the probes
// run in new network, mount, PID, UTS and IPC namespaces, behind a veth pair whose box end
// is their gateway, and the box forwards and masquerades them out of eth0. What the drill
// proves from there is what a container Docker runs in a box can reach.

// Nested network interfaces: the box's end and the nested container's (eth0 once inside).
const (
	NestedBoxVeth  = "cbnest0"
	nestedPeerVeth = "cbnest1"
	nestedTable    = "claudebox_nested"
	nestedGoFD     = 3 // the child's end of the "network is ready" pipe
)

// RunNested runs specs in a nested container on prefix (a /30: .1 the box's end, .2 the
// container), via the binary at self ("/proc/self/exe"): its `probe nested-child`.
func RunNested(ctx context.Context, self string, prefix netip.Prefix, specs []Spec) ([]Result, error) {
	if !prefix.Addr().Is4() || prefix.Bits() > 30 {
		return nil, fmt.Errorf("nested: %s is no IPv4 prefix of at least 4 addresses", prefix)
	}
	prefix = prefix.Masked()
	gw, child := prefix.Addr().Next(), prefix.Addr().Next().Next()
	undo, err := nestedBoxSide(prefix, gw)
	if err != nil {
		return nil, err
	}
	defer undo()
	in, err := json.Marshal(specs)
	if err != nil {
		return nil, err
	}
	ready, goAhead, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	defer ready.Close()
	defer goAhead.Close()
	var out, errb bytes.Buffer
	cmd := exec.CommandContext(ctx, self, "probe", "nested-child", netip.PrefixFrom(child, prefix.Bits()).String(), gw.String())
	cmd.Stdin, cmd.Stdout, cmd.Stderr = bytes.NewReader(in), &out, &errb
	cmd.ExtraFiles = []*os.File{ready}
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Cloneflags: unix.CLONE_NEWNET | unix.CLONE_NEWNS | unix.CLONE_NEWPID | unix.CLONE_NEWUTS | unix.CLONE_NEWIPC,
		Pdeathsig:  unix.SIGKILL,
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("nested: starting the container: %w", err)
	}
	ready.Close()
	peer, err := netlink.LinkByName(nestedPeerVeth)
	if err == nil {
		err = netlink.LinkSetNsPid(peer, cmd.Process.Pid)
	}
	if err != nil {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		return nil, fmt.Errorf("nested: moving %s into the container: %w", nestedPeerVeth, err)
	}
	_, _ = goAhead.Write([]byte{1})
	goAhead.Close()
	if err := cmd.Wait(); err != nil {
		return nil, fmt.Errorf("nested: the container's probe run: %w: %s", err, strings.TrimSpace(errb.String()))
	}
	var res []Result
	if err := json.Unmarshal(out.Bytes(), &res); err != nil || len(res) != len(specs) {
		return nil, fmt.Errorf("nested: the container's results (%d for %d probes): %v", len(res), len(specs), err)
	}
	boxSideARPFailures(res, func(dst netip.Addr) (bool, string) { return neighbourFailed(dst, "") })
	return res, nil
}

// boxSideARPFailures turns a nested container's "refused" into "dropped" where the host
// unreachable came from its box, the container's router, because the box's own who-has
// for the next hop got no answer: silence on the box's wire, as classify judges the
// kernel's own ARP failure for a probe run in the box itself. The container cannot see
// its router's neighbour table, so the box looks after the run. Measured: a drill of 8
// boxes on a busy host, the nested container's probes to three other boxes waited past the
// box's 3 s ARP failure and saw "ICMP destination unreachable code 1 from" the box: six
// rows called a HOLE that was isolation holding. An answer from anywhere else (a port
// unreachable, a reject, a next hop that did answer ARP) stays refused.
func boxSideARPFailures(res []Result, failed func(dst netip.Addr) (bool, string)) {
	for i := range res {
		r := &res[i]
		if r.Outcome != Refused || !hostUnreachable(r.Evidence) {
			continue
		}
		dst, err := netip.ParseAddr(r.Probe.Target)
		if err != nil {
			continue
		}
		if ok, hop := failed(dst); ok {
			r.Outcome = Dropped
			r.Evidence = fmt.Sprintf("no ARP reply from next hop %s to the nested container's box (its router): %s", hop, r.Evidence)
		}
	}
}

// hostUnreachable says whether a refusal's evidence is a host unreachable: EHOSTUNREACH on
// a socket, or an ICMPv4 destination unreachable of code 1 (the nested network is IPv4).
func hostUnreachable(evidence string) bool {
	return strings.Contains(evidence, syscall.EHOSTUNREACH.Error()) ||
		strings.HasPrefix(evidence, fmt.Sprintf("ICMP %v code 1 ", ipv4.ICMPTypeDestinationUnreachable))
}

// nestedBoxSide is the box's half: the veth pair (its end holds gw), forwarding, and the
// masquerade of the container's prefix out of eth0. undo removes all three; a pair left by
// a killed run is replaced.
func nestedBoxSide(prefix netip.Prefix, gw netip.Addr) (undo func(), err error) {
	if old, err := netlink.LinkByName(NestedBoxVeth); err == nil {
		_ = netlink.LinkDel(old)
	}
	veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: NestedBoxVeth}, PeerName: nestedPeerVeth}
	if err := netlink.LinkAdd(veth); err != nil {
		return nil, fmt.Errorf("nested: veth pair: %w", err)
	}
	undo = func() {
		if l, err := netlink.LinkByName(NestedBoxVeth); err == nil {
			_ = netlink.LinkDel(l)
		}
		if c, err := nftables.New(); err == nil {
			c.DelTable(&nftables.Table{Family: nftables.TableFamilyIPv4, Name: nestedTable})
			_ = c.Flush()
		}
	}
	defer func() {
		if err != nil {
			undo()
		}
	}()
	box, err := netlink.LinkByName(NestedBoxVeth)
	if err == nil {
		err = netlink.AddrAdd(box, &netlink.Addr{IPNet: &net.IPNet{IP: gw.AsSlice(), Mask: net.CIDRMask(prefix.Bits(), 32)}})
	}
	if err == nil {
		err = netlink.LinkSetUp(box)
	}
	if err != nil {
		return nil, fmt.Errorf("nested: the box's end: %w", err)
	}
	if err := os.WriteFile("/proc/sys/net/ipv4/ip_forward", []byte("1\n"), 0o644); err != nil {
		return nil, fmt.Errorf("nested: forwarding: %w", err)
	}
	if err := masquerade(prefix, DefaultIface); err != nil {
		return nil, fmt.Errorf("nested: masquerade: %w", err)
	}
	return undo, nil
}

// masquerade adds `ip saddr PREFIX oifname IFACE masquerade` in a table of its own, as
// Docker's `-s 172.17.0.0/16 ! -o docker0 -j MASQUERADE` does for its bridge.
func masquerade(prefix netip.Prefix, iface string) error {
	c, err := nftables.New()
	if err != nil {
		return err
	}
	t := &nftables.Table{Family: nftables.TableFamilyIPv4, Name: nestedTable}
	c.DelTable(t)
	_ = c.Flush() // none yet is fine
	t = c.AddTable(t)
	ch := c.AddChain(&nftables.Chain{Name: "postrouting", Table: t, Type: nftables.ChainTypeNAT,
		Hooknum: nftables.ChainHookPostrouting, Priority: nftables.ChainPriorityNATSource})
	mask := net.CIDRMask(prefix.Bits(), 32)
	name := make([]byte, unix.IFNAMSIZ)
	copy(name, iface)
	c.AddRule(&nftables.Rule{Table: t, Chain: ch, Exprs: []expr.Any{
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: 12, Len: 4},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4, Mask: mask, Xor: make([]byte, 4)},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: prefix.Addr().AsSlice()},
		&expr.Meta{Key: expr.MetaKeyOIFNAME, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: name},
		&expr.Masq{},
	}})
	return c.Flush()
}

// nestedChild is `probe nested-child ADDR/BITS GATEWAY`, inside the new namespaces: it waits
// until the box moved the peer in, brings it up as eth0 with a default route via the box,
// then runs the specs on stdin like `probe run`.
func nestedChild(args []string, stdout, stderr io.Writer) int {
	if len(args) != 2 {
		fmt.Fprintln(stderr, "probe nested-child: want ADDR/BITS and the gateway")
		return ExitUsage
	}
	addr, err1 := netip.ParsePrefix(args[0])
	gw, err2 := netip.ParseAddr(args[1])
	if err := errors.Join(err1, err2); err != nil {
		fmt.Fprintf(stderr, "probe nested-child: %v\n", err)
		return ExitUsage
	}
	goAhead := os.NewFile(nestedGoFD, "go-ahead")
	b := make([]byte, 1)
	if n, err := goAhead.Read(b); n != 1 {
		fmt.Fprintf(stderr, "probe nested-child: the box never moved the interface in: %v\n", err)
		return ExitError
	}
	goAhead.Close()
	if err := nestedUp(addr, gw); err != nil {
		fmt.Fprintf(stderr, "probe nested-child: %v\n", err)
		return ExitError
	}
	specs, code := readSpecs("probe nested-child", nil, stderr)
	if specs == nil {
		return code
	}
	return printJSON(stdout, stderr, RunMany(context.Background(), specs))
}

// nestedUp configures the container's side: lo, eth0 (the moved peer), the default route.
func nestedUp(addr netip.Prefix, gw netip.Addr) error {
	lo, err := netlink.LinkByName("lo")
	if err == nil {
		err = netlink.LinkSetUp(lo)
	}
	if err != nil {
		return fmt.Errorf("lo: %w", err)
	}
	var peer netlink.Link
	for deadline := time.Now().Add(2 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if peer, err = netlink.LinkByName(nestedPeerVeth); err == nil || time.Now().After(deadline) {
			break
		}
	}
	if err != nil {
		return fmt.Errorf("%s: %w", nestedPeerVeth, err)
	}
	if err := netlink.LinkSetName(peer, DefaultIface); err != nil {
		return fmt.Errorf("renaming %s: %w", nestedPeerVeth, err)
	}
	ip := &net.IPNet{IP: addr.Addr().AsSlice(), Mask: net.CIDRMask(addr.Bits(), 32)}
	if err := netlink.AddrAdd(peer, &netlink.Addr{IPNet: ip}); err != nil {
		return fmt.Errorf("address: %w", err)
	}
	if err := netlink.LinkSetUp(peer); err != nil {
		return fmt.Errorf("up: %w", err)
	}
	if err := netlink.RouteAdd(&netlink.Route{LinkIndex: peer.Attrs().Index, Gw: gw.AsSlice()}); err != nil {
		return fmt.Errorf("default route: %w", err)
	}
	return awaitGateway(gw)
}

// awaitGateway waits until the box's end answers a ping: probes sent before the veth's
// carrier is up lose their ARP request, and the next one comes a second later, past a probe's
// timeout (measured: 5 runs of 30 had every probe fail for want of an ARP reply).
func awaitGateway(gw netip.Addr) error {
	ping := Spec{Kind: KindICMP, Target: gw.String(), Timeout: 200 * time.Millisecond}
	var last Result
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); {
		if last = RunMany(context.Background(), []Spec{ping})[0]; last.Outcome == Open {
			return nil
		}
	}
	return fmt.Errorf("the box's end %s never answered: %s", gw, last.Evidence)
}
