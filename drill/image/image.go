// Package image builds the drill's probe image, the smallest Incus container image there is: a unified image
// tarball (metadata.yaml + rootfs/) whose rootfs holds one static binary as /sbin/init and
// the empty directories a container needs (dev, proc, sys, tmp, run, etc, root, var, ...).
// There is no /etc/hostname, no shell and no libc: the binary is the whole system, and it
// must treat "running as PID 1" (or "no arguments") as init mode.
//
// The tarball is deterministic (fixed times and owners), so the same binary and recipe
// always give the same bytes and therefore the same Incus fingerprint. EnsureImage imports
// it once and finds it again by an alias derived from the content hash.
package image

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/sha256"
	"debug/elf"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"runtime"
	"strings"
	"time"

	"github.com/claudebox/claudebox/boxcore/incus"
)

// RecipeVersion changes whenever the tarball layout changes, so that the content hash (and
// the alias) changes with it.
const RecipeVersion = "1"

// epoch is the fixed time stamped on every entry and in metadata.yaml.
var epoch = time.Unix(1700000000, 0).UTC()

// dirs are the rootfs directories, in order, with their modes.
var dirs = []struct {
	name string
	mode int64
}{
	{"rootfs/", 0o755},
	{"rootfs/dev/", 0o755},
	{"rootfs/proc/", 0o555},
	{"rootfs/sys/", 0o555},
	{"rootfs/tmp/", 0o1777},
	{"rootfs/run/", 0o755},
	{"rootfs/etc/", 0o755},
	{"rootfs/root/", 0o700},
	{"rootfs/var/", 0o755},
	{"rootfs/var/tmp/", 0o1777},
	{"rootfs/mnt/", 0o755},
	{"rootfs/sbin/", 0o755},
}

// Hash returns the content hash of an image built from binary: the hex SHA-256 of the
// recipe version and the binary. Its first 16 characters suffix the image's alias.
func Hash(binary []byte) string {
	h := sha256.New()
	fmt.Fprintf(h, "claudebox-scratch recipe %s\n", RecipeVersion)
	h.Write(binary)
	return hex.EncodeToString(h.Sum(nil))
}

// Arch returns Incus's name for the architecture this program was built for.
func Arch() string {
	switch runtime.GOARCH {
	case "amd64":
		return "x86_64"
	case "arm64":
		return "aarch64"
	case "386":
		return "i686"
	case "arm":
		return "armv7l"
	case "riscv64":
		return "riscv64"
	case "ppc64le":
		return "ppc64le"
	case "s390x":
		return "s390x"
	}
	return runtime.GOARCH
}

// Write streams the unified tarball for binary to w.
func Write(w io.Writer, binary []byte) error {
	hash := Hash(binary)
	meta := fmt.Sprintf(`architecture: %s
creation_date: %d
properties:
  os: claudebox-scratch
  release: "%s"
  architecture: %s
  description: claudebox scratch image %s (recipe %s)
  claudebox.hash: %s
`, Arch(), epoch.Unix(), RecipeVersion, Arch(), hash[:16], RecipeVersion, hash)

	tw := tar.NewWriter(w)
	hdr := func(name string, typ byte, mode, size int64) *tar.Header {
		return &tar.Header{
			Name: name, Typeflag: typ, Mode: mode, Size: size, ModTime: epoch,
			Uid: 0, Gid: 0, Format: tar.FormatUSTAR,
		}
	}
	if err := tw.WriteHeader(hdr("metadata.yaml", tar.TypeReg, 0o644, int64(len(meta)))); err != nil {
		return err
	}
	if _, err := io.WriteString(tw, meta); err != nil {
		return err
	}
	for _, d := range dirs {
		if err := tw.WriteHeader(hdr(d.name, tar.TypeDir, d.mode, 0)); err != nil {
			return err
		}
	}
	if err := tw.WriteHeader(hdr("rootfs/sbin/init", tar.TypeReg, 0o755, int64(len(binary)))); err != nil {
		return err
	}
	if _, err := tw.Write(binary); err != nil {
		return err
	}
	return tw.Close()
}

// Build returns the unified tarball for binary and its content hash (see Hash).
func Build(binary []byte) (tarball []byte, hash string, err error) {
	var buf bytes.Buffer
	buf.Grow(len(binary) + 16*1024)
	if err := Write(&buf, binary); err != nil {
		return nil, "", err
	}
	return buf.Bytes(), Hash(binary), nil
}

