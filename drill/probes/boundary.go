package probes

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Two probes of what a box may ask of the kernel and of Incus beyond its limits (found by the
// attacker): the guest API socket's presence (`stat`), and a btrfs subvolume created from
// inside the box (`subvolume`), which would sit outside the box's qgroup and so outside its
// disk quota.

// probeStat: Open when Target exists, Dropped when it does not (ENOENT), CheckFailed for any
// other error.
func probeStat(s Spec, r *Result) {
	fi, err := os.Lstat(s.Target)
	switch {
	case err == nil:
		r.Outcome, r.Evidence = Open, fmt.Sprintf("%s exists (%s)", s.Target, fi.Mode().Type())
	case errors.Is(err, os.ErrNotExist):
		r.Outcome, r.Evidence = Dropped, s.Target+" does not exist"
	default:
		r.Outcome, r.Evidence = CheckFailed, err.Error()
	}
}

// The btrfs subvolume ioctls (linux/btrfs.h): _IOW(0x94, nr, struct btrfs_ioctl_vol_args[_v2]),
// both structs 4096 bytes, the name at offset 8.
const (
	btrfsIOCSubvolCreate   = 0x5000940e
	btrfsIOCSubvolCreateV2 = 0x50009418
	btrfsVolNameOffset     = 8
	btrfsVolArgsSize       = 4096
	// ioctlHighBit: the kernel takes the request as 32 bits; a filter that compares 64 must
	// mask, or the same request with bit 32 set slips past it.
	ioctlHighBit = 1 << 32
)

// probeSubvolume tries to create a btrfs subvolume in the directory Target (default /): after
// a plain mkdir there works (the control: the directory is writable), each subvolume ioctl is
// tried as is and with bit 32 set. Refused when every try fails with EPERM (denied); Open
// when one creates a subvolume (it is removed at once: rmdir deletes an empty one);
// CheckFailed otherwise (not btrfs, the control failed).
func probeSubvolume(s Spec, r *Result) {
	dir := s.Target
	if dir == "" {
		dir = "/"
	}
	base := fmt.Sprintf("claudebox-subvol.%d", os.Getpid())
	ctl := filepath.Join(dir, base+".ctl")
	if err := os.Mkdir(ctl, 0o700); err != nil {
		r.Outcome, r.Evidence = CheckFailed, "control: mkdir: "+err.Error()
		return
	}
	_ = os.Remove(ctl)
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		r.Outcome, r.Evidence = CheckFailed, err.Error()
		return
	}
	defer unix.Close(fd)
	var denied []string
	for i, req := range []uint64{btrfsIOCSubvolCreate, btrfsIOCSubvolCreate | ioctlHighBit, btrfsIOCSubvolCreateV2, btrfsIOCSubvolCreateV2 | ioctlHighBit} {
		name := fmt.Sprintf("%s.%d", base, i)
		var args [btrfsVolArgsSize]byte
		copy(args[btrfsVolNameOffset:btrfsVolArgsSize-1], name)
		_, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), uintptr(req), uintptr(unsafe.Pointer(&args[0])))
		what := fmt.Sprintf("ioctl %#x", req)
		switch errno {
		case 0:
			rmErr := unix.Rmdir(filepath.Join(dir, name))
			r.Outcome, r.Evidence = Open, what+" created subvolume "+filepath.Join(dir, name)
			if rmErr != nil {
				r.Evidence += " (and it could not be removed: " + rmErr.Error() + ")"
			}
			return
		case unix.EPERM:
			denied = append(denied, what)
		default:
			r.Outcome, r.Evidence = CheckFailed, what+": "+errno.Error()
			return
		}
	}
	r.Outcome, r.Evidence = Refused, "denied (EPERM): "+strings.Join(denied, ", ")+"; mkdir works"
}
