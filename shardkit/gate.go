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
	serve       verdict = iota
	notOwner            // another shard owns the tenant: 421 naming it, or forward
	unplaced            // nobody owns it: 421 without an owner
	inHandoff           // the tenant is being handed off: 503 Retry-After
	behind              // the request's epoch is newer than what this instance learned: 503
	staleEpoch          // the request's epoch is older than the owner's: 421 naming the owner
	draining            // the tenant is draining here: 421 to the new owner, else 503
	closing             // the instance is shutting down: 503 (forward mode: to a sibling)
	unconfirmed         // the instance's lease ran out (it cannot confirm its placement view): 503
)

var refuseReasons = [...]string{
	notOwner: "not_owner", unplaced: "unplaced", inHandoff: "handoff", behind: "behind",
	staleEpoch: "stale_epoch", draining: "draining", closing: "closing", unconfirmed: "unconfirmed",
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
	changes := g.s.view.Changes()
	e, ok := g.s.view.Lookup(tenant)
	if want > 0 && (!ok || e.Epoch < want) {
		changes = g.s.view.Changes()
		e, ok = g.awaitEpoch(r.Context(), tenant, want)
	}
	v := g.judge(e, ok, want)
	now := time.Now()
	if v == serve && !g.s.leaseHoldsAt(now) {
		v = unconfirmed
	}
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
	if tmhttp.IsGRPC(r) {
		r = withCall(r, ts)
	}
	g.serveOwned(next, w, r, ts, e.Epoch, changes, now)
}

