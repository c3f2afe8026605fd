// Package render is an example service of the affinity policy (the prerender manager's prerender server): a
// stateless renderer that keeps a pool of warm "pages", one per tenant, of fixed capacity with
// LRU disposal. Rendering for a tenant whose page is warm is fast (a cache hit); a cold tenant
// costs a page load and, when the pool is full, the least-recently-used tenant's page is
// disposed and the tenant released (shardkit's Release), so the gateway's mapping shrinks and
// the instance's capacity is free again.
//
//	POST /render   (x-tenant-id; body {"path": "..."})  -> {"tenant","path","html","warm"}
//	GET  /         -> {"ready": true} (the source design's health check)
//	GET  /pages    -> the warm tenants, most recently used first
//
// The kind is registered with the affinity policy (see [KindConfig]); the gateway assigns
// tenants to instances with room, up to the kind's multiplex.
package render

import (
	"container/list"
	"context"
	"encoding/json"
	"io"
	"log/slog"
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
const Kind = "render"

// HeaderCache says whether a render found the tenant's page warm ("hit") or loaded it ("miss").
const HeaderCache = "X-Render-Cache"

// RouteTable is what the service publishes in the route registry.
var RouteTable = []schema.Route{{Method: http.MethodPost, Prefix: "/render", Kind: Kind}}

// KindConfig is the kind's registration: the affinity policy with the source design's defaults
// (multiplex 1, health every 10s, 30s server timeout, capacity 4).
func KindConfig() schema.KindConfig {
	return schema.KindConfig{Kind: Kind, Policy: schema.PolicyAffinity}.WithDefaults()
}

// Releaser gives up an affinity tenant (shardkit's *Shard).
type Releaser interface {
	Release(ctx context.Context, tenant string) error
}

// Config configures a Service; zero fields take the defaults named.
type Config struct {
	// Capacity is the page pool size (the prerender manager's PRERENDER_PAGE_POOL_SIZE). Default 4.
	Capacity int
	// LoadTime is what loading a cold page costs. Default 20ms.
	LoadTime time.Duration
	// RenderTime is what a render on a warm page costs. Default 1ms.
	RenderTime time.Duration
	// Logger; if nil, logs are discarded.
	Logger *slog.Logger
}

// Service is the renderer. It implements shardmain.App.
type Service struct {
	cfg Config
	rel atomic.Pointer[releaserBox]

	mu    sync.Mutex
	lru   *list.List               // of *page, most recently used first
	pages map[string]*list.Element // tenant -> element

	hits, misses, evictions atomic.Uint64
	wg                      sync.WaitGroup
	bg                      context.Context
	stop                    context.CancelFunc
}

type releaserBox struct{ r Releaser }

type page struct {
	tenant string
	loaded time.Time
	served uint64
}

// New makes a Service.
func New(cfg Config) *Service {
	if cfg.Capacity <= 0 {
		cfg.Capacity = 4
	}
	if cfg.LoadTime <= 0 {
		cfg.LoadTime = 20 * time.Millisecond
	}
	if cfg.RenderTime <= 0 {
		cfg.RenderTime = time.Millisecond
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	s := &Service{cfg: cfg, lru: list.New(), pages: map[string]*list.Element{}}
	s.bg, s.stop = context.WithCancel(context.Background())
	return s
}

// AttachShard makes sk, the shard the service runs in, what disposing a tenant's page
// releases (Handler does it; a test that mounts the routes itself calls it).
func (s *Service) AttachShard(sk *shardkit.Shard) { s.SetReleaser(sk) }

// Handler serves the service's routes on their own router and attaches sk (AttachShard).
func (s *Service) Handler(sk *shardkit.Shard) http.Handler {
	s.AttachShard(sk)
	r := chi.NewRouter()
	s.Mount(r, sk.Gate, sk.RequireAdmin)
	return r
}

// SetReleaser sets what disposal calls (tests may pass a fake).
func (s *Service) SetReleaser(r Releaser) { s.rel.Store(&releaserBox{r}) }

// Hooks: when shardkit releases a tenant (a drain), the page goes without a second Release.
func (s *Service) Hooks() shardkit.Hooks {
	return shardkit.Hooks{Release: func(_ context.Context, tenant string) error {
		s.drop(tenant)
		return nil
	}}
}

// Routes are the routes the service publishes.
func (s *Service) Routes() []schema.Route { return RouteTable }

// Mount registers the handlers: /render behind the gate, / and /pages outside it.
func (s *Service) Mount(r chi.Router, gate, _ func(http.Handler) http.Handler) {
	r.With(gate).Post("/render", s.handleRender)
	r.Get("/", func(w http.ResponseWriter, _ *http.Request) {
		tmhttp.WriteJSON(w, http.StatusOK, map[string]bool{"ready": true})
	})
	r.Get("/pages", func(w http.ResponseWriter, _ *http.Request) {
		tmhttp.WriteJSON(w, http.StatusOK, map[string]any{"capacity": s.cfg.Capacity, "pages": s.Pages(),
			"hits": s.hits.Load(), "misses": s.misses.Load(), "evictions": s.evictions.Load()})
	})
}

// Run waits for ctx, then for the releases still in flight.
func (s *Service) Run(ctx context.Context) error {
	<-ctx.Done()
	s.wg.Wait()
	s.stop()
	return nil
}

// Pages lists the warm tenants, most recently used first.
func (s *Service) Pages() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]string, 0, s.lru.Len())
	for e := s.lru.Front(); e != nil; e = e.Next() {
		out = append(out, e.Value.(*page).tenant)
	}
	return out
}

