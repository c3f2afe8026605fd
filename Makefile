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

.PHONY: all run test test-short test-norace vet lint staticcheck fmt fmt-check bench tools build bench-gateway

all: build

build:
	$(GO) build ./...

run:
	@echo "The dev stack (gateway, rebalancer, shards on an embedded NATS) is not built yet; see issue 10."
	@echo "Today: 'make test' runs the foundation's tests against a real embedded nats-server."

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
