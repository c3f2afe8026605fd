package shardkit

import (
	"context"
	"errors"
	"net/http"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/tenantmesh/tenantmesh/internal/backoff"
	"github.com/tenantmesh/tenantmesh/internal/promreg"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// Move verification. When the service has a Digest hook, shardkit wraps its hooks so that
// every instance of a move's source and target records a digest of the tenant's state at the
// handoff's fence in tm_verify (the target's inside the handoff, before its commit; the
// source's just after its fence, outside the pause), and, for a kind whose config says
// verify, the source releases the tenant (its Release hook: its cleanup) only once the
// target's digests equal its own. A mismatch holds the source's copy of the tenant until an
// operator releases it (POST /admin/verify/release), and is counted in
// tm_shard_verify_mismatches_total.
type verifier struct {
	s *Shard

	mu      sync.Mutex
	pending map[string]*sourceDigest // tenant -> the digest this source made at its last handoff
	held    map[string]HeldTenant    // tenants whose release a mismatch holds

	made       *prometheus.CounterVec
	took       *prometheus.HistogramVec
	mismatches prometheus.Counter

	release func(ctx context.Context, tenant string) error // the service's own Release hook
}

// sourceDigest is a source's digest at a handoff: done is closed once rec is made.
type sourceDigest struct {
	epoch, fence uint64
	done         chan struct{}
	rec          schema.DigestRecord
}

// HeldTenant is a tenant whose release a verification mismatch holds on this instance.
type HeldTenant struct {
	Tenant string `json:"tenant"`
	// Epoch is the move's handoff epoch; Target the shard the tenant moved to.
	Epoch  uint64    `json:"epoch"`
	Target string    `json:"target"`
	Detail string    `json:"detail"`
	Since  time.Time `json:"since"`
}

func newVerifier(s *Shard) *verifier {
	v := &verifier{s: s, pending: map[string]*sourceDigest{}, held: map[string]HeldTenant{}}
	reg := s.cfg.Registerer
	v.made = promreg.Register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tm_shard_verify_digests_total",
		Help: "State digests made at a move's fence for move verification, by role (source, target) and result (ok, failed).",
	}, []string{"role", "result"}))
	v.took = promreg.Register(reg, prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "tm_shard_verify_digest_seconds",
		Help:    "Time the service's Digest hook took at a move's fence, by role (a target's is inside the handoff pause).",
		Buckets: prometheus.ExponentialBuckets(0.00001, 4, 10),
	}, []string{"role"}))
	v.mismatches = promreg.Register(reg, prometheus.NewCounter(prometheus.CounterOpts{
		Name: "tm_shard_verify_mismatches_total",
		Help: "Moves from this instance whose target's state digest at the fence differed from this instance's: the tenant's release is held.",
	}))
	promreg.Register(reg, prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "tm_shard_verify_held_tenants",
		Help: "Tenants this instance keeps after a move because verification found a mismatch.",
	}, func() float64 { return float64(len(v.Held())) }))
	return v
}

// wrap returns h with the verification steps around Fence, Warm and Release; h itself when
// the service makes no digests.
func (v *verifier) wrap(h Hooks) Hooks {
	if h.Digest == nil {
		return h
	}
	orig := h
	h.Fence = func(tenant string) uint64 {
		fence := orig.fence(tenant)
		v.sourceFenced(tenant, fence)
		return fence
	}
	h.Warm = func(ctx context.Context, tenant string, fence uint64) error {
		if orig.Warm != nil {
			if err := orig.Warm(ctx, tenant, fence); err != nil {
				return err
			}
		}
		v.targetWarmed(ctx, tenant, fence, orig.applied(tenant))
		return nil
	}
	h.Release = func(ctx context.Context, tenant string) error {
		if !v.mayRelease(ctx, tenant) {
			return nil
		}
		if orig.Release == nil {
			return nil
		}
		return orig.Release(ctx, tenant)
	}
	v.release = orig.Release
	return h
}

// sourceFenced runs on a move's source when it took its fence at handoff: the digest at the
// fence is made and recorded in the background.
func (v *verifier) sourceFenced(tenant string, fence uint64) {
	s := v.s
	e, ok := s.watcher.Lookup(s.kind, tenant)
	if !ok || e.Phase != schema.PhaseHandoff || e.Shard != s.cfg.ID.Shard {
		return // a drain outside a move
	}
	sd := &sourceDigest{epoch: e.Epoch, fence: fence, done: make(chan struct{})}
	v.mu.Lock()
	v.pending[tenant] = sd
	v.mu.Unlock()
	if !s.goTask(func() {
		defer close(sd.done)
		ctx, cancel := context.WithTimeout(s.runCtx, 30*time.Second)
		defer cancel()
		sd.rec = v.digest(ctx, tenant, schema.RoleSource, e.Epoch, fence)
		v.put(ctx, sd.rec)
	}) {
		close(sd.done)
	}
}

