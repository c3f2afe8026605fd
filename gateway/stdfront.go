package gateway

import (
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/tenantmesh/tenantmesh/gateway/h1"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// ServeHTTP is the front end on net/http's server, which serves what the gateway's own HTTP/1.1
// front end (front.go) leaves to it: TLS listeners (and with them HTTP/2), protocol upgrades
// and the gateway's own endpoints (requests without x-tenant-id to /healthz, /readyz,
// /metrics, /admin/, /prerender-servers, /debug/pprof/). Tenant requests run the same stages.
func (g *Gateway) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.ProtoMajor == 1 && r.Context().Value(handedOffKey{}) != nil {
		// One request per handed-over connection: the next one goes back to a fresh
		// connection, and so to the gateway's own front end.
		w.Header().Set("Connection", "close")
	}
	if _, ok := r.Header[tmhttp.HeaderTenant]; !ok && isAdminPath(r.URL.Path) {
		g.admin.ServeHTTP(w, r)
		return
	}
	x := getExchange()
	defer putExchange(x)
	x.method = r.Method
	target := r.URL.EscapedPath()
	if r.URL.RawQuery != "" {
		target += "?" + r.URL.RawQuery
	}
	if r.RequestURI != "" && r.RequestURI[0] == '/' {
		target = r.RequestURI
	}
	x.path, _, _ = strings.Cut(target, "?")
	x.target, x.host = str2b(target), str2b(r.Host)
	for k, vv := range r.Header {
		for _, v := range vv {
			x.fields = append(x.fields, h1.Field{Name: str2b(k), Value: str2b(v)})
		}
	}
	_, x.connNames = r.Header["Connection"]
	if ip, _, err := net.SplitHostPort(r.RemoteAddr); err == nil {
		x.remoteIP = ip
	}
	x.tls = r.TLS != nil
	x.upgrade = r.ProtoMajor == 1 && r.Header.Get("Upgrade") != "" && httpHasToken(r.Header["Connection"], "upgrade")
	rc := http.NewResponseController(w)
	if x.grpc = tmhttp.IsGRPC(r); x.grpc {
		// The request stream goes to the instance as it comes (grpc.go); HTTP/2's flow
		// control and the server's bounds pace it, not the body deadlines of HTTP/1.1.
		if r.Body != nil && r.Body != http.NoBody {
			x.rbody = newReplayBody(r.Body, g.cfg.MaxReplayBody)
		}
	} else if r.Body != nil && r.Body != http.NoBody && r.ContentLength != 0 {
		x.body, x.bodyLen = &stdBody{rc: rc, r: r.Body, start: time.Now(), idle: g.cfg.BodyReadTimeout,
			rate: g.cfg.MinBodyRate, slow: g.metrics.slow}, r.ContentLength
	}
	x.ctx, x.cancelable = r.Context(), true
	x.out = &stdResponder{w: w, r: r, dl: writeDeadline{c: rcDeadline{rc}, d: g.cfg.WriteTimeout, slow: g.metrics.slow}}
	g.serve(x)
}

// handedOffKey marks the contexts of connections the gateway's own front end handed over.
type handedOffKey struct{}

func httpHasToken(vv []string, tok string) bool {
	for _, v := range vv {
		if h1.HasToken([]byte(v), tok) {
			return true
		}
	}
	return false
}

// stdResponder answers through net/http's ResponseWriter.
type stdResponder struct {
	w  http.ResponseWriter
	r  *http.Request
	dl writeDeadline // each write's bound (WriteTimeout)
}

func (s *stdResponder) writeHead(status int, fields []h1.Field, n int64, noBody bool) error {
	h := s.w.Header()
	for _, f := range fields {
		// A Trailer declaration goes as it is (it makes net/http chunk the body); the values
		// are sent with http.TrailerPrefix.
		k := http.CanonicalHeaderKey(string(f.Name))
		h[k] = append(h[k], string(f.Value))
	}
	if !noBody && n >= 0 {
		h["Content-Length"] = []string{strconv.FormatInt(n, 10)}
	}
	s.w.WriteHeader(status)
	return nil
}

func (s *stdResponder) write(p []byte) error {
	s.dl.renew()
	_, err := s.w.Write(p)
	return s.dl.check(err)
}

func (s *stdResponder) flush() error {
	s.dl.renew()
	return s.dl.check(http.NewResponseController(s.w).Flush())
}

func (s *stdResponder) finish(trailer []h1.Field) error {
	for _, f := range trailer {
		s.w.Header().Add(http.TrailerPrefix+string(f.Name), string(f.Value))
	}
	return nil
}

func (s *stdResponder) abort() { panic(http.ErrAbortHandler) }

func (s *stdResponder) problem(status int, body []byte, retryAfter int, extra ...h1.Field) {
	if body == nil {
		s.w.WriteHeader(status)
		return
	}
	h := s.w.Header()
	for _, f := range extra {
		h.Set(string(f.Name), string(f.Value))
	}
	h.Set("Content-Type", tmhttp.ContentTypeProblem)
	h.Set("Cache-Control", "no-store")
	if retryAfter > 0 {
		h.Set("Retry-After", strconv.Itoa(retryAfter))
	}
	s.w.WriteHeader(status)
	_, _ = s.w.Write(body)
}

func (s *stdResponder) hijack() (io.ReadWriteCloser, error) {
	c, brw, err := http.NewResponseController(s.w).Hijack()
	if err != nil {
		return nil, err
	}
	return hijacked{Reader: brw.Reader, Conn: c}, nil
}

// hijacked reads what net/http buffered before the connection's own bytes.
type hijacked struct {
	io.Reader
	net.Conn
}

func (h hijacked) Read(p []byte) (int, error) { return h.Reader.Read(p) }
