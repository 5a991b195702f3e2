package firewall

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"sort"
	"strings"
	"sync"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

// All kernel access happens in the network namespace of the calling OS
// thread (sockets are opened per call), so a caller that has locked its
// goroutine to a thread inside another namespace acts on that namespace.

// Observed is what the kernel holds for one bridge's tables.
type Observed struct {
	Bridge string
	Tables []TableState // bridge table, guard table, wall table; Present says if it exists
}

// TableState is one of our tables as read back.
type TableState struct {
	Name    string
	Family  string
	Present bool
	Flags   uint32       // table flags; 1 = dormant (all its chains off)
	Chains  []ChainState // by name
	Sets    []string     // set names; we own none, so any is foreign
}

// ChainState is a chain as read back. Regular (non-base) chains have empty
// Type/Hook/Policy and Base false.
type ChainState struct {
	Chain
	Base    bool
	Rules   []string // each rule rendered like Rule.Summary
	Handles []uint64 // the kernel's handle of each rule in Rules
}

// Drift is one difference between desired and observed.
type Drift struct {
	What     string // e.g. "table bridge claudebox_claudenet", "rule inet claudebox_claudenet_guard input #3"
	Expected string
	Actual   string
}

func (d Drift) String() string {
	return fmt.Sprintf("%s: expected %s, actual %s", d.What, d.Expected, d.Actual)
}

const absent = "absent"

var hookNames = map[nftables.ChainHook]string{
	0: "prerouting", 1: "input", 2: "forward", 3: "output", 4: "postrouting", 5: "ingress",
}

func hookName(h *nftables.ChainHook) string {
	if h == nil {
		return ""
	}
	if n, ok := hookNames[*h]; ok {
		return n
	}
	return fmt.Sprintf("hook#%d", *h)
}

func policyName(p *nftables.ChainPolicy) string {
	switch {
	case p == nil:
		return ""
	case *p == nftables.ChainPolicyAccept:
		return "accept"
	case *p == nftables.ChainPolicyDrop:
		return "drop"
	}
	return fmt.Sprintf("policy#%d", *p)
}

// ourTables lists our tables as (family, name), bridge table first.
func ourTables(bridge string) []Chain {
	bt, gt := TableNames(bridge)
	return []Chain{{Table: bt, Family: FamilyBridge}, {Table: gt, Family: FamilyInet}, {Table: WallTableName(bridge), Family: FamilyInet}}
}

// chainsOf returns the desired chains of one table.
func chainsOf(s Spec, table string) []Chain {
	var out []Chain
	for _, c := range DesiredChains(s) {
		if c.Table == table {
			out = append(out, c)
		}
	}
	return out
}

var bridgeMeta struct {
	once sync.Once
	ok   bool
}

// BridgeMetaSupported reports whether the kernel accepts `meta ibrname`
// (nft_meta_bridge). It asks once per process with a batch that adds a
// scratch table holding such a rule and deletes it again: the kernel
// validates the rule either way, and nothing outlives the batch.
func BridgeMetaSupported() bool {
	bridgeMeta.once.Do(func() {
		cc, err := nftables.New()
		if err != nil {
			return
		}
		t := &nftables.Table{Name: fmt.Sprintf("claudebox_probe_%d", os.Getpid()), Family: nftables.TableFamilyBridge}
		cc.AddTable(t)
		hook := nftables.ChainHook(hookNum("forward"))
		ch := cc.AddChain(&nftables.Chain{Name: "p", Table: t, Type: nftables.ChainTypeFilter,
			Hooknum: &hook, Priority: nftables.ChainPriorityRef(BridgeFwdPrio)})
		cc.AddRule(&nftables.Rule{Table: t, Chain: ch, Exprs: ifname(expr.MetaKeyBRIIIFNAME, "probe")})
		cc.DelTable(t)
		bridgeMeta.ok = cc.Flush() == nil
	})
	return bridgeMeta.ok
}

// Read reads back the three tables for bridge over netlink.
func Read(bridge string) (Observed, error) {
	if err := validateBridge(bridge); err != nil {
		return Observed{}, err
	}
	var (
		obs Observed
		err error
	)
	// A dump that races a concurrent ruleset change can fail; the second try
	// sees a settled generation.
	for attempt := 0; attempt < 3; attempt++ {
		obs, err = read(bridge)
		if err == nil {
			return obs, nil
		}
	}
	return obs, err
}

