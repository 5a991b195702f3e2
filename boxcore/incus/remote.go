package incus

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"time"

	"gopkg.in/yaml.v3"
)

// cliConfig is the part of the incus CLI's config.yml that Connect reads.
type cliConfig struct {
	DefaultRemote string                     `yaml:"default-remote"`
	Remotes       map[string]cliConfigRemote `yaml:"remotes"`
}

type cliConfigRemote struct {
	Addr     string `yaml:"addr"`
	Protocol string `yaml:"protocol"`
	Public   bool   `yaml:"public"`
}

// ConfigDir returns the incus CLI's configuration directory: $INCUS_CONF, else
// ~/.config/incus.
func ConfigDir() string {
	if d := os.Getenv("INCUS_CONF"); d != "" {
		return d
	}
	home, err := os.UserHomeDir()
	if err != nil {
		home = "/root"
	}
	return filepath.Join(home, ".config", "incus")
}

// Connect returns a client for remote. "" and "local" mean the local daemon's Unix socket
// (see LocalSocket). Any other name is looked up in the incus CLI's config.yml (see
// ConfigDir): its addr must be https:// (or unix://) and its protocol "incus"; the client
// certificate is client.crt/client.key of that directory and the server certificate, when
// servercerts/<name>.crt exists, is pinned. An unknown name gives *UnknownRemoteError.
// Connect does not touch the network: the first call reveals whether the remote answers.
func Connect(ctx context.Context, remote string) (*Client, error) {
	_ = ctx
	if remote == "" || remote == "local" {
		return NewUnixClient(LocalSocket()), nil
	}
	dir := ConfigDir()
	cfgPath := filepath.Join(dir, "config.yml")
	var cfg cliConfig
	b, err := os.ReadFile(cfgPath)
	switch {
	case errors.Is(err, os.ErrNotExist):
		return nil, &UnknownRemoteError{Name: remote, Config: cfgPath}
	case err != nil:
		return nil, fmt.Errorf("incus: reading %s: %w", cfgPath, err)
	}
	if err := yaml.Unmarshal(b, &cfg); err != nil {
		return nil, fmt.Errorf("incus: parsing %s: %w", cfgPath, err)
	}
	r, ok := cfg.Remotes[remote]
	if !ok {
		return nil, &UnknownRemoteError{Name: remote, Config: cfgPath}
	}
	if r.Protocol != "" && r.Protocol != "incus" {
		return nil, fmt.Errorf("incus: remote %q uses protocol %q: only \"incus\" remotes can hold boxes", remote, r.Protocol)
	}
	switch {
	case strings.HasPrefix(r.Addr, "unix:"):
		p := strings.TrimPrefix(strings.TrimPrefix(r.Addr, "unix:"), "//")
		if p == "" {
			p = LocalSocket()
		}
		c := NewUnixClient(p)
		c.remote = remote
		return c, nil
	case strings.HasPrefix(r.Addr, "https://"):
	default:
		return nil, fmt.Errorf("incus: remote %q has address %q: want https:// or unix://", remote, r.Addr)
	}
	tlsCfg, err := remoteTLS(dir, remote)
	if err != nil {
		return nil, err
	}
	tr := &http.Transport{
		TLSClientConfig:     tlsCfg,
		DialContext:         (&net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		Proxy:               http.ProxyFromEnvironment,
		MaxIdleConnsPerHost: 16,
		IdleConnTimeout:     30 * time.Second,
		TLSHandshakeTimeout: 10 * time.Second,
	}
	c := NewHTTPClient(r.Addr, &http.Client{Transport: tr})
	c.remote = remote
	return c, nil
}

// remoteTLS builds the TLS config for remote: client certificate from dir, server
// certificate pinned from dir/servercerts/<remote>.crt when present.
func remoteTLS(dir, remote string) (*tls.Config, error) {
	cfg := &tls.Config{MinVersion: tls.VersionTLS12}
	crt, key := filepath.Join(dir, "client.crt"), filepath.Join(dir, "client.key")
	if _, err := os.Stat(crt); err == nil {
		pair, err := tls.LoadX509KeyPair(crt, key)
		if err != nil {
			return nil, fmt.Errorf("incus: loading client certificate for remote %q: %w", remote, err)
		}
		cfg.Certificates = []tls.Certificate{pair}
	}
	srvPath := filepath.Join(dir, "servercerts", remote+".crt")
	pemBytes, err := os.ReadFile(srvPath)
	if errors.Is(err, os.ErrNotExist) {
		return cfg, nil // verified against the system's roots
	}
	if err != nil {
		return nil, fmt.Errorf("incus: reading %s: %w", srvPath, err)
	}
	blk, _ := pem.Decode(pemBytes)
	if blk == nil {
		return nil, fmt.Errorf("incus: %s holds no PEM certificate", srvPath)
	}
	pinned, err := x509.ParseCertificate(blk.Bytes)
	if err != nil {
		return nil, fmt.Errorf("incus: parsing %s: %w", srvPath, err)
	}
	// The server's certificate is usually self-signed with names that do not match the
	// address, so pin it: accept exactly that certificate.
	cfg.InsecureSkipVerify = true
	cfg.VerifyPeerCertificate = func(raw [][]byte, _ [][]*x509.Certificate) error {
		if len(raw) == 0 || !bytes.Equal(raw[0], pinned.Raw) {
			return fmt.Errorf("incus: remote %q presented a certificate other than %s", remote, srvPath)
		}
		return nil
	}
	return cfg, nil
}
