package drill

import (
	"net/netip"
	"os"
	"strings"
	"testing"

	"github.com/vishvananda/netlink"
)

func TestPickEdgesSkipsClaims(t *testing.T) {
	a := avoid{nets: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/24"), netip.MustParsePrefix("10.255.255.0/24")}}
	got, err := pickEdges("10.0.0.0/8", a)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 || got[0] != netip.MustParseAddr("10.0.1.1") || got[1] != netip.MustParseAddr("10.255.254.254") {
		t.Fatalf("edges = %v", got)
	}
	if _, err := pickEdges("192.168.0.0/16", avoid{nets: []netip.Prefix{netip.MustParsePrefix("192.168.0.0/16")}}); err == nil {
		t.Fatal("a fully routed range must be refused")
	}
}

func TestForwarderLine(t *testing.T) {
	l := ForwarderLine("incus", netip.MustParsePrefix("10.87.1.1/24"), netip.MustParseAddr("198.18.0.10"))
	if l != "server=/claudebox-drill.test/incus//1.87.10.in-addr.arpa/198.18.0.10" {
		t.Fatalf("line = %q", l)
	}
	if !IsForwarderLine(l) || IsForwarderLine("server=10.255.255.53") {
		t.Fatal("IsForwarderLine")
	}
	got := stripForwarder("no-hosts\n" + l + "\nserver=1.1.1.1")
	if strings.Join(got, ",") != "no-hosts,server=1.1.1.1" {
		t.Fatalf("strip = %v", got)
	}
}

func TestVMAgentCommands(t *testing.T) {
	cmds := VMAgentCommands()
	if len(cmds) != 1 || !strings.Contains(cmds[0][2], VMAgent+" probe serve") || !strings.HasSuffix(cmds[0][2], "&") {
		t.Fatalf("VM agent commands = %v", cmds)
	}
}

func TestBoxNames(t *testing.T) {
	if BoxName("abc123", 0, 1) != "cbdrill-abc123-b" || BoxName("abc123", 1, 0) != "cbdrill-abc123-2a" {
		t.Fatal(BoxName("abc123", 0, 1), BoxName("abc123", 1, 0))
	}
	if JSONLPath("/x/RUNS.md") != "/x/RUNS.jsonl" {
		t.Fatal(JSONLPath("/x/RUNS.md"))
	}
}

// A VM-mode run records itself as one (the report used to say "container mode" whatever ran).
func TestReportRecordsInstanceType(t *testing.T) {
	for vm, want := range map[bool]string{true: "virtual-machine", false: "container"} {
		r := (&engine{o: Options{VM: vm, Boxes: 2}}).newReport()
		r.finish()
		if r.InstanceType != want || (vm && strings.Contains(r.VMBoundary, "not validated")) {
			t.Errorf("VM %v: instance type %q, boundary %q", vm, r.InstanceType, r.VMBoundary)
		}
	}
}

// Boxes that never got ready leave no nil behind in the run's list.
func TestCompactBoxes(t *testing.T) {
	a, b := &Box{Name: "a"}, &Box{Name: "b"}
	if got := compact([]*Box{nil, a, nil, b}); len(got) != 2 || got[0] != a || got[1] != b {
		t.Fatalf("compact = %v", got)
	}
}

// --cleanup removes only veths carrying the decoy's mark, not every veth named cbdr*.
func TestCleanupNeedsTheMark(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root")
	}
	name := VethPrefix + "t" + NewRunID()[:4] + "h"
	v := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: name}, PeerName: name[:len(name)-1] + "n"}
	if err := netlink.LinkAdd(v); err != nil {
		t.Fatal(err)
	}
	defer func() {
		if l, err := netlink.LinkByName(name); err == nil {
			_ = netlink.LinkDel(l)
		}
	}()
	l, _ := netlink.LinkByName(name)
	if isDrillVeth(l) {
		t.Fatal("an unmarked veth counts as the drill's")
	}
	if err := netlink.LinkSetAlias(l, VethAlias+" "+name); err != nil {
		t.Fatal(err)
	}
	l, _ = netlink.LinkByName(name)
	if !isDrillVeth(l) {
		t.Fatal("a marked veth does not count as the drill's")
	}
}
