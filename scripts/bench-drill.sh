#!/usr/bin/env bash
# Drill wall time: 2 boxes (goal <= 10 s) and 8 boxes (goal <= 2x the 2-box time), container
# mode, full matrix, on the host's stack. Needs root, the daemon and 'claudebox host init'.
# Usage: scripts/bench-drill.sh [BIN]   (default bin/claudebox; RUNS=n repeats each size)
set -euo pipefail
BIN=${1:-bin/claudebox}
RUNS=${RUNS:-1}
rec=$(mktemp -d)/RUNS.md
trap 'rm -rf "$(dirname "$rec")"' EXIT
best() { # best wall time of $RUNS runs with --boxes $1
	local b=999 t
	for _ in $(seq "$RUNS"); do
		s=$(date +%s.%N)
		"$BIN" drill --container --boxes "$1" --record "$rec" >/dev/null 2>"$rec.err" || { cat "$rec.err" >&2; echo "drill --boxes $1 failed" >&2; exit 1; }
		t=$(echo "$(date +%s.%N) - $s" | bc)
		b=$(echo "if ($t < $b) $t else $b" | bc)
	done
	echo "$b"
}
t2=$(best 2)
t8=$(best 8)
ratio=$(echo "scale=2; $t8 / $t2" | bc)
printf 'BenchmarkDrill/boxes=2  wall %.2fs  (goal <= 10s)  %s\n' "$t2" "$(echo "$t2 <= 10" | bc | sed 's/1/ok/;s/0/OVER/')"
printf 'BenchmarkDrill/boxes=8  wall %.2fs  ratio %sx (goal <= 2x)  %s\n' "$t8" "$ratio" "$(echo "$ratio <= 2" | bc | sed 's/1/ok/;s/0/OVER/')"
