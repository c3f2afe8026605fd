package cli

import (
	"bytes"
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/internal/tmtest"
	"github.com/tenantmesh/tenantmesh/rebalancer"
	"github.com/tenantmesh/tenantmesh/shardkit"
	"github.com/tenantmesh/tenantmesh/shardkit/kittest"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// digestShard runs an aggregate shard instance whose Digest hook reduces a tenant to the value
// the test keeps for it on that shard (what its "state" is there).
func (e *env) digestShard(t *testing.T, shard string, state *sync.Map) {
	digest := func(_ context.Context, tenant string, at uint64) (schema.Digest, error) {
		v, _ := state.Load(tenant)
		s, _ := v.(string)
		var set schema.DigestSet
		set.Add([]byte(s))
		return schema.NewDigest(at, set.Part("state")), nil
	}
	kittest.Shard(t, shardkit.Config{Store: e.st, ID: schema.InstanceID{Kind: "aggregate", Shard: shard}, Hooks: shardkit.Hooks{Digest: digest}})
}

// TestVerifyCommand: `rebalance verify` judges an applied plan's moves by the digests their
// shards recorded at each fence: a target whose state equals its source's matches, one that
// differs is a mismatch (exit 4), in the table and in JSON; one move alone can be asked for.
func TestVerifyCommand(t *testing.T) {
	e := newEnv(t)
	var one, two sync.Map
	for _, tenant := range []string{"acme", "globex"} {
		e.place(t, tenant, "s-1")
		one.Store(tenant, tenant+" ledger")
		two.Store(tenant, tenant+" ledger")
	}
	two.Store("globex", "globex ledger, one balance off")
	e.digestShard(t, "s-1", &one)
	e.digestShard(t, "s-2", &two)
	tmtest.WaitFor(t, 10*time.Second, tmtest.Until("both shards in the directory", func() bool {
		insts, err := e.st.Directory().Instances(context.Background(), "aggregate")
		return err == nil && len(insts) == 2
	}))

	r := e.run(t, "", "plan", "--output", "json", "manual", "acme=s-2", "globex=s-2", "--kind", "aggregate", "--collect", "0")
	if r.code != 0 {
		t.Fatalf("plan: %d %s", r.code, r.stderr)
	}
	id := decode[PlanOutput](t, r.stdout).ID
	if r = e.run(t, "", "apply", id, "--yes"); r.code != 0 {
		t.Fatalf("apply: %d %s %s", r.code, r.stdout, r.stderr)
	}

	r = e.run(t, "", "verify", id)
	if r.code != 4 || !strings.Contains(r.stdout, "2 moves: 1 mismatch, 1 match") || !strings.Contains(r.stderr, "1 move differ") {
		t.Fatalf("verify: code %d\n%s%s", r.code, r.stdout, r.stderr)
	}
	res := decode[VerifyResult](t, e.run(t, "", "verify", id, "--output", "json").stdout)
	byTenant := map[string]rebalancer.MoveVerdict{}
	for _, v := range res.Verdicts {
		byTenant[v.Tenant] = v
	}
	if byTenant["acme"].Result != schema.VerifyMatch || byTenant["globex"].Result != schema.VerifyMismatch ||
		!strings.Contains(byTenant["globex"].Detail, "target s-2.i1 differs") {
		t.Fatalf("verdicts: %+v", res.Verdicts)
	}
	acme := byTenant["acme"].Move
	if r = e.run(t, "", "verify", id+"/"+acme); r.code != 0 || !strings.Contains(r.stdout, "1 move: 1 match") {
		t.Fatalf("verify one move: code %d\n%s%s", r.code, r.stdout, r.stderr)
	}
	if r = e.run(t, "", "verify", id, "--move", "m00009"); r.code != 1 || !strings.Contains(r.stderr, "no move m00009") {
		t.Fatalf("verify an unknown move: code %d %s", r.code, r.stderr)
	}
	if r = e.run(t, "", "verify"); r.code != 2 {
		t.Fatalf("verify without a plan: code %d", r.code)
	}
}

func TestRenderVerifyGolden(t *testing.T) {
	rec := func(role, shard string, sum string, items int) schema.DigestRecord {
		return schema.DigestRecord{Role: role, Shard: shard, Instance: "a", Digest: &schema.Digest{At: 1042, Sum: sum, Items: items}}
	}
	v := func(move, tenant, result string, fence uint64, detail string, src, tgt []schema.DigestRecord) rebalancer.MoveVerdict {
		return rebalancer.MoveVerdict{Plan: "p20260304-100000-0001", Move: move, Kind: "aggregate", Tenant: tenant, From: "aggregate-1",
			To: "aggregate-2", Verdict: schema.Verdict{Result: result, Fence: fence, Detail: detail, Source: src, Target: tgt}}
	}
	res := VerifyResult{Plan: "p20260304-100000-0001", Verdicts: []rebalancer.MoveVerdict{
		v("m00001", "acme", schema.VerifyMatch, 1042, "1 target instance(s) equal the source at fence 1042",
			[]schema.DigestRecord{rec("source", "aggregate-1", "9c2f1e0b44d7a311", 5)}, []schema.DigestRecord{rec("target", "aggregate-2", "9c2f1e0b44d7a311", 5)}),
		v("m00002", "globex", schema.VerifyMismatch, 77, "target aggregate-2.a differs from the source at 77: subjects (3 items, source 3)",
			[]schema.DigestRecord{rec("source", "aggregate-1", "1b2c3d4e5f607182", 4)}, []schema.DigestRecord{rec("target", "aggregate-2", "0a0b0c0d0e0f1011", 4)}),
		v("m00003", "initech", schema.VerifyUnverified, 0, "no digest from the source aggregate-1 at fence 0", nil, []schema.DigestRecord{rec("target", "aggregate-2", "77aa", 0)}),
		v("m00004", "umbrella", rebalancer.VerifyNotMoved, 0, "the move did not commit (aborted)", nil, nil),
	}}
	res.Summary = rebalancer.Summary(res.Verdicts)
	var b bytes.Buffer
	if err := renderVerify(&b, res); err != nil {
		t.Fatal(err)
	}
	golden(t, "verify", b.String())
}
