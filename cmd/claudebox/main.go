// Command claudebox mints network-isolated Incus boxes and drills their isolation.
package main

import (
	"os"

	"github.com/claudebox/claudebox/cli"
)

func main() {
	os.Exit(cli.Run(cli.DefaultEnv(), os.Args))
}
