package cli

import (
	"errors"
	"fmt"
	"testing"

	"github.com/claudebox/claudebox/boxcore"
)

// TestRender: boxcore's domain errors get the CLI's hint, wrapped or not, and keep their exit
// class (usage or failure).
func TestRender(t *testing.T) {
	cases := []struct {
		err   error
		want  string
		usage bool
	}{
		{&boxcore.StackMissingError{Object: "network n", Detail: "does not exist", AsUsage: true},
			"network n does not exist: run 'sudo claudebox host init' first", true},
		{fmt.Errorf("ctx: %w", &boxcore.StackMissingError{Object: "network n", Detail: "has no IPv4 address"}),
			"ctx: network n has no IPv4 address: run 'sudo claudebox host init' first", false},
		{&boxcore.NoStoragePoolError{}, "Incus has no storage pool: run 'make setup' (or 'incus storage create default dir')", false},
		{&boxcore.SubnetTakenError{Subnet: "10.1.2.0/24", By: "eth1"}, "subnet 10.1.2.0/24 is already used by eth1: pick another with --subnet", true},
		{&boxcore.NoFreeSubnetError{}, "no free /24 in 10.0.0.0/8: pick one with --subnet", false},
		{&boxcore.OptionError{Option: "subnet", Value: "x", Want: "want an IPv4 /24"}, `invalid --subnet "x": want an IPv4 /24`, true},
		{&boxcore.OptionError{Option: "dns", Value: "host", Want: "unusable", Err: errors.New("no nameserver")},
			`invalid --dns "host": unusable: no nameserver: name resolvers with --dns IP[,IP]`, true},
		{&boxcore.StackInUseError{Boxes: []string{"a"}}, "1 box(es) use the stack (a): remove them with 'claudebox rm', or pass --force to tear down anyway (they lose their network)", true},
		{&boxcore.ChangedError{Object: "network n"}, "network n was changed by someone else after it was read; nothing was overwritten: run the command again (it reads the host afresh)", false},
		{errors.New("plain"), "plain", false},
	}
	for _, tc := range cases {
		if got := Render(tc.err); got != tc.want {
			t.Errorf("Render(%T) = %q\n want %q", tc.err, got, tc.want)
		}
		if got := boxcore.IsUsage(tc.err); got != tc.usage {
			t.Errorf("IsUsage(%T) = %v, want %v", tc.err, got, tc.usage)
		}
	}
}