func read(bridge string) (Observed, error) {
	cc, err := nftables.New()
	if err != nil {
		return Observed{}, err
	}
	nl, err := netlink.Dial(unix.NETLINK_NETFILTER, nil)
	if err != nil {
		return Observed{}, fmt.Errorf("firewall: netlink: %w", err)
	}
	defer nl.Close()

	obs := Observed{Bridge: bridge}
	for _, spec := range ourTables(bridge) {
		fam := familyByte(spec.Family)
		ts := TableState{Name: spec.Table, Family: spec.Family}
		flags, present, err := tableFlagsOf(nl, fam, spec.Table)
		if err != nil {
			return obs, err
		}
		if !present {
			obs.Tables = append(obs.Tables, ts)
			continue
		}
		ts.Present, ts.Flags = true, flags
		t := &nftables.Table{Name: spec.Table, Family: fam}

		chains, err := cc.ListChainsOfTableFamily(fam)
		if err != nil {
			return obs, fmt.Errorf("firewall: list %s chains: %w", spec.Family, err)
		}
		for _, c := range chains {
			if c.Table == nil || c.Table.Name != spec.Table {
				continue
			}
			cs := ChainState{Chain: Chain{Table: spec.Table, Family: spec.Family, Name: c.Name}}
			if c.Hooknum != nil {
				cs.Base = true
				cs.Type, cs.Hook, cs.Policy = string(c.Type), hookName(c.Hooknum), policyName(c.Policy)
				if c.Priority != nil {
					cs.Priority = int32(*c.Priority)
				}
			}
			if cs.Rules, cs.Handles, err = dumpRules(nl, fam, spec.Table, c.Name); err != nil {
				return obs, err
			}
			ts.Chains = append(ts.Chains, cs)
		}
		sort.Slice(ts.Chains, func(i, j int) bool { return ts.Chains[i].Name < ts.Chains[j].Name })

		sets, err := cc.GetSets(t)
		if err != nil {
			return obs, fmt.Errorf("firewall: list sets of %s: %w", spec.Table, err)
		}
		for _, s := range sets {
			ts.Sets = append(ts.Sets, s.Name)
		}
		sort.Strings(ts.Sets)
		obs.Tables = append(obs.Tables, ts)
	}
	return obs, nil
}

// tableFlagsOf finds a table by dumping the family's tables. (The library's
// table listing decodes NFTA_TABLE_FLAGS in host byte order, so a dormant
// table would read as flags 0x1000000 on x86.)
func tableFlagsOf(nl *netlink.Conn, fam nftables.TableFamily, name string) (flags uint32, present bool, err error) {
	msgs, err := nl.Execute(netlink.Message{
		Header: netlink.Header{
			Type:  netlink.HeaderType(unix.NFNL_SUBSYS_NFTABLES<<8 | unix.NFT_MSG_GETTABLE),
			Flags: netlink.Request | netlink.Dump,
		},
		Data: []byte{byte(fam), unix.NFNETLINK_V0, 0, 0},
	})
	if err != nil {
		return 0, false, fmt.Errorf("firewall: list tables: %w", err)
	}
	newTable := netlink.HeaderType(unix.NFNL_SUBSYS_NFTABLES<<8 | unix.NFT_MSG_NEWTABLE)
	for _, m := range msgs {
		if m.Header.Type != newTable || len(m.Data) < 4 || nftables.TableFamily(m.Data[0]) != fam {
			continue
		}
		ad, err := netlink.NewAttributeDecoder(m.Data[4:])
		if err != nil {
			return 0, false, err
		}
		ad.ByteOrder = binary.BigEndian
		var n string
		var f uint32
		for ad.Next() {
			switch ad.Type() {
			case unix.NFTA_TABLE_NAME:
				n = ad.String()
			case unix.NFTA_TABLE_FLAGS:
				f = ad.Uint32()
			}
		}
		if err := ad.Err(); err != nil {
			return 0, false, err
		}
		if n == name {
			return f, true, nil
		}
	}
	return 0, false, nil
}

