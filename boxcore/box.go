package boxcore

import (
	"context"
	"errors"
	"regexp"

	"github.com/claudebox/claudebox/boxcore/incus"
)

// Box is an Incus instance claudebox minted: it carries user.claudebox=1.
type Box struct {
	Name     string
	Instance incus.Instance
	ETag     string
}

// Running reports whether the box is running (or otherwise not stopped).
func (b *Box) Running() bool { return b.Instance.Status != "Stopped" }

// IsBox reports whether an instance carries the tag.
func IsBox(in incus.Instance) bool { return in.Config[TagKey] == "1" }

// Incus's instance name rules: 1-63 characters, letters, digits and hyphens, not starting
// with a digit or a hyphen, not ending with a hyphen.
var nameRE = regexp.MustCompile(`^[A-Za-z]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?$`)

// ValidateName rejects names Incus would refuse, before anything is asked of the daemon.
func ValidateName(name string) error {
	if !nameRE.MatchString(name) {
		return Usagef("invalid box name %q: 1-63 letters, digits and hyphens, starting with a letter and not ending with a hyphen", name)
	}
	return nil
}

// NoSuchBox is the one answer for anything that is not a box, tagged or not, so the boundary
// leaks nothing about instances claudebox did not mint.
func NoSuchBox(name string) error {
	return Usagef("no such box: %s (see 'claudebox list')", name)
}

// Resolve finds a box by name. This is the boundary: every verb goes through it.
func Resolve(ctx context.Context, c *incus.Client, name string) (*Box, error) {
	if err := ValidateName(name); err != nil {
		return nil, NoSuchBox(name)
	}
	in, etag, err := c.Instance(ctx, name)
	if errors.Is(err, incus.ErrNotFound) {
		return nil, NoSuchBox(name)
	}
	if err != nil {
		return nil, err
	}
	if !IsBox(in) {
		return nil, NoSuchBox(name)
	}
	return &Box{Name: in.Name, Instance: in, ETag: etag}, nil
}