// serveOwned runs next, counting the answer. The answer leaves only if the instance may still
// answer for the tenant when it begins (answerable): a request admitted just before the
// process froze, or before a takeover, gets a 503 instead of an answer from stale state.
// changes is the view's count of changes before the placement the request was admitted on was
// read; start is when it was admitted.
func (g *gatekeeper) serveOwned(next http.Handler, w http.ResponseWriter, r *http.Request, ts *tenantState, epoch, changes uint64, start time.Time) {
	w.Header()[tmhttp.HeaderServedBy] = g.s.servedBy
	sw := writerPool.Get().(*statusWriter)
	*sw = statusWriter{ResponseWriter: w, g: g, r: r, tenant: ts.tenant, epoch: epoch, changes: changes}
	defer func() {
		status := sw.status
		if status == 0 {
			status = http.StatusOK
		}
		*sw = statusWriter{}
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

// answerable reports whether an answer for tenant, admitted at epoch, may still leave the
// instance: its lease holds, and the placement still gives the tenant to this shard at that
// epoch (or this shard is the source of its handoff, whose drain waits for the answer). Under
// the affinity policy the owner set may change while a request runs: only the lease counts.
func (g *gatekeeper) answerable(tenant string, epoch, changes uint64) bool {
	if !g.s.leaseHolds() {
		return false
	}
	if kc := g.s.kindCfg.Load(); kc != nil && kc.Policy == schema.PolicyAffinity {
		return true
	}
	if g.s.view.Changes() == changes {
		return true // no placement changed since the one the request was admitted on
	}
	e, ok := g.s.view.Lookup(tenant)
	if !ok || e.Epoch != epoch {
		return false
	}
	return g.owns(e) || (e.Phase == schema.PhaseHandoff && e.Shard == g.s.cfg.ID.Shard)
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
	case e.Phase.Moving():
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
	if v == draining && (e.Shard == g.s.cfg.ID.Shard || e.Phase.Moving()) {
		owner = ""
	}
	switch v {
	case notOwner, staleEpoch, draining:
		if owner == "" {
			break
		}
		if g.s.cfg.Forward && !tmhttp.IsGRPC(r) { // gRPC callers are told the owner (x-tm-owner)
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
	case closing, unconfirmed:
		if g.s.cfg.Forward && !tmhttp.IsGRPC(r) {
			g.s.fwd.forward(nil, w, r, tenant, g.s.cfg.ID.Shard)
			return
		}
		g.writeUnavailable(w, r, tenant, v)
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

// writeUnavailable answers 503 for an instance that cannot serve now (shutting down, or its
// lease ran out): the gateway sends the request to another instance.
func (g *gatekeeper) writeUnavailable(w http.ResponseWriter, r *http.Request, tenant string, v verdict) {
	var p tmhttp.Problem
	if v == closing {
		p = g.s.problem(http.StatusServiceUnavailable, "instance-draining", "Instance shutting down", tenant,
			"instance "+g.s.self+" is shutting down; retry on another instance")
	} else {
		p = g.s.problem(http.StatusServiceUnavailable, "lease-expired", "Placement view not confirmed", tenant,
			"instance "+g.s.self+" could not confirm its view of placement with NATS within its lease, so it serves no tenant; retry on another instance")
	}
	p.RetryAfter = 1
	tmhttp.WriteProblem(w, r, p)
}

// statusWriter records the status the service answers, and checks before the answer begins
// that it may leave (gatekeeper.answerable). Pooled: the gate allocates nothing.
type statusWriter struct {
	http.ResponseWriter
	status  int
	g       *gatekeeper
	r       *http.Request
	tenant  string
	epoch   uint64
	changes uint64 // the placement view's change count at admission (answerable)
	// checked: the answer began (and was judged); dropped: it was refused, the service's
	// writes go nowhere.
	checked, dropped bool
	// scratch takes the service's header writes once dropped (a gRPC service sets its status
	// in trailers after the answer began; they must not follow the withheld answer's status).
	scratch http.Header
}

// Header is the answer's header map; once the answer is withheld, one that goes nowhere.
func (sw *statusWriter) Header() http.Header {
	if sw.dropped {
		if sw.scratch == nil {
			sw.scratch = http.Header{}
		}
		return sw.scratch
	}
	return sw.ResponseWriter.Header()
}

var writerPool = sync.Pool{New: func() any { return new(statusWriter) }}

// begin judges the answer once, when it begins. A withheld answer is replaced by a 503, and
// what the service writes after goes nowhere. It carries no X-Tm-Refused: the service saw the
// request, and whatever it did stays done (an append that passed the store's fence happened
// before the takeover's marker, so the new owner has it), so only the client may send it
// again, with its Idempotency-Key to learn the outcome.
func (sw *statusWriter) begin() {
	if sw.checked {
		return
	}
	sw.checked = true
	if sw.g.answerable(sw.tenant, sw.epoch, sw.changes) {
		return
	}
	sw.dropped = true
	sw.status = http.StatusServiceUnavailable
	h := sw.ResponseWriter.Header()
	clear(h)
	h[tmhttp.HeaderServedBy] = sw.g.s.servedBy
	sw.g.s.metrics.refused.WithLabelValues("answer_withheld").Inc()
	p := sw.g.s.problem(http.StatusServiceUnavailable, "answer-withheld", "Answer withheld", sw.tenant,
		"the tenant moved, or this instance lost its lease, while the request ran, so its answer may be stale; "+
			"what the request did is kept: send it again (with the same Idempotency-Key) to get the answer from the owner")
	p.RetryAfter = 1
	tmhttp.WriteProblem(sw.ResponseWriter, sw.r, p)
}

func (sw *statusWriter) WriteHeader(code int) {
	if code >= 200 {
		sw.begin()
	}
	if sw.dropped {
		return
	}
	if sw.status == 0 && code >= 200 {
		sw.status = code
	}
	sw.ResponseWriter.WriteHeader(code)
}

func (sw *statusWriter) Write(b []byte) (int, error) {
	sw.begin()
	if sw.dropped {
		return len(b), nil
	}
	if sw.status == 0 {
		sw.status = http.StatusOK
	}
	return sw.ResponseWriter.Write(b)
}

// Flush passes through to the underlying writer when it can flush.
func (sw *statusWriter) Flush() {
	if f, ok := sw.ResponseWriter.(http.Flusher); ok {
		sw.begin()
		if sw.dropped {
			return
		}
		if sw.status == 0 {
			sw.status = http.StatusOK
		}
		f.Flush()
	}
}

// Unwrap lets http.ResponseController reach the underlying writer.
func (sw *statusWriter) Unwrap() http.ResponseWriter { return sw.ResponseWriter }
