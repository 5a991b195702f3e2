package boxcore

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/claudebox/claudebox/boxcore/incus"
)

// On an Incus cluster the stack's Incus objects are the cluster's: the ACL and the profile are
// cluster-wide as they are, while a network or a storage pool is first defined on every member
// (pending, with what is the member's own: a pool's loop file size) and then created once with
// the cluster-wide config. The kernel-local parts (nftables tables, sysctls, port bindings,
// the boot unit) are each member's: `claudebox host init` run on a member converges that
// member's kernel, and `host check` there reads that member's.

// clusterMembers returns the cluster's members, or nil when the daemon is standalone.
func (h *Host) clusterMembers(ctx context.Context) ([]string, error) {
	srv, err := h.Client.Server(ctx)
	if err != nil || !srv.Clustered {
		return nil, err
	}
	return memberNames(ctx, h.Client)
}

// memberNames are the cluster's member names, sorted.
func memberNames(ctx context.Context, c *incus.Client) ([]string, error) {
	ms, err := c.ClusterMembers(ctx)
	names := make([]string, 0, len(ms))
	for _, m := range ms {
		names = append(names, m.Name)
	}
	return names, err
}

// createClustered creates one cluster-wide object: pending on each member, then the object
// itself. When the last step fails the pending definitions are removed again (remove), so a
// retry starts from nothing.
func createClustered(members []string, pending func(member string) error, create func() error, remove func() error) error {
	for _, m := range members {
		if err := pending(m); err != nil {
			return errors.Join(fmt.Errorf("defining it on member %s: %w", m, err), removeQuiet(remove))
		}
	}
	if err := create(); err != nil {
		if len(members) > 0 {
			return errors.Join(err, removeQuiet(remove))
		}
		return err
	}
	return nil
}

// removeQuiet runs remove, taking "not found" as done.
func removeQuiet(remove func() error) error {
	if err := remove(); err != nil && !errors.Is(err, incus.ErrNotFound) {
		return fmt.Errorf("and removing the half-defined object again: %w", err)
	}
	return nil
}

// checkCluster says, on a cluster, whose kernel the readings above are (this member's), and
// reads what Incus shows of every other member: the network's keys of that member's own
// (bridge.external_interfaces joins its bridge to another segment), and that member's bridge
// as its kernel has it — up, the gateway's address and nothing else (an IPv6 address means
// IPv6 is on there), and no port but that member's instances'. What only a member's own kernel
// shows (nftables, sysctls, bindings, FDB pins, the boot unit) is not readable from here: the
// check says so, member by member.
func (h *Host) checkCluster(ctx context.Context, c *checker, st *StackState) error {
	local := st.Member
	if local == "" {
		return nil // a standalone daemon
	}
	ms, err := h.Client.ClusterMembers(ctx)
	if err != nil {
		return err
	}
	var members []string
	for _, m := range ms {
		members = append(members, m.Name)
	}
	c.note("cluster", "member "+local, "this member: the kernel readings above are its own")
	c.add("cluster", "member "+local+": network "+h.Stack.Network+" keys of its own", "none", keyList(st.MemberKeys))
	// Every member's agent, by the heartbeat it keeps in its member's config: without one,
	// a box started there (by Incus's placement, from any member, at boot) runs unbound.
	for _, m := range ms {
		row := "member " + m.Name + ": claudebox agent (network " + h.Stack.Network + ")"
		if m.Name == local {
			c.add("cluster", row, agentFresh, agentSeen(m.Config[AgentKey(h.Stack.Network)], time.Now()))
		} else {
			c.addOn(m.Name, "cluster", row, agentFresh, agentSeen(m.Config[AgentKey(h.Stack.Network)], time.Now()))
		}
	}
	if st.Network == nil {
		return nil
	}
	insts, err := h.Client.Instances(ctx, nil, false)
	if err != nil {
		return err
	}
	for _, m := range members {
		if m == local {
			continue
		}
		h.checkMember(ctx, c, st, m, insts)
		c.note("cluster", "member "+m+": nftables, sysctls, port bindings, FDB pins, boot unit",
			"kernel state not readable from "+local+": run 'claudebox host check' on "+m)
	}
	return nil
}

