package boxcore

import (
	"errors"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// execPath is the PATH `incus exec` runs a command with in a container (no environment.PATH
// set): where the first boot's exec looks for cloud-init.
var execPath = []string{"usr/local/sbin", "usr/local/bin", "usr/sbin", "usr/bin", "sbin", "bin", "snap/bin", "run/current-system/sw/bin"}

// lacksCommand reports whether a container's root filesystem, read on the host, has no
// command cmd on exec's PATH. false whenever it cannot tell: then the caller asks the box
// (an exec, 20-30 ms on the critical path of `new`). Only this kernel's daemon keeps the
// root under INCUS_DIR, and only a mounted root has the init a container starts (a storage
// driver that mounts it only while running leaves an empty directory, which must not read
// as "no cloud-init").
// Paths resolve inside the root (RESOLVE_IN_ROOT): a clone's source box may have planted
// symlinks, and they must not lead to the host's own files.
func lacksCommand(container, cmd string) bool {
	return rootLacksCommand(filepath.Join(incusDir(), "containers", container, "rootfs"), cmd)
}

// rootLacksCommand is lacksCommand for the root file system at dir (a container's, or an
// image's volume in a pool: an image is named by the hash of its content, so its volume
// holds what every box created from it starts with).
func rootLacksCommand(dir, cmd string) bool {
	root, err := unix.Open(dir, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return false
	}
	defer unix.Close(root)
	how := &unix.OpenHow{Flags: unix.O_PATH | unix.O_CLOEXEC, Resolve: unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_MAGICLINKS}
	exists := func(p string) (bool, error) {
		fd, err := unix.Openat2(root, p, how)
		if err == nil {
			unix.Close(fd)
			return true, nil
		}
		if errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ENOTDIR) {
			return false, nil
		}
		return false, err
	}
	if ok, err := exists("sbin/init"); !ok || err != nil {
		return false
	}
	for _, dir := range execPath {
		if ok, err := exists(dir + "/" + cmd); ok || err != nil {
			return false
		}
	}
	return true
}
