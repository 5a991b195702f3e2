package cli

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/claudebox/claudebox/boxcore"
	"github.com/claudebox/claudebox/boxcore/incus"
	"github.com/claudebox/claudebox/internal/cloudimage"
	"github.com/claudebox/claudebox/internal/testenv"
	"github.com/claudebox/claudebox/internal/teststack"
)

// privileged rewrites an export's backup/container/backup.yaml to ask for a privileged
// container (a plain text edit: the key goes right under the instance's config).
func privileged(t *testing.T, in, out string) {
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
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	tr := tar.NewReader(zr)
	done := false
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(tr)
		if h.Name == "backup/container/backup.yaml" {
			body = bytes.Replace(body, []byte("container:\n  architecture: x86_64\n  config:\n"), []byte("container:\n  architecture: x86_64\n  config:\n    security.privileged: \"true\"\n"), 1)
			done = bytes.Contains(body, []byte("security.privileged"))
			h.Size = int64(len(body))
		}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if _, err := tw.Write(body); err != nil {
			t.Fatal(err)
		}
	}
	if !done {
		t.Fatal("could not tamper the export's backup.yaml")
	}
	_ = tw.Close()
	if err := os.WriteFile(out, buf.Bytes(), 0o600); err != nil {
		t.Fatal(err)
	}
}

// export and import through the command line: unknown and untagged boxes, an existing file,
// stdout and stdin, a name taken, a tampered file (exit 2, nothing changed).
func TestExportImportVerbs(t *testing.T) {
	c := testenv.RequireIncus(t)
	ctx := context.Background()
	h := &harness{t: t, c: c, stack: teststack.New(t, c, "xport"), image: teststack.ProbeImage(t, c)}
	a, b, d := h.name("xa"), h.name("xb"), h.name("xd")
	dir := t.TempDir()
	file := filepath.Join(dir, "a.tar.gz")

	if r := h.newBox(a); r.code != 0 {
		t.Fatalf("new: %d %s", r.code, r.stderr)
	}
	h.tagForSweep(a)

	// Not a box: missing, or an instance claudebox did not mint.
	h.unchanged(2, "no such box", "export", h.name("nosuch"), file)
	plain := h.name("plain")
	h.removeLater(plain)
	if err := c.CreateInstance(ctx, incus.InstancesPost{Name: plain, Type: "container", Config: teststack.Tag(),
		Devices: testenv.RootDisk(t, c), Source: incus.InstanceSource{Type: "image", Alias: h.image}}, nil); err != nil {
		t.Fatal(err)
	}
	h.unchanged(2, "no such box: "+plain, "export", plain, file)
	if _, err := os.Stat(file); !os.IsNotExist(err) {
		t.Fatalf("a refused export wrote %s (%v)", file, err)
	}

	start := time.Now()
	h.expect(0, "exported "+a, "export", a, file)
	t.Logf("measured: export via the CLI %.2fs", time.Since(start).Seconds())
	if st, err := os.Stat(file); err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("exported file: %v %v", st, err)
	}
	h.unchanged(2, "already exists", "export", a, file)
	h.expect(0, "exported "+a, "export", a, file, "--overwrite")
	r := h.run("export", a, "-")
	if r.code != 0 || !strings.HasPrefix(r.stdout, "\x1f\x8b") {
		t.Fatalf("export to stdout: exit %d, %d bytes, stderr %s", r.code, len(r.stdout), r.stderr)
	}

	// Import: a name taken, a bad name, a missing file, a tampered file: exit 2, nothing changed.
	h.unchanged(2, "already exists", "import", file, "--name", a)
	h.unchanged(2, "invalid box name", "import", file, "--name", "-bad")
	h.unchanged(2, "no file", "import", filepath.Join(dir, "nosuch.tar.gz"), "--name", b)
	bad := filepath.Join(dir, "privileged.tar")
	privileged(t, file, bad)
	h.unchanged(2, "security.privileged=true", "import", bad, "--name", b)
	h.gone(b, "a refused import")

	start = time.Now()
	h.expect(0, b+" is ready", "import", file, "--name", b)
	t.Logf("measured: import via the CLI %.2fs", time.Since(start).Seconds())
	h.tagForSweep(b)
	in, _, err := c.Instance(ctx, b)
	if err != nil || in.Config[boxcore.TagOrigin] != boxcore.OriginImport || in.Config[boxcore.TagFrom] != a || in.Status != "Running" {
		t.Fatalf("imported %s: %v %v", b, in.Config, err)
	}
	h.expect(0, b, "list")

	// From stdin (the stdout export above), under another name.
	if r := h.runIn(r.stdout, "import", "-", "--name", d); r.code != 0 || !strings.Contains(r.stdout, d+" is ready") {
		t.Fatalf("import from stdin: exit %d\n%s\n%s", r.code, r.stdout, r.stderr)
	}
	h.tagForSweep(d)
}

