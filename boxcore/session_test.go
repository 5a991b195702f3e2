package boxcore

import (
	"slices"
	"testing"
)

func TestParsePasswd(t *testing.T) {
	passwd := "root:x:0:0:root:/root:/bin/bash\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n" +
		"broken:x:notanumber:0::/:/bin/sh\nclaude:x:1000:1000:claudebox agent:/home/claude:/bin/bash\n"
	u, ok := ParsePasswd(passwd, "claude")
	if !ok || u.UID != 1000 || u.GID != 1000 || u.Home != "/home/claude" || u.Shell != "/bin/bash" {
		t.Fatalf("claude: %+v %v", u, ok)
	}
	if u, ok := ParsePasswd(passwd, "root"); !ok || u.UID != 0 || u.Home != "/root" {
		t.Fatalf("root: %+v %v", u, ok)
	}
	for _, name := range []string{"broken", "clau", "nosuch", ""} {
		if _, ok := ParsePasswd(passwd, name); ok {
			t.Errorf("%q found", name)
		}
	}
}

func TestUserExec(t *testing.T) {
	u := BoxUser{Name: "claude", UID: 1000, GID: 1000, Home: "/home/claude", Shell: "/bin/bash", HomeExists: true}
	req := UserExec(u, []string{"printf", "%s|", "a b", "$HOME"})
	want := []string{"/bin/bash", "-l", "-c", `exec "$@"`, "bash", "printf", "%s|", "a b", "$HOME"}
	if !slices.Equal(req.Command, want) {
		t.Fatalf("command %q, want %q", req.Command, want)
	}
	if req.User != 1000 || req.Group != 1000 || req.Cwd != "/home/claude" {
		t.Fatalf("uid %d gid %d cwd %q", req.User, req.Group, req.Cwd)
	}
	for k, v := range map[string]string{"HOME": "/home/claude", "USER": "claude", "LOGNAME": "claude", "SHELL": "/bin/bash"} {
		if req.Env[k] != v {
			t.Errorf("%s=%q, want %q", k, req.Env[k], v)
		}
	}
	if p := req.Env["PATH"]; len(p) < 24 || p[:24] != "/home/claude/.local/bin:" {
		t.Errorf("PATH %q does not start with ~/.local/bin", p)
	}
	if login := UserExec(u, nil); !slices.Equal(login.Command, []string{"/bin/bash", "-l"}) {
		t.Errorf("login: %q", login.Command)
	}
	u.HomeExists = false
	if req := UserExec(u, []string{"true"}); req.Cwd != "/" {
		t.Errorf("cwd without a home: %q", req.Cwd)
	}
	bare := UserExec(BoxUser{Name: "root", NoPasswd: true}, []string{"/sbin/init", "probe"})
	if !slices.Equal(bare.Command, []string{"/sbin/init", "probe"}) || bare.User != 0 {
		t.Errorf("a box without /etc/passwd: %q uid %d", bare.Command, bare.User)
	}
}

// Incus's exec drops supplementary groups: a user with groups (docker) runs through setpriv,
// started as root, which takes the user's ids and groups; without setpriv, or without
// groups, the exec itself sets the ids.
func TestUserExecGroups(t *testing.T) {
	group := "root:x:0:\nsudo:x:27:\ndocker:x:998:claude\nclaudes:x:1001:claudette\nusers:x:100:alice,claude,bob\nbroken\n"
	if g := ParseGroups(group, "claude"); !slices.Equal(g, []string{"docker", "users"}) {
		t.Fatalf("groups of claude: %v", g)
	}
	if g := ParseGroups(group, "nobody"); len(g) != 0 {
		t.Fatalf("groups of nobody: %v", g)
	}
	u := BoxUser{Name: "claude", UID: 1000, GID: 1000, Home: "/home/claude", Shell: "/bin/bash", HomeExists: true,
		Groups: []string{"docker"}, Setpriv: "/usr/bin/setpriv"}
	req := UserExec(u, []string{"docker", "ps"})
	want := []string{"/usr/bin/setpriv", "--reuid=1000", "--regid=1000", "--init-groups", "--", "/bin/bash", "-l", "-c", `exec "$@"`, "bash", "docker", "ps"}
	if !slices.Equal(req.Command, want) || req.User != 0 || req.Group != 0 || req.Env["HOME"] != "/home/claude" {
		t.Fatalf("with groups: %q uid %d gid %d env %v", req.Command, req.User, req.Group, req.Env)
	}
	u.Setpriv = ""
	if req := UserExec(u, []string{"true"}); req.User != 1000 || req.Command[0] != "/bin/bash" {
		t.Errorf("without setpriv: %q uid %d", req.Command, req.User)
	}
}
