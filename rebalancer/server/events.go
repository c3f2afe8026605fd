package server

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/tenantmesh/tenantmesh/internal/ctxtime"
	"github.com/tenantmesh/tenantmesh/rebalancer"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// Event is one server-sent event: Type is the SSE event name, Data its JSON payload.
//
//	plan      a plan record changed (rebalancer.PlanRecord)
//	move      a move record changed: its phase, pause, reason (rebalancer.MoveRecord)
//	audit     an audit event was journaled (schema.AuditEvent)
//	instance  an instance changed status (sweeper.Event), seen by the leader's sweeper
//	leader    this process took or lost the leader lease
//	error     a background apply of this process failed
//
// plan and move events come from a watch of tm_rebalance and audit events from the journal's
// subjects, so every rebalancer process streams every apply, whoever runs it.
type Event struct {
	Type string
	Data json.RawMessage
}

// hub fans events out to the connected event streams. A stream that cannot keep up loses
// events (counted) rather than slowing the others.
type hub struct {
	mu      sync.Mutex
	subs    map[chan Event]struct{}
	closed  bool
	dropped prometheus.Counter
}

func newHub() *hub {
	return &hub{subs: map[chan Event]struct{}{}, dropped: prometheus.NewCounter(prometheus.CounterOpts{
		Name: "tm_rebalancer_events_dropped_total", Help: "Server-sent events dropped because a stream was too slow."})}
}

func (h *hub) publish(typ string, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		return
	}
	h.send(Event{Type: typ, Data: b})
}

func (h *hub) send(ev Event) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for c := range h.subs {
		select {
		case c <- ev:
		default:
			h.dropped.Inc()
		}
	}
}

// maxStreams bounds the event streams one process serves at once (each holds a goroutine
// and a buffer of 256 events); beyond it a new stream is answered 503.
const maxStreams = 64

var errTooManyStreams = &tmhttp.Error{Status: http.StatusServiceUnavailable, Type: "too-many-streams", Title: "Too many event streams",
	Detail: "this rebalancer serves as many event streams as it may; retry later", RetryAfter: 5 * time.Second}

func (h *hub) subscribe() (chan Event, func()) {
	c, cancel, _ := h.trySubscribe(0)
	return c, cancel
}

// trySubscribe is subscribe with a bound on the streams (0: none).
func (h *hub) trySubscribe(bound int) (chan Event, func(), error) {
	c := make(chan Event, 256)
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed {
		close(c)
		return c, func() {}, nil
	}
	if bound > 0 && len(h.subs) >= bound {
		return nil, nil, errTooManyStreams
	}
	h.subs[c] = struct{}{}
	return c, func() {
		h.mu.Lock()
		defer h.mu.Unlock()
		if _, ok := h.subs[c]; ok {
			delete(h.subs, c)
			close(c)
		}
	}, nil
}

// close ends every stream (at shutdown).
func (h *hub) close() {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.closed = true
	for c := range h.subs {
		delete(h.subs, c)
		close(c)
	}
}

// startEvents feeds the hub from the audit journal's subjects, the runners' job events
// (job.created, job_run.done) and a watch of tm_rebalance.
func (s *Server) startEvents(ctx context.Context) error {
	sub, err := s.st.JS().Conn().Subscribe(schema.SubjectAuditAll, func(m *nats.Msg) {
		if len(m.Data) > 0 && json.Valid(m.Data) {
			s.hub.send(Event{Type: "audit", Data: m.Data})
		}
	})
	if err != nil {
		return fmt.Errorf("server: subscribe to audit events: %w", err)
	}
	jobs, err := s.st.SubscribeJobEvents(func(raw []byte, ev schema.JobEvent) {
		s.hub.send(Event{Type: ev.Event, Data: raw})
	})
	if err != nil {
		_ = sub.Unsubscribe()
		return err
	}
	s.work.Go(func() {
		<-ctx.Done()
		_ = sub.Unsubscribe()
		_ = jobs.Unsubscribe()
	})
	s.work.Go(func() { s.watchRecords(ctx) })
	return nil
}

