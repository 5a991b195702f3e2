package boxcore

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

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

// checkCluster says, on a cluster, whose kernel the readings above are (this member's) and
// which members' kernels this check cannot read: each runs its own `host check`.
func (h *Host) checkCluster(ctx context.Context, c *checker) error {
	srv, err := h.Client.Server(ctx)
	if err != nil || !srv.Clustered {
		return err
	}
	members, err := memberNames(ctx, h.Client)
	if err != nil {
		return err
	}
	c.note("cluster", "member "+srv.ServerName, "this member: the kernel readings above are its own")
	for _, m := range members {
		if m != srv.ServerName {
			c.note("cluster", "member "+m, "kernel state not readable from "+srv.ServerName+": run 'claudebox host check' on "+m)
		}
	}
	return nil
}

// localMember is the name of the cluster member this daemon is, or "" when standalone.
func (h *Host) localMember(ctx context.Context) (string, error) {
	srv, err := h.Client.Server(ctx)
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

// placement is the member a new box goes to (LocalTarget for `new`).
func (bs *Boxes) placement(ctx context.Context, target string) (string, error) {
	return LocalTarget(ctx, bs.Client, "new", target)
}

// LocalTarget checks a verb's --target: none on a standalone daemon (where a --target is
// refused), else this daemon's own member (the default). Another member is refused too:
// claudebox works in the kernel it runs in — a box it placed elsewhere would start with its
// port unbound until someone ran claudebox there, and a drill's decoys and layers are this
// kernel's — so the verb is to be run on that member.
func LocalTarget(ctx context.Context, c *incus.Client, verb, target string) (string, error) {
	srv, err := c.Server(ctx)
	if err != nil {
		return "", err
	}
	if !srv.Clustered {
		if target != "" {
			return "", Usagef("%s --target %s: this Incus daemon is not a cluster member", verb, target)
		}
		return "", nil
	}
	local := srv.ServerName
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
