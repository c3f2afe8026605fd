package shardkit

import (
	"context"
	"net/http"
	"slices"
	"strconv"
	"sync"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/tenantmesh/tenantmesh/internal/tracing"
	"github.com/tenantmesh/tenantmesh/shardkit/placement"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// verdict is the gate's judgement of one request.
type verdict uint8

const (
	serve      verdict = iota
	notOwner           // another shard owns the tenant: 421 naming it, or forward
	unplaced           // nobody owns it: 421 without an owner
	inHandoff          // the tenant is being handed off: 503 Retry-After
	behind             // the request's epoch is newer than what this instance learned: 503
	staleEpoch         // the request's epoch is older than the owner's: 421 naming the owner
	draining           // the tenant is draining here: 421 to the new owner, else 503
	closing            // the instance is shutting down: 503 (forward mode: to a sibling)
)

var refuseReasons = [...]string{
	notOwner: "not_owner", unplaced: "unplaced", inHandoff: "handoff", behind: "behind",
	staleEpoch: "stale_epoch", draining: "draining", closing: "closing",
}

// refusedValues are the X-Tm-Refused header values, allocated once.
var refusedValues = func() (out [len(refuseReasons)][]string) {
	for i, r := range refuseReasons {
		out[i] = []string{r}
	}
	return out
}()

// Tenant returns the request's tenant id (the x-tenant-id header). Behind the gate it is valid
// and owned by this shard.
func Tenant(r *http.Request) string { return r.Header.Get(tmhttp.HeaderTenant) }

// Tenant is the package-level Tenant, as a method for convenience.
func (s *Shard) Tenant(r *http.Request) string { return Tenant(r) }

// Epoch returns the placement epoch at which this shard serves tenant (0 if it does not).
// Behind the gate it is the epoch the request was admitted at, unless a move committed since.
func (s *Shard) Epoch(tenant string) uint64 {
	e, ok := s.watcher.Lookup(s.kind, tenant)
	if !ok || !s.gk.owns(e) {
		return 0
	}
	return e.Epoch
}

// Gate is the middleware that serves a request only if this shard owns its tenant at the
// request's epoch (x-tm-epoch; without one, at the local snapshot's). Otherwise it answers 421
// naming the owner, or in forward mode proxies to the owner's live instances. Mount it on the
// tenant routes only; Mount's admin and health routes must stay outside it.
func (s *Shard) Gate(next http.Handler) http.Handler {
	if tracing.On() { // set up before the shard is built (shardmain): off, the gate pays nothing
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { s.gk.tracedGate(next, w, r) })
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { s.gk.serveGate(next, w, r) })
}

// gatekeeper is the Gate's work: admit a request for a tenant this shard owns at the epoch the
// gateway routed it by, wait a moment for a placement change in flight, refuse or forward
// the rest.
type gatekeeper struct{ s *Shard }

// tracedGate is serveGate in a span, shardkit.gate, the parent of the service's own spans.
func (g *gatekeeper) tracedGate(next http.Handler, w http.ResponseWriter, r *http.Request) {
	ctx, span := tracer.Start(r.Context(), "shardkit.gate", trace.WithAttributes(
		attribute.String("tm.tenant", r.Header.Get(tmhttp.HeaderTenant)), attribute.String("tm.instance", g.s.cfg.ID.Key())))
	defer span.End()
	g.serveGate(next, w, r.WithContext(ctx))
}

// tracer makes shardkit's spans.
var tracer = tracing.NewTracer("github.com/tenantmesh/tenantmesh/shardkit")

