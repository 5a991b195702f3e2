package firewall

import (
	"fmt"
	"os"
	"runtime"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/google/nftables"
	"golang.org/x/sys/unix"
)

// The watcher sees a generation this process commits (an empty table added and removed)
// with our pid, and ByOthers drops it.
func TestWatchSeesGenerations(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root")
	}
	w, err := Watch()
	if err != nil {
		t.Fatal(err)
	}
	name := fmt.Sprintf("cbwatch_%d", os.Getpid())
	// The kernel names the committing thread, not the process: commit from a thread other
	// than the main one (as a Go program's goroutines mostly do), which ByOthers must still
	// count as ours.
	tid, release, err := onOtherThread(func() error {
		c, err := nftables.New()
		if err != nil {
			return err
		}
		tb := c.AddTable(&nftables.Table{Name: name, Family: nftables.TableFamilyINet})
		if err := c.Flush(); err != nil {
			return err
		}
		c.DelTable(tb)
		return c.Flush()
	})
	defer release()
	if err != nil {
		t.Fatal(err)
	}
	var gens []Generation
	for deadline := time.Now().Add(2 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		if gens = w.Generations(); len(gens) >= 2 {
			break
		}
	}
	gens = w.Stop()
	var mine []string
	for _, g := range gens {
		if g.PID == uint32(os.Getpid()) {
			mine = append(mine, g.Changes...)
			if g.TID != uint32(tid) {
				t.Errorf("generation %+v: thread %d, want %d", g, g.TID, tid)
			}
		}
	}
	for _, want := range []string{"newtable inet " + name, "deltable inet " + name} {
		if !slices.Contains(mine, want) {
			t.Errorf("watcher missed %q; saw %+v", want, gens)
		}
	}
	for _, g := range ByOthers(gens) {
		if g.PID == uint32(os.Getpid()) {
			t.Errorf("ByOthers kept our own generation %+v", g)
		}
	}
	t0 := time.Now()
	r, ok := ReapplyOf([]Generation{
		{At: t0, Changes: []string{"newrule inet incus acl.claudenet"}},
		{At: t0.Add(time.Millisecond), Changes: []string{"delchain inet incus fwd.claudenet"}},
		{At: t0.Add(2 * time.Millisecond), Changes: []string{"delchain inet incus fwd.other"}},
		{At: t0.Add(time.Second), Changes: []string{"newrule inet incus acl.claudenet"}},
	}, "claudenet")
	if !ok || !r.Start.Equal(t0.Add(time.Millisecond)) || !r.End.Equal(t0.Add(time.Second)) {
		t.Errorf("ReapplyOf = %+v %v, want the span from the first delete to the last re-add", r, ok)
	}
}

// onOtherThread runs f on an OS thread of this process that is not its main thread and
// returns that thread's id. The thread lives on until release is called: a locked thread
// ends with its goroutine, and the watcher maps a committing thread to its process by
// reading /proc/<tid>, which a thread already gone no longer has.
func onOtherThread(f func() error) (tid int, release func(), err error) {
	for range 100 {
		type result struct {
			tid int
			err error
		}
		ch := make(chan result)
		done := make(chan struct{})
		go func() {
			runtime.LockOSThread() // never unlocked: the thread goes with the goroutine
			tid := unix.Gettid()
			if tid == os.Getpid() {
				ch <- result{tid: tid}
				return
			}
			ch <- result{tid, f()}
			<-done
		}()
		if r := <-ch; r.tid != os.Getpid() {
			return r.tid, sync.OnceFunc(func() { close(done) }), r.err
		}
	}
	return 0, func() {}, fmt.Errorf("no thread but the main one")
}

// ReapplyStarts counts one re-apply per delete of the network's fwd chain, and only that
// network's.
func TestReapplyStarts(t *testing.T) {
	t0 := time.Now()
	gens := []Generation{
		{At: t0, Changes: []string{"delchain inet incus fwd.net0", "delchain inet incus pstrt.net0"}},
		{At: t0.Add(time.Second), Changes: []string{"newchain inet incus fwd.net0"}},
		{At: t0.Add(2 * time.Second), Changes: []string{"delchain inet incus fwd.net1"}},
		{At: t0.Add(3 * time.Second), Changes: []string{"delchain inet incus fwd.net0"}},
	}
	got := ReapplyStarts(gens, "net0")
	if len(got) != 2 || !got[0].Equal(t0) || !got[1].Equal(t0.Add(3*time.Second)) {
		t.Fatalf("ReapplyStarts = %v", got)
	}
}
