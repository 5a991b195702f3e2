// Package cloudimage builds a cloud-init-capable Debian 12 CONTAINER image from Debian's
// own packages (debootstrap), for tests and CI that must prove what cloud-init does in a
// box without downloading images:debian/12/cloud (the image server is not reachable from
// the test machines) — and, through BuildAlias, for `claudebox image build`, which imports the
// same image under a product alias on hosts that reach no image server.
//
// The image is a unified tarball (metadata.yaml + templates/ + rootfs/) holding systemd as
// init, cloud-init (Debian's 22.4), ifupdown + isc-dhcp-client for eth0 DHCP (cloud-init's
// eni renderer writes the interface), sudo, curl and ca-certificates. No Node.js and no Claude
// Code: the user-data must install those, so a test on this image proves the install.
//
// How user-data reaches cloud-init — the same mechanism as images:debian/12/cloud (built by
// distrobuilder): the image's metadata.yaml declares Incus templates that render, on the
// instance's first start after create or copy, into the NoCloud seed directory
// /var/lib/cloud/seed/nocloud-net/{meta-data,user-data,vendor-data,network-config}.
// user-data is the instance's `cloud-init.user-data` config key (falling back to the older
// `user.user-data`); meta-data sets instance-id and local-hostname to the instance name, so a
// copy gets a new instance-id and cloud-init runs its per-instance modules again; the
// network-config defaults to DHCP on eth0 (enp5s0 on VMs) unless `cloud-init.network-config`
// is set. cloud-init is pinned to the NoCloud datasource (datasource_list: [NoCloud]) so that
// a missing seed fails visibly instead of falling back to an empty config; Incus 6 offers
// /dev/incus/sock, not the /dev/lxd/sock cloud-init 22.4's LXD datasource looks for, so NoCloud
// is also what detection would pick. /etc/machine-id is emptied on create and copy, so every
// box and every clone boots with its own machine id.
//
// The tarball is cached on disk under a hash of the recipe (CacheDir/<hash>.tar.gz) and
// imported under the alias Alias(hash); Ensure costs one API call once the alias exists,
// and an import of the cached file (no build) when only the daemon lost it.
//
// Build-host requirements: Requirements() lists the Debian packages the build needs
// (debootstrap); `make setup` installs them. The build never installs packages itself (two
// test packages doing so at once collide on the dpkg lock): CheckRequirements says what to run.
package cloudimage

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/claudebox/claudebox/boxcore/incus"
)

// RecipeVersion changes whenever the build steps or the files written into the image change
// in a way the Recipe fields do not show; it is part of the hash.
const RecipeVersion = "1"

// AliasPrefix prefixes the image alias; the first 12 hex digits of the recipe hash follow.
const AliasPrefix = "claudebox-test/debian12-cloud-"

// DefaultCacheDir holds built tarballs; CLAUDEBOX_IMAGE_CACHE overrides it.
const DefaultCacheDir = "/var/cache/claudebox/images"

// Recipe is what the image is built from.
type Recipe struct {
	Suite    string   // Debian suite, "bookworm"
	Mirror   string   // Debian mirror URL, e.g. http://deb.debian.org/debian
	Arch     string   // Debian architecture, e.g. amd64
	Packages []string // debootstrap --include, on top of the minbase variant
}

// DefaultPackages are installed on top of debootstrap's minbase variant.
//
// python3-cffi-backend is listed because debootstrap does not resolve virtual packages:
// python3-cryptography (cloud-init → python3-oauthlib → it) depends on the virtual
// python3-cffi-backend-api-min/max, which only python3-cffi-backend provides; without it
// the base system fails to configure.
var DefaultPackages = []string{
	"systemd", "systemd-sysv", "dbus", "cloud-init", "python3-cffi-backend",
	"ifupdown", "isc-dhcp-client", "iproute2", "netbase",
	"ca-certificates", "curl", "sudo", "locales",
}

// Default returns the recipe for this host: bookworm from the host's own Debian mirror (the
// one apt already uses, so the build reaches only the package registry the host is allowed
// to reach), for the host's architecture.
func Default() Recipe {
	return Recipe{Suite: "bookworm", Mirror: HostMirror(), Arch: DebArch(), Packages: slices.Clone(DefaultPackages)}
}