func (g *gatekeeper) serveGate(next http.Handler, w http.ResponseWriter, r *http.Request) {
	if !g.fromGateway(w, r) { // gateauth.go
		return
	}
	tenant := r.Header.Get(tmhttp.HeaderTenant)
	if !schema.ValidTenant(tenant) {
		tmhttp.WriteError(w, r, schema.CheckTenant(tenant), tenant, g.s.kind)
		return
	}
	var want uint64
	if h := r.Header.Get(tmhttp.HeaderEpoch); h != "" {
		n, err := strconv.ParseUint(h, 10, 64)
		if err != nil || n == 0 {
			tmhttp.WriteProblem(w, r, g.s.problem(http.StatusBadRequest, "invalid-epoch", "Invalid epoch", tenant,
				"x-tm-epoch must be a positive integer"))
			return
		}
		want = n
	}
	e, ok := g.s.watcher.Lookup(g.s.kind, tenant)
	if want > 0 && (!ok || e.Epoch < want) {
		e, ok = g.awaitEpoch(r.Context(), tenant, want)
	}
	v := g.judge(e, ok, want)
	if v != serve {
		g.refuse(next, w, r, tenant, v, e)
		return
	}
	g.s.inflight.Add(1)
	defer g.releaseInstance()
	if g.s.closing.Load() {
		g.refuse(next, w, r, tenant, closing, e)
		return
	}
	ts := g.s.states.getOrCreate(tenant)
	for {
		ok, dead := ts.acquire()
		if ok {
			break
		}
		if !dead {
			g.refuse(next, w, r, tenant, draining, e)
			return
		}
		ts = g.s.states.getOrCreate(tenant)
	}
	defer ts.release()
	g.serveOwned(next, w, r, ts)
}

// serveOwned runs next, counting the answer.
func (g *gatekeeper) serveOwned(next http.Handler, w http.ResponseWriter, r *http.Request, ts *tenantState) {
	start := time.Now()
	w.Header()[tmhttp.HeaderServedBy] = g.s.servedBy
	sw := writerPool.Get().(*statusWriter)
	sw.ResponseWriter, sw.status = w, 0
	defer func() {
		status := sw.status
		if status == 0 {
			status = http.StatusOK
		}
		sw.ResponseWriter = nil
		writerPool.Put(sw)
		ts.requests.Add(1)
		if status >= 500 {
			ts.errors.Add(1)
		}
		ts.labels.Load().requests[classIndex(status)].Inc()
		d := time.Since(start)
		ts.latency.Add(uint64(d))
		g.s.metrics.latency.Observe(d.Seconds())
	}()
	next.ServeHTTP(sw, r)
}

func (g *gatekeeper) releaseInstance() {
	if g.s.inflight.Add(-1) == 0 && g.s.closing.Load() {
		select {
		case g.s.idle <- struct{}{}:
		default:
		}
	}
}

// owns reports whether this shard serves e's tenant now.
func (g *gatekeeper) owns(e placement.Entry) bool {
	switch e.Phase {
	case schema.PhaseActive, schema.PhaseWarming, schema.PhaseDraining:
		return e.Shard == g.s.cfg.ID.Shard || g.inOwners(e.Owners)
	}
	return false
}

// inOwners reports whether an affinity owner list names this instance (by key or by name).
func (g *gatekeeper) inOwners(owners []string) bool {
	return len(owners) > 0 && (slices.Contains(owners, g.s.self) || slices.Contains(owners, g.s.cfg.ID.Instance))
}

// judge decides whether to serve a request for a tenant placed at e (ok: placed at all) that
// carries epoch want (0: none).
func (g *gatekeeper) judge(e placement.Entry, ok bool, want uint64) verdict {
	switch {
	case !ok:
		return unplaced
	case want > e.Epoch:
		return behind
	case e.Phase == schema.PhaseHandoff:
		return inHandoff
	case !g.owns(e):
		return notOwner
	case want != 0 && want < e.Epoch:
		return staleEpoch
	}
	return serve
}

// awaitEpoch waits, up to EpochWait, for the local snapshot to reach epoch want for tenant.
func (g *gatekeeper) awaitEpoch(ctx context.Context, tenant string, want uint64) (placement.Entry, bool) {
	t := time.NewTimer(g.s.cfg.EpochWait)
	defer t.Stop()
	for {
		ch := g.s.changes()
		e, ok := g.s.watcher.Lookup(g.s.kind, tenant)
		if ok && e.Epoch >= want {
			return e, ok
		}
		select {
		case <-ch:
		case <-t.C:
			return g.s.watcher.Lookup(g.s.kind, tenant)
		case <-ctx.Done():
			return g.s.watcher.Lookup(g.s.kind, tenant)
		}
	}
}

