// Package procstat tells a live process from a reused pid: an owner record holds a pid and
// that process's start time, and only the same pair is the same process.
package procstat

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
)

// StartTime is a process's start time (field 22 of /proc/<pid>/stat, clock ticks since boot).
func StartTime(pid int) (uint64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	i := bytes.LastIndexByte(b, ')') // the command name may hold spaces and parentheses
	if i < 0 {
		return 0, errors.New("malformed stat")
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 20 {
		return 0, errors.New("malformed stat")
	}
	return strconv.ParseUint(f[19], 10, 64)
}

// Alive reports whether pid still is the process that started at start.
func Alive(pid int, start uint64) bool {
	got, err := StartTime(pid)
	return pid > 0 && err == nil && got == start
}
