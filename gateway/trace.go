package gateway

import (
	"bufio"
	"context"
	"encoding/hex"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/tenantmesh/tenantmesh/gateway/h1"
	"github.com/tenantmesh/tenantmesh/internal/tracing"
)

// Tracing (internal/tracing: on when the OTEL_* environment names an exporter). A request is a
// "gateway" span, the child of the client's traceparent if it sent one. A sampled request gets a
// child span per stage (gateway.admit, gateway.place, gateway.hold) and one per upstream
// attempt (gateway.attempt: the instance picked, its answer or error), whose context the
// instance receives as its traceparent. A new trace the sampler drops costs no span at all
// (tracing.SampleRoot decides before the SDK), a dropped trace the client started costs its
// root span; either way the instance receives a traceparent carrying the decision.
// Off, none of this runs.

var tracer = tracing.NewTracer("github.com/tenantmesh/tenantmesh/gateway")

// serverSpan is made once: an option built per request would be an allocation per request.
var serverSpan = []trace.SpanStartOption{trace.WithSpanKind(trace.SpanKindServer)}

// traceStart starts x's request span, when tracing is on.
func traceStart(x *exchange) {
	if !tracing.On() {
		return
	}
	parent := context.Background()
	if tp, n := h1.Get(x.fields, "Traceparent"); n == 1 {
		carrier := propagation.MapCarrier{"traceparent": string(tp)}
		if ts, n := h1.Get(x.fields, "Tracestate"); n == 1 {
			carrier["tracestate"] = string(ts)
		}
		parent = otel.GetTextMapPropagator().Extract(parent, carrier)
	} else if sc, sampled, known := tracing.SampleRoot("gateway", trace.SpanKindServer); known {
		// A new trace: decided before the SDK, which a dropped request then never calls.
		if !sampled {
			x.sc = sc
			return
		}
		parent = tracing.WithIDs(parent, sc)
	}
	ctx, span := tracer.Start(parent, "gateway", serverSpan...)
	x.sc = span.SpanContext()
	if !span.IsRecording() {
		return // not sampled: the instance gets this span's context, nothing more is recorded
	}
	span.SetAttributes(attribute.String("http.request.method", x.method), attribute.String("url.path", x.path))
	x.span, x.tctx = span, ctx
}

// traceStage starts a stage's span of a sampled request; end ends it with the stage's outcome.
func traceStage(x *exchange, name string) (end func(error)) {
	if x.span == nil {
		return noEnd
	}
	_, span := tracer.Start(x.tctx, name)
	return func(err error) { endSpan(span, err) }
}

func noEnd(error) {}

// traceAttempt starts the span of one upstream attempt to in, of a sampled request; it is the
// instance's parent.
func traceAttempt(x *exchange, in *instance, n int) (end func(status int, err error)) {
	if x.span == nil {
		return noEndAttempt
	}
	_, span := tracer.Start(x.tctx, "gateway.attempt", trace.WithSpanKind(trace.SpanKindClient),
		trace.WithAttributes(attribute.String("tm.instance", in.key), attribute.Int("tm.attempt", n)))
	x.sc = span.SpanContext()
	return func(status int, err error) {
		if status > 0 {
			span.SetAttributes(attribute.Int("http.response.status_code", status))
		}
		endSpan(span, err)
	}
}

func noEndAttempt(int, error) {}

// traceEnd ends x's request span with the status answered.
func traceEnd(x *exchange) {
	x.sc = trace.SpanContext{}
	if x.span == nil {
		return
	}
	x.span.SetAttributes(attribute.String("tm.tenant", x.tenant), attribute.Int("http.response.status_code", x.code))
	if x.ke != nil {
		x.span.SetAttributes(attribute.String("tm.kind", x.ke.name))
	}
	if x.code >= 500 {
		x.span.SetStatus(codes.Error, "")
	}
	x.span.End()
	x.span, x.tctx = nil, nil
}

func endSpan(span trace.Span, err error) {
	if err != nil {
		span.RecordError(err)
		span.SetStatus(codes.Error, err.Error())
	}
	span.End()
}

// writeTraceparent writes the W3C traceparent (and tracestate) of sc as request fields, into
// the writer's own buffer: "00-<trace id>-<span id>-<flags>".
// traceparentValue is sc as traceparent and tracestate values (for HTTP/2 attempts).
func traceparentValue(sc trace.SpanContext) (string, string) {
	tid, sid := sc.TraceID(), sc.SpanID()
	b := make([]byte, 0, 55)
	b = append(b, "00-"...)
	b = hex.AppendEncode(b, tid[:])
	b = append(b, '-')
	b = hex.AppendEncode(b, sid[:])
	b = append(b, '-', hexDigits[sc.TraceFlags()>>4], hexDigits[sc.TraceFlags()&0xf])
	return string(b), sc.TraceState().String()
}

func writeTraceparent(w *bufio.Writer, sc trace.SpanContext) {
	tid, sid := sc.TraceID(), sc.SpanID()
	b := w.AvailableBuffer()
	b = append(b, "Traceparent: 00-"...)
	b = hex.AppendEncode(b, tid[:])
	b = append(b, '-')
	b = hex.AppendEncode(b, sid[:])
	b = append(b, '-', hexDigits[sc.TraceFlags()>>4], hexDigits[sc.TraceFlags()&0xf], '\r', '\n')
	w.Write(b)
	if ts := sc.TraceState(); ts.Len() > 0 {
		w.WriteString("Tracestate: ")
		w.WriteString(ts.String())
		w.WriteString("\r\n")
	}
}

const hexDigits = "0123456789abcdef"
