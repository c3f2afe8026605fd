package projection

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/tenantmesh/tenantmesh/internal/ctxtime"
	"github.com/tenantmesh/tenantmesh/internal/tracing"
	"github.com/tenantmesh/tenantmesh/shardkit/jsx"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// tail is one partition of the instance's shared consumption of TM_EVENTS: an ordered consumer
// whose filter subjects are its live tenants' events.<tenant>.> (or events.> filtered here,
// past MaxFilters). It applies every event of each of its live tenants, in stream order.
// Tenants are spread over TailPartitions tails by a hash of their name, so a change of the live
// set rebuilds one consumer of a few hundred filters, not one of thousands: JetStream's consumer
// creation time grows with the square of the filter count (README.md).
//
// A tenant becomes live by joining after its own catch-up replay: the catch-up read the
// tenant's events up to covered (the stream's last sequence when the replay began), so when the
// tail rebuilds its consumer it starts at min(pos+1, covered+1) over the joiners. Events at or
// below a tenant's applied sequence are skipped, so the switch has neither gap nor duplicate.
// Invariant: for each live tenant, every event of it at or below pos has been applied.
type tail struct {
	s  *Service
	id int

	mu     sync.Mutex
	joins  []join
	leaves []string
	wake   chan struct{}

	// Owned by the run goroutine.
	live     map[string]*tenantState
	pos      uint64 // last stream sequence processed
	posValid bool   // pos binds live tenants (false before the first consumer and once none is live)
	restart  uint64 // 0, or the first sequence joiners need from the next consumer
	left     int    // tenants that left since the consumer was made: their filters are still in it
	cur      *feed
	all      bool // the consumer reads events.>
	remode   bool // the consumer should switch between filters and events.>

	received atomic.Uint64 // messages delivered, applied or not
}

type join struct {
	ts      *tenantState
	covered uint64
}

// feed is one consumer of the tail and the goroutine that reads it.
type feed struct {
	r    *jsx.Reader
	ch   chan delivery
	err  error // set before ch is closed
	stop chan struct{}
}

type delivery struct {
	m  jetstream.Msg
	md *jetstream.MsgMetadata
}

func newTail(s *Service, id int) *tail {
	return &tail{s: s, id: id, wake: make(chan struct{}, 1), live: map[string]*tenantState{}}
}

func (t *tail) join(ts *tenantState, covered uint64) {
	t.mu.Lock()
	t.joins = append(t.joins, join{ts, covered})
	t.mu.Unlock()
	t.poke()
}

func (t *tail) leave(tenant string) {
	t.mu.Lock()
	t.leaves = append(t.leaves, tenant)
	t.mu.Unlock()
	t.poke()
}

func (t *tail) poke() {
	select {
	case t.wake <- struct{}{}:
	default:
	}
}

// run applies events until ctx ends.
func (t *tail) run(ctx context.Context) {
	defer t.closeFeed()
	for ctx.Err() == nil {
		changed := t.takeChanges()
		if changed && t.cur != nil && t.all && len(t.live) > 0 && (t.restart == 0 || t.restart > t.pos) {
			// Reading events.> already carries every tenant from pos on: a join or leave is
			// a change of the live set only, without a new consumer.
			changed, t.restart = false, 0
		}
		// A leave alone makes no new consumer: handle skips the events of a tenant that is not
		// live, so its filter can stay until a join rebuilds it, or until the filters of tenants
		// gone outnumber the live ones. A move's source leaves at its end; a new consumer then
		// held up this instance's other tenants for its creation (a move's target among them,
		// waiting for the events up to its fence).
		stale := t.cur != nil && !t.s.cfg.AllTenants && (len(t.live) == 0 || !t.all && t.left > len(t.live))
		if changed || stale || t.remode || (t.cur == nil && (len(t.live) > 0 || t.s.cfg.AllTenants)) {
			if err := t.rebuild(ctx); err != nil {
				t.s.cfg.Logger.Warn("tail consumer rebuild failed; retrying", "err", err)
				if !ctxtime.Sleep(ctx, time.Second) {
					return
				}
				continue
			}
		}
		if t.cur == nil {
			select {
			case <-t.wake:
			case <-ctx.Done():
			}
			continue
		}
		t.consume(ctx)
	}
}

