package shardkit

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tenantmesh/tenantmesh/shardkit/kvwatch"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// peerView keeps the kind's memberships (tm_members) in memory: forward mode proxies to live
// peers, and a move's target judges which source instances must report drained. It follows
// memberships, not the heartbeating directory, so what an instance receives does not grow with
// the fleet's heartbeats: a peer is live while its membership says online or degraded, and
// dead once the sweeper marks it offline (after Thresholds.OfflineAfter without a heartbeat)
// or it unregisters.
type peerView struct {
	s      *Shard
	f      *kvwatch.Follower
	synced chan struct{}
	once   sync.Once
	rr     atomic.Uint32

	mu    sync.RWMutex
	insts map[string]schema.Instance // by key
	// version grows with every applied entry; notify is closed and replaced on each.
	version uint64
	notify  chan struct{}
}

func newPeerView(s *Shard) *peerView {
	return &peerView{s: s, synced: make(chan struct{}), insts: map[string]schema.Instance{}, notify: make(chan struct{})}
}

func (p *peerView) start(ctx context.Context, wg *sync.WaitGroup) error {
	f, err := kvwatch.New(kvwatch.Config{
		JS:     p.s.st.JS().JetStream(),
		Bucket: schema.BucketMembers,
		Filter: p.s.kind + ".>",
		Logger: p.s.cfg.Logger.With("watch", schema.BucketMembers),
	}, p)
	if err != nil {
		return fmt.Errorf("shardkit: %w", err)
	}
	p.f = f
	wg.Go(func() { _ = f.Run(ctx) })
	return nil
}

func (p *peerView) waitReady(ctx context.Context) error {
	select {
	case <-p.synced:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("shardkit: waiting for the instance directory: %w", ctx.Err())
	}
}

// Apply implements kvwatch.Handler.
func (p *peerView) Apply(e kvwatch.Entry) {
	p.mu.Lock()
	defer p.mu.Unlock()
	defer func() {
		p.version++
		close(p.notify)
		p.notify = make(chan struct{})
	}()
	if e.Op != kvwatch.Put {
		delete(p.insts, e.Key)
		p.checkSelf(e.Key, schema.Instance{}, false)
		return
	}
	var inst schema.Instance
	if err := json.Unmarshal(e.Value, &inst); err != nil {
		p.s.cfg.Logger.Warn("skipping corrupt instance entry", "key", e.Key, "err", err)
		delete(p.insts, e.Key)
		return
	}
	inst.Revision = e.Revision
	p.insts[e.Key] = inst
	p.checkSelf(e.Key, inst, true)
}

// checkSelf asks for this instance's membership to be written again when the sweeper marked it
// offline or removed it while it lives (cut off from NATS for a while, say).
func (p *peerView) checkSelf(key string, inst schema.Instance, ok bool) {
	if key != p.s.self {
		return
	}
	if !ok || inst.Reported == schema.StatusOffline {
		p.s.memberStale.Store(true)
		p.s.routesStale.Store(true)
	}
}

// Synced implements kvwatch.Handler.
func (p *peerView) Synced() { p.once.Do(func() { close(p.synced) }) }

// instance returns the directory's entry for key, and a channel closed at the next change.
func (p *peerView) instance(key string) (schema.Instance, bool, <-chan struct{}) {
	p.mu.RLock()
	defer p.mu.RUnlock()
	inst, ok := p.insts[key]
	return inst, ok, p.notify
}

// live returns the live instances of shard other than this one, rotated round-robin.
func (p *peerView) live(shard string) []schema.Instance {
	p.mu.RLock()
	var out []schema.Instance
	for k, inst := range p.insts {
		if inst.Shard == shard && k != p.s.self && memberStatus(inst).Live() {
			out = append(out, inst)
		}
	}
	p.mu.RUnlock()
	if len(out) > 1 {
		// map order is random; sort for a fair rotation
		sortInstances(out)
		n := int(p.rr.Add(1)) % len(out)
		out = append(out[n:], out[:n]...)
	}
	return out
}

