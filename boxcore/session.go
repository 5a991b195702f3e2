package boxcore

import (
	"context"
	"errors"
	"fmt"
	"path"
	"strconv"
	"strings"

	"github.com/claudebox/claudebox/boxcore/incus"
	"github.com/claudebox/claudebox/boxcore/templates"
)

// BoxUser is an account of a box, as its /etc/passwd has it.
type BoxUser struct {
	Name       string
	UID, GID   uint32
	Home       string
	Shell      string
	NoPasswd   bool // the box has no /etc/passwd (a scratch image): commands run bare, as root
	HomeExists bool
	// Groups are the user's supplementary groups (/etc/group), e.g. docker. Incus's exec
	// sets only a uid and a gid and drops every supplementary group, so a command run as the
	// user goes through Setpriv (util-linux's setpriv in the box) to get them.
	Groups  []string
	Setpriv string
}

// setprivPath is util-linux's setpriv (an essential package on Debian).
const setprivPath = "/usr/bin/setpriv"

// ParseGroups lists the groups of the text of an /etc/group that name is a member of.
func ParseGroups(group, name string) []string {
	var out []string
	for _, line := range strings.Split(group, "\n") {
		f := strings.Split(strings.TrimSpace(line), ":")
		if len(f) < 4 {
			continue
		}
		for _, m := range strings.Split(f[3], ",") {
			if m == name {
				out = append(out, f[0])
				break
			}
		}
	}
	return out
}

// ParsePasswd finds name's entry in the text of an /etc/passwd.
func ParsePasswd(passwd, name string) (BoxUser, bool) {
	for _, line := range strings.Split(passwd, "\n") {
		f := strings.Split(strings.TrimSpace(line), ":")
		if len(f) < 7 || f[0] != name {
			continue
		}
		uid, err1 := strconv.ParseUint(f[2], 10, 32)
		gid, err2 := strconv.ParseUint(f[3], 10, 32)
		if err1 != nil || err2 != nil {
			continue
		}
		return BoxUser{Name: name, UID: uint32(uid), GID: uint32(gid), Home: f[5], Shell: f[6]}, true
	}
	return BoxUser{}, false
}

// LookupUser reads the box's /etc/passwd through the files API and returns the user name
// (empty: the box's own user, `claude` where it exists, else root). A box without an
// /etc/passwd has only root, and commands there run bare (no login shell to wrap them).
func (bs *Boxes) LookupUser(ctx context.Context, b *Box, name string) (BoxUser, error) {
	data, err := bs.Client.PullFile(ctx, b.Name, "/etc/passwd")
	if errors.Is(err, incus.ErrNotFound) {
		if name == "" || name == "root" {
			return BoxUser{Name: "root", Home: "/root", Shell: "/bin/sh", NoPasswd: true}, nil
		}
		return BoxUser{}, Usagef("box %s has no /etc/passwd, so no user %s: only root (--user root)", b.Name, name)
	}
	if err != nil {
		return BoxUser{}, err
	}
	var u BoxUser
	var ok bool
	if name == "" {
		if u, ok = ParsePasswd(string(data), templates.User); !ok {
			u, ok = ParsePasswd(string(data), "root")
		}
	} else {
		u, ok = ParsePasswd(string(data), name)
	}
	if !ok {
		if name == "" {
			name = "root"
		}
		return BoxUser{}, Usagef("box %s has no user %s (see: claudebox exec %s --user root -- getent passwd)", b.Name, name, b.Name)
	}
	if u.Shell == "" || strings.HasSuffix(u.Shell, "/nologin") || strings.HasSuffix(u.Shell, "/false") {
		u.Shell = "/bin/sh"
	}
	if u.Home != "" {
		// A directory is not a file: the files API answers, and PullFile says so. Only a
		// missing path is 404.
		_, herr := bs.Client.PullFile(ctx, b.Name, u.Home)
		u.HomeExists = herr != nil && !errors.Is(herr, incus.ErrNotFound)
	}
	if u.UID != 0 {
		if groups, err := bs.Client.PullFile(ctx, b.Name, "/etc/group"); err == nil {
			u.Groups = ParseGroups(string(groups), u.Name)
		}
		if len(u.Groups) > 0 {
			if _, err := bs.Client.PullFile(ctx, b.Name, setprivPath); err == nil {
				u.Setpriv = setprivPath
			}
		}
	}
	return u, nil
}

