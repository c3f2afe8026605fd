// Package kvwatch follows a JetStream KV bucket and survives what kills nats.go's own watcher.
//
// nats.go's KeyValue.Watch runs on an ordered push consumer that, on some failures, closes its
// channel silently or recovers only after 8-17 s. A Follower instead owns an ephemeral pull
// consumer on the bucket's stream with idle heartbeats: a dead or stale consumer is noticed
// within two heartbeat intervals and replaced by one that starts at the revision after the last
// one applied, so the handler sees every revision once, in order, with no gap and no duplicate.
//
// A consumer lives on one server of a cluster. When that server stops, the consumer is gone,
// and a Follower hears it at the latest after two heartbeats; sooner when a stream's new
// leader is announced with that server among its offline replicas (the JetStream advisory
// $JS.EVENT.ADVISORY.STREAM.LEADER_ELECTED, sent when a stopping server hands off its
// leaderships): the consumer is made again at once.
//
// A Follower first delivers the current value of every key (or every revision after a start
// revision), then calls the handler's Synced once, then delivers updates as they happen.
package kvwatch

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/tenantmesh/tenantmesh/internal/backoff"
	"github.com/tenantmesh/tenantmesh/shardkit/jsx"
)

// Op is what happened to a key.
type Op uint8

const (
	Put Op = iota
	Delete
	Purge
)

// Entry is one revision of one key.
type Entry struct {
	Key      string
	Value    []byte
	Revision uint64
	Op       Op
	Created  time.Time
}

// Handler receives a bucket's entries. Apply and Synced are called from the follower's
// goroutine only, one at a time.
type Handler interface {
	// Apply is called once per revision, in revision order.
	Apply(Entry)
	// Synced is called when the initial values are in (once per Run).
	Synced()
}

// Config configures a Follower.
type Config struct {
	JS     jetstream.JetStream
	Bucket string
	// Filter selects keys ("" or ">" for all); it may use NATS wildcards.
	Filter string
	// After: start with the revisions after this one instead of each key's current value.
	// Used to resume from a snapshot that covers revisions up to After.
	After uint64
	// Heartbeat is the consumer's idle heartbeat; a consumer silent for twice this long is
	// replaced. Default 500ms.
	Heartbeat time.Duration
	// Batch is how many messages one pull asks for. Default 4096.
	Batch int
	// Retry is the wait between attempts to recreate the consumer. Default 100ms, doubling to
	// 4s while attempts keep failing, each wait drawn at random from its second half so that a
	// fleet that lost its consumers at once does not come back at once.
	Retry time.Duration
	// Logger; if nil, logs are discarded.
	Logger *slog.Logger
}

// Stats are a follower's counters.
type Stats struct {
	Revision uint64 // last revision applied
	Applied  uint64 // entries applied
	Resumes  uint64 // consumers recreated after a failure
	Gaps     uint64 // sequence gaps detected (each causes a resume)
	// LastMessage is when the last entry arrived.
	LastMessage time.Time
	// DownSince is when the follower lost its consumer, zero while it has one. Routing from a
	// snapshot that has been down for long is routing from stale data: report it.
	DownSince time.Time
	Synced    bool
	// Server is the server that holds the consumer ("" without one, or outside a cluster).
	Server string
}

// Follower follows one bucket. Create with New, run with Run.
type Follower struct {
	cfg    Config
	h      Handler
	prefix string

	rev         atomic.Uint64
	applied     atomic.Uint64
	resumes     atomic.Uint64
	gaps        atomic.Uint64
	lastMessage atomic.Int64
	downSince   atomic.Int64
	synced      atomic.Bool

	deletes sync.WaitGroup // of the consumers of ended sessions

	servers *jsx.ServerWatch // set by Run

	mu     sync.Mutex
	server string // where the session's consumer lives
	stop   func() // ends the session
}