// Hash is the recipe's content hash: hex SHA-256 over the recipe version, the fields and
// every file the build writes into the image.
func (r Recipe) Hash() string {
	h := sha256.New()
	fmt.Fprintf(h, "claudebox cloudimage recipe %s\nsuite %s\nmirror %s\narch %s\n", RecipeVersion, r.Suite, r.Mirror, r.Arch)
	pk := slices.Clone(r.Packages)
	slices.Sort(pk)
	fmt.Fprintf(h, "packages %s\n", strings.Join(pk, ","))
	for _, f := range rootfsFiles {
		fmt.Fprintf(h, "file %s %o %d\n%s\n", f.path, f.mode, len(f.content), f.content)
	}
	for _, t := range incusTemplates {
		fmt.Fprintf(h, "template %s %s %v %d\n%s\n", t.target, t.name, t.when, len(t.content), t.content)
	}
	return hex.EncodeToString(h.Sum(nil))
}

// Alias returns the image alias for a recipe hash.
func Alias(hash string) string { return AliasPrefix + hash[:12] }

// CacheDir returns where tarballs are kept: $CLAUDEBOX_IMAGE_CACHE or DefaultCacheDir.
func CacheDir() string {
	if d := os.Getenv("CLAUDEBOX_IMAGE_CACHE"); d != "" {
		return d
	}
	return DefaultCacheDir
}

// CachePath returns the cached tarball's path for a recipe hash.
func CachePath(hash string) string { return filepath.Join(CacheDir(), hash+".tar.gz") }

// Requirements returns the Debian packages the build host needs. debootstrap is the only
// one: the rest of the build is Go and coreutils (tar, gzip).
func Requirements() []string { return []string{"debootstrap"} }

// requirementBinary maps a package of Requirements to the program that shows it is present.
var requirementBinary = map[string]string{"debootstrap": "debootstrap"}

// CheckRequirements says which packages of Requirements are missing and how to get them.
// It never installs anything: `make setup` (scripts/setup.sh) does, once, before any test,
// because two test packages running apt-get at once collide on the dpkg lock.
func CheckRequirements() error {
	missing := missingRequirements()
	if len(missing) == 0 {
		return nil
	}
	return fmt.Errorf("cloudimage: the image build needs %s, which is not installed: run 'sudo make setup' (it installs everything the tests use)", strings.Join(missing, ", "))
}

// missingRequirements returns the packages of Requirements whose program is not on PATH.
func missingRequirements() []string {
	var missing []string
	for _, p := range Requirements() {
		if _, err := exec.LookPath(requirementBinary[p]); err != nil {
			missing = append(missing, p)
		}
	}
	return missing
}

// HostMirror returns the first Debian archive URI the host's apt sources use (deb822
// *.sources or one-line sources.list), skipping debian-security; http://deb.debian.org/debian
// if none is found.
func HostMirror() string { return hostMirror("/etc/apt") }

func hostMirror(aptDir string) string {
	var files []string
	if m, _ := filepath.Glob(filepath.Join(aptDir, "sources.list.d", "*.sources")); m != nil {
		files = append(files, m...)
	}
	if m, _ := filepath.Glob(filepath.Join(aptDir, "sources.list.d", "*.list")); m != nil {
		files = append(files, m...)
	}
	files = append(files, filepath.Join(aptDir, "sources.list"))
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		sc := bufio.NewScanner(bytes.NewReader(b))
		for sc.Scan() {
			line := strings.TrimSpace(sc.Text())
			var uris []string
			switch {
			case strings.HasPrefix(line, "URIs:"):
				uris = strings.Fields(strings.TrimPrefix(line, "URIs:"))
			case strings.HasPrefix(line, "deb "):
				fs := strings.Fields(line)
				for _, f := range fs[1:] {
					if strings.Contains(f, "://") {
						uris = []string{f}
						break
					}
				}
			}
			for _, u := range uris {
				u = strings.TrimSuffix(u, "/")
				if strings.HasSuffix(u, "/debian") && !strings.Contains(u, "security") {
					return u
				}
			}
		}
	}
	return "http://deb.debian.org/debian"
}

// DebArch returns Debian's name for the architecture this program was built for.
func DebArch() string {
	switch runtime.GOARCH {
	case "386":
		return "i386"
	case "arm":
		return "armhf"
	case "ppc64le":
		return "ppc64el"
	}
	return runtime.GOARCH // amd64, arm64, riscv64, s390x
}

// incusArch returns Incus's name for a Debian architecture.
func incusArch(deb string) string {
	switch deb {
	case "amd64":
		return "x86_64"
	case "arm64":
		return "aarch64"
	case "i386":
		return "i686"
	case "armhf":
		return "armv7l"
	case "ppc64el":
		return "ppc64le"
	}
	return deb
}

// Result says what Ensure did.
type Result struct {
	Alias       string
	Fingerprint string
	Hash        string
	Built       bool          // the tarball was built (no cache)
	Imported    bool          // the tarball was imported (alias was missing)
	BuildTime   time.Duration // debootstrap + configure + tar
	ImportTime  time.Duration
}

