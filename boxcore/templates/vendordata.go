package templates

import (
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"gopkg.in/yaml.v3"
)

// Trusting the host's extra CAs in a box.
//
// Where the host reaches the internet through a TLS-intercepting egress proxy (this
// project's test machines do: their CA is in /usr/local/share/ca-certificates), a box on
// the NAT bridge goes through the same proxy, and nothing in it — curl, apt over https, npm —
// trusts the proxy's certificate. The fix belongs to the environment, not to the template:
// Incus's `cloud-init.vendor-data` key (rendered by the image into the NoCloud seed, as
// user-data is) carries cloud-init's ca_certs module with the host's locally added CAs.
// cloud-init runs it in its init stage, before packages and runcmd; the npm install then
// uses the system store (NODE_EXTRA_CA_CERTS). CA certificates are public: no secret moves.

// HostCADir is where Debian keeps locally added CA certificates (update-ca-certificates).
const HostCADir = "/usr/local/share/ca-certificates"

// HostExtraCAs returns the PEM CA certificates in dir (*.crt, recursively, sorted by path):
// the CAs the host trusts beyond Debian's bundle. A missing dir gives none. A file holding
// anything but certificates (a private key, say) is an error, never copied.
func HostExtraCAs(dir string) ([]string, error) {
	var out []string
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) && p == dir {
				return fs.SkipAll
			}
			return err
		}
		if d.IsDir() || !strings.HasSuffix(p, ".crt") {
			return nil
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		certs, err := pemCertificates(b)
		if err != nil {
			return fmt.Errorf("%s: %w", p, err)
		}
		out = append(out, certs...)
		return nil
	})
	return out, err
}

// pemCertificates splits b into PEM CERTIFICATE blocks, each re-encoded, and refuses any
// other block type or a certificate that does not parse.
func pemCertificates(b []byte) ([]string, error) {
	var out []string
	for {
		var blk *pem.Block
		blk, b = pem.Decode(b)
		if blk == nil {
			break
		}
		if blk.Type != "CERTIFICATE" {
			return nil, fmt.Errorf("holds a %s block, not only certificates", blk.Type)
		}
		if _, err := x509.ParseCertificate(blk.Bytes); err != nil {
			return nil, fmt.Errorf("bad certificate: %w", err)
		}
		out = append(out, string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: blk.Bytes})))
	}
	if len(out) == 0 {
		return nil, errors.New("no PEM certificate")
	}
	return out, nil
}

// TrustCAVendorData returns #cloud-config vendor-data that adds the PEM certificates to
// the box's system trust store (cloud-init's ca_certs module), for the instance config key
// `cloud-init.vendor-data`; "" when pems is empty.
func TrustCAVendorData(pems []string) (string, error) {
	if len(pems) == 0 {
		return "", nil
	}
	var certs []string
	for _, p := range pems {
		c, err := pemCertificates([]byte(p))
		if err != nil {
			return "", err
		}
		certs = append(certs, c...)
	}
	slices.Sort(certs)
	certs = slices.Compact(certs)
	b, err := yaml.Marshal(map[string]any{"ca_certs": map[string]any{"trusted": certs}})
	if err != nil {
		return "", err
	}
	s := "#cloud-config\n" + string(b)
	if f := SecretFindings(s); len(f) > 0 {
		return "", fmt.Errorf("vendor-data looks like it holds a credential (%s): refusing", strings.Join(f, "; "))
	}
	return s, nil
}
