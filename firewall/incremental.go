package firewall

import "github.com/google/nftables"

// Incremental apply: a box start adds one port's rules to chains that hold every bound
// port's (about 30 rules a port), and rewriting them all cost a start 92 ms of nftables
// work with twelve boxes running, growing with every box (each rule added is echoed back by
// the kernel). A chain whose rules differ from the desired ones only by some rules is
// edited in place instead: the rules that are not wanted are deleted by handle, the missing
// ones inserted where they belong, in the same single batch as before (atomic: no packet
// sees a half-edited chain), and a chain already right is not touched. Anything else (a
// missing chain, a foreign structure, a failed batch) takes the full rewrite.

// ruleStep is one step of turning a chain's rules (got) into the desired ones (want).
type ruleStep struct {
	op   byte // '=' keep got[j] as want[i], '-' delete got[j], '+' insert want[i]
	i, j int
}

// maxAlignCells bounds the alignment's table (the middle that differs, after the common
// head and tail are taken off): beyond it the chain is rewritten whole.
const maxAlignCells = 1 << 22

// alignRules lists the steps from got to want in order: the common head and tail are
// kept, and the rest is aligned on its longest common subsequence. ok is false when that
// rest is too large to align (rewrite the chain instead).
func alignRules(want, got []string) (steps []ruleStep, ok bool) {
	head := 0
	for head < len(want) && head < len(got) && want[head] == got[head] {
		steps = append(steps, ruleStep{'=', head, head})
		head++
	}
	tail := 0
	for tail < len(want)-head && tail < len(got)-head && want[len(want)-1-tail] == got[len(got)-1-tail] {
		tail++
	}
	w, g := want[head:len(want)-tail], got[head:len(got)-tail]
	if (len(w)+1)*(len(g)+1) > maxAlignCells {
		return nil, false
	}
	lcs := lcsTable(w, g)
	i, j := 0, 0
	for i < len(w) || j < len(g) {
		switch {
		case i < len(w) && j < len(g) && w[i] == g[j]:
			steps = append(steps, ruleStep{'=', head + i, head + j})
			i, j = i+1, j+1
		case j < len(g) && (i == len(w) || lcs[i][j+1] >= lcs[i+1][j]):
			steps = append(steps, ruleStep{'-', 0, head + j})
			j++
		default:
			steps = append(steps, ruleStep{'+', head + i, 0})
			i++
		}
	}
	for k := 0; k < tail; k++ {
		steps = append(steps, ruleStep{'=', len(want) - tail + k, len(got) - tail + k})
	}
	return steps, true
}

// lcsTable is the longest-common-subsequence table of want and got: [i][j] is the LCS
// length of want[i:] and got[j:].
func lcsTable(want, got []string) [][]int {
	n, m := len(want), len(got)
	lcs := make([][]int, n+1)
	for i := range lcs {
		lcs[i] = make([]int, m+1)
	}
	for i := n - 1; i >= 0; i-- {
		for j := m - 1; j >= 0; j-- {
			if want[i] == got[j] {
				lcs[i][j] = lcs[i+1][j+1] + 1
			} else {
				lcs[i][j] = max(lcs[i+1][j], lcs[i][j+1])
			}
		}
	}
	return lcs
}

// editChain queues the steps that turn the chain's kernel rules (got, with their handles)
// into want, in place; it reports whether it could (false: rewrite the chain). Inserts are
// anchored on the last rule kept before them (the chain's start when none): a run of
// inserts on one anchor is queued last first, since each lands right after the anchor.
func editChain(cc *nftables.Conn, t *nftables.Table, ch *nftables.Chain, want []Rule, got ChainState) bool {
	if len(got.Handles) != len(got.Rules) {
		return false
	}
	summaries := make([]string, len(want))
	for i, r := range want {
		summaries[i] = r.Summary
	}
	steps, ok := alignRules(summaries, got.Rules)
	if !ok {
		return false
	}
	for _, st := range steps {
		if st.op == '-' && got.Handles[st.j] == 0 {
			return false
		}
	}
	var (
		anchor uint64
		run    []int // want indexes waiting to go in after anchor
	)
	flush := func() {
		for k := len(run) - 1; k >= 0; k-- {
			r := &nftables.Rule{Table: t, Chain: ch, Exprs: want[run[k]].exprs, Position: anchor}
			if anchor == 0 {
				cc.InsertRule(r) // at the chain's start
			} else {
				cc.AddRule(r) // right after the anchor
			}
		}
		run = run[:0]
	}
	for _, st := range steps {
		switch st.op {
		case '=':
			flush()
			anchor = got.Handles[st.j]
		case '-':
			_ = cc.DelRule(&nftables.Rule{Table: t, Chain: ch, Handle: got.Handles[st.j]})
		case '+':
			run = append(run, st.i)
		}
	}
	flush()
	return true
}