// A box of the test cloud image (systemd, cloud-init) comes back with a machine-id systemd
// made anew, a new MAC and its own lease, its files intact.
func TestImportCloudBox(t *testing.T) {
	c := testenv.RequireIncus(t)
	ctx := context.Background()
	img, err := cloudimage.Ensure(ctx, c, cloudimage.Default(), testLog{t})
	if err != nil {
		t.Fatalf("cloud image: %v", err)
	}
	h := &harness{t: t, c: c, stack: teststack.New(t, c, "ycloud"), image: img.Alias}
	a, b := h.name("ya"), h.name("yb")
	h.removeLater(a)
	h.removeLater(b)
	if r := h.run("new", "--name", a, "--container", "--image", img.Alias, "--template", "blank"); r.code != 0 {
		t.Fatalf("new: exit %d\n%s\n%s", r.code, r.stdout, r.stderr)
	}
	h.tagForSweep(a)
	h.expect(0, "", "exec", a, "--user", "root", "--", "sh", "-c", "echo kept > /root/kept")
	srcID := strings.TrimSpace(h.expect(0, "", "exec", a, "--user", "root", "--", "cat", "/etc/machine-id").stdout)
	src, _, err := c.Instance(ctx, a)
	if err != nil {
		t.Fatal(err)
	}
	file := filepath.Join(t.TempDir(), "a.tar.gz")
	start := time.Now()
	h.expect(0, "exported", "export", a, file)
	st, _ := os.Stat(file)
	t.Logf("measured: export of a cloud-image box %.2fs (%d bytes)", time.Since(start).Seconds(), st.Size())
	start = time.Now()
	r := h.expect(0, b+" is ready", "import", file, "--name", b)
	t.Logf("measured: import of a cloud-image box %.2fs: %s", time.Since(start).Seconds(), strings.TrimSpace(r.stderr))
	h.tagForSweep(b)

	h.expect(0, "kept", "exec", b, "--user", "root", "--", "cat", "/root/kept")
	id := strings.TrimSpace(h.expect(0, "", "exec", b, "--user", "root", "--", "cat", "/etc/machine-id").stdout)
	if len(srcID) != 32 || len(id) != 32 || id == srcID {
		t.Errorf("machine-id %q, source's %q: want a new one", id, srcID)
	}
	dst, _, err := c.Instance(ctx, b)
	if err != nil {
		t.Fatal(err)
	}
	if m, sm := dst.Config["volatile.eth0.hwaddr"], src.Config["volatile.eth0.hwaddr"]; m == "" || m == sm {
		t.Errorf("MAC %q, source's %q: want a new one", m, sm)
	}
	sa, da := leaseOf(t, c, a), leaseOf(t, c, b)
	if da == "" || da == sa {
		t.Errorf("imported box's IPv4 %q, source's %q: want a lease of its own", da, sa)
	}
}

// leaseOf waits for a box's eth0 IPv4 address.
func leaseOf(t *testing.T, c *incus.Client, box string) string {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(500 * time.Millisecond) {
		st, err := c.InstanceState(context.Background(), box)
		if err != nil {
			continue
		}
		for _, a := range st.Network["eth0"].Addresses {
			if a.Family == "inet" {
				return a.Address
			}
		}
	}
	return ""
}

// An interrupted export leaves no file (not even a partial one) and no backup on the daemon;
// an interrupted import leaves no instance. Either exits 130, or 0 when it finished first.
func TestExportImportInterrupted(t *testing.T) {
	c := testenv.RequireIncus(t)
	ctx := context.Background()
	h := &harness{t: t, c: c, stack: teststack.New(t, c, "zint"), image: teststack.ProbeImage(t, c)}
	a := h.name("za")
	dir := t.TempDir()
	if r := h.newBox(a); r.code != 0 {
		t.Fatalf("new: %d %s", r.code, r.stderr)
	}
	h.tagForSweep(a)
	file := filepath.Join(dir, "a.tar.gz")
	h.expect(0, "exported", "export", a, file)

	for i, d := range []time.Duration{100 * time.Millisecond, 300 * time.Millisecond, 600 * time.Millisecond, 1200 * time.Millisecond} {
		out := filepath.Join(dir, fmt.Sprintf("int%d.tar.gz", i))
		r := h.runSignalled(syscall.SIGINT, d, "export", a, out)
		t.Logf("export, SIGINT at %v: exit %d: %s", d, r.code, strings.TrimSpace(r.stderr))
		_, err := os.Stat(out)
		switch r.code {
		case 0:
			if err != nil {
				t.Errorf("export exited 0 without the file: %v", err)
			}
		case 130:
			if err == nil {
				t.Errorf("an interrupted export left %s", out)
			}
		default:
			t.Fatalf("export, SIGINT at %v: exit %d\n%s", d, r.code, r.stderr)
		}
		if left, _ := filepath.Glob(filepath.Join(dir, ".*partial*")); len(left) > 0 {
			t.Errorf("an interrupted export left %v", left)
		}
		if bks, err := c.Backups(ctx, a); err != nil || len(bks) != 0 {
			t.Errorf("an interrupted export left backups %v (%v)", bks, err)
		}

		name := h.name(fmt.Sprintf("zi%d", i))
		h.removeLater(name)
		r = h.runSignalled(syscall.SIGINT, d, "import", file, "--name", name)
		t.Logf("import, SIGINT at %v: exit %d: %s", d, r.code, strings.TrimSpace(r.stderr))
		switch r.code {
		case 0:
			h.tagForSweep(name)
			h.expect(0, "", "rm", name, "--force")
		case 130:
			h.gone(name, fmt.Sprintf("import interrupted at %v", d))
			time.Sleep(300 * time.Millisecond)
			h.gone(name, fmt.Sprintf("import interrupted at %v (300 ms later)", d))
		default:
			t.Fatalf("import, SIGINT at %v: exit %d\n%s", d, r.code, r.stderr)
		}
	}
}
