package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	natsserver "github.com/nats-io/nats-server/v2/server"

	"github.com/tenantmesh/tenantmesh/internal/embednats"
	"github.com/tenantmesh/tenantmesh/internal/embednats/natstest"
	"github.com/tenantmesh/tenantmesh/internal/natsauth"
	"github.com/tenantmesh/tenantmesh/internal/tmtest"
	"github.com/tenantmesh/tenantmesh/shardkit/kittest"
	"github.com/tenantmesh/tenantmesh/shardkit/natsconn"
	"github.com/tenantmesh/tenantmesh/shardkit/natsperm"

	"github.com/tenantmesh/tenantmesh/rebalancer"
	"github.com/tenantmesh/tenantmesh/rebalancer/server"
	"github.com/tenantmesh/tenantmesh/shardkit"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

var update = flag.Bool("update", false, "rewrite testdata/*.golden from the current output")

// env is an embedded nats-server with the tenantmesh schema.
type env struct {
	url, creds string
	st         *schema.Store
}

func newEnv(t *testing.T) *env {
	st, url := kittest.Store(t)
	return &env{url: url, st: st, creds: natstest.CredsFile(t, natsperm.Rebalancer())}
}

// startShard runs one stateless shardkit instance of kind aggregate until the test ends.
func (e *env) startShard(t *testing.T, shard string) {
	kittest.Shard(t, shardkit.Config{Store: e.st, ID: schema.InstanceID{Kind: "aggregate", Shard: shard},
		Labels: map[string]string{"region": "eu"}})
}