// liveNames returns the instance names of shard's live instances (this one included), and a
// channel closed at the next directory change.
func (p *peerView) liveNames(shard string) ([]string, <-chan struct{}) {
	p.mu.RLock()
	defer p.mu.RUnlock()
	var out []string
	for _, inst := range p.insts {
		if inst.Shard == shard && memberStatus(inst).Live() {
			out = append(out, inst.Instance)
		}
	}
	return out, p.notify
}

func sortInstances(xs []schema.Instance) {
	for i := 1; i < len(xs); i++ {
		for j := i; j > 0 && xs[j].Key() < xs[j-1].Key(); j-- {
			xs[j], xs[j-1] = xs[j-1], xs[j]
		}
	}
}

// memberStatus is the status a membership entry says: memberships carry no heartbeats to age.
func memberStatus(i schema.Instance) schema.Status {
	if i.Reported == "" {
		return schema.StatusOnline
	}
	return i.Reported
}

// PeerStatus is the status of another instance of this kind as this instance sees it: what its
// membership entry says (the sweeper marks it offline when its heartbeats stop). ok is false
// when there is no entry for it.
func (s *Shard) PeerStatus(id schema.InstanceID) (st schema.Status, ok bool) {
	inst, ok, _ := s.peers.instance(id.Key())
	if !ok {
		return "", false
	}
	return memberStatus(inst), true
}

// forwardPlan travels in a forwarded request's context to the proxy's transport.
type forwardPlan struct {
	targets []*url.URL
	body    []byte // buffered body; nil when there is none or it was too big to buffer
	retry   bool   // retrying is allowed at all (body buffered or empty)
	tenant  string
	// fallback is the local handler to serve with when every attempt failed safely
	// (ForwardFallback); nil when falling back is not allowed. in is the request as it came.
	fallback http.Handler
	in       *http.Request
	// exhausted is set by the transport when every target was tried and each failure was
	// safe to repeat.
	exhausted bool
	// refused is the gate's refusal mark, taken off the answer while the request is forwarded:
	// the owner's answer is not a refusal, and a gateway that read one would send it again.
	// It goes back on only if no attempt reached an instance (reached unset).
	refused []string
	reached bool
}

type planKey struct{}

// forwarder sends a request this shard does not own to the owner's instance (forward mode).
type forwarder struct{ s *Shard }

