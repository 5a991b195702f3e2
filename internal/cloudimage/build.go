package cloudimage

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"time"

	"github.com/claudebox/claudebox/internal/mounts"
)

// rootfsFile is a file the build writes into the rootfs after debootstrap.
type rootfsFile struct {
	path    string
	mode    os.FileMode
	content string
}

var rootfsFiles = []rootfsFile{
	// Only NoCloud: the seed Incus renders is the one source of user-data; if it is missing,
	// cloud-init reports an error rather than running with an empty config.
	{"/etc/cloud/cloud.cfg.d/90_claudebox.cfg", 0o644, "# claudebox test image: user-data comes from the NoCloud seed Incus renders\n# (metadata.yaml templates -> /var/lib/cloud/seed/nocloud-net).\ndatasource_list: [ NoCloud ]\n"},
	// ifupdown: cloud-init's eni renderer writes eth0 (DHCP) into interfaces.d at init-local.
	{"/etc/network/interfaces", 0o644, "# Interfaces are written by cloud-init into /etc/network/interfaces.d.\nsource /etc/network/interfaces.d/*\n\nauto lo\niface lo inet loopback\n"},
	// debootstrap copies the build host's; the box gets its own from Incus templates / DHCP.
	{"/etc/hostname", 0o644, "localhost\n"},
	{"/etc/hosts", 0o644, "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\nff02::1\tip6-allnodes\nff02::2\tip6-allrouters\n"},
	{"/etc/resolv.conf", 0o644, ""},
	// Empty: systemd generates a machine id on first boot.
	{"/etc/machine-id", 0o444, ""},
	{"/etc/default/locale", 0o644, "LANG=C.UTF-8\n"},
}

// incusTemplate is an Incus image template: rendered by the daemon (pongo2) into target
// inside the instance on the listed triggers.
type incusTemplate struct {
	target     string
	name       string
	when       []string
	properties map[string]string
	content    string
}

var incusTemplates = []incusTemplate{
	{"/var/lib/cloud/seed/nocloud-net/meta-data", "cloud-init-meta-data.tpl", []string{"create", "copy"}, nil,
		"instance-id: {{ instance.name }}\nlocal-hostname: {{ instance.name }}\n{{ config_get(\"user.meta-data\", \"\") }}\n"},
	{"/var/lib/cloud/seed/nocloud-net/user-data", "cloud-init-user-data.tpl", []string{"create", "copy"},
		map[string]string{"default": "#cloud-config\n{}"},
		"{% if config_get(\"cloud-init.user-data\", \"\") != \"\" %}{{ config_get(\"cloud-init.user-data\", \"\") }}" +
			"{% else %}{{ config_get(\"user.user-data\", properties.default) }}{% endif %}\n"},
	{"/var/lib/cloud/seed/nocloud-net/vendor-data", "cloud-init-vendor-data.tpl", []string{"create", "copy"},
		map[string]string{"default": "#cloud-config\n{}"},
		"{% if config_get(\"cloud-init.vendor-data\", \"\") != \"\" %}{{ config_get(\"cloud-init.vendor-data\", \"\") }}" +
			"{% else %}{{ config_get(\"user.vendor-data\", properties.default) }}{% endif %}\n"},
	{"/var/lib/cloud/seed/nocloud-net/network-config", "cloud-init-network-config.tpl", []string{"create", "copy"}, nil,
		"{% if config_get(\"cloud-init.network-config\", \"\") != \"\" %}{{ config_get(\"cloud-init.network-config\", \"\") }}" +
			"{% else %}version: 1\nconfig:\n  - type: physical\n" +
			"    name: {% if instance.type == \"virtual-machine\" %}enp5s0{% else %}eth0{% endif %}\n" +
			"    subnets:\n      - type: dhcp\n        control: auto{% endif %}\n"},
	{"/etc/hostname", "hostname.tpl", []string{"create", "copy"}, nil, "{{ instance.name }}\n"},
	{"/etc/hosts", "hosts.tpl", []string{"create", "copy"}, nil,
		"127.0.0.1\tlocalhost\n127.0.1.1\t{{ instance.name }}\n\n::1\tlocalhost ip6-localhost ip6-loopback\nff02::1\tip6-allnodes\nff02::2\tip6-allrouters\n"},
	// A clone must not share its source's machine id: empty it so systemd makes a new one.
	{"/etc/machine-id", "machine-id.tpl", []string{"create", "copy"}, nil, ""},
}