// agentFresh is what an agent row expects: a heartbeat younger than AgentFresh.
var agentFresh = "a heartbeat within the last " + AgentFresh.String()

// agentSeen is an agent row's reading of a heartbeat (agentFresh when it is fresh).
func agentSeen(beat string, now time.Time) string {
	t, err := time.Parse(time.RFC3339, beat)
	switch {
	case beat == "":
		return "none (no agent runs there or it stopped)"
	case err != nil:
		return "unreadable heartbeat " + strconv.Quote(beat)
	case now.Sub(t) < AgentFresh:
		return agentFresh
	}
	return "last heartbeat " + beat + ", " + now.Sub(t).Round(time.Second).String() + " ago"
}

// checkMember is checkCluster's reading of one other member through its daemon.
func (h *Host) checkMember(ctx context.Context, c *checker, st *StackState, member string, insts []incus.Instance) {
	n := h.Stack.Network
	// A member that does not answer (offline, upgrading) is a row, not the end of the check.
	on, _, err := h.Client.NetworkOn(ctx, n, member)
	if err != nil {
		c.addOn(member, "cluster", "member "+member+": network "+n, "readable through Incus", "unreadable: "+err.Error())
		return
	}
	c.addOn(member, "cluster", "member "+member+": network "+n+" keys of its own", "none", keyList(memberOwnKeys(on.Config, st.Network.Config)))
	bs, err := h.Client.NetworkStateOn(ctx, n, member)
	if err != nil {
		c.addOn(member, "cluster", "member "+member+": bridge "+n, "readable through Incus", "unreadable: "+err.Error())
		return
	}
	c.addOn(member, "cluster", "member "+member+": bridge "+n+" state", "up", bs.State)
	want := "none"
	if st.Gateway != nil {
		want = st.Gateway.String()
	}
	var addrs []string
	for _, a := range bs.Addresses {
		addrs = append(addrs, a.Address+"/"+a.Netmask)
	}
	c.addOn(member, "cluster", "member "+member+": bridge "+n+" addresses", want, listOrNone(addrs))
	ports := map[string]bool{}
	for _, in := range insts {
		if in.Location != member {
			continue
		}
		for dev, d := range in.ExpandedDevices {
			if d["type"] == "nic" && d["network"] == n {
				if p := in.Config["volatile."+dev+".host_name"]; p != "" {
					ports[p] = true
				}
			}
		}
	}
	var foreign []string
	if bs.Bridge != nil {
		for _, p := range bs.Bridge.UpperDevices {
			if !ports[p] {
				foreign = append(foreign, p)
			}
		}
	}
	slices.Sort(foreign)
	c.addOn(member, "cluster", "member "+member+": bridge "+n+" ports that are not its instances'", "none", listOrNone(foreign))
}

// memberOwnKeys are the keys a member's view of a network (GET ?target=) has beyond the
// cluster-wide config: that member's own, which claudebox never sets.
func memberOwnKeys(onMember, global map[string]string) map[string]string {
	out := map[string]string{}
	for k, v := range onMember {
		if g, ok := global[k]; (!ok || g != v) && !keptKey(k) {
			out[k] = v
		}
	}
	return out
}

// removeMemberKeys drops this member's own keys of the network: the member's view is read
// and written back whole without them (see incus.UpdateNetworkOn).
func (h *Host) removeMemberKeys(ctx context.Context, member string) error {
	n := h.Stack.Network
	cur, etag, err := h.Client.NetworkOn(ctx, n, member)
	if err != nil {
		return err
	}
	global, _, err := h.Client.Network(ctx, n)
	if err != nil {
		return err
	}
	cfg := maps.Clone(cur.Config)
	for k := range memberOwnKeys(cur.Config, global.Config) {
		delete(cfg, k)
	}
	if err := h.Client.UpdateNetworkOn(ctx, n, member, cfg, cur.Description, etag); err != nil {
		return fmt.Errorf("removing network %s's keys of member %s: %w", n, member, changed("network "+n, err))
	}
	return nil
}

