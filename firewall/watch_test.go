package firewall

import (
	"fmt"
	"os"
	"slices"
	"testing"
	"time"

	"github.com/google/nftables"
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
	c, err := nftables.New()
	if err != nil {
		t.Fatal(err)
	}
	tb := c.AddTable(&nftables.Table{Name: name, Family: nftables.TableFamilyINet})
	if err := c.Flush(); err != nil {
		t.Fatal(err)
	}
	c.DelTable(tb)
	if err := c.Flush(); err != nil {
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
	if _, ok := ReapplyOf([]Generation{{Changes: []string{"delchain inet incus fwd.claudenet"}}}, "claudenet"); !ok {
		t.Error("ReapplyOf missed Incus deleting a chain of claudenet")
	}
	if _, ok := ReapplyOf(gens, "claudenet"); ok {
		t.Error("ReapplyOf saw a re-apply in our own table changes")
	}
}
