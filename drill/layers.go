package drill

import (
	"context"
	"os"

	"golang.org/x/sys/unix"

	"github.com/claudebox/claudebox/boxcore"
	"github.com/claudebox/claudebox/boxcore/incus"
	"github.com/claudebox/claudebox/firewall"
)

// LayerState is one reading of one layer, as boxcore's stack reader gives it.
type LayerState = boxcore.LayerState

// HostInfo is what the record says about the machine.
type HostInfo struct {
	Hostname      string `json:"hostname"`
	Kernel        string `json:"kernel"`
	IncusVersion  string `json:"incus_version"`
	NFTBridgeMeta bool   `json:"nft_meta_bridge"`
}

func hostInfo(ctx context.Context, c *incus.Client) HostInfo {
	h := HostInfo{NFTBridgeMeta: firewall.BridgeMetaSupported()}
	h.Hostname, _ = os.Hostname()
	var u unix.Utsname
	if unix.Uname(&u) == nil {
		h.Kernel = unix.ByteSliceToString(u.Release[:])
	}
	if s, err := c.Server(ctx); err == nil {
		h.IncusVersion = s.Version
	}
	return h
}

func (e *engine) printLayers(title string, ls []LayerState) {
	e.progress("%s:", title)
	for _, l := range ls {
		mark := "on "
		if !l.On {
			mark = "OFF"
		}
		e.progress("  %s %-18s %s", mark, l.Layer, l.What)
	}
}
