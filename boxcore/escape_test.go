package boxcore

import (
	"slices"
	"strings"
	"testing"
)

func TestHatchArgs(t *testing.T) {
	cases := []struct {
		args []string
		want string
	}{
		{[]string{"info"}, "info box"},
		{[]string{"config", "show", "{}", "--expanded"}, "config show box --expanded"},
		{[]string{"file", "pull", "{}/etc/hostname", "-"}, "file pull box/etc/hostname -"},
		{[]string{"snapshot", "list", "{}", "{}"}, "snapshot list box box"},
	}
	for _, tc := range cases {
		if got := strings.Join(HatchArgs(tc.args, "box"), " "); got != tc.want {
			t.Errorf("HatchArgs(%v) = %q, want %q", tc.args, got, tc.want)
		}
	}
}

func TestClassifyHatch(t *testing.T) {
	risky := [][]string{
		{"config", "set", "box", "security.nesting=true"},
		{"config", "set", "box", "security.privileged", "true"},
		{"config", "set", "box", "raw.lxc=lxc.apparmor.profile=unconfined"},
		{"config", "device", "add", "box", "eth1", "nic", "network=incusbr0"},
		{"config", "device", "set", "box", "eth0", "security.port_isolation=false"},
		{"profile", "remove", "box", "claude-dev"},
		{"profile", "assign", "box", "default"},
		{"network", "attach", "incusbr0", "box"},
		{"config", "edit", "box"},
		{"config", "set", "box", "linux.kernel_modules=br_netfilter"},
		{"rebuild", "images:debian/12", "box"},
		{"move", "box", "--target", "x"},
		{"copy", "box", "other", "--profile=default"},
		{"CONFIG", "SET", "box", "SECURITY.NESTING=true"},
	}
	for _, args := range risky {
		if r := ClassifyHatch(args); len(r) == 0 {
			t.Errorf("ClassifyHatch(%v) found nothing", args)
		}
	}
	harmless := [][]string{
		{"info", "box"},
		{"config", "show", "box"},
		{"config", "get", "box", "user.claudebox"},
		{"config", "set", "box", "user.note=hello"},
		{"file", "pull", "box/etc/hostname", "-"},
		{"snapshot", "list", "box"},
		{"console", "box", "--show-log"},
		{"exec", "box", "--", "ls", "-la"},
	}
	for _, args := range harmless {
		if r := ClassifyHatch(args); len(r) != 0 {
			t.Errorf("ClassifyHatch(%v) = %v, want nothing", args, r)
		}
	}
}

// FuzzClassifyHatch: never panics, reasons are unique, and a security.* or raw.* key
// anywhere always warns.
func FuzzClassifyHatch(f *testing.F) {
	f.Add("config set {} security.nesting=true")
	f.Add("profile add {} default")
	f.Add("info {}")
	f.Add("exec {} -- sh -c 'echo security.'")
	f.Fuzz(func(t *testing.T, line string) {
		args := strings.Fields(line)
		reasons := ClassifyHatch(args)
		seen := map[string]bool{}
		for _, r := range reasons {
			if seen[r] {
				t.Fatalf("duplicate reason %q", r)
			}
			seen[r] = true
		}
		for _, a := range args {
			l := strings.ToLower(a)
			if (strings.HasPrefix(l, "security.") || strings.HasPrefix(l, "raw.")) && len(reasons) == 0 {
				t.Fatalf("%v sets %s but no warning", args, a)
			}
		}
		if got := HatchArgs(args, "b"); !slices.Contains(got, "b") && !strings.Contains(strings.Join(got, " "), "b") {
			t.Fatalf("HatchArgs lost the box: %v", got)
		}
	})
}
