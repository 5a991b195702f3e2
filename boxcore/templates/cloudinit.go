package templates

import (
	"encoding/json"
	"fmt"
	"slices"
	"strconv"
	"strings"
)

// Waiting for cloud-init, for `new`.
//
// What to poll: run WaitCommand in the box (`cloud-init status --wait --format json`). It
// blocks while cloud-init is "not run" or "running" — so it is safe to start right after
// the instance starts, before cloud-init's first stage — and then prints the final status
// as JSON and exits 0 when done, 1 on error (2 on "degraded" from cloud-init 23.4 on).
// Bound it with a context deadline; on a VM, retry the exec until the guest agent answers.
// Parse stdout with ParseStatus: Failed() says whether the box is usable.
//
// On failure: FailingStage, fed the output of StageCommand (`cat /run/cloud-init/status.json`;
// not the files API, the path is a symlink), names the first stage that recorded errors (init-local,
// init, modules-config, modules-final) with its errors, and LogTailCommand(n) prints the
// last n lines of CloudInitOutputLog (/var/log/cloud-init-output.log: every module's and
// runcmd's stdout/stderr, including the Claude install script's).
//
// Timing: InstallRecord (JSON) holds the Claude install's duration; the stages' start and
// finish times are in StageFile.

// Paths in the box.
const (
	CloudInitOutputLog = "/var/log/cloud-init-output.log"
	StageFile          = "/run/cloud-init/status.json"
)

// WaitCommand blocks until cloud-init has finished and prints its status as JSON.
func WaitCommand() []string { return []string{"cloud-init", "status", "--wait", "--format", "json"} }

// LogTailCommand prints the last n lines of cloud-init's output log.
func LogTailCommand(n int) []string {
	return []string{"tail", "-n", strconv.Itoa(n), CloudInitOutputLog}
}

// CloudInitStatus is `cloud-init status --format json` (22.4 and later).
type CloudInitStatus struct {
	// Status: "not run", "running", "done", "error", "disabled".
	Status string `json:"status"`
	// ExtendedStatus (23.4+): e.g. "degraded done" when a recoverable error happened.
	ExtendedStatus string   `json:"extended_status"`
	BootStatusCode string   `json:"boot_status_code"`
	Datasource     string   `json:"datasource"`
	Detail         string   `json:"detail"`
	Errors         []string `json:"errors"`
	LastUpdate     string   `json:"last_update"`
}

// ParseStatus decodes the output of WaitCommand.
func ParseStatus(b []byte) (CloudInitStatus, error) {
	var s CloudInitStatus
	if err := json.Unmarshal(b, &s); err != nil {
		return s, fmt.Errorf("cloud-init status: not JSON (%w): %q", err, truncate(string(b), 200))
	}
	if s.Status == "" {
		return s, fmt.Errorf("cloud-init status: no status in %q", truncate(string(b), 200))
	}
	return s, nil
}

// Finished reports whether cloud-init is no longer running or pending.
func (s CloudInitStatus) Finished() bool { return s.Status != "not run" && s.Status != "running" }

// Failed reports whether the box did not come up as its user-data asked: anything but a
// clean "done" (errors, "disabled": the user-data never ran, or not finished yet).
func (s CloudInitStatus) Failed() bool { return s.Status != "done" || len(s.Errors) > 0 }

// Summary is one line for a user: status, datasource and the first error.
func (s CloudInitStatus) Summary() string {
	out := "cloud-init " + s.Status
	if s.ExtendedStatus != "" && s.ExtendedStatus != s.Status {
		out += " (" + s.ExtendedStatus + ")"
	}
	if s.Datasource != "" {
		out += ", datasource " + s.Datasource
	}
	if len(s.Errors) > 0 {
		out += ": " + s.Errors[0]
		if len(s.Errors) > 1 {
			out += fmt.Sprintf(" (and %d more)", len(s.Errors)-1)
		}
	}
	if s.Status == "disabled" {
		out += ": " + s.Detail
	}
	return out
}

// Stage is one cloud-init stage from StageFile.
type Stage struct {
	Name     string
	Start    float64 // unix seconds; 0 when it has not started
	Finished float64 // unix seconds; 0 when it has not finished
	Errors   []string
}

// StageOrder is the order cloud-init runs its stages in.
var StageOrder = []string{"init-local", "init", "modules-config", "modules-final"}

// ParseStages decodes StageFile ({"v1": {"init-local": {...}, ..., "stage": ...}}).
func ParseStages(b []byte) ([]Stage, error) {
	var doc struct {
		V1 map[string]json.RawMessage `json:"v1"`
	}
	if err := json.Unmarshal(b, &doc); err != nil {
		return nil, fmt.Errorf("cloud-init %s: %w", StageFile, err)
	}
	var out []Stage
	for _, name := range StageOrder {
		raw, ok := doc.V1[name]
		if !ok {
			continue
		}
		var st struct {
			Start    *float64 `json:"start"`
			Finished *float64 `json:"finished"`
			Errors   []any    `json:"errors"`
		}
		if err := json.Unmarshal(raw, &st); err != nil {
			continue // not a stage object
		}
		s := Stage{Name: name}
		if st.Start != nil {
			s.Start = *st.Start
		}
		if st.Finished != nil {
			s.Finished = *st.Finished
		}
		for _, e := range st.Errors {
			s.Errors = append(s.Errors, fmt.Sprint(e))
		}
		out = append(out, s)
	}
	return out, nil
}

// FailingStage returns the first stage of StageFile's content that recorded errors, or the
// stage that started but never finished; ok is false when every stage is clean.
func FailingStage(b []byte) (st Stage, ok bool, err error) {
	stages, err := ParseStages(b)
	if err != nil {
		return Stage{}, false, err
	}
	if i := slices.IndexFunc(stages, func(s Stage) bool { return len(s.Errors) > 0 }); i >= 0 {
		return stages[i], true, nil
	}
	if i := slices.IndexFunc(stages, func(s Stage) bool { return s.Start > 0 && s.Finished == 0 }); i >= 0 {
		return stages[i], true, nil
	}
	return Stage{}, false, nil
}

func truncate(s string, n int) string {
	s = strings.TrimSpace(s)
	if len(s) > n {
		return s[:n] + "…"
	}
	return s
}

// StageCommand prints StageFile. Read it with exec, not the files API: in the box it is a
// symlink (to /var/lib/cloud/data/status.json), and Incus's files API returns a symlink's
// target path rather than the file.
func StageCommand() []string { return []string{"cat", StageFile} }
