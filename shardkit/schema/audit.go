package schema

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/nats-io/nuid"
	"github.com/tenantmesh/tenantmesh/shardkit/jsx"
)

// AuditEvent records one placement change or workflow step in TM_AUDIT.
type AuditEvent struct {
	Time   time.Time `json:"time"`
	Actor  string    `json:"actor"`  // who: "rebalancer/<id>", "gateway/<id>", "cli/<user>"
	Action string    `json:"action"` // what: "placement.assign", "move.handoff", ...
	Kind   string    `json:"kind,omitempty"`
	Tenant string    `json:"tenant,omitempty"`
	Plan   string    `json:"plan,omitempty"`
	Move   string    `json:"move,omitempty"`
	Before any       `json:"before,omitempty"`
	After  any       `json:"after,omitempty"`
	// Revision is the KV revision the change produced.
	Revision uint64 `json:"revision,omitempty"`
	Detail   string `json:"detail,omitempty"`

	// ID, if set, names the event for the journal's duplicate window (2 minutes): an event
	// recorded twice under one ID is kept once (an observer and a resumed observer of one step).
	ID string `json:"-"`

	// Seq is the event's sequence in TM_AUDIT (set when read).
	Seq uint64 `json:"-"`
}

// AuditLog is the handle on the audit journal, the stream TM_AUDIT:
// store.Audit().Append(ctx, ev).
type AuditLog struct{ s *Store }

// Audit is the handle on the audit journal.
func (s *Store) Audit() AuditLog { return AuditLog{s} }

// Append appends ev to the journal and waits for JetStream's acknowledgement.
func (a AuditLog) Append(ctx context.Context, ev AuditEvent) error {
	if ev.Time.IsZero() {
		ev.Time = time.Now().UTC()
	}
	if ev.Action == "" || ev.Actor == "" {
		return fmt.Errorf("%w: audit events need an actor and an action", ErrInvalid)
	}
	if ev.Tenant != "" {
		if err := CheckTenant(ev.Tenant); err != nil {
			return err
		}
	}
	b, err := json.Marshal(ev)
	if err != nil {
		return fmt.Errorf("schema: encode audit event: %w", err)
	}
	// An unanswered publish is made again with the same message id, which the stream's
	// duplicate window drops if the first one was stored.
	id := ev.ID
	if id == "" {
		id = nuid.Next()
	}
	if err := a.s.js.PublishOnce(ctx, AuditSubject(ev.Kind, ev.Tenant), b, id); err != nil {
		return fmt.Errorf("schema: publish audit %s: %w", ev.Action, err)
	}
	return nil
}

// AuditQuery selects journal entries. The zero value reads the newest 100.
type AuditQuery struct {
	Kind, Tenant string    // "" for any
	Since        time.Time // zero: no lower bound
	Limit        int       // newest entries returned, at most; default 100, max 10000
}

// Read returns the newest entries matching q, oldest first. A read that fails transiently (see
// ErrUnavailable) is started again within the store's timeout.
func (a AuditLog) Read(ctx context.Context, q AuditQuery) ([]AuditEvent, error) {
	var out []AuditEvent
	err := a.s.js.Read(ctx, func(ctx context.Context) (err error) {
		out, err = a.read(ctx, q)
		return err
	})
	return out, err
}

func (a AuditLog) read(ctx context.Context, q AuditQuery) ([]AuditEvent, error) {
	// Names, not wildcards: they become the consumer's subject filter.
	if q.Kind != "" {
		if err := CheckName("kind", q.Kind); err != nil {
			return nil, err
		}
	}
	if q.Tenant != "" && !ValidTenant(q.Tenant) {
		return nil, CheckTenant(q.Tenant)
	}
	if q.Limit <= 0 {
		q.Limit = 100
	}
	q.Limit = min(q.Limit, 10000)
	kind, tenant := q.Kind, q.Tenant
	if kind == "" {
		kind = "*"
	}
	if tenant == "" {
		tenant = "*"
	}
	cfg := jsx.ReadConfig{Filters: []string{"tm.audit." + kind + "." + tenant}, Batch: 1000}
	if !q.Since.IsZero() {
		cfg.Since = q.Since
	} else if q.Kind == "" && q.Tenant == "" {
		info, err := a.s.js.JetStream().Stream(ctx, StreamAudit)
		if err != nil {
			return nil, fmt.Errorf("schema: audit stream: %w", err)
		}
		st := info.CachedInfo().State
		if st.Msgs == 0 {
			return nil, nil
		}
		start := st.FirstSeq
		if st.LastSeq >= uint64(q.Limit) && st.LastSeq-uint64(q.Limit)+1 > start {
			start = st.LastSeq - uint64(q.Limit) + 1
		}
		cfg.Start = start
	}
	r, err := jsx.Read(ctx, a.s.js.JetStream(), StreamAudit, cfg)
	if err != nil {
		return nil, fmt.Errorf("schema: read audit: %w", err)
	}
	defer r.Stop()
	if r.Pending() == 0 {
		return nil, nil
	}
	ring := make([]AuditEvent, 0, q.Limit)
	for pending := r.Pending(); pending > 0; {
		wctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		m, md, err := r.Next(wctx)
		cancel()
		if err != nil {
			return nil, fmt.Errorf("schema: read audit: %w", err)
		}
		pending = md.NumPending
		var ev AuditEvent
		if err := json.Unmarshal(m.Data(), &ev); err != nil {
			a.s.opts.Logger.Warn("skipping corrupt audit event", "seq", md.Sequence.Stream, "err", err)
			continue
		}
		ev.Seq = md.Sequence.Stream
		if len(ring) == q.Limit {
			ring = append(ring[:0], ring[1:]...)
		}
		ring = append(ring, ev)
	}
	return ring, nil
}
