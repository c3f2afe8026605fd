# tenantmesh: `make run` starts the platform, `make test` runs what CI runs.
SHELL := /bin/bash
GO ?= go
PKG ?= ./...
T ?=
TESTFLAGS ?=
BENCH ?=
BENCHTIME ?=
COUNT ?=

.PHONY: all help bins run e2e scale faults upgrade-test generate generate-check protoc test test-short test-norace vet lint staticcheck fmt fmt-check bench bench-smoke tools build bench-gateway bench-tools fuzz slowhttptest bench-grpc

all: build

## help: this list.
help:
	@awk '/^## /{sub(/^## /, ""); if (match($$0, /^[a-z0-9-]+:/)) printf "\n"; print}' $(MAKEFILE_LIST)

build:
	$(GO) build ./...

# Binaries: name=package. Those whose package does not exist yet are skipped.
BINARIES := ./gateway/cmd/gateway ./rebalancer/cmd/rebalance ./services/aggregate/cmd/aggregate \
	./services/projection/cmd/projection ./services/runner/cmd/runner ./services/render/cmd/render ./deploy/devstack \
	./shardkit/cmd/shardkit-sidecar ./proto/cmd/grpcall

## bins: build every binary into bin/ (each named after its directory).
bins:
	$(GO) build -o bin/ $(BINARIES)

## run: the whole platform on an embedded NATS (data in .data/); Ctrl-C stops it.
run: bins
	exec bin/devstack

# Modules of their own under examples/ (go ./... at the root does not enter them): make test,
# vet and staticcheck run in each, alone (GOWORK=off), as the user's module it stands for builds:
# go.work joins them to the root for editors and go build, not for these checks.
EXAMPLES := examples/notes

## test: everything CI runs: gofmt check, go vet, staticcheck, and all tests with -race
## (integration tests run against a real embedded nats-server), the examples' modules included
## (examples/notes runs the README's "Make your service a shard" guide word for word). The
## deploy tests run promtool and helm, the dashboard's browser tests Chromium (make tools
## installs them); here a missing one fails instead of skipping.
## The rolling-upgrade test runs alone after the rest: it replaces a fleet's processes one at a
## time against start-up deadlines, which two other whole-platform packages beside it on two
## cores can miss.
UPGRADE_PKG := ./test/netfault/upgrade
test: fmt-check vet staticcheck generate-check
	TM_REQUIRE_TOOLS=1 TM_HELM=$(HELM) $(GO) test -race -count=1 -timeout 12m $(TESTFLAGS) $(if $(T),-run '$(T)') \
		$(if $(filter ./...,$(PKG)),$$($(GO) list ./... | grep -v '/test/netfault/upgrade$$'),$(PKG))
	@$(if $(filter ./...,$(PKG)),TM_REQUIRE_TOOLS=1 $(GO) test -race -count=1 -timeout 12m $(TESTFLAGS) $(if $(T),-run '$(T)') $(UPGRADE_PKG))
	@$(if $(filter ./...,$(PKG)),for d in $(EXAMPLES); do (cd $$d && GOWORK=off $(GO) test -race -count=1 -timeout 5m $(TESTFLAGS) $(if $(T),-run '$(T)') ./...) || exit 1; done)
	$(MAKE) fuzz FUZZTIME=100000x

## fuzz: the gateway's HTTP/1.1 parsers under Go's fuzzer, FUZZTIME each (default 30s; make test
## runs 100,000 inputs each, about 2s: a count, not a duration, because Go 1.26's fuzz coordinator
## can fail a clean run with "context deadline exceeded" when a duration ends, go.dev/issue/75804,
## fixed in Go 1.27). Crashers land in gateway/h1/testdata/fuzz and fail the tests from then on.
FUZZTIME ?= 30s
FUZZ_TARGETS := FuzzParseRequest FuzzParseResponse FuzzChunked FuzzReadHead
fuzz:
	@for f in $(FUZZ_TARGETS); do \
		$(GO) test -run '^$$' -fuzz "^$$f\$$" -fuzztime $(FUZZTIME) -fuzzminimizetime 0 ./gateway/h1/ || exit 1; \
	done

## generate: the Go code of proto/*.proto (gRPC APIs of the services), with Debian's protoc
## (protobuf-compiler, installed if missing) and protoc-gen-go / protoc-gen-go-grpc pinned as
## go.mod tools. The generated files are committed.
generate: protoc
	./proto/generate.sh

## generate-check: fails when the committed generated code differs from what make generate
## makes (part of make test).
generate-check: protoc
	@d=$$(mktemp -d) && ./proto/generate.sh $$d && \
	for f in $$(cd $$d && find . -name '*.go'); do \
		cmp -s $$d/$$f proto/$$f || { echo "proto/$$f is not what make generate makes: run make generate"; rm -rf $$d; exit 1; }; \
	done; rm -rf $$d

