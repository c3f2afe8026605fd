package tracing

import (
	"context"
	"strings"
	"testing"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
)

func TestSamplerFromEnv(t *testing.T) {
	for _, c := range []struct{ name, arg, err string }{
		{"", "", ""},
		{"parentbased_traceidratio", "0.01", ""},
		{"always_off", "", ""},
		{"traceidratio", "2", "OTEL_TRACES_SAMPLER_ARG"},
		{"sometimes", "", "OTEL_TRACES_SAMPLER"},
	} {
		t.Setenv("OTEL_TRACES_SAMPLER", c.name)
		t.Setenv("OTEL_TRACES_SAMPLER_ARG", c.arg)
		_, err := samplerFromEnv()
		if (err == nil) != (c.err == "") || (err != nil && !strings.Contains(err.Error(), c.err)) {
			t.Errorf("%s %s: %v, want an error naming %q", c.name, c.arg, err, c.err)
		}
	}
}

// SampleRoot's decision is the provider's, and a span started from WithIDs takes its ids.
func TestSampleRoot(t *testing.T) {
	ratio := sdktrace.TraceIDRatioBased(0.5)
	tp := NewProvider(ratio)
	defer func() { _ = tp.Shutdown(context.Background()) }()
	defer Use(tp)()
	kept, dropped := 0, 0
	for range 200 {
		sc, sampled, known := SampleRoot("r", trace.SpanKindServer)
		if !known {
			t.Fatal("the sampler NewProvider installed is not known")
		}
		if !sampled {
			dropped++
			continue
		}
		kept++
		_, span := tp.Tracer("t").Start(WithIDs(context.Background(), sc), "r")
		got := span.SpanContext()
		span.End()
		if got.TraceID() != sc.TraceID() || got.SpanID() != sc.SpanID() || !got.IsSampled() {
			t.Fatalf("span %v, want the ids and decision of %v", got, sc)
		}
	}
	if kept == 0 || dropped == 0 {
		t.Fatalf("a 0.5 ratio kept %d and dropped %d of 200", kept, dropped)
	}
}
