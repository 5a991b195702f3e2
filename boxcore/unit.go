package boxcore

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
)

// The boot unit re-applies the firewall: nftables rules live in the kernel and die with it,
// while Incus restores its own network, ACL and profile by itself.
type unitPlan struct {
	path    string
	content []byte
	write   bool
}

// UnitContent renders the oneshot unit for a binary path and stack.
func UnitContent(exe string, s Stack) []byte {
	return []byte(fmt.Sprintf(`[Unit]
Description=claudebox firewall for %[2]s (box-to-box and box-to-host drops)
After=incus.service incus.socket network-online.target
Wants=incus.service

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=%[1]s host firewall --network %[2]s

[Install]
WantedBy=multi-user.target
`, exe, s.Network))
}

func (h *Host) planUnit() (*unitPlan, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, fmt.Errorf("finding this binary for the boot unit: %w", err)
	}
	up := &unitPlan{path: filepath.Join(h.Kernel.UnitDir, h.Stack.Unit), content: UnitContent(exe, h.Stack)}
	have, err := os.ReadFile(up.path)
	up.write = err != nil || !bytes.Equal(have, up.content)
	return up, nil
}

// applyUnit writes the unit when it changed, then enables and restarts it on every init, so
// the running state matches the file rather than whatever an old binary left.
func (h *Host) applyUnit(up *unitPlan) error {
	if up.write {
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
	return true, nil
}
