package gateway

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httputil"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/tenantmesh/tenantmesh/gateway/edgeauth"
	"github.com/tenantmesh/tenantmesh/shardkit/placement"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// reqState is what the request path knows about one request; Rewrite and the upstream transport
// find it in the request's context.
type reqState struct {
	ke     *kindEntry
	rt     *route
	tenant string
	method string
	entry  placement.Entry
	reqID  string // generated request id, "" if the client sent a usable one
	// subject is the verified token's sub (edge auth), sent as x-tm-subject.
	subject []string

	body       []byte // buffered body, nil if none or streamed
	replayable bool   // the request can be sent again (no body, or body buffered)

	code int       // status answered, for metrics
	inst *instance // instance that answered
}

func (st *reqState) getBody() (io.ReadCloser, error) {
	return io.NopCloser(bytes.NewReader(st.body)), nil
}

type stateKey struct{}

func stateOf(ctx context.Context) *reqState {
	st, _ := ctx.Value(stateKey{}).(*reqState)
	return st
}

// ServeHTTP serves admin endpoints (requests without x-tenant-id to /healthz, /readyz, /metrics
// and /admin/) and proxies everything else as tenant traffic.
func (g *Gateway) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if _, ok := r.Header[tmhttp.HeaderTenant]; !ok && isAdminPath(r.URL.Path) {
		g.admin.ServeHTTP(w, r)
		return
	}
	g.serveTenant(w, r)
}

func isAdminPath(p string) bool {
	return p == "/" || strings.HasPrefix(p, "/prerender-servers") || p == "/healthz" || p == "/readyz" || p == "/metrics" || strings.HasPrefix(p, "/admin/") || strings.HasPrefix(p, "/debug/pprof/")
}

// refuseToken answers a request whose bearer token is missing or not valid: 401 with
// WWW-Authenticate (RFC 6750), as problem+json.
func (g *Gateway) refuseToken(w http.ResponseWriter, r *http.Request, err error) {
	ae := &edgeauth.Error{Reason: "invalid", Err: err}
	errors.As(err, &ae)
	desc := "the bearer token is " + ae.Reason
	hdr := `Bearer realm="tenantmesh"`
	if errors.Is(err, edgeauth.ErrNoToken) {
		desc = "send Authorization: Bearer <token> from your identity provider"
	} else {
		hdr += `, error="invalid_token", error_description="` + desc + `"`
	}
	w.Header().Set("WWW-Authenticate", hdr)
	g.reject(w, r, nil, &tmhttp.Error{Status: http.StatusUnauthorized, Type: "unauthenticated", Title: "Unauthenticated", Detail: desc, Err: err}, "", "")
}

// reject answers a request refused before it reached the proxy.
func (g *Gateway) reject(w http.ResponseWriter, r *http.Request, km *kindMetrics, err error, tenant, kind string) {
	p := tmhttp.FromError(err)
	p.Tenant, p.Kind = tenant, kind
	tmhttp.WriteProblem(w, r, p)
	if km != nil {
		km.code(p.Status)
	} else {
		g.metrics.requests.WithLabelValues("-", strconv.Itoa(p.Status)).Inc()
	}
}