// Stats returns hits, misses and evictions.
func (s *Service) Stats() (hits, misses, evictions uint64) {
	return s.hits.Load(), s.misses.Load(), s.evictions.Load()
}

type renderRequest struct {
	Path string `json:"path"`
}

// Rendered is POST /render's answer.
type Rendered struct {
	Tenant string `json:"tenant"`
	Path   string `json:"path"`
	HTML   string `json:"html"`
	Warm   bool   `json:"warm"`
}

func (s *Service) handleRender(w http.ResponseWriter, r *http.Request) {
	tenant := shardkit.Tenant(r)
	var req renderRequest
	if err := json.NewDecoder(io.LimitReader(r.Body, 64<<10)).Decode(&req); err != nil && err != io.EOF {
		tmhttp.WriteProblem(w, r, tmhttp.Problem{Type: tmhttp.TypeBase + "bad-body", Title: "Bad request body",
			Status: http.StatusBadRequest, Detail: "the body must be {\"path\": \"...\"}", Tenant: tenant, Kind: Kind})
		return
	}
	if req.Path == "" {
		req.Path = "/"
	}
	warm, served := s.page(tenant)
	d := s.cfg.RenderTime
	if !warm {
		d += s.cfg.LoadTime
	}
	t := time.NewTimer(d)
	select {
	case <-t.C:
	case <-r.Context().Done():
		t.Stop()
		return
	}
	if warm {
		w.Header().Set(HeaderCache, "hit")
	} else {
		w.Header().Set(HeaderCache, "miss")
	}
	tmhttp.WriteJSON(w, http.StatusOK, Rendered{Tenant: tenant, Path: req.Path, Warm: warm,
		HTML: "<html><body>" + tenant + req.Path + " #" + strconv.FormatUint(served, 10) + "</body></html>"})
}

// page takes tenant's page (loading it if cold, disposing the LRU page if the pool is full)
// and reports whether it was warm.
func (s *Service) page(tenant string) (warm bool, served uint64) {
	s.mu.Lock()
	if e := s.pages[tenant]; e != nil {
		s.lru.MoveToFront(e)
		p := e.Value.(*page)
		p.served++
		n := p.served
		s.mu.Unlock()
		s.hits.Add(1)
		return true, n
	}
	var evicted []string
	for s.lru.Len() >= s.cfg.Capacity {
		e := s.lru.Back()
		p := e.Value.(*page)
		s.lru.Remove(e)
		delete(s.pages, p.tenant)
		evicted = append(evicted, p.tenant)
	}
	s.pages[tenant] = s.lru.PushFront(&page{tenant: tenant, loaded: time.Now(), served: 1})
	s.mu.Unlock()
	s.misses.Add(1)
	for _, t := range evicted {
		s.release(t)
	}
	return false, 1
}

// release tells the placement this instance no longer holds tenant (in the background: the
// request that caused the disposal does not wait for it).
func (s *Service) release(tenant string) {
	s.evictions.Add(1)
	b := s.rel.Load()
	if b == nil {
		return
	}
	s.wg.Go(func() {
		ctx, cancel := context.WithTimeout(s.bg, 5*time.Second)
		defer cancel()
		if err := b.r.Release(ctx, tenant); err != nil {
			s.cfg.Logger.Warn("releasing a disposed tenant failed", "tenant", tenant, "err", err)
		}
	})
}

// drop disposes tenant's page without releasing it (shardkit already did).
func (s *Service) drop(tenant string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if e := s.pages[tenant]; e != nil {
		s.lru.Remove(e)
		delete(s.pages, tenant)
	}
}