// dumpRules fetches one chain's rules, in order, rendered, and their handles.
func dumpRules(nl *netlink.Conn, fam nftables.TableFamily, table, chain string) ([]string, []uint64, error) {
	attrs, err := netlink.MarshalAttributes([]netlink.Attribute{
		{Type: unix.NFTA_RULE_TABLE, Data: []byte(table + "\x00")},
		{Type: unix.NFTA_RULE_CHAIN, Data: []byte(chain + "\x00")},
	})
	if err != nil {
		return nil, nil, err
	}
	newRule := netlink.HeaderType(unix.NFNL_SUBSYS_NFTABLES<<8 | unix.NFT_MSG_NEWRULE)
	msgs, err := nl.Execute(netlink.Message{
		Header: netlink.Header{
			Type:  netlink.HeaderType(unix.NFNL_SUBSYS_NFTABLES<<8 | unix.NFT_MSG_GETRULE),
			Flags: netlink.Request | netlink.Dump,
		},
		// nfgenmsg: family, version, resource id (big endian)
		Data: append([]byte{byte(fam), unix.NFNETLINK_V0, 0, 0}, attrs...),
	})
	if err != nil {
		return nil, nil, fmt.Errorf("firewall: dump rules of %s %s: %w", table, chain, err)
	}
	var (
		rules   []string
		handles []uint64
	)
	for _, m := range msgs {
		if m.Header.Type != newRule || len(m.Data) < 4 {
			continue
		}
		ad, err := netlink.NewAttributeDecoder(m.Data[4:])
		if err != nil {
			return nil, nil, err
		}
		ad.ByteOrder = binary.BigEndian // the handle; the expressions are decoded raw
		var (
			raws     []rawExpr
			userdata []byte
			tbl, ch  string
			handle   uint64
		)
		for ad.Next() {
			switch ad.Type() {
			case unix.NFTA_RULE_TABLE:
				tbl = ad.String()
			case unix.NFTA_RULE_CHAIN:
				ch = ad.String()
			case unix.NFTA_RULE_EXPRESSIONS:
				if raws, err = rawFromList(ad.Bytes()); err != nil {
					return nil, nil, err
				}
			case unix.NFTA_RULE_HANDLE:
				handle = ad.Uint64()
			case unix.NFTA_RULE_USERDATA:
				userdata = ad.Bytes()
			}
		}
		if err := ad.Err(); err != nil {
			return nil, nil, err
		}
		if tbl != table || ch != chain {
			continue // kernels that ignore the dump filter
		}
		rules = append(rules, renderRaw(raws, userdata))
		handles = append(handles, handle)
	}
	return rules, handles, nil
}

// Check compares the kernel with Desired(s). Empty means converged.
func Check(s Spec) ([]Drift, error) {
	if err := s.Validate(); err != nil {
		return nil, err
	}
	obs, err := Read(s.Bridge)
	if err != nil {
		return nil, err
	}
	s = s.Resolved()
	return diff(s, Desired(s), obs), nil
}

func tableWhat(t TableState) string { return fmt.Sprintf("table %s %s", t.Family, t.Name) }

// diff lists drift table by table of a resolved spec s, whose rules are desired. A
// missing table is one drift, not one per rule it would have held.
func diff(s Spec, desired []Rule, obs Observed) []Drift {
	var out []Drift
	for _, ts := range obs.Tables {
		if !ts.Present {
			out = append(out, Drift{What: tableWhat(ts), Expected: "present", Actual: absent})
			continue
		}
		if ts.Flags != 0 {
			out = append(out, Drift{What: tableWhat(ts) + " flags", Expected: "none", Actual: tableFlags(ts.Flags)})
		}
		for _, set := range ts.Sets {
			out = append(out, Drift{What: fmt.Sprintf("set %s %s %s", ts.Family, ts.Name, set), Expected: absent, Actual: "present"})
		}
		wants := chainsOf(s, ts.Name)
		for _, c := range ts.Chains {
			if !hasChain(wants, c.Name) {
				out = append(out, Drift{What: chainWhat(c.Chain), Expected: absent, Actual: chainHeader(c)})
			}
		}
		for _, want := range wants {
			got := findChain(ts.Chains, want.Name)
			if got == nil {
				out = append(out, Drift{What: chainWhat(want), Expected: want.Header(), Actual: absent})
				continue
			}
			if h := chainHeader(*got); h != want.Header() {
				out = append(out, Drift{What: chainWhat(want), Expected: want.Header(), Actual: h})
			}
			var wantRules []string
			for _, r := range desired {
				if r.Table == want.Table && r.Chain == want.Name {
					wantRules = append(wantRules, r.Summary)
				}
			}
			out = append(out, diffRules(chainWhat(want), wantRules, got.Rules)...)
		}
	}
	return out
}

func hasChain(cs []Chain, name string) bool {
	for _, c := range cs {
		if c.Name == name {
			return true
		}
	}
	return false
}

func findChain(cs []ChainState, name string) *ChainState {
	for i := range cs {
		if cs[i].Name == name {
			return &cs[i]
		}
	}
	return nil
}

func chainWhat(c Chain) string { return fmt.Sprintf("chain %s %s %s", c.Family, c.Table, c.Name) }