func (g *Gateway) serveTenant(w http.ResponseWriter, r *http.Request) {
	start := time.Now()
	tenant := r.Header.Get(tmhttp.HeaderTenant)
	var subject []string
	if g.cfg.Auth != nil {
		id, err := g.cfg.Auth.Verify(r)
		if err != nil {
			g.refuseToken(w, r, err)
			return
		}
		switch {
		case tenant == "":
			tenant = id.Tenant
			r.Header.Set(tmhttp.HeaderTenant, tenant)
		case tenant != id.Tenant:
			g.reject(w, r, nil, tmhttp.Errorf(http.StatusForbidden, "tenant-mismatch", "Tenant mismatch",
				"x-tenant-id names a tenant the bearer token is not for; send the token's tenant or leave x-tenant-id out"), tenant, "")
			return
		}
		if id.Subject != "" {
			subject = []string{id.Subject}
		}
	}
	if !schema.ValidTenant(tenant) {
		g.reject(w, r, nil, schema.CheckTenant(tenant), "", "")
		return
	}
	snap := g.reg.snap.Load()
	rt := snap.match(r.Method, r.URL.Path)
	if rt == nil {
		if k := affinityKindOf(snap, r.URL.Path); k != "" {
			g.reject(w, r, nil, &tmhttp.Error{Status: http.StatusServiceUnavailable, Type: "no-live-instance", Title: "No live instance",
				Detail: "no server of kind " + k + " is registered", RetryAfter: time.Second}, tenant, k)
			return
		}
		g.reject(w, r, nil, tmhttp.Errorf(http.StatusNotFound, "no-route", "No route",
			"no route in the registry matches "+r.Method+" "+truncate(r.URL.Path, 80)), tenant, "")
		return
	}
	ke := snap.kinds[rt.kind]
	if ke == nil || ke.config() == nil {
		g.reject(w, r, nil, tmhttp.Errorf(http.StatusNotFound, "unknown-kind", "Unknown kind",
			"the route's kind "+rt.kind+" is not registered"), tenant, rt.kind)
		return
	}
	cfg := ke.config()
	km := ke.metrics
	if lim := ke.limiter.Load(); lim != nil {
		if ok, wait := lim.allow(tenant, start); !ok {
			g.reject(w, r, km, &tmhttp.Error{Status: http.StatusTooManyRequests, Type: "rate-limited", Title: "Too many requests",
				Detail: "the tenant is over its rate limit for kind " + rt.kind, RetryAfter: max(wait, time.Second)}, tenant, rt.kind)
			return
		}
	}
	entry, ok := ke.lookup(tenant)
	if !ok && cfg.Policy != schema.PolicyAffinity { // affinity: the policy assigns (affinity.go)
		if cfg.Unplaced == schema.UnplacedReject {
			g.reject(w, r, km, tmhttp.Errorf(http.StatusNotFound, "tenant-not-placed", "Tenant not placed",
				"the tenant has no placement for kind "+rt.kind+" and the kind does not assign new tenants"), tenant, rt.kind)
			return
		}
		var err error
		if entry, err = g.assign(r.Context(), snap, ke, tenant); err != nil {
			g.reject(w, r, km, err, tenant, rt.kind)
			return
		}
	}
	st := &reqState{ke: ke, rt: rt, tenant: tenant, method: r.Method, entry: entry, replayable: true, subject: subject}
	if err := g.readBody(w, r, st); err != nil {
		g.reject(w, r, km, err, tenant, rt.kind)
		return
	}
	if id := r.Header.Get(tmhttp.HeaderRequestID); !validRequestID(id) {
		st.reqID = newRequestID()
	}
	ctx, cancel := context.WithTimeout(r.Context(), requestTimeout(cfg))
	defer func() {
		cancel()
		km.code(st.code)
		km.duration.Observe(time.Since(start).Seconds())
	}()
	if !g.cfg.Lean || g.cfg.StdTransport || !leanable(r) {
		g.proxy.ServeHTTP(w, r.WithContext(context.WithValue(ctx, stateKey{}, st)))
		return
	}
	g.proxyLean(w, r, ctx, st)
}

