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

.PHONY: all build setup host test drill bench vet fmt clean

all: build

build:
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags '$(LDFLAGS)' -o $(BIN) ./cmd/claudebox

# Installs Incus when missing, starts the daemon when it is not answering, makes sure a storage
# pool exists, builds the binary and converges the isolation stack. Idempotent.
setup: build
	@bash scripts/setup.sh
	@$(BIN) host init --yes --dns $(DNS)

# The drill's specs flip host-wide layers (br_netfilter, the real stack) in their seeded-hole
# phase, so they run after every other package, alone.
test: setup
	@set -o pipefail; { \
		$(GO) test -json -count=1 -timeout $(TEST_TIMEOUT) $(TESTFLAGS) $$($(GO) list ./... | grep -v /drill/specs); \
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
