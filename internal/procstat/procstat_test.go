package procstat

import (
	"os"
	"testing"
)

// This process is alive with its own start time, not with another; a pid that does not run
// is not.
func TestAlive(t *testing.T) {
	st, err := StartTime(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	if !Alive(os.Getpid(), st) {
		t.Error("this process is not alive with its own start time")
	}
	if Alive(os.Getpid(), st+1) {
		t.Error("this process is alive with another start time")
	}
	if Alive(1<<30, st) || Alive(0, 0) {
		t.Error("a pid that does not run is alive")
	}
}
