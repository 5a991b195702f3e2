package boxcore

import (
	"context"
	"errors"
	"regexp"
	"strconv"
	"strings"

	"github.com/claudebox/claudebox/boxcore/incus"
)

// Box is an Incus instance claudebox minted: it carries user.claudebox=1.
type Box struct {
	Name     string
	Instance incus.Instance
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
	in, _, err := c.Instance(ctx, name)
	if errors.Is(err, incus.ErrNotFound) {
		return nil, NoSuchBox(name)
	}
	if err != nil {
		return nil, err
	}
	if !IsBox(in) {
		return nil, NoSuchBox(name)
	}
	return &Box{Name: in.Name, Instance: in}, nil
}

var (
	cpuCountRE = regexp.MustCompile(`^[0-9]+$`)
	cpuSetRE   = regexp.MustCompile(`^[0-9]+(-[0-9]+)?(,[0-9]+(-[0-9]+)?)*$`)
	sizeRE     = regexp.MustCompile(`^([0-9]+(\.[0-9]+)?)(B|kB|MB|GB|TB|PB|EB|KiB|MiB|GiB|TiB|PiB|EiB)?$`)
	percentRE  = regexp.MustCompile(`^([0-9]+)%$`)
)

// ValidateResources checks --cpu, --memory and --disk before anything reaches Incus, and says
// what to type instead. Empty means "the template's default".
func ValidateResources(cpu, memory, disk string) error {
	if cpu != "" {
		ok := false
		if cpuCountRE.MatchString(cpu) {
			n, err := strconv.Atoi(cpu)
			ok = err == nil && n >= 1
		} else if cpuSetRE.MatchString(cpu) {
			ok = true
			for _, part := range strings.Split(cpu, ",") {
				if lo, hi, isRange := strings.Cut(part, "-"); isRange {
					a, _ := strconv.Atoi(lo)
					b, _ := strconv.Atoi(hi)
					ok = ok && a <= b
				}
			}
		}
		if !ok {
			return Usagef("new: --cpu %q: want a number of CPUs, 1 or more (e.g. --cpu 2), or a set of CPUs to pin (e.g. --cpu 0-3 or --cpu 0,2)", cpu)
		}
	}
	if memory != "" && !positiveSize(memory, true) {
		return Usagef("new: --memory %q: want a size above zero with a unit, e.g. --memory 4GiB or 512MiB (units B, kB, MB, GB, KiB, MiB, GiB, TiB), or a share of the host's, e.g. 50%%", memory)
	}
	if disk != "" && !positiveSize(disk, false) {
		return Usagef("new: --disk %q: want a size above zero with a unit, e.g. --disk 20GiB or 500MiB (units B, kB, MB, GB, KiB, MiB, GiB, TiB)", disk)
	}
	return nil
}

func positiveSize(s string, percent bool) bool {
	if m := percentRE.FindStringSubmatch(s); m != nil {
		n, _ := strconv.Atoi(m[1])
		return percent && n > 0 && n <= 100
	}
	m := sizeRE.FindStringSubmatch(s)
	if m == nil {
		return false
	}
	f, err := strconv.ParseFloat(m[1], 64)
	return err == nil && f > 0
}
