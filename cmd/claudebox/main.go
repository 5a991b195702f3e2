// Command claudebox mints network-isolated Incus boxes and drills their isolation. The same
// static binary is the probe agent inside a box: as PID 1 of the scratch probe image it
// brings the box's network up and serves the drill's listeners.
package main

import (
	"fmt"
	"os"

	"github.com/claudebox/claudebox/cli"
	"github.com/claudebox/claudebox/drill/probes"
)

func main() {
	if probes.IsInitMode() {
		err := probes.RunInit(probes.DefaultInitConfig())
		fmt.Fprintln(os.Stderr, "claudebox init:", err)
		os.Exit(1)
	}
	os.Exit(cli.Run(cli.DefaultEnv(), os.Args))
}