protoc:
	@command -v protoc >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -qq --no-install-recommends protobuf-compiler >/dev/null && protoc --version)

test-short:
	$(GO) test -race -short -count=1 $(if $(T),-run '$(T)') $(PKG)

test-norace:
	$(GO) test -count=1 $(if $(T),-run '$(T)') $(PKG)

vet:
	$(GO) vet ./...
	@for d in $(EXAMPLES); do (cd $$d && GOWORK=off $(GO) vet ./...) || exit 1; done

## tools: builds the pinned Go tools (staticcheck: a `tool` line in go.mod, run with `go tool`),
## installs nft (package nftables, for the fault harness test/netfault), promtool (package prometheus) and Chromium (package chromium, for the dashboard's
## browser tests) from Debian if missing, and builds helm $(HELM_VERSION)
## from its Go module into $(HELM) if missing (not a go.mod tool: it would add Kubernetes'
## client libraries to go.mod). Idempotent.
HELM_VERSION := v3.22.0
HELM ?= $(CURDIR)/.tools/helm-$(HELM_VERSION)/helm
tools:
	$(GO) build -o /dev/null honnef.co/go/tools/cmd/staticcheck
	@command -v nft >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -qq --no-install-recommends nftables iproute2 >/dev/null && nft --version)
	@command -v promtool >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -qq --no-install-recommends prometheus >/dev/null && promtool --version)
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || command -v google-chrome >/dev/null || \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null && chromium --version)
	@test -x '$(HELM)' || GOBIN='$(dir $(HELM))' GOFLAGS=-mod=mod $(GO) install helm.sh/helm/v3/cmd/helm@$(HELM_VERSION)

staticcheck:
	$(GO) tool staticcheck ./...
	@sc=$$($(GO) tool -n staticcheck) && for d in $(EXAMPLES); do (cd $$d && GOWORK=off $$sc ./...) || exit 1; done

lint: fmt-check vet staticcheck

fmt:
	gofmt -w $$(git ls-files '*.go')

fmt-check:
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi

## e2e: the whole platform as processes under load: 1,000 tenant moves across all three kinds
## (TM_E2E_MOVES changes it; its clients send back to back, or with TM_E2E_THINK, e.g. 100ms,
## between iterations) with zero failed requests, the long chaos run, 20 starts on a
## fresh 3-node NATS cluster (TM_CLUSTER_STARTS), 20 failovers of a killed shard of every kind
## and a 30 s freeze (TM_FAILOVER_RUNS, TM_FREEZE) with the ledger history checked for
## linearizability, and a 4-minute autopilot soak (TM_SOAK_MINUTES).
e2e: tools
	TM_E2E_MOVES=$${TM_E2E_MOVES:-1000} TM_CHAOS_LONG=1 TM_CLUSTER_STARTS=$${TM_CLUSTER_STARTS:-20} \
		TM_FAILOVER_RUNS=$${TM_FAILOVER_RUNS:-20} TM_FREEZE=$${TM_FREEZE:-30s} TM_SOAK_MINUTES=$${TM_SOAK_MINUTES:-4} \
		$(GO) test -count=1 -timeout 90m -run 'MovesUnderLoad|Chaos|FreshClusterStarts|Contention|FailoverUnderLoad|AutopilotSoak' -v ./test/
	$(GO) test -count=1 -timeout 10m -run '^TestTenThousandTenants$$' -v ./services/runner/

## scale: the scale harness (test/scale, about 30-40 minutes on 2 cores): a 3-node NATS
## cluster, TM_SCALE_TENANTS placements per kind (1,000,000), fleets of TM_SCALE_FLEETS shard
## instances (100,1000), 3 gateways, the rebalancer, traffic through the gateways while a plan of
## TM_SCALE_MOVES moves (3,000) runs at TM_SCALE_CONCURRENCY (50); every part a process of its
## own (NATS nodes, shard instances in groups of TM_SCALE_GROUP (100), gateways, rebalancer), so
## no one garbage collector is the wall. Prints NATS traffic per role, CPU and memory per process
## and per role, cold start, moves/s, pauses, failed requests and the ratio between the fleet
## sizes. Not part of `make test`, which runs its smoke version (tiny numbers). 127.0.0.1 only.
scale:
	TM_SCALE=1 $(GO) test -count=1 -timeout 50m -run '^TestScale$$' -v ./test/scale/ | tee $(or $(TMPDIR),/tmp)/tenantmesh-scale.txt

