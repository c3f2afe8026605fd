package aggregate

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// idemEntry is the remembered outcome of one command, so a retry with the same idempotency
// key is answered without being applied again.
type idemEntry struct {
	Key         string `json:"key"`
	AggregateID string `json:"aggregate_id"`
	Version     uint64 `json:"version"`
	Seq         uint64 `json:"seq"`
	Event       string `json:"event"`
}

// idemWindow keeps the last max outcomes per tenant (FIFO).
type idemWindow struct {
	max   int
	byKey map[string]idemEntry
	order []string
	head  int
}

func newIdemWindow(max int) *idemWindow {
	return &idemWindow{max: max, byKey: make(map[string]idemEntry)}
}

func (w *idemWindow) get(key string) (idemEntry, bool) {
	e, ok := w.byKey[key]
	return e, ok
}

func (w *idemWindow) put(e idemEntry) {
	if e.Key == "" {
		return
	}
	if _, ok := w.byKey[e.Key]; ok {
		return
	}
	if len(w.order) < w.max {
		w.order = append(w.order, e.Key)
	} else {
		delete(w.byKey, w.order[w.head])
		w.order[w.head] = e.Key
		w.head = (w.head + 1) % w.max
	}
	w.byKey[e.Key] = e
}

// entries returns the window oldest first.
func (w *idemWindow) entries() []idemEntry {
	out := make([]idemEntry, 0, len(w.order))
	for i := range w.order {
		out = append(out, w.byKey[w.order[(w.head+i)%len(w.order)]])
	}
	return out
}

// tenantState is one tenant's ledger in this instance's memory.
type tenantState struct {
	tenant string
	mu     sync.Mutex // serialises commands and catch-ups of this tenant

	accounts map[string]*Account
	totals   Totals
	idem     *idemWindow
	// contig: every event of the tenant up to this sequence is applied. Appends by this
	// instance can run ahead of it (a sibling may have written in between); catchUp closes it.
	contig uint64
	// applied is the highest sequence applied.
	applied   uint64
	sinceSnap int

	// A move's target follows the stream between warm-up and its first command (follow.go).
	unfollow    context.CancelFunc
	followToken *int
	advanced    chan struct{} // closed and replaced when the follow advances contig
}

func newTenantState(tenant string, window int) *tenantState {
	return &tenantState{tenant: tenant, accounts: map[string]*Account{}, idem: newIdemWindow(window), advanced: make(chan struct{})}
}

// apply adds ev to the state unless it is already in (its aggregate has reached it).
func (ts *tenantState) apply(ev Event) {
	acc := ts.accounts[ev.AggregateID]
	if acc != nil && acc.LastSeq >= ev.Seq {
		return
	}
	ts.accounts[ev.AggregateID] = evolve(acc, ev, &ts.totals)
	ts.idem.put(idemEntry{Key: ev.CommandKey, AggregateID: ev.AggregateID, Version: ev.Version, Seq: ev.Seq, Event: ev.Event})
	ts.applied = max(ts.applied, ev.Seq)
	ts.sinceSnap++
}

// catchUp applies every event of the tenant after contig. Caller holds mu.
func (ts *tenantState) catchUp(ctx context.Context, es *eventStore) error {
	// Usually nothing is new (a move's source wrote the tenant's events itself): one direct
	// read of the newest event says so, where a replay costs a consumer's creation and a scan.
	newest, err := es.lastSeq(ctx, schema.TenantEvents(ts.tenant))
	if err != nil {
		return err
	}
	if newest <= ts.contig {
		return nil
	}
	last, err := es.replay(ctx, schema.TenantEvents(ts.tenant), ts.contig, func(ev Event) error {
		ts.apply(ev)
		return nil
	})
	if err != nil {
		return err
	}
	ts.contig = max(ts.contig, last)
	ts.applied = max(ts.applied, ts.contig)
	return nil
}

// fresh reports whether this instance has applied the aggregate's last stored event.
func (ts *tenantState) fresh(ctx context.Context, es *eventStore, id string) (bool, error) {
	last, err := es.lastSeq(ctx, schema.EventSubject(ts.tenant, AccountType, id))
	if err != nil {
		return false, err
	}
	var have uint64
	if acc := ts.accounts[id]; acc != nil {
		have = acc.LastSeq
	}
	return have >= last, nil
}

// catchUpAggregate applies the events of one aggregate this instance has not seen.
func (ts *tenantState) catchUpAggregate(ctx context.Context, es *eventStore, id string) error {
	var after uint64
	if acc := ts.accounts[id]; acc != nil {
		after = acc.LastSeq
	}
	_, err := es.replay(ctx, schema.EventSubject(ts.tenant, AccountType, id), after, func(ev Event) error {
		ts.apply(ev)
		return nil
	})
	return err
}

func (ts *tenantState) snapshot() *snapshot {
	accs := make(map[string]*Account, len(ts.accounts))
	for id, a := range ts.accounts {
		c := *a
		accs[id] = &c
	}
	return &snapshot{Tenant: ts.tenant, Applied: ts.contig, Accounts: accs, Totals: ts.totals, Recent: ts.idem.entries()}
}

// Strategy is how a tenant's state is rebuilt when a shard takes it over (the Cloudlysis PRD section 4).
type Strategy string

const (
	// StrategySnapshot loads the newest snapshot and replays the events after it.
	StrategySnapshot Strategy = "snapshot"
	// StrategyReplay rebuilds from the first event (cold rehydrate).
	StrategyReplay Strategy = "replay"
)

// load rebuilds a tenant's state with strategy and reports how.
func load(ctx context.Context, es *eventStore, tenant string, strategy Strategy, window int) (*tenantState, loadReport, error) {
	start := time.Now()
	ts := newTenantState(tenant, window)
	rep := loadReport{Strategy: strategy}
	if strategy == StrategySnapshot {
		s, n, err := es.loadSnapshot(ctx, tenant)
		if err != nil {
			return nil, rep, err
		}
		if s != nil {
			ts.accounts, ts.totals, ts.contig, ts.applied = s.Accounts, s.Totals, s.Applied, s.Applied
			if ts.accounts == nil {
				ts.accounts = map[string]*Account{}
			}
			for _, e := range s.Recent {
				ts.idem.put(e)
			}
			rep.SnapshotHit, rep.SnapshotBytes, rep.SnapshotSeq = true, n, s.Applied
		}
	}
	if err := ts.catchUp(ctx, es); err != nil {
		return nil, rep, fmt.Errorf("aggregate: load %s: %w", tenant, err)
	}
	rep.Replayed = ts.sinceSnap
	rep.Took = time.Since(start)
	return ts, rep, nil
}

type loadReport struct {
	Strategy      Strategy
	SnapshotHit   bool
	SnapshotSeq   uint64
	SnapshotBytes int
	Replayed      int
	Took          time.Duration
}