// watchRecords turns changes of plan and move records into events, re-watching if the watch
// ends, and keeps the moves in progress for tm_rebalancer_move_stalled_seconds. The first watch
// reads the records already stored (the moves running when this process started) without
// streaming them; a re-watch streams only what changed since the last record it saw.
func (s *Server) watchRecords(ctx context.Context) {
	var last uint64    // the last revision seen
	streaming := false // the first watch has delivered the stored records
	for ctx.Err() == nil {
		w, err := s.st.KV(schema.BucketRebalance).WatchAll(ctx)
		if err != nil {
			ctxtime.Sleep(ctx, time.Second)
			continue
		}
		for en := range w.Updates() {
			if en == nil {
				streaming = true
				continue
			}
			fresh := streaming && en.Revision() > last
			last = max(last, en.Revision())
			if en.Operation() != jetstream.KeyValuePut {
				s.moves.forget(en.Key())
				continue
			}
			switch {
			case strings.HasPrefix(en.Key(), "move."):
				var m rebalancer.MoveRecord
				if json.Unmarshal(en.Value(), &m) != nil {
					continue
				}
				s.moves.track(en.Key(), m)
				if fresh {
					s.hub.publish("move", moveEvent{MoveRecord: m, PauseMS: m.Pause().Milliseconds()})
					if m.State == rebalancer.MoveDone {
						s.verify.moveDone(ctx, m)
					}
				}
			case strings.HasPrefix(en.Key(), "plan.") && fresh:
				s.hub.send(Event{Type: "plan", Data: en.Value()})
			}
		}
		_ = w.Stop()
		if ctx.Err() == nil {
			ctxtime.Sleep(ctx, time.Second)
		}
	}
}

// moveTracker holds when each move in progress (warming, handoff, committed) last took a step.
// Pending and finished moves are not held, so it stays as small as the moves running now.
type moveTracker struct {
	mu    sync.Mutex
	steps map[string]time.Time // record key -> the record's Updated
}

func (t *moveTracker) track(key string, m rebalancer.MoveRecord) {
	t.mu.Lock()
	defer t.mu.Unlock()
	switch m.State {
	case rebalancer.MoveWarming, rebalancer.MoveHandoff, rebalancer.MoveCommitted:
		if t.steps == nil {
			t.steps = map[string]time.Time{}
		}
		t.steps[key] = m.Updated
	default:
		delete(t.steps, key)
	}
}

func (t *moveTracker) forget(key string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	delete(t.steps, key)
}

// stalled is how long ago the move in progress that stepped longest ago took its last step (0
// when no move is in progress).
func (t *moveTracker) stalled(now time.Time) time.Duration {
	t.mu.Lock()
	defer t.mu.Unlock()
	var worst time.Duration
	for _, at := range t.steps {
		worst = max(worst, now.Sub(at))
	}
	return worst
}

// moveEvent is a move record with its pause in milliseconds.
type moveEvent struct {
	rebalancer.MoveRecord
	PauseMS int64 `json:"pause_ms"`
}

func (s *Server) registerEventRoutes(r chi.Router) {
	r.Get("/api/events", s.handleEvents)
}

// handleEvents streams events as text/event-stream until the client goes away or the server
// stops, with a comment line every 15s to keep proxies from closing an idle stream.
func (s *Server) handleEvents(w http.ResponseWriter, r *http.Request) {
	fl, ok := w.(http.Flusher)
	if !ok {
		s.fail(w, r, fmt.Errorf("streaming unsupported"))
		return
	}
	c, cancel, err := s.hub.trySubscribe(maxStreams)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	defer cancel()
	h := w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-store")
	h.Set("X-Accel-Buffering", "no")
	w.WriteHeader(http.StatusOK)
	fmt.Fprintf(w, ": tenantmesh rebalancer %s\n\n", s.cfg.Holder)
	fl.Flush()
	keep := time.NewTicker(15 * time.Second)
	defer keep.Stop()
	for {
		select {
		case ev, ok := <-c:
			if !ok {
				return
			}
			fmt.Fprintf(w, "event: %s\ndata: %s\n\n", ev.Type, ev.Data)
			fl.Flush()
		case <-keep.C:
			fmt.Fprint(w, ": keepalive\n\n")
			fl.Flush()
		case <-r.Context().Done():
			return
		}
	}
}
