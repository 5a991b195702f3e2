# claudebox — build, set up the host, test, drill, benchmark.
# Every target that touches Incus runs `setup` first, so each works on a fresh machine.

SHELL     := /bin/bash
GO        ?= go
BIN       := bin/claudebox
VERSION   ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
LDFLAGS   := -s -w -X github.com/claudebox/claudebox/cli.Version=$(VERSION)
# Upstream resolvers for the boxes' DNS: "host" pins this host's own resolvers (public
# resolvers are unreachable on sandboxed CI machines); pass DNS=1.1.1.1,9.9.9.9 to choose.
DNS       ?= host
# go test flags; TESTFLAGS=-run=Foo narrows a run.
TESTFLAGS ?=
TEST_TIMEOUT ?= 60m
# make install: the binary goes to $(DESTDIR)$(PREFIX)/bin, root-owned, mode 0755.
PREFIX    ?= /usr/local
DESTDIR   ?=

.PHONY: all build install setup host test drill bench vet fmt clean

all: build

build:
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags '$(LDFLAGS)' -o $(BIN) ./cmd/claudebox

# Puts bin/claudebox on PATH: $(PREFIX)/bin/claudebox, owned by root, 0755 (a user can run it
# but not replace it). Idempotent: install(1) replaces the file each time. Under sudo, whose
# PATH often lacks Go, an already built bin/claudebox (make build) is installed as it is.
install:
	@if command -v $(GO) >/dev/null 2>&1; then $(MAKE) --no-print-directory build; \
	elif [ ! -x $(BIN) ]; then echo "make install: no '$(GO)' on PATH and no $(BIN): run 'make build' first (as yourself), then 'sudo make install'"; exit 1; \
	else echo "make install: no '$(GO)' on PATH: installing the $(BIN) already built"; fi
	install -d -m 0755 $(DESTDIR)$(PREFIX)/bin
	install -o root -g root -m 0755 $(BIN) $(DESTDIR)$(PREFIX)/bin/claudebox
	@echo "installed $(DESTDIR)$(PREFIX)/bin/claudebox ($$($(DESTDIR)$(PREFIX)/bin/claudebox --version))"

# Installs Incus when missing, starts the daemon when it is not answering, makes sure a storage
# pool exists, builds the binary and converges the isolation stack. Idempotent.
setup: build
	@bash scripts/setup.sh
	@$(BIN) host init --yes --dns $(DNS)

# The drill's specs flip host-wide layers (br_netfilter, the real stack) in their seeded-hole
# phase, so they run after every other package, alone. The test cluster (three incusd beside
# the host's, about 15 s) runs with the rest.
test: setup
	@set -o pipefail; { \
		CLAUDEBOX_CLUSTER_TESTS=1 $(GO) test -json -count=1 -timeout $(TEST_TIMEOUT) $(TESTFLAGS) $$($(GO) list ./... | grep -v /drill/specs); \
		if [ -d drill/specs ]; then $(GO) test -json -count=1 -timeout $(TEST_TIMEOUT) $(TESTFLAGS) ./drill/specs/...; fi; \
	} | $(GO) run ./internal/testsummary

drill: setup
	$(BIN) drill --container --record RUNS.md

bench: setup
	@bash scripts/bench.sh

vet:
	$(GO) vet ./...
	@$(GO) mod tidy -diff || { echo "go.mod/go.sum are not tidy: run 'go mod tidy'"; exit 1; }
	@test -z "$$(gofmt -l $$(git ls-files '*.go'))" || { gofmt -l $$(git ls-files '*.go'); exit 1; }

clean:
	rm -rf bin

# A real three-member Incus cluster on this machine, beside the host's daemon (network
# namespaces, one INCUS_DIR each): internal/testcluster builds it and removes it all.
.PHONY: test-cluster
test-cluster:
	CLAUDEBOX_CLUSTER_TESTS=1 $(GO) test ./internal/testcluster/ ./boxcore/ -run 'Cluster' -count=1 -v
