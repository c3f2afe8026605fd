// Package aggregate is the aggregate shard service: a tenant-scoped command API whose state is
// event-sourced on JetStream, with single-writer safety, snapshots and both warm-up strategies
// of the Cloudlysis PRD (snapshot migration and cold replay).
//
// # Overview
//
// The domain is a ledger of accounts (open, deposit, withdraw never below zero, close): decide
// and evolve in ledger.go. Everything else is shardkit/events: each command appends one event
// to TM_EVENTS on events.<tenant>.account.<id> with JetStream's expected-last-subject-sequence
// set to the last event this instance applied for that account (a second writer cannot fork an
// account's history: it catches the account up and decides again), the message id and a
// per-tenant window of recent outcomes make a retried command apply once, also across a move,
// and the tenant's state lives in memory, rebuilt from the newest snapshot (object store
// tm_aggregate_snapshots, written every SnapshotEvery events and when a tenant is released)
// plus later events.
package aggregate

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"regexp"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/tenantmesh/tenantmesh/internal/tracing"
	"github.com/tenantmesh/tenantmesh/shardkit/events"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// Config configures a Service. The zero value of each field is its documented default.
type Config struct {
	Store *schema.Store
	// SnapshotEvery: a tenant's snapshot is written after this many new events. Default 1000.
	SnapshotEvery int
	// IdempotencyWindow: outcomes remembered per tenant for retries. Default 10000.
	IdempotencyWindow int
	// Strategy used when a move does not name one, and for lazy loads. Default snapshot.
	Strategy Strategy
	// CommandTimeout bounds one command's NATS calls. Default 5s.
	CommandTimeout time.Duration
	// MaxAttempts bounds the catch-ups before a command is rejected on state a sibling instance
	// may have moved on from. Default 5. A command that lost an append to another writer is
	// decided again until CommandTimeout runs out, not a fixed number of times: a client gets
	// no failure it did nothing to cause (the gateway sends a tenant's commands to one
	// instance, so such races are rare: clients that bypass it, a change of writer).
	MaxAttempts int
	Logger      *slog.Logger
	Registerer  prometheus.Registerer
}

// Strategy is how a tenant's state is rebuilt when a shard takes it over (the Cloudlysis PRD
// section 4).
type Strategy = events.Strategy

const (
	// StrategySnapshot loads the newest snapshot and replays the events after it.
	StrategySnapshot = events.StrategySnapshot
	// StrategyReplay rebuilds from the first event (cold rehydrate).
	StrategyReplay = events.StrategyReplay
)

// Service holds the ledgers of the tenants this instance hosts.
type Service struct {
	cfg Config
	log *events.Log[*ledgerState]
	m   *metrics
}

// ledgerState is one tenant's ledger: what its events come to.
type ledgerState struct {
	Accounts map[string]*Account `json:"accounts"`
	Totals   Totals              `json:"totals"`
}

func newLedgerState() *ledgerState { return &ledgerState{Accounts: map[string]*Account{}} }

// apply folds a stored event into the ledger.
func applyEvent(st *ledgerState, e events.Event) error {
	ev, err := decodeEvent(e)
	if err != nil {
		return err
	}
	if st.Accounts == nil {
		st.Accounts = map[string]*Account{}
	}
	st.Accounts[ev.AggregateID] = evolve(st.Accounts[ev.AggregateID], ev, &st.Totals)
	return nil
}

// decodeEvent reads the ledger event a stored one carries, with its stream sequence and (when
// known) the version shardkit/events counted for its account.
func decodeEvent(e events.Event) (Event, error) {
	var ev Event
	if err := json.Unmarshal(e.Data, &ev); err != nil {
		return Event{}, fmt.Errorf("corrupt ledger event: %w", err)
	}
	ev.Seq = e.Seq
	if e.Version > 0 {
		ev.Version = e.Version
	}
	return ev, nil
}

// subject is an account's subject within its tenant's events: account.<id>.
func subject(id string) string { return AccountType + "." + id }