// epoch is the creation date stamped into metadata.yaml, so that a recipe builds the same
// metadata every time.
var epoch = time.Unix(1700000000, 0).UTC()

// metadataYAML renders the image's metadata.yaml.
func metadataYAML(r Recipe, hash string) string {
	var b strings.Builder
	fmt.Fprintf(&b, "architecture: %s\ncreation_date: %d\n", incusArch(r.Arch), epoch.Unix())
	fmt.Fprintf(&b, "properties:\n  os: debian\n  release: %s\n  variant: cloud\n  architecture: %s\n", r.Suite, r.Arch)
	fmt.Fprintf(&b, "  description: claudebox test image, Debian %s with cloud-init (recipe %s)\n", r.Suite, hash[:12])
	fmt.Fprintf(&b, "  claudebox.recipe: %s\n", hash)
	b.WriteString("templates:\n")
	for _, t := range incusTemplates {
		fmt.Fprintf(&b, "  %s:\n    when: [%s]\n    create_only: false\n    template: %s\n", t.target, strings.Join(t.when, ", "), t.name)
		if len(t.properties) > 0 {
			b.WriteString("    properties:\n")
			keys := make([]string, 0, len(t.properties))
			for k := range t.properties {
				keys = append(keys, k)
			}
			sort.Strings(keys)
			for _, k := range keys {
				fmt.Fprintf(&b, "      %s: %q\n", k, t.properties[k])
			}
		}
	}
	return b.String()
}

// Build builds the unified image tarball of r into out (gzip), as root. It runs debootstrap
// (minbase + r.Packages) from r.Mirror, writes the image's files and Incus templates, and
// packs metadata.yaml, templates/ and rootfs/. The work directory sits next to out and is
// removed afterwards; out appears atomically.
func Build(ctx context.Context, r Recipe, out string, log io.Writer) error {
	if log == nil {
		log = io.Discard
	}
	if os.Geteuid() != 0 {
		return fmt.Errorf("cloudimage: building the image needs root (debootstrap)")
	}
	if err := CheckRequirements(); err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(out), 0o755); err != nil {
		return fmt.Errorf("cloudimage: %w", err)
	}
	work, err := os.MkdirTemp(filepath.Dir(out), ".build-")
	if err != nil {
		return fmt.Errorf("cloudimage: %w", err)
	}
	rootfs := filepath.Join(work, "rootfs")
	defer func() {
		// debootstrap mounts proc and sys inside the rootfs while configuring; never
		// RemoveAll through a live mount.
		if err := unmountUnder(work); err != nil {
			fmt.Fprintf(log, "cloudimage: leaving %s in place: %v\n", work, err)
			return
		}
		_ = os.RemoveAll(work)
	}()

	hash := r.Hash()
	fmt.Fprintf(log, "cloudimage: debootstrap %s (%s) from %s\n", r.Suite, r.Arch, r.Mirror)
	t0 := time.Now()
	args := []string{"--variant=minbase", "--arch=" + r.Arch, "--components=main",
		"--include=" + strings.Join(r.Packages, ","), r.Suite, rootfs, r.Mirror}
	cmd := exec.CommandContext(ctx, "debootstrap", args...)
	var dbOut bytes.Buffer
	cmd.Stdout = io.MultiWriter(&dbOut, log)
	cmd.Stderr = cmd.Stdout
	if err := cmd.Run(); err != nil {
		detail := tailLines(dbOut.String(), 15)
		if b, rerr := os.ReadFile(filepath.Join(rootfs, "debootstrap", "debootstrap.log")); rerr == nil {
			detail += "\n--- debootstrap.log (tail) ---\n" + tailLines(string(b), 30)
		}
		return fmt.Errorf("cloudimage: debootstrap failed: %w\n%s", err, detail)
	}
	fmt.Fprintf(log, "cloudimage: debootstrap took %s\n", time.Since(t0).Round(time.Second))
	if err := unmountUnder(rootfs); err != nil {
		return err
	}

	if err := configure(rootfs); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(work, "metadata.yaml"), []byte(metadataYAML(r, hash)), 0o644); err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Join(work, "templates"), 0o755); err != nil {
		return err
	}
	for _, t := range incusTemplates {
		if err := os.WriteFile(filepath.Join(work, "templates", t.name), []byte(t.content), 0o644); err != nil {
			return err
		}
	}

	t1 := time.Now()
	tmp := out + ".tmp"
	tarCmd := exec.CommandContext(ctx, "tar", "--numeric-owner", "--xattrs", "--xattrs-include=security.capability",
		"-I", compressor(), "-C", work, "-cf", tmp, "metadata.yaml", "templates", "rootfs")
	if b, err := tarCmd.CombinedOutput(); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("cloudimage: packing the image: %w\n%s", err, b)
	}
	if err := os.Rename(tmp, out); err != nil {
		return fmt.Errorf("cloudimage: %w", err)
	}
	if st, err := os.Stat(out); err == nil {
		fmt.Fprintf(log, "cloudimage: packed %s (%d MiB) in %s\n", out, st.Size()>>20, time.Since(t1).Round(time.Second))
	}
	return nil
}

