package cli

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/claudebox/claudebox/boxcore"
	"github.com/claudebox/claudebox/boxcore/templates"
	"github.com/claudebox/claudebox/internal/cloudimage"
	"github.com/claudebox/claudebox/internal/testenv"
	"github.com/claudebox/claudebox/internal/teststack"
)

// TestDockerInBox: a box of the docker template runs Docker for user claude — an image built
// inside the box from a local file (no registry), run, its container on Docker's own bridge
// reaching the box's resolver. The box carries the template's nesting and nothing else of
// the kind; a claude box has none of it. The drill's nested rows prove the isolation claims
// from such a container.
func TestDockerInBox(t *testing.T) {
	c := testenv.RequireIncus(t)
	ctx := context.Background()
	img, err := cloudimage.Ensure(ctx, c, cloudimage.Default(), testLog{t})
	if err != nil {
		t.Fatalf("cloud image: %v", err)
	}
	// On the product's btrfs pool, with the seccomp rule every box gets: there Docker's own
	// btrfs driver cannot make its subvolumes (the attacker found every docker run failing on
	// it; the test stacks' dir pool hid it).
	pool, _, err := c.StoragePool(ctx, boxcore.PoolName)
	if err != nil || pool.Driver != "btrfs" {
		t.Fatalf("the docker test runs on the btrfs pool %s that make setup makes: %+v %v", boxcore.PoolName, pool, err)
	}
	h := &harness{t: t, c: c, stack: teststack.NewOnPool(t, c, "docker", boxcore.PoolName), image: img.Alias}
	box := h.name("dk")
	h.removeLater(box)
	start := time.Now()
	if r := h.run("new", "--name", box, "--container", "--image", img.Alias, "--template", "docker"); r.code != 0 {
		t.Fatalf("new --template docker: exit %d\n%s\n%s", r.code, r.stdout, r.stderr)
	}
	h.tagForSweep(box)
	t.Logf("measured: new --template docker (cold, from the cloud image) %.1fs", time.Since(start).Seconds())

	in, _, err := c.Instance(ctx, box)
	if err != nil {
		t.Fatal(err)
	}
	dt, _ := templates.Get("docker")
	for k, v := range dt.ContainerConfig {
		if in.Config[k] != v {
			t.Errorf("the box lacks the template's %s=%s: %q", k, v, in.Config[k])
		}
	}
	if in.Config[boxcore.KeySyscallsDeny] != boxcore.SubvolumeDeny {
		t.Errorf("the box lacks the subvolume deny every container box gets")
	}
	if r := h.expect(0, "", "exec", box, "--", "docker", "info", "--format", "{{.Driver}}"); strings.TrimSpace(r.stdout) != "overlay2" {
		t.Errorf("docker's storage driver %q, want overlay2", r.stdout)
	}

	// The image: the claudebox binary (static) as the only file, built in the box.
	bin, err := os.ReadFile(teststack.Binary(t))
	if err != nil {
		t.Fatal(err)
	}
	dir := "/home/" + templates.User + "/img"
	h.expect(0, "", "exec", box, "--", "mkdir", "-p", dir)
	if err := c.PushFile(ctx, box, dir+"/cb", strings.NewReader(string(bin)), 0o755, templates.UserUID, templates.UserUID); err != nil {
		t.Fatal(err)
	}
	dockerfile := "FROM scratch\nCOPY cb /cb\nENTRYPOINT [\"/cb\"]\n"
	if err := c.PushFile(ctx, box, dir+"/Dockerfile", strings.NewReader(dockerfile), 0o644, templates.UserUID, templates.UserUID); err != nil {
		t.Fatal(err)
	}
	// As user claude (group docker), no sudo: claudebox exec gives the user its groups.
	if r := h.expect(0, "", "exec", box, "--", "id", "-Gn"); !strings.Contains(r.stdout, "docker") {
		t.Fatalf("claudebox exec as claude: groups %q lack docker", r.stdout)
	}
	h.expect(0, "", "exec", box, "--", "sh", "-c", "cd "+dir+" && DOCKER_BUILDKIT=0 docker build -q -t cbtest .")
	r := h.expect(0, "claudebox", "exec", box, "--", "docker", "run", "--rm", "cbtest", "version")
	t.Logf("docker run: %s", strings.TrimSpace(r.stdout))
	// Whiteouts: an image whose second layer deletes a file of the first (what most
	// registry images hold), loaded from a docker-archive and run; the file is gone.
	archive := whiteoutArchive(t, bin)
	if err := c.PushFile(ctx, box, dir+"/wh.tar", bytes.NewReader(archive), 0o644, templates.UserUID, templates.UserUID); err != nil {
		t.Fatal(err)
	}
	h.expect(0, "Loaded image", "exec", box, "--", "docker", "load", "-i", dir+"/wh.tar")
	h.expect(0, "", "exec", box, "--", "sh", "-c", "docker create --name whc cbwhiteout version >/dev/null")
	files := h.expect(0, "", "exec", box, "--", "sh", "-c", "docker export whc | tar -t; docker rm whc >/dev/null").stdout
	if !strings.Contains(files, "kept") || strings.Contains(files, "deleted") {
		t.Errorf("the whiteout layer did not apply: the container's files:\n%s", files)
	}
	// The container's network is Docker's bridge inside the box: it reaches the box's
	// resolver (the gateway's DNS, which answers NXDOMAIN for a name under .invalid).
	gw := strings.TrimSpace(h.expect(0, "", "exec", box, "--", "sh", "-c", "ip -4 route show default | cut -d' ' -f3").stdout)
	spec := `{"kind":"dns","dns":{"server":"` + gw + `","name":"claudebox-test.invalid","type":"A"},"timeout":"3s"}`
	r = h.expect(0, "", "exec", box, "--", "docker", "run", "--rm", "cbtest", "probe", "run", spec)
	if !strings.Contains(r.stdout, "NXDOMAIN") {
		t.Errorf("a container on Docker's bridge did not reach the box's resolver:\n%s", r.stdout)
	}
}