## faults: the fault scenarios of test/netfault, TM_FAULT_RUNS times each (20): every process
## of a fleet in its own network namespace (root, ip and nft; make tools installs nftables),
## a shard cut off NATS (both ways, and deaf to it), frozen past every lease, a gateway cut
## off NATS during a move, a NATS node in the minority, a 2|1 split, a NATS node's disk full,
## under the ledger workload checked for linearizability; prints FIGURE lines (time unserved
## per fault). make test runs each once. TM_FAULT_ONLY=Name runs only that scenario.
faults: tools
	TM_REQUIRE_TOOLS=1 TM_FAULT_RUNS=$${TM_FAULT_RUNS:-20} $(GO) test -race -count=1 -timeout 120m -run '^TestFaults$$' -v ./test/netfault/ \
		| tee $(or $(TMPDIR),/tmp)/tenantmesh-faults.txt | grep -E '^(=== RUN|--- |\s+--- |PASS|FAIL|ok)|FIGURE|Error|failed'; exit $${PIPESTATUS[0]}

## upgrade-test: a rolling upgrade and downgrade under load (test/netfault/upgrade, TestUpgrade):
## builds the previous release (TM_UPGRADE_FROM, default 481c260: main when records got their
## format version; there are no tags) with git archive, and the working tree; starts a fleet
## (3 NATS nodes, 2 gateways, 2 shards of each kind with 2 instances each, the rebalancer)
## on the old binaries, replaces every process one at a time with the new one under the
## ledger workload and live moves, then back. make test runs the short version (one process
## of each role, one instance per shard).
upgrade-test: tools
	TM_REQUIRE_TOOLS=1 TM_UPGRADE=full $(GO) test -race -count=1 -timeout 60m -run '^TestUpgrade$$' -v ./test/netfault/upgrade/ \
		| tee $(or $(TMPDIR),/tmp)/tenantmesh-upgrade.txt | grep -E '^(=== RUN|--- |PASS|FAIL|ok)|replaced|upgrade |Error|failed'; exit $${PIPESTATUS[0]}

## slowhttptest: slowhttptest (apt-get install slowhttptest) in its slow-body, slow-read and
## slow-headers modes against a gateway with its default bounds, 800 connections each, while
## another client address must be answered within a second (about a minute; docs/security.md).
slowhttptest:
	TM_SLOWHTTPTEST=1 $(GO) test -count=1 -run '^TestSlowHTTPTest$$' -v ./gateway/

## bench: the benchmark suite (test/benchreport/suite.go): the gateway vs HAProxy vs nginx vs
## direct, the placement watcher's lookup and 1M cold start, placement change -> routed on 1/3
## gateways x 1/3 NATS nodes, aggregate and projection warm-up, the cutover pause under load, the
## planner at 1M tenants, ...; about 10-12 minutes on 2 cores. Writes the medians, the commands and
## the machine into the generated section of docs/benchmarks.md. COUNT=N sets -count for all,
## BENCHTIME=2s the -benchtime of the time-based ones, BENCH=regexp runs only the matching entries
## and prints the section instead of writing it. Raw output: $(BENCH_RAW).
BENCH_RAW ?= $(or $(TMPDIR),/tmp)/tenantmesh-bench.txt
bench: bench-tools
	$(GO) run ./test/benchreport -raw '$(BENCH_RAW)' $(if $(COUNT),-count $(COUNT)) \
		$(if $(BENCHTIME),-benchtime $(BENCHTIME)) $(if $(BENCH),-only '$(BENCH)')

## bench-smoke: every benchmark in PKG once (BENCHTIME=1x, cold start at 100k placements), to
## check they run; writes nothing. Not part of `make test`.
bench-smoke:
	TM_BENCH_PLACEMENTS=$${TM_BENCH_PLACEMENTS:-100000} $(GO) test -run '^$$' -bench '$(or $(BENCH),.)' \
		-benchtime $(or $(BENCHTIME),1x) -benchmem -timeout 20m $(PKG)

## bench-gateway: the gateway vs HAProxy 2.6 and nginx 1.22 (Debian) vs direct, 10,000 tenants over
## 4 backends, wrk at -c32 and -c256 with 64 B and 16 KiB answers, interleaved rounds (ROUNDS=5
## DURATION=2s), req/s, p99 and CPU per request; installs haproxy, nginx and wrk with apt-get if
## missing. PROFILE=/tmp/gw.prof also takes a CPU profile of the gateway under load.
bench-gateway: bench-tools
	./gateway/bench/run.sh

## bench-grpc: gRPC through the gateway vs HAProxy (HTTP/2 backends) vs nginx (grpc_pass) vs
## direct: unary calls and a server stream, and plain HTTP from h2c clients, interleaved rounds
## with h2load (ROUNDS=5 DURATION=2 CLIENTS=8 STREAMS=32); installs haproxy, nginx and
## nghttp2-client with apt-get if missing. PROFILE=/tmp/gw.prof also profiles the gateway.
bench-grpc: bench-tools
	@command -v h2load >/dev/null || (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y nghttp2-client)
	./gateway/bench/grpc.sh

# bench-tools: the peers of the gateway benchmark, from Debian, if missing.
bench-tools:
	@command -v haproxy >/dev/null && command -v nginx >/dev/null && command -v wrk >/dev/null || \
		(apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y haproxy nginx wrk)
