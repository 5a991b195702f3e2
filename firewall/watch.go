package firewall

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/google/nftables"
	"github.com/mdlayher/netlink"
)

// Generation is one nftables ruleset generation the kernel committed: who committed it and
// what it changed. The drill watches generations to notice a writer it did not expect
// during a probe batch (the batch is re-run, not judged) and to see Incus re-applying its
// firewall (the re-apply window rows need to know it happened while they flooded).
type Generation struct {
	At  time.Time `json:"at"`
	ID  uint32    `json:"id"`
	PID uint32    `json:"pid"` // the committing process (thread group)
	// TID is the committing thread, which is what the kernel reports (task_pid_nr): in a
	// multi-threaded committer such as a Go program it differs from PID on all but the main thread.
	TID     uint32   `json:"tid"`
	Comm    string   `json:"comm"`
	Changes []string `json:"changes"` // "delchain inet incus fwd.claudenet", "newrule inet incus acl.claudenet"
}

// Watcher records generations until Stop.
type Watcher struct {
	mu      sync.Mutex
	mon     *nftables.Monitor
	stopped bool
	gens    []Generation
	lost    int // times the kernel dropped events (the socket overflowed) and the watch resumed
	done    chan struct{}
}

// watchReadBuffer is the monitor socket's receive buffer: a firewall apply commits thousands
// of rule events at once, and an overflow (ENOBUFS) loses events.
const watchReadBuffer = 8 << 20

// Watch starts recording every generation committed from now on. When the kernel drops
// events (its socket overflowed) the watch resumes on a new socket and counts the loss
// (Lost): what was committed meanwhile is unknown.
func Watch() (*Watcher, error) {
	w := &Watcher{done: make(chan struct{})}
	ch, err := w.subscribe()
	if err != nil {
		return nil, err
	}
	go func() {
		defer close(w.done)
		for {
			w.record(ch)
			w.mu.Lock()
			stopped := w.stopped
			if !stopped {
				w.lost++
			}
			w.mu.Unlock()
			if stopped {
				return
			}
			if ch, err = w.subscribe(); err != nil {
				return
			}
		}
	}()
	return w, nil
}

func (w *Watcher) subscribe() (chan *nftables.MonitorEvents, error) {
	c, err := nftables.New(nftables.WithSockOptions(func(nc *netlink.Conn) error {
		return nc.SetReadBuffer(watchReadBuffer)
	}))
	if err != nil {
		return nil, err
	}
	mon := nftables.NewMonitor(nftables.WithMonitorEventBuffer(4096))
	ch, err := c.AddGenerationalMonitor(mon)
	if err != nil {
		return nil, fmt.Errorf("watching nftables: %w", err)
	}
	w.mu.Lock()
	w.mon = mon
	stopped := w.stopped
	w.mu.Unlock()
	if stopped {
		_ = mon.Close()
	}
	return ch, nil
}

// record reads one subscription until it ends (Stop, or an error the kernel reported).
func (w *Watcher) record(ch chan *nftables.MonitorEvents) {
	for evs := range ch {
		if evs.GeneratedBy != nil && evs.GeneratedBy.Error != nil {
			continue // the subscription's last event: the channel closes next
		}
		g := Generation{At: time.Now()}
		if evs.GeneratedBy != nil {
			if gm, ok := evs.GeneratedBy.Data.(*nftables.GenMsg); ok {
				g.ID, g.TID, g.Comm = gm.ID, gm.ProcPID, gm.ProcComm
				g.PID = processOf(gm.ProcPID)
			}
		}
		for _, ev := range evs.Changes {
			if s := describe(ev); s != "" {
				g.Changes = append(g.Changes, s)
			}
		}
		w.mu.Lock()
		w.gens = append(w.gens, g)
		w.mu.Unlock()
	}
}

// Lost is how many times events were dropped since Watch (0: the record is complete).
func (w *Watcher) Lost() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.lost
}

// Generations returns what was recorded so far.
func (w *Watcher) Generations() []Generation {
	w.mu.Lock()
	defer w.mu.Unlock()
	return append([]Generation(nil), w.gens...)
}