// takeChanges applies queued leaves and joins to the live set, lowering restart to where the
// joiners' catch-ups stopped, and counts the leaves; it reports whether a tenant joined.
func (t *tail) takeChanges() bool {
	t.mu.Lock()
	joins, leaves := t.joins, t.leaves
	t.joins, t.leaves = nil, nil
	t.mu.Unlock()
	changed := false
	for _, tenant := range leaves {
		if _, in := t.live[tenant]; in {
			delete(t.live, tenant)
			t.s.m.liveTenants.Dec()
			t.left++
		}
	}
	if len(t.live) == 0 && !t.s.cfg.AllTenants {
		t.posValid = false // no live tenant depends on pos any more
	}
	for _, j := range joins {
		j.ts.mu.Lock()
		dropped := j.ts.phase == phaseDropped
		if !dropped {
			j.ts.phase = phaseLive
		}
		j.ts.mu.Unlock()
		if dropped || t.live[j.ts.tenant] == j.ts {
			continue
		}
		if t.live[j.ts.tenant] == nil {
			t.s.m.liveTenants.Inc()
		}
		t.live[j.ts.tenant] = j.ts
		changed = true
		if t.restart == 0 || j.covered+1 < t.restart {
			t.restart = j.covered + 1
		}
	}
	return changed
}

// filters are the consumer's filter subjects: one per live tenant, or all events (filtered
// here) when there are more than MaxFilters live tenants or all is asked for.
func (t *tail) filters(all bool) []string {
	if all || len(t.live) > t.s.cfg.MaxFilters || t.s.cfg.AllTenants {
		return []string{schema.SubjectEventsAll}
	}
	out := make([]string, 0, len(t.live))
	for tenant := range t.live {
		out = append(out, schema.TenantEvents(tenant))
	}
	return out
}

// rebuild replaces the consumer with one over the live set, starting after pos, or earlier
// where joiners need it.
func (t *tail) rebuild(ctx context.Context) error {
	t.closeFeed()
	t.left = 0
	if len(t.live) == 0 && !t.s.cfg.AllTenants {
		t.restart = 0
		return nil
	}
	start := t.restart
	if t.posValid && (start == 0 || t.pos+1 < start) {
		start = t.pos + 1
	}
	if start == 0 && len(t.live) == 0 {
		// A multi-tenant shard with nothing hosted yet: every tenant whose events arrive from
		// now on (a tenant's history comes with its catch-up).
		info, err := t.s.st.stream.Info(ctx)
		if err != nil {
			return fmt.Errorf("projection: read %s state: %w", schema.StreamEvents, err)
		}
		start = info.State.LastSeq + 1
	}
	begin := time.Now()
	r, filters, err := t.consumer(ctx, start, false)
	if err != nil {
		return err
	}
	if len(filters) > 1 && r.Pending() > uint64(t.s.cfg.FilterBacklog) {
		// JetStream serves a consumer with several filters slowly when it is far behind (for
		// each message it intersects the filters with the subjects of a message block): read
		// events.> until near the end, then go back to the filters (see handle).
		r.Stop()
		if r, filters, err = t.consumer(ctx, start, true); err != nil {
			return err
		}
	}
	all := len(filters) == 1 && filters[0] == schema.SubjectEventsAll
	f := &feed{r: r, ch: make(chan delivery, t.s.cfg.TailBatch), stop: make(chan struct{})}
	go f.read()
	t.cur, t.pos, t.posValid, t.restart = f, max(start, 1)-1, len(t.live) > 0 || t.s.cfg.AllTenants, 0
	t.all, t.remode = all, false
	took := time.Since(begin)
	t.s.m.rebuilds.Observe(took.Seconds())
	t.s.cfg.Logger.Debug("tail consumer rebuilt", "partition", t.id, "tenants", len(t.live), "filters", len(filters), "start", start, "took", took)
	return nil
}

