package gateway

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/gateway/breaker"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// A single-writer kind's tenant always reaches the same instance of its shard; tenants spread
// over the instances; when an instance leaves, only its tenants move.
func TestSingleWriterRouting(t *testing.T) {
	route := schema.Route{Method: "*", Prefix: "/w/", Kind: "ledger"}
	var bs []*backend
	e := newEnv(t, Config{}, []schema.KindConfig{{Kind: "ledger", SingleWriter: true}}, func(e *env) {
		for i := range 3 {
			b := newBackend(t, "ledger", "ledger-1", fmt.Sprintf("i%d", i))
			e.register(b, "", 100, route)
			bs = append(bs, b)
		}
		for i := range 30 {
			e.place("ledger", fmt.Sprintf("t%d", i), "ledger-1")
		}
	})
	eventually(t, 10*time.Second, "3 instances", func() bool { return e.gw.reg.snap.Load().total == 3 })
	writers := func() map[string]string {
		w := map[string]string{}
		for i := range 30 {
			tenant := fmt.Sprintf("t%d", i)
			for range 5 {
				resp, body := e.do("POST", "/w/cmd", tenant, "{}", nil)
				if resp.StatusCode != 200 {
					t.Fatalf("%s: %d %s", tenant, resp.StatusCode, body)
				}
				if prev, ok := w[tenant]; ok && prev != body {
					t.Fatalf("%s went to %s and %s", tenant, prev, body)
				}
				w[tenant] = body
			}
		}
		return w
	}
	before := writers()
	per := map[string]int{}
	for _, w := range before {
		per[w]++
	}
	if len(per) != 3 {
		t.Fatalf("30 tenants on %d of 3 instances: %v", len(per), per)
	}
	gone := bs[0].id
	if err := e.st.Directory().Unregister(context.Background(), gone); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "instance gone", func() bool { return e.gw.reg.snap.Load().total == 2 })
	after := writers()
	for tenant, w := range before {
		switch {
		case w == gone.Key() && after[tenant] == w:
			t.Errorf("%s still on the instance that left", tenant)
		case w != gone.Key() && after[tenant] != w:
			t.Errorf("%s moved from %s to %s though its instance stayed", tenant, w, after[tenant])
		}
	}
}

func BenchmarkPickWriter(b *testing.B) {
	insts := make([]*instance, 3)
	for i := range insts {
		insts[i] = &instance{key: fmt.Sprintf("aggregate.aggregate-1.i%d", i), breaker: breaker.New(breaker.Config{})}
	}
	b.ReportAllocs()
	for i := 0; i < b.N; i++ {
		if pickWriter(insts, nil, "tenant-42") == nil {
			b.Fatal("none")
		}
	}
}