// targetWarmed runs on a move's target after Warm returned: at handoff, with the tenant at
// the fence, the digest is made now, before the commit lets anything change the state.
func (v *verifier) targetWarmed(ctx context.Context, tenant string, fence, applied uint64) {
	s := v.s
	e, ok := s.watcher.Lookup(s.kind, tenant)
	if !ok || e.Phase != schema.PhaseHandoff || e.Target != s.cfg.ID.Shard || applied < fence {
		return
	}
	v.mu.Lock()
	delete(v.held, tenant) // moving back here: what was held is the tenant's state again
	v.mu.Unlock()
	if s.cfg.Hooks.DigestBeside {
		s.goTask(func() {
			wctx, cancel := context.WithTimeout(s.runCtx, 30*time.Second)
			defer cancel()
			v.put(wctx, v.digest(wctx, tenant, schema.RoleTarget, e.Epoch, fence))
		})
		return
	}
	rec := v.digest(ctx, tenant, schema.RoleTarget, e.Epoch, fence)
	s.goTask(func() {
		wctx, cancel := context.WithTimeout(s.runCtx, 30*time.Second)
		defer cancel()
		v.put(wctx, rec)
	})
}

// digest calls the Digest hook and makes the record of it.
func (v *verifier) digest(ctx context.Context, tenant, role string, epoch, fence uint64) schema.DigestRecord {
	s := v.s
	rec := schema.DigestRecord{Kind: s.kind, Tenant: tenant, Shard: s.cfg.ID.Shard, Instance: s.cfg.ID.Instance,
		Role: role, Epoch: epoch, Fence: fence}
	start := time.Now()
	d, err := s.cfg.Hooks.Digest(ctx, tenant, fence)
	took := time.Since(start)
	rec.TookMicros = took.Microseconds()
	v.took.WithLabelValues(role).Observe(took.Seconds())
	if err != nil {
		rec.Error = err.Error()
		v.made.WithLabelValues(role, "failed").Inc()
		s.cfg.Logger.Warn("no state digest at the fence: the move stays unverified", "tenant", tenant, "role", role, "fence", fence, "err", err)
		return rec
	}
	rec.Digest = &d
	v.made.WithLabelValues(role, "ok").Inc()
	return rec
}

func (v *verifier) put(ctx context.Context, rec schema.DigestRecord) {
	err := v.s.st.Digests().Put(ctx, rec)
	if errors.Is(err, schema.ErrNotFound) {
		v.s.cfg.Logger.Debug("move verification is not provisioned; digest not recorded", "tenant", rec.Tenant)
		return
	}
	if err != nil {
		v.s.cfg.Logger.Warn("recording a state digest", "tenant", rec.Tenant, "role", rec.Role, "err", err)
	}
}

// mayRelease decides, on a move's source after the commit, whether the tenant's state may be
// released: its own digest must be made first, and for a kind that verifies moves the target's
// digests at the fence must equal it. A mismatch holds the tenant.
func (v *verifier) mayRelease(ctx context.Context, tenant string) bool {
	s := v.s
	v.mu.Lock()
	sd := v.pending[tenant]
	delete(v.pending, tenant)
	v.mu.Unlock()
	if sd == nil {
		return true
	}
	select {
	case <-sd.done:
	case <-ctx.Done():
		return true
	}
	e, ok := s.watcher.Lookup(s.kind, tenant)
	if !ok || e.Phase != schema.PhaseDraining || e.Source != s.cfg.ID.Shard || e.Epoch != sd.epoch+1 || !v.verifies(ctx) {
		return true
	}
	vd := v.awaitVerdict(ctx, tenant, sd, e.Shard)
	switch vd.Result {
	case schema.VerifyMismatch:
		v.mismatches.Inc()
		v.mu.Lock()
		v.held[tenant] = HeldTenant{Tenant: tenant, Epoch: sd.epoch, Target: e.Shard, Detail: vd.Detail, Since: time.Now().UTC()}
		v.mu.Unlock()
		s.cfg.Logger.Error("move verification: the target's state differs from this source's; keeping the tenant here",
			"tenant", tenant, "target", e.Shard, "epoch", sd.epoch, "fence", vd.Fence, "detail", vd.Detail)
		return false
	case schema.VerifyUnverified:
		s.cfg.Logger.Warn("move verification: releasing unverified", "tenant", tenant, "target", e.Shard, "detail", vd.Detail)
	}
	return true
}

// verifies reads whether the kind's config asks for verified moves now (the config may have
// changed since the instance started); the config known at start if NATS does not answer.
func (v *verifier) verifies(ctx context.Context) bool {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if kc, err := v.s.st.Kinds().Get(ctx, v.s.kind); err == nil {
		return kc.Verify
	}
	kc := v.s.kindCfg.Load()
	return kc != nil && kc.Verify
}

