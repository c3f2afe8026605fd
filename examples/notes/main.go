// Command notes is a per-tenant notes service run as a tenantmesh shard: POST /notes adds a
// note, GET /notes lists them. A tenant's notes live under one key of a NATS KV bucket; the
// shard that owns the tenant caches them, and the move hooks hand the tenant over.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"sync"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/tenantmesh/tenantmesh/shardkit"
	"github.com/tenantmesh/tenantmesh/shardkit/jsx"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/shardmain"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

type note struct {
	ID   string `json:"id"`
	Text string `json:"text"`
}

// notes are one tenant's notes as of revision rev of its key.
type notes struct {
	mu    sync.Mutex
	rev   uint64
	notes []note
}

type service struct {
	kv      jetstream.KeyValue
	mu      sync.Mutex
	tenants map[string]*notes
}

func main() {
	shardmain.Exit("notes", func(m *shardmain.Main) (shardmain.Builder, error) {
		return func(ctx context.Context, env shardmain.Env) (shardmain.App, error) {
			kv, err := env.Store.JS().EnsureKV(ctx, jsx.KVSpec{
				Bucket: schema.ServiceBucket("notes", "notes"), Description: "notes service: notes per tenant"})
			return &service{kv: kv, tenants: map[string]*notes{}}, err
		}, nil
	})
}

// Routes are published for the gateway: it sends these to the shard that owns the tenant.
func (s *service) Routes() []schema.Route {
	return []schema.Route{{Method: "POST", Prefix: "/notes"}, {Method: "GET", Prefix: "/notes"}}
}

// Hooks hand a tenant over in a move: the source reports the revision it last wrote (Applied,
// its fence), the target reads the tenant afresh, so at or past it (Warm), and the source
// forgets the tenant once it has moved away (Release).
func (s *service) Hooks() shardkit.Hooks {
	return shardkit.Hooks{Warm: s.warm, Applied: s.applied, Release: s.release}
}

func (s *service) warm(ctx context.Context, tenant string, _ uint64) error {
	s.release(ctx, tenant)
	_, err := s.load(ctx, tenant)
	return err
}

func (s *service) applied(tenant string) uint64 {
	s.mu.Lock()
	n := s.tenants[tenant]
	s.mu.Unlock()
	if n == nil {
		return 0
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.rev
}

func (s *service) release(_ context.Context, tenant string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.tenants, tenant)
	return nil
}

// Handler serves the routes on a plain ServeMux, each behind the shard's gate.
func (s *service) Handler(sk *shardkit.Shard) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("GET /notes", sk.Gate(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n, err := s.load(r.Context(), shardkit.Tenant(r))
		if err != nil {
			tmhttp.WriteError(w, r, err, shardkit.Tenant(r), "notes")
			return
		}
		n.mu.Lock()
		defer n.mu.Unlock()
		tmhttp.WriteJSON(w, http.StatusOK, n.notes)
	})))
	mux.Handle("POST /notes", sk.Gate(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var in note
		if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, 64<<10)).Decode(&in); err != nil || in.ID == "" {
			tmhttp.WriteError(w, r, tmhttp.Errorf(http.StatusBadRequest, "invalid-note", "Invalid note", `send {"id":"...","text":"..."}`), shardkit.Tenant(r), "notes")
			return
		}
		status, err := s.add(r.Context(), shardkit.Tenant(r), in)
		if err != nil {
			tmhttp.WriteError(w, r, err, shardkit.Tenant(r), "notes")
			return
		}
		tmhttp.WriteJSON(w, status, in)
	})))
	return mux
}

// add appends a note once (a retried id answers 200) by compare-and-set on the tenant's key.
func (s *service) add(ctx context.Context, tenant string, in note) (int, error) {
	n, err := s.load(ctx, tenant)
	if err != nil {
		return 0, err
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	for _, old := range n.notes {
		if old.ID == in.ID {
			return http.StatusOK, nil
		}
	}
	b, _ := json.Marshal(append(n.notes, in))
	rev, err := s.kv.Update(ctx, tenant, b, n.rev)
	if err != nil {
		s.release(ctx, tenant) // another writer: read afresh on the next request
		return 0, err
	}
	n.rev, n.notes = rev, append(n.notes, in)
	return http.StatusCreated, nil
}

// load returns the tenant's notes, read from the bucket on first use.
func (s *service) load(ctx context.Context, tenant string) (*notes, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if n, ok := s.tenants[tenant]; ok {
		return n, nil
	}
	n := &notes{}
	e, err := s.kv.Get(ctx, tenant)
	switch {
	case errors.Is(err, jetstream.ErrKeyNotFound):
	case err != nil:
		return nil, err
	default:
		n.rev = e.Revision()
		if err := json.Unmarshal(e.Value(), &n.notes); err != nil {
			return nil, err
		}
	}
	s.tenants[tenant] = n
	return n, nil
}
