package boxcore

import (
	"strings"
)

// HatchArgs substitutes the instance name for every "{}" in the escape hatch's arguments, or
// appends it when there is none. ref is the instance as the incus CLI names it ("box", or
// "remote:box").
func HatchArgs(args []string, ref string) []string {
	out := make([]string, 0, len(args)+1)
	found := false
	for _, a := range args {
		if strings.Contains(a, "{}") {
			found = true
			a = strings.ReplaceAll(a, "{}", ref)
		}
		out = append(out, a)
	}
	if !found {
		out = append(out, ref)
	}
	return out
}

// offStackWords are arguments that can attach, detach or reconfigure what isolates a box.
var offStackWords = map[string]string{
	"profile":       "profiles",
	"profiles":      "profiles",
	"--profile":     "profiles",
	"-p":            "profiles",
	"--no-profiles": "profiles",
	"network":       "networks",
	"--network":     "networks",
	"-n":            "networks",
	"device":        "devices",
	"devices":       "devices",
	"--device":      "devices",
	"-d":            "devices",
	"nic":           "a NIC",
	"edit":          "the whole configuration (edit)",
	"rebuild":       "the root disk (rebuild)",
	"move":          "placement or network (move)",
}

// offStackPrefixes are config keys that change the trust boundary itself.
var offStackPrefixes = []string{"security.", "raw.", "linux.", "volatile.", "nic.", "limits.kernel."}

// ClassifyHatch says why escape-hatch arguments could move a box off the isolation stack; an
// empty answer means nothing in them looks like it could. It errs on the side of warning: a
// warning costs a line, a silent hole costs the box.
func ClassifyHatch(args []string) []string {
	seen := map[string]bool{}
	var reasons []string
	add := func(r string) {
		if !seen[r] {
			seen[r] = true
			reasons = append(reasons, r)
		}
	}
	for _, a := range args {
		l := strings.ToLower(strings.TrimSpace(a))
		key := l
		if k, _, ok := strings.Cut(l, "="); ok {
			key = k
		}
		if flag, v, ok := strings.Cut(l, "="); ok && strings.HasPrefix(flag, "-") {
			if r, risky := offStackWords[flag]; risky {
				add("it changes " + r)
			}
			key = v
		}
		if r, ok := offStackWords[l]; ok {
			add("it changes " + r)
		}
		for _, p := range offStackPrefixes {
			if strings.HasPrefix(key, p) || strings.Contains(key, "."+p) {
				add("it sets " + strings.TrimSuffix(p, ".") + ".* keys")
			}
		}
		if strings.Contains(key, "port_isolation") || strings.Contains(key, "acls") {
			add("it changes network isolation keys")
		}
	}
	return reasons
}
