package boxcore

import (
	"bytes"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"
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

const (
	bridgeNFPath  = "sys/net/bridge/bridge-nf-call-iptables"
	bridgeNF6Path = "sys/net/bridge/bridge-nf-call-ip6tables"
)

// BridgeNFCallIPTables reads the br_netfilter switch; ok is false when br_netfilter is not loaded.
func (k Kernel) BridgeNFCallIPTables() (int, bool) { return k.sysctl(bridgeNFPath) }

// BridgeNFCallIP6Tables reads br_netfilter's IPv6 switch.
func (k Kernel) BridgeNFCallIP6Tables() (int, bool) { return k.sysctl(bridgeNF6Path) }

// SetBridgeNFCallIPTables writes the br_netfilter switch.
func (k Kernel) SetBridgeNFCallIPTables(v int) error { return k.setSysctl(bridgeNFPath, v) }

// SetBridgeNFCallIP6Tables writes br_netfilter's IPv6 switch.
func (k Kernel) SetBridgeNFCallIP6Tables(v int) error { return k.setSysctl(bridgeNF6Path, v) }

func (k Kernel) sysctl(rel string) (int, bool) {
	b, err := os.ReadFile(filepath.Join(k.Proc, rel))
	if err != nil {
		return 0, false
	}
	v, err := strconv.Atoi(strings.TrimSpace(string(b)))
	return v, err == nil
}

func (k Kernel) setSysctl(rel string, v int) error {
	if err := os.WriteFile(filepath.Join(k.Proc, rel), []byte(strconv.Itoa(v)+"\n"), 0o644); err != nil {
		name := strings.ReplaceAll(strings.TrimPrefix(rel, "sys/"), "/", ".")
		return fmt.Errorf("setting %s: %w", name, err)
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
	// Index is the port's ifindex: a veth deleted and made again under the same name (a box
	// restarted) has another.
	Index int
}

// BridgePorts lists a bridge's ports with their brport/isolated flag and ifindex.
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
		index := k.Ifindex(e.Name())
		if index == 0 {
			continue
		}
		ports = append(ports, BridgePort{Name: e.Name(), Isolated: strings.TrimSpace(string(b)) == "1", Index: index})
	}
	sort.Slice(ports, func(i, j int) bool { return ports[i].Name < ports[j].Name })
	return ports, nil
}

// Ifindex is a network interface's ifindex, 0 when there is no such interface.
func (k Kernel) Ifindex(name string) int {
	b, err := os.ReadFile(filepath.Join(k.Sys, "class/net", name, "ifindex"))
	if err != nil {
		return 0
	}
	n, _ := strconv.Atoi(strings.TrimSpace(string(b)))
	return n
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
	ownNet, _ := os.Readlink(filepath.Join(k.Proc, "self/ns/net"))
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		raw, err := os.ReadFile(filepath.Join(k.Proc, e.Name(), "cmdline"))
		if err != nil || !bytes.Contains(raw, []byte("--interface="+bridge+"\x00")) {
			continue
		}
		// A bridge of that name in another network namespace (another Incus daemon's, such as
		// a test cluster member's on this machine) has a dnsmasq of its own: not this one's.
		if net, err := os.Readlink(filepath.Join(k.Proc, e.Name(), "ns/net")); err == nil && ownNet != "" && net != ownNet {
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

// LeaseFile is the dnsmasq lease file of a running dnsmasq ("" when it names none).
func (d DNSMasq) LeaseFile() string {
	for _, a := range d.Args {
		if f, ok := strings.CutPrefix(a, "--dhcp-leasefile="); ok {
			return f
		}
	}
	return ""
}

// Lease is one named lease of a dnsmasq lease file.
type Lease struct {
	MAC  string
	IP   netip.Addr
	Name string
}

// Leases lists the leases of a dnsmasq lease file ("*" for a lease without a host name).
func Leases(path string) ([]Lease, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		if os.IsNotExist(err) {
			return nil, nil
		}
		return nil, err
	}
	var out []Lease
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) >= 4 && f[0] != "duid" {
			ip, _ := netip.ParseAddr(f[2])
			out = append(out, Lease{MAC: f[1], IP: ip, Name: f[3]})
		}
	}
	return out, nil
}

// NamedLeases lists the leases of a dnsmasq lease file that carry a host name (see LeaseNames).
func NamedLeases(path string) ([]Lease, error) {
	leases, err := Leases(path)
	return slices.DeleteFunc(leases, func(l Lease) bool { return l.Name == "*" }), err
}

// LeaseNames lists the host names recorded in a dnsmasq lease file. With dhcp-ignore-names
// every name is "*"; a real name is left over from a time the option was off, and dnsmasq
// keeps serving it until the lease is gone — no restart or renewal clears it (measured).
func LeaseNames(path string) ([]string, error) {
	leases, err := NamedLeases(path)
	var names []string
	for _, l := range leases {
		names = append(names, l.Name)
	}
	return names, err
}

// ForgetLeaseNames stops a bridge's dnsmasq and blanks the host names in its lease file, so
// the next dnsmasq Incus starts holds no name. The caller must make Incus restart dnsmasq.
func (k Kernel) ForgetLeaseNames(d DNSMasq) error {
	path := d.LeaseFile()
	if path == "" {
		return fmt.Errorf("dnsmasq (pid %d) names no lease file", d.PID)
	}
	if p, err := os.FindProcess(d.PID); err == nil {
		_ = p.Signal(syscall.SIGTERM)
	}
	for i := 0; i < 40; i++ { // dnsmasq rewrites the file as it exits: wait until it is gone
		if _, err := os.Stat(filepath.Join(k.Proc, strconv.Itoa(d.PID))); os.IsNotExist(err) {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	lines := strings.Split(string(b), "\n")
	for i, line := range lines {
		f := strings.Fields(line)
		if len(f) >= 4 && f[0] != "duid" && f[3] != "*" {
			f[3] = "*"
			lines[i] = strings.Join(f, " ")
		}
	}
	return os.WriteFile(path, []byte(strings.Join(lines, "\n")), 0o644)
}
