package firewall

import (
	"fmt"
	"os"
	"strings"
)

// Frames to an IEEE 802.1D reserved group address (01:80:c2:00:00:0x) are
// learnt by the bridge outside the prerouting hook (LLDP with no netfilter
// hook at all), so a box could still move a sibling's FDB entry past the port
// binding by sending to such an address with the sibling's MAC. The bridge
// option no_linklocal_learn=1 stops learning from them (measured:
// TestPortBindingLinkLocal). It is part of the port-binding layer.

func noLLPath(bridge string) string { return "/sys/class/net/" + bridge + "/bridge/no_linklocal_learn" }

// NoLinkLocalLearn reads the bridge's no_linklocal_learn option (through
// sysfs: the network namespace sysfs was mounted in, the host's).
func NoLinkLocalLearn(bridge string) (bool, error) {
	if err := validateBridge(bridge); err != nil {
		return false, err
	}
	b, err := os.ReadFile(noLLPath(bridge))
	if err != nil {
		return false, fmt.Errorf("firewall: %w", err)
	}
	return strings.TrimSpace(string(b)) == "1", nil
}

// SetNoLinkLocalLearn sets the bridge's no_linklocal_learn option.
func SetNoLinkLocalLearn(bridge string, on bool) error {
	if err := validateBridge(bridge); err != nil {
		return err
	}
	v := "0"
	if on {
		v = "1"
	}
	if err := os.WriteFile(noLLPath(bridge), []byte(v), 0o644); err != nil {
		return fmt.Errorf("firewall: %w", err)
	}
	return nil
}
