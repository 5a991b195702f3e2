package boxcore_test

import (
	"context"
	"encoding/json"
	"errors"
	"net"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/claudebox/claudebox/boxcore"
	"github.com/claudebox/claudebox/boxcore/incus"
	"github.com/claudebox/claudebox/firewall"
	"github.com/claudebox/claudebox/internal/testenv"
	"github.com/claudebox/claudebox/internal/teststack"
)

func TestMain(m *testing.M) {
	code := m.Run()
	teststack.RemoveBinary()
	os.Exit(code)
}

// snapshotHost captures every object init manages, as the daemon and the kernel hold them.
func snapshotHost(t *testing.T, c *incus.Client, s boxcore.Stack) string {
	t.Helper()
	ctx := context.Background()
	n, _, err := c.Network(ctx, s.Network)
	if err != nil {
		t.Fatal(err)
	}
	a, _, err := c.NetworkACL(ctx, s.ACL)
	if err != nil {
		t.Fatal(err)
	}
	p, _, err := c.Profile(ctx, s.Profile)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := json.Marshal([]any{n.Config, n.Description, a, p.Config, p.Devices, p.Description})
	return string(b) + "\n" + nftRuleset(t, s)
}

func nftRuleset(t *testing.T, s boxcore.Stack) string {
	t.Helper()
	bt, gt := firewall.TableNames(s.Network)
	var out []string
	for _, tbl := range [][2]string{{"bridge", bt}, {"inet", gt}} {
		b, err := exec.Command("nft", "list", "table", tbl[0], tbl[1]).CombinedOutput()
		if err != nil {
			out = append(out, "missing "+tbl[1])
			continue
		}
		out = append(out, string(b))
	}
	return strings.Join(out, "\n")
}

func mustCheck(t *testing.T, h *boxcore.Host) boxcore.CheckReport {
	t.Helper()
	r, err := h.Check(context.Background())
	if err != nil {
		t.Fatalf("check: %v", err)
	}
	return r
}

func driftItems(r boxcore.CheckReport) []string {
	var out []string
	for _, d := range r.Drift() {
		out = append(out, d.Layer+": "+d.Item)
	}
	return out
}

