package firewall

import (
	"fmt"
	"maps"
	"math/rand/v2"
	"net"
	"net/netip"
	"slices"
	"strings"
	"testing"
)

// Applying alignRules' steps to got gives want, keeping every rule the two share in order
// (as many as their longest common subsequence), for edits anywhere and random lists.
func TestAlignRules(t *testing.T) {
	apply := func(want, got []string, steps []ruleStep) []string {
		var out []string
		for _, st := range steps {
			switch st.op {
			case '=':
				if want[st.i] != got[st.j] {
					t.Fatalf("keep %q as %q", got[st.j], want[st.i])
				}
				out = append(out, got[st.j])
			case '+':
				out = append(out, want[st.i])
			}
		}
		return out
	}
	cases := [][2][]string{
		{{"a", "b", "c"}, {"a", "b", "c"}},
		{{"a", "b", "x", "c"}, {"a", "b", "c"}},
		{{"a", "c"}, {"a", "b", "c"}},
		{{"x", "a"}, {"a"}},
		{{}, {"a", "b"}},
		{{"a", "b"}, {}},
		{{"a", "y", "c"}, {"a", "b", "c"}},
		{{"p", "a", "p", "a"}, {"a", "p", "a", "p"}},
	}
	rng := rand.New(rand.NewPCG(1, 2))
	for range 200 {
		var w, g []string
		for range rng.IntN(12) {
			w = append(w, string(rune('a'+rng.IntN(4))))
		}
		for range rng.IntN(12) {
			g = append(g, string(rune('a'+rng.IntN(4))))
		}
		cases = append(cases, [2][]string{w, g})
	}
	for _, c := range cases {
		want, got := c[0], c[1]
		steps, ok := alignRules(want, got)
		if !ok {
			t.Fatalf("%v from %v: not aligned", want, got)
		}
		if out := apply(want, got, steps); !slices.Equal(out, want) && !(len(out) == 0 && len(want) == 0) {
			t.Fatalf("%v from %v: steps give %v", want, got, out)
		}
		kept := 0
		for _, st := range steps {
			if st.op == '=' {
				kept++
			}
		}
		if lcs := lcsTable(want, got)[0][0]; kept != lcs {
			t.Errorf("%v from %v: keeps %d rules, the longest common subsequence is %d", want, got, kept, lcs)
		}
	}
	if _, ok := alignRules(make([]string, 3000), append(make([]string, 1), slices.Repeat([]string{"x"}, 3000)...)); ok {
		t.Error("a difference too large to align was aligned")
	}
}

// On the kernel: adding a port edits the chains in place (every rule of the ports already
// bound keeps its handle), removing one deletes only its rules, a converged spec writes
// nothing, and a foreign rule slipped into a chain is removed — the result always exactly
// Desired.
func TestApplyInPlace(t *testing.T) {
	ns := freshNS(t)
	port := func(i int) PortBinding {
		return PortBinding{Port: fmt.Sprintf("cbxinplace%03d", i), MAC: net.HardwareAddr{0x10, 0x66, 0x6a, 0, 1, byte(i)},
			IPv4: netip.AddrFrom4([4]byte{10, 77, 12, byte(20 + i)})}
	}
	s := testSpec("cbti")
	s.Ports = []PortBinding{port(1), port(2)}
	apply(t, s, true)
	requireClean(t, s)
	handles := func(prefix string) map[string]uint64 { // rule text → handle, for rules naming prefix
		obs, err := Read(s.Bridge)
		if err != nil {
			t.Fatal(err)
		}
		out := map[string]uint64{}
		for _, ts := range obs.Tables {
			for _, c := range ts.Chains {
				for k, r := range c.Rules {
					if strings.Contains(r, prefix) {
						out[c.Name+": "+r] = c.Handles[k]
					}
				}
			}
		}
		return out
	}
	before := handles(port(1).Port)
	if len(before) < 10 {
		t.Fatalf("%d rules name %s, want its bindings' (%v)", len(before), port(1).Port, before)
	}

	s.Ports = []PortBinding{port(1), port(3), port(2)}
	apply(t, s, true)
	requireClean(t, s)
	if after := handles(port(1).Port); !maps.Equal(before, after) {
		t.Errorf("adding a port rewrote the rules of another: %d of its %d rules have new handles", changedHandles(before, after), len(before))
	}
	if len(handles(port(3).Port)) == 0 {
		t.Error("the added port has no rules")
	}

	s.Ports = []PortBinding{port(1), port(3)}
	apply(t, s, true)
	requireClean(t, s)
	if n := len(handles(port(2).Port)); n != 0 {
		t.Errorf("a removed port keeps %d rules", n)
	}
	if after := handles(port(1).Port); !maps.Equal(before, after) {
		t.Errorf("removing a port rewrote the rules of another: %d of its %d rules have new handles", changedHandles(before, after), len(before))
	}
	all := handles("")
	apply(t, s, false)
	if again := handles(""); !maps.Equal(all, again) {
		t.Error("a converged apply rewrote rules")
	}

	bt, _ := TableNames(s.Bridge)
	nft(t, ns, "insert", "rule", "bridge", bt, PreroutingChain, "position", fmt.Sprint(before[firstKey(before, PreroutingChain)]), "counter", "accept")
	if d := check(t, s); len(d) != 1 {
		t.Fatalf("a foreign rule in prerouting: drift %v, want one item", d)
	}
	apply(t, s, true)
	requireClean(t, s)
}

