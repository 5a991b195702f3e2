package boxcore

import (
	"maps"
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
		{"config", "set", "box", "--", "security.privileged=true"},
		{"config", "set", "box", "limits.kernel.nofile=1"},
		{"config", "set", "box", "boot.host_shutdown_action=stop"},
		{"config", "device", "add", "box", "p", "proxy", "listen=tcp:0.0.0.0:80", "connect=tcp:127.0.0.1:80"},
		{"query", "-X", "PATCH", "/1.0/instances/box", "--data", `{"config":{"security.privileged":"true"}}`},
		{"query", "--request=PUT", "/1.0/instances/box", "-d", "{}"},
		{"query", "/1.0/instances/box", "-X", "DELETE"},
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
		{"exec", "box", "--", "sh", "-c", "echo security.privileged=true"},
		{"query", "/1.0/instances/box"},
		{"config", "set", "box", "security.secureboot=false"}, // the template's own VM setting
		{"config", "set", "box", "limits.memory=2GiB"},
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
		for i, a := range args {
			if a == "--" && execTail(args, i) {
				break // a command inside the box
			}
			l := strings.ToLower(a)
			k, v, _ := strings.Cut(l, "=")
			if (strings.HasPrefix(l, "security.") || strings.HasPrefix(l, "raw.")) && !OwnConfig(k, v) && len(reasons) == 0 {
				t.Fatalf("%v sets %s but no warning", args, a)
			}
		}
		if got := HatchArgs(args, "b"); !slices.Contains(got, "b") && !strings.Contains(strings.Join(got, " "), "b") {
			t.Fatalf("HatchArgs lost the box: %v", got)
		}
	})
}

func TestHatchOtherInstance(t *testing.T) {
	names := []string{"box", "other", "third"}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"exec", "box", "--", "ls", "other"}, ""},
		{[]string{"exec", "other", "--", "sh", "box"}, "other"},
		{[]string{"stop", "other", "--force", "box"}, "other"},
		{[]string{"config", "show", "local:other"}, "other"},
		{[]string{"file", "pull", "other/etc/hostname", "-", "box"}, "other"},
		{[]string{"snapshot", "restore", "other/s1", "box"}, "other"},
		{[]string{"query", "/1.0/instances/other/state"}, "other"},
		{[]string{"query", "/1.0/instances/box?recursion=1"}, ""},
		{[]string{"delete", "--", "third", "box"}, "third"},
		{[]string{"config", "set", "box", "user.note=other"}, ""},
		{[]string{"copy", "box", "newname"}, ""},
		{[]string{"info", "loop:box"}, ""},
	} {
		if got := HatchOtherInstance(tc.args, "box", names); got != tc.want {
			t.Errorf("HatchOtherInstance(%v) = %q, want %q", tc.args, got, tc.want)
		}
	}
}

