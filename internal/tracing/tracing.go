// Package tracing turns OpenTelemetry tracing on from the standard OTEL_* environment variables
// and carries trace context in NATS message headers, so one trace follows a request from the
// gateway into a shard, a JetStream append and the projection that applies it.
//
// Tracing is off unless the environment names an OTLP endpoint (OTEL_EXPORTER_OTLP_ENDPOINT or
// OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) or OTEL_TRACES_EXPORTER=otlp. Off, the global tracer
// provider stays OpenTelemetry's no-op one: a span costs a few nanoseconds and no allocation.
// On, the exporter is OTLP over HTTP and every setting is the SDK's own OTEL_* variable
// (OTEL_TRACES_SAMPLER and _ARG, OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES, OTEL_BSP_*,
// OTEL_EXPORTER_OTLP_HEADERS, ...). OTEL_SDK_DISABLED=true or OTEL_TRACES_EXPORTER=none turn it
// off whatever else is set.
package tracing

import (
	"context"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"go.opentelemetry.io/contrib/instrumentation/net/http/otelhttp"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
)

// Enabled reports whether the environment asks for traces (see the package doc).
func Enabled() bool {
	if strings.EqualFold(os.Getenv("OTEL_SDK_DISABLED"), "true") {
		return false
	}
	switch strings.ToLower(os.Getenv("OTEL_TRACES_EXPORTER")) {
	case "none":
		return false
	case "otlp":
		return true
	}
	return os.Getenv("OTEL_EXPORTER_OTLP_ENDPOINT") != "" || os.Getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") != ""
}

// Setup installs the global tracer provider and the W3C trace-context propagator when the
// environment asks for traces, for the process named service (OTEL_SERVICE_NAME overrides it).
// shutdown flushes the spans not yet exported; call it on the way out. Off, Setup does nothing
// and shutdown is a no-op.
func Setup(ctx context.Context, service string) (shutdown func(context.Context) error, err error) {
	if !Enabled() {
		return func(context.Context) error { return nil }, nil
	}
	exp, err := otlptracehttp.New(ctx)
	if err != nil {
		return nil, fmt.Errorf("tracing: the OTLP exporter (OTEL_EXPORTER_OTLP_*): %w", err)
	}
	res, err := resource.New(ctx,
		resource.WithAttributes(attribute.String("service.name", service)),
		resource.WithFromEnv(), // OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES win
		resource.WithHost(),
		resource.WithProcessPID(),
	)
	if err != nil {
		return nil, fmt.Errorf("tracing: resource (OTEL_RESOURCE_ATTRIBUTES): %w", err)
	}
	// The sampler comes from OTEL_TRACES_SAMPLER (default: parent-based, always on).
	sampler, err := samplerFromEnv()
	if err != nil {
		return nil, err
	}
	tp := NewProvider(sampler, sdktrace.WithBatcher(exp), sdktrace.WithResource(res))
	otel.SetTracerProvider(tp)
	otel.SetTextMapPropagator(propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{}))
	on.Store(true)
	return tp.Shutdown, nil
}

var on atomic.Bool

// NewProvider is the SDK's tracer provider with sampler and opts, and trace and span ids drawn
// from math/rand/v2's lock-free generator (the SDK's default takes a mutex per span, which a
// gateway serving on every core contends for on each request). sampler is also the one
// SampleRoot consults.
func NewProvider(sampler sdktrace.Sampler, opts ...sdktrace.TracerProviderOption) *sdktrace.TracerProvider {
	rootSampler.Store(&sampler)
	return sdktrace.NewTracerProvider(append([]sdktrace.TracerProviderOption{
		sdktrace.WithIDGenerator(randomIDs{}), sdktrace.WithSampler(sampler)}, opts...)...)
}

var rootSampler atomic.Pointer[sdktrace.Sampler]

// SampleRoot decides, before any span exists, whether a new trace (a request that came with no
// trace context) is sampled, as the provider's sampler would, and draws its ids. A hot path
// skips the SDK for the traces it drops (sc is then the unsampled context to pass on) and, for
// those it keeps, starts the root span from WithIDs(ctx, sc), so the SDK's span gets these ids
// and the same decision. known is false when NewProvider did not make the provider: the caller
// starts its span as usual.
func SampleRoot(name string, kind trace.SpanKind) (sc trace.SpanContext, sampled, known bool) {
	sp := rootSampler.Load()
	if sp == nil || !On() {
		return trace.SpanContext{}, false, false
	}
	tid, sid := randomIDs{}.NewIDs(context.Background())
	r := (*sp).ShouldSample(sdktrace.SamplingParameters{ParentContext: context.Background(), TraceID: tid, Name: name, Kind: kind})
	sampled = r.Decision == sdktrace.RecordAndSample
	var flags trace.TraceFlags
	if sampled {
		flags = trace.FlagsSampled
	}
	return trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: sid, TraceFlags: flags}), sampled, true
}

type presetIDs struct{}

// WithIDs returns ctx carrying the ids of sc: the next root span started from it takes them
// (see SampleRoot).
func WithIDs(ctx context.Context, sc trace.SpanContext) context.Context {
	return context.WithValue(ctx, presetIDs{}, sc)
}

// randomIDs makes non-zero random trace and span ids (not secrets: W3C asks for uniqueness).
type randomIDs struct{}

