package incus_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/claudebox/claudebox/boxcore/incus"
	"github.com/claudebox/claudebox/internal/testenv"
)

func incusCLI(t *testing.T, args ...string) string {
	t.Helper()
	out, err := exec.Command("incus", args...).CombinedOutput()
	if err != nil {
		t.Fatalf("incus %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return strings.TrimSpace(string(out))
}

// TestHTTPSRemote connects to the real daemon as an HTTPS remote read from an incus CLI
// config: the daemon listens on loopback for the test, trusts a client certificate made for
// it, and the client pins the daemon's own certificate.
func TestHTTPSRemote(t *testing.T) {
	testenv.RequireIncus(t)
	name := "cbt-https-" + testenv.RunID()
	// A dead run's trusted test certificates go first.
	for _, line := range strings.Split(incusCLI(t, "config", "trust", "list", "--format", "csv", "--columns", "nf"), "\n") {
		f := strings.Split(line, ",")
		if len(f) == 2 && strings.HasPrefix(f[0], "cbt-https-") && f[0] != name {
			_, _ = exec.Command("incus", "config", "trust", "remove", f[1]).CombinedOutput()
		}
	}

	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	prev := incusCLI(t, "config", "get", "core.https_address")
	incusCLI(t, "config", "set", "core.https_address", addr)
	t.Cleanup(func() {
		if prev == "" {
			_, _ = exec.Command("incus", "config", "unset", "core.https_address").CombinedOutput()
		} else {
			_, _ = exec.Command("incus", "config", "set", "core.https_address", prev).CombinedOutput()
		}
	})

	dir := t.TempDir()
	certPEM, keyPEM, fp := clientCert(t, name)
	must(t, os.WriteFile(filepath.Join(dir, "client.crt"), certPEM, 0o644))
	must(t, os.WriteFile(filepath.Join(dir, "client.key"), keyPEM, 0o600))
	incusCLI(t, "config", "trust", "add-certificate", filepath.Join(dir, "client.crt"), "--name", name)
	t.Cleanup(func() { _, _ = exec.Command("incus", "config", "trust", "remove", fp).CombinedOutput() })

	incusDir := os.Getenv("INCUS_DIR")
	if incusDir == "" {
		incusDir = "/var/lib/incus"
	}
	serverCrt, err := os.ReadFile(filepath.Join(incusDir, "server.crt"))
	must(t, err)
	must(t, os.MkdirAll(filepath.Join(dir, "servercerts"), 0o755))
	must(t, os.WriteFile(filepath.Join(dir, "servercerts", "loop.crt"), serverCrt, 0o644))
	cfg := "remotes:\n  loop:\n    addr: https://" + addr + "\n    protocol: incus\n  stranger:\n    addr: https://" + addr + "\n    protocol: incus\n"
	must(t, os.WriteFile(filepath.Join(dir, "config.yml"), []byte(cfg), 0o644))
	// "stranger" pins a certificate the daemon does not have.
	other, _, _ := clientCert(t, "not-the-server")
	must(t, os.WriteFile(filepath.Join(dir, "servercerts", "stranger.crt"), other, 0o644))
	t.Setenv("INCUS_CONF", dir)

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var srv incus.Server
	var c *incus.Client
	deadline := time.Now().Add(10 * time.Second) // the listener comes up asynchronously
	for {
		c, err = incus.Connect(ctx, "loop")
		must(t, err)
		if srv, err = c.Server(ctx); err == nil || time.Now().After(deadline) {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
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
	must(t, err)
	if _, err := s.Server(ctx); err == nil || !strings.Contains(err.Error(), "certificate") {
		t.Fatalf("a remote pinning another certificate connected: %v", err)
	}
}

func clientCert(t *testing.T, cn string) (certPEM, keyPEM []byte, fingerprint string) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	must(t, err)
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(time.Now().UnixNano()),
		Subject:      pkix.Name{CommonName: cn},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	must(t, err)
	kb, err := x509.MarshalECPrivateKey(key)
	must(t, err)
	sum := sha256.Sum256(der)
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kb}), hex.EncodeToString(sum[:])
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}