// readBody buffers a body of up to MaxReplayBody bytes so the request can be retried or held;
// a larger one is streamed (and the request is not replayable).
func (g *Gateway) readBody(w http.ResponseWriter, r *http.Request, st *reqState) error {
	if r.Body == nil || r.Body == http.NoBody || r.ContentLength == 0 {
		return nil
	}
	tooLarge := &tmhttp.Error{Status: http.StatusRequestEntityTooLarge, Type: "body-too-large", Title: "Request body too large",
		Detail: "the request body is larger than the gateway accepts (" + strconv.FormatInt(g.cfg.MaxBodyBytes, 10) + " bytes)"}
	if g.cfg.MaxBodyBytes > 0 {
		if r.ContentLength > g.cfg.MaxBodyBytes {
			return tooLarge
		}
		r.Body = http.MaxBytesReader(w, r.Body, g.cfg.MaxBodyBytes)
	}
	limit := g.cfg.MaxReplayBody
	if r.ContentLength > limit {
		st.replayable = false
		return nil
	}
	n := r.ContentLength
	if n < 0 {
		n = 512
	}
	buf := bytes.NewBuffer(make([]byte, 0, n))
	if _, err := buf.ReadFrom(io.LimitReader(r.Body, limit+1)); err != nil {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			return tooLarge
		}
		return &tmhttp.Error{Status: http.StatusBadRequest, Type: "bad-body", Title: "Bad request body", Detail: "reading the request body failed", Err: err}
	}
	if int64(buf.Len()) > limit {
		// Unknown length and larger than the replay limit: stream what was read, then the rest.
		st.replayable = false
		r.Body = struct {
			io.Reader
			io.Closer
		}{io.MultiReader(bytes.NewReader(buf.Bytes()), r.Body), r.Body}
		return nil
	}
	st.body = buf.Bytes()
	r.Body = io.NopCloser(bytes.NewReader(st.body))
	r.ContentLength = int64(len(st.body))
	return nil
}

func validRequestID(id string) bool {
	if id == "" || len(id) > 128 {
		return false
	}
	for i := 0; i < len(id); i++ {
		if id[i] <= ' ' || id[i] > '~' {
			return false
		}
	}
	return true
}

func newRequestID() string {
	var b [16]byte
	const hex = "0123456789abcdef"
	v := rand.Uint64()
	for i := range b {
		b[i] = hex[v&15]
		v >>= 4
	}
	return string(b[:])
}

// rewrite prepares the outgoing request (ReverseProxy has removed hop-by-hop headers): it strips
// every x-tm-* header the client sent and sets x-forwarded-* and x-request-id. The upstream
// transport sets the URL and the epoch and shard headers per attempt.
func (g *Gateway) rewrite(pr *httputil.ProxyRequest) {
	h := pr.Out.Header
	for k := range h {
		if len(k) >= len(tmhttp.HeaderPrefixTM) && strings.EqualFold(k[:len(tmhttp.HeaderPrefixTM)], tmhttp.HeaderPrefixTM) {
			delete(h, k)
		}
	}
	pr.SetXForwarded()
	st := stateOf(pr.In.Context())
	if st.reqID != "" {
		h.Set(tmhttp.HeaderRequestID, st.reqID)
	}
	h.Set(tmhttp.HeaderKind, st.ke.name)
	if st.subject != nil {
		h[tmhttp.HeaderSubject] = st.subject
	}
	pr.Out.URL.Scheme = "http"
}

// upstream is the proxy's transport: it chooses the instance, sends, and retries.
type upstream struct{ g *Gateway }

func (u upstream) RoundTrip(req *http.Request) (*http.Response, error) { return u.g.roundTrip(req) }

func (g *Gateway) roundTrip(req *http.Request) (*http.Response, error) {
	return g.forward(req, stateOf(req.Context()))
}

