package tracing_test

import (
	"context"
	"testing"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/tenantmesh/tenantmesh/internal/tracing"
)

// A Tracer made before any provider is installed starts its spans with each provider installed
// after, in turn (otel.Tracer's would keep the first, shut down here before the second).
func TestTracerFollowsTheProviderInstalledLast(t *testing.T) {
	tr := tracing.NewTracer("tracer-test")
	for round := range 3 {
		rec := tracetest.NewSpanRecorder()
		tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
		off := tracing.Use(tp)
		_, span := tr.Start(context.Background(), "s")
		span.End()
		off()
		_ = tp.Shutdown(context.Background())
		if got := len(rec.Ended()); got != 1 {
			t.Fatalf("round %d: the provider installed recorded %d spans, want 1", round, got)
		}
	}
}
