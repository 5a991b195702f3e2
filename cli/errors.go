package cli

import (
	"errors"
	"strings"

	"github.com/claudebox/claudebox/boxcore"
)

// Render is an error as the CLI says it: boxcore's domain errors say what is wrong; the
// command to run or the flag to pass is said here. The exit code does not depend on it
// (usage errors 2, failures 1: see Run).
func Render(err error) string {
	msg := err.Error()
	var opt *boxcore.OptionError
	if errors.As(err, &opt) { // the option as it is spelt on the command line
		msg = strings.Replace(msg, "invalid "+opt.Option+" ", "invalid --"+opt.Option+" ", 1)
	}
	if h := hint(err); h != "" {
		return msg + ": " + h
	}
	return msg
}

func hint(err error) string {
	var (
		missing *boxcore.StackMissingError
		pool    *boxcore.NoStoragePoolError
		taken   *boxcore.SubnetTakenError
		nofree  *boxcore.NoFreeSubnetError
		opt     *boxcore.OptionError
		inUse   *boxcore.StackInUseError
		foreign *boxcore.ForeignUserError
		chg     *boxcore.ChangedError
		locked  *boxcore.HostLockedError
	)
	switch {
	case errors.As(err, &missing):
		return "run 'sudo claudebox host init' first"
	case errors.As(err, &pool):
		return "run 'make setup' (or 'incus storage create default dir')"
	case errors.As(err, &taken):
		return "pick another with --subnet"
	case errors.As(err, &nofree):
		return "pick one with --subnet"
	case errors.As(err, &opt):
		if opt.Option == "dns" && opt.Value == "host" {
			return "name resolvers with --dns IP[,IP]"
		}
		return ""
	case errors.As(err, &inUse):
		return "remove them with 'claudebox rm', or pass --force to tear down anyway (they lose their network)"
	case errors.As(err, &foreign):
		return "detach them first (e.g. 'incus profile remove <instance> <profile>'; for a network, remove their NIC)"
	case errors.As(err, &locked):
		return "wait for it to finish, then run the command again"
	case errors.As(err, &chg):
		return "run the command again (it reads the host afresh)"
	}
	return ""
}
