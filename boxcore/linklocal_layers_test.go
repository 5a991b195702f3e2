package boxcore_test

// The link-local group path on a real stack, layer by layer (runs with the attack harness:
// CLAUDEBOX_ATTACK=1, on a stack of its own; traffic only to this machine's own addresses).
// A box's frame to 01:80:c2:00:00:0X reaches the host's IP stack on the box's own port. Two
// layers hold it: the wall (pre-port, pre-subnet-elsewhere) and port-rp-filter. Each alone holds
// every case; with both off the cases reach the host again; restored, held again.
//
//	CLAUDEBOX_ATTACK=1 go test ./boxcore -run TestAttackLinkLocalLayers -v -count=1

import (
	"context"
	"fmt"
	"net"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/claudebox/claudebox/boxcore"
	"github.com/claudebox/claudebox/internal/testenv"
	"github.com/claudebox/claudebox/internal/teststack"
)

func TestAttackLinkLocalLayers(t *testing.T) {
	if os.Getenv("CLAUDEBOX_ATTACK") != "1" {
		t.Skip("attack harness: set CLAUDEBOX_ATTACK=1")
	}
	c := testenv.RequireIncus(t)
	ctx := context.Background()
	s := teststack.New(t, c, "atkll")
	bs := &boxcore.Boxes{Client: c, Stack: s, Version: "test"}
	img := teststack.ProbeImage(t, c)
	f := &atkFixture{c: c, s: s, h: boxcore.NewHost(c, s)}
	nics := mintTwo(t, ctx, bs, img, "cbt-atkll")
	f.a, f.b = nics[0], nics[1]
	gw, _, err := net.ParseCIDR(mustNetwork(t, c, s.Network).Config["ipv4.address"])
	if err != nil {
		t.Fatal(err)
	}
	f.gw = gw.To4()
	ifs, _ := net.Interfaces()
	for _, ifi := range ifs {
		if ifi.Name == s.Network || ifi.Flags&net.FlagLoopback != 0 {
			continue
		}
		addrs, _ := ifi.Addrs()
		for _, ad := range addrs {
			if ipn, ok := ad.(*net.IPNet); ok && ipn.IP.To4() != nil {
				f.hostIPs = append(f.hostIPs, ipn.IP.To4())
			}
		}
	}
	other := f.otherHostIP()
	targets := []net.IP{f.gw}
	if other != nil {
		targets = append(targets, other)
	}
	for _, ip := range targets {
		mustLocal(t, ip, s.Network)
	}
	if r := mustCheck(t, f.h); !r.OK {
		t.Fatalf("stack not converged: %v", driftItems(r))
	}
	requireLayer(t, f.h, boxcore.LayerWall, true)
	requireLayer(t, f.h, boxcore.LayerPortRPFilter, true)
	hl := listenHost(t)

	n := 0
	round := func(t *testing.T, phase string) map[string]string {
		t.Helper()
		n++
		a, b := nicOf(t, c, f.a.name), f.b
		var frames []frameCase
		var names []string
		add := func(name string, frame []byte) {
			frames = append(frames, frameCase{name: name, frame: frame})
			names = append(names, name)
		}
		for _, x := range []byte{0x03, 0x0e, 0x0f} {
			ll := net.HardwareAddr{1, 0x80, 0xc2, 0, 0, x}
			for _, ip := range targets {
				nm := fmt.Sprintf("r%d-ll%02x-udp-%s", n, x, ip)
				add(nm, ether(ll, a.mac, 0x0800, udpPkt(a.ip, ip, 40800, uint16(hl.port), []byte(marker(nm)))))
			}
			nm := fmt.Sprintf("r%d-ll%02x-icmp-gw", n, x)
			add(nm, ether(ll, a.mac, 0x0800, icmpEcho(a.ip, f.gw, []byte(marker(nm)))))
			if other != nil {
				nm = fmt.Sprintf("r%d-ll%02x-spoof-b-ip", n, x)
				add(nm, ether(ll, a.mac, 0x0800, udpPkt(b.ip, other, 40801, uint16(hl.port), []byte(marker(nm)))))
				nm = fmt.Sprintf("r%d-ll%02x-spoof-b-ip-mac", n, x)
				add(nm, ether(ll, b.mac, 0x0800, udpPkt(b.ip, other, 40802, uint16(hl.port), []byte(marker(nm)))))
			}
		}
		var toB []string
		toA, _ := captureDir(t, a.veth, func() {
			toB, _ = captureDir(t, b.veth, func() { sendFrom(t, c, a.name, frames) })
		})
		time.Sleep(200 * time.Millisecond)
		out := map[string]string{}
		for _, nm := range names {
			var got []string
			if src, ok := hl.got(nm); ok {
				got = append(got, "host listener heard it from "+src)
			}
			if slices.Contains(toA, nm) || slices.Contains(toA, "echo-"+nm) {
				got = append(got, "reply into the box")
			}
			if slices.Contains(toB, "echo-"+nm) {
				got = append(got, "reflected into the sibling")
			}
			key := strings.SplitN(nm, "-", 2)[1]
			out[key] = strings.Join(got, "; ")
			if out[key] != "" {
				record(t, phase+" "+key, "THROUGH: %s", out[key])
			} else {
				record(t, phase+" "+key, "blocked")
			}
		}
		return out
	}
	held := func(t *testing.T, phase string) {
		t.Helper()
		for k, v := range round(t, phase) {
			if v != "" {
				t.Errorf("%s: %s got through: %s", phase, k, v)
			}
		}
	}
	// With both layers off every LLDP-group (0e) case reaches the host: it skips the bridge's
	// input hook. For 03 and 0f that hook still runs, so Incus's NIC filtering holds the spoofs
	// and the l2-ranges layer the uplink address (its subnet is blocked); every other case
	// reaches the host.
	open := func(t *testing.T, phase string) {
		t.Helper()
		for k, v := range round(t, phase) {
			bridgeInput := !strings.HasPrefix(k, "ll0e") &&
				(strings.Contains(k, "spoof") || other != nil && strings.Contains(k, "-"+other.String()))
			if v == "" && !bridgeInput {
				t.Errorf("%s: %s held with both layers off, want it through (the seeded hole)", phase, k)
			}
		}
	}
	switchOff := func(t *testing.T, ls ...boxcore.Layer) func() {
		t.Helper()
		restore, err := f.h.SwitchOff(ctx, ls, nil)
		if err != nil {
			t.Fatalf("switch off %v: %v", ls, err)
		}
		for _, l := range ls {
			requireLayer(t, f.h, l, false)
		}
		return func() {
			if err := restore(ctx); err != nil {
				t.Fatalf("restore %v: %v", ls, err)
			}
			for _, l := range ls {
				requireLayer(t, f.h, l, true)
			}
		}
	}

	held(t, "every layer on")
	back := switchOff(t, boxcore.LayerWall)
	held(t, "wall off (port-rp-filter alone of the two)")
	back()
	back = switchOff(t, boxcore.LayerPortRPFilter)
	held(t, "port-rp-filter off (the wall alone of the two)")
	back()
	back = switchOff(t, boxcore.LayerWall, boxcore.LayerPortRPFilter)
	open(t, "wall and port-rp-filter off")
	back()
	held(t, "both restored")
	if r := mustCheck(t, f.h); !r.OK {
		t.Errorf("stack not converged after the restores: %v", driftItems(r))
	}
	results.Lock()
	defer results.Unlock()
	for _, r := range results.list {
		t.Logf("SUMMARY %-50s %s", r.attack, r.outcome)
	}
}
