package gateway

import (
	"testing"

	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// BenchmarkPickLoad measures the pick stage of a load-policy kind (3 instances, the tenant's
// affinity set): "score" is the choice by load scores alone (what a non-producer route ran
// before producer routes), "plain" a non-producer route now, "producer" a producer route whose
// key (path queue, query group) has consumers on another instance than the usual pick.
func BenchmarkPickLoad(b *testing.B) {
	produce := schema.Route{Method: "POST", Prefix: "/mq/", Kind: "mq",
		Producer: &schema.ProducerRoute{Queue: "path:0", Group: "query:group"}}
	consume := schema.Route{Method: "GET", Prefix: "/mq/", Kind: "mq"}
	var bs []*backend
	e := newEnv(b, Config{}, []schema.KindConfig{{Kind: "mq", Policy: schema.PolicyLoad}}, func(e *env) {
		for _, n := range []string{"a", "b", "c"} {
			be := newBackend(b, "mq", "mq-1", n)
			bs = append(bs, be)
			e.register(be, "", 100, produce, consume)
		}
		e.place("mq", "t1", "mq-1")
	})
	resp, _ := e.do("GET", "/mq/orders", "t1", "", nil) // the tenant's affinity
	if resp.StatusCode != 200 {
		b.Fatal(resp.StatusCode)
	}
	for _, be := range bs {
		if be.id.Key() != resp.Header.Get("X-Served-By") {
			e.announce(be, map[string]int{"orders:g1": 1})
			break
		}
	}
	snap := e.gw.reg.snap.Load()
	ke := snap.kinds["mq"]
	lp := loadPolicy{ke: ke}
	entry, _ := ke.lookup("t1")
	exchangeFor := func(method, target string) *exchange {
		x := &exchange{method: method, path: "/mq/orders", target: []byte(target), tenant: "t1", ke: ke, entry: entry,
			policy: ke.policy(), rt: snap.match(method, "/mq/orders")}
		if (method == "POST") != (x.rt.producer != nil) {
			b.Fatalf("route of %s: producer %v", method, x.rt.producer)
		}
		return x
	}
	run := func(b *testing.B, x *exchange, pick func(x *exchange) *instance) {
		b.ReportAllocs()
		for b.Loop() {
			x.tried = x.triedArr[:0]
			if pick(x) == nil {
				b.Fatal("no instance")
			}
		}
	}
	b.Run("score", func(b *testing.B) {
		x := exchangeFor("GET", "/mq/orders?group=g1")
		run(b, x, func(x *exchange) *instance { return lp.chooseByScore(x, x.rt.byShard[x.entry.Shard], x.tried) })
	})
	b.Run("plain", func(b *testing.B) {
		x := exchangeFor("GET", "/mq/orders?group=g1")
		run(b, x, func(x *exchange) *instance { return lp.choose(x, x.rt.byShard[x.entry.Shard], x.tried) })
	})
	b.Run("producer", func(b *testing.B) {
		x := exchangeFor("POST", "/mq/orders?group=g1")
		run(b, x, func(x *exchange) *instance { return lp.choose(x, x.rt.byShard[x.entry.Shard], x.tried) })
	})
}
