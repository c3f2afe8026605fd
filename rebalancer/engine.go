package rebalancer

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"
	"golang.org/x/sync/errgroup"

	"github.com/tenantmesh/tenantmesh/rebalancer/planner"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// Config configures an Engine. Zero fields take the documented defaults.
type Config struct {
	Store *schema.Store
	// Holder names this rebalancer in the leader lease and the audit journal. Keep it stable
	// across restarts of the same process (a restart then resumes at once instead of waiting
	// for its own lease to expire). Default "rebalancer".
	Holder string
	// LeaseTTL is the leader lease's lifetime; it is renewed every third of it. Default 10s.
	LeaseTTL time.Duration
	// WarmTimeout: a target not ready this long after the move started aborts it. Default 2m.
	WarmTimeout time.Duration
	// HandoffTimeout: a handoff not ready to commit this long after it began aborts the move
	// (the tenant's requests are held meanwhile, so keep it short). Default 10s.
	HandoffTimeout time.Duration
	// DrainTimeout: after commit, how long to wait for the source to report drained before
	// finishing anyway (the epoch already fences it). Default 30s.
	DrainTimeout time.Duration
	// PauseBudget is the handoff pause (the time the gateways hold a moving tenant's requests)
	// a move should keep within. While moves' pauses exceed it, the engine runs fewer of them at
	// once, down to one, and back up towards the plan's concurrency while they keep within it
	// (see pacer). Default 50ms; negative: always the plan's concurrency.
	PauseBudget time.Duration
	// Thresholds decide which instances are live. Default schema's.
	Thresholds schema.Thresholds
	// Presence, if set, tells of dead instances within seconds (the directory's ages take
	// minutes): moves stop waiting for them, a move whose source shard died becomes a takeover,
	// and a takeover commits once every instance of its source is gone, without waiting out
	// their lease. Without it (the CLI's apply) a takeover always waits out the lease.
	Presence *Presence
	// LeaseHeld tells the engine that its caller holds the leader lease as Holder for as long
	// as the engine is used (rebalancer serve keeps it) and cancels the context it passes if
	// the lease is lost; Apply and Rollback then do not take the lease themselves.
	LeaseHeld bool
	// Progress, if set, is called after every change of a move record.
	Progress func(MoveRecord)
	Logger   *slog.Logger

	// afterStep is a test hook called after each durable step; an error stops the engine
	// there, as a crash would.
	afterStep func(step string) error
}

