package boxcore

import (
	"strings"
	"testing"

	"github.com/claudebox/claudebox/boxcore/incus"
)

// A bake's properties fit the recipe they were made from, and every part of the recipe
// that changes makes them stale, with the reason.
func TestBakeStaleness(t *testing.T) {
	r := BakeRecipe{Template: "claude", Base: "claudebox/debian12-cloud", BaseFingerprint: "aaaa", UserData: "#cloud-config\n", VendorData: ""}
	p := r.properties()
	if why := staleness(p, r); why != "" {
		t.Fatalf("a bake is stale against its own recipe: %s", why)
	}
	for _, tc := range []struct {
		edit func(*BakeRecipe)
		want string
	}{
		{func(r *BakeRecipe) { r.UserData += "# more\n" }, "the template changed"},
		{func(r *BakeRecipe) { r.Template = "blank" }, `template "claude"`},
		{func(r *BakeRecipe) { r.Base = "images:debian/12/cloud" }, "the base image is now images:debian/12/cloud"},
		{func(r *BakeRecipe) { r.BaseFingerprint = "bbbb" }, "the base image claudebox/debian12-cloud changed"},
		{func(r *BakeRecipe) { r.VendorData = "#cloud-config\nca_certs: {}\n" }, "CA certificates changed"},
	} {
		r2 := r
		tc.edit(&r2)
		if why := staleness(p, r2); !strings.Contains(why, tc.want) {
			t.Errorf("stale %q, want %q", why, tc.want)
		}
		if r2.Hash() == r.Hash() {
			t.Errorf("recipe hash did not change for %q", tc.want)
		}
	}
	old := r.properties()
	old[PropBakeVersion] = "0"
	if why := staleness(old, r); !strings.Contains(why, "another bake version") {
		t.Errorf("an older bake version: %q", why)
	}
}

// A box copied from a baked box waits for its lease, one with a template for cloud-init,
// one with neither for nothing; applyBake leaves no user-data for cloud-init to find.
func TestFirstBootOf(t *testing.T) {
	if fb := firstBootOf(map[string]string{TagTemplate: "claude", TagBake: "x"}); fb == nil || !fb.Baked {
		t.Errorf("baked: %+v", fb)
	}
	if fb := firstBootOf(map[string]string{TagTemplate: "claude"}); fb == nil || fb.Baked {
		t.Errorf("templated: %+v", fb)
	}
	if fb := firstBootOf(map[string]string{}); fb != nil {
		t.Errorf("plain: %+v", fb)
	}
	o := NewOptions{Image: "base", Config: map[string]string{"cloud-init.user-data": "#cloud-config\n", "cloud-init.vendor-data": "#cloud-config\n", TagTemplate: "claude"},
		FirstBoot: &FirstBoot{Timeout: DefaultFirstBootTimeout}}
	img := incus.Image{Fingerprint: "0123456789abcdef", Properties: map[string]string{PropBakeClaude: "2.1.1"}}
	applyBake(&o, BakeState{Alias: "claudebox/bake/claude", Image: &img})
	if o.Image != "claudebox/bake/claude" || o.Config["cloud-init.user-data"] != "" || o.Config["cloud-init.vendor-data"] != "" ||
		!o.FirstBoot.Baked || o.Config[TagBake] != "claudebox/bake/claude (image 0123456789ab, Claude Code 2.1.1)" {
		t.Errorf("applyBake: %+v %+v", o, o.FirstBoot)
	}
}
