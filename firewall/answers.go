package firewall

import (
	"github.com/google/nftables/expr"
)

// The local-answers part: two chains of the guard table that keep the gateway's own DNS data
// from reaching a box, whatever dnsmasq is configured to serve.
//
// dnsmasq marks every answer it makes from its own data authoritative (AA): DHCP lease
// names and their PTRs, instance names, /etc/hosts, CHAOS servers.bind/version.bind.
// Forwarded answers carry the upstream's AA (a recursive resolver's is 0) and cached ones
// never have it (measured on dnsmasq 2.90). The header's flags and ANCOUNT sit at fixed
// offsets of a UDP datagram, so one rule drops every authoritative answer with records on
// its way to a box: a second layer under dns.mode=none, dhcp-ignore-names, no-hosts and
// no-ident, each of which is one dnsmasq option.
//
// TCP cannot be read that way: a box picks the segment sizes of the answer (its receive
// window) and can pipeline several queries on one connection, so a header may start
// anywhere in a segment. The part therefore refuses DNS over TCP from a box. What that
// costs: an answer larger than the box's UDP size (512 bytes without EDNS) comes back
// truncated and cannot be re-asked over TCP.
const (
	AnswersChain          = "answers" // hook output: authoritative DNS answers to a box dropped
	DNSTCPChain           = "dns_tcp" // hook input: DNS over TCP from a box dropped
	PartLocalAnswers Part = "local-answers"
)

// localAnswersChains are the guard table's chains of the local-answers part.
func localAnswersChains(s Spec) []Chain {
	_, gt := TableNames(s.Bridge)
	return []Chain{
		{Table: gt, Family: FamilyInet, Name: AnswersChain, Type: "filter", Hook: "output", Priority: GuardOutPrio, Policy: "accept"},
		{Table: gt, Family: FamilyInet, Name: DNSTCPChain, Type: "filter", Hook: "input", Priority: GuardInputPrio, Policy: "accept"},
	}
}

// dnsAAWithRecords is `@th,80,8 & 0x84 == 0x84 @th,112,16 != 0`: a DNS response (QR) that is
// authoritative (AA) and carries at least one answer record (ANCOUNT), read after the 8-byte
// UDP header.
func dnsAAWithRecords() []expr.Any {
	return cat(
		masked(expr.PayloadBaseTransportHeader, 10, []byte{0x84}, expr.CmpOpEq, []byte{0x84}),
		rawCmp(expr.PayloadBaseTransportHeader, 14, expr.CmpOpNeq, []byte{0, 0}),
	)
}

// localAnswersRules are the part's rules.
func localAnswersRules(s Spec) []Rule {
	_, gt := TableNames(s.Bridge)
	drop := []expr.Any{verdict(expr.VerdictDrop)}
	return []Rule{
		{Table: gt, Family: FamilyInet, Chain: AnswersChain, key: "local-answers-aa",
			Why: "the gateway's own DNS data (authoritative answers with records) never reaches a box",
			exprs: cat(ifname(expr.MetaKeyOIFNAME, s.Bridge), l4proto(expr.CmpOpEq, ipprotoUDP), thPort(0, expr.CmpOpEq, 53),
				dnsAAWithRecords(), drop)},
		{Table: gt, Family: FamilyInet, Chain: DNSTCPChain, key: "local-answers-tcp",
			Why:   "no DNS over TCP from a box (its answers' headers cannot be found in the stream)",
			exprs: cat(ifname(expr.MetaKeyIIFNAME, s.Bridge), l4proto(expr.CmpOpEq, ipprotoTCP), thPort(2, expr.CmpOpEq, 53), drop)},
	}
}
