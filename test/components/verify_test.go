package components_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/tenantmesh/tenantmesh/internal/embednats/natstest"
	"github.com/tenantmesh/tenantmesh/internal/tmtest"
	"github.com/tenantmesh/tenantmesh/rebalancer"
	"github.com/tenantmesh/tenantmesh/shardkit"
	"github.com/tenantmesh/tenantmesh/shardkit/kittest"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// digestService is a stateful service whose state per tenant is a list of values up to a
// sequence; a move's target copies it from the shared "stream" when it warms, unless the test
// corrupted what it will load.
type digestService struct {
	stream  *sync.Map // tenant -> []string, the truth both sides read
	mu      sync.Mutex
	state   map[string][]string
	corrupt map[string]bool // tenants this instance loads wrong
	release map[string]int
}

func newDigestService(stream *sync.Map) *digestService {
	return &digestService{stream: stream, state: map[string][]string{}, corrupt: map[string]bool{}, release: map[string]int{}}
}

func (d *digestService) load(tenant string) {
	v, _ := d.stream.Load(tenant)
	vals := append([]string(nil), v.([]string)...)
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.corrupt[tenant] {
		vals[0] = "corrupt"
	}
	d.state[tenant] = vals
}

func (d *digestService) released(tenant string) int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.release[tenant]
}

func (d *digestService) hooks() shardkit.Hooks {
	return shardkit.Hooks{
		Warm: func(_ context.Context, tenant string, _ uint64) error { d.load(tenant); return nil },
		Applied: func(tenant string) uint64 {
			d.mu.Lock()
			defer d.mu.Unlock()
			return uint64(len(d.state[tenant]))
		},
		Release: func(_ context.Context, tenant string) error {
			d.mu.Lock()
			defer d.mu.Unlock()
			delete(d.state, tenant)
			d.release[tenant]++
			return nil
		},
		Digest: func(_ context.Context, tenant string, at uint64) (schema.Digest, error) {
			d.mu.Lock()
			defer d.mu.Unlock()
			vals, ok := d.state[tenant]
			if !ok || uint64(len(vals)) != at {
				return schema.Digest{}, fmt.Errorf("%s is at %d, not %d", tenant, len(vals), at)
			}
			var set schema.DigestSet
			for i, v := range vals {
				set.Add(schema.RowEncoder(nil).Int(int64(i)).String(v))
			}
			return schema.NewDigest(at, set.Part("values")), nil
		},
	}
}

// TestVerifyHoldsTheSourceOnMismatch: a move's source and target record their state digests at
// the fence; with the kind's verify on, a target whose state differs from the source's (it
// loaded corrupt state) keeps the source from releasing the tenant, is counted, and is judged a
// mismatch; a good target's move matches and the source releases at once.
func TestVerifyHoldsTheSourceOnMismatch(t *testing.T) {
	srv := natstest.Server(t)
	st := kittest.StoreAt(t, srv.URL())
	ctx := context.Background()
	verifiedKind(t, st, "aggregate", "")
	var stream sync.Map
	for _, tenant := range []string{"good", "bad"} {
		stream.Store(tenant, []string{tenant + "-1", tenant + "-2", tenant + "-3"})
		if _, err := st.Placements("aggregate").Create(ctx, schema.Placement{Tenant: tenant, Shard: "aggregate-1"}); err != nil {
			t.Fatal(err)
		}
	}
	src, dst := newDigestService(&stream), newDigestService(&stream)
	src.load("good")
	src.load("bad")
	dst.corrupt["bad"] = true
	reg := prometheus.NewRegistry()
	a, aURL := serveShard(t, shardkit.Config{Store: st, ID: schema.InstanceID{Kind: "aggregate", Shard: "aggregate-1", Instance: "a"}, Hooks: src.hooks(), Registerer: reg}, nil)
	serveShard(t, shardkit.Config{Store: st, ID: schema.InstanceID{Kind: "aggregate", Shard: "aggregate-2", Instance: "b"}, Hooks: dst.hooks(), WarmRetry: 20 * time.Millisecond}, nil)

	good := moveWithEngine(t, st, "aggregate", "good", "aggregate-2", "")
	v, err := rebalancer.VerifyMove(ctx, st, good)
	if err != nil || v.Result != schema.VerifyMatch || v.Fence != 3 || len(v.Source) != 1 || len(v.Target) != 1 {
		t.Fatalf("good move: %v %+v", err, v)
	}
	if src.released("good") != 1 {
		t.Fatalf("the source released the verified tenant %d times", src.released("good"))
	}

	bad := moveWithEngine(t, st, "aggregate", "bad", "aggregate-2", "")
	v, err = rebalancer.VerifyMove(ctx, st, bad)
	if err != nil || v.Result != schema.VerifyMismatch || !strings.Contains(v.Detail, "values (3 items, source 3)") {
		t.Fatalf("corrupt target: %v %+v", err, v)
	}
	if n := src.released("bad"); n != 0 {
		t.Fatalf("the source released a tenant whose target differs (%d)", n)
	}
	if got := testutil.ToFloat64(mustCounter(t, reg, "tm_shard_verify_mismatches_total")); got != 1 {
		t.Fatalf("tm_shard_verify_mismatches_total = %v", got)
	}
	held := a.HeldTenants()
	if len(held) != 1 || held[0].Tenant != "bad" || held[0].Target != "aggregate-2" {
		t.Fatalf("held: %+v", held)
	}
	var listed struct{ Held []shardkit.HeldTenant }
	if code, _ := tmtest.CallJSON(t, adminToken, "GET", aURL+"/admin/verify", nil, &listed); code != http.StatusOK || len(listed.Held) != 1 || listed.Held[0].Tenant != "bad" {
		t.Fatalf("GET /admin/verify: %d %+v", code, listed)
	}
	if code, _ := tmtest.CallJSON(t, adminToken, "POST", aURL+"/admin/verify/release?tenant_id=good", nil, nil); code != http.StatusNotFound {
		t.Fatalf("releasing a tenant not held: %d", code)
	}
	if code, _ := tmtest.CallJSON(t, adminToken, "POST", aURL+"/admin/verify/release?tenant_id=bad", nil, nil); code != http.StatusNoContent {
		t.Fatalf("releasing the held tenant: %d", code)
	}
	if src.released("bad") != 1 || len(a.HeldTenants()) != 0 {
		t.Fatalf("after the operator's release: released %d, held %+v", src.released("bad"), a.HeldTenants())
	}
	var recs []schema.DigestRecord
	if recs, err = st.Digests().List(ctx, "aggregate", "bad", bad.Epoch); err != nil || len(recs) != 2 {
		t.Fatalf("records: %v %+v", err, recs)
	}
	b, _ := json.Marshal(recs)
	t.Logf("records of the mismatched move: %s", b)
}

// mustCounter finds the counter name in reg.
func mustCounter(t *testing.T, reg *prometheus.Registry, name string) prometheus.Collector {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name {
			return prometheus.NewCounterFunc(prometheus.CounterOpts{Name: name}, func() float64 { return mf.GetMetric()[0].GetCounter().GetValue() })
		}
	}
	t.Fatalf("no metric %s", name)
	return nil
}
