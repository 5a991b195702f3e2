// Package drill is the isolation drill's engine: it mints real boxes on a stack, puts up
// decoy hosts we own, runs the claims table (data, claims.go) as probes from inside the
// boxes and from the host, and turns outcomes into verdicts that count only when their
// positive controls passed. `claudebox drill` and the Ginkgo suite (drill/specs) share it.
// docs/drill.md describes the matrix, the layers, and what was measured.
package drill

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"net/netip"
	"os"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/claudebox/claudebox/internal/netdump"
	"github.com/vishvananda/netlink"

	"github.com/claudebox/claudebox/boxcore"
	"github.com/claudebox/claudebox/boxcore/incus"
	"github.com/claudebox/claudebox/drill/image"
	"github.com/claudebox/claudebox/drill/probes"
	"github.com/claudebox/claudebox/firewall"
)

// Options configure a drill run.
type Options struct {
	Client *incus.Client
	Stack  boxcore.Stack
	Boxes  int  // at least 2
	VM     bool // VM mode: the box image plus the pushed binary (needs the Incus agent)
	// Image: container mode defaults to the scratch probe image built from Binary; VM mode
	// needs a VM image with the Incus agent.
	Image string
	// Binary is the static claudebox binary (os.Executable() for the CLI).
	Binary  string
	Keep    bool
	Version string
	// Progress gets one line per phase (nil: silent).
	Progress io.Writer
	// Timeout is the shared window of every probe (default 1 s).
	Timeout time.Duration
	// SelfTest runs the seeded holes after the matrix (mutates the host stack, restores it).
	SelfTest bool
	// Holes limits the self-test to these seeded holes (nil: all).
	Holes []string
	// Soak adds the soak to the first matrix: this many re-applies, then an incusd restart
	// and a host init drift repair, under one flood from every box (0: no soak).
	Soak int
	// Pause, for tests: the phase to stop at forever ("decoy-up", "minting", "probing").
	Pause string
}

// engine is one run's state.
type engine struct {
	o          Options
	c          *incus.Client
	run        string
	image      string
	binary     []byte
	boxes      []*Box
	gen        int
	resBox     *Box // the resource rows' own box (nil when none is up)
	resGen     int  // resource boxes minted so far
	decoy      *Decoy
	hostL      *probes.Listeners
	hostTCP    int
	hostUDP    int
	gateway    netip.Prefix
	foreign    *ForeignBox // the stand-in for another member's box (members.go)
	domain     string
	hostNames  []string
	hostAddrs  []netip.Addr
	peers      []Endpoint // the other cluster members' API addresses (cluster.go)
	hostFlow   *hostFlow  // the host's own live UDP flow to the public decoy (nat.go)
	netBefore  *incus.Network
	forwarder  string
	windowGen  int  // how many re-apply windows this run made
	serversSet bool // the forwarder was written to the network's servers-file
	admitted   bool // the public decoy's side was admitted as an uplink
	rounds     int  // matrices run so far
	start      time.Time
	lock       *os.File
	host       *boxcore.Host // the stack's layers: read, switched, the decoy admitted as an uplink
	phases     []Phase
	// Every re-apply of the network during the run is accounted for: reapplyWatch sees them,
	// spans say which ones a flood (or a seeded hole) covered.
	reapplyWatch *firewall.Watcher
	spansMu      sync.Mutex
	spans        []reapplySpan
	// The seeded hole being measured (nil outside the self-test), and the layers of it that
	// are the drill's own: the resource layers the lab does not tighten while it is open.
	hole       *Hole
	holeOff    []Layer
	diskBefore int64 // the stress box's root, referenced bytes, before the disk fill
	// The first box's exposure (exposure.go), and the lab's listeners beyond loopback while
	// its hole is open.
	exposure   netip.AddrPort
	exposedBox string
	exposing   <-chan error // the exposure under way (exposure.go)
	beyond     []net.Listener
}

// Phase is one timed step, for the progress lines and the record.
type Phase struct {
	Name    string        `json:"name"`
	Elapsed time.Duration `json:"elapsed_ns"`
}

// NewRunID returns a 6-character run id.
func NewRunID() string {
	const abc = "abcdefghijklmnopqrstuvwxyz0123456789"
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	for i := range b {
		b[i] = abc[int(b[i])%len(abc)]
	}
	return string(b)
}

func (e *engine) progress(format string, a ...any) {
	if e.o.Progress != nil {
		fmt.Fprintf(e.o.Progress, "drill: "+format+"\n", a...)
	}
}

