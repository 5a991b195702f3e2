package boxcore

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"strings"
	"unsafe"

	"github.com/claudebox/claudebox/boxcore/incus"
)

// poolPlan is what init does to the stack's storage pool.
type poolPlan struct {
	create bool
	driver string
	config map[string]string
	// quota: turn btrfs quotas on, set drop_subtree_threshold, rescan an inconsistent count.
	quota bool
}

// planPool makes sure the stack's pool exists: a loop-backed btrfs pool Incus creates itself
// (its loop file under INCUS_DIR/disks, mounted by the daemon on every start), or, where btrfs
// cannot be had, a dir pool and a loud warning. An existing btrfs pool gets its quota
// accounting checked: on, drop_subtree_threshold at QgroupDropThreshold, consistent.
func (h *Host) planPool(ctx context.Context, p *InitPlan, opts InitOptions) error {
	name := h.Stack.Pool
	p.Pool = name
	pools, err := h.Client.StoragePools(ctx)
	if err != nil {
		return err
	}
	for _, pl := range pools {
		if pl.Name != name {
			continue
		}
		p.pool.driver = pl.Driver
		switch pl.Driver {
		case "dir":
			p.Warnings = append(p.Warnings, DirPoolWarning(name))
		case "btrfs":
			h.planQuota(p, name)
		}
		return nil
	}
	obj := "storage pool " + name
	ok, why := BtrfsUsable()
	if !ok {
		p.pool = poolPlan{create: true, driver: "dir"}
		p.Warnings = append(p.Warnings, DirPoolWarning(name)+" ("+why+")")
		p.change(obj, "create a dir pool (btrfs cannot be used: "+why+"): disk limits NOT enforced")
		return nil
	}
	size := opts.PoolSize
	if size == "" {
		free, err := freeBytes(incusDir())
		if err != nil {
			return err
		}
		size = PoolSizeString(PoolSizeFor(free))
	} else if n, err := DiskBytes(size); err != nil || n <= 0 {
		return Usagef("host init: pool size %q: want a size like 40GiB", size)
	}
	p.pool = poolPlan{create: true, driver: "btrfs", config: map[string]string{"size": size}, quota: true}
	p.change(obj, "create btrfs, "+size+" loop file under "+incusDir()+"/disks (copy-on-write boxes, enforced disk limits)")
	return nil
}

// planQuota plans the repair of a btrfs pool's quota accounting.
func (h *Host) planQuota(p *InitPlan, pool string) {
	if h.Client.Remote() != "local" {
		return
	}
	obj := "storage pool " + pool
	st, err := ReadQgroupStatus(PoolMount(pool))
	switch {
	case err != nil:
		p.Warnings = append(p.Warnings, fmt.Sprintf("WARNING: storage pool %s: cannot read its quota accounting (%v): disk limits may not hold", pool, err))
		return
	case !st.Enabled:
		p.pool.quota = true
		p.change(obj, fmt.Sprintf("turn quota accounting on (drop_subtree_threshold %d)", QgroupDropThreshold))
	default:
		if st.DropThreshold != QgroupDropThreshold {
			p.pool.quota = true
			p.change(obj, fmt.Sprintf("set qgroups drop_subtree_threshold %d (was %d: deleting a large box would stop every disk limit)", QgroupDropThreshold, st.DropThreshold))
		}
		if st.Inconsistent {
			p.pool.quota = true
			p.change(obj, "rescan the quota accounting (inconsistent: no disk limit holds)")
		}
	}
}

// applyPool creates the pool and repairs its quota accounting, as planned.
func (h *Host) applyPool(ctx context.Context, p *InitPlan) error {
	name := p.Pool
	if p.pool.create {
		members, err := h.clusterMembers(ctx)
		if err != nil {
			return err
		}
		global := p.pool.config
		if len(members) > 0 {
			global = nil // size and source are each member's own
		}
		err = createClustered(members,
			func(m string) error {
				return h.Client.CreateStoragePoolPending(ctx, m, name, p.pool.driver, p.pool.config)
			},
			func() error { return h.Client.CreateStoragePool(ctx, name, p.pool.driver, global) },
			func() error { return h.Client.DeleteStoragePool(context.WithoutCancel(ctx), name) })
		if err != nil {
			return fmt.Errorf("creating storage pool %s: %w", name, err)
		}
	}
	if !p.pool.quota || p.pool.driver != "btrfs" || h.Client.Remote() != "local" {
		return nil
	}
	return EnsureQuota(PoolMount(name))
}

