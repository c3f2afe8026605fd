// Package otlptest is an in-process OTLP/HTTP trace receiver for tests: processes started with
// its Env export their spans to it, and a test reads them back as trees.
package otlptest

import (
	"compress/gzip"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"

	collectortrace "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	commonpb "go.opentelemetry.io/proto/otlp/common/v1"
	"google.golang.org/protobuf/proto"
)

// Span is one received span.
type Span struct {
	Service  string
	Name     string
	TraceID  string
	SpanID   string
	ParentID string // "" for a root
	Attrs    map[string]string
}

// Receiver collects the spans exported to it.
type Receiver struct {
	srv *httptest.Server

	mu    sync.Mutex
	spans []Span
}

// New starts a receiver that stops when the test ends.
func New(t testing.TB) *Receiver {
	r := &Receiver{}
	r.srv = httptest.NewServer(http.HandlerFunc(r.serve))
	t.Cleanup(r.srv.Close)
	return r
}

// Env is what a process needs to export every span to r, quickly: OTLP/HTTP to r, every trace
// sampled, batches sent every 100 ms.
func (r *Receiver) Env() []string {
	return []string{
		"OTEL_EXPORTER_OTLP_ENDPOINT=" + r.srv.URL,
		"OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf",
		"OTEL_TRACES_SAMPLER=always_on",
		"OTEL_BSP_SCHEDULE_DELAY=100",
	}
}

func (r *Receiver) serve(w http.ResponseWriter, req *http.Request) {
	if req.URL.Path != "/v1/traces" {
		http.NotFound(w, req)
		return
	}
	var body io.Reader = http.MaxBytesReader(w, req.Body, 32<<20)
	if req.Header.Get("Content-Encoding") == "gzip" {
		zr, err := gzip.NewReader(body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		defer zr.Close()
		body = io.LimitReader(zr, 64<<20)
	}
	b, err := io.ReadAll(body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	var msg collectortrace.ExportTraceServiceRequest
	if err := proto.Unmarshal(b, &msg); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	var got []Span
	for _, rs := range msg.GetResourceSpans() {
		service := attrs(rs.GetResource().GetAttributes())["service.name"]
		for _, ss := range rs.GetScopeSpans() {
			for _, s := range ss.GetSpans() {
				got = append(got, Span{Service: service, Name: s.GetName(), TraceID: hex.EncodeToString(s.GetTraceId()),
					SpanID: hex.EncodeToString(s.GetSpanId()), ParentID: hex.EncodeToString(s.GetParentSpanId()),
					Attrs: attrs(s.GetAttributes())})
			}
		}
	}
	r.mu.Lock()
	r.spans = append(r.spans, got...)
	r.mu.Unlock()
	w.Header().Set("Content-Type", "application/x-protobuf")
	out, _ := proto.Marshal(&collectortrace.ExportTraceServiceResponse{})
	_, _ = w.Write(out)
}

func attrs(kvs []*commonpb.KeyValue) map[string]string {
	m := make(map[string]string, len(kvs))
	for _, kv := range kvs {
		v := kv.GetValue()
		switch {
		case v.GetStringValue() != "":
			m[kv.GetKey()] = v.GetStringValue()
		default:
			m[kv.GetKey()] = strings.Trim(fmt.Sprint(v.GetValue()), "&{}")
		}
	}
	return m
}

// Spans returns every span received so far.
func (r *Receiver) Spans() []Span {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.spans)
}

// Trace returns the spans of one trace.
func (r *Receiver) Trace(traceID string) []Span {
	return slices.DeleteFunc(r.Spans(), func(s Span) bool { return s.TraceID != traceID })
}

// Find returns the first span received that ok accepts.
func (r *Receiver) Find(ok func(Span) bool) (Span, bool) {
	for _, s := range r.Spans() {
		if ok(s) {
			return s, true
		}
	}
	return Span{}, false
}

// Tree renders spans as an indented tree of "service: name" lines, children in the order
// received, for a test's message.
func Tree(spans []Span) string {
	ids := map[string]bool{}
	for _, s := range spans {
		ids[s.SpanID] = true
	}
	var b strings.Builder
	var walk func(parent string, depth int)
	walk = func(parent string, depth int) {
		for _, s := range spans {
			if s.ParentID == parent || (depth == 0 && parent == "" && !ids[s.ParentID]) {
				fmt.Fprintf(&b, "%s%s: %s\n", strings.Repeat("  ", depth), s.Service, s.Name)
				walk(s.SpanID, depth+1)
			}
		}
	}
	walk("", 0)
	return b.String()
}

// Path reports whether spans hold a chain of spans, each a descendant of the one before,
// whose "service: name" match want in order (a name may be a prefix ending in "*").
func Path(spans []Span, want ...string) bool {
	byID := map[string]Span{}
	for _, s := range spans {
		byID[s.SpanID] = s
	}
	match := func(s Span, w string) bool {
		got := s.Service + ": " + s.Name
		if p, ok := strings.CutSuffix(w, "*"); ok {
			return strings.HasPrefix(got, p)
		}
		return got == w
	}
	descends := func(s, anc Span) bool {
		for p, ok := byID[s.ParentID]; ok; p, ok = byID[p.ParentID] {
			if p.SpanID == anc.SpanID {
				return true
			}
		}
		return false
	}
	var from func(prev *Span, i int) bool
	from = func(prev *Span, i int) bool {
		if i == len(want) {
			return true
		}
		for _, s := range spans {
			if match(s, want[i]) && (prev == nil || descends(s, *prev)) && from(&s, i+1) {
				return true
			}
		}
		return false
	}
	return from(nil, 0)
}
