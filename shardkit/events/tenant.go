package events

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"sync/atomic"
	"time"
)

// Event is one stored fact of a tenant.
type Event struct {
	// Subject says what the event is about, within the tenant: one or more NATS subject tokens
	// ("account.main"). It is stored on Config.Prefix(tenant) + Subject.
	Subject string `json:"subject"`
	// Type names the event ("deposited"); stored in the Tm-Event-Type header.
	Type string `json:"type,omitempty"`
	// Key is the idempotency key of the command that made it; stored as the message id.
	Key string `json:"key,omitempty"`
	// Version is the subject's event count, this one included; Seq its stream sequence.
	Version uint64 `json:"version"`
	Seq     uint64 `json:"seq"`
	// Data is the body, as stored (not kept in the idempotency window).
	Data []byte `json:"-"`
}

// Position is how far a subject's history has been applied: its event count and the stream
// sequence of its last event (what the next append expects).
type Position struct {
	Version uint64 `json:"version"`
	Seq     uint64 `json:"seq"`
}

// window keeps the last max outcomes per tenant (FIFO), by idempotency key.
type window struct {
	max   int
	byKey map[string]Event
	order []string
	head  int
}

func newWindow(max int) *window {
	return &window{max: max, byKey: make(map[string]Event)}
}

func (w *window) get(key string) (Event, bool) {
	e, ok := w.byKey[key]
	return e, ok
}