// awaitVerdict reads the handoff's digests until every live target instance has recorded one
// (or VerifyWait ends) and judges them.
func (v *verifier) awaitVerdict(ctx context.Context, tenant string, sd *sourceDigest, target string) schema.Verdict {
	s := v.s
	ctx, cancel := context.WithTimeout(ctx, s.cfg.VerifyWait)
	defer cancel()
	pauses := backoff.Policy{Initial: 20 * time.Millisecond, Max: 500 * time.Millisecond}.Pauses()
	var vd schema.Verdict
	for {
		recs, err := s.st.Digests().List(ctx, s.kind, tenant, sd.epoch)
		if err == nil {
			if !slices.ContainsFunc(recs, func(r schema.DigestRecord) bool {
				return r.Role == sd.rec.Role && r.Shard == sd.rec.Shard && r.Instance == sd.rec.Instance
			}) {
				recs = append(recs, sd.rec) // our own write may not have landed
			}
			vd = schema.CompareDigests(recs, s.cfg.ID.Shard, target)
			live, _ := s.peers.liveNames(target)
			if vd.Result == schema.VerifyMismatch || recordedAll(vd.Target, live) {
				return vd
			}
		}
		if !pauses.Wait(ctx) {
			if vd.Result == "" {
				vd = schema.Verdict{Result: schema.VerifyUnverified, Detail: "no digests read within the verify wait"}
			}
			return vd
		}
	}
}

// recordedAll reports whether every live instance (at least one) has a record in recs.
func recordedAll(recs []schema.DigestRecord, live []string) bool {
	if len(recs) == 0 {
		return false
	}
	for _, n := range live {
		if !slices.ContainsFunc(recs, func(r schema.DigestRecord) bool { return r.Instance == n }) {
			return false
		}
	}
	return true
}

// Held lists the tenants whose release a verification mismatch holds on this instance.
func (v *verifier) Held() []HeldTenant {
	v.mu.Lock()
	defer v.mu.Unlock()
	out := make([]HeldTenant, 0, len(v.held))
	for _, h := range v.held {
		out = append(out, h)
	}
	slices.SortFunc(out, func(a, b HeldTenant) int {
		if a.Tenant < b.Tenant {
			return -1
		}
		if a.Tenant > b.Tenant {
			return 1
		}
		return 0
	})
	return out
}

// HeldTenants lists the tenants whose release a move verification mismatch holds here.
func (s *Shard) HeldTenants() []HeldTenant { return s.ver.Held() }

// ErrNotHeld is ReleaseHeld's answer for a tenant not held.
var ErrNotHeld = errors.New("shardkit: the tenant is not held by a verification mismatch")

// ReleaseHeld releases a tenant that a verification mismatch held (calls the Release hook),
// once an operator has looked at it (or rolled the move back, which makes it this shard's again).
func (s *Shard) ReleaseHeld(ctx context.Context, tenant string) error {
	v := s.ver
	v.mu.Lock()
	_, ok := v.held[tenant]
	delete(v.held, tenant)
	v.mu.Unlock()
	if !ok {
		return ErrNotHeld
	}
	if e, ok := s.watcher.Lookup(s.kind, tenant); ok && s.gk.owns(e) {
		return nil // the tenant is this shard's again: its state is in use
	}
	if v.release == nil {
		return nil
	}
	return v.release(ctx, tenant)
}

func (a *adminAPI) handleVerify(w http.ResponseWriter, _ *http.Request) {
	tmhttp.WriteJSON(w, http.StatusOK, map[string]any{"instance": a.s.self, "held": a.s.HeldTenants()})
}

func (a *adminAPI) handleVerifyRelease(w http.ResponseWriter, r *http.Request) {
	tenant := r.URL.Query().Get("tenant_id")
	if err := schema.CheckTenant(tenant); err != nil {
		tmhttp.WriteError(w, r, tmhttp.Errorf(http.StatusBadRequest, "bad-tenant", "Bad tenant", err.Error()), tenant, a.s.kind)
		return
	}
	switch err := a.s.ReleaseHeld(r.Context(), tenant); {
	case errors.Is(err, ErrNotHeld):
		tmhttp.WriteError(w, r, tmhttp.Errorf(http.StatusNotFound, "not-held", "Not held", tenant+" is not held here by a verification mismatch"), tenant, a.s.kind)
	case err != nil:
		tmhttp.WriteError(w, r, tmhttp.Errorf(http.StatusInternalServerError, "release-failed", "Release failed", err.Error()), tenant, a.s.kind)
	default:
		w.WriteHeader(http.StatusNoContent)
	}
}
