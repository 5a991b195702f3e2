package boxcore

import (
	"encoding/json"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/claudebox/claudebox/boxcore/incus"
)

// list and info give addresses as plain strings, the interface in its own field, and times
// in UTC (RFC 3339 in JSON).
func TestSummaryAddressesAndTimes(t *testing.T) {
	zone := time.FixedZone("CET", 3600)
	in := incus.Instance{
		Name: "work", Status: "Running", Type: "container", Config: map[string]string{TagKey: "1"},
		CreatedAt: time.Date(2026, 12, 2, 12, 39, 0, 0, zone),
		State: &incus.InstanceState{Network: map[string]incus.NetworkState{
			"lo":   {Addresses: []incus.NetworkAddress{{Family: "inet", Address: "127.0.0.1", Netmask: "8", Scope: "local"}}},
			"eth0": {Addresses: []incus.NetworkAddress{{Family: "inet", Address: "10.87.0.10", Netmask: "24", Scope: "global"}, {Family: "inet6", Address: "fe80::1", Netmask: "64", Scope: "link"}}},
		}},
	}
	s := summarize(in)
	if !slices.Equal(s.IPv4, []string{"10.87.0.10"}) {
		t.Errorf("ipv4 %q, want plain [10.87.0.10]", s.IPv4)
	}
	want := []Address{{"eth0", "inet", "10.87.0.10", "24", "global"}, {"eth0", "inet6", "fe80::1", "64", "link"}}
	if !slices.Equal(s.Addresses, want) {
		t.Errorf("addresses %+v, want %+v", s.Addresses, want)
	}
	b, _ := json.Marshal(s)
	if !strings.Contains(string(b), `"created":"2026-12-02T11:39:00Z"`) || !strings.Contains(string(b), `"ipv4":["10.87.0.10"]`) || !strings.Contains(string(b), `"interface":"eth0"`) {
		t.Errorf("json %s", b)
	}
	// info is flat: the summary's fields at the top, beside its own.
	ib, _ := json.Marshal(Info{Summary: s, CloneLine: "x"})
	var top map[string]any
	_ = json.Unmarshal(ib, &top)
	for _, k := range []string{"name", "ipv4", "addresses", "created", "clone_command"} {
		if _, ok := top[k]; !ok {
			t.Errorf("info json lacks top-level %q: %s", k, ib)
		}
	}
	if _, nested := top["Summary"]; nested {
		t.Errorf("info json nests the summary: %s", ib)
	}
}
