package boxcore

import (
	"fmt"
	"slices"
	"sort"
	"strings"

	"github.com/claudebox/claudebox/boxcore/templates"
)

// The boundary, as an allow-list: what claudebox itself puts on a box. A clone inherits only
// this; the escape hatch warns about anything else. Both ask the same two functions, so they
// can never disagree.

// OwnConfig reports whether config key k (with value v) is one claudebox puts on a box, or
// Incus's own bookkeeping about it:
//
//   - user.*                         claudebox's tags, and free-form metadata that reaches
//     nothing outside the box (the box can read its own user.* keys anyway)
//   - volatile.*, image.*            Incus's bookkeeping and the image's description
//   - cloud-init.user-data, cloud-init.vendor-data   the template's first boot (runs inside)
//   - limits.cpu                     --cpu
//   - limits.memory, limits.processes, limits.cpu.allowance   --memory, --processes and the
//     host-sized defaults, but only within the caps (limits.go): a memory limit above the
//     host's budget, a process limit above the cap, or a CPU allowance that is no hard quota
//     of at most the default is looser than claudebox sets
//   - a template's vm_config key with the template's value (security.secureboot=false)
//
// A template's container_config key (the docker template's nesting) is own config only on a
// box of that template: OffBoundary checks it against the box's template tag.
//
// Everything else — security.*, raw.*, linux.*, limits.kernel.*, boot.*, other cloud-init
// keys, ... — claudebox never sets, so it is not carried over.
func OwnConfig(k, v string) bool {
	if within, isLimit := DefaultLimits().limitWithinCaps(k, v); isLimit {
		return within
	}
	switch {
	case strings.HasPrefix(k, "user."), strings.HasPrefix(k, "volatile."), strings.HasPrefix(k, "image."):
		return true
	case k == "cloud-init.user-data", k == "cloud-init.vendor-data", k == "limits.cpu":
		return true
	}
	for _, t := range templates.List() {
		if tv, ok := t.VMConfig[k]; ok && tv == v {
			return true
		}
	}
	return false
}

// templateContainerKey reports whether the template named tmpl puts k=v on its container
// boxes (container_config: the docker template's nesting). Only a box of that template may
// carry it; on any other box it is off the boundary like every security.* key.
func templateContainerKey(tmpl, k, v string) bool {
	return tmpl != "" && slices.Contains(containerKeyOf(k, v), tmpl)
}

// containerKeyOf names the templates whose container_config sets k to v.
func containerKeyOf(k, v string) []string {
	var out []string
	for _, t := range templates.List() {
		if tv, ok := t.ContainerConfig[k]; ok && tv == v {
			out = append(out, t.Name)
		}
	}
	return out
}

// ownRootDiskKeys are the only keys of the one device claudebox puts on a box itself: the
// root disk `new --disk` adds, on the stack's pool.
var ownRootDiskKeys = []string{"type", "path", "pool", "size"}

// OffBoundary lists, sorted, what in an instance's (or a snapshot's) own config and devices
// claudebox did not put there. Empty means a clone of it is a box like any other.
func OffBoundary(config map[string]string, devices map[string]map[string]string, s Stack) []string {
	var out []string
	for k, v := range config {
		if OwnConfig(k, v) || templateContainerKey(config[TagTemplate], k, v) {
			continue
		}
		if _, isLimit := DefaultLimits().limitWithinCaps(k, v); isLimit {
			out = append(out, fmt.Sprintf("config %s=%s (looser than claudebox sets: %s)", k, short(v), DefaultLimits().capOf(k)))
			continue
		}
		out = append(out, fmt.Sprintf("config %s=%s (claudebox never sets %s)", k, short(v), keyClass(k)))
	}
	for name, d := range devices {
		if why := offDevice(name, d, s); why != "" {
			out = append(out, why)
		}
	}
	sort.Strings(out)
	return out
}

func offDevice(name string, d map[string]string, s Stack) string {
	typ := d["type"]
	switch {
	case typ == "disk" && d["path"] == "/" && d["source"] == "":
		if d["pool"] != s.Pool {
			return fmt.Sprintf("device %s: the root disk on pool %s, not the stack's %s", name, d["pool"], s.Pool)
		}
		for k := range d {
			if !slices.Contains(ownRootDiskKeys, k) {
				return fmt.Sprintf("device %s: the root disk sets %s", name, k)
			}
		}
		return offRootSize(name, d["size"], s)
	case typ == "disk" && d["source"] != "" && d["pool"] == "":
		return fmt.Sprintf("device %s: a disk mounting the host's %s at %s", name, d["source"], d["path"])
	case typ == "disk":
		return fmt.Sprintf("device %s: an extra disk (%s)", name, firstNonEmpty(d["source"], d["path"]))
	case typ == "nic" && name == "eth0" && IsBoxNIC(d, s, ""):
		return "" // the stack's eth0 with the box's fixed port name (BoxNIC)
	case typ == "nic":
		return fmt.Sprintf("device %s: a NIC of its own (%s), overriding the stack's %s", name, firstNonEmpty(d["network"], d["parent"], d["nictype"]), s.Network)
	case typ == "proxy":
		if _, ok := AsExposure(name, d); ok {
			return "" // claudebox's own exposure (expose.go): a clone or an import drops it
		}
		return fmt.Sprintf("device %s: a proxy device (a path between the host and the box: %s -> %s)", name, d["listen"], d["connect"])
	}
	return fmt.Sprintf("device %s: a %s device, which claudebox never adds", name, firstNonEmpty(typ, "typeless"))
}