func (e *env) place(t *testing.T, tenant, shard string) schema.Placement {
	t.Helper()
	p, err := e.st.Placements("aggregate").Create(context.Background(), schema.Placement{Tenant: tenant, Shard: shard})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

type result struct {
	stdout, stderr string
	code           int
}

// run runs the CLI in-process against the embedded server.
func (e *env) run(t *testing.T, stdin string, args ...string) result {
	t.Helper()
	var out, errb bytes.Buffer
	m := &Main{Stdin: strings.NewReader(stdin), Stdout: &out, Stderr: &errb, Terminal: func(any) bool { return false }}
	if len(args) > 0 && args[0] != "help" {
		args = append(args, "--nats-url", e.url, "--nats-creds", e.creds)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	code := m.Exit(ctx, args)
	return result{out.String(), errb.String(), code}
}

func golden(t *testing.T, name, got string) {
	t.Helper()
	path := filepath.Join("testdata", name+".golden")
	if *update {
		if err := os.MkdirAll("testdata", 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, []byte(got), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (run with -update to create it)", err)
	}
	if got != string(want) {
		t.Errorf("%s differs from %s (run with -update to accept):\n--- got\n%s\n--- want\n%s", name, path, got, want)
	}
}

func decode[T any](t *testing.T, s string) T {
	t.Helper()
	var v T
	if err := json.Unmarshal([]byte(s), &v); err != nil {
		t.Fatalf("output is not JSON: %v\n%s", err, s)
	}
	return v
}

// TestPlanApplyStatusRollback drives the whole CLI against real shards: a dry run (golden),
// a stored plan (JSON), apply (refused without --yes off a terminal, then done), status,
// audit, rollback.
func TestPlanApplyStatusRollback(t *testing.T) {
	e := newEnv(t)
	e.startShard(t, "s-1")
	e.startShard(t, "s-2")
	for i := range 6 {
		e.place(t, fmt.Sprintf("t%d", i), "s-1")
	}

	r := e.run(t, "", "plan", "balance", "--kind", "aggregate", "--collect", "0", "--dry-run")
	if r.code != 0 {
		t.Fatalf("dry run: %d %s", r.code, r.stderr)
	}
	golden(t, "plan-balance-dry-run", r.stdout)

	r = e.run(t, "", "plan", "--output", "json", "balance", "--kind", "aggregate", "--collect", "0")
	if r.code != 0 {
		t.Fatalf("plan: %d %s", r.code, r.stderr)
	}
	po := decode[PlanOutput](t, r.stdout)
	if po.ID == "" || len(po.Plan.Moves) != 3 {
		t.Fatalf("plan output %+v", po)
	}

	if r = e.run(t, "", "apply", po.ID); r.code != 2 || !strings.Contains(r.stderr, "--yes") {
		t.Fatalf("apply without --yes off a terminal: code %d, %q", r.code, r.stderr)
	}
	r = e.run(t, "", "apply", po.ID, "--yes")
	if r.code != 0 {
		t.Fatalf("apply: %d\n%s\n%s", r.code, r.stdout, r.stderr)
	}
	if !strings.Contains(r.stdout, "[3/3]") || !strings.Contains(r.stdout, "plan "+po.ID+": done") {
		t.Fatalf("apply output:\n%s", r.stdout)
	}

	r = e.run(t, "", "status")
	if r.code != 0 || !strings.Contains(r.stdout, po.ID) || !strings.Contains(r.stdout, "done") {
		t.Fatalf("status: %d\n%s%s", r.code, r.stdout, r.stderr)
	}
	sums := decode[[]rebalancer.PlanSummary](t, e.run(t, "", "status", "--output", "json").stdout)
	if len(sums) != 1 || sums[0].Count(rebalancer.MoveDone) != 3 {
		t.Fatalf("status json %+v", sums)
	}
	pr := decode[PlanResult](t, e.run(t, "", "status", po.ID, "--output", "json").stdout)
	for _, m := range pr.Moves {
		if m.State != rebalancer.MoveDone || m.Pause() <= 0 {
			t.Errorf("move %s: %s, pause %s", m.ID, m.State, m.Pause())
		}
	}
	moved := pr.Moves[0].Tenant
	evs := decode[[]schema.AuditEvent](t, e.run(t, "", "audit", "--tenant", moved, "--output", "json").stdout)
	if len(evs) != 4 || evs[3].Action != "move.done" {
		t.Fatalf("audit of %s: %+v", moved, evs)
	}
	if r = e.run(t, "", "audit", "--kind", "aggregate", "--since", "1h"); r.code != 0 || !strings.Contains(r.stdout, "move.commit") {
		t.Fatalf("audit table: %d\n%s%s", r.code, r.stdout, r.stderr)
	}

	r = e.run(t, "", "rollback", po.ID, "--yes", "--output", "json")
	if r.code != 0 {
		t.Fatalf("rollback: %d\n%s\n%s", r.code, r.stdout, r.stderr)
	}
	rb := decode[PlanResult](t, r.stdout)
	if rb.Plan.RollbackOf != po.ID || len(rb.Moves) != 3 {
		t.Fatalf("rollback result %+v", rb.Plan)
	}
	for i := range 6 {
		p, _ := e.st.Placements("aggregate").Get(context.Background(), fmt.Sprintf("t%d", i))
		if p.Shard != "s-1" || p.Phase != schema.PhaseActive {
			t.Errorf("t%d after rollback: %s %s", i, p.Shard, p.Phase)
		}
	}
	if r = e.run(t, "", "status"); !strings.Contains(r.stdout, "rolled back by "+rb.Plan.ID) {
		t.Fatalf("status after rollback:\n%s", r.stdout)
	}
}

// TestApplyPartialExitCode: a tenant pinned after planning is skipped; apply exits 3.
func TestApplyPartialExitCode(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	p := e.place(t, "acme", "s-1")
	e.place(t, "globex", "s-2")
	// Manual plans are checked against the world, which needs live shards.
	for _, sh := range []string{"s-1", "s-2"} {
		if _, err := e.st.Directory().Register(ctx, schema.Instance{InstanceID: schema.InstanceID{Kind: "aggregate", Shard: sh, Instance: "i1"}, URL: "http://127.0.0.1:9", Capacity: 10}); err != nil {
			t.Fatal(err)
		}
	}
	file := filepath.Join(t.TempDir(), "plan.json")
	r := e.run(t, "", "plan", "manual", "acme=s-2", "--kind", "aggregate", "--collect", "0", "--out", file, "--dry-run")
	if r.code != 0 || !strings.Contains(r.stdout, "plan written to "+file) {
		t.Fatalf("plan: %d %s %s", r.code, r.stdout, r.stderr)
	}
	np := p
	np.Pinned = true
	if _, err := e.st.Placements(np.Kind).Update(ctx, p, np); err != nil {
		t.Fatal(err)
	}
	r = e.run(t, "", "apply", file, "--yes")
	if r.code != 3 || !strings.Contains(r.stdout, "skipped") || !strings.Contains(r.stderr, "partially") {
		t.Fatalf("apply of a stale plan: code %d\n%s\n%s", r.code, r.stdout, r.stderr)
	}
}

func TestUsageAndErrors(t *testing.T) {
	e := newEnv(t)
	cases := []struct {
		args []string
		code int
		want string
	}{
		{[]string{"bogus"}, 2, "unknown command"},
		{[]string{"plan"}, 2, "name a strategy"},
		{[]string{"plan", "sideways", "--collect", "0"}, 2, "unknown strategy"},
		{[]string{"plan", "evacuate"}, 2, "one shard"},
		{[]string{"plan", "move", "acme"}, 2, "--to"},
		{[]string{"plan", "balance", "--nope"}, 2, "flag provided but not defined"},
		{[]string{"status", "--output", "yaml"}, 2, "--output"},
		{[]string{"apply", "p-nope", "--yes"}, 1, "plan not found"},
		{[]string{"plan", "evacuate", "s-9", "--kind", "aggregate", "--collect", "0"}, 1, "cannot plan"},
		{[]string{"plan", "balance", "--kind", "nokind", "--collect", "0"}, 1, "unknown kind"},
		{[]string{"plan", "balance", "--collect", "0"}, 1, "name the kind"},
		{[]string{"kinds", "set", "aggregate", "--unplaced", "sometimes"}, 1, "unplaced"},
	}
	for _, c := range cases {
		r := e.run(t, "", c.args...)
		if r.code != c.code || !strings.Contains(r.stderr, c.want) || strings.Count(strings.TrimSpace(r.stderr), "\n") != 0 {
			t.Errorf("%v: code %d, stderr %q; want code %d and one line with %q", c.args, r.code, r.stderr, c.code, c.want)
		}
	}
	r := e.run(t, "", "plan", "--help")
	if r.code != 0 || !strings.Contains(r.stdout, "Examples:") || !strings.Contains(r.stdout, "-tolerance") {
		t.Errorf("plan --help: %d %q", r.code, r.stdout)
	}
	if r := e.run(t, "", "help"); r.code != 0 || !strings.Contains(r.stdout, "rollback") {
		t.Errorf("help: %d %q", r.code, r.stdout)
	}
}

func TestKindsAndInstances(t *testing.T) {
	e := newEnv(t)
	e.startShard(t, "s-1")
	r := e.run(t, "", "kinds", "set", "aggregate", "--unplaced", "reject")
	if r.code != 0 || !strings.Contains(r.stdout, "reject") {
		t.Fatalf("kinds set: %d %s %s", r.code, r.stdout, r.stderr)
	}
	kcs := decode[[]schema.KindConfig](t, e.run(t, "", "kinds", "--output", "json").stdout)
	for _, k := range kcs {
		if k.Kind == "aggregate" && (k.Unplaced != schema.UnplacedReject || k.Policy != schema.PolicyManaged) {
			t.Errorf("aggregate after set: %+v", k)
		}
	}
	if r := e.run(t, "", "kinds", "set", "render", "--policy", "affinity", "--multiplex", "2"); r.code != 0 {
		t.Fatalf("register an affinity kind: %d %s", r.code, r.stderr)
	}
	if r := e.run(t, "", "kinds", "set", "mq", "--policy", "load", "--queue-affinity-threshold", "4", "--degraded-error-rate", "0.2", "--output", "json"); r.code != 0 {
		t.Fatalf("register a load kind: %d %s", r.code, r.stderr)
	} else if kc := decode[schema.KindConfig](t, r.stdout); kc.Load == nil || kc.Load.QueueAffinityThreshold != 4 || kc.DegradedErrorRate != 0.2 {
		t.Fatalf("load kind: %+v", kc)
	}
	if r := e.run(t, "", "kinds", "set", "render", "--queue-affinity-threshold", "4"); r.code != 2 {
		t.Fatalf("--queue-affinity-threshold on an affinity kind: exit %d", r.code)
	}
	views := decode[[]rebalancer.InstanceView](t, e.run(t, "", "instances", "--output", "json").stdout)
	if len(views) != 1 || views[0].Status != schema.StatusOnline || views[0].Labels["region"] != "eu" {
		t.Fatalf("instances: %+v", views)
	}
	if r := e.run(t, "", "instances"); !strings.Contains(r.stdout, "aggregate.s-1.i1") || !strings.Contains(r.stdout, "region=eu") {
		t.Fatalf("instances table:\n%s", r.stdout)
	}
}

// TestRenderGolden renders fixed records with every table renderer.
func TestRenderGolden(t *testing.T) {
	created := time.Date(2026, 3, 4, 10, 0, 0, 0, time.UTC)
	rec := rebalancer.PlanRecord{ID: "p20260304-100000-0001", Status: rebalancer.PlanPartial, Actor: "cli/ops", Created: created}
	rec.Plan.Strategy, rec.Plan.Concurrency, rec.Plan.Waves = "balance", 2, 2
	mv := func(id, tenant string, st rebalancer.MoveState, wave int, pause time.Duration, reason string) rebalancer.MoveRecord {
		m := rebalancer.MoveRecord{Plan: rec.ID, ID: id, State: st, Reason: reason}
		m.Kind, m.Tenant, m.From, m.To, m.Wave = "aggregate", tenant, "aggregate-1", "aggregate-2", wave
		if pause > 0 {
			m.Handoff = created.Add(time.Second)
			m.Commit = m.Handoff.Add(pause)
		}
		return m
	}
	moves := []rebalancer.MoveRecord{
		mv("m00001", "acme", rebalancer.MoveDone, 1, 12*time.Millisecond, ""),
		mv("m00002", "globex", rebalancer.MoveSkipped, 1, 0, "the tenant changed since the plan"),
		mv("m00003", "initech", rebalancer.MoveAborted, 2, 0, "the target aggregate-2 was not ready within 2m0s"),
	}
	moves[0].Strategy, moves[0].WarmupSeconds = "snapshot", 0.046 // chosen by size: shown with its prediction
	for _, m := range moves {
		rec.Plan.Moves = append(rec.Plan.Moves, m.Move)
	}
	var b bytes.Buffer
	_ = renderPlanDetail(&b, rec, moves)
	b.WriteString("----------\n")
	rb := rebalancer.PlanRecord{ID: "p20260304-110000-0001", Status: rebalancer.PlanDone, Actor: "rollback/r1", Created: created.Add(time.Hour), RollbackOf: rec.ID}
	rec.RolledBackBy = rb.ID
	_ = renderPlans(&b, []rebalancer.PlanSummary{rebalancer.Summarize(rb, nil), rebalancer.Summarize(rec, moves)})
	b.WriteString("----------\n")
	now := created.Add(10 * time.Minute)
	i := func(shard, name string, hb time.Duration, st schema.Status, m *schema.InstanceMetrics) rebalancer.InstanceView {
		in := schema.Instance{InstanceID: schema.InstanceID{Kind: "runner", Shard: shard, Instance: name}, URL: "http://10.0.0.1:9101",
			Capacity: 50, Version: "v1.2.0", Labels: map[string]string{"region": "eu", "env": "prod"}, Heartbeat: now.Add(-hb), Metrics: m}
		return rebalancer.InstanceView{Instance: in, Key: in.Key(), Status: st, HeartbeatAge: hb.Seconds()}
	}
	_ = renderInstances(&b, []rebalancer.InstanceView{
		i("runner-1", "a", time.Second, schema.StatusOnline, &schema.InstanceMetrics{InFlight: 3, RatePerSec: 41.5, LatencyMS: 12.25, CPU: 37, Tenants: 12, ErrorRate: 0.004, MemBytes: 96 << 20, MemPercent: 1.2, DiskPercent: 63.4}),
		i("runner-1", "b", 9*time.Second, schema.StatusDegraded, nil),
		i("runner-2", "a", 3*time.Minute+4*time.Second, schema.StatusOffline, nil),
	})
	b.WriteString("----------\n")
	_ = renderAudit(&b, []schema.AuditEvent{
		{Time: created, Actor: "rebalancer/r1", Action: "move.commit", Kind: "aggregate", Tenant: "acme", Plan: rec.ID, Move: "m00001", Revision: 17},
		{Time: created.Add(time.Minute), Actor: "rebalancer/sweeper", Action: "instance.offline", Kind: "runner", Detail: "runner.runner-2.a: no heartbeat for 2m0s"},
	})
	b.WriteString("----------\n")
	_ = renderKinds(&b, []schema.KindConfig{schema.DefaultKindConfig("aggregate"), schema.KindConfig{Kind: "render", Policy: schema.PolicyAffinity,
		RateLimit: &schema.RateLimit{PerSecond: 5, Burst: 10}}.WithDefaults()})
	golden(t, "render", b.String())
}

// TestApplyOnTerminal answers the confirmation on a terminal: "n" applies nothing, "y"
// applies with the in-place progress line.
func TestApplyOnTerminal(t *testing.T) {
	e := newEnv(t)
	e.startShard(t, "s-1")
	e.startShard(t, "s-2")
	e.place(t, "acme", "s-1")
	e.place(t, "globex", "s-1")
	po := decode[PlanOutput](t, e.run(t, "", "plan", "balance", "--kind", "aggregate", "--collect", "0", "--output", "json").stdout)
	tty := func(stdin string, args ...string) result {
		var out, errb bytes.Buffer
		m := &Main{Stdin: strings.NewReader(stdin), Stdout: &out, Stderr: &errb, Terminal: func(any) bool { return true }}
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		code := m.Exit(ctx, append(args, "--nats-url", e.url, "--nats-creds", e.creds))
		return result{out.String(), errb.String(), code}
	}
	r := tty("n\n", "apply", po.ID)
	if r.code != 1 || !strings.Contains(r.stderr, "[y/N]") || !strings.Contains(r.stderr, "not applied") {
		t.Fatalf("answer n: %d %q", r.code, r.stderr)
	}
	if p, _ := e.st.Placements("aggregate").Get(context.Background(), po.Plan.Moves[0].Tenant); p.Shard != "s-1" {
		t.Fatalf("moved without confirmation: %+v", p)
	}
	r = tty("y\n", "apply", po.ID)
	if r.code != 0 || !strings.Contains(r.stdout, "\r\033[K[1/1]") || !strings.Contains(r.stdout, "ETA") {
		t.Fatalf("answer y: %d %q %q", r.code, r.stdout, r.stderr)
	}
}

// TestServeCommand runs `rebalance serve` in-process: it listens, leads, answers the API and
// stops cleanly when its context ends.
func TestServeCommand(t *testing.T) {
	t.Setenv("TM_ADMIN_TOKEN", "")
	const token = "serve-test-token"
	e := newEnv(t)
	var errb bytes.Buffer
	sc := &ServeCommand{m: &Main{Stdout: io.Discard, Stderr: &syncWriter{w: &errb}}}
	if err := sc.ParseFlags([]string{"--addr", "127.0.0.1:0", "--nats-url", e.url, "--nats-creds", e.creds, "--holder", "serve-test", "--log-format", "json", "--no-compact",
		"--admin-token", token}); err != nil {
		t.Fatal(err)
	}
	addr := sc.Listening()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { defer sc.Close(); done <- sc.Serve(ctx) }()
	var base string
	select {
	case a := <-addr:
		base = "http://" + a
	case err := <-done:
		t.Fatalf("serve stopped: %v", err)
	case <-time.After(20 * time.Second):
		t.Fatal("serve did not listen")
	}
	for _, path := range []string{"/healthz", "/readyz", "/api/plans", "/api/instances", "/api/kinds", "/api/leader"} {
		resp, err := tmtest.HTTP.Get(base + path)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Errorf("GET %s: %d", path, resp.StatusCode)
		}
	}
	// While the service leads, `rebalance apply --server` with its admin token applies through
	// it and follows the moves to the end; without the token, or with a wrong one, it fails
	// saying what to set.
	e.startShard(t, "s-1")
	e.startShard(t, "s-2")
	e.place(t, "acme", "s-1")
	waitLeader(t, base)
	po := decode[PlanOutput](t, e.run(t, "", "plan", "manual", "acme=s-2", "--kind", "aggregate", "--collect", "0", "--output", "json").stdout)
	r := e.run(t, "", "apply", po.ID, "--yes", "--server", base)
	if r.code != 1 || !strings.Contains(r.stderr, "needs the rebalancer's admin token: set --admin-token or TM_ADMIN_TOKEN") {
		t.Fatalf("apply through the service without the token: %d %q", r.code, r.stderr)
	}
	r = e.run(t, "", "apply", po.ID, "--yes", "--server", base, "--admin-token", "wrong")
	if r.code != 1 || !strings.Contains(r.stderr, "refused the admin token: set --admin-token or TM_ADMIN_TOKEN") {
		t.Fatalf("apply through the service with a wrong token: %d %q", r.code, r.stderr)
	}
	t.Setenv("TM_ADMIN_TOKEN", token)
	r = e.run(t, "", "apply", po.ID, "--yes", "--server", base)
	if r.code != 0 || !strings.Contains(r.stdout, "1 done") {
		t.Fatalf("apply through the service: %d\n%s\n%s", r.code, r.stdout, r.stderr)
	}
	if p, _ := e.st.Placements("aggregate").Get(context.Background(), "acme"); p.Shard != "s-2" {
		t.Fatalf("acme on %s after the apply", p.Shard)
	}
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("serve: %v", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("serve did not stop")
	}
}

// TestApplyThroughServiceWithoutToken: apply --server to a service started without an admin
// token fails saying how to start it.
func TestApplyThroughServiceWithoutToken(t *testing.T) {
	e := newEnv(t)
	e.place(t, "acme", "s-1")
	if _, err := e.st.Directory().Register(context.Background(), schema.Instance{InstanceID: schema.InstanceID{Kind: "aggregate", Shard: "s-2", Instance: "i1"}, URL: "http://127.0.0.1:9", Capacity: 10}); err != nil {
		t.Fatal(err)
	}
	srv, err := server.New(server.Config{Store: e.st})
	if err != nil {
		t.Fatal(err)
	}
	ts := httptest.NewServer(srv.Handler())
	defer ts.Close()
	po := decode[PlanOutput](t, e.run(t, "", "plan", "manual", "acme=s-2", "--kind", "aggregate", "--collect", "0", "--output", "json").stdout)
	r := e.run(t, "", "apply", po.ID, "--yes", "--server", ts.URL, "--admin-token", "some-token")
	if r.code != 1 || !strings.Contains(r.stderr, "the rebalancer has no admin token; start it with --admin-token or TM_ADMIN_TOKEN") {
		t.Fatalf("apply through a service without a token: %d %q", r.code, r.stderr)
	}
}

type syncWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (s *syncWriter) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.w.Write(p)
}

// TestApplyRefusedWhileServiceLeads: a CLI apply while a rebalancer service holds the lease
// fails with one line naming the holder and how to apply through the service instead.
func TestApplyRefusedWhileServiceLeads(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	e.place(t, "acme", "s-1")
	if _, err := e.st.Directory().Register(ctx, schema.Instance{InstanceID: schema.InstanceID{Kind: "aggregate", Shard: "s-2", Instance: "i1"}, URL: "http://127.0.0.1:9", Capacity: 10}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.st.Rebalance().AcquireLease(ctx, schema.LeaderLease, "rebalancer-a", time.Minute); err != nil {
		t.Fatal(err)
	}
	po := decode[PlanOutput](t, e.run(t, "", "plan", "manual", "acme=s-2", "--kind", "aggregate", "--collect", "0", "--output", "json").stdout)
	r := e.run(t, "", "apply", po.ID, "--yes")
	if r.code != 1 || !strings.Contains(r.stderr, "held by rebalancer-a") || !strings.Contains(r.stderr, "rebalance apply "+po.ID+" --server") {
		t.Fatalf("apply under another leader: %d %q", r.code, r.stderr)
	}
}

// waitLeader waits until the service at base reports that it leads.
func waitLeader(t *testing.T, base string) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		resp, err := tmtest.HTTP.Get(base + "/api/leader")
		if err == nil {
			var v struct {
				Leading bool `json:"leading"`
			}
			_ = json.NewDecoder(resp.Body).Decode(&v)
			resp.Body.Close()
			if v.Leading {
				return
			}
		}
		if time.Now().After(deadline) {
			t.Fatal("the service did not become the leader")
		}
		time.Sleep(50 * time.Millisecond) // polling another component's state
	}
}

