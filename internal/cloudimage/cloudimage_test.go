package cloudimage

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"gopkg.in/yaml.v3"
)

func TestHashFollowsTheRecipe(t *testing.T) {
	r := Recipe{Suite: "bookworm", Mirror: "http://deb.debian.org/debian", Arch: "amd64", Packages: slices.Clone(DefaultPackages)}
	h := r.Hash()
	if !regexp.MustCompile(`^[0-9a-f]{64}$`).MatchString(h) {
		t.Fatalf("hash %q", h)
	}
	shuffled := r
	shuffled.Packages = slices.Clone(r.Packages)
	slices.Reverse(shuffled.Packages)
	if shuffled.Hash() != h {
		t.Error("package order changed the hash")
	}
	for name, change := range map[string]func(*Recipe){
		"suite":    func(r *Recipe) { r.Suite = "trixie" },
		"mirror":   func(r *Recipe) { r.Mirror = "http://mirror.example/debian" },
		"arch":     func(r *Recipe) { r.Arch = "arm64" },
		"packages": func(r *Recipe) { r.Packages = append(slices.Clone(r.Packages), "vim") },
	} {
		c := r
		change(&c)
		if c.Hash() == h {
			t.Errorf("changing the %s did not change the hash", name)
		}
	}
	a := Alias(h)
	if !strings.HasPrefix(a, "claudebox-test/debian12-cloud-") || len(a) != len("claudebox-test/debian12-cloud-")+12 {
		t.Errorf("alias %q", a)
	}
}

func TestCachePath(t *testing.T) {
	t.Setenv("CLAUDEBOX_IMAGE_CACHE", "")
	if got := CachePath("abc"); got != "/var/cache/claudebox/images/abc.tar.gz" {
		t.Errorf("CachePath = %s", got)
	}
	t.Setenv("CLAUDEBOX_IMAGE_CACHE", "/tmp/x")
	if got := CachePath("abc"); got != "/tmp/x/abc.tar.gz" {
		t.Errorf("CachePath with override = %s", got)
	}
}

func TestRequirements(t *testing.T) {
	if !slices.Equal(Requirements(), []string{"debootstrap"}) {
		t.Errorf("Requirements = %v", Requirements())
	}
	for _, p := range Requirements() {
		if requirementBinary[p] == "" {
			t.Errorf("no binary known for %s", p)
		}
	}
}

// The metadata carries the NoCloud seed templates, the way images:debian/12/cloud does.
func TestMetadata(t *testing.T) {
	r := Recipe{Suite: "bookworm", Mirror: "http://deb.debian.org/debian", Arch: "amd64", Packages: DefaultPackages}
	var md struct {
		Architecture string            `yaml:"architecture"`
		CreationDate int64             `yaml:"creation_date"`
		Properties   map[string]string `yaml:"properties"`
		Templates    map[string]struct {
			When       []string          `yaml:"when"`
			CreateOnly bool              `yaml:"create_only"`
			Template   string            `yaml:"template"`
			Properties map[string]string `yaml:"properties"`
		} `yaml:"templates"`
	}
	dec := yaml.NewDecoder(strings.NewReader(metadataYAML(r, r.Hash())))
	dec.KnownFields(true)
	if err := dec.Decode(&md); err != nil {
		t.Fatalf("metadata.yaml: %v\n%s", err, metadataYAML(r, r.Hash()))
	}
	if md.Architecture != "x86_64" || md.Properties["os"] != "debian" || md.Properties["claudebox.recipe"] != r.Hash() {
		t.Errorf("metadata: %+v", md)
	}
	for _, p := range []string{"meta-data", "user-data", "vendor-data", "network-config"} {
		tp, ok := md.Templates["/var/lib/cloud/seed/nocloud-net/"+p]
		if !ok || !slices.Equal(tp.When, []string{"create", "copy"}) {
			t.Errorf("seed %s: %+v", p, tp)
		}
	}
	if md.Templates["/var/lib/cloud/seed/nocloud-net/user-data"].Properties["default"] != "#cloud-config\n{}" {
		t.Error("user-data template has no empty #cloud-config default")
	}
	for _, tp := range incusTemplates {
		if tp.name != md.Templates[tp.target].Template {
			t.Errorf("%s: template file %q", tp.target, md.Templates[tp.target].Template)
		}
	}
	var seed string
	for _, tp := range incusTemplates {
		if strings.HasSuffix(tp.target, "/user-data") {
			seed = tp.content
		}
	}
	if !strings.Contains(seed, `config_get("cloud-init.user-data"`) || !strings.Contains(seed, `config_get("user.user-data"`) {
		t.Errorf("user-data template reads neither key: %s", seed)
	}
}

func TestHostMirror(t *testing.T) {
	dir := t.TempDir()
	os.MkdirAll(filepath.Join(dir, "sources.list.d"), 0o755)
	if got := hostMirror(dir); got != "http://deb.debian.org/debian" {
		t.Errorf("no sources: %s", got)
	}
	os.WriteFile(filepath.Join(dir, "sources.list.d", "debian.sources"), []byte(
		"Types: deb\nURIs: http://security.example/debian-security\nSuites: bookworm-security\n\nTypes: deb\nURIs: http://mirror.example/debian/\nSuites: bookworm\n"), 0o644)
	if got := hostMirror(dir); got != "http://mirror.example/debian" {
		t.Errorf("deb822: %s", got)
	}
	dir2 := t.TempDir()
	os.WriteFile(filepath.Join(dir2, "sources.list"), []byte("# x\ndeb [arch=amd64] http://m2.example/debian bookworm main\n"), 0o644)
	if got := hostMirror(dir2); got != "http://m2.example/debian" {
		t.Errorf("one-line: %s", got)
	}
}

func TestTailLines(t *testing.T) {
	if got := tailLines("a\nb\nc\n", 2); got != "b\nc" {
		t.Errorf("tailLines = %q", got)
	}
}

// Two builders of one image (two test packages at once) take turns: the second waits on the
// lock file until the first lets go, and a cancelled wait gives up without the lock.
func TestLockFileSerializesBuilders(t *testing.T) {
	path := filepath.Join(t.TempDir(), "x.lock")
	unlock, err := lockFile(context.Background(), path)
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan time.Time, 1)
	go func() {
		u2, err := lockFile(context.Background(), path)
		if err != nil {
			t.Error(err)
			got <- time.Time{}
			return
		}
		got <- time.Now()
		u2()
	}()
	time.Sleep(700 * time.Millisecond)
	released := time.Now()
	unlock()
	if at := <-got; at.Before(released) {
		t.Fatalf("the second builder took the lock %v before the first released it", released.Sub(at))
	}
	u3, err := lockFile(context.Background(), path)
	if err != nil {
		t.Fatal(err)
	}
	defer u3()
	ctx, cancel := context.WithTimeout(context.Background(), 600*time.Millisecond)
	defer cancel()
	if _, err := lockFile(ctx, path); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("a cancelled wait: %v", err)
	}
}

// No build step installs packages: that is make setup's job (the dpkg lock collides).
func TestBuildNeverInstalls(t *testing.T) {
	for _, f := range []string{"build.go", "cloudimage.go"} {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		if strings.Contains(string(b), `"apt-get"`) {
			t.Errorf("%s runs apt-get", f)
		}
	}
}
