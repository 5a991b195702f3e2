#!/usr/bin/env bash
# make bench: speed targets, measured as medians of paired runs on this machine.
set -euo pipefail
cd "$(dirname "$0")/.."
echo "== claudebox vs incus (paired medians)"
go run ./internal/bench -bin bin/claudebox
if [ -d drill/specs ] && grep -rqs 'func BenchmarkDrill' drill/; then
	echo "== drill wall time"
	go test -run '^$' -bench 'BenchmarkDrill' -benchtime 1x ./drill/ 2>&1 | grep -E '^(Benchmark|ok|FAIL|---)|_test\.go:[0-9]+:|^drill wall' || true
fi
if grep -rqs 'func BenchmarkMint' boxcore/ internal/ 2>/dev/null; then
	echo "== mint time split"
	go test -run '^$' -bench 'BenchmarkMint' -benchtime 1x ./... 2>&1 | grep -E '^(Benchmark|---)|_test\.go:[0-9]+:' || true
fi
echo "== client and firewall micro-benchmarks"
go test -run '^$' -bench . -benchtime 20x ./boxcore/incus/ ./firewall/ 2>&1 | grep -E '^Benchmark' || true