// offRootSize: a root size claudebox would give is a size at or below the stack's cap (the
// pool's size); no size at all is the profile's.
func offRootSize(name, size string, s Stack) string {
	if size == "" {
		return ""
	}
	n, err := DiskBytes(size)
	switch {
	case err != nil || n <= 0:
		return fmt.Sprintf("device %s: the root disk's size %q is no size claudebox sets", name, size)
	case s.MaxDisk > 0 && n > s.MaxDisk:
		return fmt.Sprintf("device %s: the root disk's size %s is above the cap (pool %s holds %s)", name, size, s.Pool, humanBytes(s.MaxDisk))
	}
	return ""
}

func keyClass(k string) string {
	if ns, _, ok := strings.Cut(k, "."); ok {
		return ns + ".* keys"
	}
	return k
}

func short(v string) string {
	if len(v) > 40 {
		return v[:37] + "..."
	}
	return v
}

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

// HatchOtherInstance returns the first instance other than box that the escape hatch's
// arguments name (as NAME, REMOTE:NAME, NAME/SNAP, NAME/PATH or /1.0/instances/NAME in a
// query), or "". names are the instances the daemon has. Only the incus command's own part
// is looked at: what follows an exec's "--" is a command inside the box.
func HatchOtherInstance(args []string, box string, names []string) string {
	known := map[string]bool{}
	for _, n := range names {
		known[n] = true
	}
	for i, a := range args {
		if a == "--" && execTail(args, i) {
			break
		}
		cand := a
		if rest, ok := strings.CutPrefix(a, "/1.0/instances/"); ok {
			cand, _, _ = strings.Cut(rest, "?")
		} else if i := strings.IndexByte(cand, ':'); i >= 0 && !strings.ContainsAny(cand[:i], "=/.") {
			cand = cand[i+1:]
		}
		cand, _, _ = strings.Cut(cand, "/")
		if cand != "" && cand != box && known[cand] {
			return cand
		}
	}
	return ""
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

// configNamespaces are the first words of Incus instance and device config keys: an argument
// starting with one of them (and a dot) is a key, checked against OwnConfig.
var configNamespaces = []string{"security", "raw", "linux", "limits", "boot", "cloud-init", "volatile", "image",
	"user", "snapshots", "migration", "nvidia", "cluster", "agent", "environment", "ipv4", "ipv6", "nic", "acls"}

// ClassifyHatch says why escape-hatch arguments could move a box off the isolation stack; an
// empty answer means nothing in them looks like it could. It errs on the side of warning: a
// warning costs a line, a silent hole costs the box. Config keys are judged by the same
// allow-list a clone is (OwnConfig).
func ClassifyHatch(args []string) []string {
	seen := map[string]bool{}
	var reasons []string
	add := func(r string) {
		if !seen[r] {
			seen[r] = true
			reasons = append(reasons, r)
		}
	}
	query, method, data := false, "GET", false
	for i, a := range args {
		if a == "--" && execTail(args, i) {
			break // a command inside the box
		}
		l := strings.ToLower(strings.TrimSpace(a))
		switch {
		case l == "query":
			query = true
		case (l == "-x" || l == "--request") && i+1 < len(args):
			method = strings.ToUpper(args[i+1])
		case strings.HasPrefix(l, "--request="):
			method = strings.ToUpper(strings.TrimPrefix(a, "--request="))
		case l == "-d" || l == "--data" || strings.HasPrefix(l, "--data="):
			data = true
		}
		if flag, v, ok := strings.Cut(l, "="); ok && strings.HasPrefix(flag, "-") {
			if r, risky := offStackWords[flag]; risky {
				add("it changes " + r)
			}
			l = v
		}
		if r, ok := offStackWords[l]; ok && !query {
			add("it changes " + r)
		}
		key, val, _ := strings.Cut(strings.TrimSpace(a), "=")
		if ns, _, ok := strings.Cut(strings.ToLower(key), "."); ok && slices.Contains(configNamespaces, ns) {
			if !hasValue(a) && i+1 < len(args) {
				val = args[i+1]
			}
			lk := strings.ToLower(key)
			if _, isLimit := DefaultLimits().limitWithinCaps(lk, val); isLimit && !OwnConfig(lk, val) {
				add("it sets " + key + " looser than claudebox does (" + DefaultLimits().capOf(lk) + "), or removes it")
			} else if ts := containerKeyOf(lk, val); len(ts) > 0 {
				add("it sets " + key + ", which claudebox puts only on boxes of the " + strings.Join(ts, ", ") + " template (new --template " + ts[0] + ")")
			} else if !OwnConfig(lk, val) {
				add("it sets " + ns + ".* keys (" + key + "), which claudebox never puts on a box")
			}
		}
	}
	if query && (method != "GET" || data) {
		add("it writes to the Incus API directly (query " + method + "): nothing checks what it changes")
	}
	return reasons
}

// execTail reports whether the "--" at args[i] begins a command inside the box: only for
// `exec`. Elsewhere the incus CLI reads a "--" as the end of its flags, and what follows is
// still its own arguments (`config set BOX -- security.privileged=true`).
func execTail(args []string, i int) bool {
	for _, a := range args[:i] {
		if !strings.HasPrefix(a, "-") {
			return strings.EqualFold(a, "exec")
		}
	}
	return false
}

func hasValue(a string) bool { return strings.Contains(a, "=") }

func firstNonEmpty(s ...string) string {
	for _, x := range s {
		if x != "" {
			return x
		}
	}
	return "?"
}
