package firewall

import (
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"net"
	"sort"
	"strconv"
	"strings"
	"sync"

	"github.com/google/nftables"
	"github.com/google/nftables/binaryutil"
	"github.com/google/nftables/expr"
	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

// The renderer decodes expressions from their netlink attributes itself
// rather than trusting github.com/google/nftables' decoders: those skip
// expression types they do not know and ignore attributes they do not know
// (a bitwise shift decodes as a plain mask), so a tampered rule could read
// back as ours. Here every attribute must be one we expect, or the whole
// expression renders as an opaque "<name 0x…>" token that equals nothing in
// Desired. Desired's rules go through the same path (marshalled by the
// library, then decoded here), so converged means string equality.

// rawExpr is one expression as the kernel holds it.
type rawExpr struct {
	name string
	data []byte // NFTA_EXPR_DATA contents
}

// Not in x/sys: newer bitwise attributes (shift ops; second source register).
const (
	nftaBitwiseOp    = 6
	nftaBitwiseData  = 7
	nftaBitwiseSreg2 = 8
)

// rawFromList decodes the contents of NFTA_RULE_EXPRESSIONS.
func rawFromList(b []byte) ([]rawExpr, error) {
	ad, err := netlink.NewAttributeDecoder(b)
	if err != nil {
		return nil, err
	}
	var out []rawExpr
	for ad.Next() {
		if ad.Type() != unix.NFTA_LIST_ELEM {
			out = append(out, rawExpr{name: fmt.Sprintf("list-attr-%d", ad.Type()), data: ad.Bytes()})
			continue
		}
		e, err := rawFromElem(ad.Bytes())
		if err != nil {
			return nil, err
		}
		out = append(out, e)
	}
	return out, ad.Err()
}

// rawFromElem decodes one NFTA_EXPR_NAME/NFTA_EXPR_DATA pair.
func rawFromElem(b []byte) (rawExpr, error) {
	ad, err := netlink.NewAttributeDecoder(b)
	if err != nil {
		return rawExpr{}, err
	}
	var e rawExpr
	for ad.Next() {
		switch ad.Type() {
		case unix.NFTA_EXPR_NAME:
			e.name = ad.String()
		case unix.NFTA_EXPR_DATA:
			e.data = append([]byte(nil), ad.Bytes()...)
		default:
			e.name += fmt.Sprintf("+attr%d", ad.Type())
		}
	}
	return e, ad.Err()
}

// renderExprs renders library expressions (the desired side).
func renderExprs(fam nftables.TableFamily, exprs []expr.Any) string {
	raws := make([]rawExpr, 0, len(exprs))
	for _, e := range exprs {
		b, err := expr.Marshal(byte(fam), e)
		if err != nil {
			raws = append(raws, rawExpr{name: fmt.Sprintf("unmarshallable %T", e)})
			continue
		}
		r, err := rawFromElem(b)
		if err != nil {
			r = rawExpr{name: fmt.Sprintf("undecodable %T", e)}
		}
		raws = append(raws, r)
	}
	return renderRaw(raws, nil)
}

type valKind int

const (
	kindRaw valKind = iota
	kindIfname
	kindNfproto
	kindL4proto
	kindIPv4
	kindPort
	kindCtState
	kindCtStatus
	kindEthertype
	kindAddrType
	kindMAC
)

// regVal is what a register holds: a label for the source, how to format
// values compared against it, and a pending bitwise mask if any.
type regVal struct {
	label     string
	kind      valKind
	width     uint32
	mask, xor []byte
	used      bool
}

type renderer struct {
	regs   map[uint32]*regVal
	tokens []string
}

// rendered memoises renderRaw by the rule's bytes. One Apply renders every rule three times
// over (desired, the read, the read-back), nearly all of them the same bytes: with a port's
// ~37 rules per box, rendering was a fifth of a box start's own CPU.
var rendered struct {
	sync.Mutex
	m map[string]string
}

// renderRaw renders kernel expressions (and userdata, if any) as one line; equal bytes give
// the text rendered for them before.
func renderRaw(raws []rawExpr, userdata []byte) string {
	var k strings.Builder
	for _, e := range raws {
		k.WriteString(e.name)
		k.WriteByte(0)
		k.WriteString(strconv.Itoa(len(e.data)))
		k.WriteByte(0)
		k.Write(e.data)
	}
	k.WriteByte(1)
	k.Write(userdata)
	key := k.String()
	rendered.Lock()
	text, ok := rendered.m[key]
	rendered.Unlock()
	if ok {
		return text
	}
	text = renderRawUncached(raws, userdata)
	rendered.Lock()
	if rendered.m == nil || len(rendered.m) > 1<<16 {
		rendered.m = map[string]string{}
	}
	rendered.m[key] = text
	rendered.Unlock()
	return text
}

// renderRawUncached is renderRaw's work.
func renderRawUncached(raws []rawExpr, userdata []byte) string {
	r := &renderer{regs: map[uint32]*regVal{}}
	for _, e := range raws {
		if !r.expr(e) {
			r.tokens = append(r.tokens, opaque(e))
		}
	}
	regs := make([]uint32, 0, len(r.regs))
	for reg := range r.regs {
		regs = append(regs, reg)
	}
	sort.Slice(regs, func(i, j int) bool { return regs[i] < regs[j] })
	for _, reg := range regs {
		if v := r.regs[reg]; !v.used {
			// A load nothing compared: harmless, but not ours.
			r.tokens = append(r.tokens, fmt.Sprintf("<unused load %s into reg %d>", v.label, reg))
		}
	}
	if len(userdata) > 0 {
		r.tokens = append(r.tokens, "<userdata 0x"+hex.EncodeToString(userdata)+">")
	}
	return strings.Join(r.tokens, " ")
}

func opaque(e rawExpr) string {
	if e.name == "counter" {
		return "<counter>" // its data changes with traffic
	}
	return fmt.Sprintf("<%s 0x%s>", e.name, hex.EncodeToString(e.data))
}

// attrs splits an expression's attributes; ok is false if any attribute is
// outside allowed or repeated.
func attrs(b []byte, allowed ...uint16) (map[uint16][]byte, bool) {
	ad, err := netlink.NewAttributeDecoder(b)
	if err != nil {
		return nil, false
	}
	m := map[uint16][]byte{}
	for ad.Next() {
		t := ad.Type()
		ok := false
		for _, a := range allowed {
			ok = ok || a == t
		}
		if _, dup := m[t]; !ok || dup {
			return nil, false
		}
		m[t] = ad.Bytes()
	}
	return m, ad.Err() == nil
}

func u32(b []byte) (uint32, bool) {
	if len(b) != 4 {
		return 0, false
	}
	return binary.BigEndian.Uint32(b), true
}

// load records that reg now holds v; overwriting an unread load is shown.
func (r *renderer) load(reg uint32, v *regVal) {
	if old, ok := r.regs[reg]; ok && !old.used {
		r.tokens = append(r.tokens, fmt.Sprintf("<unused load %s into reg %d>", old.label, reg))
	}
	r.regs[reg] = v
}

func (r *renderer) expr(e rawExpr) bool {
	switch e.name {
	case "meta":
		return r.meta(e.data)
	case "payload":
		return r.payload(e.data)
	case "ct":
		return r.ct(e.data)
	case "bitwise":
		return r.bitwise(e.data)
	case "cmp":
		return r.cmp(e.data)
	case "immediate":
		return r.immediate(e.data)
	case "fib":
		return r.fib(e.data)
	case "reject":
		// A TCP reset only (the exposure rules'): an ICMP reject renders opaque.
		m, ok := attrs(e.data, unix.NFTA_REJECT_TYPE, unix.NFTA_REJECT_ICMP_CODE)
		// The kernel dumps a TCP reset without its (meaningless) code.
		code, hasCode := m[unix.NFTA_REJECT_ICMP_CODE]
		if typ, ok1 := u32(m[unix.NFTA_REJECT_TYPE]); ok && ok1 && typ == unix.NFT_REJECT_TCP_RST &&
			(!hasCode || len(code) == 1 && code[0] == 0) {
			r.tokens = append(r.tokens, "reject with tcp reset")
			return true
		}
	case "masq":
		// Plain masquerade only: flags or port registers render opaque.
		if m, ok := attrs(e.data); ok && len(m) == 0 {
			r.tokens = append(r.tokens, "masquerade")
			return true
		}
	}
	return false
}

func (r *renderer) meta(b []byte) bool {
	m, ok := attrs(b, unix.NFTA_META_DREG, unix.NFTA_META_KEY)
	if !ok {
		return false
	}
	reg, ok1 := u32(m[unix.NFTA_META_DREG])
	key, ok2 := u32(m[unix.NFTA_META_KEY])
	if !ok1 || !ok2 {
		return false
	}
	v := &regVal{}
	switch expr.MetaKey(key) {
	case expr.MetaKeyIIFNAME:
		v.label, v.kind, v.width = "iifname", kindIfname, ifnamsiz
	case expr.MetaKeyOIFNAME:
		v.label, v.kind, v.width = "oifname", kindIfname, ifnamsiz
	case expr.MetaKeyBRIIIFNAME:
		v.label, v.kind, v.width = "meta ibrname", kindIfname, ifnamsiz
	case expr.MetaKeyBRIOIFNAME:
		v.label, v.kind, v.width = "meta obrname", kindIfname, ifnamsiz
	case expr.MetaKeyNFPROTO:
		v.label, v.kind, v.width = "meta nfproto", kindNfproto, 1
	case expr.MetaKeyL4PROTO:
		v.label, v.kind, v.width = "meta l4proto", kindL4proto, 1
	case expr.MetaKeyPROTOCOL:
		v.label, v.kind, v.width = "meta protocol", kindEthertype, 2
	default:
		v.label = fmt.Sprintf("meta key#%d", key)
	}
	r.load(reg, v)
	return true
}

func (r *renderer) payload(b []byte) bool {
	m, ok := attrs(b, unix.NFTA_PAYLOAD_DREG, unix.NFTA_PAYLOAD_BASE, unix.NFTA_PAYLOAD_OFFSET, unix.NFTA_PAYLOAD_LEN)
	if !ok {
		return false // includes payload writes (SREG, CSUM_*)
	}
	reg, ok1 := u32(m[unix.NFTA_PAYLOAD_DREG])
	base, ok2 := u32(m[unix.NFTA_PAYLOAD_BASE])
	off, ok3 := u32(m[unix.NFTA_PAYLOAD_OFFSET])
	ln, ok4 := u32(m[unix.NFTA_PAYLOAD_LEN])
	if !ok1 || !ok2 || !ok3 || !ok4 {
		return false
	}
	v := &regVal{width: ln}
	type field struct {
		base     expr.PayloadBase
		off, len uint32
	}
	// Fields we name; IPv4 address fields also name their prefix loads
	// (nft loads only the prefix bytes of a byte-aligned prefix).
	addrs := map[field]string{
		{expr.PayloadBaseNetworkHeader, 12, 4}: "ip saddr",
		{expr.PayloadBaseNetworkHeader, 16, 4}: "ip daddr",
		{expr.PayloadBaseNetworkHeader, 14, 4}: "arp saddr ip",
		{expr.PayloadBaseNetworkHeader, 24, 4}: "arp daddr ip",
	}
	others := map[field]*regVal{
		{expr.PayloadBaseTransportHeader, 0, 2}: {label: "th sport", kind: kindPort, width: 2},
		{expr.PayloadBaseTransportHeader, 2, 2}: {label: "th dport", kind: kindPort, width: 2},
		{expr.PayloadBaseLLHeader, 12, 2}:       {label: "ether type", kind: kindEthertype, width: 2},
		{expr.PayloadBaseLLHeader, 6, 6}:        {label: "ether saddr", kind: kindMAC, width: 6},
		{expr.PayloadBaseNetworkHeader, 8, 6}:   {label: "arp saddr ether", kind: kindMAC, width: 6},
	}
	pb := expr.PayloadBase(base)
	if name, ok := addrs[field{pb, off, 4}]; ok && ln >= 1 && ln <= 4 {
		v.label, v.kind = name, kindIPv4
	} else if o, ok := others[field{pb, off, ln}]; ok {
		v = o
	} else {
		bases := map[expr.PayloadBase]string{
			expr.PayloadBaseLLHeader: "ll", expr.PayloadBaseNetworkHeader: "nh", expr.PayloadBaseTransportHeader: "th",
		}
		bn, ok := bases[pb]
		if !ok {
			bn = fmt.Sprintf("base#%d", base)
		}
		// nft's raw payload syntax counts bits.
		v.label = fmt.Sprintf("@%s,%d,%d", bn, off*8, ln*8)
	}
	r.load(reg, v)
	return true
}

func (r *renderer) ct(b []byte) bool {
	m, ok := attrs(b, unix.NFTA_CT_DREG, unix.NFTA_CT_KEY, unix.NFTA_CT_DIRECTION)
	if !ok {
		return false
	}
	reg, ok1 := u32(m[unix.NFTA_CT_DREG])
	key, ok2 := u32(m[unix.NFTA_CT_KEY])
	if !ok1 || !ok2 {
		return false
	}
	v := &regVal{}
	switch {
	case expr.CtKey(key) == expr.CtKeySTATE && m[unix.NFTA_CT_DIRECTION] == nil:
		v.label, v.kind, v.width = "ct state", kindCtState, 4
	case expr.CtKey(key) == expr.CtKeySTATUS && m[unix.NFTA_CT_DIRECTION] == nil:
		v.label, v.kind, v.width = "ct status", kindCtStatus, 4
	default:
		v.label = fmt.Sprintf("ct key#%d", key)
		if d := m[unix.NFTA_CT_DIRECTION]; d != nil {
			v.label += fmt.Sprintf(" dir 0x%x", d)
		}
	}
	r.load(reg, v)
	return true
}

func (r *renderer) fib(b []byte) bool {
	m, ok := attrs(b, unix.NFTA_FIB_DREG, unix.NFTA_FIB_RESULT, unix.NFTA_FIB_FLAGS)
	if !ok {
		return false
	}
	reg, ok1 := u32(m[unix.NFTA_FIB_DREG])
	res, ok2 := u32(m[unix.NFTA_FIB_RESULT])
	flags, ok3 := u32(m[unix.NFTA_FIB_FLAGS])
	if !ok1 || !ok2 || !ok3 {
		return false
	}
	v := &regVal{label: fmt.Sprintf("fib flags#0x%x result#%d", flags, res)}
	if flags == unix.NFTA_FIB_F_DADDR && res == unix.NFT_FIB_RESULT_ADDRTYPE {
		v.label, v.kind, v.width = "fib daddr type", kindAddrType, 4
	}
	r.load(reg, v)
	return true
}

func (r *renderer) bitwise(b []byte) bool {
	m, ok := attrs(b, unix.NFTA_BITWISE_SREG, unix.NFTA_BITWISE_DREG, unix.NFTA_BITWISE_LEN,
		unix.NFTA_BITWISE_MASK, unix.NFTA_BITWISE_XOR, nftaBitwiseOp)
	if !ok {
		return false // includes shifts' DATA and SREG2
	}
	if op, present := m[nftaBitwiseOp]; present {
		if v, ok := u32(op); !ok || v != 0 { // NFT_BITWISE_BOOL (mask-and-xor) only
			return false
		}
	}
	sreg, ok1 := u32(m[unix.NFTA_BITWISE_SREG])
	dreg, ok2 := u32(m[unix.NFTA_BITWISE_DREG])
	ln, ok3 := u32(m[unix.NFTA_BITWISE_LEN])
	mask, ok4 := dataValue(m[unix.NFTA_BITWISE_MASK])
	xor, ok5 := dataValue(m[unix.NFTA_BITWISE_XOR])
	src, ok6 := r.regs[sreg]
	if !ok1 || !ok2 || !ok3 || !ok4 || !ok5 || !ok6 || sreg != dreg || src.mask != nil || ln != src.width {
		return false
	}
	src.mask, src.xor = mask, xor
	return true
}

// dataValue unwraps NFTA_DATA_VALUE from a nested nft_data.
func dataValue(b []byte) ([]byte, bool) {
	m, ok := attrs(b, unix.NFTA_DATA_VALUE)
	if !ok || m[unix.NFTA_DATA_VALUE] == nil {
		return nil, false
	}
	return m[unix.NFTA_DATA_VALUE], true
}

var cmpOps = map[expr.CmpOp]string{
	expr.CmpOpEq: "", expr.CmpOpNeq: "!= ", expr.CmpOpLt: "< ", expr.CmpOpLte: "<= ",
	expr.CmpOpGt: "> ", expr.CmpOpGte: ">= ",
}

func (r *renderer) cmp(b []byte) bool {
	m, ok := attrs(b, unix.NFTA_CMP_SREG, unix.NFTA_CMP_OP, unix.NFTA_CMP_DATA)
	if !ok {
		return false
	}
	reg, ok1 := u32(m[unix.NFTA_CMP_SREG])
	op, ok2 := u32(m[unix.NFTA_CMP_OP])
	data, ok3 := dataValue(m[unix.NFTA_CMP_DATA])
	opStr, ok4 := cmpOps[expr.CmpOp(op)]
	v, ok5 := r.regs[reg]
	if !ok1 || !ok2 || !ok3 || !ok4 || !ok5 {
		return false
	}
	v.used = true
	if v.mask != nil {
		// `ct state a,b` is (state & mask) != 0; anything else is shown raw.
		if v.kind == kindCtState && expr.CmpOp(op) == expr.CmpOpNeq && isZero(data) && isZero(v.xor) && len(v.mask) == 4 {
			r.tokens = append(r.tokens, "ct state "+ctStates(binaryutil.NativeEndian.Uint32(v.mask)))
			return true
		}
		// `ct status & 0x10 == 0x0`: host-endian bits, as nft reads the number.
		if v.kind == kindCtStatus && isZero(v.xor) && len(v.mask) == 4 && len(data) == 4 &&
			(expr.CmpOp(op) == expr.CmpOpEq || expr.CmpOp(op) == expr.CmpOpNeq) {
			if expr.CmpOp(op) == expr.CmpOpEq {
				opStr = "== "
			}
			r.tokens = append(r.tokens, fmt.Sprintf("ct status & 0x%x %s0x%x", binaryutil.NativeEndian.Uint32(v.mask), opStr, binaryutil.NativeEndian.Uint32(data)))
			return true
		}
		// `ip daddr [!=] a.b.c.d/n` for a prefix that is not byte-aligned.
		eqNeq := expr.CmpOp(op) == expr.CmpOpEq || expr.CmpOp(op) == expr.CmpOpNeq
		if ones, bits := net.IPMask(v.mask).Size(); v.kind == kindIPv4 && v.width == 4 && bits == 32 &&
			eqNeq && isZero(v.xor) && len(data) == 4 && net.IP(data).Mask(v.mask).Equal(net.IP(data)) {
			r.tokens = append(r.tokens, fmt.Sprintf("%s %s%s/%d", v.label, opStr, net.IP(data), ones))
			return true
		}
		if isZero(v.xor) && len(v.mask) == len(data) {
			// `@nh,48,16 & 0x3fff != 0x0000`, as nft reads it back in (an
			// equality spelled out: nft reads `a & m v` no other way).
			if expr.CmpOp(op) == expr.CmpOpEq {
				opStr = "== "
			}
			r.tokens = append(r.tokens, fmt.Sprintf("%s & 0x%x %s0x%x", v.label, v.mask, opStr, data))
			return true
		}
		r.tokens = append(r.tokens, fmt.Sprintf("%s & 0x%x ^ 0x%x %s0x%x", v.label, v.mask, v.xor, opStr, data))
		return true
	}
	r.tokens = append(r.tokens, v.label+" "+opStr+formatValue(v, data))
	return true
}

func (r *renderer) immediate(b []byte) bool {
	m, ok := attrs(b, unix.NFTA_IMMEDIATE_DREG, unix.NFTA_IMMEDIATE_DATA)
	if !ok {
		return false
	}
	reg, ok1 := u32(m[unix.NFTA_IMMEDIATE_DREG])
	if !ok1 || reg != unix.NFT_REG_VERDICT {
		return false // loading a constant into a data register: not ours
	}
	d, ok := attrs(m[unix.NFTA_IMMEDIATE_DATA], unix.NFTA_DATA_VERDICT)
	if !ok || d[unix.NFTA_DATA_VERDICT] == nil {
		return false
	}
	vm, ok := attrs(d[unix.NFTA_DATA_VERDICT], unix.NFTA_VERDICT_CODE, unix.NFTA_VERDICT_CHAIN)
	if !ok {
		return false
	}
	code, ok := u32(vm[unix.NFTA_VERDICT_CODE])
	if !ok {
		return false
	}
	chain := strings.TrimRight(string(vm[unix.NFTA_VERDICT_CHAIN]), "\x00")
	var s string
	switch expr.VerdictKind(int32(code)) {
	case expr.VerdictAccept:
		s = "accept"
	case expr.VerdictDrop:
		s = "drop"
	case expr.VerdictReturn:
		s = "return"
	case expr.VerdictContinue:
		s = "continue"
	case expr.VerdictJump:
		s = "jump " + chain
	case expr.VerdictGoto:
		s = "goto " + chain
	default:
		s = fmt.Sprintf("verdict#%d", int32(code))
	}
	if chain != "" && !strings.HasPrefix(s, "jump") && !strings.HasPrefix(s, "goto") {
		s += " chain " + chain
	}
	r.tokens = append(r.tokens, s)
	return true
}

func isZero(b []byte) bool {
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}

func ctStates(mask uint32) string {
	names := []struct {
		bit  uint32
		name string
	}{
		{expr.CtStateBitINVALID, "invalid"}, {expr.CtStateBitESTABLISHED, "established"},
		{expr.CtStateBitRELATED, "related"}, {expr.CtStateBitNEW, "new"}, {expr.CtStateBitUNTRACKED, "untracked"},
	}
	var out []string
	for _, n := range names {
		if mask&n.bit != 0 {
			out = append(out, n.name)
			mask &^= n.bit
		}
	}
	if mask != 0 || len(out) == 0 {
		out = append(out, fmt.Sprintf("0x%x", mask))
	}
	return strings.Join(out, ",")
}

// formatValue prints data the way nft would, when it has exactly the shape
// of that kind of value; otherwise hex, so distinct bytes stay distinct.
func formatValue(v *regVal, data []byte) string {
	if uint32(len(data)) != v.width {
		return fmt.Sprintf("0x%x", data)
	}
	switch v.kind {
	case kindIfname:
		// Whole-name match: name, then NULs to IFNAMSIZ. A shorter compare is a
		// prefix match (nft's "eth*") and falls through to hex.
		i := strings.IndexByte(string(data), 0)
		if i > 0 && isZero(data[i:]) {
			return fmt.Sprintf("%q", string(data[:i]))
		}
	case kindNfproto:
		switch data[0] {
		case unix.NFPROTO_IPV4:
			return "ipv4"
		case unix.NFPROTO_IPV6:
			return "ipv6"
		}
	case kindL4proto:
		switch data[0] {
		case unix.IPPROTO_TCP:
			return "tcp"
		case unix.IPPROTO_UDP:
			return "udp"
		case unix.IPPROTO_ICMP:
			return "icmp"
		case unix.IPPROTO_ICMPV6:
			return "ipv6-icmp"
		}
		return fmt.Sprintf("%d", data[0])
	case kindIPv4:
		if len(data) == 4 {
			return net.IP(data).String()
		}
		// A prefix load: the compared bytes are the network.
		ip := make(net.IP, 4)
		copy(ip, data)
		return fmt.Sprintf("%s/%d", ip, 8*len(data))
	case kindEthertype:
		switch binary.BigEndian.Uint16(data) {
		case 0x0800:
			return "ip"
		case 0x0806:
			return "arp"
		case 0x86dd:
			return "ip6"
		}
	case kindPort:
		return fmt.Sprintf("%d", binary.BigEndian.Uint16(data))
	case kindMAC:
		return net.HardwareAddr(data).String()
	case kindAddrType:
		names := map[uint32]string{
			unix.RTN_UNICAST: "unicast", unix.RTN_LOCAL: "local", unix.RTN_BROADCAST: "broadcast",
			unix.RTN_ANYCAST: "anycast", unix.RTN_MULTICAST: "multicast", unix.RTN_BLACKHOLE: "blackhole",
			unix.RTN_UNREACHABLE: "unreachable", unix.RTN_PROHIBIT: "prohibit",
		}
		if n, ok := names[binaryutil.NativeEndian.Uint32(data)]; ok {
			return n
		}
	}
	return fmt.Sprintf("0x%x", data)
}