func (randomIDs) NewIDs(ctx context.Context) (trace.TraceID, trace.SpanID) {
	if sc, ok := ctx.Value(presetIDs{}).(trace.SpanContext); ok {
		return sc.TraceID(), sc.SpanID()
	}
	var tid trace.TraceID
	for !tid.IsValid() {
		binary.NativeEndian.PutUint64(tid[:8], rand.Uint64())
		binary.NativeEndian.PutUint64(tid[8:], rand.Uint64())
	}
	return tid, newSpanID()
}

func (randomIDs) NewSpanID(context.Context, trace.TraceID) trace.SpanID { return newSpanID() }

func newSpanID() trace.SpanID {
	var sid trace.SpanID
	for !sid.IsValid() {
		binary.NativeEndian.PutUint64(sid[:], rand.Uint64())
	}
	return sid
}

// Use installs tp as the global tracer provider, with the W3C propagator, and turns tracing on,
// as Setup does from the environment: for a test or benchmark that brings its own provider (an
// in-memory recorder, a sampler). The packages' tracers (NewTracer) follow the provider
// installed last, so a test may call it once per run. off turns tracing off again (spans then
// cost nothing; the provider stays).
func Use(tp trace.TracerProvider) (off func()) {
	otel.SetTracerProvider(tp)
	otel.SetTextMapPropagator(propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{}))
	on.Store(true)
	return func() { on.Store(false) }
}

// On reports whether Setup turned tracing on in this process: hot paths skip span work
// entirely when it did not.
func On() bool { return on.Load() }

// Handler gives every request to h a server span named "<operation> <method>", continuing the
// trace of its traceparent header (OpenTelemetry's otelhttp). With tracing off it is h
// itself: no cost.
func Handler(operation string, h http.Handler) http.Handler {
	if !On() {
		return h
	}
	return otelhttp.NewHandler(h, operation, otelhttp.WithSpanNameFormatter(func(op string, r *http.Request) string {
		return op + " " + r.Method
	}))
}

// Transport is Handler's client side: a span per request and traceparent sent (otelhttp).
// With tracing off it is rt itself.
func Transport(rt http.RoundTripper) http.RoundTripper {
	if !On() {
		return rt
	}
	return otelhttp.NewTransport(rt)
}

// Main is Setup for a binary's main: flush, deferred, exports what is left (bounded to 5 s).
func Main(ctx context.Context, service string) (flush func(), err error) {
	shutdown, err := Setup(ctx, service)
	if err != nil {
		return nil, err
	}
	return func() {
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		_ = shutdown(sctx)
	}, nil
}

// Inject writes ctx's trace context into h, a NATS message's headers (nothing when ctx has no
// span or tracing is off).
func Inject(ctx context.Context, h nats.Header) {
	if On() {
		otel.GetTextMapPropagator().Inject(ctx, natsCarrier(h))
	}
}

// Extract returns ctx carrying the trace context found in h.
func Extract(ctx context.Context, h nats.Header) context.Context {
	if !On() || len(h) == 0 {
		return ctx
	}
	return otel.GetTextMapPropagator().Extract(ctx, natsCarrier(h))
}

// Traced reports whether h carries a trace context: a consumer starts spans only for the
// messages of a sampled trace.
func Traced(h nats.Header) bool { return On() && len(h["traceparent"]) > 0 }

// natsCarrier adapts NATS headers to the propagator, with the W3C header names as written
// (NATS header names are case-sensitive).
type natsCarrier nats.Header

func (c natsCarrier) Get(key string) string {
	if v := c[key]; len(v) > 0 {
		return v[0]
	}
	return ""
}

func (c natsCarrier) Set(key, value string) { c[key] = []string{value} }

func (c natsCarrier) Keys() []string {
	keys := make([]string, 0, len(c))
	for k := range c {
		keys = append(keys, k)
	}
	return keys
}

// samplerFromEnv is the sampler OTEL_TRACES_SAMPLER and OTEL_TRACES_SAMPLER_ARG name (the
// OpenTelemetry specification's values; default parentbased_always_on), made here so SampleRoot
// can consult the same one.
func samplerFromEnv() (sdktrace.Sampler, error) {
	ratio := func() (float64, error) {
		arg := os.Getenv("OTEL_TRACES_SAMPLER_ARG")
		if arg == "" {
			return 1, nil
		}
		f, err := strconv.ParseFloat(arg, 64)
		if err != nil || f < 0 || f > 1 {
			return 0, fmt.Errorf("tracing: OTEL_TRACES_SAMPLER_ARG=%q: want a ratio from 0 to 1", arg)
		}
		return f, nil
	}
	switch name := strings.ToLower(strings.TrimSpace(os.Getenv("OTEL_TRACES_SAMPLER"))); name {
	case "", "parentbased_always_on":
		return sdktrace.ParentBased(sdktrace.AlwaysSample()), nil
	case "always_on":
		return sdktrace.AlwaysSample(), nil
	case "always_off":
		return sdktrace.NeverSample(), nil
	case "parentbased_always_off":
		return sdktrace.ParentBased(sdktrace.NeverSample()), nil
	case "traceidratio", "parentbased_traceidratio":
		f, err := ratio()
		if err != nil {
			return nil, err
		}
		if name == "traceidratio" {
			return sdktrace.TraceIDRatioBased(f), nil
		}
		return sdktrace.ParentBased(sdktrace.TraceIDRatioBased(f)), nil
	default:
		return nil, fmt.Errorf("tracing: OTEL_TRACES_SAMPLER=%q: want always_on, always_off, traceidratio or their parentbased_ forms", name)
	}
}
