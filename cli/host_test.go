package cli

import (
	"context"
	"errors"
	"net"
	"os/exec"
	"strings"
	"syscall"
	"testing"

	"github.com/claudebox/claudebox/boxcore"
	"github.com/claudebox/claudebox/boxcore/incus"
	"github.com/claudebox/claudebox/firewall"
	"github.com/claudebox/claudebox/internal/testenv"
	"github.com/claudebox/claudebox/internal/teststack"
)

// The host verbs' bad input: one clear line, the right exit code, nothing made.
func TestHostVerbsBadInput(t *testing.T) {
	c := testenv.RequireIncus(t)
	ctx := context.Background()
	s := teststack.Stack("hostcli")
	h := &harness{t: t, c: c, stack: s}
	t.Cleanup(func() { teststack.Remove(t, c, s) })
	nothingMade := func(t *testing.T) {
		t.Helper()
		if _, _, err := c.Network(ctx, s.Network); !errors.Is(err, incus.ErrNotFound) {
			t.Fatalf("network %s exists after a refused init: %v", s.Network, err)
		}
		if obs, err := firewall.Read(s.Network); err == nil {
			for _, tb := range obs.Tables {
				if tb.Present {
					t.Fatalf("nft table %s exists after a refused init", tb.Name)
				}
			}
		}
	}
	claims, err := boxcore.HostClaims()
	if err != nil || len(claims) == 0 {
		t.Fatalf("host claims: %v %v", claims, err)
	}
	// A claim of a /24 or wider (a /32 route, e.g. a test's decoy, names no /24 network address).
	takenSubnet := ""
	for _, cl := range claims {
		if ones, _ := cl.Net.Mask.Size(); ones <= 24 {
			takenSubnet = cl.Net.IP.Mask(net.CIDRMask(24, 32)).To4().String() + "/24"
			break
		}
	}
	if takenSubnet == "" {
		t.Fatalf("no host claim of a /24 or wider: %v", claims)
	}

	for _, tc := range []struct {
		code int
		want string
		args []string
	}{
		{2, "invalid --subnet", []string{"host", "init", "--yes", "--subnet", "10.1.2.3/24"}},
		{2, "invalid --subnet", []string{"host", "init", "--yes", "--subnet", "nonsense"}},
		{2, "already used by", []string{"host", "init", "--yes", "--subnet", takenSubnet}},
		{2, "invalid --dns", []string{"host", "init", "--yes", "--dns", "8.8.8.8,nope"}},
		{2, "no terminal to confirm on: pass --yes", []string{"host", "init", "--dns", "host"}},
		{2, "unexpected argument", []string{"host", "init", "extra"}},
		{2, "unknown --format", []string{"host", "check", "--format", "xml"}},
	} {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			h.t = t
			h.expect(tc.code, tc.want, tc.args...)
			nothingMade(t)
		})
	}
	h.t = t

	t.Run("daemon down", func(t *testing.T) {
		t.Setenv("INCUS_SOCKET", "/nonexistent/unix.socket")
		h.t = t
		h.expect(1, "not answering at /nonexistent/unix.socket: start it with 'make setup'", "host", "init", "--yes")
		h.t = t
	})
	h.t = t

	t.Run("not root", func(t *testing.T) {
		for _, args := range [][]string{{"host", "init", "--yes"}, {"host", "check"}, {"host", "teardown", "--yes"}} {
			cmd := exec.Command(teststack.Binary(t), args...)
			cmd.Env = append(cmd.Environ(), "CLAUDEBOX_STACK="+s.Network)
			cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
			out, err := cmd.CombinedOutput()
			var ee *exec.ExitError
			if !errors.As(err, &ee) || ee.ExitCode() != 2 || !strings.Contains(string(out), "needs root") {
				t.Fatalf("%v as nobody: %v %s", args, err, out)
			}
		}
		nothingMade(t)
	})

	// With a stack: check exits 1 on drift, teardown refuses with a box and no --force, and
	// without a terminal and --yes.
	h.expect(0, "create NAT bridge", "host", "init", "--yes", "--dns", "host")
	h.expect(0, "no changes", "host", "init", "--yes")
	h.expect(0, "ok: the stack is as declared", "host", "check")
	h.expect(0, `"ok": true`, "host", "check", "--format", "json")
	bt, _ := firewall.TableNames(s.Network)
	if out, err := exec.Command("nft", "delete", "table", "bridge", bt).CombinedOutput(); err != nil {
		t.Fatalf("nft: %v %s", err, out)
	}
	r := h.expect(1, "drift: ", "host", "check")
	if !strings.Contains(r.stdout, bt) || !strings.Contains(r.stdout, "DRIFT") {
		t.Fatalf("check does not name the missing table:\n%s", r.stdout)
	}
	h.expect(0, "nftables", "host", "init", "--yes")
	h.expect(0, "ok: the stack is as declared", "host", "check")

	h.image = teststack.ProbeImage(t, c)
	box := h.name("hostcli")
	if r := h.newBox(box); r.code != 0 {
		t.Fatalf("new: %s", r.stderr)
	}
	h.tagForSweep(box)
	h.unchanged(2, "no terminal to confirm on: pass --yes", "host", "teardown", "--force")
	h.unchanged(2, "use the stack ("+box+"): remove them with 'claudebox rm', or pass --force", "host", "teardown", "--yes")
	r = h.expect(0, "lost their network", "host", "teardown", "--yes", "--force")
	if !strings.Contains(r.stdout, "network "+s.Network+": delete") {
		t.Fatalf("teardown output: %s", r.stdout)
	}
	nothingMade(t)
	h.expect(0, "nothing to remove", "host", "teardown", "--yes")
}
