package gateway

import (
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/tenantmesh/tenantmesh/internal/tmtest"
	"github.com/tenantmesh/tenantmesh/internal/tracing"
)

// sampleSwitch samples every trace while on, none while off.
type sampleSwitch struct{ on atomic.Bool }

func (s *sampleSwitch) ShouldSample(p sdktrace.SamplingParameters) sdktrace.SamplingResult {
	d := sdktrace.Drop
	if s.on.Load() {
		d = sdktrace.RecordAndSample
	}
	return sdktrace.SamplingResult{Decision: d, Tracestate: trace.SpanContextFromContext(p.ParentContext).TraceState()}
}

func (s *sampleSwitch) Description() string { return "switch" }

// With tracing on, a sampled request is a gateway span (the client's traceparent its parent)
// with a span per stage and per attempt, and the instance's parent is the attempt; a request the
// sampler drops records nothing, and the instance still learns the trace and the decision.
func TestTracing(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	sw := &sampleSwitch{}
	tp := sdktrace.NewTracerProvider(sdktrace.WithSampler(sw), sdktrace.WithSpanProcessor(rec))
	t.Cleanup(tracing.Use(tp))
	var a1 *backend
	e := newEnv(t, Config{}, nil, func(e *env) {
		a1 = newBackend(t, "aggregate", "aggregate-1", "i1")
		e.register(a1, "", 10, aggRoute)
		e.place("aggregate", "t1", "aggregate-1")
	})
	const client = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
	sent := func() []string { // the instance's traceparent, split
		t.Helper()
		if resp, _ := e.do("GET", "/agg/x", "t1", "", map[string]string{"Traceparent": client}); resp.StatusCode != 200 {
			t.Fatalf("status %d", resp.StatusCode)
		}
		reqs, _ := a1.requests()
		got := reqs[len(reqs)-1].Header.Values("Traceparent")
		if len(got) != 1 {
			t.Fatalf("the instance got traceparent %q, want one", got)
		}
		return strings.Split(got[0], "-")
	}

	sw.on.Store(true)
	tpOut := sent()
	if tpOut[1] != "0af7651916cd43dd8448eb211c80319c" || tpOut[2] == "b7ad6b7169203331" || tpOut[3] != "01" {
		t.Fatalf("the instance got %v: want the client's trace, the gateway's span, sampled", tpOut)
	}
	names := map[string]sdktrace.ReadOnlySpan{}
	tmtest.WaitFor(t, 5*time.Second, func() error {
		for _, s := range rec.Ended() {
			names[s.Name()] = s
		}
		if len(names) < 5 {
			return fmt.Errorf("spans so far: %v", slices.Sorted(maps.Keys(names)))
		}
		return nil
	})
	root := names["gateway"]
	if root == nil || root.Parent().SpanID().String() != "b7ad6b7169203331" {
		t.Fatalf("the gateway span is missing or not the client's child: %v", root)
	}
	for _, n := range []string{"gateway.admit", "gateway.place", "gateway.hold", "gateway.attempt"} {
		if s := names[n]; s == nil || s.Parent().SpanID() != root.SpanContext().SpanID() {
			t.Errorf("%s is missing or not a child of the gateway span", n)
		}
	}
	if att := names["gateway.attempt"]; att != nil && att.SpanContext().SpanID().String() != tpOut[2] {
		t.Errorf("the instance's parent is %s, want the attempt's span %s", tpOut[2], att.SpanContext().SpanID())
	}

	sw.on.Store(false)
	before := len(rec.Ended())
	if tpOut = sent(); tpOut[1] != "0af7651916cd43dd8448eb211c80319c" || tpOut[3] != "00" {
		t.Fatalf("not sampled, the instance got %v: want the client's trace, not sampled", tpOut)
	}
	if after := len(rec.Ended()); after != before {
		t.Fatalf("a request the sampler dropped recorded %d spans", after-before)
	}
}
