package drill

import (
	"maps"
	"net/netip"
	"slices"
	"strings"

	"github.com/claudebox/claudebox/boxcore/templates"
	"github.com/claudebox/claudebox/internal/addr4"
)

// The nested claim: a container that Docker runs inside a box reaches what the box reaches
// and nothing more. The first box carries the docker template's container settings
// (nesting), and its probe agent builds a container the way Docker's default bridge network
// does — new namespaces behind a veth pair, the box forwarding and masquerading them out of
// eth0 — and runs the rows below from inside it.
// They are the box rows of the same name with the nested container as their source: same
// expectation, same layers (the packets leave the box as the box's own), and their controls
// are the nested container's own where the box row's were the box's.

// ClaimNested groups the nested container's rows.
const ClaimNested = "a container in a box (Docker) reaches what the box reaches"

// NestedSuffix marks the nested container of a box in a case's source: "BOX/nested".
const NestedSuffix = "/nested"

// NestedTemplate is the template whose container settings the drill's nesting box gets.
const NestedTemplate = "docker"

// nestedRowKeys are the box rows the nested container repeats: the positive controls and
// every claim that a masqueraded packet could break (a frame or a spoof cannot leave the
// container's veth as anything but the box's own traffic: those rows stay the box's).
var nestedRowKeys = []string{
	"internet/tcp", "internet/dns",
	"box-box/tcp", "box-box/udp", "box-box/icmp",
	"box-box-name/dns-instance", "box-box-name/dns-ptr", "host-names/dns",
	"box-host/gateway-tcp", "box-host/gateway-udp", "box-host/addr-tcp", "box-host/addr-udp",
	"lan/tcp", "lan/udp", "lan/icmp", "cgnat/tcp", "cgnat/udp", "cgnat/icmp",
	"other-net/tcp", "other-net/udp", "uplink-net/tcp", "uplink-net/udp",
	"resolver/servers.bind",
}

// FromNested is the first box's nested container, when the lab built one.
var FromNested = Selector{"the first box's nested container", func(t *Topology, _ Endpoint) []Endpoint {
	if !t.Nested.IsValid() || len(t.Boxes) == 0 {
		return nil
	}
	b := t.Boxes[0]
	return []Endpoint{{Key: b.Name + NestedSuffix, Label: b.Name + " (nested container)", Box: b}}
}}

// withNested appends the nested container's version of each of nestedRowKeys.
func withNested(rows []ClaimRow) []ClaimRow {
	byKey := map[string]ClaimRow{}
	for _, r := range rows {
		byKey[r.Key] = r
	}
	for _, k := range nestedRowKeys {
		r, ok := byKey[k]
		if !ok {
			panic("drill: nested row " + k + " is no claim row")
		}
		n := r
		n.Key, n.From = "nested/"+k, FromNested
		if r.Claim != ClaimInternet {
			n.Claim = ClaimNested
		}
		n.Controls = nil
		own := false
		for _, c := range r.Controls {
			if c.From == EndSource && slices.Contains(nestedRowKeys, c.Row) {
				c.Row, own = "nested/"+c.Row, true
			}
			n.Controls = append(n.Controls, c)
		}
		// A verdict from a container that reaches nothing proves nothing: every negative row
		// needs the container's own positive control (the box rows' host-side ones do not
		// show that the container's network works).
		if r.Expect.Negative() && !own {
			n.Controls = append(n.Controls, Control{"nested/internet/tcp", EndSource, EndPublic})
		}
		rows = append(rows, n)
	}
	return rows
}

// nestedBox is the box a case's source names when it is a box's nested container.
func nestedBox(from string) (string, bool) {
	return strings.CutSuffix(from, NestedSuffix)
}

// nestingConfig is what the drill's first box gets so that its nested container runs as
// Docker's would in a box of the docker template.
func nestingConfig() map[string]string {
	t, err := templates.Get(NestedTemplate)
	if err != nil {
		panic(err) // the embedded templates are checked by their tests
	}
	return maps.Clone(t.ContainerConfig)
}

// nestedPrefix is the nested container's /30 inside the box: in the decoy's free /24 of the
// benchmarking range, clear of every decoy address and every address the host routes.
func nestedPrefix(d *Decoy) netip.Prefix {
	if d == nil || !d.Public.IsValid() {
		return netip.Prefix{}
	}
	return netip.PrefixFrom(addr4.Add(d.Public, 30), 30) // .40/30: the /24's .10 is the public decoy
}
