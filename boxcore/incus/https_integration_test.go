package incus_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/claudebox/claudebox/boxcore/incus"
	"github.com/claudebox/claudebox/internal/testenv"
)

// TestHTTPSRemote connects to the real daemon as an HTTPS remote read from an incus CLI
// config: the daemon listens on loopback for the test, trusts a client certificate made for
// it, and the client pins the daemon's own certificate.
func TestHTTPSRemote(t *testing.T) {
	testenv.RequireIncus(t)
	testenv.LoopbackRemote(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, err := incus.Connect(ctx, "loop")
	if err != nil {
		t.Fatal(err)
	}
	srv, err := c.Server(ctx)
	if err != nil {
		t.Fatalf("Server over HTTPS: %v", err)
	}
	if c.Remote() != "loop" || srv.Auth != "trusted" || srv.Version == "" {
		t.Fatalf("remote %q auth %q version %q", c.Remote(), srv.Auth, srv.Version)
	}
	if _, err := c.Instances(ctx, map[string]string{"user.claudebox": "1"}, true); err != nil {
		t.Fatalf("Instances over HTTPS: %v", err)
	}
	s, err := incus.Connect(ctx, "stranger")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Server(ctx); err == nil || !strings.Contains(err.Error(), "certificate") {
		t.Fatalf("a remote pinning another certificate connected: %v", err)
	}
}
