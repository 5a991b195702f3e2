package cli

import (
	"errors"
	"os/exec"
	"strings"

	"github.com/claudebox/claudebox/boxcore"
)

// incusHatch hands the rest of the line to the incus CLI, aimed at a box and only a box.
func incusHatch(c *Ctx) error {
	args := c.Args[1:]
	if len(args) > 0 && args[0] == "--" {
		args = args[1:]
	}
	if len(args) == 0 {
		return boxcore.Usagef("incus: no incus arguments (usage: claudebox incus BOX -- ARGS..., {} stands for the box)")
	}
	ref := c.Box.Name
	if r := c.String("remote"); r != "" && r != "local" {
		ref = r + ":" + ref
	}
	full := boxcore.HatchArgs(args, ref)
	// The rail: the hatch acts on its box, never on an instance claudebox did not mint.
	insts, err := c.Client.Instances(c.Context.Context, nil, false)
	if err != nil {
		return err
	}
	names := make([]string, 0, len(insts))
	for _, in := range insts {
		names = append(names, in.Name)
	}
	if other := boxcore.HatchOtherInstance(full, c.Box.Name, names); other != "" {
		return boxcore.Usagef("incus: the arguments name instance %s, not box %s: the escape hatch acts on its box only ({} stands for it); nothing was run", other, c.Box.Name)
	}
	if reasons := boxcore.ClassifyHatch(full); len(reasons) > 0 {
		c.Warn("claudebox: warning: this could move box %s off the isolation stack (%s); from here the trust boundary is yours to keep",
			c.Box.Name, strings.Join(reasons, "; "))
	}
	bin, err := exec.LookPath("incus")
	if err != nil {
		return errors.New("incus: the incus CLI is not installed (it comes with Incus: run 'make setup')")
	}
	cmd := exec.Command(bin, full...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = c.Env.Stdin, c.Env.Stdout, c.Env.Stderr
	if err := cmd.Run(); err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			return exitError{ee.ExitCode()}
		}
		return err
	}
	return nil
}