// New makes a follower; it does nothing until Run.
func New(cfg Config, h Handler) (*Follower, error) {
	if cfg.JS == nil || cfg.Bucket == "" || h == nil {
		return nil, errors.New("kvwatch: JS, Bucket and a handler are required")
	}
	if cfg.Filter == "" {
		cfg.Filter = ">"
	}
	if cfg.Heartbeat <= 0 {
		cfg.Heartbeat = 500 * time.Millisecond
	}
	if cfg.Batch <= 0 {
		cfg.Batch = 4096
	}
	if cfg.Retry <= 0 {
		cfg.Retry = 100 * time.Millisecond
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	// JetStream's KV naming: a bucket's stream is KV_<bucket>, a key's subject $KV.<bucket>.<key>.
	f := &Follower{cfg: cfg, h: h, prefix: "$KV." + cfg.Bucket + "."}
	f.rev.Store(cfg.After)
	return f, nil
}

// Stats returns the follower's counters.
func (f *Follower) Stats() Stats {
	return Stats{
		Revision:    f.rev.Load(),
		Applied:     f.applied.Load(),
		Resumes:     f.resumes.Load(),
		Gaps:        f.gaps.Load(),
		LastMessage: unixTime(f.lastMessage.Load()),
		DownSince:   unixTime(f.downSince.Load()),
		Synced:      f.synced.Load(),
		Server:      f.currentServer(),
	}
}

func unixTime(ns int64) time.Time {
	if ns == 0 {
		return time.Time{}
	}
	return time.Unix(0, ns)
}

// Revision is the last revision applied.
func (f *Follower) Revision() uint64 { return f.rev.Load() }

// Run follows the bucket until ctx ends. It returns ctx's error; failures on the way are
// logged and retried.
func (f *Follower) Run(ctx context.Context) error {
	defer f.deletes.Wait()
	f.servers = jsx.WatchServers(f.cfg.JS.Conn(), f.serversOffline)
	defer f.servers.Leave()
	pauses, createTry := backoff.Policy{Initial: f.cfg.Retry, Max: maxRetry, Jitter: backoff.Half}.Pauses(), firstCreateTry
	for ctx.Err() == nil {
		err := f.session(ctx, createTry)
		// A create whose answer was lost (a meta leader that stopped took it) is made again
		// after a short try, not after a long one; a slow cluster gets longer ones.
		if errors.Is(err, context.DeadlineExceeded) {
			createTry = min(2*createTry, maxCreateTry)
			if nc := f.cfg.JS.Conn(); ctx.Err() == nil {
				if server := nc.ConnectedServerName(); jsx.APITimedOut(nc) {
					f.cfg.Logger.Warn("leaving a NATS server whose JetStream API requests keep timing out",
						"bucket", f.cfg.Bucket, "server", server)
				}
			}
		} else {
			createTry = firstCreateTry
		}
		if ctx.Err() != nil {
			break
		}
		f.downSince.CompareAndSwap(0, time.Now().UnixNano())
		f.resumes.Add(1)
		f.cfg.Logger.Warn("kv follower resuming", "bucket", f.cfg.Bucket, "after_revision", f.rev.Load(), "err", err)
		if errors.Is(err, errGap) {
			continue // resume at once; the server is fine
		}
		if errors.Is(err, errOfflineServer) || errors.Is(err, jsx.ErrPullsUnheard) {
			pauses.Reset() // made where it cannot live, or cannot be reached: again, soon
		}
		pauses.Wait(ctx)
		if err == nil {
			pauses.Reset()
		}
	}
	return ctx.Err()
}

var (
	errGap           = errors.New("sequence gap")
	errOfflineServer = errors.New("consumer made on a server that went offline")
)

// syncCheckTry bounds the request that checks a follower has seen every key before it says
// it is synced.
const syncCheckTry = 2 * time.Second

// maxRetry bounds the wait between attempts to recreate a consumer.
const maxRetry = 4 * time.Second

// firstCreateTry bounds a session's consumer create; after one that timed out, the next
// session's is twice as long, up to maxCreateTry.
const (
	firstCreateTry = time.Second
	maxCreateTry   = 8 * time.Second
)

// session runs one consumer until it fails.
func (f *Follower) session(ctx context.Context, createTry time.Duration) error {
	cctx, cancel := context.WithTimeout(ctx, createTry)
	streamName := "KV_" + f.cfg.Bucket
	cc := jetstream.ConsumerConfig{
		FilterSubject:     f.prefix + f.cfg.Filter,
		AckPolicy:         jetstream.AckNonePolicy,
		MemoryStorage:     true,
		Replicas:          1,
		InactiveThreshold: 30 * time.Second,
		MaxWaiting:        4,
		HeadersOnly:       false,
	}
	after := f.rev.Load()
	if after == 0 {
		cc.DeliverPolicy = jetstream.DeliverLastPerSubjectPolicy
	} else {
		cc.DeliverPolicy = jetstream.DeliverByStartSequencePolicy
		cc.OptStartSeq = after + 1
	}
	// One API request per session (no stream lookup first): a fleet starting at once makes
	// a thousand of them, all through the cluster's meta leader.
	cons, err := f.cfg.JS.CreateConsumer(cctx, streamName, cc)
	cancel()
	if err != nil {
		return fmt.Errorf("create consumer: %w", err)
	}
	jsx.APIAnswered(f.cfg.JS.Conn())
	// The consumer is deleted beside the next session, not before it: after its server
	// stopped, the delete may take its whole bound to fail.
	defer f.deletes.Go(func() {
		dctx, dcancel := context.WithTimeout(context.Background(), time.Second)
		_ = f.cfg.JS.DeleteConsumer(dctx, streamName, cons.CachedInfo().Name)
		dcancel()
	})
	if server := jsx.ConsumerServer(cons.CachedInfo()); f.servers.Offline(server) {
		return fmt.Errorf("%w: %s", errOfflineServer, server)
	}
	if err := jsx.AwaitPulls(ctx, f.cfg.JS.Conn(), streamName, cons.CachedInfo(), time.Second); err != nil {
		return err
	}
	f.downSince.Store(0)
	// Synced once nothing is left and nothing newer exists (jsx.CaughtUp: the consumer's count
	// of what is left can read 0 a moment early when a write replaces a key it had yet to send).
	caught := jsx.NewCaughtUp(f.cfg.JS.Conn(), streamName, f.prefix+f.cfg.Filter)
	if !f.synced.Load() && cons.CachedInfo().NumPending == 0 {
		if err := f.checkSynced(ctx, caught, after); err != nil {
			return err
		}
	}
	it, err := cons.Messages(
		jetstream.PullMaxMessages(f.cfg.Batch),
		jetstream.PullHeartbeat(f.cfg.Heartbeat),
		jetstream.WithMessagesErrOnMissingHeartbeat(true),
	)
	if err != nil {
		return fmt.Errorf("pull: %w", err)
	}
	defer it.Stop()
	stop := context.AfterFunc(ctx, it.Stop)
	defer stop()
	f.setSession(cons.CachedInfo(), it.Stop)
	defer f.setSession(nil, nil)
	// An advisory heard since the check above found no session to end: look again (one heard
	// from now on ends it).
	if server := jsx.ConsumerServer(cons.CachedInfo()); f.servers.Offline(server) {
		return fmt.Errorf("%w: %s", errOfflineServer, server)
	}
	var consSeq uint64
	for {
		m, err := it.Next()
		if err != nil {
			return fmt.Errorf("next: %w", err)
		}
		f.lastMessage.Store(time.Now().UnixNano())
		md, err := m.Metadata()
		if err != nil {
			return fmt.Errorf("metadata: %w", err)
		}
		if md.Sequence.Consumer != consSeq+1 {
			f.gaps.Add(1)
			return fmt.Errorf("%w: consumer sequence %d after %d", errGap, md.Sequence.Consumer, consSeq)
		}
		consSeq = md.Sequence.Consumer
		if md.Sequence.Stream > f.rev.Load() {
			f.apply(m, md)
		}
		if md.NumPending == 0 && !f.synced.Load() {
			if err := f.checkSynced(ctx, caught, md.Sequence.Stream); err != nil {
				return err
			}
		}
	}
}

// checkSynced marks the follower synced if nothing under its filter is newer than seq, the
// newest message it has: one request. A failed one ends the session; the next counts afresh.
func (f *Follower) checkSynced(ctx context.Context, caught *jsx.CaughtUp, seq uint64) error {
	cctx, cancel := context.WithTimeout(ctx, syncCheckTry)
	defer cancel()
	done, err := caught.Check(cctx, seq)
	if err != nil {
		return fmt.Errorf("check synced: %w", err)
	}
	if done {
		f.markSynced()
	}
	return nil
}

func (f *Follower) setSession(info *jetstream.ConsumerInfo, stop func()) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.server, f.stop = jsx.ConsumerServer(info), stop
}