// auth init writes a chain, a server config that nats-server accepts, and credentials a server
// trusting that config lets in, each as its role.
func TestAuthInit(t *testing.T) {
	dir := t.TempDir()
	var out, errb bytes.Buffer
	m := &Main{Stdout: &out, Stderr: &errb, Terminal: func(any) bool { return false }}
	if code := m.Exit(context.Background(), []string{"auth", "init", "--dir", dir, "--shards", "runner:runner-1", "--output", "json"}); code != 0 {
		t.Fatalf("auth init: %d %s", code, errb.String())
	}
	var wrote []struct{ What, Path string }
	if err := json.Unmarshal(out.Bytes(), &wrote); err != nil || len(wrote) != 11 { // chain, auth.conf, 4 credentials, the gateways' key and 4 kinds' keys
		t.Fatalf("auth init printed %s (%v)", out.String(), err)
	}
	opts, err := natsserver.ProcessConfigFile(filepath.Join(dir, "auth.conf"))
	if err != nil {
		t.Fatalf("nats-server rejects auth.conf: %v", err)
	}
	if len(opts.TrustedOperators) != 1 || opts.SystemAccount == "" {
		t.Fatalf("auth.conf trusts %d operators, system account %q", len(opts.TrustedOperators), opts.SystemAccount)
	}
	chain, err := natsauth.LoadOrCreate(dir)
	if err != nil {
		t.Fatal(err)
	}
	srv := natstest.Restart(t, embednats.Config{StoreDir: t.TempDir(), Auth: chain})
	for _, role := range []string{"rebalancer", "gateway", "shard-runner-runner-1"} {
		nc, err := natsconn.Connect(natsconn.Options{URL: srv.URL(), Creds: filepath.Join(dir, "creds", role+".creds")}, "test", nil)
		if err != nil {
			t.Fatalf("%s: %v", role, err)
		}
		if _, err := nc.Request("$JS.API.INFO", nil, 2*time.Second); err != nil {
			t.Errorf("%s: JetStream account info: %v", role, err)
		}
		nc.Close()
	}
	// Again: the chain is kept, so credentials made before still work.
	out.Reset()
	if code := m.Exit(context.Background(), []string{"auth", "init", "--dir", dir}); code != 0 {
		t.Fatalf("auth init again: %d %s", code, errb.String())
	}
	again, _ := natsauth.LoadOrCreate(dir)
	if again.AccountJWT != chain.AccountJWT {
		t.Error("auth init made a new chain over the kept one")
	}
}