// Ensure makes sure the image of r is in the daemon under Alias(r.Hash()), building the
// tarball only when it is not cached and importing it only when the alias is missing.
// Concurrent callers (parallel test packages) are serialized by a lock file in CacheDir.
// Progress lines go to log.
func Ensure(ctx context.Context, c *incus.Client, r Recipe, log io.Writer) (Result, error) {
	if log == nil {
		log = io.Discard
	}
	hash := r.Hash()
	res := Result{Alias: Alias(hash), Hash: hash}
	if a, err := c.ImageAlias(ctx, res.Alias); err == nil {
		res.Fingerprint = a.Target
		return res, nil
	} else if !errors.Is(err, incus.ErrNotFound) {
		return res, err
	}
	unlock, err := lockRecipe(ctx, hash)
	if err != nil {
		return res, err
	}
	defer unlock()
	// Someone may have finished while we waited for the lock.
	if a, err := c.ImageAlias(ctx, res.Alias); err == nil {
		res.Fingerprint = a.Target
		return res, nil
	}
	path := CachePath(hash)
	if _, err := os.Stat(path); err != nil {
		t0 := time.Now()
		if err := Build(ctx, r, path, log); err != nil {
			return res, err
		}
		res.Built, res.BuildTime = true, time.Since(t0)
		fmt.Fprintf(log, "cloudimage: built %s in %s\n", path, res.BuildTime.Round(time.Second))
	} else {
		fmt.Fprintf(log, "cloudimage: using cached %s\n", path)
	}
	t0 := time.Now()
	fp, err := importFile(ctx, c, path)
	if err != nil {
		return res, err
	}
	if err := c.CreateImageAlias(ctx, res.Alias, fp); err != nil {
		if !errors.Is(err, incus.ErrConflict) {
			return res, fmt.Errorf("cloudimage: aliasing %s: %w", res.Alias, err)
		}
		a, aerr := c.ImageAlias(ctx, res.Alias)
		if aerr != nil {
			return res, aerr
		}
		if a.Target != fp {
			return res, fmt.Errorf("cloudimage: alias %s already points at image %s, not %s", res.Alias, a.Target, fp)
		}
	}
	res.Fingerprint, res.Imported, res.ImportTime = fp, true, time.Since(t0)
	fmt.Fprintf(log, "cloudimage: imported %s as %s in %s\n", fp[:12], res.Alias, res.ImportTime.Round(100*time.Millisecond))
	return res, nil
}

// importFile imports the tarball at path, tolerating an image already in the store (its
// fingerprint is the tarball's SHA-256).
func importFile(ctx context.Context, c *incus.Client, path string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", fmt.Errorf("cloudimage: %w", err)
	}
	defer f.Close()
	fp, err := c.ImportImage(ctx, f, nil)
	if err == nil {
		return fp, nil
	}
	if !errors.Is(err, incus.ErrConflict) {
		return "", fmt.Errorf("cloudimage: importing %s: %w", path, err)
	}
	// The upload closed f (an HTTP request body is closed once sent): hash a fresh handle.
	g, err := os.Open(path)
	if err != nil {
		return "", fmt.Errorf("cloudimage: %w", err)
	}
	defer g.Close()
	h := sha256.New()
	if _, err := io.Copy(h, g); err != nil {
		return "", err
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

// lockFile takes an exclusive flock on path, polling so ctx can cancel the wait.
func lockFile(ctx context.Context, path string) (func(), error) {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return nil, fmt.Errorf("cloudimage: %w", err)
	}
	for {
		err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		if err == nil {
			return func() { _ = syscall.Flock(int(f.Fd()), syscall.LOCK_UN); f.Close() }, nil
		}
		if !errors.Is(err, syscall.EWOULDBLOCK) {
			f.Close()
			return nil, fmt.Errorf("cloudimage: locking %s: %w", path, err)
		}
		select {
		case <-ctx.Done():
			f.Close()
			return nil, ctx.Err()
		case <-time.After(500 * time.Millisecond):
		}
	}
}

// lockRecipe makes the cache directory and takes the lock of one recipe's build: one builder
// per recipe on this host, the others wait and then find its result.
func lockRecipe(ctx context.Context, hash string) (unlock func(), err error) {
	if err := os.MkdirAll(CacheDir(), 0o755); err != nil {
		return nil, fmt.Errorf("cloudimage: %w", err)
	}
	return lockFile(ctx, filepath.Join(CacheDir(), hash+".lock"))
}
