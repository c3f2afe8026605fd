package placement

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// TestTableAgainstMap drives the table and a reference map through the same random inserts,
// updates and deletes (short inline keys and long arena keys), while readers look up
// concurrently; -race checks the publication protocol.
func TestTableAgainstMap(t *testing.T) {
	tb := newTable(0)
	ref := map[string]uint64{}
	rng := rand.New(rand.NewPCG(1, 2))
	key := func(i int) string {
		if i%3 == 0 {
			return fmt.Sprintf("long-tenant-%s-%d", strings.Repeat("x", i%40), i) // arena
		}
		return fmt.Sprintf("t%d", i) // inline
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for range 2 {
		wg.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				if e, ok := tb.lookup(key(i % 3000)); ok && (e.Shard == "" || e.Epoch == 0) {
					t.Errorf("torn read: %+v", e)
					return
				}
				if i%64 == 0 {
					_ = tb.heldTenants() // beside the writer's changes to the set
				}
			}
		})
	}
	for step := range 60000 {
		k := key(rng.IntN(3000))
		if rng.IntN(4) == 0 {
			tb.set(k, 0, uint64(step+1))
			delete(ref, k)
			continue
		}
		p := schema.Placement{Shard: fmt.Sprintf("s-%d", rng.IntN(50)), Epoch: uint64(rng.IntN(1000) + 1), Phase: schema.PhaseActive}
		switch rng.IntN(10) {
		case 0, 1:
			p.Phase, p.Target = schema.PhaseHandoff, "s-99"
		case 2:
			p.Phase, p.Target = schema.PhaseTakeover, "s-98"
		}
		v, ok := tb.pack(p)
		if !ok {
			t.Fatal("pack failed")
		}
		tb.set(k, v, uint64(step+1))
		ref[k] = v
	}
	close(stop)
	wg.Wait()
	if tb.len() != len(ref) {
		t.Fatalf("table holds %d, reference %d", tb.len(), len(ref))
	}
	var takeovers []string
	for k, v := range ref {
		if inTakeover(v) {
			takeovers = append(takeovers, k)
		}
	}
	slices.Sort(takeovers)
	if got := tb.takeovers.Load(); got != int64(len(takeovers)) || len(takeovers) == 0 {
		t.Fatalf("table counts %d takeovers, reference %d", got, len(takeovers))
	}
	if held := tb.heldTenants(); !slices.Equal(slices.Sorted(slices.Values(held)), takeovers) {
		t.Fatalf("table holds %d tenants in a takeover, reference %d (or others)", len(held), len(takeovers))
	}
	for i := range 3000 {
		k := key(i)
		e, ok := tb.lookup(k)
		want, wantOK := ref[k]
		if ok != wantOK {
			t.Fatalf("%s: found=%v, want %v", k, ok, wantOK)
		}
		if ok {
			we, _ := tb.decode(want, 0)
			if e.Shard != we.Shard || e.Epoch != we.Epoch || e.Phase != we.Phase || e.Target != we.Target {
				t.Fatalf("%s = %+v, want %+v", k, e, we)
			}
		}
	}
	// A snapshot round trip preserves everything.
	t2, rev, err := decodeSnapshot("k", encodeSnapshot("k", 77, tb))
	if err != nil || rev != 77 || t2.len() != tb.len() || t2.takeovers.Load() != tb.takeovers.Load() {
		t.Fatalf("snapshot: %v rev=%d len=%d takeovers=%d", err, rev, t2.len(), t2.takeovers.Load())
	}
	if held := t2.heldTenants(); !slices.Equal(slices.Sorted(slices.Values(held)), takeovers) {
		t.Fatalf("snapshot: %d tenants in a takeover, reference %d (or others)", len(held), len(takeovers))
	}
	for k := range ref {
		a, _ := tb.lookup(k)
		b, ok := t2.lookup(k)
		if !ok || a.Shard != b.Shard || a.Epoch != b.Epoch || a.Revision != b.Revision {
			t.Fatalf("%s after snapshot: %+v vs %+v", k, b, a)
		}
	}
	bad := encodeSnapshot("k", 1, tb)
	bad[len(bad)/2] ^= 0xff
	if _, _, err := decodeSnapshot("k", bad); err == nil {
		t.Fatal("corrupted snapshot accepted")
	}
}

func TestPackLimits(t *testing.T) {
	tb := newTable(0)
	if _, ok := tb.pack(schema.Placement{Shard: "s", Epoch: maxEpoch + 1, Phase: schema.PhaseActive}); ok {
		t.Fatal("epoch beyond 28 bits packed")
	}
	v, ok := tb.pack(schema.Placement{Shard: "s", Epoch: maxEpoch, Phase: schema.PhaseDraining, Source: "old", Pinned: true})
	e, _ := tb.decode(v, 9)
	if !ok || e.Epoch != maxEpoch || e.Source != "old" || !e.Pinned || e.Revision != 9 {
		t.Fatalf("round trip: %+v", e)
	}
}
