package rebalancer

import (
	"context"
	"testing"

	"go.opentelemetry.io/otel"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
)

// A plan's apply is one trace: plan.apply, a move span per move, and a span per step of each
// move, in the order the move took them.
func TestMoveSpans(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	prev := otel.GetTracerProvider()
	otel.SetTracerProvider(tp)
	t.Cleanup(func() { otel.SetTracerProvider(prev); _ = tp.Shutdown(context.Background()) })

	st := openStore(t)
	startShard(t, st, "s-1")
	startShard(t, st, "s-2")
	e := newEngine(t, st, Config{})
	ctx := context.Background()
	plan, err := e.CreatePlan(ctx, planOf(place(t, st, "acme", "s-1")), "test")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.Apply(ctx, plan.ID); err != nil {
		t.Fatal(err)
	}
	spans := rec.Ended()
	byID := map[string]sdktrace.ReadOnlySpan{}
	var apply, move sdktrace.ReadOnlySpan
	for _, s := range spans {
		byID[s.SpanContext().SpanID().String()] = s
		switch s.Name() {
		case "plan.apply":
			apply = s
		case "move":
			move = s
		}
	}
	if apply == nil || move == nil {
		t.Fatalf("spans %v: want plan.apply and move", names(spans))
	}
	if move.Parent().SpanID() != apply.SpanContext().SpanID() || move.SpanContext().TraceID() != apply.SpanContext().TraceID() {
		t.Fatal("the move span is not a child of plan.apply")
	}
	var steps []string
	for _, s := range spans {
		if s.Parent().SpanID() == move.SpanContext().SpanID() {
			steps = append(steps, s.Name())
		}
	}
	// Each step span ends before the next starts; the recorder has them in that order. The
	// target commits the handoff, so the engine's last steps are handoff and committed.
	want := []string{"move.pending", "move.warming", "move.handoff", "move.committed"}
	if !containsInOrder(steps, want) {
		t.Fatalf("move steps %v, want %v in order", steps, want)
	}
}

func names(spans []sdktrace.ReadOnlySpan) []string {
	var out []string
	for _, s := range spans {
		out = append(out, s.Name())
	}
	return out
}

// containsInOrder reports whether want appears in got as a subsequence.
func containsInOrder(got, want []string) bool {
	i := 0
	for _, g := range got {
		if i < len(want) && g == want[i] {
			i++
		}
	}
	return i == len(want)
}
