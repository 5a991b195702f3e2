package boxcore_test

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/claudebox/claudebox/boxcore"
	"github.com/claudebox/claudebox/internal/testcluster"
	"github.com/claudebox/claudebox/internal/teststack"
)

// On a real three-member cluster, a box on each member: list and info (boxcore and the
// binary, asked through any member) say which member each box lives on. The boxes are
// made with the API (source none: nothing to download); the cluster goes with its run.
func TestClusterMember(t *testing.T) {
	testcluster.Gate(t)
	c := testcluster.Up(t, 3)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	where := map[string]string{} // box → member
	for i, m := range c.Members() {
		name := fmt.Sprintf("%s-box%d", c.Run, i)
		req := map[string]any{"name": name, "type": "container", "source": map[string]string{"type": "none"},
			"profiles": []string{"default"}, "config": map[string]string{boxcore.TagKey: "1"}}
		op, err := c.API(ctx, 0, http.MethodPost, "/1.0/instances?target="+m.Name, req, nil)
		if err != nil {
			t.Fatalf("creating %s on %s: %v", name, m.Name, err)
		}
		if _, err := c.Client(0).WaitOperation(ctx, op, nil); err != nil {
			t.Fatalf("creating %s on %s: %v", name, m.Name, err)
		}
		where[name] = m.Name
	}
	for i := range c.Members() {
		bs := &boxcore.Boxes{Client: c.Client(i), Stack: boxcore.DefaultStack()}
		list, err := bs.List(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if len(list) != len(where) {
			t.Fatalf("asked through m%d: %d boxes, want %d: %+v", i+1, len(list), len(where), list)
		}
		for _, s := range list {
			if s.Member != where[s.Name] {
				t.Errorf("asked through m%d: %s on %q, want %q", i+1, s.Name, s.Member, where[s.Name])
			}
		}
	}
	for name, member := range where {
		b, err := boxcore.Resolve(ctx, c.Client(0), name)
		if err != nil {
			t.Fatal(err)
		}
		info, err := (&boxcore.Boxes{Client: c.Client(0), Stack: boxcore.DefaultStack()}).Info(ctx, b)
		if err != nil {
			t.Fatal(err)
		}
		if info.Member != member {
			t.Errorf("info %s: member %q, want %q", name, info.Member, member)
		}
	}

	// The binary, pointed at the second member's socket: a MEMBER column, and info's line.
	bin := teststack.Binary(t)
	run := func(args ...string) string {
		cmd := exec.CommandContext(ctx, bin, args...)
		cmd.Env = append(os.Environ(), "INCUS_SOCKET="+c.Members()[1].Socket)
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("claudebox %s: %v\n%s", strings.Join(args, " "), err, out)
		}
		return string(out)
	}
	out := run("list")
	if !strings.Contains(out, "MEMBER") {
		t.Errorf("list has no MEMBER column:\n%s", out)
	}
	for name, member := range where {
		line := ""
		for _, l := range strings.Split(out, "\n") {
			if strings.HasPrefix(l, name+" ") {
				line = l
			}
		}
		if !strings.HasSuffix(strings.TrimSpace(line), " "+member) {
			t.Errorf("list: %s's line %q does not end with its member %s", name, line, member)
		}
		if info := run("info", name); !strings.Contains(info, "member:    "+member+" ") {
			t.Errorf("info %s does not name %s:\n%s", name, member, info)
		}
	}
}
