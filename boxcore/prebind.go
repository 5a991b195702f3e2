package boxcore

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/claudebox/claudebox/boxcore/incus"
	"github.com/claudebox/claudebox/firewall"
	"github.com/claudebox/claudebox/internal/procstat"
)

// Binding a new box's port while Incus creates and starts it (see address.go for the plan).
//
// `new` records its planned NIC as pending (a file under /run naming the minting process)
// and runs an ordinary round: every round binds the pending NICs beside the running ones,
// so the new port's rules are in nftables before its veth exists, and no other verb's round
// in the meantime drops them. completeBind, after the start, finishes what needs the veth
// (its FDB pin, its rp_filter) — if nothing else applied since (the round's token still in
// the stamp: no other round, no drill hole, no teardown) and the box came up as planned (its
// port on the bridge, Incus's reservation for its MAC and address, no other NIC's). Anything
// else, and it runs a full round instead, as a start without a plan does. The pending record
// goes when the mint ends; one whose process died is dropped by the next round.

// preBound is what preBind did: the round's token, or why it did not.
type preBound struct {
	nic   NICBinding
	token string
	err   error
}

// preBind records plan's NIC as pending and starts the round binding it beside the running
// ones; the channel gives its outcome once. A nil plan gives a nil channel.
func (bs *Boxes) preBind(ctx context.Context, box string, plan *firewall.PortBinding) <-chan *preBound {
	if plan == nil {
		return nil
	}
	out := make(chan *preBound, 1)
	go func() {
		t := time.Now()
		defer incus.TraceStep("bind", "bind before the start", t)
		pb := &preBound{nic: pendingNIC(box, *plan)}
		var ok bool
		defer func() { out <- pb }()
		if pb.err = writePending(bs.Stack.Network, box, *plan); pb.err != nil {
			return
		}
		if !bs.HostLocked {
			unlock, err := bs.lockNetwork(ctx)
			if err != nil {
				pb.err = err
				return
			}
			defer unlock()
		}
		h := NewHost(bs.Client, bs.Stack)
		if pb.token, ok, pb.err = h.quickRound(ctx); ok || pb.err != nil {
			return
		}
		var st *StackState
		st, pb.token, pb.err = h.round(ctx, time.Time{})
		if st != nil && !slices.ContainsFunc(st.Bindings(), func(b firewall.PortBinding) bool { return b.String() == plan.String() }) {
			pb.token = "" // the round bound the port to another NIC (a running box of its name): after the start, a full round
		}
	}()
	return out
}

// completeBind binds box's port once its start is over: the pins of the round preBind ran
// (pre's outcome), or a full round when that round is no longer what the kernel holds. The
// box's pending record goes either way.
func (bs *Boxes) completeBind(ctx context.Context, box string, pre <-chan *preBound) error {
	if pre == nil {
		return bs.bindPorts(ctx, box)
	}
	pb := <-pre
	defer removePending(bs.Stack.Network, box)
	if pb.err == nil {
		if done, err := bs.pinPreBound(ctx, pb); done || err != nil {
			return err
		}
	}
	return bs.bindPorts(ctx, box)
}

// pinPreBound is Host.completeBind under the network's lock (see bindPorts).
func (bs *Boxes) pinPreBound(ctx context.Context, pb *preBound) (bool, error) {
	if !bs.HostLocked {
		unlock, err := bs.lockNetwork(ctx)
		if err != nil {
			return false, err
		}
		defer unlock()
	}
	return NewHost(bs.Client, bs.Stack).completeBind(ctx, pb)
}

// completeBind pins pb's port and sets its rp_filter, if that round's token is still the
// stamp's and the box came up as planned. done is false when it did nothing: the caller
// runs a full round.
func (h *Host) completeBind(ctx context.Context, pb *preBound) (done bool, err error) {
	t := time.Now()
	defer incus.TraceStep("bind", "pins after the start", t)
	unlock, err := lockFile(ctx, bindLockPath(h.Stack.Network), HostLockWait)
	if err != nil {
		return false, err
	}
	defer unlock()
	if _, token := lastFullBind(boundStampPath(h.Stack.Network)); token != pb.token || !h.startedAsPlanned(pb.nic.Binding) {
		return false, nil
	}
	// The round did every other port; this one's veth exists only now.
	own := []firewall.PortBinding{pb.nic.Binding}
	if _, err := firewall.StrictRPFilter(firewall.Spec{Ports: own}); err != nil {
		return false, nil
	}
	if _, err := h.Kernel.PinFDB(h.Stack.Network, own); err != nil {
		return false, nil // a full round says which port, and whose
	}
	h.recordPlugged(pb.token, pb.nic.Binding.Port)
	return true, nil
}

