package firewall

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"strconv"
	"strings"
)

// Reverse-path filtering on box ports: the port-rp-filter layer, beside the
// wall's `iifname "<port>" drop` and outside nftables (a flushed ruleset
// leaves it standing).
//
// A frame a box sends to a link-local group MAC (01:80:c2:00:00:0X) reaches
// the IP stack on the box's port (the host-side veth), not on the bridge. With
// rp_filter=1 (strict) on the port the kernel drops every such packet whose
// source is not routed back by the port: a box's own or a sibling's address is
// routed by the bridge, any other by the uplink, so every source but 0.0.0.0
// fails. (The kernel skips source validation for 0.0.0.0 to the limited
// broadcast or to a 224.0.0.0/24 group: those are held by the wall alone.)
//
// The kernel uses max(conf.all.rp_filter, conf.<port>.rp_filter): all=2
// (loose) overrides a port's 1, and then the layer does not hold; PortRPFilter
// reports the effective value so that a check sees it. systemd hosts set
// conf.*.rp_filter=2 on new interfaces (udev): the port's value is written
// after the box runs, and a check reads it back.

func rpPath(iface string) string { return "/proc/sys/net/ipv4/conf/" + iface + "/rp_filter" }

func readInt(path string) (int, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, fmt.Errorf("firewall: %w", err)
	}
	v, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		return 0, fmt.Errorf("firewall: %s: %w", path, err)
	}
	return v, nil
}

// PortRPFilter reads a port's rp_filter: own is the port's value, effective
// what the kernel applies (the larger of the port's and conf.all's). It reads
// the calling thread's network namespace.
func PortRPFilter(port string) (effective, own int, err error) {
	if err := validateBridge(port); err != nil {
		return 0, 0, err
	}
	if own, err = readInt(rpPath(port)); err != nil {
		return 0, 0, err
	}
	all, err := readInt(rpPath("all"))
	if err != nil {
		return 0, 0, err
	}
	return max(own, all), own, nil
}

// SetPortRPFilter writes a port's rp_filter (0 off, 1 strict, 2 loose).
func SetPortRPFilter(port string, v int) error {
	if err := validateBridge(port); err != nil {
		return err
	}
	if v < 0 || v > 2 {
		return fmt.Errorf("firewall: rp_filter %d: want 0, 1 or 2", v)
	}
	if err := os.WriteFile(rpPath(port), []byte(strconv.Itoa(v)), 0o644); err != nil {
		return fmt.Errorf("firewall: %w", err)
	}
	return nil
}

// StrictRPFilter sets rp_filter=1 on every bound port of s whose own value is
// not 1 already, and reports whether it wrote any. A port that is gone (its box was
// deleted meanwhile) is skipped: it carries nothing, and a new port of that name is
// bound, and set, when its box starts.
func StrictRPFilter(s Spec) (changed bool, err error) {
	for _, p := range s.Ports {
		_, own, err := PortRPFilter(p.Port)
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return changed, err
		}
		if own != 1 {
			if err := SetPortRPFilter(p.Port, 1); err != nil && !errors.Is(err, fs.ErrNotExist) {
				return changed, err
			}
			changed = true
		}
	}
	return changed, nil
}
