package projection

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/tenantmesh/tenantmesh/services/ledger"
	"github.com/tenantmesh/tenantmesh/shardkit/events"
	"github.com/tenantmesh/tenantmesh/shardkit/jsx"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// errTooFar: a replay with several filters has too many events to deliver.
var errTooFar = errors.New("projection: too many events for one multi-filter replay")

// store reads TM_EVENTS and keeps the views' snapshots and checkpoints.
type store struct {
	jsc    *jsx.Client
	js     jetstream.JetStream
	stream jetstream.Stream
	views  jetstream.ObjectStore
	checks jetstream.KeyValue
	batch  int
	log    *slog.Logger
}

// Checkpoint is a tenant's record in tm_projection_checkpoints: the applied sequence its
// stored views (objects <tenant> and <tenant>/tx/<n> in tm_projection_views) cover, and their
// size.
type Checkpoint struct {
	Tenant  string    `json:"tenant"`
	Applied uint64    `json:"applied"`
	Bytes   int       `json:"bytes"`
	At      time.Time `json:"at"`
}

func openEventStore(ctx context.Context, st *schema.Store, log *slog.Logger) (*store, error) {
	if err := st.EnsureEventsStream(ctx); err != nil {
		return nil, err
	}
	js := st.JS().JetStream()
	stream, err := st.JS().Stream(ctx, schema.StreamEvents)
	if err != nil {
		return nil, fmt.Errorf("projection: open %s: %w", schema.StreamEvents, err)
	}
	bucket := schema.ServiceBucket("projection", "views")
	views, err := st.JS().ObjectStore(ctx, bucket, "projection service: per-tenant views with the sequence they cover")
	if err != nil {
		return nil, fmt.Errorf("projection: open %s: %w", bucket, err)
	}
	checks, err := st.JS().EnsureKV(ctx, jsx.KVSpec{Bucket: schema.ServiceBucket("projection", "checkpoints"), Description: "projection service: per-tenant checkpoints"})
	if err != nil {
		return nil, err
	}
	return &store{jsc: st.JS(), js: js, stream: stream, views: views, checks: checks, batch: 4096, log: log}, nil
}

// decodeEvent turns a message into an event: an error for a corrupt one, or one stored in a
// newer format than this binary reads (jsx.ErrNewerFormat).
func decodeEvent(m jetstream.Msg) (ledger.Event, error) {
	md, err := m.Metadata()
	if err != nil {
		return ledger.Event{}, err
	}
	if err := events.CheckFormat(m.Headers()); err != nil {
		return ledger.Event{Seq: md.Sequence.Stream}, fmt.Errorf("projection: event %d on %s: %w", md.Sequence.Stream, m.Subject(), err)
	}
	var ev ledger.Event
	if err := json.Unmarshal(m.Data(), &ev); err != nil {
		return ledger.Event{Seq: md.Sequence.Stream}, fmt.Errorf("projection: event %d on %s is corrupt: %w", md.Sequence.Stream, m.Subject(), err)
	}
	ev.Seq = md.Sequence.Stream
	return ev, nil
}

// tenantOfSubject extracts <tenant> from events.<tenant>.<type>.<id>.
func tenantOfSubject(subj string) string {
	rest, ok := strings.CutPrefix(subj, "events.")
	if !ok {
		return ""
	}
	t, _, _ := strings.Cut(rest, ".")
	return t
}

// replay calls fn with every event on filters after sequence after, in order, until it has
// delivered the last one present when it started (or one at or past until, the stream's last
// sequence read before), and returns how many it delivered.
// With several filters and maxPending > 0, it returns errTooFar, having delivered nothing, if
// more than maxPending events match (JetStream serves many filters slowly from far behind).
func (s *store) replay(ctx context.Context, filters []string, after, until uint64, maxPending int, fn func(subject string, ev ledger.Event, err error) error) (int, error) {
	r, err := jsx.Read(ctx, s.js, schema.StreamEvents, jsx.ReadConfig{Filters: filters, Start: after + 1, Batch: s.batch, Inactive: 30 * time.Second, Logger: s.log})
	if err != nil {
		return 0, fmt.Errorf("projection: replay %d subjects: %w", len(filters), err)
	}
	defer r.Stop()
	pending := r.Pending()
	if pending == 0 {
		return 0, nil
	}
	if maxPending > 0 && len(filters) > 1 && pending > uint64(maxPending) {
		return 0, errTooFar
	}
	n := 0
	for {
		wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		m, md, err := r.Next(wctx)
		cancel()
		if err != nil {
			if ctx.Err() != nil {
				return n, ctx.Err()
			}
			return n, fmt.Errorf("projection: replay %d subjects stalled after %d events: %w", len(filters), n, err)
		}
		ev, derr := decodeEvent(m)
		if err := fn(m.Subject(), ev, derr); err != nil {
			return n, err
		}
		n++
		if md.NumPending == 0 || md.Sequence.Stream >= until {
			return n, nil
		}
	}
}

// lastSeq is the stream sequence of the newest event of tenant (0 if none), from any replica,
// each try bounded: every query reports its lag with it, and a query in flight when NATS
// stopped a node waited out nats.go's whole 5 s timeout for it, holding a move's source drain
// as long (chaos, 2026-11-26).
func (s *store) lastSeq(ctx context.Context, tenant string) (uint64, error) {
	seq, err := s.jsc.DirectLastSeq(ctx, s.stream, schema.TenantEvents(tenant))
	if err != nil {
		return 0, fmt.Errorf("projection: last event of %s: %w", tenant, err)
	}
	return seq, nil
}

// pending counts the tenant's events after sequence after (an ephemeral consumer's pending
// count: exact, and one round trip).
func (s *store) pending(ctx context.Context, tenant string, after uint64) (uint64, error) {
	r, err := jsx.Read(ctx, s.js, schema.StreamEvents, jsx.ReadConfig{Filters: []string{schema.TenantEvents(tenant)}, Start: after + 1})
	if err != nil {
		return 0, fmt.Errorf("projection: count pending events of %s: %w", tenant, err)
	}
	r.Stop()
	return r.Pending(), nil
}

// checkpoint reads the tenant's checkpoint record (zero if none).
func (s *store) checkpoint(ctx context.Context, tenant string) (Checkpoint, error) {
	e, err := s.checks.Get(ctx, tenant)
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return Checkpoint{Tenant: tenant}, nil
	}
	if err != nil {
		return Checkpoint{}, fmt.Errorf("projection: read checkpoint of %s: %w", tenant, err)
	}
	var cp Checkpoint
	if err := json.Unmarshal(e.Value(), &cp); err != nil {
		return Checkpoint{}, fmt.Errorf("projection: checkpoint of %s is corrupt: %w", tenant, err)
	}
	return cp, nil
}
