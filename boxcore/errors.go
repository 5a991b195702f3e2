package boxcore

import (
	"errors"
	"fmt"
	"strings"

	"github.com/claudebox/claudebox/boxcore/incus"
)

// UsageError means the caller asked for something wrong (exit 2); every other error means
// something went wrong while doing what was asked (exit 1).
type UsageError struct{ Msg string }

func (e *UsageError) Error() string { return e.Msg }

// Usage marks a usage error (see IsUsage).
func (e *UsageError) Usage() bool { return true }

// Usagef builds a UsageError.
func Usagef(format string, args ...any) error {
	return &UsageError{Msg: fmt.Sprintf(format, args...)}
}

// IsUsage reports whether err is, or wraps, a usage error: a UsageError or a domain error
// whose Usage method says so.
func IsUsage(err error) bool {
	var u interface{ Usage() bool }
	return errors.As(err, &u) && u.Usage()
}

// The domain errors below say what is wrong in the domain's words; what a person can do about
// it (a command to run, a flag to pass) is the CLI's to say (cli renders them with hints).

// StackMissingError: a piece of the host stack that a verb needs is not there, or not usable.
type StackMissingError struct {
	Object string // "network claudenet", "profile claude-dev"
	Detail string // "does not exist", "has no IPv4 address (\"\")"
	// AsUsage: the caller asked for something the missing stack makes impossible (exit 2),
	// rather than a step failing (exit 1).
	AsUsage bool
}

func (e *StackMissingError) Error() string { return e.Object + " " + e.Detail }

// Usage reports whether the missing stack is the caller's error.
func (e *StackMissingError) Usage() bool { return e.AsUsage }

// NoStoragePoolError: Incus has no storage pool for the profile's root disk.
type NoStoragePoolError struct{}

func (e *NoStoragePoolError) Error() string { return "Incus has no storage pool" }

// SubnetTakenError: the subnet asked for is used by something else on the host.
type SubnetTakenError struct{ Subnet, By string }

func (e *SubnetTakenError) Error() string {
	return fmt.Sprintf("subnet %s is already used by %s", e.Subnet, e.By)
}

// Usage: the subnet was the caller's choice.
func (e *SubnetTakenError) Usage() bool { return true }

// NoFreeSubnetError: no /24 in 10.0.0.0/8 is free for the bridge.
type NoFreeSubnetError struct{}

func (e *NoFreeSubnetError) Error() string { return "no free /24 in 10.0.0.0/8" }

// OptionError: an option's value cannot be used. Option is its name without dashes
// ("subnet", "dns"); Want says what would do.
type OptionError struct {
	Option, Value, Want string
	Err                 error // the cause, if any
}

func (e *OptionError) Error() string {
	msg := fmt.Sprintf("invalid %s %q: %s", e.Option, e.Value, e.Want)
	if e.Err != nil {
		msg += ": " + e.Err.Error()
	}
	return msg
}

func (e *OptionError) Unwrap() error { return e.Err }

// Usage: a value the caller gave.
func (e *OptionError) Usage() bool { return true }

// StackInUseError: teardown refused because boxes use the stack (forcing it detaches them).
type StackInUseError struct{ Boxes []string }

func (e *StackInUseError) Error() string {
	return fmt.Sprintf("%d box(es) use the stack (%s)", len(e.Boxes), strings.Join(e.Boxes, ", "))
}

// Usage: the caller may remove the boxes or force the teardown.
func (e *StackInUseError) Usage() bool { return true }

// ForeignUserError: instances claudebox did not mint use a stack object; claudebox never
// touches them, so the object cannot go.
type ForeignUserError struct {
	Object    string // "profile claude-dev", "network claudenet"
	Instances []string
}

func (e *ForeignUserError) Error() string {
	return fmt.Sprintf("%s is used by %s, which claudebox did not mint and will not touch", e.Object, strings.Join(e.Instances, ", "))
}

// Usage: the caller must detach them first.
func (e *ForeignUserError) Usage() bool { return true }

// ChangedError: an Incus object changed between the moment claudebox read it and its write
// (the write carried the read's ETag, and Incus refused it): someone else wrote it meanwhile,
// and nothing of theirs was overwritten.
type ChangedError struct {
	Object string // "network claudenet"
	Err    error
}

func (e *ChangedError) Error() string {
	return e.Object + " was changed by someone else after it was read; nothing was overwritten"
}

func (e *ChangedError) Unwrap() error { return e.Err }

// changed turns Incus's refusal of an ETag-checked write (412) into a ChangedError for object.
func changed(object string, err error) error {
	if err != nil && incus.IsPreconditionFailed(err) {
		return &ChangedError{Object: object, Err: err}
	}
	return err
}
