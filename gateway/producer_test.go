package gateway

import (
	"fmt"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/gateway/h1"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// announce publishes b's waiting consumers in a load report and waits until the gateway holds
// exactly them.
func (e *env) announce(b *backend, keys map[string]int) {
	e.t.Helper()
	var cs []schema.ConsumerPresence
	total := 0
	for k, n := range keys {
		q, g, _ := cut(k)
		cs = append(cs, schema.ConsumerPresence{Queue: q, Group: g, Waiting: n})
		total += n
	}
	eventually(e.t, 10*time.Second, "consumers of "+b.id.Key(), func() bool {
		_ = e.st.PublishLoad(schema.LoadReport{InstanceID: b.id, Consumers: cs})
		e.gw.reg.mu.Lock()
		in := e.gw.reg.insts[b.id.Key()]
		e.gw.reg.mu.Unlock()
		if in == nil {
			return false
		}
		got := 0
		if set := in.consumers.Load(); set != nil {
			for _, qc := range *set {
				got += qc.total
			}
		}
		return got == total
	})
}

func cut(k string) (q, g string, ok bool) {
	for i := range len(k) {
		if k[i] == ':' {
			return k[:i], k[i+1:], true
		}
	}
	return k, "", false
}

// Producer routes of a load-policy kind, end to end through telemetry: the seed's cases (the
// usual pick has consumers for the key, another instance has, none has) and the dynamic key
// granularity (queue:group up to queue_affinity_threshold groups, the queue beyond it).
func TestProducerRoutes(t *testing.T) {
	produce := schema.Route{Method: "POST", Prefix: "/mq/", Kind: "mq",
		Producer: &schema.ProducerRoute{Queue: "path:0", Group: "query:group"}}
	consume := schema.Route{Method: "GET", Prefix: "/mq/", Kind: "mq"}
	bs := map[string]*backend{}
	e := newEnv(t, Config{}, []schema.KindConfig{{Kind: "mq", Policy: schema.PolicyLoad}}, func(e *env) {
		for _, n := range []string{"a", "b", "c"} {
			bs[n] = newBackend(t, "mq", "mq-1", n)
			e.register(bs[n], "", 100, produce, consume)
		}
	})
	by := map[string]*backend{}
	for _, b := range bs {
		by[b.id.Key()] = b
	}
	// The tenant's usual pick is its load-policy affinity, fixed by its first request.
	resp, _ := e.do("GET", "/mq/orders", "t1", "", nil)
	usual := by[resp.Header.Get(tmhttp.HeaderServedBy)]
	if usual == nil {
		t.Fatalf("first request: %d %v", resp.StatusCode, resp.Header)
	}
	var others []*backend
	for _, n := range []string{"a", "b", "c"} {
		if bs[n] != usual {
			others = append(others, bs[n])
		}
	}
	x, y := others[0], others[1]
	servedBy := func(path string) string {
		t.Helper()
		resp, body := e.do("POST", path, "t1", "m", nil)
		if resp.StatusCode != 200 {
			t.Fatalf("POST %s: %d %s", path, resp.StatusCode, body)
		}
		return resp.Header.Get(tmhttp.HeaderServedBy)
	}
	groups := func(from, to int) map[string]int {
		m := map[string]int{}
		for i := from; i <= to; i++ {
			m[fmt.Sprintf("orders:g%d", i)] = 1
		}
		return m
	}
	for _, c := range []struct {
		name      string
		consumers map[*backend]map[string]int
		path      string
		want      *backend
	}{
		{"none has consumers: the usual pick", nil, "/mq/orders?group=g1", usual},
		{"another has: there", map[*backend]map[string]int{x: {"orders:g1": 2}}, "/mq/orders?group=g1", x},
		{"the usual pick has: kept", map[*backend]map[string]int{usual: {"orders:g1": 1}, x: {"orders:g1": 5}}, "/mq/orders?group=g1", usual},
		{"another has, for another group only: the usual pick", map[*backend]map[string]int{x: {"orders:g2": 1}}, "/mq/orders?group=g1", usual},
		{"a key without a group: any consumer of the queue", map[*backend]map[string]int{x: {"orders:g2": 1}}, "/mq/orders", x},
		{"the most consumers win", map[*backend]map[string]int{x: {"orders:g1": 1}, y: {"orders:g1": 3}}, "/mq/orders?group=g1", y},
		// Granularity: 10 groups in all is still queue:group, so g1's producer goes to x alone.
		{"10 groups: keyed by queue:group", map[*backend]map[string]int{x: {"orders:g1": 1}, y: groups(2, 10)}, "/mq/orders?group=g1", x},
		// An 11th group switches the queue to queue-level affinity: the most consumers of orders.
		{"11 groups: keyed by queue", map[*backend]map[string]int{x: {"orders:g1": 1}, y: groups(2, 11)}, "/mq/orders?group=g1", y},
	} {
		t.Run(c.name, func(t *testing.T) {
			for _, b := range bs {
				e.announce(b, c.consumers[b])
			}
			for i := range 5 {
				if got := servedBy(c.path); got != c.want.id.Key() {
					t.Fatalf("request %d served by %s, want %s", i, got, c.want.id.Key())
				}
			}
		})
	}
	// A route that is not a producer route keeps its usual pick whatever the consumers.
	e.announce(x, map[string]int{"orders:g1": 9})
	e.announce(usual, nil)
	resp, _ = e.do("GET", "/mq/orders?group=g1", "t1", "", nil)
	if got := resp.Header.Get(tmhttp.HeaderServedBy); got != usual.id.Key() {
		t.Fatalf("consumer route served by %s, want the usual %s", got, usual.id.Key())
	}
}

func TestProducerKeyParts(t *testing.T) {
	for _, c := range []struct {
		name, src, path, target, header, want string
	}{
		{"tenant", "tenant", "/mq/orders", "/mq/orders", "", "t1"},
		{"path 0", "path:0", "/mq/orders/x", "/mq/orders/x", "", "orders"},
		{"path 1", "path:1", "/mq/orders/x", "/mq/orders/x", "", "x"},
		{"path past the end", "path:2", "/mq/orders/x", "/mq/orders/x", "", ""},
		{"query", "query:group", "/mq/orders", "/mq/orders?a=1&group=g7&group=g8", "", "g7"},
		{"query escaped", "query:group", "/mq/orders", "/mq/orders?group=a%20b", "", "a b"},
		{"query absent", "query:group", "/mq/orders", "/mq/orders?groups=x", "", ""},
		{"header", "header:X-Queue", "/mq/", "/mq/", "invoices", "invoices"},
	} {
		t.Run(c.name, func(t *testing.T) {
			x := &exchange{tenant: "t1", path: c.path, target: []byte(c.target)}
			if c.header != "" {
				x.fields = append(x.fields, h1.Field{Name: []byte("x-queue"), Value: []byte(c.header)})
			}
			if got := parseKeySource(c.src).read(x, "/mq/"); got != c.want {
				t.Fatalf("%s: %q, want %q", c.src, got, c.want)
			}
		})
	}
}