// UserExec is the exec request that runs cmd in the box as u, with u's uid, gid and
// supplementary groups, in u's home, with a login environment (HOME, USER, LOGNAME, SHELL,
// PATH with ~/.local/bin) and through u's login shell (`SHELL -l -c 'exec "$@"' SHELLNAME
// CMD...`), so profile settings apply and the arguments reach the command as given, never
// re-split. An empty cmd is the interactive login shell itself. A box without /etc/passwd
// runs cmd bare, as root.
func UserExec(u BoxUser, cmd []string) incus.ExecRequest {
	if u.NoPasswd {
		if len(cmd) == 0 {
			cmd = []string{"/bin/sh", "-l"}
		}
		return incus.ExecRequest{Command: cmd, Env: map[string]string{"HOME": "/root", "USER": "root", "LOGNAME": "root"}}
	}
	search := "/usr/local/bin:/usr/bin:/bin:/usr/local/games:/usr/games"
	if u.UID == 0 {
		search = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
	}
	if u.Home != "" && u.Home != "/" {
		search = u.Home + "/.local/bin:" + search
	}
	env := map[string]string{"HOME": u.Home, "USER": u.Name, "LOGNAME": u.Name, "SHELL": u.Shell, "PATH": search}
	command := []string{u.Shell, "-l"}
	if len(cmd) > 0 {
		// $0 is the shell's name, so its own messages read "bash: line 1: exec: x: not found".
		command = append([]string{u.Shell, "-l", "-c", `exec "$@"`, path.Base(u.Shell)}, cmd...)
	}
	cwd := "/"
	if u.HomeExists {
		cwd = u.Home
	}
	if len(u.Groups) > 0 && u.Setpriv != "" {
		// Started as root, setpriv takes the user's ids and every group of theirs, then
		// executes the command in its place (the same process: signals and the terminal are
		// the command's).
		uid, gid := strconv.FormatUint(uint64(u.UID), 10), strconv.FormatUint(uint64(u.GID), 10)
		command = append([]string{u.Setpriv, "--reuid=" + uid, "--regid=" + gid, "--init-groups", "--"}, command...)
		return incus.ExecRequest{Command: command, Env: env, Cwd: cwd}
	}
	return incus.ExecRequest{Command: command, Env: env, User: u.UID, Group: u.GID, Cwd: cwd}
}

// LoginCommand is the exec request of an interactive login to a box: its `claude` user when
// it has one (cloud images made by the claude template), else root's login shell.
func (bs *Boxes) LoginCommand(ctx context.Context, b *Box) (incus.ExecRequest, error) {
	u, err := bs.LookupUser(ctx, b, "")
	if err != nil {
		return incus.ExecRequest{}, err
	}
	return UserExec(u, nil), nil
}

// TmuxMissing is the usage error of a box without tmux.
func TmuxMissing(box string) error {
	return Usagef("box %s has no tmux: add it with: claudebox exec %s --user root -- sh -c 'apt-get update && apt-get install -y tmux' "+
		"(boxes made by the claude template have it)", box, box)
}

// TmuxSessions lists u's tmux sessions in the box (none when no tmux server runs). It
// returns TmuxMissing when the box has no tmux.
func (bs *Boxes) TmuxSessions(ctx context.Context, b *Box, u BoxUser) ([]TmuxSession, error) {
	probe, err := bs.Client.Exec(ctx, b.Name, UserExec(u, []string{"sh", "-c", "command -v tmux >/dev/null 2>&1 || exit 3"}))
	if err != nil {
		return nil, err
	}
	if probe.ExitCode == 3 {
		return nil, TmuxMissing(b.Name)
	}
	if probe.ExitCode != 0 {
		return nil, fmt.Errorf("looking for tmux in %s: exit %d: %s", b.Name, probe.ExitCode, strings.TrimSpace(string(probe.Stderr)))
	}
	res, err := bs.Client.Exec(ctx, b.Name, UserExec(u, []string{"tmux", "list-sessions", "-F",
		"#{session_name}\t#{session_windows}\t#{session_attached}\t#{session_created}"}))
	if err != nil {
		return nil, err
	}
	if res.ExitCode != 0 {
		msg := string(res.Stderr)
		if strings.Contains(msg, "no server running") || strings.Contains(msg, "No such file or directory") || strings.Contains(msg, "error connecting") {
			return nil, nil
		}
		return nil, fmt.Errorf("tmux list-sessions in %s: exit %d: %s", b.Name, res.ExitCode, strings.TrimSpace(msg))
	}
	var out []TmuxSession
	for _, line := range strings.Split(strings.TrimSpace(string(res.Stdout)), "\n") {
		f := strings.Split(line, "\t")
		if len(f) < 4 || f[0] == "" {
			continue
		}
		w, _ := strconv.Atoi(f[1])
		a, _ := strconv.Atoi(f[2])
		c, _ := strconv.ParseInt(f[3], 10, 64)
		out = append(out, TmuxSession{Name: f[0], Windows: w, Attached: a, Created: c})
	}
	return out, nil
}

// TmuxSession is one tmux session in a box.
type TmuxSession struct {
	Name     string `json:"name"`
	Windows  int    `json:"windows"`
	Attached int    `json:"attached"` // clients attached
	Created  int64  `json:"created"`  // unix seconds
}
