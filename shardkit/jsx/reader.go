package jsx

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/tenantmesh/tenantmesh/internal/backoff"
)

// Reader reads a stream's messages on some subjects in stream order, each once, from a start
// sequence, on an ephemeral consumer it owns. When that consumer fails (its server stopped: the
// stream leader advisories say so, or its idle heartbeats stop; a gap shows in its sequence; it
// is deleted), the Reader makes another that starts after the last message it returned, so the
// caller sees neither gap nor duplicate. Each create is bounded to half a second, doubling after
// one that went unanswered, up to 8 s.
//
// It replaces nats.go's ordered consumer for reads that must not stall: that one makes its
// consumer again with 10 s creates, and a create whose answer was lost while the cluster elected
// a meta leader held a projection's tail, and so a move's warm-up, for 10 s (docs/decisions.md,
// "Ordered reads own their consumer").
//
// Next is called from one goroutine; Stop may be called from any.
type Reader struct {
	js      jetstream.JetStream
	stream  string
	cfg     ReadConfig
	pending uint64

	stopped context.Context // done once Stop is called
	stop    context.CancelFunc
	servers *ServerWatch
	moved   atomic.Bool // the consumer's server was listed offline: make another

	mu   sync.Mutex
	cons jetstream.Consumer
	it   jetstream.MessagesContext

	// Owned by Next's goroutine.
	next      uint64 // stream sequence the next consumer starts at (0: the stream's first)
	consSeq   uint64 // consumer sequence of the last message of the current consumer
	consHas   bool   // the current consumer, of one filter, had messages to deliver when made
	createTry time.Duration
	firstWait time.Duration // for the first message of a consumer made with some to deliver
}

// ReadConfig says what a Reader reads.
type ReadConfig struct {
	// Filters are the subjects to read (several allowed; JetStream serves many of them slowly
	// from far behind the stream's end).
	Filters []string
	// Start is the first stream sequence to read; 0 reads from the stream's first (or Since).
	Start uint64
	// Since, without Start, starts at the first message stored at or after it.
	Since time.Time
	// LastPerSubject, without Start, starts with the last message of each subject, then the
	// ones stored after (a resume may deliver a subject's older messages, never out of order).
	LastPerSubject bool
	// HeadersOnly leaves the messages' bodies on the server.
	HeadersOnly bool
	// Batch is how many messages one pull asks for. Default 256.
	Batch int
	// Inactive is how long the server keeps a consumer no one pulls from. Default 5 s.
	Inactive time.Duration
	// Heartbeat is the consumer's idle heartbeat; a consumer silent for two is made again.
	// Default 500 ms. (A consumer whose server stops is made again sooner: the stream leader
	// advisories list the server offline.)
	Heartbeat time.Duration
	// Logger says when a consumer is made again; nil discards.
	Logger *slog.Logger
}