func (f *Follower) currentServer() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.server
}

// serversOffline ends the session if its consumer's server is among the offline: the
// consumer went with it.
func (f *Follower) serversOffline(stream string, offline []string) {
	f.mu.Lock()
	server, stop := f.server, f.stop
	f.mu.Unlock()
	if server == "" || stop == nil || !slices.Contains(offline, server) {
		return
	}
	f.cfg.Logger.Info("kv follower's server went offline; making its consumer again", "bucket", f.cfg.Bucket,
		"server", server, "seen_on", stream)
	stop()
}

func (f *Follower) apply(m jetstream.Msg, md *jetstream.MsgMetadata) {
	e := Entry{
		Key:      strings.TrimPrefix(m.Subject(), f.prefix),
		Value:    m.Data(),
		Revision: md.Sequence.Stream,
		Created:  md.Timestamp,
	}
	if h := m.Headers(); len(h) > 0 {
		switch h.Get("KV-Operation") {
		case "DEL":
			e.Op = Delete
		case "PURGE":
			e.Op = Purge
		default:
			switch h.Get("Nats-Marker-Reason") {
			case "MaxAge", "Purge":
				e.Op = Purge
			case "Remove":
				e.Op = Delete
			}
		}
	}
	f.h.Apply(e)
	f.rev.Store(e.Revision)
	f.applied.Add(1)
}

func (f *Follower) markSynced() {
	f.synced.Store(true)
	f.h.Synced()
}