func (c Config) withDefaults() Config {
	if c.Holder == "" {
		c.Holder = "rebalancer"
	}
	if c.LeaseTTL <= 0 {
		c.LeaseTTL = 10 * time.Second
	}
	if c.WarmTimeout <= 0 {
		c.WarmTimeout = 2 * time.Minute
	}
	if c.HandoffTimeout <= 0 {
		c.HandoffTimeout = 10 * time.Second
	}
	if c.DrainTimeout <= 0 {
		c.DrainTimeout = 30 * time.Second
	}
	if c.PauseBudget == 0 {
		c.PauseBudget = DefaultPauseBudget
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	return c
}

// DefaultPauseBudget is Config.PauseBudget's default.
const DefaultPauseBudget = 50 * time.Millisecond

// Engine records plans and drives their moves.
type Engine struct {
	cfg   Config
	st    *schema.Store
	dir   *dirView // the directory, shared by the running moves
	sigs  *sigHub  // the tenant signals, shared by the running moves
	limit atomic.Int64
	// controls are the plans this engine applies, by id: a control it records reaches the
	// apply at once (watchControl).
	controls sync.Map
}

// MoveLimit is how many moves the plan being applied may run at once now (its concurrency, or
// fewer while pauses exceed Config.PauseBudget); 0 when no plan is being applied.
func (e *Engine) MoveLimit() int { return int(e.limit.Load()) }

// New makes an engine.
func New(cfg Config) (*Engine, error) {
	if cfg.Store == nil {
		return nil, errors.New("rebalancer: Store is required")
	}
	cfg = cfg.withDefaults()
	if err := schema.CheckName("holder", cfg.Holder); err != nil {
		return nil, err
	}
	e := &Engine{cfg: cfg, st: cfg.Store}
	e.dir, e.sigs = newDirView(e), newSigHub(e)
	return e, nil
}

// ErrPlanNotFound means no plan has that id.
var ErrPlanNotFound = errors.New("plan not found")

// CreatePlan stores a plan and its moves, all pending.
func (e *Engine) CreatePlan(ctx context.Context, p *planner.Plan, actor string) (PlanRecord, error) {
	rec, _, err := e.CreatePlanMoves(ctx, p, actor)
	return rec, err
}

// CreatePlanMoves is CreatePlan that also returns the move records as stored (with their
// revisions), so a caller answering with the new plan need not read it back.
func (e *Engine) CreatePlanMoves(ctx context.Context, p *planner.Plan, actor string) (PlanRecord, []MoveRecord, error) {
	return e.StorePlan(ctx, PlanRecord{Actor: actor, Origin: "operator", Plan: *p})
}

// StorePlan stores rec (its ID, status and times are set here) and its moves, all pending:
// for a caller that fills in more of the record than the plan (the autopilot: origin,
// trigger).
func (e *Engine) StorePlan(ctx context.Context, rec PlanRecord) (PlanRecord, []MoveRecord, error) {
	now := time.Now().UTC()
	rec.ID, rec.Status, rec.Created, rec.Updated = NewPlanID(now), PlanPlanned, now, now
	moves, err := e.storePlan(ctx, &rec)
	return rec, moves, err
}

// storeWorkers is how many of a plan's move records storePlan writes at once. Each is a
// round trip to the stream leader (1-3 ms on a 3-node cluster), and the leader commits the
// writes in flight together: a 3,000-move plan one at a time took seconds on a quiet cluster
// and minutes on a busy one. (A variable only so that BenchmarkStorePlan can compare.)
var storeWorkers = 32

// storePlan writes rec's moves, then rec, and returns the moves as written. The moves are
// written before the record that names them, so a plan that exists has all its moves; a
// store that fails part way leaves moves no plan names, which nothing reads.
func (e *Engine) storePlan(ctx context.Context, rec *PlanRecord) ([]MoveRecord, error) {
	moves := make([]MoveRecord, len(rec.Plan.Moves))
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(storeWorkers)
	for i, m := range rec.Plan.Moves {
		g.Go(func() error {
			mr := MoveRecord{Plan: rec.ID, ID: moveID(i), Move: m, Strategy: m.Warmup, State: MovePending, Updated: rec.Created}
			rev, err := e.st.Rebalance().Create(gctx, schema.MoveKey(rec.ID, mr.ID), mr)
			if err != nil {
				return fmt.Errorf("rebalancer: store move %d of plan %s: %w", i+1, rec.ID, err)
			}
			mr.RecordRev = rev
			moves[i] = mr
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		return nil, err
	}
	rev, err := e.st.Rebalance().Create(ctx, schema.PlanKey(rec.ID), rec)
	if err != nil {
		return nil, fmt.Errorf("rebalancer: store plan %s: %w", rec.ID, err)
	}
	rec.Revision = rev
	return moves, nil
}

// Plan reads a plan and its moves (in order).
func (e *Engine) Plan(ctx context.Context, id string) (PlanRecord, []MoveRecord, error) {
	if err := schema.CheckName("plan id", id); err != nil {
		return PlanRecord{}, nil, err
	}
	var rec PlanRecord
	rev, err := e.st.Rebalance().Latest(ctx, schema.PlanKey(id), &rec)
	if errors.Is(err, schema.ErrNotFound) {
		return PlanRecord{}, nil, fmt.Errorf("%w: %s (list plans with `rebalance status`)", ErrPlanNotFound, id)
	}
	if err != nil {
		return PlanRecord{}, nil, err
	}
	rec.Revision = rev
	var moves []MoveRecord
	if n := len(rec.Plan.Moves); n <= directReadMoves {
		// A plan's moves are stored before the plan itself, so they all exist: read them by key
		// rather than by listing, which costs a consumer on the server each time (on a cluster
		// a meta-layer operation; dashboards and CLIs poll this). Each read is the stream
		// leader's (Latest), so a client's status read never lags its own apply or rollback.
		moves = make([]MoveRecord, n)
		for i := range moves {
			rev, err := e.st.Rebalance().Latest(ctx, schema.MoveKey(id, moveID(i)), &moves[i])
			if err != nil {
				return rec, nil, err
			}
			moves[i].RecordRev = rev
		}
		return rec, moves, nil
	}
	err = e.st.Rebalance().List(ctx, schema.MovesOf(id), func(_ string, rev uint64, raw json.RawMessage) {
		var m MoveRecord
		if json.Unmarshal(raw, &m) == nil {
			m.RecordRev = rev
			moves = append(moves, m)
		}
	})
	slices.SortFunc(moves, func(a, b MoveRecord) int { return strings.Compare(a.ID, b.ID) })
	return rec, moves, err
}

// Move reads the move a placement names (Placement.Move: plan/id). It wraps ErrPlanNotFound
// if there is no such move (or key names none).
func (e *Engine) Move(ctx context.Context, key string) (MoveRecord, error) {
	plan, id, ok := strings.Cut(key, "/")
	if !ok || schema.CheckName("plan id", plan) != nil || schema.CheckName("move id", id) != nil {
		return MoveRecord{}, fmt.Errorf("%w: %q is not a move's name (plan/move)", ErrPlanNotFound, key)
	}
	var m MoveRecord
	rev, err := e.st.Rebalance().Latest(ctx, schema.MoveKey(plan, id), &m)
	if errors.Is(err, schema.ErrNotFound) {
		return MoveRecord{}, fmt.Errorf("%w: no move %s", ErrPlanNotFound, key)
	}
	m.RecordRev = rev
	return m, err
}

// directReadMoves is the largest plan whose moves Plan reads one by one.
const directReadMoves = 256

// Plans lists every stored plan, newest first.
func (e *Engine) Plans(ctx context.Context) ([]PlanRecord, error) {
	var out []PlanRecord
	err := e.st.Rebalance().List(ctx, "plan.*", func(_ string, rev uint64, raw json.RawMessage) {
		var p PlanRecord
		if json.Unmarshal(raw, &p) == nil {
			p.Revision = rev
			out = append(out, p)
		}
	})
	slices.SortFunc(out, func(a, b PlanRecord) int { return strings.Compare(b.ID, a.ID) })
	return out, err
}

// lead takes the leader lease and keeps it until the returned stop is called; ctx is cancelled
// if the lease is lost.
func (e *Engine) lead(ctx context.Context) (context.Context, func(), error) {
	if e.cfg.LeaseHeld {
		lctx, cancel := context.WithCancel(ctx)
		return lctx, cancel, nil
	}
	l, err := e.st.Rebalance().AcquireLease(ctx, schema.LeaderLease, e.cfg.Holder, e.cfg.LeaseTTL)
	if err != nil {
		return nil, nil, fmt.Errorf("rebalancer: not the leader: %w", err)
	}
	lctx, cancel := context.WithCancelCause(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		t := time.NewTicker(e.cfg.LeaseTTL / 3)
		defer t.Stop()
		for {
			select {
			case <-t.C:
				nl, err := e.st.Rebalance().RenewLease(lctx, l, e.cfg.LeaseTTL)
				if err != nil {
					if errors.Is(err, schema.ErrLeaseHeld) {
						e.cfg.Logger.Error("leader lease lost; stopping", "err", err)
						cancel(err)
						return
					}
					e.cfg.Logger.Warn("lease renewal failed; retrying", "err", err)
					continue
				}
				l = nl
			case <-lctx.Done():
				return
			}
		}
	}()
	stop := func() {
		cancel(nil)
		<-done
		rctx, rcancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer rcancel()
		_ = e.st.Rebalance().ReleaseLease(rctx, l)
	}
	return lctx, stop, nil
}

// Apply drives every move of the plan, wave by wave, at most Concurrency at a time (fewer while
// pauses exceed Config.PauseBudget), until each is terminal. It resumes a plan left
// half-applied by a crash. It needs the leader lease.
func (e *Engine) Apply(ctx context.Context, id string) (PlanRecord, error) {
	lctx, stop, err := e.lead(ctx)
	if err != nil {
		return PlanRecord{}, err
	}
	defer stop()
	return e.apply(lctx, id)
}

func (e *Engine) apply(ctx context.Context, id string) (rec PlanRecord, err error) {
	ctx, span := tracer.Start(ctx, "plan.apply", trace.WithAttributes(attribute.String("tm.plan", id)))
	defer func() { endSpan(span, err, attribute.String("tm.plan.status", string(rec.Status))) }()
	rec, moves, err := e.Plan(ctx, id)
	if err != nil {
		return rec, err
	}
	if rec.Status == PlanPlanned || rec.Status == PlanPaused {
		rec.Status = PlanApplying
		if err := e.savePlan(ctx, &rec); err != nil {
			return rec, err
		}
	}
	ctl := e.watchControl(ctx, &rec)
	defer ctl.stop()
	conc := max(rec.Plan.Concurrency, 1)
	budget := e.cfg.PauseBudget
	if rec.Plan.Strategy == planner.StrategyFailover {
		budget = -1 // a takeover holds its tenant for its source's lease, not for a drain: no pacing on it
	}
	pace := newPacer(conc, budget, func(limit int, pause time.Duration) {
		e.cfg.Logger.Info("moves slowed: a handoff pause exceeded the budget", "plan", id, "pause", pause.Round(time.Millisecond),
			"budget", e.cfg.PauseBudget, "at_once", limit, "concurrency", conc)
	})
	e.limit.Store(int64(pace.Limit()))
	defer e.limit.Store(0)
	// The shared views stay up for the whole apply: with few moves at once (a paced plan, a
	// plan of concurrency 1) the count of moves holding them would drop to zero between two
	// moves, and each restart costs a consumer through the meta leader and a re-read of the
	// directory and the signals.
	e.dir.acquire()
	e.sigs.acquire()
	defer func() {
		e.sigs.release()
		e.dir.release()
	}()
	waves := map[int][]int{}
	var order []int
	for i, m := range moves {
		if _, ok := waves[m.Wave]; !ok {
			order = append(order, m.Wave)
		}
		waves[m.Wave] = append(waves[m.Wave], i)
	}
	slices.Sort(order)
	var firstErr error
	var mu sync.Mutex
	for _, w := range order {
		var wg sync.WaitGroup
		for _, i := range waves[w] {
			if moves[i].State.Terminal() {
				continue
			}
			if ctl.halted() {
				break // paused or cancelled: start nothing more
			}
			epoch, err := pace.acquire(ctx)
			if err != nil {
				mu.Lock()
				firstErr = cmp.Or(firstErr, err)
				mu.Unlock()
				break
			}
			if ctl.halted() {
				pace.release()
				break
			}
			wg.Go(func() {
				m := &moves[i]
				learned := false
				learn := func() { // once: at the commit, or at the end of a move that never committed
					if !learned {
						learned = true
						pace.learn(epoch, m.Pause(), m.State == MoveAborted && !m.Handoff.IsZero() && m.Commit.IsZero())
						e.limit.Store(int64(pace.Limit()))
					}
				}
				defer func() {
					learn()
					pace.release()
				}()
				if err := e.drive(ctx, m, learn, ctl); err != nil {
					mu.Lock()
					if firstErr == nil {
						firstErr = err
					}
					mu.Unlock()
				}
			})
		}
		wg.Wait()
		if firstErr != nil {
			return rec, firstErr
		}
		if ctl.halted() {
			break
		}
	}
	rec.Status = PlanDone
	switch {
	case ctl.cancelled():
		for i := range moves {
			if err := e.cancelMove(ctx, &moves[i], ctl); err != nil {
				return rec, err
			}
		}
		rec.Status = PlanCancelled
	case ctl.halted():
		rec.Status = PlanPaused
		e.cfg.Logger.Info("plan paused", "plan", id, "by", ctl.by())
	}
	for _, m := range moves {
		if m.State != MoveDone && rec.Status == PlanDone {
			rec.Status = PlanPartial
		}
	}
	return rec, e.savePlan(ctx, &rec)
}

func (e *Engine) savePlan(ctx context.Context, rec *PlanRecord) error {
	rec.Updated = time.Now().UTC()
	for range 8 {
		rev, err := e.st.Rebalance().Update(ctx, schema.PlanKey(rec.ID), rec.Revision, rec)
		if err == nil {
			rec.Revision = rev
			return nil
		}
		if !errors.Is(err, schema.ErrConflict) {
			return err
		}
		var cur PlanRecord
		if rev, err = e.st.Rebalance().Latest(ctx, schema.PlanKey(rec.ID), &cur); err != nil {
			return err
		}
		rec.Revision = rev
		if cur.RolledBackBy != "" {
			rec.RolledBackBy = cur.RolledBackBy
		}
		rec.Control, rec.ControlBy = cur.Control, cur.ControlBy // an operator's pause or cancel stays
	}
	return fmt.Errorf("rebalancer: plan %s kept changing underneath", rec.ID)
}

// saveMove persists the move record (CAS on its revision) and reports progress.
func (e *Engine) saveMove(ctx context.Context, m *MoveRecord) error {
	m.Updated = time.Now().UTC()
	rev, err := e.st.Rebalance().Update(ctx, schema.MoveKey(m.Plan, m.ID), m.RecordRev, m)
	if err != nil {
		return fmt.Errorf("rebalancer: save move %s: %w", m.Key(), err)
	}
	m.RecordRev = rev
	if e.cfg.Progress != nil {
		e.cfg.Progress(*m)
	}
	return e.step("record." + string(m.State))
}

func (e *Engine) step(name string) error {
	if e.cfg.afterStep != nil {
		return e.cfg.afterStep(name)
	}
	return nil
}
