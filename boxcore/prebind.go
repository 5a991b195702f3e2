package boxcore

import (
	"context"
	"os"
	"path/filepath"
	"time"

	"github.com/claudebox/claudebox/boxcore/incus"
	"github.com/claudebox/claudebox/firewall"
)

// Binding a new box's port while Incus creates and starts it (see address.go for the plan).
//
// preBind runs one ordinary round with the planned NIC added as if the box ran: every running
// port is bound as always, and the new port's rules are in nftables before its veth exists.
// completeBind, after the start, finishes what needs the veth (its FDB pin, its rp_filter) —
// if nothing else applied since (the round's token still in the stamp: no other round, no
// drill hole, no teardown) and the box came up as planned (its port on the bridge, Incus's
// reservation for its MAC and address). Anything else, and it runs a full round instead,
// exactly as a start without a plan does. The new port is never less bound than before: its
// rules are there from the first frame, where a round after the start left the first frames
// to Incus's NIC filtering alone.

// preBound is what preBind did: the round's token, or why it did not.
type preBound struct {
	nic   NICBinding
	token string
	err   error
}

// preBind starts the round binding plan's port beside the running ones; the channel gives
// its outcome once. A nil plan gives a nil channel (nothing to bind early).
func (bs *Boxes) preBind(ctx context.Context, box string, plan *plannedNIC) <-chan *preBound {
	if plan == nil {
		return nil
	}
	out := make(chan *preBound, 1)
	go func() {
		t := time.Now()
		defer incus.TraceStep("bind", "bind before the start", t)
		pb := &preBound{nic: NICBinding{Box: box, Device: "eth0", Binding: plan.Binding, IPFrom: "planned by new", Tagged: true, RPFilter: -1, RPFilterOwn: -1}}
		if !bs.HostLocked {
			unlock, err := bs.lockNetwork(ctx)
			if err != nil {
				pb.err = err
				out <- pb
				return
			}
			defer unlock()
		}
		h := NewHost(bs.Client, bs.Stack)
		h.pending = &pb.nic
		_, pb.token, pb.err = h.round(ctx, time.Time{})
		out <- pb
	}()
	return out
}

// completeBind binds box's port once its start is over: the pins of the round preBind ran
// (pre's outcome), or a full round when that round is no longer what the kernel holds.
func (bs *Boxes) completeBind(ctx context.Context, box string, pre <-chan *preBound) error {
	if pre == nil {
		return bs.bindPorts(ctx, box)
	}
	if pb := <-pre; pb.err == nil {
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

// completeBind pins pb's port and sets its rp_filter, if that round's token is still
// the stamp's and the box came up as planned. done is false when it did nothing: the caller
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
	return true, nil
}

// startedAsPlanned: b's port is on the stack's bridge and Incus reserved b's address for b's
// MAC, and for no other.
func (h *Host) startedAsPlanned(b firewall.PortBinding) bool {
	if _, err := os.Stat(filepath.Join(h.Kernel.Sys, "class/net", h.Stack.Network, "brif", b.Port)); err != nil {
		return false
	}
	found := false
	for _, e := range readDNSMasqHosts(h.Stack.Network) {
		if e.ip == b.IPv4 {
			if !macEqual(e.mac, b.MAC) {
				return false
			}
			found = true
		}
	}
	return found
}
