package boxcore

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/claudebox/claudebox/boxcore/incus"
)

// Storage: the product's pool is a loop-backed btrfs pool Incus creates and mounts itself
// (the loop file is <INCUS_DIR>/disks/<pool>.img). On btrfs a box's root is a snapshot of
// its image (creation ~0.3-1.5 s instead of unpacking the image in full, ~9 s on dir) and its
// disk size is a btrfs qgroup limit (max_referenced) the kernel enforces: a write past it
// fails with EDQUOT. A dir pool enforces no size at all.

// PoolName is the storage pool of the product's stack (DefaultStack).
const PoolName = "claudebox"

// DefaultDisk is the root disk size of a box when neither --disk nor its template says.
const DefaultDisk = "10GiB"

// The size `host init` gives a new pool: half the free space of INCUS_DIR's filesystem,
// clamped to [MinPoolSize, MaxPoolSize].
const (
	MinPoolSize int64 = 20 << 30
	MaxPoolSize int64 = 200 << 30
)

// QgroupDropThreshold is the drop_subtree_threshold host init sets on a btrfs pool. The
// kernel's default (3) makes deleting a large box (a subvolume whose tree is 3 levels high or
// more) skip the accounting and mark every qgroup inconsistent; counts then stop moving, so
// no disk limit holds until a rescan. 8 is the highest level a btrfs tree has: deletes are
// always accounted (slower deletes of huge subvolumes, the price of limits that hold).
const QgroupDropThreshold = 8

// PoolSizeFor is the size of a new pool on a filesystem with free bytes free.
func PoolSizeFor(free int64) int64 {
	return min(max(free/2, MinPoolSize), MaxPoolSize)
}

// PoolSizeString renders a pool size for Incus's size= key (whole GiB).
func PoolSizeString(n int64) string { return strconv.FormatInt(n>>30, 10) + "GiB" }

// PoolMount is where Incus mounts a (local) storage pool.
func PoolMount(pool string) string { return filepath.Join(incusDir(), "storage-pools", pool) }

// BtrfsUsable says whether Incus can make a btrfs pool here: the kernel knows btrfs and
// mkfs.btrfs (btrfs-progs) is installed. why says what is missing.
func BtrfsUsable() (ok bool, why string) {
	b, err := os.ReadFile("/proc/filesystems")
	if err != nil {
		return false, "cannot read /proc/filesystems: " + err.Error()
	}
	found := false
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) > 0 && f[len(f)-1] == "btrfs" {
			found = true
		}
	}
	if !found {
		return false, "the kernel has no btrfs (not in /proc/filesystems)"
	}
	if _, err := exec.LookPath("mkfs.btrfs"); err != nil {
		for _, d := range []string{"/usr/sbin", "/sbin"} {
			if st, err := os.Stat(filepath.Join(d, "mkfs.btrfs")); err == nil && !st.IsDir() {
				return true, ""
			}
		}
		return false, "mkfs.btrfs is not installed (Debian package btrfs-progs; make setup installs it)"
	}
	return true, ""
}

// DirPoolWarning is what init and check say about a dir pool.
func DirPoolWarning(pool string) string {
	return "WARNING: storage pool " + pool + " is a dir pool: disk limits (--disk, a template's disk) are NOT enforced " +
		"(a box sees and can fill the host's filesystem) and every box and copy is a full copy of its image"
}

// DiskQuota is the btrfs quota of a box's root: its subvolume's qgroup limit and usage.
type DiskQuota struct {
	Path       string // the root subvolume on the host
	Subvolume  uint64 // its btrfs subvolume id (qgroup 0/<id>)
	Limit      int64  // max_referenced in bytes; -1: no limit
	Referenced int64  // bytes the subvolume references (shared with its image included)
}

// ErrNoQuota: the pool cannot carry a disk quota (not btrfs, or not on this host).
var ErrNoQuota = errors.New("no disk quota")

