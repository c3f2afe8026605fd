package gateway

import (
	_ "embed"
	"net/http"
	"net/http/pprof"
	"slices"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/tenantmesh/tenantmesh/gateway/breaker"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// openAPI is the admin API's OpenAPI 3.1 document, served at /admin/openapi.json: under the
// gateway's reserved /admin/ prefix, since a request elsewhere without x-tenant-id can be
// tenant traffic (a bearer token names the tenant) to the tenant's own /openapi.json.
// openapi_test.go checks it against the routes below, its examples and real answers.
//
//go:embed openapi.json
var openAPI []byte

// OpenAPI returns the admin API's OpenAPI 3.1 document (JSON).
func OpenAPI() []byte { return slices.Clone(openAPI) }

// adminMux registers the gateway's own endpoints. They are reached with requests that carry no
// x-tenant-id header; tenant traffic to the same paths is routed like any other. Every route is
// in openapi.json.
func (g *Gateway) adminMux() *http.ServeMux {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		_, _ = w.Write([]byte("ok\n"))
	})
	mux.HandleFunc("GET /readyz", g.handleReady)
	mux.Handle("GET /metrics", promhttp.HandlerFor(g.cfg.Registry, promhttp.HandlerOpts{}))
	// The listener also faces tenants: admin and registration need a bearer token (a gateway
	// without one refuses them).
	admin := tmhttp.RequireBearer(g.cfg.AdminToken, "--admin-token (TM_ADMIN_TOKEN)")
	mux.Handle("GET /admin/balance", admin(http.HandlerFunc(g.handleBalance)))
	mux.Handle("GET /admin/placement/{kind}/{tenant}", admin(http.HandlerFunc(g.handlePlacement)))
	// The API's description is open, as /healthz and /metrics are.
	mux.HandleFunc("GET /admin/openapi.json", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Cache-Control", "no-cache")
		_, _ = w.Write(openAPI)
	})
	g.registerServerRoutes(mux)
	if g.cfg.Pprof {
		mux.Handle("GET /debug/pprof/", admin(http.HandlerFunc(pprof.Index)))
		mux.Handle("GET /debug/pprof/profile", admin(http.HandlerFunc(pprof.Profile)))
		mux.Handle("GET /debug/pprof/trace", admin(http.HandlerFunc(pprof.Trace)))
		mux.Handle("GET /debug/pprof/symbol", admin(http.HandlerFunc(pprof.Symbol)))
	}
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		tmhttp.WriteProblem(w, r, tmhttp.Problem{Type: tmhttp.TypeBase + "not-found", Title: "Not found", Status: http.StatusNotFound,
			Detail: "no such admin endpoint; tenant requests need the x-tenant-id header"})
	})
	return mux
}

// Readiness is /readyz's body.
type Readiness struct {
	Ready bool `json:"ready"`
	// NATSConnected says whether the gateway's NATS connection is up now.
	NATSConnected bool `json:"nats_connected"`
	// SnapshotAgeSeconds is how long the routing state has been cut off from NATS (0: following).
	SnapshotAgeSeconds float64                  `json:"snapshot_age_seconds"`
	Stale              bool                     `json:"stale"`
	Detail             string                   `json:"detail"`
	Routes             int                      `json:"routes"`
	Instances          int                      `json:"instances"`
	LiveInstances      int                      `json:"live_instances"`
	Kinds              map[string]KindReadiness `json:"kinds"`
	HeldRequests       int                      `json:"held_requests"`
}

// KindReadiness is one kind's placement state in /readyz.
type KindReadiness struct {
	Placements int    `json:"placements"`
	Revision   uint64 `json:"revision"`
	Synced     bool   `json:"synced"`
}

func (g *Gateway) readiness() Readiness {
	snap := g.reg.snap.Load()
	age := g.Staleness()
	held, _, _ := g.holds.stats()
	rd := Readiness{
		NATSConnected:      g.store.JS().Conn().IsConnected(),
		SnapshotAgeSeconds: age.Seconds(),
		Stale:              age > 0,
		Routes:             len(snap.routes),
		Instances:          snap.total,
		LiveInstances:      snap.live,
		Kinds:              map[string]KindReadiness{},
		HeldRequests:       held,
	}
	select {
	case <-g.ready:
		rd.Ready = true
	default:
	}
	for name, ke := range snap.kinds {
		if w := ke.w.Load(); w != nil {
			st, _ := w.Stats(name)
			rd.Kinds[name] = KindReadiness{Placements: st.Placements, Revision: st.Revision, Synced: st.Synced}
		}
	}
	switch {
	case !rd.Ready:
		rd.Detail = "syncing routes, directory, kinds and placement from NATS"
	case rd.Stale:
		rd.Detail = "routing from a snapshot cut off from NATS for " + age.Round(time.Millisecond).String() + " (static stability)"
	default:
		rd.Detail = "following NATS"
	}
	return rd
}

