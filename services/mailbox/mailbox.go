// Package mailbox is a small demo service of producer routes (the Queen coordinator's producer
// routing, for a kind with the load policy): consumers long-poll a queue, producers post to it,
// and a message reaches a consumer waiting on the same instance at once (local notification).
//
//	GET  /mailbox/{queue}?group=G&wait=10s  (x-tenant-id) a consumer: the next message, or 204
//	                                        when none came within wait (at most 30s)
//	POST /mailbox/{queue}?group=G           (x-tenant-id; body: the message, at most 64 KiB)
//	                                        -> {"delivered":"consumer"} handed to a waiting
//	                                        consumer here, or 202 {"delivered":"kept"} kept on
//	                                        this instance for its next consumer
//
// Messages live in the instance's memory only (it is a demo of routing, not a queue): a
// producer's message helps a consumer only on the instance the consumer waits on. So the POST
// route is a producer route keyed by queue and group: while a consumer waits here, this
// instance announces the key in its load reports (shardkit Shard.Waiting), and the gateway
// sends the key's producers here.
package mailbox

import (
	"io"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-chi/chi/v5"

	"github.com/tenantmesh/tenantmesh/shardkit"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// Kind is the service kind.
const Kind = "mailbox"

// RouteTable is what the service publishes: the POST route is a producer route whose affinity
// key is the queue (the path segment after /mailbox/) and the group (?group=); the GET route,
// where consumers wait, is a consumer route with the same key, so a tenant's queues and groups
// spread over the shard's instances by load, each sticking to its instance.
var RouteTable = []schema.Route{
	{Method: http.MethodGet, Prefix: "/mailbox/", Kind: Kind, Consumer: &schema.ConsumerRoute{Key: []string{"path:0", "query:group"}}},
	{Method: http.MethodPost, Prefix: "/mailbox/", Kind: Kind, Producer: &schema.ProducerRoute{Queue: "path:0", Group: "query:group"}},
}

// KindConfig is the kind's registration: the load policy (producer routes are the load
// policy's).
func KindConfig() schema.KindConfig {
	return schema.KindConfig{Kind: Kind, Policy: schema.PolicyLoad}.WithDefaults()
}

// Bounds. A tenant names its queues and groups, so without MaxBoxes and MaxTenantBytes one
// tenant could make boxes until the instance's memory ran out; MaxBytes bounds all tenants
// together.
const (
	MaxMessage     = 64 << 10 // bytes of one message
	MaxKept        = 100      // messages kept per tenant, queue and group
	MaxWait        = 30 * time.Second
	MaxBoxes       = 64        // queue and group pairs per tenant on an instance
	MaxTenantBytes = 4 << 20   // kept message bytes per tenant on an instance
	MaxBytes       = 256 << 20 // kept message bytes on an instance
)

// Waiter announces waiting consumers (shardkit's *Shard).
type Waiter interface {
	Waiting(queue, group string) (done func())
}

// Service is the mailbox. It implements shardmain.App.
type Service struct {
	waiter atomic.Pointer[waiterBox]

	mu    sync.Mutex
	boxes map[boxKey]*box
	use   map[string]*usage // per tenant
	bytes int64             // kept, all tenants
}

// usage is one tenant's boxes and kept bytes on this instance.
type usage struct {
	boxes int
	bytes int64
}

type waiterBox struct{ w Waiter }

type boxKey struct{ tenant, queue, group string }

// box is one tenant's queue and group on this instance: consumers waiting (first come, first
// served) and messages kept for the next ones.
type box struct {
	waiting []chan []byte
	kept    [][]byte
}

// New makes a Service.
func New() *Service { return &Service{boxes: map[boxKey]*box{}, use: map[string]*usage{}} }

// Hooks: the mailbox keeps nothing worth moving.
func (s *Service) Hooks() shardkit.Hooks { return shardkit.Hooks{} }

// Routes are the routes the service publishes.
func (s *Service) Routes() []schema.Route { return RouteTable }

// Handler serves the routes behind sk's gate, and announces waiting consumers through sk.
func (s *Service) Handler(sk *shardkit.Shard) http.Handler {
	s.SetWaiter(sk)
	r := chi.NewRouter()
	s.Mount(r, sk.Gate)
	return r
}

// SetWaiter sets what announces waiting consumers.
func (s *Service) SetWaiter(w Waiter) { s.waiter.Store(&waiterBox{w}) }

// Mount registers the routes behind gate.
func (s *Service) Mount(r chi.Router, gate func(http.Handler) http.Handler) {
	r.With(gate).Get("/mailbox/{queue}", s.handleConsume)
	r.With(gate).Post("/mailbox/{queue}", s.handleProduce)
}

func key(r *http.Request) (boxKey, bool) {
	k := boxKey{tenant: shardkit.Tenant(r), queue: chi.URLParam(r, "queue"), group: r.URL.Query().Get("group")}
	ok := schema.CheckName("queue", k.queue) == nil && (k.group == "" || schema.CheckName("group", k.group) == nil)
	return k, ok
}

func badKey(w http.ResponseWriter, r *http.Request) {
	tmhttp.WriteProblem(w, r, tmhttp.Problem{Type: tmhttp.TypeBase + "invalid-request", Title: "Invalid queue or group",
		Status: http.StatusBadRequest, Detail: "queue and group must be 1 to 64 characters of [A-Za-z0-9_-]", Kind: Kind})
}

// handleConsume is the long poll: a kept message at once, else wait for a producer.
func (s *Service) handleConsume(w http.ResponseWriter, r *http.Request) {
	k, ok := key(r)
	if !ok {
		badKey(w, r)
		return
	}
	wait := 10 * time.Second
	if v := r.URL.Query().Get("wait"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d < 0 {
			tmhttp.WriteProblem(w, r, tmhttp.Problem{Type: tmhttp.TypeBase + "invalid-request", Title: "Invalid wait",
				Status: http.StatusBadRequest, Detail: "wait is a duration such as 10s (at most 30s)", Kind: Kind})
			return
		}
		wait = min(d, MaxWait)
	}
	ch := make(chan []byte, 1)
	s.mu.Lock()
	b := s.box(k)
	if b == nil {
		s.mu.Unlock()
		full(w, r, "the tenant uses "+strconv.Itoa(MaxBoxes)+" queue and group pairs on this instance; use fewer")
		return
	}
	if len(b.kept) > 0 {
		msg := b.kept[0]
		b.kept = b.kept[1:]
		s.account(k.tenant, -int64(len(msg)))
		s.tidy(k, b)
		s.mu.Unlock()
		deliver(w, msg)
		return
	}
	b.waiting = append(b.waiting, ch)
	s.mu.Unlock()
	if wb := s.waiter.Load(); wb != nil {
		done := wb.w.Waiting(k.queue, k.group)
		defer done()
	}
	t := time.NewTimer(wait)
	defer t.Stop()
	select {
	case msg := <-ch:
		deliver(w, msg)
		return
	case <-t.C:
	case <-r.Context().Done():
	}
	s.mu.Lock()
	if b := s.boxes[k]; b != nil {
		for i, c := range b.waiting {
			if c == ch {
				b.waiting = append(b.waiting[:i], b.waiting[i+1:]...)
				break
			}
		}
		s.tidy(k, b)
	}
	s.mu.Unlock()
	select {
	case msg := <-ch: // a producer handed it over just as the wait ended
		deliver(w, msg)
	default:
		w.WriteHeader(http.StatusNoContent)
	}
}

func deliver(w http.ResponseWriter, msg []byte) {
	w.Header().Set("Content-Type", "application/octet-stream")
	_, _ = w.Write(msg)
}

// handleProduce hands the message to a consumer waiting here, or keeps it.
func (s *Service) handleProduce(w http.ResponseWriter, r *http.Request) {
	k, ok := key(r)
	if !ok {
		badKey(w, r)
		return
	}
	msg, err := io.ReadAll(io.LimitReader(r.Body, MaxMessage+1))
	if err != nil || len(msg) > MaxMessage {
		tmhttp.WriteProblem(w, r, tmhttp.Problem{Type: tmhttp.TypeBase + "bad-body", Title: "Bad message",
			Status: http.StatusBadRequest, Detail: "send the message as the body, at most 64 KiB", Kind: Kind})
		return
	}
	s.mu.Lock()
	b := s.box(k)
	if b == nil {
		s.mu.Unlock()
		full(w, r, "the tenant uses "+strconv.Itoa(MaxBoxes)+" queue and group pairs on this instance; use fewer")
		return
	}
	if len(b.waiting) > 0 {
		ch := b.waiting[0]
		b.waiting = b.waiting[1:]
		s.tidy(k, b)
		s.mu.Unlock()
		ch <- msg // buffered: never blocks
		tmhttp.WriteJSON(w, http.StatusOK, map[string]string{"delivered": "consumer"})
		return
	}
	if len(b.kept) >= MaxKept {
		s.tidy(k, b)
		s.mu.Unlock()
		tmhttp.WriteProblem(w, r, tmhttp.Problem{Type: tmhttp.TypeBase + "mailbox-full", Title: "Mailbox full",
			Status: http.StatusServiceUnavailable, Detail: "this instance keeps " + strconv.Itoa(MaxKept) + " messages for " + k.queue + "; retry once consumers took some",
			RetryAfter: 1, Kind: Kind})
		return
	}
	if u := s.use[k.tenant]; u.bytes+int64(len(msg)) > MaxTenantBytes || s.bytes+int64(len(msg)) > MaxBytes {
		s.tidy(k, b)
		s.mu.Unlock()
		full(w, r, "this instance keeps as many message bytes as it may for the tenant; retry once consumers took some")
		return
	}
	b.kept = append(b.kept, msg)
	s.account(k.tenant, int64(len(msg)))
	s.mu.Unlock()
	tmhttp.WriteJSON(w, http.StatusAccepted, map[string]string{"delivered": "kept"})
}

func full(w http.ResponseWriter, r *http.Request, detail string) {
	tmhttp.WriteProblem(w, r, tmhttp.Problem{Type: tmhttp.TypeBase + "mailbox-full", Title: "Mailbox full",
		Status: http.StatusServiceUnavailable, Detail: detail, RetryAfter: 1, Kind: Kind})
}

// box returns k's box, made if absent; nil when the tenant has MaxBoxes already (s.mu held).
func (s *Service) box(k boxKey) *box {
	b := s.boxes[k]
	if b == nil {
		u := s.use[k.tenant]
		if u == nil {
			u = &usage{}
			s.use[k.tenant] = u
		}
		if u.boxes >= MaxBoxes {
			return nil
		}
		u.boxes++
		b = &box{}
		s.boxes[k] = b
	}
	return b
}

// account adds n kept bytes to tenant's and the instance's counts (s.mu held).
func (s *Service) account(tenant string, n int64) {
	s.use[tenant].bytes += n
	s.bytes += n
}

// tidy forgets an empty box (s.mu held).
func (s *Service) tidy(k boxKey, b *box) {
	if len(b.waiting) == 0 && len(b.kept) == 0 {
		delete(s.boxes, k)
		if u := s.use[k.tenant]; u != nil {
			if u.boxes--; u.boxes == 0 && u.bytes == 0 {
				delete(s.use, k.tenant)
			}
		}
	}
}