// forward sends req for st: holds it during a handoff, picks the instance, retries.
func (g *Gateway) forward(req *http.Request, st *reqState) (*http.Response, error) {
	if st.ke.config().Policy == schema.PolicyAffinity {
		return g.forwardAffinity(req, st)
	}
	ctx := req.Context()
	var triedArr [4]*instance
	tried := triedArr[:0]
	var ticket *held
	defer func() {
		if ticket != nil {
			g.hold.done(st.ke, ticket)
		}
	}()
	path, rawPath := req.URL.Path, req.URL.RawPath
	var lastErr error
	for attempt := 0; attempt <= g.cfg.Retries; attempt++ {
		if ticket == nil && g.mustHold(st) {
			t, err := g.holdRequest(ctx, st)
			if err != nil {
				return nil, err
			}
			ticket = t
		}
		if attempt > 0 || ticket != nil {
			if nr := g.reg.snap.Load().match(st.method, path); nr != nil && nr.kind == st.rt.kind {
				st.rt = nr
			}
		}
		in := g.pickFor(st, tried)
		if in == nil {
			if lastErr != nil {
				return nil, lastErr
			}
			return nil, &tmhttp.Error{Status: http.StatusServiceUnavailable, Type: "no-live-instance", Title: "No live instance",
				Detail: "shard " + st.entry.Shard + " has no live instance serving this route (or all its circuits are open)", RetryAfter: time.Second}
		}
		g.prepare(req, st, in, path, rawPath)
		in.inflight.Add(1)
		in.requests.Add(1)
		t0 := time.Now()
		resp, err := g.send(req)
		in.inflight.Add(-1)
		if err != nil {
			if errors.Is(ctx.Err(), context.Canceled) {
				in.breaker.Abandon()
				return nil, err
			}
			in.failures.Add(1)
			in.breaker.Failure()
			lastErr = &upstreamError{inst: in.key, err: err}
			reason, ok := g.retryable(ctx, err, st)
			if !ok || attempt == g.cfg.Retries {
				return nil, lastErr
			}
			st.ke.metrics.retry(reason)
			tried = append(tried, in)
			continue
		}
		in.observe(time.Since(t0))
		in.breaker.Success()
		if refused := resp.Header.Get(tmhttp.HeaderRefused); refused != "" || resp.StatusCode == http.StatusMisdirectedRequest {
			// The shard's gate refused before its service saw the request (421, or 503 in a
			// handoff, while stopping, or behind on placement): sending it again is safe.
			status := resp.StatusCode
			prob := readProblem(resp)
			if !st.replayable || attempt == g.cfg.Retries {
				if status == http.StatusMisdirectedRequest {
					return nil, errMisdirected(st)
				}
				return nil, &tmhttp.Error{Status: status, Type: strings.TrimPrefix(prob.Type, tmhttp.TypeBase), Title: prob.Title,
					Detail: prob.Detail, RetryAfter: time.Duration(max(prob.RetryAfter, 1)) * time.Second}
			}
			if refused == "closing" {
				st.ke.metrics.retry("instance_stopping")
				tried = append(tried, in) // another instance of the same shard
				continue
			}
			st.ke.metrics.retry("misdirected")
			if err := g.refresh(ctx, st, prob); err != nil {
				return nil, err
			}
			tried = tried[:0]
			continue
		}
		st.inst = in
		st.code = resp.StatusCode
		resp.Header.Set(tmhttp.HeaderServedBy, in.key)
		if st.reqID != "" {
			resp.Header.Set(tmhttp.HeaderRequestID, st.reqID)
		}
		return resp, nil
	}
	if lastErr != nil {
		return nil, lastErr
	}
	return nil, errMisdirected(st)
}

// send makes one attempt with the gateway's HTTP/1.1 client, or net/http.Transport for upgrades.
func (g *Gateway) send(req *http.Request) (*http.Response, error) {
	if g.cfg.StdTransport || req.URL.Scheme == "https" {
		return g.transport.RoundTrip(req)
	}
	if _, up := req.Header["Upgrade"]; up {
		return g.transport.RoundTrip(req)
	}
	return g.h1.RoundTrip(req)
}

// prepare points req at in for the current placement.
func (g *Gateway) prepare(req *http.Request, st *reqState, in *instance, path, rawPath string) {
	u := in.url.Load()
	req.URL.Scheme, req.URL.Host = u.Scheme, u.Host
	if u.Path != "" && u.Path != "/" {
		req.URL.Path = strings.TrimSuffix(u.Path, "/") + path
		req.URL.RawPath = ""
	} else {
		req.URL.Path, req.URL.RawPath = path, rawPath
	}
	h := req.Header
	h.Set(tmhttp.HeaderEpoch, strconv.FormatUint(st.entry.Epoch, 10))
	h.Set(tmhttp.HeaderShard, st.entry.Shard)
	if st.body != nil {
		req.Body = io.NopCloser(bytes.NewReader(st.body))
		req.ContentLength = int64(len(st.body))
		req.GetBody = st.getBody
	}
}