// A kind beyond the built-in ones owns the KV buckets --kv names: its shards may create and
// write tm_<kind>_<name>, and a name that is not a token is a usage error.
func TestAuthPermissionsKV(t *testing.T) {
	var out, errb bytes.Buffer
	m := &Main{Stdout: &out, Stderr: &errb, Terminal: func(any) bool { return false }}
	if code := m.Exit(context.Background(), []string{"auth", "permissions", "--kind", "notes", "--shard", "notes-1", "--kv", "notes", "--output", "json"}); code != 0 {
		t.Fatalf("auth permissions: %d %s", code, errb.String())
	}
	for _, want := range []string{`"$KV.tm_notes_notes.\u003e"`, "$JS.API.STREAM.CREATE.KV_tm_notes_notes"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("the notes shard may not %s:\n%s", want, out.String())
		}
	}
	out.Reset()
	if code := m.Exit(context.Background(), []string{"auth", "permissions", "--kind", "notes", "--shard", "notes-1"}); code != 0 || strings.Contains(out.String(), "tm_notes_notes") {
		t.Errorf("without --kv: %d, buckets %s", code, out.String())
	}
	if code := m.Exit(context.Background(), []string{"auth", "permissions", "--kind", "notes", "--kv", "a.b"}); code != 2 {
		t.Errorf("--kv a.b: exit %d, want 2 (%s)", code, errb.String())
	}
}

