package probes

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/insomniacslk/dhcp/dhcpv4"
	"github.com/insomniacslk/dhcp/dhcpv4/nclient4"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// DefaultStatusFile is where PID-1 mode reports its state for the engine.
const DefaultStatusFile = StateDir + "/status.json"

// InitConfig configures PID-1 mode. The zero value is completed by defaults
// (see DefaultInitConfig); tests point the paths elsewhere.
type InitConfig struct {
	Iface      string         // DHCP interface, default eth0
	Listen     ListenerConfig // default TCP 7001, UDP 7002, hits in DefaultHitsFile
	StatusFile string         // default DefaultStatusFile
	ResolvConf string         // default /etc/resolv.conf
	// Hostname sent as DHCP option 12; default the UTS hostname, which Incus
	// sets to the instance name.
	Hostname string
	// DHCPTimeout bounds one DORA attempt; attempts repeat until success.
	DHCPTimeout time.Duration
	// SkipMounts leaves /proc, /sys, /run, /tmp alone (tests).
	SkipMounts bool
}

// Status is the JSON in the status file. The engine polls it until Ready is
// true or Error is set (DHCP keeps retrying in the background after an error,
// so Ready may still turn true later).
type Status struct {
	Ready bool `json:"ready"`
	// Phase: "booting", "dhcp", "ready", "dhcp-failed".
	Phase    string   `json:"phase"`
	Hostname string   `json:"hostname"`
	Iface    string   `json:"iface"`
	IPv4     string   `json:"ipv4,omitempty"` // CIDR of the lease
	Gateway  string   `json:"gateway,omitempty"`
	DNS      []string `json:"dns,omitempty"`
	Domain   string   `json:"domain,omitempty"`
	// LeaseSeconds: the agent never renews (boxes are short-lived); past
	// LeaseExpires dnsmasq may hand the address to another box.
	LeaseSeconds int       `json:"lease_seconds,omitempty"`
	LeaseExpires time.Time `json:"lease_expires,omitzero"`
	DHCPAttempts int       `json:"dhcp_attempts,omitempty"`
	DHCPMillis   int64     `json:"dhcp_ms,omitempty"`
	TCP          []int     `json:"tcp,omitempty"`
	UDP          []int     `json:"udp,omitempty"`
	Error        string    `json:"error"`
	Updated      time.Time `json:"updated"`
}

// DefaultInitConfig is what the scratch image runs.
func DefaultInitConfig() InitConfig {
	return InitConfig{}.withDefaults()
}

func (c InitConfig) withDefaults() InitConfig {
	if c.Iface == "" {
		c.Iface = DefaultIface
	}
	if c.Listen.TCP == nil && c.Listen.UDP == nil {
		c.Listen.TCP, c.Listen.UDP = []int{DefaultTCPPort}, []int{DefaultUDPPort}
		// The box also records odd frames reaching it (markers, foreign sources).
		c.Listen.Capture = c.Iface
		if c.Listen.HitsFile == "" {
			c.Listen.HitsFile = DefaultHitsFile
		}
	}
	if c.StatusFile == "" {
		c.StatusFile = DefaultStatusFile
	}
	if c.ResolvConf == "" {
		c.ResolvConf = "/etc/resolv.conf"
	}
	if c.DHCPTimeout == 0 {
		// dnsmasq pings an address before offering it to a new client and
		// holds the offer ~3 s while it waits: a shorter window never sees it.
		c.DHCPTimeout = 10 * time.Second
	}
	return c
}

// IsInitMode reports whether this process is a container's PID 1 started
// with no arguments: the scratch image's /sbin/init.
func IsInitMode() bool {
	return os.Getpid() == 1 && len(os.Args) <= 1
}

// sigRTMin3 is glibc's SIGRTMIN+3 (34+3): LXC stops an init that blocks SIGPWR with it,
// taking it for systemd, and the Go runtime's threads block the real-time signals. Without
// it `incus stop` waited out its timeout (measured: 30 s; with it, under a second).
const sigRTMin3 = unix.Signal(37)

