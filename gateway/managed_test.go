package gateway

import (
	"context"
	"errors"
	"net"
	"net/http"
	"slices"
	"sync/atomic"
	"testing"

	"github.com/tenantmesh/tenantmesh/gateway/breaker"
	"github.com/tenantmesh/tenantmesh/shardkit/placement"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// The managed policy without a gateway: a policyEnv and an exchange are all it reads. An
// attempt that never connected goes again on the shard's other instance, while the retry
// budget lasts; with every instance tried, pick answers 503, naming the failure.
func TestManagedPolicyWithoutGateway(t *testing.T) {
	a := &instance{key: "k.s1.a", breaker: breaker.New(breaker.Config{})}
	b := &instance{key: "k.s1.b", breaker: breaker.New(breaker.Config{})}
	ke := &kindEntry{name: "k", metrics: newMetrics(nil, nil).forKind("k")}
	ke.cfg.Store(&schema.KindConfig{Kind: "k"})
	x := &exchange{ctx: context.Background(), method: http.MethodPost, tenant: "t1", replayable: true, ke: ke,
		entry: placement.Entry{Shard: "s1", Epoch: 1}, rt: &route{kind: "k", byShard: map[string][]*instance{"s1": {a, b}}}}
	env := &policyEnv{snap: new(atomic.Pointer[snapshot]), retries: 1, refresh: func(*exchange, tmhttp.Problem) error {
		t.Fatal("a transport failure refreshed the placement")
		return nil
	}}
	env.snap.Store(&snapshot{}) // no routes: a retry keeps the request's
	var p policy = managedPolicy{}
	refused := &net.OpError{Op: "dial", Net: "tcp", Err: errors.New("connection refused")}

	first, err := p.pick(env, x, 0)
	if first == nil || err != nil {
		t.Fatalf("pick 0: %v, %v", first, err)
	}
	if v, err := p.judge(env, x, first, nil, refused, 0); v != again || err != nil {
		t.Fatalf("judge 0 of a refused connection: %v, %v; want again", v, err)
	}
	second, err := p.pick(env, x, 1)
	if second == nil || second == first || err != nil {
		t.Fatalf("pick 1: %v after %v, %v; want the other instance", second, first, err)
	}
	v, err := p.judge(env, x, second, nil, refused, 1)
	var ue *upstreamError
	if v != fail || !errors.As(err, &ue) || ue.inst != second.key {
		t.Fatalf("judge 1 with the retry budget spent: %v, %v; want fail with the upstream error", v, err)
	}
	if !slices.Equal(x.tried, []*instance{first}) {
		t.Fatalf("tried %v, want [%v]", x.tried, first)
	}
	x.tried = append(x.tried, second)
	in, err := p.pick(env, x, 2)
	var te *tmhttp.Error
	if in != nil || !errors.As(err, &te) || te.Status != http.StatusServiceUnavailable || te.Type != "no-live-instance" {
		t.Fatalf("pick with every instance tried: %v, %v; want 503 no-live-instance", in, err)
	}
}
