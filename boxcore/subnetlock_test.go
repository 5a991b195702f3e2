package boxcore_test

import (
	"context"
	"net"
	"slices"
	"sync"
	"testing"

	"github.com/claudebox/claudebox/boxcore"
	"github.com/claudebox/claudebox/internal/testenv"
	"github.com/claudebox/claudebox/internal/teststack"
)

// Several inits at once (as test packages running side by side do) must end with distinct
// subnets: Incus does not refuse a second bridge with a /24 another has (the second's dnsmasq
// fails to bind the gateway, or both come up and the gateway's unicast, DNS and DHCP renewals go
// to whichever bridge the kernel picks). All plans are read before any network exists, so they
// all propose the same free /24; the applies then race, each Host with its own open of the lock
// file (flock holds between them as between processes). The pick is made again under the
// subnet lock, right before the create.
func TestConcurrentInitsPickDistinctSubnets(t *testing.T) {
	c := testenv.RequireIncus(t)
	teststack.Sweep(t, c)
	ctx := context.Background()
	const n = 4
	hosts := make([]*boxcore.Host, n)
	plans := make([]*boxcore.InitPlan, n)
	errs := make([]error, n)
	for i := range hosts {
		s := teststack.Numbered("subnet", i)
		t.Cleanup(func() { teststack.Remove(t, c, s) })
		hosts[i] = boxcore.NewHost(c, s)
	}
	var wg sync.WaitGroup
	for i, h := range hosts {
		wg.Go(func() { plans[i], errs[i] = h.PlanInit(ctx, boxcore.InitOptions{DNS: "host"}) })
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("plan %d: %v", i, err)
		}
	}
	proposed := map[string]bool{}
	for _, p := range plans {
		proposed[p.Gateway.String()] = true
	}
	t.Logf("the %d plans proposed %d distinct gateways", n, len(proposed))

	start := make(chan struct{})
	for i, h := range hosts {
		wg.Go(func() {
			<-start
			_, errs[i] = h.ApplyInit(ctx, plans[i])
		})
	}
	close(start)
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("init of %s: %v", hosts[i].Stack.Network, err)
		}
	}

	nets, err := c.Networks(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// Ours against each other and against every other network on the host (two networks of
	// others sharing one is not this test's business).
	ours := map[string]bool{}
	for _, h := range hosts {
		ours[h.Stack.Network] = true
	}
	holder := map[string][]string{} // subnet -> networks
	for _, nw := range nets {
		if _, sub, err := net.ParseCIDR(nw.Config["ipv4.address"]); nw.Managed && err == nil {
			holder[sub.String()] = append(holder[sub.String()], nw.Name)
		}
	}
	for sub, names := range holder {
		if len(names) > 1 && slices.ContainsFunc(names, func(n string) bool { return ours[n] }) {
			t.Errorf("networks %v share %s", names, sub)
		}
	}
	for i, h := range hosts {
		nw, _, err := c.Network(ctx, h.Stack.Network)
		if err != nil {
			t.Fatal(err)
		}
		if got, want := nw.Config["ipv4.address"], plans[i].Gateway.String(); got != want {
			t.Errorf("%s has %s, but its plan says %s", h.Stack.Network, got, want)
		}
		if r := mustCheck(t, h); !r.OK {
			t.Errorf("check of %s after the concurrent inits drifts: %v", h.Stack.Network, driftItems(r))
		}
	}
}
