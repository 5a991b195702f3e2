package probes

import (
	"encoding/json"
	"net"
	"strings"
	"testing"
	"time"
)

// TestActiveKindsThroughProbeRun: the engine ships the new kinds like any
// other probe, as JSON through `probe run`; sub-structs and their durations
// survive the trip and the results carry typed counts.
func TestActiveKindsThroughProbeRun(t *testing.T) {
	in := `[{"id":"f","kind":"flood","flood":{"duration":"200ms","udp":["198.18.0.2:7002"],"tcp":["198.18.0.3:7001"],"udp_every":"2ms"}},
	        {"id":"x","kind":"frame","iface":"vc0","timeout":"300ms","payload":"t1","frame":{"variant":"arp-zero","target_ip":"198.18.0.2"}}]`
	code, out, errs := runMain(t, in, "run")
	if code != ExitOK {
		t.Fatalf("exit %d: %s", code, errs)
	}
	var rs []Result
	if err := json.Unmarshal([]byte(out), &rs); err != nil || len(rs) != 2 {
		t.Fatalf("%v %s", err, out)
	}
	f, x := rs[0], rs[1]
	if f.Outcome != Open || f.Counts == nil || f.Counts.UDPEchoes == 0 || f.Counts.TCPConnected != 0 || f.Probe.Flood.UDPEvery.D() != 2*time.Millisecond {
		t.Errorf("flood: %s %+v %+v", f.Outcome, f.Counts, f.Probe.Flood)
	}
	if f.Probe.Timeout != 1200*time.Millisecond {
		t.Errorf("flood's default timeout %v, want duration + 1s", f.Probe.Timeout)
	}
	// The peer answers an ARP probe for its address from 0.0.0.0 (DAD).
	if x.Outcome != Open || x.Counts.Marker != MarkerPrefix+"t1" {
		t.Errorf("frame: %s (%s) %+v", x.Outcome, x.Evidence, x.Counts)
	}
	if !strings.Contains(out, `"duration": "200ms"`) {
		t.Errorf("durations are not written as strings: %s", out)
	}
}

func TestActiveSpecValidation(t *testing.T) {
	ok := []Spec{
		{Kind: KindFlood, Flood: &FloodSpec{Duration: Dur(time.Second), UDP: []string{"192.0.2.1:9"}}},
		{Kind: KindSpoofUDP, Target: "192.0.2.1", Port: 9, Spoof: &SpoofSpec{SrcIP: "192.0.2.7"}},
		{Kind: KindARPSpoof, Spoof: &SpoofSpec{VictimIP: "192.0.2.7"}},
		{Kind: KindMACSpoof, Spoof: &SpoofSpec{VictimMAC: "02:00:00:00:00:07"}},
		{Kind: KindDHCPRelease, DHCP: &DHCPSpec{VictimIP: "192.0.2.7", VictimMAC: "02:00:00:00:00:07"}},
		{Kind: KindDHCPSteal, DHCP: &DHCPSpec{VictimIP: "192.0.2.7"}},
		{Kind: KindDHCPFakeMAC, DHCP: &DHCPSpec{}},
		{Kind: KindFrame, Frame: &FrameSpec{Variant: FrameVLAN0RA}},
		{Kind: KindDNS, DNS: &DNSQuery{Name: "servers.bind", Type: "TXT", Class: "CH"}},
	}
	for _, s := range ok {
		if err := s.Validate(); err != nil {
			t.Errorf("%s: %v", s.Kind, err)
		}
	}
	bad := map[string]Spec{
		"flood without sub-struct":      {Kind: KindFlood},
		"flood without targets":         {Kind: KindFlood, Flood: &FloodSpec{Duration: Dur(time.Second)}},
		"flood target without port":     {Kind: KindFlood, Flood: &FloodSpec{Duration: Dur(time.Second), TCP: []string{"192.0.2.1"}}},
		"flood timeout within duration": {Kind: KindFlood, Timeout: time.Second, Flood: &FloodSpec{Duration: Dur(time.Second), UDP: []string{"192.0.2.1:9"}}},
		"spoof-udp without source":      {Kind: KindSpoofUDP, Target: "192.0.2.1", Port: 9, Spoof: &SpoofSpec{}},
		"spoof-udp IPv6 source":         {Kind: KindSpoofUDP, Target: "192.0.2.1", Port: 9, Spoof: &SpoofSpec{SrcIP: "fe80::1"}},
		"arp-spoof without victim":      {Kind: KindARPSpoof, Spoof: &SpoofSpec{}},
		"mac-spoof bad MAC":             {Kind: KindMACSpoof, Spoof: &SpoofSpec{VictimMAC: "nope"}},
		"release without MAC":           {Kind: KindDHCPRelease, DHCP: &DHCPSpec{VictimIP: "192.0.2.7"}},
		"steal without IP":              {Kind: KindDHCPSteal, DHCP: &DHCPSpec{}},
		"frame unknown variant":         {Kind: KindFrame, Frame: &FrameSpec{Variant: "vlan7"}},
		"arp-zero without target":       {Kind: KindFrame, Frame: &FrameSpec{Variant: FrameARPZero}},
		"CH class with type A":          {Kind: KindDNS, DNS: &DNSQuery{Name: "version.bind", Class: "CH"}},
	}
	for name, s := range bad {
		if err := s.Validate(); err == nil {
			t.Errorf("%s: accepted", name)
		}
		if r := Run(t.Context(), s); r.Outcome != CheckFailed {
			t.Errorf("%s: ran as %s", name, r.Outcome)
		}
	}
}

func TestFramesParseBack(t *testing.T) {
	b := frameBuilder{me: mustMAC("02:00:00:00:00:01"), ll: eui64LinkLocal(mustMAC("02:00:00:00:00:01")), marker: []byte(MarkerPrefix + "x"), f: &FrameSpec{}}
	for _, v := range FrameVariants {
		b.f = &FrameSpec{Variant: v, TargetIP: "192.0.2.9"}
		fr, _, err := b.build()
		if err != nil {
			t.Fatalf("%s: %v", v, err)
		}
		fi := parseFrame(fr)
		if findMarker(fr) != MarkerPrefix+"x" {
			t.Errorf("%s: marker not found in the frame", v)
		}
		if strings.HasPrefix(v, "vlan0") != fi.Tagged {
			t.Errorf("%s: tagged=%v", v, fi.Tagged)
		}
		if v == FrameVLAN0RA && (fi.Proto != 58 || checksum(pseudoHeader(fi.IPSrc, fi.IPDst, 58, len(fi.L4)), fi.L4) != 0) {
			t.Errorf("RA: proto %d, checksum does not verify", fi.Proto)
		}
	}
}

func mustMAC(s string) net.HardwareAddr {
	m, err := net.ParseMAC(s)
	if err != nil {
		panic(err)
	}
	return m
}
