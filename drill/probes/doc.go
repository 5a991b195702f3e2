// Package probes is what runs inside a box for the isolation drill: the probe
// agent (also PID 1 of the scratch probe image), its probes, its listeners.
//
// # Outcomes
//
// Every probe yields one of four outcomes (DESIGN.md):
//
//	open          connected / echoed / answered
//	refused       RST or ICMP unreachable: the packet arrived somewhere and was rejected
//	dropped       silence until the timeout
//	check-failed  the probe itself could not run: never a pass
//
// Mapping decisions, per kind:
//
//	tcp, tcp6ll, http  connect ok → open; ECONNREFUSED → refused; EHOSTUNREACH or
//	                   ENETUNREACH → refused (an ICMP unreachable from a router or a
//	                   rejecting firewall), EXCEPT when the kernel raised it itself
//	                   because the next hop never answered ARP/ND (its neighbour entry
//	                   is FAILED/INCOMPLETE) → dropped, since nothing answered on the
//	                   wire; timeout → dropped; no local route, bad interface, socket
//	                   errors → check-failed. http: a status line → open (Answer is it);
//	                   connected but no response in time → open, with that evidence.
//	                   tcp6ll without a usable link-local address on the interface
//	                   (IPv6 disabled, DAD pending) → check-failed: the engine decides.
//	udp                token echoed (or any reply, noted in evidence) → open; ICMP port
//	                   unreachable (ECONNREFUSED on the connected socket) → refused;
//	                   silence → dropped. The token is resent every timeout/4.
//	icmp               echo reply → open; destination unreachable / time exceeded
//	                   quoting our echo → refused (Answer: who sent it), or dropped when
//	                   it is the kernel's own ARP/ND failure; silence → dropped; no raw
//	                   or ping socket → check-failed.
//	arp                reply from Target → open (Answer: the MAC); silence → dropped.
//	dns                records → open; a response without records (NXDOMAIN,
//	                   NOERROR-empty, REFUSED, SERVFAIL) → refused with DNS.Answered=true
//	                   and DNS.Rcode; silence → dropped; ICMP port unreachable or no
//	                   server → check-failed. The engine's rule "no answer counts only
//	                   when the resolver answered" is: Outcome == refused (equivalently
//	                   DNS.Answered && no records); dropped must not count.
//	facts              gathered → open with Result.Facts; kernel unreadable → check-failed.
//
// # The probe sub-protocol (claudebox probe <sub>)
//
// Main implements it; the CLI passes os.Args after "probe".
//
//	run [JSON]      Spec or []Spec (argument or stdin) → JSON []Result on stdout, exit 0
//	facts           Facts JSON
//	hits [--file]   []Hit JSON from the hits file
//	status [--file] Status JSON from the status file
//	serve           foreground listeners (for VMs / non-PID-1 use)
//
// Exit 2 means bad arguments or JSON (message on stderr), 1 an agent failure.
//
// # Files the engine reads with `incus exec box -- cat`
//
//	/run/claudebox-probe/status.json  PID-1 mode: {"ready":..,"phase":..,"ipv4":..,"error":..}
//	/run/claudebox-probe/hits.jsonl   one Hit per line, appended by the listeners
//
// PID-1 mode (IsInitMode, RunInit) listens on TCP 7001 and UDP 7002 by default.
package probes
