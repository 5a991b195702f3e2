package boxcore

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
)

// Kernel is the host's own view of the isolation layers, read from /proc and /sys rather than
// from Incus: a layer Incus believes in but the kernel does not hold is not a layer.
type Kernel struct {
	Proc, Sys string // roots, "/proc" and "/sys" on a real host
	UnitDir   string // where systemd units go
}

// LocalKernel is this host's kernel.
func LocalKernel() Kernel {
	return Kernel{Proc: "/proc", Sys: "/sys", UnitDir: "/etc/systemd/system"}
}

const bridgeNFPath = "sys/net/bridge/bridge-nf-call-iptables"

// BridgeNFCallIPTables reads the br_netfilter switch; ok is false when br_netfilter is not loaded.
func (k Kernel) BridgeNFCallIPTables() (int, bool) {
	b, err := os.ReadFile(filepath.Join(k.Proc, bridgeNFPath))
	if err != nil {
		return 0, false
	}
	v, err := strconv.Atoi(strings.TrimSpace(string(b)))
	return v, err == nil
}

// SetBridgeNFCallIPTables writes the br_netfilter switch.
func (k Kernel) SetBridgeNFCallIPTables(v int) error {
	if err := os.WriteFile(filepath.Join(k.Proc, bridgeNFPath), []byte(strconv.Itoa(v)+"\n"), 0o644); err != nil {
		return fmt.Errorf("setting net.bridge.bridge-nf-call-iptables: %w", err)
	}
	return nil
}

// SystemdIsInit reports whether systemd is PID 1 (otherwise there is no boot unit to install).
func (k Kernel) SystemdIsInit() bool {
	b, err := os.ReadFile(filepath.Join(k.Proc, "1/comm"))
	return err == nil && strings.TrimSpace(string(b)) == "systemd"
}

// BridgePort is one port of a bridge and its isolation flag.
type BridgePort struct {
	Name     string
	Isolated bool
}

// BridgePorts lists a bridge's ports with their brport/isolated flag.
func (k Kernel) BridgePorts(bridge string) ([]BridgePort, error) {
	dir := filepath.Join(k.Sys, "class/net", bridge, "brif")
	ents, err := os.ReadDir(dir)
	if err != nil {
		if os.IsNotExist(err) {
			return nil, nil
		}
		return nil, err
	}
	var ports []BridgePort
	for _, e := range ents {
		b, err := os.ReadFile(filepath.Join(k.Sys, "class/net", e.Name(), "brport/isolated"))
		if err != nil {
			continue // the port left while we looked
		}
		ports = append(ports, BridgePort{Name: e.Name(), Isolated: strings.TrimSpace(string(b)) == "1"})
	}
	sort.Slice(ports, func(i, j int) bool { return ports[i].Name < ports[j].Name })
	return ports, nil
}

// SetPortIsolated flips one bridge port's isolation flag (the drill's seeded hole, and drift tests).
func (k Kernel) SetPortIsolated(port string, on bool) error {
	v := "0"
	if on {
		v = "1"
	}
	return os.WriteFile(filepath.Join(k.Sys, "class/net", port, "brport/isolated"), []byte(v), 0o644)
}

// DNSMasq is the dnsmasq process Incus runs for a bridge.
type DNSMasq struct {
	PID     int
	Args    []string
	Options []string // non-empty lines of its --conf-file (raw.dnsmasq)
}

// Flag reports whether the process was started with a flag (exact, or with "=value").
func (d DNSMasq) Flag(name string) bool {
	for _, a := range d.Args {
		if a == name || strings.HasPrefix(a, name+"=") {
			return true
		}
	}
	return false
}

// FindDNSMasq finds the running dnsmasq serving a bridge; ok is false when none runs.
func (k Kernel) FindDNSMasq(bridge string) (DNSMasq, bool) {
	ents, _ := os.ReadDir(k.Proc)
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		raw, err := os.ReadFile(filepath.Join(k.Proc, e.Name(), "cmdline"))
		if err != nil || !bytes.Contains(raw, []byte("--interface="+bridge+"\x00")) {
			continue
		}
		args := strings.Split(strings.TrimRight(string(raw), "\x00"), "\x00")
		if len(args) == 0 || filepath.Base(args[0]) != "dnsmasq" {
			continue
		}
		d := DNSMasq{PID: pid, Args: args}
		for _, a := range args {
			if f, ok := strings.CutPrefix(a, "--conf-file="); ok {
				if b, err := os.ReadFile(f); err == nil {
					for _, l := range strings.Split(string(b), "\n") {
						if l = strings.TrimSpace(l); l != "" {
							d.Options = append(d.Options, l)
						}
					}
				}
			}
		}
		return d, true
	}
	return DNSMasq{}, false
}

// IPv6Disabled reads the bridge's disable_ipv6 switch.
func (k Kernel) IPv6Disabled(iface string) (bool, error) {
	b, err := os.ReadFile(filepath.Join(k.Proc, "sys/net/ipv6/conf", iface, "disable_ipv6"))
	if err != nil {
		return false, err
	}
	return strings.TrimSpace(string(b)) == "1", nil
}

// systemctl runs systemctl; only called where systemd is PID 1.
func systemctl(args ...string) error {
	out, err := exec.Command("systemctl", args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("systemctl %s: %v: %s", strings.Join(args, " "), err, bytes.TrimSpace(out))
	}
	return nil
}