func chainHeader(c ChainState) string {
	if !c.Base {
		return "regular chain"
	}
	return c.Header()
}

func tableFlags(f uint32) string {
	var out []string
	if f&unix.NFT_TABLE_F_DORMANT != 0 {
		out = append(out, "dormant")
		f &^= unix.NFT_TABLE_F_DORMANT
	}
	if f != 0 {
		out = append(out, fmt.Sprintf("0x%x", f))
	}
	return strings.Join(out, ",")
}

// diffRules reports rules missing from or foreign to a chain, aligning the two
// lists on their longest common subsequence so one inserted rule is one
// drift, not a shifted tail. Positions are 1-based in the list they refer to.
func diffRules(chain string, want, got []string) []Drift {
	n, m := len(want), len(got)
	lcs := lcsTable(want, got)
	rule := "rule" + strings.TrimPrefix(chain, "chain")
	var out []Drift
	i, j := 0, 0
	for i < n || j < m {
		switch {
		case i < n && j < m && want[i] == got[j]:
			i, j = i+1, j+1
		case j < m && (i == n || lcs[i][j+1] >= lcs[i+1][j]):
			out = append(out, Drift{What: fmt.Sprintf("%s #%d", rule, j+1), Expected: absent, Actual: got[j]})
			j++
		default:
			out = append(out, Drift{What: fmt.Sprintf("%s #%d", rule, i+1), Expected: want[i], Actual: absent})
			i++
		}
	}
	return out
}

// Apply converges the kernel to Desired(s) in one atomic netlink batch: it
// creates what is missing, clears a dormant flag, and makes every chain of ours
// hold exactly the desired rules — edited in place where it differs by some
// rules (incremental.go), rewritten whole otherwise; a kernel that already
// renders exactly as desired (the renderer decodes every attribute: equal text
// is equal rules) is left alone. A table whose structure is foreign (extra
// chains or sets, or our chain with another type/hook/priority, which the
// kernel cannot change in place) is deleted and recreated in the same batch.
// changed reports whether the kernel differed from desired before the run.
func Apply(s Spec) (changed bool, err error) { return converge(s, true) }

// ApplyUnchecked is Apply without the read-back after the batch: for the bind before a box
// starts, which adds ports to a spec a checked Apply put in (with dozens of ports the read-
// back is a third of an apply, on the CPU the start needs). The batch is still atomic and
// still fails as a whole; a renderer or kernel mismatch surfaces at the next Apply or Check.
func ApplyUnchecked(s Spec) (changed bool, err error) { return converge(s, false) }

func converge(s Spec, readBack bool) (changed bool, err error) {
	if err := s.Validate(); err != nil {
		return false, err
	}
	obs, err := Read(s.Bridge)
	if err != nil {
		return false, err
	}
	// Rendered once: rendering every rule to its text is a third of an apply's time with a
	// dozen boxes bound, and it was done three times. (Not beside the read in a goroutine:
	// Resolved and Desired read the calling thread's network namespace.)
	s = s.Resolved()
	desired := Desired(s)
	changed = len(diff(s, desired, obs)) > 0
	if !changed {
		return false, nil // nothing to write; the read just now is the check
	}
	if err := applyRules(s, obs, desired, true); err != nil {
		// The in-place edit failed as a whole (one batch: nothing of it applied), e.g. a rule
		// it deletes went meanwhile: rewrite every chain from a fresh read.
		if obs, err = Read(s.Bridge); err != nil {
			return changed, err
		}
		if err := applyRules(s, obs, desired, false); err != nil {
			return changed, err
		}
	}
	if !readBack {
		return changed, nil
	}
	// Read back: a renderer or kernel mismatch must surface here, not as a
	// Check that never comes clean.
	after, err := Read(s.Bridge)
	if err != nil {
		return changed, err
	}
	if drift := diff(s, desired, after); len(drift) > 0 {
		return changed, fmt.Errorf("firewall: apply %s: still drifted after apply: %v", s.Bridge, drift)
	}
	return changed, nil
}

// batchBuffer is the send and receive buffer of the socket a batch is applied through. The
// batch goes out as one datagram, which must fit the send buffer (else EMSGSIZE), and the
// kernel handles all of it inside that send, queueing its replies before Flush reads one: an
// echo of every rule (the library asks for NLM_F_ECHO, for the handle), each an skb of a few
// KiB, then the acks. The defaults (net.core.[rw]mem_default, 208 KiB) overflow at 8 bound
// ports (158 rules: ENOBUFS) and 64 (the send); a /24 full of boxes (253 ports) is 3,833 rules.
// The buffers are limits, not allocations.
const batchBuffer = 64 << 20

