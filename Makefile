# tenantmesh: `make run` starts the platform, `make test` runs what CI runs.
SHELL := /bin/bash
GO ?= go
GOBIN ?= $(shell $(GO) env GOPATH)/bin
STATICCHECK_VERSION := v0.8.2
STATICCHECK := $(GOBIN)/staticcheck
PKG ?= ./...
T ?=
TESTFLAGS ?=
BENCH ?= .
BENCHTIME ?= 1x

.PHONY: all bins run e2e test test-short test-norace vet lint staticcheck fmt fmt-check bench tools build bench-gateway

all: build

build:
	$(GO) build ./...

# Binaries: name=package. Those whose package does not exist yet are skipped.
BINARIES := gateway=./gateway/cmd/gateway rebalance=./rebalancer/cmd/rebalance \
	aggregate=./services/aggregate/cmd/aggregate projection=./services/projection/cmd/projection \
	runner=./services/runner/cmd/runner devstack=./deploy/devstack

## bins: build every binary into bin/.
bins:
	@mkdir -p bin
	@for b in $(BINARIES); do name=$${b%%=*}; pkg=$${b#*=}; \
		if ls $$pkg/*.go >/dev/null 2>&1; then echo "go build -o bin/$$name $$pkg"; $(GO) build -o bin/$$name $$pkg || exit 1; fi; done

## run: the whole platform on an embedded NATS (data in .data/); Ctrl-C stops it.
run: bins
	exec bin/devstack

## test: everything CI runs: gofmt check, go vet, staticcheck, and all tests with -race
## (integration tests run against a real embedded nats-server).
test: fmt-check vet staticcheck
	$(GO) test -race -count=1 -timeout 12m $(TESTFLAGS) $(if $(T),-run '$(T)') $(PKG)

test-short:
	$(GO) test -race -short -count=1 $(if $(T),-run '$(T)') $(PKG)

test-norace:
	$(GO) test -count=1 $(if $(T),-run '$(T)') $(PKG)

vet:
	$(GO) vet ./...

$(STATICCHECK):
	GOBIN=$(GOBIN) $(GO) install honnef.co/go/tools/cmd/staticcheck@$(STATICCHECK_VERSION)

tools: $(STATICCHECK)

staticcheck: $(STATICCHECK)
	$(STATICCHECK) ./...

lint: fmt-check vet staticcheck

fmt:
	gofmt -w $$(git ls-files '*.go')

fmt-check:
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi

## e2e: the whole platform as processes under load: 1,000 tenant moves across all three kinds
## (TM_E2E_MOVES changes it) with zero failed requests, then the long chaos run.
e2e: tools
	TM_E2E_MOVES=$${TM_E2E_MOVES:-1000} TM_CHAOS_LONG=1 $(GO) test -count=1 -timeout 90m -run 'MovesUnderLoad|Chaos' -v ./test/

## bench: every benchmark; BENCHTIME=1x runs each once (CI smoke), e.g. BENCHTIME=3s for figures.
bench:
	$(GO) test -run '^$$' -bench '$(BENCH)' -benchtime $(BENCHTIME) -benchmem $(PKG)

## bench-gateway: the gateway vs HAProxy 2.6 and nginx 1.22 (Debian) vs direct, 10,000 tenants over
## 4 backends, wrk -c32, interleaved rounds (ROUNDS=5 DURATION=2s); installs haproxy, nginx and wrk
## with apt-get if missing. PROFILE=/tmp/gw.prof also takes a CPU profile of the gateway under load.
bench-gateway:
	@command -v haproxy >/dev/null && command -v nginx >/dev/null && command -v wrk >/dev/null || \
		(apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y haproxy nginx wrk)
	./gateway/bench/run.sh
