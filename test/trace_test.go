package test

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/tenantmesh/tenantmesh/internal/tmtest"
	"github.com/tenantmesh/tenantmesh/internal/tracing/otlptest"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// TestTraces runs the platform with tracing on (the OTEL_* environment pointing at an
// in-process OTLP receiver) and follows one trace a client started: a command goes from the
// gateway's span and its upstream attempt to the aggregate's HTTP server span, the gate, the
// command and its append, and on, in the event's headers, to the projection that applies it; a job goes from its creation to its run and its webhook delivery. A plan's
// apply is one trace too: each move, and each step of it.
func TestTraces(t *testing.T) {
	if testing.Short() {
		t.Skip("the whole platform with tracing on")
	}
	rcv := otlptest.New(t)
	for _, kv := range rcv.Env() {
		k, v, _ := strings.Cut(kv, "=")
		t.Setenv(k, v)
	}
	hook := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusNoContent) }))
	t.Cleanup(hook.Close)
	s := startStack(t)

	traced := func(path string, body any) string {
		t.Helper()
		trace, parent := randomHex(t, 16), randomHex(t, 8)
		b, _ := json.Marshal(body)
		req, _ := http.NewRequest(http.MethodPost, s.gateway+path, bytes.NewReader(b))
		req.Header.Set("x-tenant-id", "acme")
		req.Header.Set("content-type", "application/json")
		req.Header.Set("traceparent", fmt.Sprintf("00-%s-%s-01", trace, parent))
		resp, err := adminClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode >= 300 {
			t.Fatalf("POST %s: %d", path, resp.StatusCode)
		}
		return trace
	}
	awaitPath := func(what string, spans func() []otlptest.Span, path ...string) {
		t.Helper()
		tmtest.WaitFor(t, time.Minute, func() error {
			if got := spans(); !otlptest.Path(got, path...) {
				return fmt.Errorf("%s: no span path %q in:\n%s(%d spans received in all; services %v)", what, path, otlptest.Tree(got),
					len(rcv.Spans()), services(rcv.Spans()))
			}
			return nil
		})
	}

	cmd := traced("/commands", map[string]any{"aggregate_type": "account", "aggregate_id": "traced",
		"command": "open", "idempotency_key": "traced-open"})
	awaitPath("a command, trace "+cmd, func() []otlptest.Span { return rcv.Trace(cmd) },
		"tenantmesh-gateway: gateway", "tenantmesh-gateway: gateway.attempt",
		"tenantmesh-aggregate: aggregate POST", "tenantmesh-aggregate: shardkit.gate", "tenantmesh-aggregate: command", "tenantmesh-aggregate: events.append",
		"tenantmesh-projection: projection.apply")

	job := traced("/jobs", map[string]any{"type": "webhook", "idempotency_key": "traced-job",
		"payload": map[string]any{"url": hook.URL, "body": map[string]any{"traced": true}}})
	awaitPath("a job", func() []otlptest.Span { return rcv.Trace(job) },
		"tenantmesh-gateway: gateway", "tenantmesh-gateway: gateway.attempt",
		"tenantmesh-runner: runner POST", "tenantmesh-runner: shardkit.gate", "tenantmesh-runner: job.run", "tenantmesh-runner: effect.deliver")

	nc, err := nats.Connect(s.natsURL, nats.UserCredentials(s.natsCreds))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	st, err := schema.Open(context.Background(), nc, schema.Options{})
	if err != nil {
		t.Fatal(err)
	}
	moveAcross(t, st, s.rebalancer, "acme")
	awaitPath("a plan", rcv.Spans,
		"tenantmesh-rebalancer: plan.apply", "tenantmesh-rebalancer: move", "tenantmesh-rebalancer: move.handoff")
	s.stop(t)
}

func randomHex(t *testing.T, n int) string {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(b)
}

func services(spans []otlptest.Span) map[string]int {
	out := map[string]int{}
	for _, s := range spans {
		out[s.Service+": "+s.Name+" "+s.TraceID[:8]+"/"+s.ParentID]++
	}
	return out
}