// consumer reads the live set's events (or all, filtered here) from start on. The reader
// makes its consumer again by itself when the consumer's server stops.
func (t *tail) consumer(ctx context.Context, start uint64, all bool) (*jsx.Reader, []string, error) {
	filters := t.filters(all)
	cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	r, err := jsx.Read(cctx, t.s.st.js, schema.StreamEvents, jsx.ReadConfig{
		Filters:  filters,
		Start:    max(start, 1),
		Batch:    t.s.cfg.TailBatch,
		Inactive: 30 * time.Second,
		Logger:   t.s.cfg.Logger,
	})
	if err != nil {
		return nil, nil, fmt.Errorf("projection: tail consumer over %d tenants: %w", len(t.live), err)
	}
	return r, filters, nil
}

func (f *feed) read() {
	defer close(f.ch)
	for {
		m, md, err := f.r.Next(context.Background()) // Stop ends it
		if err != nil {
			f.err = err
			return
		}
		select {
		case f.ch <- delivery{m, md}:
		case <-f.stop:
			return
		}
	}
}

func (t *tail) closeFeed() {
	f := t.cur
	if f == nil {
		return
	}
	t.cur = nil
	close(f.stop)
	f.r.Stop()
	for range f.ch { // the reader exits once Next fails or it sees stop
	}
}

// consume applies messages until the live set changes, the feed fails or ctx ends.
func (t *tail) consume(ctx context.Context) {
	f := t.cur
	for {
		select {
		case d, ok := <-f.ch:
			if !ok {
				if !errors.Is(f.err, jetstream.ErrMsgIteratorClosed) {
					t.s.cfg.Logger.Warn("tail consumer failed; rebuilding", "pos", t.pos, "err", f.err)
				}
				t.closeFeed()
				ctxtime.Sleep(ctx, 100*time.Millisecond)
				return
			}
			if h := t.s.hold.Load(); h != nil { // test hook: benchmarks build a backlog
				<-*h
			}
			t.handle(d.m, d.md)
			if t.remode {
				return
			}
		case <-t.wake:
			return
		case <-ctx.Done():
			return
		}
	}
}

// handle applies one message if its tenant is live here and has not applied it yet.
func (t *tail) handle(m jetstream.Msg, md *jetstream.MsgMetadata) {
	seq := md.Sequence.Stream
	t.pos = seq
	t.received.Add(1)
	t.s.m.received.Inc()
	switch {
	case t.s.cfg.AllTenants:
		t.remode = false // always events.>
	case t.all:
		t.remode = md.NumPending <= filterResume && len(t.live) <= t.s.cfg.MaxFilters
	default:
		t.remode = md.NumPending > uint64(t.s.cfg.FilterBacklog) && len(t.live) > 1 && len(t.live) <= t.s.cfg.MaxFilters
	}
	tenant := tenantOfSubject(m.Subject())
	ts := t.live[tenant]
	if ts == nil {
		if t.s.cfg.AllTenants && schema.ValidTenant(tenant) && t.s.tailOf(tenant) == t {
			t.s.host(tenant) // a multi-tenant shard takes every tenant it sees: its catch-up covers this event
		}
		return
	}
	ts.mu.Lock()
	if ts.phase != phaseLive || seq <= ts.applied || ts.refused != nil {
		ts.mu.Unlock()
		return
	}
	ev, err := decodeEvent(m)
	if errors.Is(err, jsx.ErrNewerFormat) {
		t.s.refuse(ts, err)
		ts.mu.Unlock()
		return
	}
	if err != nil {
		ts.advance(seq)
		ts.mu.Unlock()
		t.s.corrupt(ts.tenant, err)
		return
	}
	if h := m.Headers(); tracing.Traced(h) {
		_, span := tracer.Start(tracing.Extract(context.Background(), h), "projection.apply", trace.WithAttributes(
			attribute.String("tm.tenant", ts.tenant), attribute.Int64("tm.seq", int64(seq))))
		defer span.End()
	}
	ts.apply(ev)
	due := ts.since >= t.s.cfg.CheckpointEvery
	ts.mu.Unlock()
	t.s.m.applied.Inc()
	if due {
		t.s.queueFlush(ts.tenant)
	}
}

// filterResume is how close to the stream's end a tail reading events.> goes back to filters.
const filterResume = 64

// tracer makes the projection's spans: projection.apply for each event of a sampled trace.
var tracer = tracing.NewTracer("github.com/tenantmesh/tenantmesh/services/projection")