// BuildFile is Build for the binary at path, which must be linked statically: the image has
// nothing else, so a binary that needs a loader fails to start as every box's init (lxc says
// only that it could not exec /sbin/init).
func BuildFile(path string) (tarball []byte, hash string, err error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, "", fmt.Errorf("scratch: reading the init binary: %w", err)
	}
	if interp := interpreter(b); interp != "" {
		return nil, "", fmt.Errorf("scratch: %s is linked dynamically (it needs %s), and the probe image holds nothing but it: build it statically (CGO_ENABLED=0, as 'make build' does)", path, interp)
	}
	return Build(b)
}

// interpreter is the dynamic loader an ELF binary names ("" for a static one, or not ELF).
func interpreter(b []byte) string {
	f, err := elf.NewFile(bytes.NewReader(b))
	if err != nil {
		return ""
	}
	defer f.Close()
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			raw := make([]byte, p.Filesz)
			if _, err := p.ReadAt(raw, 0); err == nil {
				return strings.TrimRight(string(raw), "\x00")
			}
			return "a loader"
		}
	}
	return ""
}

// Alias returns the image alias for a content hash: aliasPrefix-<first 16 hex digits>.
func Alias(aliasPrefix, hash string) string {
	return aliasPrefix + "-" + hash[:16]
}

// Fingerprint returns the Incus fingerprint of a unified tarball: its SHA-256.
func Fingerprint(tarball []byte) string {
	s := sha256.Sum256(tarball)
	return hex.EncodeToString(s[:])
}

// EnsureImage makes sure the scratch image for the static binary at binaryPath is in the
// daemon's image store under the alias Alias(aliasPrefix, hash), importing it only when
// the alias does not exist yet, and returns the alias. It tolerates a concurrent import of
// the same image (same fingerprint, same alias).
func EnsureImage(ctx context.Context, client *incus.Client, binaryPath, aliasPrefix string) (string, error) {
	bin, err := os.ReadFile(binaryPath)
	if err != nil {
		return "", fmt.Errorf("scratch: reading the init binary: %w", err)
	}
	alias := Alias(aliasPrefix, Hash(bin))
	if _, err := client.ImageAlias(ctx, alias); err == nil {
		return alias, nil
	} else if !errors.Is(err, incus.ErrNotFound) {
		return "", err
	}
	// A new binary means a new image: the ones older binaries left go, so the store does not
	// grow by one image per build.
	PruneImages(ctx, client, aliasPrefix, alias, PruneAge)
	tarball, _, err := Build(bin)
	if err != nil {
		return "", err
	}
	fp := Fingerprint(tarball)
	got, err := client.ImportImage(ctx, bytes.NewReader(tarball), nil)
	switch {
	case err == nil:
		fp = got
	case errors.Is(err, incus.ErrConflict):
		// The same image is already in the store (imported by someone else): alias it.
	default:
		return "", fmt.Errorf("scratch: importing %s: %w", alias, err)
	}
	if err := client.CreateImageAlias(ctx, alias, fp); err != nil {
		if !errors.Is(err, incus.ErrConflict) {
			return "", fmt.Errorf("scratch: aliasing %s: %w", alias, err)
		}
		a, aerr := client.ImageAlias(ctx, alias)
		if aerr != nil {
			return "", aerr
		}
		if a.Target != fp {
			return "", fmt.Errorf("scratch: alias %s already points at image %s, not %s", alias, a.Target, fp)
		}
	}
	return alias, nil
}

// PruneAge is how old another scratch image must be before PruneImages removes it, so that
// parallel processes running different builds never delete each other's image mid-use.
const PruneAge = 15 * time.Minute

// PruneImages deletes images aliased aliasPrefix-<hash> other than keep, uploaded more than
// olderThan ago. Instances made from them keep their own copy. Failures are ignored: pruning
// is housekeeping, never a reason to fail.
func PruneImages(ctx context.Context, client *incus.Client, aliasPrefix, keep string, olderThan time.Duration) (removed int) {
	imgs, err := client.Images(ctx)
	if err != nil {
		return 0
	}
	cutoff := time.Now().Add(-olderThan)
	for _, im := range imgs {
		ours, kept := false, false
		for _, a := range im.Aliases {
			if a == keep {
				kept = true
			}
			if strings.HasPrefix(a, aliasPrefix+"-") && len(a) == len(aliasPrefix)+17 {
				ours = true
			}
		}
		if ours && !kept && im.UploadedAt.Before(cutoff) {
			if client.DeleteImage(ctx, im.Fingerprint) == nil {
				removed++
			}
		}
	}
	return removed
}
