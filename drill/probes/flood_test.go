package probes

import (
	"bytes"
	"context"
	"os/exec"
	"testing"
	"time"
)

func flood(d time.Duration, udp, tcp []string) Spec {
	return Spec{Kind: KindFlood, Flood: &FloodSpec{Duration: Dur(d), UDP: udp, TCP: tcp}, Timeout: d + 400*time.Millisecond}
}

// TestFloodOutcomes: the flood's open, refused, dropped and check-failed
// cases against the peer's listeners and its nft drops.
func TestFloodOutcomes(t *testing.T) {
	specs := []Spec{
		flood(300*time.Millisecond, []string{"198.18.0.2:7002", "198.18.0.5:7002"}, []string{"198.18.0.2:7001"}),
		flood(300*time.Millisecond, []string{"198.18.0.2:7009", "198.18.0.3:7002"}, []string{"198.18.0.3:7001"}),
		flood(300*time.Millisecond, nil, []string{"198.18.0.2:7003"}),
		{Kind: KindFlood, Flood: &FloodSpec{Duration: Dur(100 * time.Millisecond), UDP: []string{"198.18.0.2:7002"}}, Iface: "nosuch0"},
	}
	rs := RunMany(context.Background(), specs)
	want := []Outcome{Open, Dropped, Refused, CheckFailed}
	for i, r := range rs {
		if r.Outcome != want[i] {
			t.Errorf("flood %d: %s, want %s (%s)", i, r.Outcome, want[i], r.Evidence)
		}
	}
	open, blocked := rs[0].Counts, rs[1].Counts
	if open.Sent < 100 || open.UDPEchoes < open.Sent/2 || open.TCPConnected == 0 || len(open.Through) != 3 {
		t.Errorf("open flood counts: %+v", open)
	}
	if blocked.Sent < 100 || blocked.UDPEchoes != 0 || blocked.TCPConnected != 0 || blocked.TCPAttempts < 5 {
		t.Errorf("blocked flood counts: %+v", blocked)
	}
}

// TestFloodSeesAWindow stands in for an Incus re-apply: a drop rule vanishes
// for ~150 ms in the middle of the flood, and the flood counts what got
// through in that window and nothing outside it.
func TestFloodSeesAWindow(t *testing.T) {
	var extra *Listeners
	err := inNS(topo.peer, func() error {
		var err error
		extra, err = Serve(context.Background(), ListenerConfig{UDP: []int{7010}, TCP: []int{7010}})
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	defer extra.Close()
	nft := func(rules string) {
		t.Helper()
		err := inNS(topo.peer, func() error {
			c := exec.Command("nft", "-f", "-")
			c.Stdin = bytes.NewBufferString(rules)
			out, err := c.CombinedOutput()
			if err != nil {
				t.Errorf("nft: %v: %s", err, out)
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	const table = `table inet cbwin {
	chain input {
		type filter hook input priority 0; policy accept;
		udp dport 7010 drop
		tcp dport 7010 drop
	}
}
`
	nft(table)
	defer nft("delete table inet cbwin\n")

	closed := RunMany(context.Background(), []Spec{flood(200*time.Millisecond, []string{"198.18.0.2:7010"}, []string{"198.18.0.2:7010"})})[0]
	if closed.Outcome != Dropped {
		t.Fatalf("flood with the rule in place: %s (%s)", closed.Outcome, closed.Evidence)
	}
	done := make(chan Result)
	go func() {
		done <- RunMany(context.Background(), []Spec{flood(700*time.Millisecond, []string{"198.18.0.2:7010"}, []string{"198.18.0.2:7010"})})[0]
	}()
	time.Sleep(250 * time.Millisecond)
	nft("delete table inet cbwin\n")
	time.Sleep(150 * time.Millisecond)
	nft(table)
	r := <-done
	c := r.Counts
	if r.Outcome != Open || c.UDPEchoes == 0 || c.TCPConnected == 0 {
		t.Fatalf("flood across a 150 ms window: %s (%s) %+v", r.Outcome, r.Evidence, c)
	}
	if c.UDPEchoes > c.Sent/2 {
		t.Errorf("echoes %d of %d sent: more than the window explains", c.UDPEchoes, c.Sent)
	}
	t.Logf("window: %s", r.Evidence)
}