// RunInit is the scratch image's init. It never returns normally: SIGPWR
// (how Incus stops a container), SIGTERM and SIGINT exit 0 at once. It keeps
// running when DHCP fails, reporting the error in the status file, because
// the probes then report check-failed and the engine decides.
func RunInit(cfg InitConfig) error {
	// It mounts filesystems and rewrites eth0 and resolv.conf: never on a host.
	if os.Getpid() != 1 {
		return errors.New("init mode runs only as PID 1 of a container")
	}
	cfg = cfg.withDefaults()
	sigs := make(chan os.Signal, 16)
	signal.Notify(sigs, unix.SIGPWR, unix.SIGTERM, unix.SIGINT, unix.SIGCHLD, unix.SIGHUP, sigRTMin3)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { _ = runInit(ctx, cfg, os.Stderr) }()
	for s := range sigs {
		switch s {
		case unix.SIGCHLD:
			reap()
		case unix.SIGHUP:
		default:
			fmt.Fprintf(os.Stderr, "claudebox-probe: %v: exiting\n", s)
			os.Exit(0)
		}
	}
	return errors.New("signal channel closed")
}

// reap collects every exited child: as PID 1 we inherit orphans from
// `incus exec` sessions, and unreaped zombies would pile up.
func reap() {
	for {
		var ws unix.WaitStatus
		pid, err := unix.Wait4(-1, &ws, unix.WNOHANG, nil)
		if pid <= 0 || err != nil {
			return
		}
	}
}

// runInit does the work of PID-1 mode and returns when ctx ends (tests).
func runInit(ctx context.Context, cfg InitConfig, log io.Writer) error {
	logf := func(format string, a ...any) { fmt.Fprintf(log, "claudebox-probe init: "+format+"\n", a...) }
	if !cfg.SkipMounts {
		for _, err := range mountBasics() {
			logf("%v", err)
		}
	}
	host := cfg.Hostname
	if host == "" {
		host, _ = os.Hostname()
	}
	st := &statusWriter{path: cfg.StatusFile, s: Status{Phase: "booting", Hostname: host, Iface: cfg.Iface}}
	st.update(func(*Status) {})

	if err := linkUp("lo"); err != nil {
		logf("lo: %v", err)
	}
	// Listeners bind wildcards, so they can start before the lease exists.
	ls, listenErr := Serve(ctx, cfg.Listen)
	if listenErr != nil {
		logf("listeners: %v", listenErr)
		st.update(func(s *Status) { s.Error = "listeners: " + listenErr.Error() })
	} else {
		defer ls.Close()
		st.update(func(s *Status) { s.TCP, s.UDP = boundPorts(ls) })
	}
	lease, err := dhcpUntilLease(ctx, cfg, host, st, logf)
	if err == nil {
		err = applyLease(cfg, lease)
		if err != nil {
			st.update(func(s *Status) { s.Phase, s.Error = "dhcp-failed", "applying lease: "+err.Error() })
		}
	}
	if err == nil {
		ack := lease.ACK
		ones, _ := ack.SubnetMask().Size()
		st.update(func(s *Status) {
			s.Ready, s.Phase, s.Error = true, "ready", ""
			if listenErr != nil { // the lease is fine but the box cannot be a target
				s.Ready, s.Error = false, "listeners: "+listenErr.Error()
			}
			s.IPv4 = fmt.Sprintf("%s/%d", ack.YourIPAddr, ones)
			if r := ack.Router(); len(r) > 0 {
				s.Gateway = r[0].String()
			}
			for _, d := range ack.DNS() {
				s.DNS = append(s.DNS, d.String())
			}
			s.Domain = ack.DomainName()
			lt := ack.IPAddressLeaseTime(0)
			s.LeaseSeconds = int(lt / time.Second)
			if lt > 0 {
				s.LeaseExpires = lease.CreationTime.Add(lt).UTC()
			}
		})
		logf("lease %s on %s", ack.YourIPAddr, cfg.Iface)
	}
	<-ctx.Done()
	return ctx.Err()
}