// compressor returns the gzip program tar should use: pigz when present (parallel), else
// gzip; both at a fast level, since the tarball only travels from disk to the local daemon.
func compressor() string {
	if _, err := exec.LookPath("pigz"); err == nil {
		return "pigz -3"
	}
	return "gzip -3"
}

// configure writes the image's own files into rootfs and drops what must not ship.
func configure(rootfs string) error {
	for _, f := range rootfsFiles {
		p := filepath.Join(rootfs, f.path)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			return err
		}
		_ = os.Remove(p) // may be a symlink (resolv.conf) or read-only (machine-id)
		if err := os.WriteFile(p, []byte(f.content), f.mode); err != nil {
			return fmt.Errorf("cloudimage: writing %s: %w", f.path, err)
		}
		if err := os.Chmod(p, f.mode); err != nil {
			return err
		}
	}
	// dbus keeps its own copy of the machine id; point it at systemd's.
	dbusID := filepath.Join(rootfs, "var/lib/dbus/machine-id")
	_ = os.Remove(dbusID)
	if err := os.Symlink("/etc/machine-id", dbusID); err != nil && !os.IsExist(err) {
		return err
	}
	// Package caches and lists: cloud-init's package_update fetches fresh lists anyway.
	for _, glob := range []string{"var/cache/apt/archives/*.deb", "var/cache/apt/*.bin", "var/lib/apt/lists/*_*", "var/log/*.log"} {
		m, _ := filepath.Glob(filepath.Join(rootfs, glob))
		for _, p := range m {
			_ = os.Remove(p)
		}
	}
	return nil
}

// unmountUnder lazily unmounts every mount point at or below dir, deepest first, and fails
// if any remains.
func unmountUnder(dir string) error {
	dir, err := filepath.Abs(dir)
	if err != nil {
		return err
	}
	for _, m := range mounts.Under(dir) {
		_ = syscall.Unmount(m, syscall.MNT_DETACH)
	}
	if left := mounts.Under(dir); len(left) > 0 {
		return fmt.Errorf("cloudimage: could not unmount %s", strings.Join(left, ", "))
	}
	return nil
}

// tailLines returns the last n lines of s.
func tailLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
