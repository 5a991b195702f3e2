package boxcore_test

import (
	"archive/tar"
	"compress/gzip"
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"gopkg.in/yaml.v3"

	"github.com/claudebox/claudebox/boxcore"
	"github.com/claudebox/claudebox/boxcore/incus"
	"github.com/claudebox/claudebox/internal/testenv"
	"github.com/claudebox/claudebox/internal/teststack"
)

// tamper copies an export, passing every entry through edit: it gets the entry's header and
// content, and returns the entries to write instead (none drops it).
func tamper(t *testing.T, in, out string, edit func(h *tar.Header, body []byte) []tarEntry) {
	t.Helper()
	f, err := os.Open(in)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	zr, err := gzip.NewReader(f)
	if err != nil {
		t.Fatal(err)
	}
	tr := tar.NewReader(zr)
	o, err := os.Create(out)
	if err != nil {
		t.Fatal(err)
	}
	defer o.Close()
	zw := gzip.NewWriter(o)
	tw := tar.NewWriter(zw)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		body, err := io.ReadAll(tr)
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range edit(h, body) {
			e.h.Size = int64(len(e.body))
			if err := tw.WriteHeader(e.h); err != nil {
				t.Fatal(err)
			}
			if _, err := tw.Write(e.body); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	if err := zw.Close(); err != nil {
		t.Fatal(err)
	}
}

func copyFile(t *testing.T, from, to string) {
	t.Helper()
	b, err := os.ReadFile(from)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(to, b, 0o600); err != nil {
		t.Fatal(err)
	}
}

type tarEntry struct {
	h    *tar.Header
	body []byte
}

// editYAML changes one config file of an export (as generic YAML) and keeps every other entry.
func editYAML(t *testing.T, in, out, file string, edit func(doc map[string]any)) {
	t.Helper()
	found := false
	tamper(t, in, out, func(h *tar.Header, body []byte) []tarEntry {
		if h.Name != file {
			return []tarEntry{{h, body}}
		}
		found = true
		var doc map[string]any
		if err := yaml.Unmarshal(body, &doc); err != nil {
			t.Fatal(err)
		}
		edit(doc)
		b, err := yaml.Marshal(doc)
		if err != nil {
			t.Fatal(err)
		}
		return []tarEntry{{h, b}}
	})
	if !found {
		t.Fatalf("no %s in the export", file)
	}
}

func sub(m map[string]any, keys ...string) map[string]any {
	for _, k := range keys {
		m = m[k].(map[string]any)
	}
	return m
}

func firstSnapshot(m map[string]any) map[string]any {
	return m["snapshots"].([]any)[0].(map[string]any)
}

func pull(t *testing.T, c *incus.Client, box, path string) string {
	t.Helper()
	b, err := c.PullFile(context.Background(), box, path)
	if err != nil {
		t.Fatalf("reading %s in %s: %v", path, box, err)
	}
	return string(b)
}

// A box with a snapshot goes to one file and comes back as a new box: its files and its
// snapshot survive, it is tagged (origin import), on the stack's profile with the stack's NIC
// under its own port name, with a new MAC and a new machine-id, and its port is bound and
// pinned like a new box's. Tampered files — a privileged instance in the backup.yaml the
// daemon reads, a host disk in a snapshot, a raw.lxc key only in the index, a path through a
// symlink — are refused with nothing created, as is a name already taken.
// machineIDPattern: what systemd writes to /etc/machine-id, and what a clone or import gets.
var machineIDPattern = regexp.MustCompile(`^[0-9a-f]{32}$`)

func TestExportImport(t *testing.T) {
	c := testenv.RequireIncus(t)
	ctx := context.Background()
	s := teststack.New(t, c, "export")
	bs := &boxcore.Boxes{Client: c, Stack: s, Version: "test"}
	img := teststack.ProbeImage(t, c)
	name := func(suffix string) string { return "cbt-exp-" + testenv.RunID() + "-" + suffix }
	src, dst := name("a"), name("b")
	dir := t.TempDir()

	if _, err := bs.New(ctx, boxcore.NewOptions{Name: src, Image: img, Config: teststack.Tag()}); err != nil {
		t.Fatalf("new %s: %v", src, err)
	}
	const oldID = "0123456789abcdef0123456789abcdef\n"
	for path, content := range map[string]string{"/etc/machine-id": oldID, "/root/marker": "before the snapshot"} {
		if err := c.PushFile(ctx, src, path, strings.NewReader(content), 0o644, 0, 0); err != nil {
			t.Fatal(err)
		}
	}
	b, err := boxcore.Resolve(ctx, c, src)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := bs.Snapshot(ctx, b, "s1"); err != nil {
		t.Fatal(err)
	}
	if err := c.PushFile(ctx, src, "/root/marker", strings.NewReader("after the snapshot"), 0o644, 0, 0); err != nil {
		t.Fatal(err)
	}
	srcIn, _, err := c.Instance(ctx, src)
	if err != nil {
		t.Fatal(err)
	}
	srcMAC := srcIn.Config["volatile.eth0.hwaddr"]
	if srcMAC == "" {
		t.Fatalf("%s has no volatile.eth0.hwaddr: %v", src, srcIn.Config)
	}

	// Export: the file whole, mode 0600; an existing file is refused.
	file := filepath.Join(dir, src+".tar.gz")
	t0 := time.Now()
	n, err := bs.ExportFile(ctx, b, file, false)
	if err != nil {
		t.Fatalf("export: %v", err)
	}
	t.Logf("measured: export of %s (running, 1 snapshot) %.2fs, %d bytes", src, time.Since(t0).Seconds(), n)
	st, err := os.Stat(file)
	if err != nil || st.Size() != n || st.Mode().Perm() != 0o600 {
		t.Fatalf("exported file: %v, size %d (wrote %d), mode %v", err, st.Size(), n, st.Mode())
	}
	if _, err := bs.ExportFile(ctx, b, file, false); !boxcore.IsUsage(err) {
		t.Fatalf("export over an existing file: %v, want a usage error", err)
	}
	if left, _ := filepath.Glob(filepath.Join(dir, ".*partial*")); len(left) > 0 {
		t.Fatalf("export left temporary files: %v", left)
	}
	if bks, err := c.Backups(ctx, src); err != nil || len(bks) != 0 {
		t.Fatalf("export left backups on the daemon: %v %v", bks, err)
	}

	// Tampered files: refused before the daemon sees them, nothing created.
	refused := func(what, f string, want string) {
		t.Helper()
		_, err := bs.Import(ctx, f, boxcore.ImportOptions{Name: dst, Config: teststack.Tag()})
		if !boxcore.IsUsage(err) || !strings.Contains(err.Error(), want) {
			t.Errorf("import of %s: %v, want a usage error naming %q", what, err, want)
		} else {
			t.Logf("import of %s refused: %v", what, err)
		}
		if _, _, err := c.Instance(ctx, dst); !errors.Is(err, incus.ErrNotFound) {
			t.Fatalf("import of %s left instance %s (%v)", what, dst, err)
		}
	}
	priv := filepath.Join(dir, "privileged.tar.gz")
	editYAML(t, file, priv, "backup/container/backup.yaml", func(d map[string]any) {
		sub(d, "container", "config")["security.privileged"] = "true"
	})
	refused("a privileged instance in backup/container/backup.yaml", priv, "security.privileged=true")
	hostDisk := filepath.Join(dir, "hostdisk.tar.gz")
	editYAML(t, file, hostDisk, "backup/container/backup.yaml", func(d map[string]any) {
		firstSnapshot(d)["devices"].(map[string]any)["hostetc"] = map[string]any{"type": "disk", "source": "/etc", "path": "/mnt/etc"}
	})
	refused("a host disk in a snapshot", hostDisk, "mounting the host's /etc")
	rawIdx := filepath.Join(dir, "raw-index.tar.gz")
	editYAML(t, file, rawIdx, "backup/index.yaml", func(d map[string]any) {
		firstSnapshot(sub(d, "config"))["config"].(map[string]any)["raw.lxc"] = "lxc.apparmor.profile=unconfined"
	})
	refused("raw.lxc in the index's snapshot", rawIdx, "raw.lxc")
	link := filepath.Join(dir, "symlink.tar.gz")
	tamper(t, file, link, func(h *tar.Header, body []byte) []tarEntry {
		if h.Name != "backup/container/rootfs/root/marker" {
			return []tarEntry{{h, body}}
		}
		l := &tar.Header{Name: "backup/container/rootfs/root/etc", Typeflag: tar.TypeSymlink, Linkname: "/etc", Mode: 0o777}
		x := &tar.Header{Name: "backup/container/rootfs/root/etc/cron.d/evil", Typeflag: tar.TypeReg, Mode: 0o644}
		return []tarEntry{{h, body}, {l, nil}, {x, []byte("* * * * * root touch /tmp/pwned\n")}}
	})
	refused("a file through a symlink", link, "inside symlink")

	// More tamperings, each refused by its own check before the daemon sees the file.
	entryCases := []struct {
		what, want string
		edit       func(h *tar.Header, body []byte) []tarEntry
	}{
		{"an entry outside the backup", "no part of an instance backup", func(h *tar.Header, body []byte) []tarEntry {
			if h.Name != "backup/index.yaml" {
				return []tarEntry{{h, body}}
			}
			return []tarEntry{{h, body}, {&tar.Header{Name: "etc/cron.d/evil", Typeflag: tar.TypeReg, Mode: 0o644}, []byte("x")}}
		}},
		{"a path with ..", "not a plain path", func(h *tar.Header, body []byte) []tarEntry {
			if h.Name != "backup/index.yaml" {
				return []tarEntry{{h, body}}
			}
			return []tarEntry{{h, body}, {&tar.Header{Name: "backup/container/../../evil", Typeflag: tar.TypeReg, Mode: 0o644}, []byte("x")}}
		}},
		{"a device node", "a device node", func(h *tar.Header, body []byte) []tarEntry {
			if h.Name != "backup/container/rootfs/root/marker" {
				return []tarEntry{{h, body}}
			}
			return []tarEntry{{h, body}, {&tar.Header{Name: "backup/container/rootfs/root/sda", Typeflag: tar.TypeBlock, Devmajor: 8, Mode: 0o666}, nil}}
		}},
		{"a hard link out of the backup", "a hard link to", func(h *tar.Header, body []byte) []tarEntry {
			if h.Name != "backup/container/rootfs/root/marker" {
				return []tarEntry{{h, body}}
			}
			return []tarEntry{{h, body}, {&tar.Header{Name: "backup/container/rootfs/root/shadow", Typeflag: tar.TypeLink, Linkname: "/etc/shadow"}, nil}}
		}},
		{"backup.yaml twice (the second privileged)", "twice in the file", func(h *tar.Header, body []byte) []tarEntry {
			if h.Name != "backup/container/backup.yaml" {
				return []tarEntry{{h, body}}
			}
			h2 := *h
			return []tarEntry{{h, body}, {&h2, []byte(strings.Replace(string(body), "  config:\n", "  config:\n    security.privileged: \"true\"\n", 1))}}
		}},
		{"a YAML alias", "anchors, aliases or merge keys", func(h *tar.Header, body []byte) []tarEntry {
			if h.Name != "backup/container/backup.yaml" {
				return []tarEntry{{h, body}}
			}
			return []tarEntry{{h, append(body, []byte("extra: &a {security.privileged: \"true\"}\nmore: *a\n")...)}}
		}},
	}
	for i, tc := range entryCases {
		f := filepath.Join(dir, "entry"+string(rune('a'+i))+".tar.gz")
		tamper(t, file, f, tc.edit)
		refused(tc.what, f, tc.want)
	}
	yamlCases := []struct {
		what, file, want string
		edit             func(d map[string]any)
	}{
		{"an optimized backup", "backup/index.yaml", "optimized", func(d map[string]any) { d["optimized"] = true }},
		{"a snapshot name with a slash", "backup/index.yaml", "no snapshot name", func(d map[string]any) { d["snapshots"] = []any{"../s1"} }},
		{"a stateful snapshot", "backup/container/backup.yaml", "stateful", func(d map[string]any) { firstSnapshot(d)["stateful"] = true }},
		{"a volume option", "backup/container/backup.yaml", "volume config security.shifted=true", func(d map[string]any) {
			sub(d, "volume")["config"] = map[string]any{"security.shifted": "true"}
		}},
		{"a NIC of its own in a snapshot", "backup/snapshots/s1/backup.yaml", "a NIC of its own", func(d map[string]any) {
			sub(d, "container", "devices")["eth1"] = map[string]any{"type": "nic", "nictype": "macvlan", "parent": "eth0"}
		}},
		{"a memory limit above the host's", "backup/index.yaml", "looser than claudebox sets", func(d map[string]any) {
			sub(d, "config", "container", "config")["limits.memory"] = "100TiB"
		}},
	}
	for i, tc := range yamlCases {
		f := filepath.Join(dir, "yaml"+string(rune('a'+i))+".tar.gz")
		editYAML(t, file, f, tc.file, tc.edit)
		refused(tc.what, f, tc.want)
	}

	// A file changed between its judgement and its upload: the upload judges it again and
	// is cut off, nothing created.
	swapped := filepath.Join(dir, "swapped.tar.gz")
	copyFile(t, file, swapped)
	_, err = bs.Import(ctx, swapped, boxcore.ImportOptions{Name: dst, Config: teststack.Tag(), AfterCheck: func() { copyFile(t, priv, swapped) }})
	if err == nil || !strings.Contains(err.Error(), "changed after it was checked") {
		t.Errorf("import of a file swapped after its check: %v", err)
	} else {
		t.Logf("import of a file swapped after its check: %v", err)
	}
	if _, _, err := c.Instance(ctx, dst); !errors.Is(err, incus.ErrNotFound) {
		t.Fatalf("import of a swapped file left instance %s (%v)", dst, err)
	}

	// A name already taken: refused, the box untouched.
	if _, err := bs.Import(ctx, file, boxcore.ImportOptions{Name: src, Config: teststack.Tag()}); !boxcore.IsUsage(err) || !strings.Contains(err.Error(), "already exists") {
		t.Errorf("import onto an existing name: %v", err)
	}
	if got := pull(t, c, src, "/root/marker"); got != "after the snapshot" {
		t.Errorf("%s changed by a refused import: marker %q", src, got)
	}

	// The round trip.
	t1 := time.Now()
	tm := &boxcore.ImportTimings{}
	nb, err := bs.Import(ctx, file, boxcore.ImportOptions{Name: dst, Config: teststack.Tag(), Timings: tm})
	if err != nil {
		t.Fatalf("import: %v", err)
	}
	t.Logf("measured: import %.2fs (check %.2fs, upload+unpack %.2fs, start+bind %.2fs)", time.Since(t1).Seconds(), tm.Check.Seconds(), tm.Upload.Seconds(), tm.Start.Seconds())
	got, err := boxcore.Resolve(ctx, c, dst)
	if err != nil {
		t.Fatalf("the imported box is no box: %v", err)
	}
	in := got.Instance
	if nb.Name != dst || in.Status != "Running" {
		t.Errorf("imported %s status %s, want %s running", nb.Name, in.Status, dst)
	}
	for k, want := range map[string]string{boxcore.TagOrigin: boxcore.OriginImport, boxcore.TagFrom: src, boxcore.TagVersion: "test", testenv.TagKey: testenv.RunID()} {
		if in.Config[k] != want {
			t.Errorf("%s=%q, want %q", k, in.Config[k], want)
		}
	}
	if _, minting := in.Config["user.claudebox.mint"]; minting {
		t.Errorf("the imported box still carries the mint marker")
	}
	if len(in.Profiles) != 1 || in.Profiles[0] != s.Profile {
		t.Errorf("profiles %v, want exactly [%s]", in.Profiles, s.Profile)
	}
	if !boxcore.IsBoxNIC(in.Devices["eth0"], s, dst) {
		t.Errorf("eth0 %v, want the stack's NIC with %s's port name %s", in.Devices["eth0"], dst, boxcore.HostName(dst))
	}
	if off := boxcore.OffBoundary(in.Config, in.Devices, s); len(off) > 0 {
		t.Errorf("the imported box is off the boundary: %v", off)
	}
	if mac := in.Config["volatile.eth0.hwaddr"]; mac == "" || mac == srcMAC {
		t.Errorf("MAC %q, want a new one (the source's is %s)", mac, srcMAC)
	}
	if id := strings.TrimSpace(pull(t, c, dst, "/etc/machine-id")); !machineIDPattern.MatchString(id) || id == strings.TrimSpace(oldID) {
		t.Errorf("machine-id %q, want a new one of 32 hex digits (the source's is %q)", id, oldID)
	}
	if m := pull(t, c, dst, "/root/marker"); m != "after the snapshot" {
		t.Errorf("marker %q in the imported box", m)
	}
	rep, err := boxcore.NewHost(c, s).Check(ctx)
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]int{}
	for _, r := range rep.Rows {
		if (r.Layer == "port binding" || r.Layer == "fdb pin") && strings.Contains(r.Item, dst) {
			seen[r.Layer]++
			if !r.OK {
				t.Errorf("%s %s: %s, want %s", r.Layer, r.Item, r.Actual, r.Expected)
			}
		}
	}
	if seen["port binding"] == 0 || seen["fdb pin"] == 0 {
		t.Errorf("host check has no port binding / fdb pin rows for %s: %v", dst, seen)
	}

	// The snapshot came along, carries the import's tags and no MAC of the source's.
	snap, err := bs.FindSnapshot(ctx, got, "s1")
	if err != nil {
		t.Fatalf("snapshot s1 lost: %v", err)
	}
	if snap.Config[boxcore.TagOrigin] != boxcore.OriginImport || snap.Config["volatile.eth0.hwaddr"] == srcMAC {
		t.Errorf("snapshot config %v", snap.Config)
	}
	if err := bs.Restore(ctx, got, "s1"); err != nil {
		t.Fatalf("restore of the imported snapshot: %v", err)
	}
	if m := pull(t, c, dst, "/root/marker"); m != "before the snapshot" {
		t.Errorf("marker after restoring s1: %q", m)
	}
	after, _, err := c.Instance(ctx, dst)
	if err != nil {
		t.Fatal(err)
	}
	if !boxcore.IsBox(after) || after.Config["volatile.eth0.hwaddr"] == srcMAC || !boxcore.IsBoxNIC(after.Devices["eth0"], s, dst) {
		t.Errorf("after restore: tag %q, MAC %q (source %s), eth0 %v", after.Config[boxcore.TagKey], after.Config["volatile.eth0.hwaddr"], srcMAC, after.Devices["eth0"])
	}

	// The same file onto another pool (the test stacks' pool is "default", a dir pool; the
	// product's is the btrfs pool claudebox): the root disk moves with it.
	pools, err := c.StoragePools(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range pools {
		if p.Name == s.Pool || p.Driver != "btrfs" {
			continue
		}
		other := s
		other.Pool = p.Name
		ob := &boxcore.Boxes{Client: c, Stack: other, Version: "test"}
		third := name("c")
		t2 := time.Now()
		if _, err := ob.Import(ctx, file, boxcore.ImportOptions{Name: third, Config: teststack.Tag()}); err != nil {
			t.Fatalf("import onto pool %s: %v", p.Name, err)
		}
		t.Logf("measured: import onto the %s pool %s %.2fs", p.Driver, p.Name, time.Since(t2).Seconds())
		in, _, err := c.Instance(ctx, third)
		if err != nil || in.Devices["root"]["pool"] != p.Name || in.Status != "Running" {
			t.Errorf("imported onto %s: root %v, status %s (%v)", p.Name, in.Devices["root"], in.Status, err)
		}
		if m := pull(t, c, third, "/root/marker"); m != "after the snapshot" {
			t.Errorf("marker %q in the box imported onto %s", m, p.Name)
		}
		break
	}
}