func boundPorts(ls *Listeners) (tcp, udp []int) {
	seen := map[int]bool{}
	for _, a := range ls.TCPAddrs {
		tcp = append(tcp, a.(*net.TCPAddr).Port)
	}
	for _, a := range ls.UDPAddrs {
		if p := a.(*net.UDPAddr).Port; !seen[p] {
			seen[p] = true
			udp = append(udp, p)
		}
	}
	return tcp, udp
}

// dhcpUntilLease retries DORA until it succeeds or ctx ends, reporting each
// failure in the status file so the engine need not wait blindly.
func dhcpUntilLease(ctx context.Context, cfg InitConfig, host string, st *statusWriter, logf func(string, ...any)) (*nclient4.Lease, error) {
	for attempt := 1; ; attempt++ {
		start := time.Now()
		st.update(func(s *Status) { s.Phase, s.DHCPAttempts = "dhcp", attempt })
		lease, err := DHCP(ctx, cfg.Iface, host, cfg.DHCPTimeout)
		if err == nil {
			st.update(func(s *Status) { s.DHCPMillis = time.Since(start).Milliseconds() })
			return lease, nil
		}
		logf("dhcp attempt %d: %v", attempt, err)
		st.update(func(s *Status) { s.Phase, s.Error = "dhcp-failed", "dhcp: "+err.Error() })
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(time.Second):
		}
	}
}

// DHCP brings iface up and runs one DORA exchange, sending the host name as
// option 12 the way cloud images do: the drill needs a box that announces its
// name to prove siblings still cannot resolve it.
func DHCP(ctx context.Context, iface, hostname string, timeout time.Duration) (*nclient4.Lease, error) {
	if err := waitLink(ctx, iface, timeout); err != nil {
		return nil, err
	}
	if err := linkUp(iface); err != nil {
		return nil, err
	}
	// Retries resend the same transaction, so a late offer still matches.
	c, err := nclient4.New(iface, nclient4.WithTimeout(time.Second), nclient4.WithRetry(int(timeout/time.Second)+1))
	if err != nil {
		return nil, fmt.Errorf("dhcp client on %s: %w", iface, err)
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	var mods []dhcpv4.Modifier
	if hostname != "" {
		mods = append(mods, dhcpv4.WithOption(dhcpv4.OptHostName(hostname)))
	}
	mods = append(mods, dhcpv4.WithRequestedOptions(dhcpv4.OptionSubnetMask, dhcpv4.OptionRouter,
		dhcpv4.OptionDomainNameServer, dhcpv4.OptionDomainName))
	lease, err := c.Request(ctx, mods...)
	if err != nil {
		return nil, fmt.Errorf("dhcp on %s: %w", iface, err)
	}
	return lease, nil
}

func waitLink(ctx context.Context, name string, max time.Duration) error {
	deadline := time.Now().Add(max)
	for {
		_, err := netlink.LinkByName(name)
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return fmt.Errorf("interface %s: %w", name, err)
		}
		if sleepCtx(ctx, 50*time.Millisecond) != nil {
			return fmt.Errorf("interface %s: %w", name, ctx.Err())
		}
	}
}

func linkUp(name string) error {
	l, err := netlink.LinkByName(name)
	if err != nil {
		return err
	}
	return netlink.LinkSetUp(l)
}