// forward proxies r to a live instance of shard, trying others when the request provably never
// reached one (or, for idempotent methods, failed before an answer). With ForwardFallback, next
// (nil: never) serves the request here when that fails (see serveFallback).
func (fw *forwarder) forward(next http.Handler, w http.ResponseWriter, r *http.Request, tenant, shard string) {
	next = fw.fallbackHandler(next)
	if fb := r.Header.Values(tmhttp.HeaderForwardedBy); len(fb) > 0 {
		fw.s.metrics.forwards.WithLabelValues("loop").Inc()
		if forwardedBy(fb, fw.s.self) {
			tmhttp.WriteProblem(w, r, fw.s.problem(http.StatusLoopDetected, "forward-loop", "Forwarding loop", tenant,
				"the request was already forwarded by this instance ("+fw.s.self+")"))
			return
		}
		p := fw.s.problem(http.StatusMisdirectedRequest, "not-owner", "Not the owner", tenant,
			"the request was forwarded here by "+strings.Join(fb, ",")+" but shard "+shard+" owns the tenant; forwarded requests are not forwarded again")
		p.Owner = shard
		tmhttp.WriteProblem(w, r, p)
		return
	}
	peers := fw.s.peers.live(shard)
	if len(peers) == 0 && next != nil {
		fw.serveFallback(next, w, r)
		return
	}
	if len(peers) == 0 {
		fw.s.metrics.forwards.WithLabelValues("no_instance").Inc()
		p := fw.s.problem(http.StatusServiceUnavailable, "no-live-instance", "No live instance", tenant,
			"no live instance of shard "+shard+" to forward to")
		p.Owner, p.RetryAfter = shard, 1
		tmhttp.WriteProblem(w, r, p)
		return
	}
	plan := &forwardPlan{tenant: tenant, retry: true}
	for _, inst := range peers {
		if u, err := url.Parse(inst.URL); err == nil {
			plan.targets = append(plan.targets, u)
		}
	}
	if n := 1 + fw.s.cfg.ForwardRetries; len(plan.targets) > n {
		plan.targets = plan.targets[:n]
	}
	// With a fallback, the Queen coordinator's order: the preferred instance, the next (the same
	// one again when it is the only one), then the local handler.
	switch {
	case next != nil && len(plan.targets) > 2:
		plan.targets = plan.targets[:2]
	case next != nil && len(plan.targets) == 1:
		plan.targets = append(plan.targets, plan.targets[0])
	}
	if r.Body != nil && r.Body != http.NoBody {
		buf, err := io.ReadAll(io.LimitReader(r.Body, fw.s.cfg.MaxForwardBody+1))
		if err != nil {
			tmhttp.WriteProblem(w, r, fw.s.problem(http.StatusBadRequest, "bad-body", "Unreadable body", tenant, "reading the request body failed"))
			return
		}
		if int64(len(buf)) > fw.s.cfg.MaxForwardBody {
			plan.retry = false
			r.Body = struct {
				io.Reader
				io.Closer
			}{io.MultiReader(bytes.NewReader(buf), r.Body), r.Body}
		} else {
			plan.body = buf
			r.Body = io.NopCloser(bytes.NewReader(buf))
		}
	}
	if next != nil && plan.retry {
		plan.fallback, plan.in = next, r
	}
	plan.refused = w.Header()[tmhttp.HeaderRefused]
	delete(w.Header(), tmhttp.HeaderRefused)
	ctx, cancel := context.WithTimeout(r.Context(), fw.forwardTimeout())
	defer cancel()
	fw.s.proxy.ServeHTTP(w, r.WithContext(context.WithValue(ctx, planKey{}, plan)))
}

func forwardedBy(values []string, self string) bool {
	for _, v := range values {
		for part := range strings.SplitSeq(v, ",") {
			if strings.TrimSpace(part) == self {
				return true
			}
		}
	}
	return false
}

// newProxy builds the forward-mode reverse proxy.
func (fw *forwarder) newProxy() http.Handler {
	return &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			plan := pr.In.Context().Value(planKey{}).(*forwardPlan)
			pr.SetURL(plan.targets[0])
			pr.Out.Host = pr.In.Host
			pr.SetXForwarded()
			pr.Out.Header.Set(tmhttp.HeaderForwardedBy, fw.s.self)
		},
		Transport: &retryTransport{base: fw.s.cfg.Transport, s: fw.s},
		ModifyResponse: func(resp *http.Response) error {
			resp.Header.Set(tmhttp.HeaderForwardedBy, fw.s.self)
			fw.s.metrics.forwards.WithLabelValues("ok").Inc()
			return nil
		},
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			plan, _ := r.Context().Value(planKey{}).(*forwardPlan)
			if plan != nil && plan.exhausted && plan.fallback != nil && r.Context().Err() == nil {
				fw.s.cfg.Logger.Warn("forward failed; serving here", "tenant", plan.tenant, "err", err)
				in := plan.in
				if plan.body != nil {
					in.Body = io.NopCloser(bytes.NewReader(plan.body))
				}
				fw.serveFallback(plan.fallback, w, in)
				return
			}
			tenant := ""
			if plan != nil {
				tenant = plan.tenant
			}
			status, typ, title := http.StatusBadGateway, "upstream-failed", "Forward failed"
			if errors.Is(err, context.DeadlineExceeded) {
				status, typ, title = http.StatusGatewayTimeout, "upstream-timeout", "Forward timed out"
			}
			fw.s.metrics.forwards.WithLabelValues(typ).Inc()
			fw.s.cfg.Logger.Warn("forward failed", "tenant", tenant, "err", err)
			if plan != nil && !plan.reached && plan.refused != nil {
				w.Header()[tmhttp.HeaderRefused] = plan.refused // no instance saw it: safe to send again
			}
			tmhttp.WriteProblem(w, r, fw.s.problem(status, typ, title, tenant, "forwarding to the owner failed: "+err.Error()))
		},
	}
}