func changedHandles(a, b map[string]uint64) (n int) {
	for k, v := range a {
		if b[k] != v {
			n++
		}
	}
	return n
}

// firstKey is some key of m whose rule is in chain.
func firstKey(m map[string]uint64, chain string) string {
	for k := range m {
		if strings.HasPrefix(k, chain+": ") {
			return k
		}
	}
	return ""
}

// BenchmarkApplyAddPort is a box start's nftables work with twelve boxes bound: the spec
// gains a port (and loses it again, alternately).
func BenchmarkApplyAddPort(b *testing.B) {
	freshNS(b)
	s := testSpec("cbta")
	for i := range 12 {
		s.Ports = append(s.Ports, PortBinding{Port: fmt.Sprintf("cbxbench%04d", i),
			MAC: net.HardwareAddr{0x10, 0x66, 0x6a, 0, 0, byte(i)}, IPv4: netip.AddrFrom4([4]byte{10, 77, 12, byte(10 + i)})})
	}
	twelve := s
	thirteen := s
	thirteen.Ports = append(slices.Clone(s.Ports), PortBinding{Port: "cbxbench0099", MAC: net.HardwareAddr{0x10, 0x66, 0x6a, 0, 0, 99},
		IPv4: netip.AddrFrom4([4]byte{10, 77, 12, 99})})
	if _, err := Apply(twelve); err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		next := thirteen
		if i%2 == 1 {
			next = twelve
		}
		if changed, err := Apply(next); err != nil || !changed {
			b.Fatalf("Apply = %v, %v", changed, err)
		}
	}
}

// ApplyUnchecked (the bind before a box starts) leaves the kernel as Apply does: a port
// added and one removed, each exactly Desired by Check, and a converged spec changes nothing.
func TestApplyUnchecked(t *testing.T) {
	freshNS(t)
	port := func(i int) PortBinding {
		return PortBinding{Port: fmt.Sprintf("cbxunchk%03d", i), MAC: net.HardwareAddr{0x10, 0x66, 0x6a, 0, 2, byte(i)},
			IPv4: netip.AddrFrom4([4]byte{10, 77, 12, byte(40 + i)})}
	}
	s := testSpec("cbtu")
	s.Ports = []PortBinding{port(1)}
	apply(t, s, true)
	for _, ports := range [][]PortBinding{{port(1), port(2)}, {port(2)}} {
		s.Ports = ports
		if changed, err := ApplyUnchecked(s); err != nil || !changed {
			t.Fatalf("ApplyUnchecked(%v) = %v, %v, want a change", ports, changed, err)
		}
		requireClean(t, s)
	}
	if changed, err := ApplyUnchecked(s); err != nil || changed {
		t.Errorf("ApplyUnchecked of a converged spec = %v, %v, want no change", changed, err)
	}
}