func (g *Gateway) handleReady(w http.ResponseWriter, _ *http.Request) {
	rd := g.readiness()
	code := http.StatusOK
	if !rd.Ready {
		code = http.StatusServiceUnavailable
	}
	tmhttp.WriteJSON(w, code, rd)
}

// Balance is /admin/balance's body (the Queen coordinator's balance endpoint).
type Balance struct {
	// Balanced, ImbalanceScore and Servers are the Queen coordinator's view: load scores from telemetry.
	Balanced       bool                   `json:"balanced"`
	ImbalanceScore float64                `json:"imbalance_score"`
	Servers        []ServerLoad           `json:"servers"`
	Kinds          map[string]KindBalance `json:"kinds"`
	Instances      []InstanceBalance      `json:"instances"`
}

// KindBalance is one kind's shards and how evenly tenants spread over them.
type KindBalance struct {
	Shards []ShardBalance `json:"shards"`
	// Imbalance is max/mean - 1 of the shards' utilisation (tenants/capacity): 0 is even.
	Imbalance float64 `json:"imbalance"`
}

// ShardBalance is one live shard.
type ShardBalance struct {
	Shard       string  `json:"shard"`
	Tenants     int     `json:"tenants"`
	Capacity    int     `json:"capacity"`
	Utilization float64 `json:"utilization"`
	Instances   int     `json:"instances"`
}

// InstanceBalance is one instance's score and circuit.
type InstanceBalance struct {
	Instance  string             `json:"instance"`
	URL       string             `json:"url"`
	InFlight  int64              `json:"in_flight"`
	LatencyMS float64            `json:"latency_ewma_ms"`
	Score     float64            `json:"score"`
	Requests  uint64             `json:"requests"`
	Failures  uint64             `json:"failures"`
	Circuit   breaker.Snapshot   `json:"circuit"`
	Load      *schema.LoadReport `json:"load,omitempty"`
}

func (g *Gateway) balance() Balance {
	snap := g.reg.snap.Load()
	b := Balance{Kinds: map[string]KindBalance{}}
	for name, ke := range snap.kinds {
		var counts map[string]int
		if w := ke.w.Load(); w != nil {
			counts = w.ShardCounts(name)
		}
		kb := KindBalance{}
		var utils []float64
		for _, s := range snap.shards[name] {
			sb := ShardBalance{Shard: s.name, Tenants: counts[s.name], Capacity: s.capacity, Instances: len(s.instances)}
			if s.capacity > 0 {
				sb.Utilization = float64(sb.Tenants) / float64(s.capacity)
			}
			utils = append(utils, sb.Utilization)
			kb.Shards = append(kb.Shards, sb)
		}
		kb.Imbalance = imbalance(utils)
		b.Kinds[name] = kb
	}
	for _, in := range g.reg.instances() {
		ib := InstanceBalance{Instance: in.key, InFlight: in.inflight.Load(), LatencyMS: float64(in.ewmaNS.Load()) / 1e6,
			Score: in.score() / 1e6, Requests: in.requests.Load(), Failures: in.failures.Load(),
			Circuit: in.breaker.Snapshot(), Load: in.load.Load()}
		if u := in.url.Load(); u != nil {
			ib.URL = u.String()
		}
		b.Instances = append(b.Instances, ib)
	}
	slices.SortFunc(b.Instances, func(x, y InstanceBalance) int {
		if x.Instance < y.Instance {
			return -1
		}
		return 1
	})
	g.loadBalance(&b)
	return b
}

func (g *Gateway) handleBalance(w http.ResponseWriter, _ *http.Request) {
	tmhttp.WriteJSON(w, http.StatusOK, g.balance())
}

func (g *Gateway) handlePlacement(w http.ResponseWriter, r *http.Request) {
	kind, tenant := r.PathValue("kind"), r.PathValue("tenant")
	if err := schema.CheckTenant(tenant); err != nil {
		tmhttp.WriteError(w, r, err, "", kind)
		return
	}
	ke := g.reg.snap.Load().kinds[kind]
	if ke == nil {
		tmhttp.WriteError(w, r, schema.ErrUnknownKind, tenant, kind)
		return
	}
	e, ok := ke.lookup(tenant)
	if !ok {
		tmhttp.WriteProblem(w, r, tmhttp.Problem{Type: tmhttp.TypeBase + "tenant-not-placed", Title: "Tenant not placed",
			Status: http.StatusNotFound, Tenant: tenant, Kind: kind, Detail: "the gateway's placement snapshot has no entry for the tenant"})
		return
	}
	tmhttp.WriteJSON(w, http.StatusOK, map[string]any{
		"kind": kind, "tenant": tenant, "shard": e.Shard, "epoch": e.Epoch, "phase": e.Phase,
		"target": e.Target, "source": e.Source, "owners": e.Owners, "pinned": e.Pinned, "revision": e.Revision,
		"held": g.holds.queued(kind, tenant),
	})
}