// Read makes a Reader and its first consumer, trying again within ctx while NATS does not
// answer. Stop it when done: that deletes its consumer.
func Read(ctx context.Context, js jetstream.JetStream, stream string, cfg ReadConfig) (*Reader, error) {
	if cfg.Batch <= 0 {
		cfg.Batch = 256
	}
	if cfg.Inactive <= 0 {
		cfg.Inactive = 5 * time.Second
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.Heartbeat <= 0 {
		cfg.Heartbeat = 500 * time.Millisecond
	}
	r := &Reader{js: js, stream: stream, cfg: cfg, next: cfg.Start, createTry: firstCreateTry, firstWait: firstMessageWait}
	r.stopped, r.stop = context.WithCancel(context.Background())
	r.servers = WatchServers(js.Conn(), r.serversOffline)
	cons, err := r.create(ctx)
	if err != nil {
		r.stop()
		r.servers.Leave()
		return nil, fmt.Errorf("read %s: %w", stream, err)
	}
	r.pending = cons.CachedInfo().NumPending
	r.mu.Lock()
	r.cons = cons
	r.mu.Unlock()
	r.markIfOffline(cons)
	return r, nil
}

// Pending is how many messages the first consumer had to deliver when it was made.
func (r *Reader) Pending() uint64 { return r.pending }

// Next returns the next message and its metadata, waiting within ctx. It returns
// jetstream.ErrMsgIteratorClosed once the Reader is stopped, ctx's error when ctx ends, and
// another error only for a failure that making the consumer again cannot mend (the connection
// closed).
func (r *Reader) Next(ctx context.Context) (jetstream.Msg, *jetstream.MsgMetadata, error) {
	for {
		it, err := r.iter(ctx)
		if err != nil {
			return nil, nil, err
		}
		var m jetstream.Msg
		if r.moved.Load() {
			// Its server went offline before the iterator was made: the first pull would
			// go unanswered (a 503 the iterator drops), and a consumer that had nothing to
			// deliver when made would wait out two heartbeats.
			err = errServerOffline
		} else {
			m, err = r.nextMsg(ctx, it)
		}
		if err == nil {
			md, merr := m.Metadata()
			if merr != nil {
				return nil, nil, fmt.Errorf("read %s: %w", r.stream, merr)
			}
			if md.Sequence.Consumer == r.consSeq+1 {
				r.consSeq, r.next = md.Sequence.Consumer, md.Sequence.Stream+1
				return m, md, nil
			}
			err = fmt.Errorf("%w: consumer sequence %d after %d", errReadGap, md.Sequence.Consumer, r.consSeq)
		}
		if r.moved.Swap(false) {
			err = errServerOffline
		}
		switch {
		case r.stopped.Err() != nil:
			return nil, nil, jetstream.ErrMsgIteratorClosed
		case ctx.Err() != nil:
			return nil, nil, ctx.Err()
		case errors.Is(err, errServerOffline):
		case !errors.Is(err, errReadGap) && !errors.Is(err, errReadStuck) && !transient(err):
			return nil, nil, fmt.Errorf("read %s: %w", r.stream, err)
		}
		r.cfg.Logger.Warn("ordered read making its consumer again", "stream", r.stream, "from_seq", r.next, "err", err)
		// The consumer left behind expires after Inactive: a delete now, when its server may
		// have gone away, could wait out its whole bound, and a read that waited for it would
		// hold a move's warm-up that long.
		r.drop()
	}
}

// nextMsg waits for the next message of it. The first of a consumer of one filter made with
// messages to deliver comes within milliseconds, unless the consumer landed on a server that
// was stopping (a cluster still counts a stopped server as a peer for a moment): then it is
// made again after firstWait, doubling each time that happens (up to 2 s), instead of after two
// missed heartbeats. (With several filters a server far behind may take long to find the
// first: the heartbeats tell a slow consumer from a dead one there.)
func (r *Reader) nextMsg(ctx context.Context, it jetstream.MessagesContext) (jetstream.Msg, error) {
	if r.consSeq > 0 || !r.consHas {
		return it.Next(jetstream.NextContext(ctx))
	}
	fctx, cancel := context.WithTimeout(ctx, r.firstWait)
	defer cancel()
	m, err := it.Next(jetstream.NextContext(fctx))
	switch {
	case err == nil:
		r.firstWait = firstMessageWait
	case ctx.Err() == nil && fctx.Err() != nil:
		err = fmt.Errorf("%w: no first message within %s", errReadStuck, r.firstWait)
		r.firstWait = min(2*r.firstWait, 2*time.Second)
	}
	return m, err
}

var (
	errReadGap       = errors.New("sequence gap")
	errReadStuck     = errors.New("consumer delivers nothing")
	errServerOffline = errors.New("the consumer's server went offline")
)

// serversOffline marks the current consumer gone if its server is among the offline (the
// consumer went with it) and stops its iterator if it has one; Next then makes another. (A
// mark that lands after Next dropped the consumer costs one create more.)
func (r *Reader) serversOffline(_ string, offline []string) {
	r.mu.Lock()
	cons, it := r.cons, r.it
	r.mu.Unlock()
	if cons == nil || !slices.Contains(offline, ConsumerServer(cons.CachedInfo())) {
		return
	}
	r.moved.Store(true)
	if it != nil {
		it.Stop()
	}
}

// markIfOffline marks cons, just made the current consumer, gone if an advisory listed its
// server offline since create looked: serversOffline found no consumer to mark then, and one
// heard from now on finds it.
func (r *Reader) markIfOffline(cons jetstream.Consumer) {
	if r.servers.Offline(ConsumerServer(cons.CachedInfo())) {
		r.moved.Store(true)
	}
}

// ConsumerServer is the server a consumer lives on ("" without info, or outside a cluster).
func ConsumerServer(info *jetstream.ConsumerInfo) string {
	if info == nil || info.Cluster == nil {
		return ""
	}
	return info.Cluster.Leader
}

// iter returns the current consumer's message iterator, making a consumer first if there is
// none.
func (r *Reader) iter(ctx context.Context) (jetstream.MessagesContext, error) {
	r.mu.Lock()
	it, cons := r.it, r.cons
	r.mu.Unlock()
	if it != nil {
		return it, nil
	}
	if cons == nil {
		var err error
		if cons, err = r.create(ctx); err != nil {
			if r.stopped.Err() != nil {
				return nil, jetstream.ErrMsgIteratorClosed
			}
			return nil, err
		}
	}
	it, err := cons.Messages(jetstream.PullMaxMessages(r.cfg.Batch), jetstream.PullHeartbeat(r.cfg.Heartbeat),
		jetstream.WithMessagesErrOnMissingHeartbeat(true))
	if err != nil {
		r.del(cons)
		return nil, fmt.Errorf("read %s: %w", r.stream, err)
	}
	r.mu.Lock()
	if r.stopped.Err() != nil {
		r.mu.Unlock()
		it.Stop()
		r.del(cons)
		return nil, jetstream.ErrMsgIteratorClosed
	}
	r.cons, r.it, r.consSeq = cons, it, 0
	r.consHas = len(r.cfg.Filters) == 1 && cons.CachedInfo().NumPending > 0
	r.mu.Unlock()
	r.markIfOffline(cons)
	return it, nil
}

// create makes a consumer starting at r.next, trying again while NATS does not answer or is
// electing a leader, until ctx ends or the Reader stops.
func (r *Reader) create(ctx context.Context) (jetstream.Consumer, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	defer context.AfterFunc(r.stopped, cancel)()
	cc := jetstream.ConsumerConfig{
		AckPolicy:         jetstream.AckNonePolicy,
		MemoryStorage:     true,
		Replicas:          1,
		InactiveThreshold: r.cfg.Inactive,
		DeliverPolicy:     jetstream.DeliverAllPolicy,
		HeadersOnly:       r.cfg.HeadersOnly,
	}
	if len(r.cfg.Filters) == 1 {
		cc.FilterSubject = r.cfg.Filters[0]
	} else {
		cc.FilterSubjects = r.cfg.Filters
	}
	switch {
	case r.next > 0:
		cc.DeliverPolicy, cc.OptStartSeq = jetstream.DeliverByStartSequencePolicy, r.next
	case !r.cfg.Since.IsZero():
		cc.DeliverPolicy, cc.OptStartTime = jetstream.DeliverByStartTimePolicy, &r.cfg.Since
	case r.cfg.LastPerSubject:
		cc.DeliverPolicy = jetstream.DeliverLastPerSubjectPolicy
	}
	pauses := backoff.Policy{Initial: 50 * time.Millisecond, Max: 2 * time.Second, Jitter: backoff.Half}.Pauses()
	for {
		actx, acancel := context.WithTimeout(ctx, r.createTry)
		cons, err := r.js.CreateConsumer(actx, r.stream, cc)
		acancel()
		if err == nil && r.servers.Offline(ConsumerServer(cons.CachedInfo())) {
			// Made while the cluster still counts a stopping server as a peer: it went with
			// the server. Left to expire (a delete would wait for the server).
			r.cfg.Logger.Info("an ordered read's consumer landed on a server gone offline; making another", "stream", r.stream,
				"server", ConsumerServer(cons.CachedInfo()))
			err = errServerOffline
		} else if err == nil {
			if err = AwaitPulls(ctx, r.js.Conn(), r.stream, cons.CachedInfo(), time.Second); err == nil {
				r.createTry = firstCreateTry
				return cons, nil
			}
		}
		if ctx.Err() != nil || (!creating(err) && !errors.Is(err, errServerOffline) && !errors.Is(err, ErrPullsUnheard)) {
			return nil, err
		}
		r.cfg.Logger.Info("making an ordered read's consumer failed; trying again", "stream", r.stream, "try", r.createTry, "err", err)
		if errors.Is(err, context.DeadlineExceeded) {
			r.createTry = min(2*r.createTry, maxCreateTry)
		}
		if !pauses.Wait(ctx) {
			return nil, err
		}
	}
}

// A create is bounded to firstCreateTry, doubling after one that went unanswered (a meta
// leader that stopped took it), up to maxCreateTry: a slow cluster gets longer ones.
// firstMessageWait bounds the wait for a new consumer's first message (nextMsg).
const (
	firstCreateTry   = 500 * time.Millisecond
	maxCreateTry     = 8 * time.Second
	firstMessageWait = 250 * time.Millisecond
)

// drop stops the current consumer's iterator and forgets the consumer, which it returns (nil
// if none); the next Next makes one.
func (r *Reader) drop() jetstream.Consumer {
	r.mu.Lock()
	old, it := r.cons, r.it
	r.cons, r.it = nil, nil
	r.mu.Unlock()
	if it != nil {
		it.Stop()
	}
	return old
}

// del deletes cons, waiting at most a second.
func (r *Reader) del(cons jetstream.Consumer) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	_ = r.js.DeleteConsumer(ctx, r.stream, cons.CachedInfo().Name)
}

// Stop ends the reading (a Next waiting returns jetstream.ErrMsgIteratorClosed) and deletes
// the Reader's consumer in the background, within a second: while the cluster changes (a
// server stopped, a meta leader elected) a delete can wait out that whole second, and a read
// that ends inside a move's warm-up must not hold it that long. A delete that fails leaves the
// consumer to expire (Inactive).
func (r *Reader) Stop() {
	r.stop()
	r.servers.Leave()
	if old := r.drop(); old != nil {
		go r.del(old)
	}
}