// retryTransport sends a forwarded request to the plan's targets in turn, moving on only when
// that is safe: the connection was never made, or the method is idempotent and the body is
// buffered.
type retryTransport struct {
	base http.RoundTripper
	s    *Shard
}

func (t *retryTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	plan, _ := req.Context().Value(planKey{}).(*forwardPlan)
	if plan == nil {
		return t.base.RoundTrip(req)
	}
	var errs []error
	for i, target := range plan.targets {
		out := req
		if i > 0 {
			out = req.Clone(req.Context())
			out.URL.Scheme, out.URL.Host = target.Scheme, target.Host
			out.Host = req.Host
			if plan.body != nil {
				out.Body = io.NopCloser(bytes.NewReader(plan.body))
			}
		}
		resp, err := t.base.RoundTrip(out)
		if err == nil {
			return resp, nil
		}
		if !isDial(err) {
			plan.reached = true // it may have: the connection was made
		}
		errs = append(errs, fmt.Errorf("%s: %w", target.Host, err))
		if !plan.retry || !retriable(req, err) || req.Context().Err() != nil {
			break
		}
		if i == len(plan.targets)-1 {
			plan.exhausted = true
			break
		}
		t.s.metrics.forwards.WithLabelValues("retry").Inc()
	}
	return nil, errors.Join(errs...)
}

// retriable reports whether a failed attempt may be repeated on another instance.
func retriable(req *http.Request, err error) bool {
	if isDial(err) {
		return true // the request never left
	}
	switch req.Method {
	case http.MethodGet, http.MethodHead, http.MethodOptions:
		return !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, context.Canceled)
	}
	return false
}

// isDial reports whether err is a failure to make the connection: the request never left.
func isDial(err error) bool {
	var op *net.OpError
	return errors.As(err, &op) && op.Op == "dial"
}

// Forward timeouts when neither the Config nor the kind's load config names them: the Queen
// coordinator's (a 1 s connect, 5 s for the whole forward).
const (
	defaultForwardTimeout = 5 * time.Second
	defaultConnectTimeout = time.Second
)

// forwardTimeout bounds a forwarded request: Config.ForwardTimeout, else the kind's
// forward_timeout, else 5s. The kind's config is read per request, so a change applies at the
// instance's next reload.
func (fw *forwarder) forwardTimeout() time.Duration {
	if d := fw.s.cfg.ForwardTimeout; d > 0 {
		return d
	}
	if kc := fw.s.kindCfg.Load(); kc != nil && kc.Load != nil && kc.Load.ForwardTimeout > 0 {
		return kc.Load.ForwardTimeout.D()
	}
	return defaultForwardTimeout
}

// connectTimeout bounds dialing a peer: Config.ConnectTimeout, else the kind's connect_timeout,
// else 1s.
func (fw *forwarder) connectTimeout() time.Duration {
	if d := fw.s.cfg.ConnectTimeout; d > 0 {
		return d
	}
	if kc := fw.s.kindCfg.Load(); kc != nil && kc.Load != nil && kc.Load.ConnectTimeout > 0 {
		return kc.Load.ConnectTimeout.D()
	}
	return defaultConnectTimeout
}

// defaultTransport carries forwards when Config.Transport is nil: every dial bounded by the
// connect timeout as it is when the dial starts, and straight to the peer (as the gateway
// dials instances): a process's HTTP_PROXY is for its way out, not to its own shard's peers.
func (fw *forwarder) defaultTransport() http.RoundTripper {
	t := http.DefaultTransport.(*http.Transport).Clone()
	t.Proxy = nil
	t.DialContext = func(ctx context.Context, network, addr string) (net.Conn, error) {
		d := net.Dialer{Timeout: fw.connectTimeout(), KeepAlive: 30 * time.Second}
		return d.DialContext(ctx, network, addr)
	}
	t.MaxIdleConnsPerHost = 64
	t.ResponseHeaderTimeout = 30 * time.Second
	return t
}