// startedAsPlanned: b's port is on the stack's bridge and Incus reserved b's address for b's
// MAC, and for no other NIC.
func (h *Host) startedAsPlanned(b firewall.PortBinding) bool {
	if _, err := os.Stat(filepath.Join(h.Kernel.Sys, "class/net", h.Stack.Network, "brif", b.Port)); err != nil {
		return false
	}
	return addressHeldBy(h.Stack.Network, b) == ""
}

// addressHeldBy names the first reservation other than b's own that holds b's address or
// MAC ("" when none does: b's address is b's alone). Incus checks a static address only
// against other static ones, so an address it allocated to another NIC at the same moment
// (an import's start, an older box's first) meets a planned one only here.
func addressHeldBy(network string, b firewall.PortBinding) string {
	hosts := readDNSMasqHosts(network)
	for _, k := range slices.Sorted(maps.Keys(hosts)) {
		e := hosts[k]
		sameIP, sameMAC := e.ip == b.IPv4, macEqual(e.mac, b.MAC)
		if sameIP != sameMAC {
			return strings.TrimSuffix(k, ".eth0")
		}
	}
	return ""
}

// pendingNIC is the NICBinding a pending plan stands for.
func pendingNIC(box string, b firewall.PortBinding) NICBinding {
	return NICBinding{Box: box, Device: "eth0", Binding: b, IPFrom: "planned by new", RPFilter: -1, RPFilterOwn: -1}
}

// pendingDir holds one file per box `new` is starting on network: "PORT MAC IPV4 PID START",
// the minting process and its start time (procstat: a reused pid is not it).
func pendingDir(network string) string {
	return perDaemon("/run/claudebox-pending-" + network)
}

func writePending(network, box string, b firewall.PortBinding) error {
	dir := pendingDir(network)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("recording the planned NIC: %w", err)
	}
	pid := os.Getpid()
	start, err := procstat.StartTime(pid)
	if err != nil {
		return fmt.Errorf("recording the planned NIC: %w", err)
	}
	line := fmt.Sprintf("%s %s %s %d %d\n", b.Port, b.MAC, b.IPv4, pid, start)
	if err := os.WriteFile(filepath.Join(dir, box), []byte(line), 0o600); err != nil {
		return fmt.Errorf("recording the planned NIC: %w", err)
	}
	return nil
}

func removePending(network, box string) {
	_ = os.Remove(filepath.Join(pendingDir(network), box))
}

// readPendings are the pending NICs of live mints; a record whose process is gone (a killed
// `new`) is removed.
func readPendings(network string) []NICBinding {
	dir := pendingDir(network)
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil
	}
	var out []NICBinding
	for _, e := range ents {
		path := filepath.Join(dir, e.Name())
		b, err := os.ReadFile(path)
		f := strings.Fields(string(b))
		if err != nil || len(f) != 5 {
			_ = os.Remove(path)
			continue
		}
		pid, _ := strconv.Atoi(f[3])
		start, _ := strconv.ParseUint(f[4], 10, 64)
		if !procstat.Alive(pid, start) {
			_ = os.Remove(path) // its `new` died: the round after it drops the rules
			continue
		}
		mac, merr := net.ParseMAC(f[1])
		ip, ierr := netip.ParseAddr(f[2])
		if merr != nil || ierr != nil {
			_ = os.Remove(path)
			continue
		}
		out = append(out, pendingNIC(e.Name(), firewall.PortBinding{Port: f[0], MAC: mac, IPv4: ip}))
	}
	return out
}

// mergePending adds the pending NICs to what readBindings read: each replaces what was read
// of its box mid-start (a port not on the bridge yet), never a running NIC of another MAC on
// its port (another instance of the name: that `new` is about to be refused, and the running
// box's binding stands).
func (st *StackState) mergePending(pending []NICBinding, onBridge map[string]bool) {
	for _, p := range pending {
		if slices.ContainsFunc(st.NICs, func(n NICBinding) bool {
			return n.Binding.Port == p.Binding.Port && !macEqual(n.Binding.MAC, p.Binding.MAC)
		}) {
			continue
		}
		st.NICs = slices.DeleteFunc(st.NICs, func(n NICBinding) bool { return n.Binding.Port == p.Binding.Port })
		st.NICs = append(st.NICs, p)
		if !onBridge[p.Binding.Port] {
			if st.Unplugged == nil {
				st.Unplugged = map[string]bool{}
			}
			st.Unplugged[p.Binding.Port] = true
		}
	}
}

// errAddressTaken: the planned address or MAC is another NIC's too.
var errAddressTaken = errors.New("taken by another NIC as the box was made")