// New opens the event stream and the snapshot bucket.
func New(ctx context.Context, cfg Config) (*Service, error) {
	if cfg.Store == nil {
		return nil, errors.New("aggregate: Store is required")
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if err := cfg.Store.EnsureEventsStream(ctx); err != nil {
		return nil, err
	}
	stream, err := cfg.Store.JS().Stream(ctx, schema.StreamEvents)
	if err != nil {
		return nil, fmt.Errorf("aggregate: open %s: %w", schema.StreamEvents, err)
	}
	m := newMetrics(cfg.Registerer, stream)
	log, err := events.New(ctx, events.Config[*ledgerState]{
		Store: cfg.Store, Kind: "aggregate", Stream: schema.StreamEvents,
		Prefix: func(tenant string) string { return strings.TrimSuffix(schema.TenantEvents(tenant), ">") },
		New:    newLedgerState, Apply: applyEvent, Snapshots: schema.ServiceBucket("aggregate", "snapshots"),
		SnapshotEvery: cfg.SnapshotEvery, Window: cfg.IdempotencyWindow, Strategy: cfg.Strategy,
		Timeout: cfg.CommandTimeout, MaxAttempts: cfg.MaxAttempts, Logger: cfg.Logger, Metrics: m.log,
	})
	if err != nil {
		return nil, fmt.Errorf("aggregate: %w", err)
	}
	return &Service{cfg: cfg, log: log, m: m}, nil
}

// Run writes snapshots queued by commands and owns the warmed targets' follows, until ctx ends.
func (s *Service) Run(ctx context.Context) error { return s.log.Run(ctx) }

var aggregateID = regexp.MustCompile(`^[A-Za-z0-9_-]{1,64}$`)

// Result is a command's outcome.
type Result struct {
	AggregateType string `json:"aggregate_type"`
	AggregateID   string `json:"aggregate_id"`
	Version       uint64 `json:"version"`
	Event         string `json:"event"`
	Seq           uint64 `json:"seq"`
	// Replayed is true when the idempotency key had been applied before: nothing new happened.
	Replayed bool `json:"replayed"`
}

// Handle decides and appends one command for tenant (shardkit/events' Execute: the append
// fence, catch-up and retry, the idempotency window).
func (s *Service) Handle(ctx context.Context, tenant string, cmd Command) (Result, error) {
	if !aggregateID.MatchString(cmd.AggregateID) {
		return Result{}, fmt.Errorf("%w: aggregate_id %q must be 1 to 64 characters of [A-Za-z0-9_-]", ErrBadPayload, cmd.AggregateID)
	}
	if cmd.IdempotencyKey == "" || len(cmd.IdempotencyKey) > 200 {
		return Result{}, fmt.Errorf("%w: idempotency_key (or the Idempotency-Key header) is required, at most 200 bytes, so a retried command applies once", ErrBadPayload)
	}
	if tracing.On() {
		var span trace.Span
		ctx, span = tracer.Start(ctx, "command", trace.WithAttributes(attribute.String("tm.tenant", tenant),
			attribute.String("tm.command", cmd.Command), attribute.String("tm.aggregate", cmd.AggregateID)))
		defer span.End()
	}
	var rejected error
	res, err := s.log.Execute(ctx, tenant, subject(cmd.AggregateID), cmd.IdempotencyKey, func(st *ledgerState, at events.Position) (events.Event, error) {
		ev, err := decide(st.Accounts[cmd.AggregateID], cmd)
		if rejected = err; err != nil {
			return events.Event{}, err
		}
		ev.Tenant, ev.Version, ev.At = tenant, at.Version+1, time.Now().UTC()
		data, err := json.Marshal(ev)
		return events.Event{Type: ev.Event, Data: data}, err
	})
	switch {
	case err != nil && rejected != nil && errors.Is(err, rejected):
		s.m.commands.WithLabelValues(commandLabel(cmd.Command), "rejected").Inc()
		return Result{}, err
	case errors.Is(err, events.ErrKeyReused), errors.Is(err, events.ErrConflict):
		s.m.commands.WithLabelValues(commandLabel(cmd.Command), "rejected").Inc()
		return Result{}, fmt.Errorf("%w: %w", ErrVersionConflict, err)
	case err != nil:
		s.m.commands.WithLabelValues(commandLabel(cmd.Command), "error").Inc()
		return Result{}, err
	case res.Replayed:
		s.m.commands.WithLabelValues(commandLabel(cmd.Command), "replayed").Inc()
	default:
		s.m.commands.WithLabelValues(commandLabel(cmd.Command), "applied").Inc()
	}
	return Result{AggregateType: AccountType, AggregateID: strings.TrimPrefix(res.Subject, AccountType+"."), Version: res.Version,
		Event: res.Type, Seq: res.Seq, Replayed: res.Replayed}, nil
}

// Account reads one account, first catching it up with writes made by sibling instances.
func (s *Service) Account(ctx context.Context, tenant, id string) (Account, error) {
	if !aggregateID.MatchString(id) {
		return Account{}, fmt.Errorf("%w: account id %q must be 1 to 64 characters of [A-Za-z0-9_-]", ErrBadPayload, id)
	}
	var acc Account
	err := s.log.Read(ctx, tenant, subject(id), func(st *ledgerState, _ uint64) error {
		a := st.Accounts[id]
		if a == nil {
			return fmt.Errorf("%w: %s", ErrNoAccount, id)
		}
		acc = *a
		return nil
	})
	return acc, err
}

// Totals reads a tenant's ledger totals after catching up with the stream, and the sequence
// they cover.
func (s *Service) Totals(ctx context.Context, tenant string) (Totals, uint64, error) {
	var t Totals
	var applied uint64
	err := s.log.Read(ctx, tenant, "", func(st *ledgerState, seq uint64) error {
		t, applied = st.Totals, seq
		return nil
	})
	return t, applied, err
}

// Warm loads tenant (with the move's strategy, else the default) and catches it up until its
// applied sequence reaches fence. It is shardkit's warm hook.
func (s *Service) Warm(ctx context.Context, tenant string, fence uint64) error {
	return s.log.Warm(ctx, tenant, fence)
}

// Applied is the tenant's contiguous applied sequence (0 if not loaded). shardkit hook.
func (s *Service) Applied(tenant string) uint64 { return s.log.Applied(tenant) }

// Fence is the sequence a move's target must reach: the tenant's newest event in the stream
// (its siblings' writes included). shardkit hook.
func (s *Service) Fence(tenant string) uint64 { return s.log.Fence(tenant) }

// Release writes the tenant's final snapshot (so its next owner loads it) and drops it from
// memory. shardkit hook.
func (s *Service) Release(ctx context.Context, tenant string) error {
	return s.log.Release(ctx, tenant)
}

// Size describes a tenant for the rebalancer's choice of warm-up strategy.
type Size struct {
	Tenant        string `json:"tenant"`
	Events        uint64 `json:"events"`
	SnapshotSeq   uint64 `json:"snapshot_seq"`
	SnapshotBytes int    `json:"snapshot_bytes"`
	Accounts      int    `json:"accounts"`
	// Suggested is the cheaper strategy: replay when there is no snapshot or it covers little.
	Suggested Strategy `json:"suggested"`
}

// TenantSize reports a tenant's size in events and snapshot.
func (s *Service) TenantSize(ctx context.Context, tenant string) (Size, error) {
	sz, err := s.log.TenantSize(ctx, tenant)
	return Size{Tenant: sz.Tenant, Events: sz.Events, SnapshotSeq: sz.SnapshotSeq, SnapshotBytes: sz.SnapshotBytes,
		Accounts: sz.Subjects, Suggested: sz.Suggested}, err
}

// Hosted lists the tenants in memory.
func (s *Service) Hosted() []string { return s.log.Hosted() }

// replay calls fn with the ledger events of tenant's account id ("": all accounts) in stream
// order.
func (s *Service) replay(ctx context.Context, tenant, id string, fn func(Event) error) error {
	subj := ""
	if id != "" {
		subj = subject(id)
	}
	_, err := s.log.Replay(ctx, tenant, subj, 0, func(e events.Event) error {
		ev, err := decodeEvent(e)
		if err != nil {
			return err
		}
		return fn(ev)
	})
	return err
}

// tracer makes the aggregate's spans: a command, around the event store's append.
var tracer = tracing.NewTracer("github.com/tenantmesh/tenantmesh/services/aggregate")