// refuse answers a request the gate does not serve here: a problem, or a forward (which may
// fall back to next).
func (g *gatekeeper) refuse(next http.Handler, w http.ResponseWriter, r *http.Request, tenant string, v verdict, e placement.Entry) {
	g.s.metrics.refused.WithLabelValues(refuseReasons[v]).Inc()
	w.Header()[tmhttp.HeaderRefused] = refusedValues[v]
	if tracing.On() {
		trace.SpanFromContext(r.Context()).SetAttributes(attribute.String("tm.refused", refuseReasons[v]))
	}
	owner := e.Shard
	if v == draining && (e.Shard == g.s.cfg.ID.Shard || e.Phase == schema.PhaseHandoff) {
		owner = ""
	}
	switch v {
	case notOwner, staleEpoch, draining:
		if owner == "" {
			break
		}
		if g.s.cfg.Forward {
			g.s.fwd.forward(next, w, r, tenant, owner)
			return
		}
		p := g.s.problem(http.StatusMisdirectedRequest, "not-owner", "Not the owner", tenant,
			"shard "+g.s.cfg.ID.Shard+" does not serve this tenant; its owner is "+owner+" at epoch "+strconv.FormatUint(e.Epoch, 10))
		p.Owner, p.Epoch = owner, e.Epoch
		tmhttp.WriteProblem(w, r, p)
		return
	case unplaced:
		tmhttp.WriteProblem(w, r, g.s.problem(http.StatusMisdirectedRequest, "not-owner", "Not the owner", tenant,
			"the tenant has no placement for kind "+g.s.kind))
		return
	case closing:
		if g.s.cfg.Forward {
			g.s.fwd.forward(nil, w, r, tenant, g.s.cfg.ID.Shard)
			return
		}
		p := g.s.problem(http.StatusServiceUnavailable, "instance-draining", "Instance shutting down", tenant,
			"instance "+g.s.self+" is shutting down; retry on another instance")
		p.RetryAfter = 1
		tmhttp.WriteProblem(w, r, p)
		return
	case inHandoff:
		p := g.s.problem(http.StatusServiceUnavailable, "handoff", "Tenant in handoff", tenant,
			"the tenant is moving from "+e.Shard+" to "+e.Target+"; retry shortly")
		p.Owner, p.Epoch, p.RetryAfter = e.Target, e.Epoch+1, 1
		tmhttp.WriteProblem(w, r, p)
		return
	case behind:
		p := g.s.problem(http.StatusServiceUnavailable, "placement-behind", "Placement not caught up", tenant,
			"this instance has not yet seen the request's epoch; retry shortly")
		p.RetryAfter = 1
		tmhttp.WriteProblem(w, r, p)
		return
	}
	p := g.s.problem(http.StatusServiceUnavailable, "tenant-draining", "Tenant draining", tenant,
		"the tenant is draining on "+g.s.self+"; retry shortly")
	p.RetryAfter = 1
	tmhttp.WriteProblem(w, r, p)
}

// statusWriter records the status the service answers. Pooled: the gate allocates nothing.
type statusWriter struct {
	http.ResponseWriter
	status int
}

var writerPool = sync.Pool{New: func() any { return new(statusWriter) }}

func (sw *statusWriter) WriteHeader(code int) {
	if sw.status == 0 && code >= 200 {
		sw.status = code
	}
	sw.ResponseWriter.WriteHeader(code)
}

func (sw *statusWriter) Write(b []byte) (int, error) {
	if sw.status == 0 {
		sw.status = http.StatusOK
	}
	return sw.ResponseWriter.Write(b)
}

// Flush passes through to the underlying writer when it can flush.
func (sw *statusWriter) Flush() {
	if f, ok := sw.ResponseWriter.(http.Flusher); ok {
		if sw.status == 0 {
			sw.status = http.StatusOK
		}
		f.Flush()
	}
}

// Unwrap lets http.ResponseController reach the underlying writer.
func (sw *statusWriter) Unwrap() http.ResponseWriter { return sw.ResponseWriter }
