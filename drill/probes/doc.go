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
//	                   A rogue RA that landed shows as HasGlobalIPv6 / an IPv6 default route.
//	nested (run --nested)  as its kind, then judged once more by the box: a host
//	                   unreachable (EHOSTUNREACH, ICMP code 1) whose next hop has a failed
//	                   ARP entry in the box is dropped, the box's own ARP failure one hop up.
//	dns, class CH      DNS.Class "CH" with Type TXT (servers.bind, version.bind): records →
//	                   open (the resolver disclosed itself); REFUSED, NOTIMP, NXDOMAIN or an
//	                   empty answer → refused (answered, said nothing); silence → dropped.
//
// # Active kinds (spoofing, odd frames, the re-apply window)
//
// They send what a hostile box would, carry a marker (MarkerPrefix + Spec.Payload, or
// random; in Result.Counts.Marker) that the capture listener of any box recognises, and
// report Result.Counts. Each sends for its whole Timeout while it captures on the
// interface (AF_PACKET, promiscuous). Nothing could be sent, no interface or no raw
// socket → check-failed, never a pass. Their own outcome is only what this box can see;
// the receivers' hits (marker frames, listener hits) and the host's tables are the rest.
//
//	flood          Flood{Duration, UDP, TCP, UDPEvery=1ms, TCPEvery=20ms}: datagrams
//	               round-robin to UDP targets, connects round-robin to TCP targets, for
//	               Duration (Timeout defaults to Duration+1s). Any echo or connect → open
//	               (Counts.Through names the targets); else any RST → refused; else
//	               dropped. Run it while the drill triggers an Incus re-apply.
//	spoof-udp      Spoof{SrcIP, SrcPort}: raw-IP UDP from a forged source to Target:Port.
//	               A reply reaching us → open (Counts.Replies); else dropped. The verdict
//	               is at the receivers: the decoy's hit "from" SrcIP with the marker, the
//	               sibling's capture of the echo.
//	arp-spoof      Spoof{VictimIP}: is-at replies to Target (or broadcast) and gratuitous
//	               requests claiming VictimIP with our MAC, every 100 ms. IPv4 frames for
//	               VictimIP captured here → open (Counts.Captured); else dropped. Needs
//	               traffic to the victim during the window; the drill reads the host's
//	               neighbour entry itself.
//	mac-spoof      Spoof{VictimMAC, VictimIP?}: an ARP probe and a broadcast UDP datagram
//	               from VictimMAC, every 100 ms. Frames to VictimMAC (or VictimIP) captured
//	               here → open; else dropped.
//	dhcp-release   DHCP{VictimIP, VictimMAC, ClientID?, AskMAC?, Server?}: DHCPRELEASE of
//	               the victim's lease, then a REQUEST for its address from AskMAC (default
//	               a fresh random MAC). ACK/OFFER of VictimIP → open; NAK or another
//	               address → refused; silence → dropped (Result.DHCPReply).
//	dhcp-steal     DHCP{VictimIP, AskMAC?}: the REQUEST alone (no DISCOVER, so dnsmasq's
//	               ping-before-offer does not apply). Outcomes as dhcp-release.
//	dhcp-fake-mac  DHCP{FakeMAC?, OwnFrame?}: DISCOVER with a fake chaddr from a frame with that source (OwnFrame: from our own MAC)
//	dhcp-relay     DHCP{VictimIP}: a relayed DISCOVER (giaddr VictimIP, hops 1, the marker in option 82) to the server from our address: open if anything answers us; the victim hearing the marker is the real evidence
//	               MAC. Any OFFER/ACK to it → open; NAK → refused; silence → dropped.
//	               The dhcp kinds default to a 5 s Timeout (dnsmasq holds a new client's
//	               offer ~3 s while it pings the address).
//	frame          Frame{Variant, DstMAC?, TargetIP?, Port?}: one of vlan0-ipv4 (tagged
//	               IPv4 UDP broadcast to Port, default 7002), vlan0-ipv6 (tagged UDP to
//	               ff02::1), vlan0-dhcp-offer (tagged rogue offer), vlan0-ra (tagged RA for
//	               2001:db8:cb00::/64, default route via us), ethertype (0x88B5), arp-zero
//	               (who-has TargetIP from 0.0.0.0), ll-udp (IPv4 UDP from SrcIP, default
//	               ours, to TargetIP:Port in a frame to an 802.1 link-local group MAC,
//	               default 01:80:c2:00:00:0e: the bridge hands it to the IP stack on the
//	               sender's own port). An answer here (the echo, the ARP
//	               reply) → open; else dropped — for offer, RA and ethertype there is none
//	               to expect: the receiver's capture hit and facts are the evidence. Aim
//	               at a sibling with DstMAC, or the gateway answers broadcasts too.
//
// # Resource kinds (issue 14: the box's limits)
//
// A stress runs on the box whose limit the lab has just tightened; a control runs on a
// sibling or the host at the same time (Resource.Delay lets it start once the stress is
// at its limit). Every stress is bounded by the probe itself (Resource.Bound, Duration),
// so a missing limit cannot take the machine down: hitting the bound is open (nothing
// stopped it). Their Result.Resource says what happened (Count, Stopped, and per kind
// CPUShare, UnitNs). Resource may be omitted (every default). Resource.Delay (any kind)
// waits before the probe starts; it is part of every default timeout below.
//
//	fork-bomb  Resource{Bound=1024 (max 8192) tasks, Hold=1s}: raw clone(2) children
//	           (one task each, no Go runtime in them, every signal but SIGKILL blocked, no
//	           open files, PR_SET_PDEATHSIG=SIGKILL) until clone fails or Bound; the first 4
//	           are released at once when it fails (room for the box's own threads), the
//	           rest held for Hold, then all killed and reaped. EAGAIN → refused (Count:
//	           tasks at the peak, Stopped "EAGAIN", Released 4); Bound reached → open;
//	           another errno, a task not reaped, the timeout → check-failed. The probe's
//	           own threads count against pids.max: with fewer than 16 tasks of room
//	           before it starts it is check-failed at once (a Go process that cannot
//	           make a thread dies; a limit that tight gives no result at all).
//	spawn      Resource{Bound=4 (max 64), Delay}: that many short-lived raw children one by
//	           one, each exits 0. All ran → open; EAGAIN → refused; else check-failed.
//	mem-hog    Resource{Bound=512 MiB (max 16384), Hold=0, StallAfter=3s}: a child (this
//	           binary re-executed, oom_score_adj 1000) touches memory in 4 MiB steps up to
//	           Bound and reports each step; the parent only watches. The child SIGKILLed
//	           before Bound → refused, Stopped "oom-killed", Count the MiB last reported
//	           (Evidence adds the memory cgroup's oom_kill counter when readable); no
//	           progress for StallAfter (a v1 box with memory.oom_control=1) → refused,
//	           Stopped "stalled", the child killed; mmap ENOMEM → refused "ENOMEM"; Bound
//	           reached → open; the child failing otherwise, the timeout → check-failed.
//	alloc      Resource{Bound=32 MiB (max 1024), Delay, Hold}: touch Bound MiB in-process,
//	           hold, free → open; mmap failing → check-failed.
//	disk-fill  Resource{Bound=256 MiB (max 4096), Path=/var/tmp/claudebox-disk-fill.<pid>}:
//	           1 MiB chunks of pseudo-random data (every 4 KiB block distinct) to a new file
//	           (an existing one is check-failed, never overwritten), fsync every 8 MiB, until
//	           a write or fsync fails or Bound; the file is removed and its directory
//	           fsynced. EDQUOT/ENOSPC → refused (Count: MiB written); Bound → open; other
//	           errors, or a file that could not be removed → check-failed. ENOSPC may be the
//	           host's own disk filling up (no quota): the drill checks the volume's growth.
//	write      Resource{Bound=4 MiB (max 256), Delay, Path=/var/tmp/claudebox-write.<pid>}:
//	           the same writer as a control. Done → open; EDQUOT/ENOSPC → refused.
//	cpu-burn   Resource{Threads=2 (max 64), Duration=3s}: busy loops on locked OS threads;
//	           CPUShare = their CPU time (CLOCK_THREAD_CPUTIME_ID) / wall time (≈ Threads on
//	           idle cores, ≈ 0.5 under a half-CPU quota). Open when measured (the drill
//	           judges the share); check-failed otherwise.
//	latency    Resource{Delay, Duration=2s, Units}: a fixed work unit (25000 chained
//	           SHA-256 rounds, ~2 ms here) back to back on a locked thread, for Duration
//	           or Units units (whichever ends first; Units alone: all of them). UnitNs is
//	           the median, UnitP90Ns the 90th percentile. Open when a unit ran.
//
// Default timeouts (each plus Delay): fork-bomb Hold+30s, spawn 10s, mem-hog
// Hold+StallAfter+60s, alloc Hold+30s, disk-fill 180s, write 30s, cpu-burn Duration+5s,
// latency Duration+5s (Units alone: 60s); a set Timeout must exceed Delay plus the kind's
// own time (Hold, Duration).
//
// # Listeners and the capture
//
// ListenerConfig.Capture (PID-1 mode: eth0) records as Hits with Proto "frame" every
// frame carrying a marker, and every frame addressed to this box (unicast to our MAC,
// broadcast, multicast) whose source MAC is not ours, not the default gateway's (read
// from the neighbour table) and not in CaptureAllow: "B hears nothing" is then "no
// frame hits". The same (reason, MACs, ethertype, marker) is recorded at most every
// 10 s. Frames from the bridge before the box has its route (the DHCP offer) show as
// unexpected-source; the engine knows the bridge's MAC and may discard them.
//
// # The probe sub-protocol (claudebox probe <sub>)
//
// Main implements it; the CLI passes os.Args after "probe".
//
//	run [JSON]      Spec or []Spec (argument or stdin) → JSON []Result on stdout, exit 0
//	facts           Facts JSON
//	hits [--file]   []Hit JSON from the hits file
//	status [--file] Status JSON from the status file
//	serve           foreground listeners (for VMs / non-PID-1 use; --capture IFACE)
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