func (w *window) put(e Event) {
	if e.Key == "" {
		return
	}
	if _, ok := w.byKey[e.Key]; ok {
		return
	}
	e.Data = nil
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
func (w *window) entries() []Event {
	out := make([]Event, 0, len(w.order))
	for i := range w.order {
		out = append(out, w.byKey[w.order[(w.head+i)%len(w.order)]])
	}
	return out
}

// tenant is one tenant's state in this instance's memory.
type tenant[S any] struct {
	name string
	mu   sync.Mutex // serialises commands and catch-ups of this tenant

	state    S
	apply    func(S, Event) error
	subjects map[string]Position
	idem     *window
	// contig: every event of the tenant up to this sequence is applied. Appends by this
	// instance can run ahead of it (a sibling may have written in between); catchUp closes it.
	contig uint64
	// applied is the highest sequence applied.
	applied uint64
	// epoch is the newest epoch marker applied (a takeover's, EpochSubject): an instance
	// serving the tenant at an older epoch is fenced (Log.fenced).
	epoch     uint64
	sinceSnap int
	// events and bytes count the events applied and their bytes (eventBytes), kept in
	// snapshots: the tenant's size, read without its lock.
	events, bytes atomic.Uint64
	// snapBytes is the size of the snapshot last loaded or written.
	snapBytes atomic.Uint64

	// A move's target follows the stream between warm-up and its first command (follow.go).
	unfollow    context.CancelFunc
	followToken *int
	advanced    chan struct{} // closed and replaced when the follow advances contig
}

// add applies ev unless its subject has reached it already, giving it its version. An epoch
// marker is not the service's: it raises the tenant's epoch and is not applied to the state.
func (ts *tenant[S]) add(ev Event) error {
	if ev.Subject == EpochSubject {
		var m epochMarker
		if err := json.Unmarshal(ev.Data, &m); err != nil {
			return fmt.Errorf("events: epoch marker %d of %s: %w", ev.Seq, ts.name, err)
		}
		ts.epoch = max(ts.epoch, m.Epoch)
		ts.applied = max(ts.applied, ev.Seq)
		return nil
	}
	pos := ts.subjects[ev.Subject]
	if pos.Seq >= ev.Seq {
		return nil
	}
	ev.Version = pos.Version + 1
	if err := ts.apply(ts.state, ev); err != nil {
		return fmt.Errorf("events: event %d on %s of %s: %w", ev.Seq, ev.Subject, ts.name, err)
	}
	ts.subjects[ev.Subject] = Position{Version: ev.Version, Seq: ev.Seq}
	ts.events.Add(1)
	ts.bytes.Add(eventBytes(ts.name, ev))
	ts.idem.put(ev)
	ts.applied = max(ts.applied, ev.Seq)
	ts.sinceSnap++
	return nil
}

// catchUp applies every event of the tenant after contig. Caller holds mu.
func (ts *tenant[S]) catchUp(ctx context.Context, es *store) error {
	// Usually nothing is new (a move's source wrote the tenant's events itself): one direct
	// read of the newest event says so, where a replay costs a consumer's creation and a scan.
	newest, err := es.lastSeq(ctx, es.tenantFilter(ts.name))
	if err != nil {
		return err
	}
	if newest <= ts.contig {
		return nil
	}
	last, err := es.replay(ctx, ts.name, es.tenantFilter(ts.name), ts.contig, ts.add)
	if err != nil {
		return err
	}
	ts.contig = max(ts.contig, last)
	ts.applied = max(ts.applied, ts.contig)
	return nil
}

// fresh reports whether this instance has applied the tenant's last stored event.
func (ts *tenant[S]) fresh(ctx context.Context, es *store) (bool, error) {
	last, err := es.lastSeq(ctx, es.tenantFilter(ts.name))
	if err != nil {
		return false, err
	}
	return ts.contig >= last, nil
}

// catchUpSubject applies the events of one subject this instance has not seen.
func (ts *tenant[S]) catchUpSubject(ctx context.Context, es *store, subject string) error {
	_, err := es.replay(ctx, ts.name, es.subject(ts.name, subject), ts.subjects[subject].Seq, ts.add)
	return err
}

func (ts *tenant[S]) snapshot() *snapshot[S] {
	subj := make(map[string]Position, len(ts.subjects))
	for k, v := range ts.subjects {
		subj[k] = v
	}
	return &snapshot[S]{Format: snapshotFormat, Tenant: ts.name, Applied: ts.contig, Subjects: subj, Recent: ts.idem.entries(), State: ts.state,
		Events: ts.events.Load(), Bytes: ts.bytes.Load(), Epoch: ts.epoch}
}

// eventBytes is what one event stores beyond JetStream's fixed overhead: its subject
// (events.<tenant>.<subject>), its type and key headers and its body.
func eventBytes(tenant string, ev Event) uint64 {
	return uint64(len("events.") + len(tenant) + 1 + len(ev.Subject) + len(ev.Type) + len(ev.Key) + len(ev.Data))
}

// Strategy is how a tenant's state is rebuilt when a shard takes it over.
type Strategy string

const (
	// StrategySnapshot loads the newest snapshot and replays the events after it.
	StrategySnapshot Strategy = "snapshot"
	// StrategyReplay rebuilds from the first event (cold rehydrate).
	StrategyReplay Strategy = "replay"
)

// LoadReport says how a tenant was loaded.
type LoadReport struct {
	Strategy      Strategy
	SnapshotHit   bool
	SnapshotSeq   uint64
	SnapshotBytes int
	Replayed      int
	Took          time.Duration
}

// load rebuilds a tenant's state with strategy and reports how.
func load[S any](ctx context.Context, es *store, cfg *Config[S], name string, strategy Strategy) (*tenant[S], LoadReport, error) {
	start := time.Now()
	ts := &tenant[S]{name: name, state: cfg.New(), apply: cfg.Apply, subjects: map[string]Position{},
		idem: newWindow(cfg.Window), advanced: make(chan struct{})}
	rep := LoadReport{Strategy: strategy}
	if strategy == StrategySnapshot {
		s, n, err := loadSnapshot(ctx, es, name, cfg.New)
		if err != nil {
			return nil, rep, err
		}
		if s != nil {
			ts.state, ts.contig, ts.applied, ts.epoch = s.State, s.Applied, s.Applied, s.Epoch
			ts.events.Store(s.Events)
			ts.bytes.Store(s.Bytes)
			ts.snapBytes.Store(uint64(n))
			for k, v := range s.Subjects {
				ts.subjects[k] = v
			}
			for _, e := range s.Recent {
				ts.idem.put(e)
			}
			rep.SnapshotHit, rep.SnapshotBytes, rep.SnapshotSeq = true, n, s.Applied
		}
	}
	if err := ts.catchUp(ctx, es); err != nil {
		return nil, rep, fmt.Errorf("events: load %s: %w", name, err)
	}
	rep.Replayed = ts.sinceSnap
	rep.Took = time.Since(start)
	return ts, rep, nil
}