// applyLease sets the leased address, the default route and resolv.conf. The
// address gets no lifetime: the agent does not renew, and an address that
// vanished mid-drill would read as a network verdict.
func applyLease(cfg InitConfig, lease *nclient4.Lease) error {
	ack := lease.ACK
	link, err := netlink.LinkByName(cfg.Iface)
	if err != nil {
		return err
	}
	mask := ack.SubnetMask()
	if mask == nil {
		mask = net.CIDRMask(24, 32)
	}
	addr := &netlink.Addr{IPNet: &net.IPNet{IP: ack.YourIPAddr.To4(), Mask: mask}}
	if err := netlink.AddrReplace(link, addr); err != nil {
		return fmt.Errorf("address %s: %w", addr.IPNet, err)
	}
	routers := ack.Router()
	if len(routers) > 0 {
		rt := &netlink.Route{LinkIndex: link.Attrs().Index, Gw: routers[0].To4(),
			Dst: &net.IPNet{IP: net.IPv4zero.To4(), Mask: net.CIDRMask(0, 32)}}
		if err := netlink.RouteReplace(rt); err != nil {
			return fmt.Errorf("default route via %s: %w", routers[0], err)
		}
	}
	var b strings.Builder
	b.WriteString("# written by claudebox-probe from the DHCP lease\n")
	servers := ack.DNS()
	if len(servers) == 0 {
		servers = routers
	}
	for _, s := range servers {
		fmt.Fprintf(&b, "nameserver %s\n", s)
	}
	if d := ack.DomainName(); d != "" {
		fmt.Fprintf(&b, "search %s\n", d)
	}
	return writeFileAtomic(cfg.ResolvConf, []byte(b.String()))
}

// mountBasics mounts what a rootfs holding only /sbin/init lacks. LXC
// pre-mounts some of these; anything already a mount point is left alone
// (mounting again would stack, not fail).
func mountBasics() []error {
	var errs []error
	for _, m := range []struct{ target, fstype string }{
		{"/proc", "proc"}, {"/sys", "sysfs"}, {"/run", "tmpfs"}, {"/tmp", "tmpfs"},
	} {
		if isMountPoint(m.target) {
			continue
		}
		if err := os.MkdirAll(m.target, 0o755); err != nil {
			errs = append(errs, fmt.Errorf("mkdir %s: %w", m.target, err))
			continue
		}
		flags := uintptr(unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOEXEC)
		data := ""
		if m.fstype == "tmpfs" {
			data = "mode=0755"
		}
		err := unix.Mount(m.fstype, m.target, m.fstype, flags, data)
		if err != nil && !errors.Is(err, unix.EBUSY) {
			errs = append(errs, fmt.Errorf("mount %s: %w", m.target, err))
		}
	}
	return errs
}

// isMountPoint reads /proc/self/mountinfo (once /proc is there); before that
// only /proc itself is asked about, and a missing mountinfo means "no".
func isMountPoint(path string) bool {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return false
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) > 4 && fields[4] == path {
			return true
		}
	}
	return false
}

// statusWriter rewrites the status file atomically on every change, so a
// concurrent `cat` never sees half a document.
type statusWriter struct {
	mu   sync.Mutex
	path string
	s    Status
}

func (w *statusWriter) update(f func(*Status)) {
	w.mu.Lock()
	defer w.mu.Unlock()
	f(&w.s)
	w.s.Updated = time.Now().UTC()
	b, _ := json.Marshal(w.s)
	_ = writeFileAtomic(w.path, append(b, '\n'))
}

// WriteStatus writes s to path atomically (exported for the `serve`
// sub-command and tests).
func WriteStatus(path string, s Status) error {
	s.Updated = time.Now().UTC()
	b, err := json.Marshal(s)
	if err != nil {
		return err
	}
	return writeFileAtomic(path, append(b, '\n'))
}

// ReadStatus parses a status file.
func ReadStatus(path string) (Status, error) {
	var s Status
	b, err := os.ReadFile(path)
	if err != nil {
		return s, err
	}
	err = json.Unmarshal(b, &s)
	return s, err
}

func writeFileAtomic(path string, b []byte) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, b, 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}