// ReadDiskQuota reads the qgroup limit and usage of a container's root subvolume
// (<INCUS_DIR>/storage-pools/<pool>/containers/<instance>) from sysfs. On a dir pool, or a
// daemon that is not this host's, it returns a quota with Limit -1 and an error wrapping
// ErrNoQuota.
func ReadDiskQuota(ctx context.Context, c *incus.Client, pool, instance string) (DiskQuota, error) {
	q := DiskQuota{Limit: -1, Referenced: -1}
	if c.Remote() != "local" {
		return q, fmt.Errorf("%w: the daemon %s is not on this host", ErrNoQuota, c.Remote())
	}
	p, _, err := c.StoragePool(ctx, pool)
	if err != nil {
		return q, err
	}
	if p.Driver != "btrfs" {
		return q, fmt.Errorf("%w: storage pool %s is a %s pool (only btrfs enforces a size)", ErrNoQuota, pool, p.Driver)
	}
	q.Path = filepath.Join(PoolMount(pool), "containers", instance)
	id, fsid, err := btrfsSubvolume(q.Path)
	if err != nil {
		return q, err
	}
	q.Subvolume = id
	st, err := ReadQgroupStatus(q.Path)
	if err != nil {
		return q, err
	}
	if !st.Enabled {
		return q, fmt.Errorf("%w: quotas are off on pool %s (Incus turns them on with the first sized volume)", ErrNoQuota, pool)
	}
	dir := filepath.Join("/sys/fs/btrfs", fsid, "qgroups", fmt.Sprintf("0_%d", id))
	ref, err := readInt(filepath.Join(dir, "referenced"))
	if err != nil {
		return q, fmt.Errorf("qgroup 0/%d of %s: %w", id, q.Path, err)
	}
	q.Referenced = ref
	flags, err := readInt(filepath.Join(dir, "limit_flags"))
	if err != nil {
		return q, fmt.Errorf("qgroup 0/%d of %s: %w", id, q.Path, err)
	}
	if flags&qgroupLimitMaxRfer != 0 {
		if q.Limit, err = readInt(filepath.Join(dir, "max_referenced")); err != nil {
			return q, fmt.Errorf("qgroup 0/%d of %s: %w", id, q.Path, err)
		}
	}
	return q, nil
}

// QgroupStatus is the quota state of one btrfs filesystem, from /sys/fs/btrfs/<uuid>/qgroups.
type QgroupStatus struct {
	UUID          string
	Enabled       bool // qgroups exist (Incus enables them with the first sized volume)
	Inconsistent  bool // the counts are wrong until a rescan: no limit can be trusted
	DropThreshold int  // drop_subtree_threshold; -1 when unreadable
}

// ReadQgroupStatus reads the qgroup state of the btrfs filesystem holding path.
func ReadQgroupStatus(path string) (QgroupStatus, error) {
	st := QgroupStatus{DropThreshold: -1}
	fsid, err := btrfsFSID(path)
	if err != nil {
		return st, err
	}
	st.UUID = fsid
	dir := filepath.Join("/sys/fs/btrfs", fsid, "qgroups")
	if _, err := os.Stat(dir); errors.Is(err, os.ErrNotExist) {
		return st, nil
	} else if err != nil {
		return st, err
	}
	st.Enabled = true
	if v, err := readInt(filepath.Join(dir, "enabled")); err == nil {
		st.Enabled = v != 0
	}
	inc, err := readInt(filepath.Join(dir, "inconsistent"))
	if err != nil {
		return st, err
	}
	st.Inconsistent = inc != 0
	if v, err := readInt(filepath.Join(dir, "drop_subtree_threshold")); err == nil {
		st.DropThreshold = int(v)
	}
	return st, nil
}

// RepairQgroups makes the quota accounting of the btrfs filesystem at mount hold: it sets
// drop_subtree_threshold to QgroupDropThreshold and, when the counts are inconsistent,
// rescans (waiting for the rescan to end). It returns the state before and after.
func RepairQgroups(mount string) (before, after QgroupStatus, err error) {
	before, err = ReadQgroupStatus(mount)
	if err != nil || !before.Enabled {
		return before, before, err
	}
	if before.DropThreshold != QgroupDropThreshold {
		f := filepath.Join("/sys/fs/btrfs", before.UUID, "qgroups", "drop_subtree_threshold")
		if err := os.WriteFile(f, []byte(strconv.Itoa(QgroupDropThreshold)), 0o644); err != nil {
			return before, before, fmt.Errorf("setting %s: %w", f, err)
		}
	}
	if before.Inconsistent {
		if err := btrfsRescan(mount); err != nil {
			return before, before, fmt.Errorf("rescanning the quota of %s: %w", mount, err)
		}
	}
	after, err = ReadQgroupStatus(mount)
	if err == nil && after.Inconsistent {
		err = fmt.Errorf("quota of %s still inconsistent after a rescan", mount)
	}
	return before, after, err
}

// btrfs ioctls (linux/btrfs.h): _IOC(dir, 0x94, nr, size).
const (
	btrfsIocInoLookup      = 0xD0009412 // _IOWR(0x94, 18, struct btrfs_ioctl_ino_lookup_args) (4096 bytes)
	btrfsIocFSInfo         = 0x8400941F // _IOR(0x94, 31, struct btrfs_ioctl_fs_info_args) (1024 bytes)
	btrfsIocQuotaRescan    = 0x4040942C // _IOW(0x94, 44, struct btrfs_ioctl_quota_rescan_args) (64 bytes)
	btrfsIocQuotaRescanWt  = 0x0000942E // _IO(0x94, 46)
	btrfsFirstFreeObjectID = 256
	qgroupLimitMaxRfer     = 1 // BTRFS_QGROUP_LIMIT_MAX_RFER
)

func ioctl(path string, req uintptr, arg unsafe.Pointer) error {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return &os.PathError{Op: "open", Path: path, Err: err}
	}
	defer unix.Close(fd)
	if _, _, e := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), req, uintptr(arg)); e != 0 {
		return &os.PathError{Op: "ioctl", Path: path, Err: e}
	}
	return nil
}