// `rebalance instances <key>` shows one instance's page; --degrade and --undegrade set and clear
// the operator's flag, which the derived status follows and the status history records.
func TestInstancePageAndFlag(t *testing.T) {
	e := newEnv(t)
	e.startShard(t, "s-1")
	key := "aggregate.s-1.i1"
	if _, err := e.st.Placements("aggregate").Create(t.Context(), schema.Placement{Tenant: "acme", Shard: "s-1"}); err != nil {
		t.Fatal(err)
	}
	d := decode[rebalancer.InstanceDetail](t, e.run(t, "", "instances", key, "--listen", "0", "--output", "json").stdout)
	if d.Key != key || d.Status != schema.StatusOnline || d.TenantsTotal != 1 || d.Tenants[0].Tenant != "acme" || d.Flag != nil {
		t.Fatalf("page: %+v", d)
	}
	r := e.run(t, "", "instances", key, "--degrade", "disk replacement")
	if r.code != 0 || !strings.Contains(r.stdout, "degraded") {
		t.Fatalf("--degrade: %d %s %s", r.code, r.stdout, r.stderr)
	}
	r = e.run(t, "", "instances", key, "--listen", "0")
	if r.code != 0 || !strings.Contains(r.stdout, "flagged degraded by cli/") || !strings.Contains(r.stdout, "disk replacement") ||
		!strings.Contains(r.stdout, "TENANTS (1)") || !strings.Contains(r.stdout, "acme") {
		t.Fatalf("page table:\n%s%s", r.stdout, r.stderr)
	}
	if r := e.run(t, "", "instances", key, "--undegrade"); r.code != 0 {
		t.Fatalf("--undegrade: %d %s", r.code, r.stderr)
	}
	d = decode[rebalancer.InstanceDetail](t, e.run(t, "", "instances", key, "--listen", "0", "--output", "json").stdout)
	if d.Flag != nil || d.Status != schema.StatusOnline {
		t.Fatalf("after --undegrade: %+v", d)
	}
	for _, args := range [][]string{{"instances", "--degrade", "x"}, {"instances", key, "--degrade", "x", "--undegrade"}, {"instances", "a", "b"}} {
		if r := e.run(t, "", args...); r.code != 2 {
			t.Errorf("%v: exit %d, want 2", args, r.code)
		}
	}
	if r := e.run(t, "", "instances", "aggregate.s-9.none", "--listen", "0"); r.code != 1 || !strings.Contains(r.stderr, "not found") {
		t.Errorf("unknown instance: %d %s", r.code, r.stderr)
	}
}
