package boxcore

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
)

// ServersDir holds each claudebox network's dnsmasq servers-file. The network's raw.dnsmasq
// names it (servers-file=), and dnsmasq re-reads it on SIGHUP: a forwarder set there (the
// drill's test domain) needs no change to the network, so Incus does not re-apply the
// network and no re-apply window opens (every raw.dnsmasq change re-applies it, FACTS.md).
// dnsmasq runs as nobody: the directory and the file are world-readable. A file that is
// missing is only a log line to dnsmasq (measured, dnsmasq 2.90).
const ServersDir = "/var/lib/claudebox/dnsmasq"

// ServersFile is the servers-file of a network.
func ServersFile(network string) string { return filepath.Join(ServersDir, network+".servers") }

// ServersFileOption is the raw.dnsmasq line that names a network's servers-file.
func ServersFileOption(network string) string { return "servers-file=" + ServersFile(network) }

// NamesServersFile reports whether raw (a raw.dnsmasq) names the network's servers-file.
func NamesServersFile(raw, network string) bool {
	_, other := ParseRawDNSMasq(raw)
	return slices.Contains(other, ServersFileOption(network))
}

// ReadServers reads the forwarder lines of a network's servers-file (none when it is missing).
func ReadServers(network string) ([]string, error) {
	b, err := os.ReadFile(ServersFile(network))
	if os.IsNotExist(err) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var out []string
	for _, l := range strings.Split(string(b), "\n") {
		if l = strings.TrimSpace(l); l != "" {
			out = append(out, l)
		}
	}
	return out, nil
}

// SetServers replaces a network's servers-file (lines: "server=/domain/addr") and makes its
// running dnsmasq re-read it. Only server= lines are accepted: dnsmasq takes nothing else
// from a servers-file.
func (k Kernel) SetServers(network string, lines []string) error {
	for _, l := range lines {
		if !strings.HasPrefix(l, "server=") || strings.ContainsAny(l, "\n\r") {
			return fmt.Errorf("servers-file line %q: only one server=... line each", l)
		}
	}
	if err := os.MkdirAll(ServersDir, 0o755); err != nil {
		return err
	}
	for _, d := range []string{filepath.Dir(ServersDir), ServersDir} {
		if err := os.Chmod(d, 0o755); err != nil {
			return err
		}
	}
	body := strings.Join(lines, "\n")
	if body != "" {
		body += "\n"
	}
	path := ServersFile(network)
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(body), 0o644); err != nil {
		return err
	}
	if err := os.Chmod(tmp, 0o644); err != nil {
		return err
	}
	if err := os.Rename(tmp, path); err != nil {
		return err
	}
	return k.ReloadDNSMasq(network)
}

// ReloadDNSMasq sends the network's dnsmasq SIGHUP (it re-reads its servers-file and host
// files; Incus does the same on every lease change). None running is not an error: it reads
// the file when Incus starts it.
func (k Kernel) ReloadDNSMasq(network string) error {
	d, ok := k.FindDNSMasq(network)
	if !ok {
		return nil
	}
	if err := syscall.Kill(d.PID, syscall.SIGHUP); err != nil && err != syscall.ESRCH {
		return fmt.Errorf("reloading dnsmasq of %s: %w", network, err)
	}
	return nil
}

// reapplyMarkPrefix starts the comment line of raw.dnsmasq whose value the drill changes to
// make Incus re-apply the network while it measures: a window it opens on purpose, under
// its floods, and never has to close with an unmeasured second change. `host init` keeps the
// value it finds.
const reapplyMarkPrefix = "# claudebox: re-apply mark "

// ReapplyMark is the value of raw.dnsmasq's re-apply mark ("0" when it has none).
func ReapplyMark(raw string) string {
	for _, l := range strings.Split(raw, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(l), reapplyMarkPrefix); ok && strings.TrimSpace(v) != "" {
			return strings.TrimSpace(v)
		}
	}
	return "0"
}

// WithReapplyMark is raw with its re-apply mark set to value (added when it has none).
func WithReapplyMark(raw, value string) string {
	var out []string
	for _, l := range strings.Split(raw, "\n") {
		if t := strings.TrimSpace(l); t != "" && !strings.HasPrefix(t, reapplyMarkPrefix) {
			out = append(out, l)
		}
	}
	return strings.Join(append(out, reapplyMarkPrefix+value), "\n")
}
