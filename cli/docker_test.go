package cli

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"

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
	h := &harness{t: t, c: c, stack: teststack.New(t, c, "docker"), image: img.Alias}
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
	// The container's network is Docker's bridge inside the box: it reaches the box's
	// resolver (the gateway's DNS, which answers NXDOMAIN for a name under .invalid).
	gw := strings.TrimSpace(h.expect(0, "", "exec", box, "--", "sh", "-c", "ip -4 route show default | cut -d' ' -f3").stdout)
	spec := `{"kind":"dns","dns":{"server":"` + gw + `","name":"claudebox-test.invalid","type":"A"},"timeout":"3s"}`
	r = h.expect(0, "", "exec", box, "--", "docker", "run", "--rm", "cbtest", "probe", "run", spec)
	if !strings.Contains(r.stdout, "NXDOMAIN") {
		t.Errorf("a container on Docker's bridge did not reach the box's resolver:\n%s", r.stdout)
	}
}
