package gateway

import (
	"context"
	"io"
	"sync"
	"time"
	"unsafe"

	"go.opentelemetry.io/otel/trace"

	"github.com/tenantmesh/tenantmesh/gateway/h1"
	"github.com/tenantmesh/tenantmesh/internal/gatesig"
	"github.com/tenantmesh/tenantmesh/shardkit/placement"
)

// exchange is one tenant request on its way through the stages: what the front end received,
// what each stage learned, and the answer. Exchanges are pooled; every field is reset between
// requests.
type exchange struct {
	// The request as received (the front end fills these).
	method   string
	path     string     // the target's path, for routing
	target   []byte     // the request target as received (path and query), forwarded as is
	host     []byte     // the Host field
	fields   []h1.Field // the request's header fields, in order
	remoteIP string
	tls      bool
	upgrade  bool // Upgrade + Connection: upgrade
	// connNames: the request has a Connection field, whose named fields are not forwarded.
	connNames bool
	// proof signs the request for the instance (X-Tm-Proof); nil without Config.ShardKey.
	proof *gatesig.Signer
	// dropAuthz: the client's Authorization is not forwarded (it carried the edge identity's
	// token, and the kind does not ask for it).
	dropAuthz bool
	body      io.Reader // nil: no body
	bodyLen   int64     // -1: unknown (chunked)
	// cancelable: the context ends when the client goes away (net/http's server watches it).
	cancelable bool
	// grpc: a gRPC call (HTTP/2, application/grpc): sent over HTTP/2, answered with gRPC
	// statuses (grpc.go); its request stream is rbody, not body.
	grpc  bool
	rbody *replayBody
	// streamCtx: ctx is the HTTP/2 stream's own, ended with it (h2front.go).
	streamCtx bool
	out       responder
	ctx       context.Context
	cancel    context.CancelFunc
	rctx      reqContext // the context of the own front end's requests
	start     time.Time

	// What the stages learned.
	tenant     string
	subject    string // the verified token's sub (edge identity), sent as x-tm-subject
	ke         *kindEntry
	rt         *route
	policy     policy
	entry      placement.Entry
	reqID      string // generated request id, "" if the client sent a usable one
	bodyBuf    []byte // buffered body (nil if none or streamed)
	replayable bool   // the request can be sent again (no body, or body buffered)
	ticket     *held  // the hold buffer's ticket while the tenant's queue is going out
	triedArr   [4]*instance
	tried      []*instance
	lastErr    error
	aff        affinityAttempts // the affinity policy's plan for this request
	// affinityAnswer: the answer names its server and tenant (x-tm-target, x-tm-tenant).
	affinityAnswer bool

	// Tracing (trace.go), with tracing on only: the span context the instance receives as its
	// parent (valid: the client's traceparent and tracestate are replaced), and a sampled
	// request's span and its context.
	sc   trace.SpanContext
	span trace.Span
	tctx context.Context

	// The answer.
	inst *instance // the instance that answered
	code int       // the status answered, for metrics

	// Storage reused across requests.
	head    []byte // the request head (fields point into it)
	req     h1.Request
	rfields []h1.Field // the response's fields as sent to the client
	lim     io.LimitedReader
	reqIDb  [16]byte
	num     [20]byte
	pnum    [20]byte // the epoch, for the proof
	pbuf    [80]byte // the proof
	pf      gatesig.Fields
	chunked h1.ChunkedReader
	bodyMem []byte
	h2blk   []byte // a gRPC attempt's header block (grpc.go)
	h2path  []byte
}

var exchanges = sync.Pool{New: func() any { return &exchange{} }}

func getExchange() *exchange {
	x := exchanges.Get().(*exchange)
	x.tried = x.triedArr[:0]
	x.bodyLen = -1
	x.replayable = true
	return x
}

// putExchange clears x's references and returns it to the pool.
func putExchange(x *exchange) {
	*x = exchange{head: x.head[:0], req: x.req, rfields: x.rfields[:0], chunked: x.chunked, bodyMem: x.bodyMem[:0], h2blk: x.h2blk[:0], h2path: x.h2path[:0],
		aff: affinityAttempts{plan: x.aff.plan[:0]}}
	x.req.Fields = x.req.Fields[:0]
	if cap(x.bodyMem) > 64<<10 {
		x.bodyMem = nil // do not keep large bodies' memory
	}
	exchanges.Put(x)
}

// str is a string view of b without copying; b must not change while the string is used, so
// only strings that do not outlive the exchange are made with it.
func str(b []byte) string { return unsafe.String(unsafe.SliceData(b), len(b)) }

// methodString interns the common methods.
func methodString(b []byte) string {
	switch string(b) {
	case "GET":
		return "GET"
	case "POST":
		return "POST"
	case "HEAD":
		return "HEAD"
	case "PUT":
		return "PUT"
	case "DELETE":
		return "DELETE"
	case "PATCH":
		return "PATCH"
	case "OPTIONS":
		return "OPTIONS"
	}
	return string(b)
}

// responder writes an answer to the client; each front end has its own.
type responder interface {
	// writeHead sends the status line and fields. n is the body's length: 0 with noBody (HEAD,
	// 1xx, 204, 304: the fields go as they are), else a byte count or h1.BodyChunked (unknown:
	// streamed).
	writeHead(status int, fields []h1.Field, n int64, noBody bool) error
	write(p []byte) error
	flush() error
	// finish ends the body, with the trailer fields of a chunked one.
	finish(trailer []h1.Field) error
	// abort cuts the connection: the client must not take a cut-off body for a whole one.
	abort()
	// problem answers with problem+json (and extra fields, e.g. WWW-Authenticate).
	problem(status int, body []byte, retryAfter int, extra ...h1.Field)
	// hijack takes the client connection over, for a protocol switch.
	hijack() (io.ReadWriteCloser, error)
}