// localMember is the name of the cluster member this daemon is, or "" when standalone.
func localMember(ctx context.Context, c *incus.Client) (string, error) {
	srv, err := c.RecentServer(ctx)
	if err != nil || !srv.Clustered {
		return "", err
	}
	return srv.ServerName, nil
}

// onMember reports whether an instance lives on member ("" : a standalone daemon, where
// every instance is local).
func onMember(in incus.Instance, member string) bool {
	return member == "" || in.Location == member
}

// requireHere refuses a verb that would expose a box living on another cluster member: an
// exposure listens on its member's loopback and is guarded in that kernel, so it is made
// there. Nothing is changed.
func (bs *Boxes) requireHere(ctx context.Context, b *Box, verb string) error {
	at, err := bs.startedElsewhere(ctx, b.Instance.Location)
	if err != nil || at == "" {
		return err
	}
	return Usagef("%s %s: the box lives on cluster member %s, and claudebox guards a box's exposures in the kernel it runs in: run the same command on %s", verb, b.Name, at, at)
}

// startedElsewhere reports the member a box runs on when that is not this daemon's (its
// agent binds the box there), "" when it is here or the daemon is standalone or remote.
func (bs *Boxes) startedElsewhere(ctx context.Context, at string) (string, error) {
	if at == "" || at == "none" || bs.Client.Remote() != "local" {
		return "", nil
	}
	local, err := localMember(ctx, bs.Client)
	if err != nil || local == "" || local == at {
		return "", err
	}
	return at, nil
}

// placement is the member a new box goes to: the --target given (any member: its agent binds
// the box there), else this member when here is set (the drill's boxes, whose decoys and
// layers are this kernel's), else "" — Incus's own placement. A --target on a standalone
// daemon, or naming no member, is refused.
func (bs *Boxes) placement(ctx context.Context, target string, here bool) (string, error) {
	local, err := localMember(ctx, bs.Client)
	if err != nil {
		return "", err
	}
	switch {
	case local == "" && target != "":
		return "", Usagef("new --target %s: this Incus daemon is not a cluster member", target)
	case local == "":
		return "", nil
	case target == "" && here:
		return local, nil
	case target == "" || target == local:
		return target, nil
	}
	members, err := memberNames(ctx, bs.Client)
	if err != nil {
		return "", err
	}
	if !slices.Contains(members, target) {
		return "", Usagef("new --target %s: no such cluster member (members: %s)", target, strings.Join(members, ", "))
	}
	return target, nil
}

// LocalTarget checks a verb's --target: none on a standalone daemon (where a --target is
// refused), else this daemon's own member (the default). Another member is refused: the verb
// works in this kernel (a drill's decoys and layers), so it is to be run on that member.
func LocalTarget(ctx context.Context, c *incus.Client, verb, target string) (string, error) {
	local, err := localMember(ctx, c)
	if err != nil {
		return "", err
	}
	if local == "" {
		if target != "" {
			return "", Usagef("%s --target %s: this Incus daemon is not a cluster member", verb, target)
		}
		return "", nil
	}
	if target == "" || target == local {
		return local, nil
	}
	members, err := memberNames(ctx, c)
	if err != nil {
		return "", err
	}
	if !slices.Contains(members, target) {
		return "", Usagef("%s --target %s: no such cluster member (members: %s)", verb, target, strings.Join(members, ", "))
	}
	return "", Usagef("%s --target %s: run it on %s — this is %s, and claudebox works in the kernel of the member it runs on", verb, target, target, local)
}

// readMember fills in, on a cluster, the network's keys of this member's own (st.Member, as
// readBindings read it; nothing on a standalone daemon).
func (h *Host) readMember(ctx context.Context, st *StackState) error {
	if st.Member == "" || st.Network == nil {
		return nil
	}
	on, _, err := h.Client.NetworkOn(ctx, h.Stack.Network, st.Member)
	if err != nil {
		return fmt.Errorf("network %s on member %s: %w", h.Stack.Network, st.Member, err)
	}
	st.MemberKeys = memberOwnKeys(on.Config, st.Network.Config)
	return nil
}
