package testenv

import (
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
)

// LoopbackRemote makes the local daemon reachable as an HTTPS remote for the test: it
// listens on a free loopback port, trusts a client certificate made for this run, and an
// incus CLI config directory (set as INCUS_CONF for the test) names it remote "loop", with
// the daemon's certificate pinned. A second remote, "stranger", pins another certificate.
// Everything is undone when the test ends; a dead run's trusted certificates are removed.
func LoopbackRemote(t *testing.T) (confDir string) {
	t.Helper()
	name := "cbt-https-" + RunID()
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
	certPEM, keyPEM, fp := SelfSignedCert(t, name)
	write(t, filepath.Join(dir, "client.crt"), certPEM, 0o644)
	write(t, filepath.Join(dir, "client.key"), keyPEM, 0o600)
	incusCLI(t, "config", "trust", "add-certificate", filepath.Join(dir, "client.crt"), "--name", name)
	t.Cleanup(func() { _, _ = exec.Command("incus", "config", "trust", "remove", fp).CombinedOutput() })

	incusDir := os.Getenv("INCUS_DIR")
	if incusDir == "" {
		incusDir = "/var/lib/incus"
	}
	serverCrt, err := os.ReadFile(filepath.Join(incusDir, "server.crt"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Join(dir, "servercerts"), 0o755); err != nil {
		t.Fatal(err)
	}
	write(t, filepath.Join(dir, "servercerts", "loop.crt"), serverCrt, 0o644)
	other, _, _ := SelfSignedCert(t, "not-the-server")
	write(t, filepath.Join(dir, "servercerts", "stranger.crt"), other, 0o644)
	cfg := "remotes:\n  loop:\n    addr: https://" + addr + "\n    protocol: incus\n  stranger:\n    addr: https://" + addr + "\n    protocol: incus\n"
	write(t, filepath.Join(dir, "config.yml"), []byte(cfg), 0o644)
	t.Setenv("INCUS_CONF", dir)
	// The listener comes up asynchronously.
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		if c, err := net.Dial("tcp", addr); err == nil {
			c.Close()
			break
		}
	}
	return dir
}

// SelfSignedCert makes a client certificate and key (PEM) and its SHA-256 fingerprint.
func SelfSignedCert(t *testing.T, cn string) (certPEM, keyPEM []byte, fingerprint string) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(time.Now().UnixNano()),
		Subject:      pkix.Name{CommonName: cn},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	kb, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(der)
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kb}), hex.EncodeToString(sum[:])
}

func incusCLI(t *testing.T, args ...string) string {
	t.Helper()
	out, err := exec.Command("incus", args...).CombinedOutput()
	if err != nil {
		t.Fatalf("incus %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return strings.TrimSpace(string(out))
}

func write(t *testing.T, path string, b []byte, mode os.FileMode) {
	t.Helper()
	if err := os.WriteFile(path, b, mode); err != nil {
		t.Fatal(err)
	}
}