// EnsureQuota turns quotas on for the btrfs filesystem at mount (Incus would with the first
// sized volume, but the threshold must be set before any box is deleted) and makes the
// accounting hold (RepairQgroups).
func EnsureQuota(mount string) error {
	st, err := ReadQgroupStatus(mount)
	if err != nil {
		return err
	}
	if !st.Enabled {
		args := struct{ Cmd, Status uint64 }{Cmd: btrfsQuotaCtlEnable}
		if err := ioctl(mount, btrfsIocQuotaCtl, unsafe.Pointer(&args)); err != nil {
			return fmt.Errorf("turning quotas on for %s: %w", mount, err)
		}
	}
	_, _, err = RepairQgroups(mount)
	return err
}

// ensurePoolQuota is EnsureQuota on the stack's pool when it is a local btrfs pool; errors are
// dropped (host check reports the accounting).
func (h *Host) ensurePoolQuota(ctx context.Context) {
	if h.Client.Remote() != "local" {
		return
	}
	if pl, _, err := h.Client.StoragePool(ctx, h.Stack.Pool); err == nil && pl.Driver == "btrfs" {
		_ = EnsureQuota(PoolMount(h.Stack.Pool))
	}
}

const (
	btrfsIocQuotaCtl    = 0xC0109428 // _IOWR(0x94, 40, struct btrfs_ioctl_quota_ctl_args) (16 bytes)
	btrfsQuotaCtlEnable = 1
)

// rootMoveRefused: Incus will not change the pool of a profile's root disk while instances
// take their root from it.
func rootMoveRefused(err error) bool {
	var se *incus.StatusError
	return errors.As(err, &se) && strings.Contains(se.Message, "relies on this profile's root disk")
}

// keepProfileRoot puts the profile's current root disk back into prof and says why.
func keepProfileRoot(prof *incus.Profile, cur *incus.Profile, pool string) string {
	prof.Devices = maps.Clone(prof.Devices)
	prof.Devices["root"] = maps.Clone(cur.Devices["root"])
	return fmt.Sprintf("WARNING: profile %s keeps its root disk on pool %s: instances rely on it and Incus will not move it. "+
		"New boxes get their own root on pool %s; move the old ones (stopped) with 'incus move BOX --storage %s' or remove them, then run host init again",
		prof.Name, cur.Devices["root"]["pool"], pool, pool)
}

// checkPool reads back the stack's pool: btrfs (a dir pool is a warning: init cannot convert
// it), and on btrfs, quota accounting on, consistent, with drop_subtree_threshold set.
func (h *Host) checkPool(ctx context.Context, c *checker) {
	name := h.Stack.Pool
	obj := "pool " + name
	pl, _, err := h.Client.StoragePool(ctx, name)
	if errors.Is(err, incus.ErrNotFound) {
		c.add("storage", obj, "exists", "missing")
		return
	} else if err != nil {
		c.add("storage", obj, "readable", err.Error())
		return
	}
	if prof, _, err := h.Client.Profile(ctx, h.Stack.Profile); err == nil {
		if rp := prof.Devices["root"]["pool"]; rp != "" && rp != name {
			c.note("storage", "profile "+h.Stack.Profile+" root pool",
				rp+", not "+name+": instances rely on it (boxes made since have their own root on "+name+")")
		}
	}
	if pl.Driver != "btrfs" {
		c.note("storage", obj+" driver", pl.Driver+": "+DirPoolWarning(name))
		return
	}
	c.add("storage", obj+" driver", "btrfs", pl.Driver)
	if h.Client.Remote() != "local" {
		return
	}
	st, err := ReadQgroupStatus(PoolMount(name))
	if err != nil {
		c.add("storage", obj+" mount", "btrfs at "+PoolMount(name), err.Error())
		return
	}
	c.add("storage", obj+" quota accounting", "on", map[bool]string{true: "on", false: "off"}[st.Enabled])
	if !st.Enabled {
		return
	}
	c.add("storage", obj+" quota accounting consistent", "consistent",
		map[bool]string{true: "inconsistent (no disk limit holds until a rescan)", false: "consistent"}[st.Inconsistent])
	c.add("storage", obj+" qgroups drop_subtree_threshold", fmt.Sprint(QgroupDropThreshold), fmt.Sprint(st.DropThreshold))
}