// bigBuffers raises the socket's buffers to batchBuffer, past net.core.[rw]mem_max
// (SO_SNDBUFFORCE, SO_RCVBUFFORCE: we hold CAP_NET_ADMIN, as writing nftables needs).
func bigBuffers(c *netlink.Conn) error {
	rc, err := c.SyscallConn()
	if err != nil {
		return err
	}
	var serr error
	if err := rc.Control(func(fd uintptr) {
		serr = errors.Join(unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_SNDBUFFORCE, batchBuffer),
			unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVBUFFORCE, batchBuffer))
	}); err != nil {
		return err
	}
	if serr != nil {
		return fmt.Errorf("firewall: netlink socket buffers: %w", serr)
	}
	return nil
}

// applyRules writes rules into our tables in one batch: missing tables and
// chains are created, a table of foreign structure is rebuilt, and every chain
// of ours is flushed and refilled — or, with inPlace, edited in place where its
// table stays (editChain). Tests pass a subset of Desired to take single rules
// out.
func applyRules(s Spec, obs Observed, rules []Rule, inPlace bool) error {
	cc, err := nftables.New(nftables.WithSockOptions(bigBuffers))
	if err != nil {
		return err
	}
	for _, ts := range obs.Tables {
		t := &nftables.Table{Name: ts.Name, Family: familyByte(ts.Family)}
		wants := chainsOf(s, ts.Name)
		rebuild := needsRebuild(ts, wants)
		if rebuild {
			cc.DelTable(t)
		}
		cc.AddTable(t) // exists: updates flags to 0, waking a dormant table
		// Its chains and rule handles as read are still there to edit.
		editable := inPlace && ts.Present && !rebuild
		for _, want := range wants {
			policy := nftables.ChainPolicyAccept
			hook := nftables.ChainHook(hookNum(want.Hook))
			ch := cc.AddChain(&nftables.Chain{
				Name: want.Name, Table: t, Type: nftables.ChainType(want.Type),
				Hooknum: &hook, Priority: nftables.ChainPriorityRef(nftables.ChainPriority(want.Priority)), Policy: &policy,
			})
			var chainRules []Rule
			for _, r := range rules {
				if r.Table == want.Table && r.Chain == want.Name {
					chainRules = append(chainRules, r)
				}
			}
			if got := findChain(ts.Chains, want.Name); editable && got != nil &&
				chainHeader(*got) == want.Header() && editChain(cc, t, ch, chainRules, *got) {
				continue
			}
			cc.FlushChain(ch)
			for _, r := range chainRules {
				cc.AddRule(&nftables.Rule{Table: t, Chain: ch, Exprs: r.exprs})
			}
		}
	}
	if err := cc.Flush(); err != nil {
		return fmt.Errorf("firewall: apply %s: %w", s.Bridge, err)
	}
	return nil
}

func hookNum(name string) uint32 {
	for n, s := range hookNames {
		if s == name {
			return uint32(n)
		}
	}
	panic("firewall: unknown hook " + name)
}

func needsRebuild(ts TableState, wants []Chain) bool {
	if !ts.Present {
		return false
	}
	if len(ts.Sets) > 0 {
		return true
	}
	for _, c := range ts.Chains {
		var want *Chain
		for i := range wants {
			if wants[i].Name == c.Name {
				want = &wants[i]
			}
		}
		if want == nil || !c.Base || c.Type != want.Type || c.Hook != want.Hook || c.Priority != want.Priority {
			return true
		}
	}
	return false
}

// Remove deletes the three tables for bridge. Absent tables are not an error;
// removed reports whether anything was deleted.
func Remove(bridge string) (removed bool, err error) {
	if err := validateBridge(bridge); err != nil {
		return false, err
	}
	obs, err := Read(bridge)
	if err != nil {
		return false, err
	}
	for _, ts := range obs.Tables {
		if !ts.Present {
			continue
		}
		cc, err := nftables.New()
		if err != nil {
			return removed, err
		}
		// One batch per table, so a table deleted by someone else meanwhile
		// (ENOENT) does not abort the other.
		cc.DelTable(&nftables.Table{Name: ts.Name, Family: familyByte(ts.Family)})
		switch err := cc.Flush(); {
		case err == nil:
			removed = true
		case errors.Is(err, unix.ENOENT):
		default:
			return removed, fmt.Errorf("firewall: remove %s: %w", tableWhat(ts), err)
		}
	}
	return removed, nil
}