// pick chooses among live instances by power of two choices on in-flight requests and latency,
// skipping tried instances and open circuits.
func pick(insts []*instance, tried []*instance) *instance {
	var candArr [16]*instance
	cand := candArr[:0]
	for _, in := range insts {
		if !contains(tried, in) && in.breaker.Available() {
			cand = append(cand, in)
		}
	}
	for len(cand) > 0 {
		var c *instance
		i := 0
		if len(cand) == 1 {
			c = cand[0]
		} else {
			i = rand.IntN(len(cand))
			j := rand.IntN(len(cand) - 1)
			if j >= i {
				j++
			}
			if cand[j].score() < cand[i].score() {
				i = j
			}
			c = cand[i]
		}
		if c.breaker.Allow() {
			return c
		}
		cand = append(cand[:i], cand[i+1:]...) // a probe is already out
	}
	return nil
}

func contains(l []*instance, in *instance) bool {
	for _, x := range l {
		if x == in {
			return true
		}
	}
	return false
}

// retryable says whether a failed attempt may be sent again to another instance, and why.
// A refused connection provably never reached the application, so any method may go again (if
// its body is buffered); other failures only for GET, HEAD and OPTIONS; a timeout never.
func (g *Gateway) retryable(ctx context.Context, err error, st *reqState) (string, bool) {
	if !st.replayable || ctx.Err() != nil || isTimeout(err) {
		return "", false
	}
	if isDialError(err) {
		return "unreachable", true
	}
	switch st.method {
	case http.MethodGet, http.MethodHead, http.MethodOptions:
		return "failed", true
	}
	return "", false
}

func (g *Gateway) mustHold(st *reqState) bool {
	if st.entry.Phase == schema.PhaseHandoff && !st.ke.config().Overlap {
		return true
	}
	return g.hold.queued(st.ke.name, st.tenant)
}

// holdRequest holds the request until the tenant's handoff ends, then refreshes its placement.
func (g *Gateway) holdRequest(ctx context.Context, st *reqState) (*held, error) {
	budget := st.ke.config().HoldBudget.D()
	t, err := g.hold.wait(ctx, st.ke, st.tenant, int64(len(st.body)), budget, func() bool {
		e, ok := st.ke.lookup(st.tenant)
		return ok && e.Phase == schema.PhaseHandoff
	})
	if err != nil {
		return nil, err
	}
	if e, ok := st.ke.lookup(st.tenant); ok {
		st.entry = e
	}
	return t, nil
}

// refresh finds the tenant's owner after a 421 or another gate refusal: the watcher's newer
// placement (a handoff there makes the next attempt wait in the hold buffer), else the owner the
// shard named if its epoch is newer, else it waits (bounded) for the watcher to catch up.
func (g *Gateway) refresh(ctx context.Context, st *reqState, prob tmhttp.Problem) error {
	old := st.entry
	newer := func() bool {
		e, ok := st.ke.lookup(st.tenant)
		if ok && (e.Epoch > old.Epoch || e.Shard != old.Shard || e.Phase != old.Phase) {
			st.entry = e
			return true
		}
		return false
	}
	if newer() {
		return nil
	}
	if prob.Owner != "" && prob.Epoch > old.Epoch && schema.CheckName("shard", prob.Owner) == nil {
		st.entry = placement.Entry{Shard: prob.Owner, Epoch: prob.Epoch, Phase: schema.PhaseActive}
		return nil
	}
	g.waiters.Add(1)
	defer g.waiters.Add(-1)
	timer := time.NewTimer(g.cfg.RefreshWait)
	defer timer.Stop()
	for {
		ch := *g.changed.Load()
		if newer() {
			return nil
		}
		select {
		case <-ch:
		case <-timer.C:
			return errMisdirected(st)
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// readProblem reads a 421's problem body (bounded) and closes it.
func readProblem(resp *http.Response) tmhttp.Problem {
	defer resp.Body.Close()
	var p tmhttp.Problem
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 16<<10))
	_ = json.Unmarshal(b, &p)
	return p
}

// bufferPool lends ReverseProxy 32 KiB copy buffers.
type bufferPool struct{}

var copyBufs = sync.Pool{New: func() any { b := make([]byte, 32<<10); return &b }}

func (bufferPool) Get() []byte  { return *(copyBufs.Get().(*[]byte)) }
func (bufferPool) Put(b []byte) { copyBufs.Put(&b) }

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}
