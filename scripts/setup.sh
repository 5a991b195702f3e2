#!/usr/bin/env bash
# Prepare this machine for claudebox: Incus from Debian's packages (and btrfs-progs: the product's
# storage pool is a loop-backed btrfs pool, see boxcore/disk.go), a running daemon, a storage pool,
# and every program the test suite shells out to (debootstrap for the test cloud image, Debian's
# cloud-init for the offline `cloud-init schema` check). No test installs anything: this is the one
# place packages are installed.
# Idempotent: on a ready machine it only looks for a few programs, asks the daemon two questions
# and exits.
#
# Env: CLAUDEBOX_INCUS_LOG  where the daemon's log goes when we start it ourselves
#                           (no systemd as PID 1). Default /var/log/incus/claudebox-incusd.log.
set -euo pipefail

log() { printf 'setup: %s\n' "$*" >&2; }
die() { printf 'setup: %s\n' "$*" >&2; exit 1; }

[ "$(id -u)" -eq 0 ] || { printf 'setup: must run as root (try: sudo make setup)\n' >&2; exit 2; }

incus_log=${CLAUDEBOX_INCUS_LOG:-/var/log/incus/claudebox-incusd.log}

# VMs need both KVM and vhost-vsock (the Incus agent talks over vsock); without them the daemon
# reports the VM driver "not operational", so qemu would be dead weight.
vm_capable() { [ -c /dev/kvm ] && [ -c /dev/vhost-vsock ]; }

have_backports_source() {
	grep -rqs 'bookworm-backports' /etc/apt/sources.list /etc/apt/sources.list.d/ 2>/dev/null
}

add_backports_source() {
	local src=/etc/apt/sources.list.d/debian.sources uris signed
	[ -f "$src" ] || die "no $src to copy the mirror from; add bookworm-backports to apt by hand"
	uris=$(awk '/^URIs:/ && /debian\/?$/ {print; exit}' "$src")
	[ -n "$uris" ] || uris=$(awk '/^URIs:/ {print; exit}' "$src")
	signed=$(awk '/^Signed-By:/ {print; exit}' "$src")
	log "adding bookworm-backports (Incus is there, not in bookworm main)"
	printf 'Types: deb\n%s\nSuites: bookworm-backports\nComponents: main\n%s\n' "$uris" "$signed" \
		>/etc/apt/sources.list.d/claudebox-backports.sources
}

install_incus() {
	local codename pkgs
	codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
	pkgs="incus-base"
	vm_capable && pkgs="incus"
	if [ "$codename" = bookworm ]; then
		have_backports_source || add_backports_source
		log "installing $pkgs from bookworm-backports"
		apt-get update -qq
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -t bookworm-backports \
			--no-install-recommends $pkgs dnsmasq-base nftables iproute2 btrfs-progs >/dev/null
	else
		log "installing $pkgs from $codename"
		apt-get update -qq
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			--no-install-recommends $pkgs dnsmasq-base nftables iproute2 btrfs-progs >/dev/null
	fi
}

# Programs the test suite runs, and the Debian package each comes in.
test_tools=(debootstrap:debootstrap cloud-init:cloud-init nft:nftables dnsmasq:dnsmasq-base ip:iproute2 nsenter:util-linux tar:tar gzip:gzip zsh:zsh fish:fish)

install_test_tools() {
	local missing=() pair bin pkg
	for pair in "${test_tools[@]}"; do
		bin=${pair%%:*} pkg=${pair#*:}
		command -v "$bin" >/dev/null 2>&1 || PATH=$PATH:/usr/sbin:/sbin command -v "$bin" >/dev/null 2>&1 || missing+=("$pkg")
	done
	[ "${#missing[@]}" -eq 0 ] && return 0
	# cloud-init is here only for `cloud-init schema`: a host that did not run it before must
	# not start running it at boot because the test suite needed its schema checker. A host
	# that already has cloud-init is left exactly as it is (this branch is not reached).
	if printf '%s\n' "${missing[@]}" | grep -qx cloud-init && [ ! -e /etc/cloud/cloud-init.disabled ]; then
		mkdir -p /etc/cloud
		printf 'written by claudebox setup: cloud-init is installed only for `cloud-init schema` in the tests\n' \
			>/etc/cloud/cloud-init.disabled
	fi
	log "installing what the tests run: ${missing[*]}"
	apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

daemon_answers() { incus query /1.0 >/dev/null 2>&1; }

start_daemon() {
	if [ "$(cat /proc/1/comm 2>/dev/null)" = systemd ]; then
		log "starting incus with systemd"
		systemctl enable --now incus.socket incus.service >/dev/null
	else
		# No systemd as PID 1 (containers, CI sandboxes): run the daemon ourselves, detached.
		local bin=/usr/libexec/incus/incusd
		[ -x "$bin" ] || bin=$(command -v incusd || true)
		[ -n "$bin" ] || die "incusd not found after install"
		mkdir -p "$(dirname "$incus_log")"
		log "starting $bin in the background (log: $incus_log)"
		setsid "$bin" --group root >>"$incus_log" 2>&1 </dev/null &
	fi
	incus admin waitready --timeout 60 || die "the Incus daemon did not become ready; see $incus_log"
}

ensure_storage_pool() {
	if [ -z "$(incus storage list --format csv 2>/dev/null)" ]; then
		log "creating storage pool 'default' (dir)"
		incus storage create default dir >/dev/null
	fi
}

command -v incus >/dev/null 2>&1 && { [ -x /usr/libexec/incus/incusd ] || command -v incusd >/dev/null; } || install_incus
command -v nft >/dev/null 2>&1 && command -v dnsmasq >/dev/null 2>&1 || install_incus
# mkfs.btrfs: Incus formats the claudebox pool's loop file with it (host init falls back to a dir
# pool, with no disk limits, when it is missing).
PATH=$PATH:/usr/sbin:/sbin command -v mkfs.btrfs >/dev/null 2>&1 || install_incus
daemon_answers || start_daemon
ensure_storage_pool
install_test_tools
log "ready: Incus $(incus query /1.0 | sed -n 's/.*"server_version": *"\([^"]*\)".*/\1/p' | head -n1)"