// btrfsSubvolume returns the subvolume id of the subvolume holding dir, and its filesystem's
// UUID (the name of its /sys/fs/btrfs directory).
func btrfsSubvolume(dir string) (uint64, string, error) {
	var args struct {
		TreeID   uint64
		ObjectID uint64
		Name     [4080]byte
	}
	args.ObjectID = btrfsFirstFreeObjectID
	if err := ioctl(dir, btrfsIocInoLookup, unsafe.Pointer(&args)); err != nil {
		return 0, "", fmt.Errorf("btrfs subvolume of %s: %w", dir, err)
	}
	fsid, err := btrfsFSID(dir)
	return args.TreeID, fsid, err
}

// btrfsFSID returns the UUID of the btrfs filesystem holding path.
func btrfsFSID(path string) (string, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		return "", &os.PathError{Op: "statfs", Path: path, Err: err}
	}
	if uint32(st.Type) != unix.BTRFS_SUPER_MAGIC {
		return "", fmt.Errorf("%w: %s is not on btrfs", ErrNoQuota, path)
	}
	var args [1024]byte // max_id u64, num_devices u64, fsid [16]u8, ...
	if err := ioctl(path, btrfsIocFSInfo, unsafe.Pointer(&args[0])); err != nil {
		return "", fmt.Errorf("btrfs filesystem of %s: %w", path, err)
	}
	u := args[16:32]
	return fmt.Sprintf("%x-%x-%x-%x-%x", u[0:4], u[4:6], u[6:8], u[8:10], u[10:16]), nil
}

// btrfsRescan starts a quota rescan (or joins the one running) and waits for it to end.
func btrfsRescan(mount string) error {
	var args [64]byte
	if err := ioctl(mount, btrfsIocQuotaRescan, unsafe.Pointer(&args[0])); err != nil && !errors.Is(err, unix.EINPROGRESS) {
		return err
	}
	return ioctl(mount, btrfsIocQuotaRescanWt, nil)
}

func readInt(path string) (int64, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	return strconv.ParseInt(string(bytes.TrimSpace(b)), 10, 64)
}

var diskSizeRE = regexp.MustCompile(`^([0-9]+(?:\.[0-9]+)?)(B|kB|MB|GB|TB|PB|EB|KiB|MiB|GiB|TiB|PiB|EiB)?$`)

// DiskBytes parses a disk size the way Incus does (kB = 1000, KiB = 1024; no unit = bytes).
func DiskBytes(s string) (int64, error) {
	m := diskSizeRE.FindStringSubmatch(strings.TrimSpace(s))
	if m == nil {
		return 0, fmt.Errorf("%q is not a size like 20GiB", s)
	}
	f, err := strconv.ParseFloat(m[1], 64)
	if err != nil {
		return 0, err
	}
	mult := map[string]float64{"": 1, "B": 1,
		"kB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "PB": 1e15, "EB": 1e18,
		"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40, "PiB": 1 << 50, "EiB": 1 << 60}[m[2]]
	return int64(f * mult), nil
}

// DiskCap is the largest root disk a box on the stack may have: the pool's size. 0 means
// unknown (the pool cannot be read); the daemon's own checks still apply then.
func (bs *Boxes) DiskCap(ctx context.Context) (int64, error) {
	r, err := bs.Client.StoragePoolResources(ctx, bs.Stack.Pool)
	if err != nil {
		return 0, err
	}
	return int64(r.Space.Total), nil
}

// checkDisk refuses a root disk size above the pool's size (a usage error: nothing is made).
func (bs *Boxes) checkDisk(ctx context.Context, disk, what string) error {
	n, err := DiskBytes(disk)
	if err != nil {
		return Usagef("new: %s %q: want a size above zero with a unit, e.g. 20GiB", what, disk)
	}
	limit, err := bs.DiskCap(ctx)
	if err != nil || limit <= 0 {
		return nil // no pool to read: the create says what is wrong with the stack
	}
	if n > limit {
		return Usagef("new: %s %s is more than storage pool %s holds (%s): a box's disk can be at most the pool's size",
			what, disk, bs.Stack.Pool, humanBytes(limit))
	}
	return nil
}

func humanBytes(n int64) string {
	switch {
	case n >= 1<<30:
		return strconv.FormatFloat(float64(n)/(1<<30), 'f', 1, 64) + "GiB"
	case n >= 1<<20:
		return strconv.FormatFloat(float64(n)/(1<<20), 'f', 1, 64) + "MiB"
	}
	return strconv.FormatInt(n, 10) + "B"
}

// freeBytes is the space left to unprivileged users on the filesystem holding path.
func freeBytes(path string) (int64, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		return 0, &os.PathError{Op: "statfs", Path: path, Err: err}
	}
	return int64(st.Bavail) * st.Bsize, nil
}
