package incus

import (
	"errors"
	"fmt"
	"net/http"
	"strings"
)

// ErrNotFound matches (errors.Is) any API error with status 404.
var ErrNotFound = errors.New("not found")

// ErrConflict matches (errors.Is) any API error with status 409, or whose message says the
// object "already exists" (or, for operations that fail on a duplicate name, "UNIQUE
// constraint failed").
var ErrConflict = errors.New("already exists")

// ErrBusy matches (errors.Is) an API error saying the instance is busy running another
// operation (a start, stop, update, ... whose lock the daemon still holds): trying again
// once it ends is the cure.
var ErrBusy = errors.New("busy running another operation")

// StatusError is an error returned by the Incus API, either directly (Code is the HTTP or
// Incus error code) or as the failure of an operation (Operation is its id, Code its status
// code, usually 400).
type StatusError struct {
	Code      int
	Message   string // Incus's own error text
	Method    string // request that failed, when known
	Path      string
	Operation string // operation id, for a failed operation
}

func (e *StatusError) Error() string {
	switch {
	case e.Operation != "":
		return fmt.Sprintf("incus: operation %s failed: %s", e.Operation, e.Message)
	case e.Method != "":
		return fmt.Sprintf("incus: %s %s: %s (%d)", e.Method, e.Path, e.Message, e.Code)
	default:
		return fmt.Sprintf("incus: %s (%d)", e.Message, e.Code)
	}
}

// Is makes errors.Is(err, ErrNotFound), errors.Is(err, ErrConflict) and errors.Is(err,
// ErrBusy) work.
func (e *StatusError) Is(target error) bool {
	switch target {
	case ErrNotFound:
		return e.Code == http.StatusNotFound
	case ErrConflict:
		if e.Code == http.StatusConflict {
			return true
		}
		m := strings.ToLower(e.Message)
		// Some duplicates surface only as a database error inside an operation.
		return strings.Contains(m, "already exists") || strings.Contains(m, "unique constraint failed")
	case ErrBusy:
		return strings.Contains(strings.ToLower(e.Message), "is busy running")
	}
	return false
}

// OperationError is an alias kept for readability at call sites: a failed operation is
// reported as a *StatusError whose Operation field is set.
type OperationError = StatusError

// DaemonUnreachableError says the Incus daemon did not answer: its Unix socket is missing or
// refuses connections (Socket set), or an HTTPS remote could not be dialled (Remote set).
type DaemonUnreachableError struct {
	Socket string
	Remote string
	Err    error
}

func (e *DaemonUnreachableError) Error() string {
	if e.Socket == "" && e.Remote != "" {
		return fmt.Sprintf("the Incus remote at %s is not answering: %v", e.Remote, e.Err)
	}
	return fmt.Sprintf("the Incus daemon is not answering at %s: start it with 'make setup' (or 'systemctl start incus')", e.Socket)
}

func (e *DaemonUnreachableError) Unwrap() error { return e.Err }

// SocketPermissionError says the daemon's Unix socket is there but this user may not use it:
// the daemon is running, so "start it" would be the wrong advice.
type SocketPermissionError struct {
	Socket string
	Err    error
}

func (e *SocketPermissionError) Error() string {
	return fmt.Sprintf("permission denied on the Incus socket %s: the daemon is running, but this user may not talk to it: "+
		"run as root (sudo claudebox ...) or join the incus-admin group (sudo usermod -aG incus-admin $USER, then log in again)", e.Socket)
}

func (e *SocketPermissionError) Unwrap() error { return e.Err }

// UnknownRemoteError says Connect was given a remote name the incus CLI config does not have.
type UnknownRemoteError struct {
	Name   string
	Config string // the config file consulted
}

func (e *UnknownRemoteError) Error() string {
	where := ""
	if e.Config != "" {
		where = " in " + e.Config
	}
	return fmt.Sprintf("unknown Incus remote %q%s: see `incus remote list`", e.Name, where)
}
