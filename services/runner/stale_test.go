package runner

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/tenantmesh/tenantmesh/internal/embednats/natstest"
	"github.com/tenantmesh/tenantmesh/internal/tmtest"
	"github.com/tenantmesh/tenantmesh/shardkit/jsx"
	"github.com/tenantmesh/tenantmesh/shardkit/kittest"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// A KV Get is a direct get, which any replica that is nearly caught up (or a mirror with
// MirrorDirect) answers: it can miss a run created a moment ago. A claim that read such a
// miss dropped the job's queue entry, and the job stayed pending for ever (the chaos test's
// "accepted jobs still pending"). Here, on a 3-node cluster, every direct get of the runs
// bucket the runner instances make is answered by a mirror that never receives the tenant's
// runs (a replica lagging for good), while the tenant moves from a two-instance shard to
// another shard and jobs are created before, during and after the move: every job still
// runs, and its effect is delivered exactly once.
func TestClaimReadsTheLatestRun(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a 3-node NATS cluster")
	}
	c := natstest.NewCluster(t)
	admin := kittest.StoreAt(t, c.URLs())
	ctx := context.Background()
	// The runner's streams and buckets (one replica each), as an instance creates them.
	if _, err := New(ctx, Config{Store: admin, ID: schema.InstanceID{Kind: Kind, Shard: "runner-0", Instance: "setup"}, Sagas: []Saga{}}); err != nil {
		t.Fatal(err)
	}
	bucket := schema.ServiceBucket(Kind, "runs")
	js := admin.JS().JetStream()
	runs, err := js.Stream(ctx, jsx.KVStream(bucket))
	if err != nil {
		t.Fatal(err)
	}
	// The instances connect to a server that does not hold the runs bucket, so their direct
	// gets are answered by the mirror's replica there (local responders come first).
	staleURL := ""
	for _, cfg := range c.Configs {
		if cfg.Name != runs.CachedInfo().Cluster.Leader {
			staleURL = fmt.Sprintf("nats://127.0.0.1:%d", cfg.Port)
			break
		}
	}
	kv, err := js.KeyValue(ctx, bucket)
	if err != nil {
		t.Fatal(err)
	}
	// The mirror gets only the keys of a tenant "stale". It needs one (a replica of a stream
	// with nothing committed does not serve direct gets), written before it starts.
	for _, key := range []string{"stale.1", "probe.1"} {
		if _, err := kv.Put(ctx, key, []byte("{}")); err != nil {
			t.Fatal(err)
		}
	}
	// A 3-replica stream needs every peer of the new cluster online ("no suitable peers for
	// placement" until then): setting the scene, so tried until it is placed.
	tmtest.WaitFor(t, time.Minute, func() error {
		_, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "STALE_RUNS", Replicas: 3, MirrorDirect: true,
			Mirror: &jetstream.StreamSource{Name: jsx.KVStream(bucket), FilterSubject: jsx.KVSubject(bucket, "stale.>")}})
		return err
	})
	// Wait until the mirror answers there: a run the bucket has is not found through it. A
	// new mirror takes 2-15 s (more on a loaded machine) to serve direct gets: this sets the
	// scene, it is not what the test checks.
	probe, err := jetstream.New(natstest.Connect(t, staleURL))
	if err != nil {
		t.Fatal(err)
	}
	pkv, err := probe.KeyValue(ctx, bucket)
	if err != nil {
		t.Fatal(err)
	}
	misses := 0
	mirrorWait := time.Now()
	waitUntil(t, time.Minute, "direct gets answered by the stale mirror", func() bool {
		if _, err := pkv.Get(ctx, "probe.1"); errors.Is(err, jetstream.ErrKeyNotFound) {
			misses++
		} else {
			misses = 0
		}
		return misses >= 20
	})
	t.Logf("the mirror answered after %v", time.Since(mirrorWait))

	rc := newReceiver(t)
	const tenant = "acme"
	p := place(t, admin, tenant, "runner-1")
	cfg := Config{Logger: testLogger(), MaxConcurrent: 8}
	stale := func(shard, instance string) *Service {
		return startService(t, kittest.StoreAt(t, staleURL), shard, instance, cfg)
	}
	a1, a2, b1 := stale("runner-1", "a1"), stale("runner-1", "a2"), stale("runner-2", "b1")
	owning(t, a1, tenant, true)
	owning(t, a2, tenant, true)
	job := hookJob(rc.URL, "x")
	ids := create(t, a1, tenant, 40, job)
	p = step(t, admin, p, func(p *schema.Placement) { p.Phase, p.Target = schema.PhaseWarming, "runner-2" })
	ids = append(ids, create(t, a2, tenant, 40, job)...) // the source still acquires
	p = step(t, admin, p, func(p *schema.Placement) { p.Phase = schema.PhaseHandoff })
	var wg sync.WaitGroup
	for _, a := range []*Service{a1, a2} {
		wg.Go(func() {
			if err := a.Release(ctx, tenant); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	p = kittest.Commit(t, admin, p, "runner-2")
	owning(t, b1, tenant, true)
	ids = append(ids, create(t, b1, tenant, 40, job)...)
	step(t, admin, p, func(p *schema.Placement) { p.Phase, p.Source = schema.PhaseActive, "" })

	done := waitDone(t, b1, tenant, ids, 60*time.Second)
	counts, _ := rc.snapshot()
	for _, id := range ids {
		if r := done[id]; r.Status != StatusSucceeded {
			t.Errorf("job %s: %s %s", id, r.Status, r.Error)
		}
		if n := counts[fmt.Sprintf("%s.job.%s.0", tenant, id)]; n != 1 {
			t.Errorf("job %s: effect delivered %d times, want 1", id, n)
		}
	}
}

// A claim reads the run with a direct get first, and a replica behind may answer with an older
// revision of a run that is pending and due. The claim's compare-and-set refuses it; the claim
// must then read the leader and claim, not take the refusal for a sibling's claim and leave the
// job waiting. Here every direct get of the job's run answers its first revision (a replica
// behind for good: JetStream has no way to hold one back, so the runner's read is given it),
// and the run is written again at the leader before it is due: the job still runs, once.
func TestClaimAfterAStaleRead(t *testing.T) {
	st, _ := kittest.Store(t)
	ctx := context.Background()
	rc := newReceiver(t)
	const tenant = "acme"
	place(t, st, tenant, "runner-1")
	a := startService(t, st, "runner-1", "a", Config{Logger: testLogger()})
	owning(t, a, tenant, true)
	var first atomic.Pointer[Run]
	a.store.behind = func(tn, id string) (Run, bool) {
		if r := first.Load(); r != nil && tn == r.Tenant && id == r.ID {
			return *r, true
		}
		return Run{}, false
	}
	job := hookJob(rc.URL, "x")
	job.Delay = "2s"
	id := create(t, a, tenant, 1, job)[0]
	r, err := a.store.getLatest(ctx, tenant, id)
	if err != nil {
		t.Fatal(err)
	}
	first.Store(&r)
	kv, err := st.JS().JetStream().KeyValue(ctx, schema.ServiceBucket(Kind, "runs"))
	if err != nil {
		t.Fatal(err)
	}
	cur, err := kv.Get(ctx, runKey(tenant, id))
	if err != nil {
		t.Fatal(err)
	}
	if cur.Revision() != r.rev {
		t.Fatalf("the run changed before it was due: revision %d, read %d", cur.Revision(), r.rev)
	}
	if _, err := kv.Update(ctx, runKey(tenant, id), cur.Value(), cur.Revision()); err != nil {
		t.Fatal(err)
	}

	done := waitDone(t, a, tenant, []string{id}, 30*time.Second)
	if got := done[id]; got.Status != StatusSucceeded {
		t.Fatalf("job %s: %s %s", id, got.Status, got.Error)
	}
	counts, _ := rc.snapshot()
	if n := counts[fmt.Sprintf("%s.job.%s.0", tenant, id)]; n != 1 {
		t.Errorf("job %s: effect delivered %d times, want 1", id, n)
	}
}
