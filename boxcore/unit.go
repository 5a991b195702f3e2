package boxcore

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
)

// BootBinary is where `host init` installs the root-owned copy of claudebox the boot unit
// runs. The unit never runs the binary that happened to run `host init` (a user's checkout,
// writable by that user): that would hand the user root at every boot.
const BootBinary = "/usr/local/libexec/claudebox/claudebox"

// bootBinary is BootBinary, moved by tests.
var bootBinary = BootBinary

// The boot unit runs the agent (agent.go): it re-applies the firewall — nftables rules live
// in the kernel and die with it, while Incus restores its own network, ACL and profile by
// itself — then binds every box that starts here (Incus's autostart, another cluster
// member's start) until the host stops. It is restarted whenever it ends.
type unitPlan struct {
	path    string
	content []byte
	// write: the unit or the installed binary is missing or stale.
	write bool
	// bin is the installed copy's path; src the binary to copy there when binWrite.
	bin, src string
	binWrite bool
}

// systemdQuote quotes one ExecStart= word for systemd (double quotes, backslash escapes).
func systemdQuote(s string) string {
	r := strings.NewReplacer(`\`, `\\`, `"`, `\"`, "%", "%%", "$", "$$")
	return `"` + r.Replace(s) + `"`
}

// UnitContent renders the boot unit for a binary path and stack.
func UnitContent(exe string, s Stack) []byte {
	return []byte(fmt.Sprintf(`[Unit]
Description=claudebox firewall and port binding for %[2]s (box-to-box and box-to-host drops)
After=incus.service incus.socket network-online.target
Wants=incus.service
StartLimitIntervalSec=0

[Service]
Type=simple
ExecStart=%[1]s host agent --network %[3]s
Restart=always
RestartSec=2

[Install]
WantedBy=multi-user.target
`, systemdQuote(exe), s.Network, systemdQuote(s.Network)))
}

func (h *Host) planUnit() (*unitPlan, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, fmt.Errorf("finding this binary for the boot unit: %w", err)
	}
	up := &unitPlan{path: filepath.Join(h.Kernel.UnitDir, h.Stack.Unit), content: UnitContent(bootBinary, h.Stack), bin: bootBinary, src: exe}
	have, err := os.ReadFile(up.path)
	up.write = err != nil || !bytes.Equal(have, up.content)
	up.binWrite = !sameFile(exe, bootBinary) || !rootOwned(bootBinary)
	up.write = up.write || up.binWrite
	return up, nil
}

// sameFile reports whether two files hold the same bytes.
func sameFile(a, b string) bool {
	x, err := os.ReadFile(a)
	if err != nil {
		return false
	}
	y, err := os.ReadFile(b)
	return err == nil && bytes.Equal(x, y)
}

// rootOwned reports whether path and its directory are owned by root and writable by no one
// else, so that what the boot unit runs as root only root could have put there.
func rootOwned(path string) bool {
	for _, p := range []string{path, filepath.Dir(path)} {
		st, err := os.Stat(p)
		if err != nil || st.Mode().Perm()&0o022 != 0 || !ownedByRoot(st) {
			return false
		}
	}
	return true
}

// installBinary copies src to dst (mode 0755, root-owned), atomically: a boot never runs a
// half-written binary.
func installBinary(src, dst string) error {
	b, err := os.ReadFile(src)
	if err != nil {
		return fmt.Errorf("reading %s to install it: %w", src, err)
	}
	dir := filepath.Dir(dst)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	if err := os.Chmod(dir, 0o755); err != nil {
		return err
	}
	if err := os.Chown(dir, 0, 0); err != nil {
		return err
	}
	tmp, err := os.CreateTemp(dir, ".claudebox-")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.Write(b); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	if err := os.Chmod(tmp.Name(), 0o755); err != nil {
		return err
	}
	if err := os.Chown(tmp.Name(), 0, 0); err != nil {
		return err
	}
	if err := os.Rename(tmp.Name(), dst); err != nil {
		return fmt.Errorf("installing %s: %w", dst, err)
	}
	return nil
}

// applyUnit installs the binary and writes the unit when either changed, then enables and
// restarts it on every init, so the running state matches the file rather than whatever an
// old binary left.
func (h *Host) applyUnit(up *unitPlan) error {
	if up.binWrite {
		if err := installBinary(up.src, up.bin); err != nil {
			return err
		}
	}
	if have, err := os.ReadFile(up.path); err != nil || !bytes.Equal(have, up.content) {
		if err := os.WriteFile(up.path, up.content, 0o644); err != nil {
			return fmt.Errorf("writing %s: %w", up.path, err)
		}
		if err := systemctl("daemon-reload"); err != nil {
			return err
		}
	}
	if err := systemctl("enable", h.Stack.Unit); err != nil {
		return err
	}
	return systemctl("restart", h.Stack.Unit)
}

func (h *Host) removeUnit() (bool, error) {
	if h.Stack.Unit == "" {
		return false, nil
	}
	path := filepath.Join(h.Kernel.UnitDir, h.Stack.Unit)
	if _, err := os.Stat(path); err != nil {
		return false, nil
	}
	if h.Kernel.SystemdIsInit() {
		_ = systemctl("disable", "--now", h.Stack.Unit)
	}
	if err := os.Remove(path); err != nil {
		return false, err
	}
	if h.Kernel.SystemdIsInit() {
		_ = systemctl("daemon-reload")
	}
	// The installed copy served only the unit.
	if err := os.Remove(bootBinary); err == nil {
		_ = os.Remove(filepath.Dir(bootBinary))
	}
	return true, nil
}

func ownedByRoot(st os.FileInfo) bool {
	s, ok := st.Sys().(*syscall.Stat_t)
	return ok && s.Uid == 0
}
