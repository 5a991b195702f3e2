package drill

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/claudebox/claudebox/internal/netdump"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"

	"github.com/claudebox/claudebox/boxcore"
	"github.com/claudebox/claudebox/boxcore/incus"
)

// Cleanup removes what dead drill runs left: instances carrying the drill tag, decoy
// namespaces and veths (their routes go with them) by name prefix, and the test-domain
// forwarder in any network's servers-file (or, left by older versions, raw.dnsmasq). It
// takes the drill lock, so a live run is never touched (it waits up to 30 s for one to
// finish).
func Cleanup(ctx context.Context, c *incus.Client) ([]string, error) {
	lock, err := acquireLock()
	if err != nil {
		return nil, err
	}
	defer lock.Close()
	return cleanupLocked(ctx, c)
}

func cleanupLocked(ctx context.Context, c *incus.Client) (done []string, err error) {
	gone, ierr := deleteTagged(ctx, c, func(incus.Instance) bool { return true })
	for _, n := range gone {
		done = append(done, "instance "+n)
	}
	// The rest is cleaned whatever a box's removal said; the error ends the run.
	defer func() { err = errors.Join(ierr, err) }()
	links, _ := netdump.Links()
	for _, l := range links {
		if isDrillVeth(l) {
			if netlink.LinkDel(l) == nil {
				done = append(done, "veth "+l.Attrs().Name+" (and its routes)")
			}
		}
	}
	ents, _ := os.ReadDir("/run/netns")
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), NetnsPrefix) {
			if netns.DeleteNamed(e.Name()) == nil {
				done = append(done, "netns "+e.Name())
			} else {
				_ = os.Remove(filepath.Join("/run/netns", e.Name()))
			}
		}
	}
	if b, err := os.ReadFile(HoleMarker); err == nil {
		// A run died inside a seeded hole: its layers are still off. Converge the stack.
		if _, err := boxcore.NewHost(c, boxcore.DefaultStack()).Init(ctx, boxcore.InitOptions{}); err != nil {
			return done, fmt.Errorf("a dead run left a seeded hole open (%s); restoring the stack: %w", strings.TrimSpace(string(b)), err)
		}
		_ = os.Remove(HoleMarker)
		done = append(done, "the host stack, converged again (a run died inside a seeded hole: "+strings.TrimSpace(string(b))+")")
	}
	nets, err := c.Networks(ctx)
	if err != nil {
		return done, err
	}
	for _, n := range nets {
		if n.Managed && n.Config[boxcore.UplinksKey] != "" {
			// A dead run's public decoy, admitted as an uplink of the wall.
			if err := boxcore.NewHost(c, boxcore.Stack{Network: n.Name}).SetAdmittedUplinks(ctx, nil); err != nil {
				return done, err
			}
			done = append(done, "admitted uplinks on "+n.Name+" ("+n.Config[boxcore.UplinksKey]+")")
		}
		if !n.Managed {
			continue
		}
		if keep, found := drillServers(n.Name); found {
			if err := boxcore.LocalKernel().SetServers(n.Name, keep); err != nil {
				return done, err
			}
			done = append(done, "the test-domain forwarder in "+boxcore.ServersFile(n.Name))
		}
		if !hasDrillLines(n.Config["raw.dnsmasq"]) {
			continue
		}
		full, _, err := c.Network(ctx, n.Name)
		if err != nil {
			return done, err
		}
		full.Config["raw.dnsmasq"] = strings.Join(stripForwarder(full.Config["raw.dnsmasq"]), "\n")
		if err := boxcore.PutNetworkConfig(ctx, c, n.Name, full.Config); err != nil {
			return done, err
		}
		done = append(done, "raw.dnsmasq forwarder line on "+n.Name)
	}
	return done, nil
}

// Leftovers lists what Cleanup would remove (the SIGKILL test asserts it is empty).
func Leftovers(ctx context.Context, c *incus.Client) ([]string, error) {
	var out []string
	insts, err := c.Instances(ctx, nil, false)
	if err != nil {
		return nil, err
	}
	for _, in := range insts {
		if _, ok := in.Config[DrillTag]; ok {
			out = append(out, "instance "+in.Name)
		}
	}
	links, _ := netdump.Links()
	for _, l := range links {
		if isDrillVeth(l) {
			out = append(out, "link "+l.Attrs().Name)
		}
	}
	routes, _ := netdump.Routes(nil, netlink.FAMILY_V4)
	for _, r := range routes {
		if l, err := netlink.LinkByIndex(r.LinkIndex); err == nil && isDrillVeth(l) {
			out = append(out, "route "+r.String())
		}
	}
	ents, _ := os.ReadDir("/run/netns")
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), NetnsPrefix) {
			out = append(out, "netns "+e.Name())
		}
	}
	nets, err := c.Networks(ctx)
	if err != nil {
		return out, err
	}
	for _, n := range nets {
		if hasDrillLines(n.Config["raw.dnsmasq"]) {
			out = append(out, "raw.dnsmasq forwarder on "+n.Name)
		}
		if _, found := drillServers(n.Name); found {
			out = append(out, "forwarder in "+boxcore.ServersFile(n.Name))
		}
		if n.Config[boxcore.UplinksKey] != "" {
			out = append(out, "admitted uplinks on "+n.Name)
		}
	}
	if _, err := os.Stat(HoleMarker); err == nil {
		out = append(out, "a seeded hole left open ("+HoleMarker+")")
	}
	return out, nil
}

// VethAlias marks the decoy's veths (IFLA_IFALIAS): cleanup removes a veth only when it
// carries it, never one that merely shares the name prefix.
const VethAlias = "claudebox-drill decoy"

func isDrillVeth(l netlink.Link) bool {
	return l.Type() == "veth" && strings.HasPrefix(l.Attrs().Name, VethPrefix) && strings.HasPrefix(l.Attrs().Alias, VethAlias)
}

// drillServers reads a network's servers-file: found when a drill's forwarder is in it, keep
// the lines that are not a drill's.
func drillServers(network string) (keep []string, found bool) {
	lines, _ := boxcore.ReadServers(network)
	for _, l := range lines {
		if IsForwarderLine(l) {
			found = true
		} else {
			keep = append(keep, l)
		}
	}
	return keep, found
}

func hasDrillLines(raw string) bool {
	for _, l := range strings.Split(raw, "\n") {
		if IsForwarderLine(l) {
			return true
		}
	}
	return false
}