// Stop ends the watch and returns every generation recorded; the recording goroutine is
// gone when it returns.
func (w *Watcher) Stop() []Generation {
	w.mu.Lock()
	w.stopped = true
	mon := w.mon
	w.mu.Unlock()
	_ = mon.Close()
	<-w.done
	return w.Generations()
}

// processOf maps the thread id the kernel names a generation's committer by to its process
// (Tgid in /proc/<tid>/status, readable for any thread id), read as the generation arrives,
// while the committing thread most likely still runs. A thread already gone is left as it is.
func processOf(tid uint32) uint32 {
	if tid == 0 {
		return 0
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", tid))
	if err != nil {
		return tid
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "Tgid:"); ok {
			if n, err := strconv.ParseUint(strings.TrimSpace(v), 10, 32); err == nil {
				return uint32(n)
			}
		}
	}
	return tid
}

// ByOthers keeps the generations not committed by this process (any of its threads).
func ByOthers(gens []Generation) []Generation {
	me := uint32(os.Getpid())
	var out []Generation
	for _, g := range gens {
		if g.PID != me {
			out = append(out, g)
		}
	}
	return out
}

// Reapply is one re-apply of a managed network's firewall by Incus, as the watcher saw it.
type Reapply struct {
	Start time.Time // Incus deleted the first of the network's chains in its own table
	End   time.Time // its last change to them after that (the ACL rules come last)
}

// ReapplyOf finds the first re-apply of bridge's network in gens: Incus deletes the
// network's chains in `table inet incus` (fwd.B, pstrt.B, acl.B, ...) in separate
// generations and re-adds them about a second later.
func ReapplyOf(gens []Generation, bridge string) (Reapply, bool) {
	var r Reapply
	for _, g := range gens {
		for _, c := range g.Changes {
			f := strings.Fields(c)
			if len(f) != 4 || f[1] != "inet" || f[2] != "incus" || !strings.HasSuffix(f[3], "."+bridge) {
				continue
			}
			if r.Start.IsZero() && f[0] == "delchain" {
				r.Start = g.At
			}
			if !r.Start.IsZero() {
				r.End = g.At
			}
		}
	}
	return r, !r.Start.IsZero()
}

// ReapplyStarts is when each re-apply of bridge's network in gens began: every network update
// Incus makes deletes the network's chains, fwd.B first (measured on Incus 6.0.4: a raw.dnsmasq
// change and an ACL detach alike), so each delete of fwd.B is one re-apply.
func ReapplyStarts(gens []Generation, bridge string) []time.Time {
	var out []time.Time
	for _, g := range gens {
		for _, c := range g.Changes {
			if c == "delchain inet incus fwd."+bridge {
				out = append(out, g.At)
			}
		}
	}
	return out
}

func describe(ev *nftables.MonitorEvent) string {
	if ev.Error != nil {
		return ""
	}
	verb := map[nftables.MonitorEventType]string{
		nftables.MonitorEventTypeNewTable: "newtable", nftables.MonitorEventTypeDelTable: "deltable",
		nftables.MonitorEventTypeNewChain: "newchain", nftables.MonitorEventTypeDelChain: "delchain",
		nftables.MonitorEventTypeNewRule: "newrule", nftables.MonitorEventTypeDelRule: "delrule",
	}[ev.Type]
	if verb == "" {
		return ""
	}
	switch d := ev.Data.(type) {
	case *nftables.Table:
		return fmt.Sprintf("%s %s %s", verb, familyName(d.Family), d.Name)
	case *nftables.Chain:
		if d.Table != nil {
			return fmt.Sprintf("%s %s %s %s", verb, familyName(d.Table.Family), d.Table.Name, d.Name)
		}
	case *nftables.Rule:
		if d.Table != nil && d.Chain != nil {
			return fmt.Sprintf("%s %s %s %s", verb, familyName(d.Table.Family), d.Table.Name, d.Chain.Name)
		}
	}
	return verb
}

func familyName(f nftables.TableFamily) string {
	switch f {
	case nftables.TableFamilyINet:
		return "inet"
	case nftables.TableFamilyBridge:
		return "bridge"
	case nftables.TableFamilyIPv4:
		return "ip"
	case nftables.TableFamilyIPv6:
		return "ip6"
	}
	return fmt.Sprint(f)
}