func (e *engine) phase(name string, f func() error) error {
	t := time.Now()
	e.progress("%s ...", name)
	err := f()
	d := time.Since(t)
	e.phases = append(e.phases, Phase{name, d})
	if err != nil {
		e.progress("%s failed after %.2fs: %v", name, d.Seconds(), err)
		return err
	}
	e.progress("%s done (%.2fs)", name, d.Seconds())
	return nil
}

// pause parks the run forever at a phase when the test hook asks for it (SIGKILL tests).
func (e *engine) pause(phase string) {
	p := e.o.Pause
	if p == "" {
		p = os.Getenv("CLAUDEBOX_DRILL_PAUSE")
	}
	if p == phase {
		fmt.Fprintf(os.Stderr, "drill: paused at %s (pid %d)\n", phase, os.Getpid())
		select {}
	}
}

// LockPath serialises drills on a host: decoy addresses, routes and the dnsmasq forwarder
// are host-wide, so while a run holds it every other drill leftover is a dead run's.
const LockPath = "/run/claudebox-drill.lock"

func acquireLock() (*os.File, error) {
	f, err := os.OpenFile(LockPath, os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return nil, fmt.Errorf("drill lock: %w", err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		if err == nil {
			return f, nil
		}
		if time.Now().After(deadline) {
			f.Close()
			return nil, errors.New("another drill is running on this host (lock " + LockPath + ")")
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// Run runs the drill: the matrix, then the seeded holes when SelfTest is set. The report is
// returned even when the run failed part-way (with Error set).
func Run(ctx context.Context, o Options) (rep *Report, err error) {
	if o.Boxes < 2 {
		o.Boxes = 2
	}
	if o.Timeout == 0 {
		o.Timeout = time.Second
	}
	e := &engine{o: o, c: o.Client, run: NewRunID(), start: time.Now(), host: boxcore.NewHost(o.Client, o.Stack)}
	rep = e.newReport()
	lock, lerr := acquireLock()
	if lerr != nil {
		return nil, lerr
	}
	e.lock = lock
	defer lock.Close()
	// The host lock too: `host init`, teardown and the box verbs' port binding wait while a
	// run holds it, so nothing re-converges the stack in the middle of a seeded hole.
	unlockHost, lerr := boxcore.LockHost(ctx)
	if lerr != nil {
		return nil, lerr
	}
	defer unlockHost()
	unlockNet, lerr := boxcore.LockNetwork(ctx, o.Stack.Network)
	if lerr != nil {
		return nil, lerr
	}
	defer unlockNet()

	// Teardown runs detached from ctx (a Ctrl-C still cleans up), and deferred: a panic in
	// a phase must not leave boxes, decoys or the uplink admission behind.
	defer func() {
		tctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		// A teardown that failed left something behind: the run went wrong, whatever the verdict.
		if terr := e.phase("teardown", func() error { return e.teardown(tctx) }); terr != nil {
			err = errors.Join(err, fmt.Errorf("teardown: %w", terr))
		}
		rep.Reapplies = e.countReapplies()
		if rep.Reapplies.Seen > 0 {
			e.progress("re-applies of %s during the run: %s", e.o.Stack.Network, rep.Reapplies)
		}
		if rep.Reapplies.Unmeasured > 0 {
			e.progress("WARNING: %d re-apply window(s) of %s opened that no flood measured (another writer changed the network during the run?)", rep.Reapplies.Unmeasured, e.o.Stack.Network)
		}
		rep.Phases = e.phases
		rep.Wall = time.Since(e.start)
		if err != nil {
			rep.Error = err.Error()
		}
		rep.finish()
	}()
	err = e.runAll(ctx, rep)
	return rep, err
}

// reapplySpan is a stretch of the run during which a re-apply of the network is expected.
type reapplySpan struct {
	from, to time.Time
	hole     bool // a seeded hole's switch or restore, not a flood
}

// cover records that f ran under the boxes' floods (hole: a seeded hole's switch or restore).
func (e *engine) cover(hole bool, f func()) {
	from := time.Now()
	f()
	e.spansMu.Lock()
	e.spans = append(e.spans, reapplySpan{from: from, to: time.Now(), hole: hole})
	e.spansMu.Unlock()
}

// countReapplies stops the run's watch and sorts every re-apply it saw by the span that
// covered its start.
func (e *engine) countReapplies() ReapplyCount {
	var c ReapplyCount
	if e.reapplyWatch == nil {
		return c
	}
	starts := firewall.ReapplyStarts(e.reapplyWatch.Stop(), e.o.Stack.Network)
	c.WatchLost = e.reapplyWatch.Lost()
	e.spansMu.Lock()
	defer e.spansMu.Unlock()
	for _, at := range starts {
		c.Seen++
		i := slices.IndexFunc(e.spans, func(s reapplySpan) bool { return !at.Before(s.from) && !at.After(s.to) })
		switch {
		case i < 0:
			c.Unmeasured++
		case e.spans[i].hole:
			c.SeededHole++
		default:
			c.UnderFlood++
		}
	}
	return c
}

func (e *engine) newReport() *Report {
	return &Report{RunID: e.run, Started: e.start.UTC(), Stack: e.o.Stack.Network, Boxes: e.o.Boxes, InstanceType: e.instanceType()}
}

func (e *engine) runAll(ctx context.Context, rep *Report) error {
	if err := e.phase("sweep leftovers of dead runs", func() error {
		done, err := cleanupLocked(ctx, e.c)
		for _, d := range done {
			e.progress("  removed %s", d)
		}
		return err
	}); err != nil {
		return err
	}
	if err := e.readHost(ctx, rep); err != nil {
		return err
	}
	var err error
	if rep.LayersBefore, err = e.host.ReadLayers(ctx, nil); err != nil {
		return err
	}
	e.printLayers("layer state (read from the kernel before the run)", rep.LayersBefore)

	// From here on every re-apply of the network is accounted for (see countReapplies).
	if e.reapplyWatch, err = firewall.Watch(); err != nil {
		return err
	}
	// Decoys + forwarder and the probe image in parallel: they do not depend on each other.
	var imgErr error
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		imgErr = e.ensureImage(ctx)
	}()
	err = e.phase("decoy hosts up", func() error { return e.decoyUp(ctx) })
	wg.Wait()
	if err != nil {
		return err
	}
	if imgErr != nil {
		return imgErr
	}
	rep.Decoy = e.decoy
	rep.Forwarder = e.forwarder
	e.pause("decoy-up")
	extra := ""
	if e.wantsResBox() {
		extra = " (and one for the resource rows)"
	}
	if err := e.phase(fmt.Sprintf("minting %d %s boxes%s on %s", e.o.Boxes, e.instanceType(), extra, e.o.Stack.Profile), func() error {
		names, res := e.networkBoxNames(), ""
		if e.wantsResBox() {
			res = e.nextResBoxName()
			names = append(names, res)
		}
		bs, err := e.mint(ctx, names)
		for _, b := range bs {
			if b.Name == res {
				e.resBox = b
			} else {
				e.boxes = append(e.boxes, b)
			}
		}
		if err != nil {
			return err
		}
		return e.exposeFirstBox(ctx)
	}); err != nil {
		return err
	}
	rep.BoxList = slices.Clone(e.boxes)
	if e.resBox != nil {
		rep.BoxList = append(rep.BoxList, e.resBox)
	}
	var m *Matrix
	if err := e.phase("probing", func() error {
		e.pause("probing")
		var err error
		m, err = e.matrix(ctx)
		return err
	}); err != nil {
		return err
	}
	rep.Matrix = m
	if e.o.SelfTest {
		return e.phase("seeded holes", func() error { return e.selfTest(ctx, rep) })
	}
	return nil
}

// topology is what the lab built, for the model to plan on.
func (e *engine) topology() *Topology {
	t := &Topology{Boxes: e.boxes, Gateway: e.gateway, Domain: e.domain, HostAddrs: e.hostAddrs, HostNames: e.hostNames,
		HostTCP: e.hostTCP, HostUDP: e.hostUDP, Exposure: e.exposure, ExposedBox: e.exposedBox, Peers: e.peers}
	if e.hostFlow != nil {
		t.HostFlow = e.hostFlow.local
	}
	if e.foreign != nil {
		t.Foreign, t.ForeignMAC, t.ForeignIface = e.foreign.Addr, e.foreign.MAC, e.foreign.NSVeth
	}
	if e.decoy != nil {
		t.Decoys, t.Public, t.PublicName = e.decoy.Targets, e.decoy.Public, e.decoy.PublicName
		t.DecoyHostSide, t.Forged = e.decoy.LAN.HostAddr, e.decoy.Forged
		if !e.o.VM {
			t.Nested = nestedPrefix(e.decoy)
		}
	}
	t.Round, t.Bridge = e.rounds, e.o.Stack.Network
	// The resource rows: container boxes (a VM's limits are its own kernel's), in the plain
	// matrix and in the seeded holes that switch a resource layer off.
	t.Resources = e.plansResources()
	t.ResBox = e.resBox
	if e.rounds <= 1 {
		t.Soak = e.o.Soak // the first matrix only: the seeded holes do not soak
	}
	return t
}

// plansResources: the resource rows run in the plain matrix and in the seeded holes that
// switch a resource layer off (the other holes' layers cannot touch them).
func (e *engine) plansResources() bool {
	return e.wantsResBox() && (e.hole == nil || slices.ContainsFunc(e.hole.Off, isResourceLayer))
}

func (e *engine) instanceType() string {
	if e.o.VM {
		return "virtual-machine"
	}
	return "container"
}

// ensureImage imports (once, by content hash) the scratch probe image of the binary.
func (e *engine) ensureImage(ctx context.Context) error {
	b, err := os.ReadFile(e.o.Binary)
	if err != nil {
		return fmt.Errorf("reading the probe binary: %w", err)
	}
	e.binary = b
	if e.o.Image != "" {
		e.image = e.o.Image
		return nil
	}
	if e.o.VM {
		return boxcore.Usagef("drill --vm: pass --image with a VM image that has the Incus agent (e.g. images:debian/12/cloud)")
	}
	e.image, err = image.EnsureImage(ctx, e.c, e.o.Binary, "claudebox-probe")
	return err
}

// readHost reads what the rows need from the host: the bridge, its DNS domain, the host's
// names and addresses.
func (e *engine) readHost(ctx context.Context, rep *Report) error {
	n, _, err := e.c.Network(ctx, e.o.Stack.Network)
	if err != nil {
		return fmt.Errorf("network %s: %w (run 'claudebox host init' first)", e.o.Stack.Network, err)
	}
	e.netBefore = &n
	e.gateway, err = netip.ParsePrefix(n.Config["ipv4.address"])
	if err != nil {
		return fmt.Errorf("network %s has no IPv4 address", n.Name)
	}
	e.domain = n.Config["dns.domain"]
	if e.domain == "" {
		e.domain = "incus"
	}
	hn, _ := os.Hostname()
	e.hostNames = append(e.hostNames, hn)
	if b, err := os.ReadFile("/etc/hosts"); err == nil {
		for _, l := range strings.Split(string(b), "\n") {
			if i := strings.IndexByte(l, '#'); i >= 0 {
				l = l[:i]
			}
			f := strings.Fields(l)
			for _, name := range f[min(1, len(f)):] {
				if !slices.Contains(e.hostNames, name) {
					e.hostNames = append(e.hostNames, name)
				}
			}
		}
	}
	// Host addresses: every IPv4 address on an interface that is not a bridge (other
	// stacks' bridges come and go), plus our gateway.
	e.hostAddrs = []netip.Addr{e.gateway.Addr()}
	links, _ := netdump.Links()
	for _, l := range links {
		if l.Type() == "bridge" || strings.HasPrefix(l.Attrs().Name, VethPrefix) {
			continue
		}
		addrs, _ := netdump.Addrs(l, netlink.FAMILY_V4)
		for _, a := range addrs {
			ip, ok := netip.AddrFromSlice(a.IP.To4())
			if ok && !ip.IsLoopback() && !slices.Contains(e.hostAddrs, ip) {
				e.hostAddrs = append(e.hostAddrs, ip)
			}
		}
	}
	rep.Host = hostInfo(ctx, e.c)
	e.peers, err = clusterPeers(ctx, e.c)
	return err
}

// decoyUp creates the decoy namespace, the host listener and the dnsmasq forwarder.
func (e *engine) decoyUp(ctx context.Context) error {
	d, err := PlanDecoy(e.run)
	if err != nil {
		return err
	}
	if err := d.Up(); err != nil {
		return err
	}
	e.decoy = d
	for _, t := range d.Targets {
		e.progress("  decoy %-26s %s", t.Range, t.Addr)
	}
	if err := e.foreignUp(ctx); err != nil {
		return err
	}
	ls, err := probes.Serve(context.Background(), probes.ListenerConfig{TCP: []int{0}, UDP: []int{0}})
	if err != nil {
		return fmt.Errorf("host listener: %w", err)
	}
	e.hostL = ls
	e.hostTCP = ls.TCPAddrs[0].(*net.TCPAddr).Port
	e.hostUDP = ls.UDPAddrs[0].(*net.UDPAddr).Port
	if e.hostFlow, err = startHostFlow(d.Public); err != nil {
		return err
	}
	e.progress("  announce: the wall lets box egress leave by %s too during the run (the public decoy's side; %s on %s, removed afterwards)", d.Uplink.HostVeth, boxcore.UplinksKey, e.o.Stack.Network)
	e.admitted = true
	if err := e.host.SetAdmittedUplinks(ctx, []string{d.Uplink.HostVeth}); err != nil {
		return fmt.Errorf("admitting the public decoy as an uplink: %w", err)
	}
	// The forwarder goes in the network's servers-file, which dnsmasq re-reads on SIGHUP: no
	// change to the network, so no re-apply window that no flood measures, now or at the end.
	if !boxcore.NamesServersFile(e.netBefore.Config["raw.dnsmasq"], e.o.Stack.Network) {
		return fmt.Errorf("network %s does not name its dnsmasq servers-file (%s), where the drill puts its test-domain forwarder: run 'claudebox host init' first", e.o.Stack.Network, boxcore.ServersFile(e.o.Stack.Network))
	}
	e.forwarder = ForwarderLine(e.domain, e.gateway, d.Public)
	e.progress("  announce: the bridge's dnsmasq forwards the drill's names to the decoy during the run: %s holds %q (re-read on SIGHUP, no re-apply; emptied afterwards)", boxcore.ServersFile(e.o.Stack.Network), e.forwarder)
	e.serversSet = true
	if err := boxcore.LocalKernel().SetServers(e.o.Stack.Network, []string{e.forwarder}); err != nil {
		return fmt.Errorf("setting the test-domain forwarder: %w", err)
	}
	e.progress("  announce: each matrix makes Incus re-apply %s once (its re-apply mark becomes %q; it stays so), while the boxes flood: the re-apply window rows", e.o.Stack.Network, WindowMark(e.run, 1))
	return nil
}

// reapply makes Incus re-apply the network (and restart dnsmasq) by a new value of its
// re-apply mark: the run's windows, each opened under the boxes' floods.
func (e *engine) reapply(ctx context.Context) error {
	n, _, err := e.c.Network(ctx, e.o.Stack.Network)
	if err != nil {
		return err
	}
	cfg := maps.Clone(n.Config)
	cfg["raw.dnsmasq"] = boxcore.WithReapplyMark(n.Config["raw.dnsmasq"], WindowMark(e.run, e.windowGen))
	if err := boxcore.PutNetworkConfig(ctx, e.c, n.Name, cfg); err != nil {
		return fmt.Errorf("re-applying %s: %w", n.Name, err)
	}
	return nil
}

func stripForwarder(raw string) []string {
	var out []string
	for _, l := range strings.Split(raw, "\n") {
		if strings.TrimSpace(l) != "" && !IsForwarderLine(l) {
			out = append(out, l)
		}
	}
	return out
}

func (e *engine) teardown(ctx context.Context) error {
	_ = e.awaitExposure() // never delete a box under its exposure's write
	var errs []error
	var boxesErr error
	var wg sync.WaitGroup
	if !e.o.Keep {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, boxesErr = deleteTagged(ctx, e.c, func(in incus.Instance) bool { return in.Config[DrillTag] == e.run })
		}()
	} else if len(e.boxes) > 0 {
		e.progress("  --keep: boxes left running: %s (remove with 'claudebox drill --cleanup')", boxNames(e.boxes))
	}
	if e.serversSet {
		if err := boxcore.LocalKernel().SetServers(e.o.Stack.Network, nil); err != nil {
			errs = append(errs, fmt.Errorf("removing the test-domain forwarder: %w", err))
		} else {
			e.progress("  emptied %s (forwarder removed, no re-apply)", boxcore.ServersFile(e.o.Stack.Network))
		}
	}
	if e.hostL != nil {
		_ = e.hostL.Close()
	}
	if e.hostFlow != nil {
		e.hostFlow.stop()
	}
	if e.decoy != nil {
		e.decoy.Down()
	}
	if e.foreign != nil {
		e.foreign.Down()
	}
	// The wall is re-applied once the boxes are gone: an apply while they are being deleted
	// would bind ports that vanish under it and leave their bindings stale.
	wg.Wait()
	if boxesErr != nil {
		errs = append(errs, fmt.Errorf("%w (claudebox drill --cleanup removes what is left)", boxesErr))
	}
	if e.admitted {
		if err := e.host.SetAdmittedUplinks(ctx, nil); err != nil {
			errs = append(errs, fmt.Errorf("restoring the wall's uplinks: %w", err))
		} else {
			e.progress("  restored the wall's uplinks")
		}
	}
	return errors.Join(errs...)
}

func boxNames(bs []*Box) string {
	var s []string
	for _, b := range bs {
		if b != nil {
			s = append(s, b.Name)
		}
	}
	return strings.Join(s, ", ")
}