func TestHostInitCheckTeardown(t *testing.T) {
	c := testenv.RequireIncus(t)
	ctx := context.Background()
	teststack.Sweep(t, c)
	s := teststack.Stack("host")
	t.Cleanup(func() { teststack.Remove(t, c, s) })
	h := boxcore.NewHost(c, s)

	changes, err := h.Init(ctx, boxcore.InitOptions{DNS: "host"})
	if err != nil {
		t.Fatalf("first init: %v", err)
	}
	if len(changes) < 4 {
		t.Fatalf("first init reported too few changes: %v", changes)
	}
	if r := mustCheck(t, h); !r.OK {
		t.Fatalf("check after init drifts: %v", driftItems(r))
	}

	t.Run("second init changes nothing", func(t *testing.T) {
		before := snapshotHost(t, c, s)
		changes, err := h.Init(ctx, boxcore.InitOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if len(changes) != 0 {
			t.Fatalf("second init reported changes: %v", changes)
		}
		if after := snapshotHost(t, c, s); after != before {
			t.Fatalf("second init changed the host:\nbefore:\n%s\nafter:\n%s", before, after)
		}
	})

	t.Run("drift: bridge table deleted by hand", func(t *testing.T) {
		bt, _ := firewall.TableNames(s.Network)
		if out, err := exec.Command("nft", "delete", "table", "bridge", bt).CombinedOutput(); err != nil {
			t.Fatalf("nft delete: %v %s", err, out)
		}
		r := mustCheck(t, h)
		got := driftItems(r)
		if r.OK || len(got) == 0 {
			t.Fatal("check did not notice the missing bridge table")
		}
		for _, d := range r.Drift() {
			if d.Layer != "nftables" || !strings.Contains(d.Item+d.Expected+d.Actual, bt) {
				t.Fatalf("check names more than the bridge table: %v", got)
			}
		}
		repairAndCheck(t, h)
	})

	t.Run("drift: an ACL rule deleted from the kernel by hand", func(t *testing.T) {
		chain := "acl." + s.Network
		out, err := exec.Command("nft", "-a", "list", "chain", "inet", "incus", chain).CombinedOutput()
		if err != nil {
			t.Fatalf("nft list: %v %s", err, out)
		}
		var handle string
		for _, l := range strings.Split(string(out), "\n") {
			if strings.Contains(l, "ip daddr 10.0.0.0/8 drop") {
				handle = l[strings.LastIndex(l, " ")+1:]
			}
		}
		if handle == "" {
			t.Fatalf("no 10.0.0.0/8 drop rule in %s:\n%s", chain, out)
		}
		if out, err := exec.Command("nft", "delete", "rule", "inet", "incus", chain, "handle", handle).CombinedOutput(); err != nil {
			t.Fatalf("nft delete rule: %v %s", err, out)
		}
		r := mustCheck(t, h)
		want := []string{"acl (kernel): inet incus " + chain + ` lacks: iifname "` + s.Network + `" ip daddr 10.0.0.0/8 drop`}
		if got := driftItems(r); !slices.Equal(got, want) {
			t.Fatalf("drift = %v, want exactly %v", got, want)
		}
		if l := layerOf(t, h, boxcore.LayerACL, nil); l.On {
			t.Fatalf("layer acl reads on with a rule gone: %s", l.What)
		}
		repairAndCheck(t, h)
	})

	t.Run("drift: no-hosts removed", func(t *testing.T) {
		n, _, err := c.Network(ctx, s.Network)
		if err != nil {
			t.Fatal(err)
		}
		cfg := n.Config
		cfg["raw.dnsmasq"] = strings.ReplaceAll(cfg["raw.dnsmasq"], "no-hosts\n", "")
		if err := incus.RetryBridgeChildrenRace(ctx, func() error { return c.UpdateNetwork(ctx, s.Network, cfg, n.Description, "") }); err != nil {
			t.Fatal(err)
		}
		r := mustCheck(t, h)
		got := driftItems(r)
		want := []string{"network: " + s.Network + " raw.dnsmasq no-hosts", "dnsmasq: option no-hosts"}
		if !slices.Equal(got, want) {
			t.Fatalf("drift = %v, want exactly %v", got, want)
		}
		repairAndCheck(t, h)
	})

	t.Run("a box started between init's plan and its apply stays bound", func(t *testing.T) {
		// init reads the boxes when it plans and applies the firewall later (the CLI asks
		// first): a box whose start bound its port in between must not lose that binding.
		bt, _ := firewall.TableNames(s.Network)
		p, err := h.PlanInit(ctx, boxcore.InitOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if out, err := exec.Command("nft", "delete", "table", "bridge", bt).CombinedOutput(); err != nil {
			t.Fatalf("nft delete: %v %s", err, out) // so that the apply rewrites the table
		}
		bs := &boxcore.Boxes{Client: c, Stack: s, Version: "test"}
		name := "cbt-host-" + testenv.RunID() + "-p"
		if _, err := bs.New(ctx, boxcore.NewOptions{Name: name, Image: teststack.ProbeImage(t, c), Config: teststack.Tag()}); err != nil {
			t.Fatalf("new: %v", err)
		}
		defer func() { _ = bs.Remove(ctx, &boxcore.Box{Name: name, Instance: incus.Instance{Status: "Running"}}) }()
		if _, err := h.ApplyInit(ctx, p); err != nil {
			t.Fatal(err)
		}
		r := mustCheck(t, h)
		if !r.OK {
			t.Fatalf("after an init planned before %s started: drift %v", name, r.Drift())
		}
	})

	t.Run("drift: a network key claudebox does not set", func(t *testing.T) {
		// bridge.external_interfaces would join the boxes' bridge to another segment: any key
		// init would remove is drift, named with its value.
		n, _, err := c.Network(ctx, s.Network)
		if err != nil {
			t.Fatal(err)
		}
		n.Config["bridge.mtu"] = "1400"
		if err := incus.RetryBridgeChildrenRace(ctx, func() error { return c.UpdateNetwork(ctx, s.Network, n.Config, n.Description, "") }); err != nil {
			t.Fatal(err)
		}
		r := mustCheck(t, h)
		want := []string{"network: " + s.Network + " keys claudebox does not set"}
		if got := driftItems(r); !slices.Equal(got, want) {
			t.Fatalf("drift = %v, want exactly %v", got, want)
		}
		for _, row := range r.Drift() {
			if row.Actual != "bridge.mtu=1400" {
				t.Errorf("drift row %+v, want actual bridge.mtu=1400", row)
			}
		}
		repairAndCheck(t, h)
		if n, _, err := c.Network(ctx, s.Network); err != nil || n.Config["bridge.mtu"] != "" {
			t.Errorf("after init: bridge.mtu=%q (%v), want it removed", n.Config["bridge.mtu"], err)
		}
	})

	t.Run("drift: a lease name learnt while dhcp-ignore-names was off", func(t *testing.T) {
		n, _, err := c.Network(ctx, s.Network)
		if err != nil {
			t.Fatal(err)
		}
		n.Config["raw.dnsmasq"] = strings.ReplaceAll(n.Config["raw.dnsmasq"], "dhcp-ignore-names\n", "")
		if err := incus.RetryBridgeChildrenRace(ctx, func() error { return c.UpdateNetwork(ctx, s.Network, n.Config, n.Description, "") }); err != nil {
			t.Fatal(err)
		}
		bs := &boxcore.Boxes{Client: c, Stack: s, Version: "test"}
		name := "cbt-host-" + testenv.RunID() + "-n"
		if _, err := bs.New(ctx, boxcore.NewOptions{Name: name, Image: teststack.ProbeImage(t, c), Config: teststack.Tag()}); err != nil {
			t.Fatalf("new: %v", err)
		}
		d, _ := h.Kernel.FindDNSMasq(s.Network)
		deadline := time.Now().Add(15 * time.Second)
		for {
			names, _ := boxcore.LeaseNames(d.LeaseFile())
			if slices.Contains(names, name) {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("dnsmasq never recorded %s's DHCP hostname (names %v)", name, names)
			}
			time.Sleep(100 * time.Millisecond)
		}
		gw := strings.Split(n.Config["ipv4.address"], "/")[0]
		if rcode := resolve(t, gw, name); rcode != dns.RcodeSuccess {
			t.Fatalf("positive control: the gateway does not resolve %s with the option off (rcode %d)", name, rcode)
		}
		r := mustCheck(t, h)
		got := driftItems(r)
		want := []string{"network: " + s.Network + " raw.dnsmasq dhcp-ignore-names", "dnsmasq: option dhcp-ignore-names", "dnsmasq: names in leases"}
		if !slices.Equal(got, want) {
			t.Fatalf("drift = %v, want exactly %v", got, want)
		}
		repairAndCheck(t, h)
		if rcode := resolve(t, gw, name); rcode != dns.RcodeNameError {
			t.Fatalf("after repair the gateway still answers %s (rcode %d)", name, rcode)
		}
		if err := bs.Remove(ctx, &boxcore.Box{Name: name, Instance: incus.Instance{Status: "Running"}}); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("drift: one port's isolation off", func(t *testing.T) {
		bs := &boxcore.Boxes{Client: c, Stack: s, Version: "test"}
		box, err := bs.New(ctx, boxcore.NewOptions{Name: "cbt-host-" + testenv.RunID(), Image: teststack.ProbeImage(t, c), Config: teststack.Tag()})
		if err != nil {
			t.Fatalf("new: %v", err)
		}
		st, err := c.InstanceState(ctx, box.Name)
		if err != nil {
			t.Fatal(err)
		}
		port := st.Network["eth0"].HostName
		if err := h.Kernel.SetPortIsolated(port, false); err != nil {
			t.Fatal(err)
		}
		r := mustCheck(t, h)
		if got, want := driftItems(r), []string{"port isolation: " + port}; !slices.Equal(got, want) {
			t.Fatalf("drift = %v, want exactly %v", got, want)
		}
		repairAndCheck(t, h)

		// Teardown refuses while a box uses the stack, and changes nothing.
		before := snapshotHost(t, c, s)
		_, err = h.PlanTeardown(ctx, false)
		if !boxcore.IsUsage(err) || !strings.Contains(err.Error(), box.Name) {
			t.Fatalf("teardown with a box and no force: %v", err)
		}
		if after := snapshotHost(t, c, s); after != before {
			t.Fatal("refused teardown changed the host")
		}
	})

	t.Run("teardown leaves nothing", func(t *testing.T) {
		p, err := h.PlanTeardown(ctx, true)
		if err != nil {
			t.Fatal(err)
		}
		if len(p.Boxes) != 1 {
			t.Fatalf("teardown --force should report 1 box losing its network, got %v", p.Boxes)
		}
		if _, err := h.ApplyTeardown(ctx, p); err != nil {
			t.Fatal(err)
		}
		if _, _, err := c.Network(ctx, s.Network); !errors.Is(err, incus.ErrNotFound) {
			t.Errorf("network still there: %v", err)
		}
		if _, _, err := c.NetworkACL(ctx, s.ACL); !errors.Is(err, incus.ErrNotFound) {
			t.Errorf("ACL still there: %v", err)
		}
		if _, _, err := c.Profile(ctx, s.Profile); !errors.Is(err, incus.ErrNotFound) {
			t.Errorf("profile still there: %v", err)
		}
		if rs := nftRuleset(t, s); !strings.Contains(rs, "missing claudebox_"+s.Network+"\n") || strings.Count(rs, "missing") != 2 {
			t.Errorf("nft tables still there:\n%s", rs)
		}
		// The box survived, off the stack, with its disk.
		in, _, err := c.Instance(ctx, "cbt-host-"+testenv.RunID())
		if err != nil {
			t.Fatalf("box gone after teardown --force: %v", err)
		}
		if len(in.Profiles) != 0 || in.Devices["root"] == nil {
			t.Errorf("box after teardown: profiles %v devices %v", in.Profiles, in.Devices)
		}
	})
}

func repairAndCheck(t *testing.T, h *boxcore.Host) {
	t.Helper()
	changes, err := h.Init(context.Background(), boxcore.InitOptions{})
	if err != nil {
		t.Fatalf("repairing init: %v", err)
	}
	if len(changes) == 0 {
		t.Fatal("repairing init reported no changes")
	}
	if r := mustCheck(t, h); !r.OK {
		t.Fatalf("check after repair drifts: %v", driftItems(r))
	}
}

func TestHostInitBadInput(t *testing.T) {
	c := testenv.RequireIncus(t)
	ctx := context.Background()
	s := teststack.Stack("badinput")
	h := boxcore.NewHost(c, s)
	t.Cleanup(func() { teststack.Remove(t, c, s) })

	claims, err := boxcore.HostClaims()
	if err != nil {
		t.Fatal(err)
	}
	var taken string
	for _, cl := range claims {
		if ones, _ := cl.Net.Mask.Size(); ones <= 24 {
			taken = cl.Net.IP.Mask(cl.Net.Mask).String() + "/24"
			break
		}
	}
	cases := []struct {
		name string
		opts boxcore.InitOptions
		want string
	}{
		{"invalid subnet", boxcore.InitOptions{Subnet: "10.1.2.3/24"}, "invalid subnet"},
		{"not a /24", boxcore.InitOptions{Subnet: "10.1.0.0/16"}, "invalid subnet"},
		{"garbage subnet", boxcore.InitOptions{Subnet: "banana"}, "invalid subnet"},
		{"invalid dns", boxcore.InitOptions{DNS: "1.1.1.1,nope"}, "invalid dns"},
	}
	if taken != "" {
		cases = append(cases, struct {
			name string
			opts boxcore.InitOptions
			want string
		}{"claimed subnet", boxcore.InitOptions{Subnet: taken}, "already used by"})
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := h.PlanInit(ctx, tc.opts)
			if err == nil || !boxcore.IsUsage(err) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("PlanInit(%+v) = %v, want a usage error containing %q", tc.opts, err, tc.want)
			}
			var opt *boxcore.OptionError
			var taken *boxcore.SubnetTakenError
			if !errors.As(err, &opt) && !errors.As(err, &taken) {
				t.Fatalf("PlanInit(%+v) = %T, want an *OptionError or *SubnetTakenError", tc.opts, err)
			}
			if _, _, err := c.Network(ctx, s.Network); !errors.Is(err, incus.ErrNotFound) {
				t.Fatalf("bad input left a network behind: %v", err)
			}
		})
	}
}

// resolve asks the bridge's dnsmasq (on the gateway, this host's own address) for a name.
func resolve(t *testing.T, server, name string) int {
	t.Helper()
	m := new(dns.Msg)
	m.SetQuestion(dns.Fqdn(name), dns.TypeA)
	cl := &dns.Client{Timeout: 2 * time.Second}
	r, _, err := cl.Exchange(m, net.JoinHostPort(server, "53"))
	if err != nil {
		t.Fatalf("asking %s for %s: %v", server, name, err)
	}
	if r.Rcode == dns.RcodeSuccess && len(r.Answer) == 0 {
		return -1 // answered, but empty
	}
	return r.Rcode
}

// host check prints its rows in the same order every time (it used to follow map order).
func TestCheckOrderIsStable(t *testing.T) {
	c := testenv.RequireIncus(t)
	s := teststack.New(t, c, "order")
	h := boxcore.NewHost(c, s)
	var first []string
	for i := 0; i < 5; i++ {
		r, err := h.Check(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		var rows []string
		for _, row := range r.Rows {
			rows = append(rows, row.Layer+" / "+row.Item)
		}
		if i == 0 {
			first = rows
			continue
		}
		if strings.Join(rows, "\n") != strings.Join(first, "\n") {
			t.Fatalf("check %d lists its rows in another order:\n%s\nwas:\n%s", i, strings.Join(rows, "\n"), strings.Join(first, "\n"))
		}
	}
}

// An init that planned on a missing ACL and finds it made meanwhile (another init, or a
// daemon read that missed it once: one CI run's second init failed so) converges the one it
// finds instead of failing on the create.
func TestInitACLMadeMeanwhile(t *testing.T) {
	c := testenv.RequireIncus(t)
	ctx := context.Background()
	s := teststack.Stack("aclrace")
	t.Cleanup(func() { teststack.Remove(t, c, s) })
	h := boxcore.NewHost(c, s)
	p, err := h.PlanInit(ctx, boxcore.InitOptions{DNS: "host"})
	if err != nil {
		t.Fatal(err)
	}
	stray := incus.NetworkACL{Name: s.ACL, Description: "made meanwhile", Egress: []incus.ACLRule{}, Ingress: []incus.ACLRule{}}
	if err := c.CreateNetworkACL(ctx, stray); err != nil {
		t.Fatal(err)
	}
	if _, err := h.ApplyInit(ctx, p); err != nil {
		t.Fatalf("init after the ACL appeared: %v", err)
	}
	r, err := h.Check(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range r.Drift() {
		t.Errorf("drift after the init: %+v", d)
	}
}