// whiteoutArchive is a docker-archive (the format of docker save) of an image of two layers:
// the first holds /cb (bin), /kept and /deleted, the second only the whiteout of /deleted.
func whiteoutArchive(t *testing.T, bin []byte) []byte {
	t.Helper()
	layers := [][]byte{
		tarOf(t, map[string][]byte{"cb": bin, "kept": []byte("k\n"), "deleted": []byte("d\n")}, 0o755),
		tarOf(t, map[string][]byte{".wh.deleted": nil}, 0o755),
	}
	var diffIDs, paths []string
	files := map[string][]byte{}
	for i, l := range layers {
		sum := sha256.Sum256(l)
		diffIDs = append(diffIDs, "sha256:"+hex.EncodeToString(sum[:]))
		p := fmt.Sprintf("layer%d/layer.tar", i)
		paths = append(paths, p)
		files[p] = l
	}
	config, _ := json.Marshal(map[string]any{
		"architecture": runtime.GOARCH, "os": "linux",
		"config": map[string]any{"Entrypoint": []string{"/cb"}},
		"rootfs": map[string]any{"type": "layers", "diff_ids": diffIDs},
	})
	files["config.json"] = config
	manifest, _ := json.Marshal([]map[string]any{{"Config": "config.json", "RepoTags": []string{"cbwhiteout:latest"}, "Layers": paths}})
	files["manifest.json"] = manifest
	return tarOf(t, files, 0o644)
}

// tarOf is a tar of regular files, in name order, all of one mode.
func tarOf(t *testing.T, files map[string][]byte, mode int64) []byte {
	t.Helper()
	var b bytes.Buffer
	tw := tar.NewWriter(&b)
	for _, name := range slices.Sorted(maps.Keys(files)) {
		if err := tw.WriteHeader(&tar.Header{Name: name, Mode: mode, Size: int64(len(files[name])), Typeflag: tar.TypeReg}); err != nil {
			t.Fatal(err)
		}
		_, _ = tw.Write(files[name])
	}
	_ = tw.Close()
	return b.Bytes()
}