// The boundary is one allow-list: what claudebox itself puts on a box passes, and each kind
// of hole the issue names is refused, with the reason naming it.
func TestOffBoundary(t *testing.T) {
	s := DefaultStack()
	own := map[string]string{
		"user.claudebox": "1", "user.claudebox.mint": "x", "user.note": "hi", "volatile.eth0.hwaddr": "00:16:3e:00:00:01",
		"image.os": "debian", "cloud-init.user-data": "#cloud-config\n", "cloud-init.vendor-data": "#cloud-config\n",
		"limits.cpu": "2", "limits.memory": "4GiB", "security.secureboot": "false",
	}
	root := map[string]map[string]string{"root": {"type": "disk", "path": "/", "pool": s.Pool, "size": "20GiB"},
		"eth0": BoxNIC(s, "some-box")} // the stack's NIC with the box's fixed port name
	if off := OffBoundary(own, root, s); len(off) != 0 {
		t.Fatalf("claudebox's own settings refused: %v", off)
	}
	if off := OffBoundary(own, nil, s); len(off) != 0 {
		t.Fatalf("no devices refused: %v", off)
	}
	// The docker template's container keys are own config on a box of that template only.
	docker := maps.Clone(own)
	docker[TagTemplate] = "docker"
	docker["security.nesting"] = "true"
	if off := OffBoundary(docker, root, s); len(off) != 0 {
		t.Fatalf("a docker box's nesting refused: %v", off)
	}
	if r := ClassifyHatch([]string{"config", "set", "b", "security.nesting=true"}); len(r) != 1 || !strings.Contains(r[0], "docker template") {
		t.Errorf("the hatch setting nesting: %v, want a warning naming the docker template", r)
	}
	for name, tc := range map[string]struct {
		cfg  map[string]string
		devs map[string]map[string]string
		want string
	}{
		"privileged":      {map[string]string{"security.privileged": "true"}, nil, "security.privileged"},
		"nesting":         {map[string]string{"security.nesting": "true"}, nil, "security.nesting"},
		"nesting, claude": {map[string]string{"security.nesting": "true", TagTemplate: "claude"}, nil, "security.nesting"},
		"docker, looser":  {map[string]string{"security.nesting": "true", "security.privileged": "true", TagTemplate: "docker"}, nil, "security.privileged"},
		"secureboot on":   {map[string]string{"security.secureboot": "true"}, nil, "security.secureboot"},
		"raw.lxc":         {map[string]string{"raw.lxc": "lxc.apparmor.profile=unconfined"}, nil, "raw.lxc"},
		"linux":           {map[string]string{"linux.kernel_modules": "br_netfilter"}, nil, "linux.kernel_modules"},
		"kernel limits":   {map[string]string{"limits.kernel.memlock": "unlimited"}, nil, "limits.kernel.memlock"},
		"network cfg":     {map[string]string{"cloud-init.network-config": "x"}, nil, "cloud-init.network-config"},
		"host folder":     {nil, map[string]map[string]string{"home": {"type": "disk", "source": "/home/me", "path": "/mnt"}}, "host's /home/me"},
		"extra volume":    {nil, map[string]map[string]string{"data": {"type": "disk", "pool": s.Pool, "source": "vol", "path": "/data"}}, "extra disk"},
		"nic override":    {nil, map[string]map[string]string{"eth0": {"type": "nic", "network": s.Network, "security.port_isolation": "false"}}, "NIC"},
		"nic renamed":     {nil, map[string]map[string]string{"eth0": withKey(BoxNIC(s, "b"), "host_name", "eth9")}, "NIC"},
		"nic loosened":    {nil, map[string]map[string]string{"eth0": withKey(BoxNIC(s, "b"), "security.mac_filtering", "false")}, "NIC"},
		"second nic":      {nil, map[string]map[string]string{"eth1": {"type": "nic", "network": "incusbr0"}}, "incusbr0"},
		"proxy":           {nil, map[string]map[string]string{"p": {"type": "proxy", "listen": "tcp:0.0.0.0:80", "connect": "tcp:127.0.0.1:80"}}, "proxy"},
		"gpu":             {nil, map[string]map[string]string{"g": {"type": "gpu"}}, "gpu"},
		"root elsewhere":  {nil, map[string]map[string]string{"root": {"type": "disk", "path": "/", "pool": "other"}}, "pool other"},
		"root readonly":   {nil, map[string]map[string]string{"root": {"type": "disk", "path": "/", "pool": s.Pool, "readonly": "true"}}, "readonly"},
	} {
		off := OffBoundary(tc.cfg, tc.devs, s)
		if len(off) != 1 || !strings.Contains(off[0], tc.want) {
			t.Errorf("%s: %v, want one reason naming %q", name, off, tc.want)
		}
	}
}

func TestValidateResources(t *testing.T) {
	for _, ok := range [][3]string{{"", "", ""}, {"1", "1", "1"}, {"2", "4GiB", "20GiB"}, {"0-3", "50%", "500MiB"}, {"0,2", "1.5GiB", "1GB"}} {
		if err := ValidateResources(ok[0], ok[1], ok[2]); err != nil {
			t.Errorf("%v refused: %v", ok, err)
		}
	}
	for _, bad := range []struct{ cpu, mem, disk, want string }{
		{"0", "", "", "--cpu"}, {"-1", "", "", "--cpu"}, {"abc", "", "", "--cpu"}, {"3-1", "", "", "--cpu"},
		{"", "1XB", "", "--memory"}, {"", "0", "", "--memory"}, {"", "0GiB", "", "--memory"}, {"", "-1GiB", "", "--memory"}, {"", "150%", "", "--memory"},
		{"", "", "abc", "--disk"}, {"", "", "0", "--disk"}, {"", "", "50%", "--disk"},
	} {
		err := ValidateResources(bad.cpu, bad.mem, bad.disk)
		if !IsUsage(err) || !strings.Contains(err.Error(), bad.want) || !strings.Contains(err.Error(), "e.g.") {
			t.Errorf("%+v: %v", bad, err)
		}
	}
}

func TestParseFrom(t *testing.T) {
	for in, want := range map[string][2]string{"a": {"a", ""}, "a/s": {"a", "s"}} {
		src, snap, err := ParseFrom(in)
		if err != nil || src != want[0] || snap != want[1] {
			t.Errorf("ParseFrom(%q) = %q %q %v", in, src, snap, err)
		}
	}
	for _, in := range []string{"/snap", "a/", "/", "a/b/c"} {
		if _, _, err := ParseFrom(in); !IsUsage(err) || !strings.Contains(err.Error(), "--from BOX/SNAP") {
			t.Errorf("ParseFrom(%q): %v", in, err)
		}
	}
}

func withKey(m map[string]string, k, v string) map[string]string {
	out := maps.Clone(m)
	out[k] = v
	return out
}
