package components_test

import (
	"cmp"
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/gateway"
	"github.com/tenantmesh/tenantmesh/internal/tmtest"
	"github.com/tenantmesh/tenantmesh/services/render"
	"github.com/tenantmesh/tenantmesh/shardkit/kittest"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// runResult is one policy's figures.
type runResult struct {
	requests, ok, hits int64
	served             map[string]int64
	wall               time.Duration
}

// TestPolicyLoadRun drives skewed traffic (Zipf over 48 tenants) through a gateway to four
// render instances with pools of 8 pages, once per policy (and managed as the baseline), and
// reports the affinity hit ratio (renders that found the tenant's page warm) and each
// instance's share of the requests. The hit ratio is what the affinity and load policies are
// for: keeping a tenant on one instance keeps its page warm, so each must beat the managed
// baseline (power of two choices, no stickiness) by a wide margin, and stay high. The figures
// are ratios of the algorithms, stable on a loaded machine (docs/benchmarks.md, "Affinity and
// load policies": about 92% against 58%); the bounds leave room below them.
func TestPolicyLoadRun(t *testing.T) {
	if testing.Short() {
		t.Skip("load run")
	}
	const (
		tenants, instances, capacity = 48, 4, 8
		requests, workers            = 3000, 16
	)
	run := func(t *testing.T, policy schema.Policy) runResult {
		st, _ := kittest.Store(t)
		if _, err := st.Kinds().Put(context.Background(), schema.KindConfig{Kind: render.Kind, Policy: policy, Capacity: capacity}); err != nil {
			t.Fatal(err)
		}
		for i := range instances {
			shard := "render-1" // load, managed: one shard; the policy picks the instance
			if policy == schema.PolicyAffinity {
				shard = fmt.Sprintf("render-%c", 'a'+i) // affinity: each instance its own shard
			}
			// Load kinds place tenants on the shard (managed rule): its registered capacity
			// must hold every tenant; the page pool stays at capacity.
			reg := capacity
			if policy != schema.PolicyAffinity {
				reg = tenants
			}
			startRender(t, st, shard, fmt.Sprintf("i%d", i), reg, render.Config{Capacity: capacity, LoadTime: 3 * time.Millisecond, RenderTime: 200 * time.Microsecond})
		}
		// The load run's client names 48 new tenants at once: no assignment limit.
		gwURL := startGateway(t, st, gateway.Config{Assign: gateway.AssignLimits{PerClient: -1, PerKind: -1}})
		tmtest.WaitFor(t, 10*time.Second, tmtest.Until("the gateway routing to every instance", func() bool {
			var r gateway.Readiness
			code, _ := call(t, "GET", gwURL+"/readyz", nil, &r)
			return code == http.StatusOK && r.LiveInstances == instances
		}))
		rng := rand.New(rand.NewPCG(1, 2))
		zipf := rand.NewZipf(rng, 1.2, 1, tenants-1)
		seq := make([]string, requests)
		for i := range seq {
			seq[i] = fmt.Sprintf("tenant-%02d", zipf.Uint64())
		}
		res := runResult{served: map[string]int64{}}
		var mu sync.Mutex
		var next atomic.Int64
		start := time.Now()
		var wg sync.WaitGroup
		for range workers {
			wg.Go(func() {
				for {
					i := next.Add(1) - 1
					if i >= requests {
						return
					}
					req, _ := http.NewRequest("POST", gwURL+"/render", strings.NewReader(`{"path":"/"}`))
					req.Header.Set(tmhttp.HeaderTenant, seq[i])
					resp, err := tmtest.HTTP.Do(req)
					if err != nil {
						t.Error(err)
						return
					}
					body, _ := io.ReadAll(resp.Body)
					resp.Body.Close()
					if resp.StatusCode != 200 {
						t.Logf("%s: %d %s", seq[i], resp.StatusCode, body)
					}
					mu.Lock()
					res.requests++
					if resp.StatusCode == 200 {
						res.ok++
						res.served[resp.Header.Get(tmhttp.HeaderServedBy)]++
						if resp.Header.Get(render.HeaderCache) == "hit" {
							res.hits++
						}
					}
					mu.Unlock()
				}
			})
		}
		wg.Wait()
		res.wall = time.Since(start)
		return res
	}
	report := func(t *testing.T, policy schema.Policy, r runResult) {
		var keys []string
		for k := range r.served {
			keys = append(keys, k)
		}
		slices.SortFunc(keys, cmp.Compare)
		var b strings.Builder
		for _, k := range keys {
			fmt.Fprintf(&b, " %s=%.1f%%", k, 100*float64(r.served[k])/float64(r.ok))
		}
		t.Logf("policy %s: %d requests, %d ok, hit ratio %.1f%%, %.0f req/s; share per instance:%s",
			policy, r.requests, r.ok, 100*float64(r.hits)/float64(max(r.ok, 1)), float64(r.requests)/r.wall.Seconds(), b.String())
		if r.ok < r.requests*99/100 {
			t.Errorf("policy %s: only %d of %d requests succeeded", policy, r.ok, r.requests)
		}
	}
	// managed is the baseline: one shard, power of two choices, no affinity to an instance.
	ratio := map[schema.Policy]float64{}
	for _, p := range []schema.Policy{schema.PolicyAffinity, schema.PolicyLoad, schema.PolicyManaged} {
		t.Run(string(p), func(t *testing.T) {
			r := run(t, p)
			report(t, p, r)
			ratio[p] = float64(r.hits) / float64(max(r.ok, 1))
		})
	}
	base := ratio[schema.PolicyManaged]
	for _, p := range []schema.Policy{schema.PolicyAffinity, schema.PolicyLoad} {
		if ratio[p] < 0.75 || ratio[p] < base+0.15 {
			t.Errorf("policy %s: hit ratio %.1f%%, want at least 75%% and 15 points above the managed baseline's %.1f%%", p, 100*ratio[p], 100*base)
		}
	}
}
