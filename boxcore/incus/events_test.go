package incus_test

import (
	"encoding/json"
	"testing"

	"github.com/claudebox/claudebox/boxcore/incus"
)

// The instance a lifecycle event names, from its source: a project query, a snapshot's or
// a log's path and an escaped name all name the instance; other sources and other event
// types name none.
func TestLifecycleInstance(t *testing.T) {
	for _, c := range []struct {
		typ, source, want string
	}{
		{"lifecycle", "/1.0/instances/box1", "box1"},
		{"lifecycle", "/1.0/instances/box1?project=p", "box1"},
		{"lifecycle", "/1.0/instances/box1/snapshots/s1", "box1"},
		{"lifecycle", "/1.0/instances/a%2Db", "a-b"},
		{"lifecycle", "/1.0/networks/claudenet", ""},
		{"operation", "/1.0/instances/box1", ""},
	} {
		meta, _ := json.Marshal(map[string]any{"action": "instance-started", "source": c.source})
		e := incus.Event{Type: c.typ, Metadata: meta}
		l, ok := e.Lifecycle()
		if got := l.Instance(); got != c.want || ok != (c.typ == "lifecycle") {
			t.Errorf("%s %s: instance %q (lifecycle %v), want %q", c.typ, c.source, got, ok, c.want)
		}
	}
}
