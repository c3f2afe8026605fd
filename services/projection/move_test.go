package projection

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	dto "github.com/prometheus/client_model/go"

	"github.com/tenantmesh/tenantmesh/internal/tmtest"
	"github.com/tenantmesh/tenantmesh/services/aggregate"
	"github.com/tenantmesh/tenantmesh/services/aggregate/ledgertest"
	"github.com/tenantmesh/tenantmesh/shardkit/events"
	"github.com/tenantmesh/tenantmesh/shardkit/jsx"
	"github.com/tenantmesh/tenantmesh/shardkit/kittest"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// snapshotOf reads a tenant's whole views through the query API, as JSON for comparison.
func snapshotOf(t *testing.T, s *Service, tenant string) string {
	t.Helper()
	accs := all[AccountRow](t, s, tenant, "accounts", Query{Limit: MaxLimit})
	txs := all[TxRow](t, s, tenant, "transactions", Query{Limit: MaxLimit})
	b, _ := json.Marshal(struct {
		A []AccountRow
		T []TxRow
	}{accs, txs})
	return string(b)
}

// TestMoveMidStream moves a tenant between two instances the way shardkit drives the hooks,
// while commands keep arriving: the target warms (fence 0) during the writes; at handoff the
// source's applied sequence is the fence and the target warms to it; at cutover the target's
// views are exactly the source's. The source then releases the tenant (storing its views and
// checkpoint) and drops its copy, and the target keeps applying new events.
func TestMoveMidStream(t *testing.T) {
	st := openStore(t)
	a := newAggregate(t, st)
	src, _ := newService(t, st, Config{CheckpointEvery: 50})
	// The target stores no views of its own during the test: its periodic store, landing after
	// the source's release, would put an older checkpoint over the release's (the record is a
	// report, last writer wins; a load reads the views' head).
	tgt, _ := newService(t, st, Config{CheckpointEvery: 1 << 30, CheckpointInterval: time.Hour})
	warm(t, src, "acme", 0)

	stop, progress := make(chan struct{}), make(chan int)
	done := ledgertest.Writer(t, a, "acme", stop, progress)
	ledgertest.WaitProgress(t, progress, 150)
	warm(t, tgt, "acme", 0) // warming: the source still serves; both consume
	ledgertest.WaitProgress(t, progress, 300)
	// Handoff. Reads may overlap during a projection move, so nothing is held; the test stops
	// the writes here only so that "the same view" is well defined at cutover.
	close(stop)
	<-done
	if t.Failed() {
		return
	}
	warm(t, src, "acme", 0) // the source has the stream's tail...
	fence := src.Applied("acme")
	warm(t, tgt, "acme", fence) // ...and the target reaches the source's fence
	if got := tgt.Applied("acme"); got != fence {
		t.Fatalf("target applied %d, source's fence %d", got, fence)
	}
	want, got := snapshotOf(t, src, "acme"), snapshotOf(t, tgt, "acme")
	if got != want {
		t.Fatalf("target view at cutover differs from the source's:\nsource %.300s\ntarget %.300s", want, got)
	}

	// Commit: the old owner drops its copy after flushing it.
	ctx := context.Background()
	if err := src.Release(ctx, "acme"); err != nil {
		t.Fatal(err)
	}
	if src.Applied("acme") != 0 || len(src.Tenants()) != 0 {
		t.Fatalf("source still holds acme: applied %d, tenants %v", src.Applied("acme"), src.Tenants())
	}
	cp, err := src.Checkpoint(ctx, "acme")
	if err != nil || cp.Applied != fence {
		t.Fatalf("checkpoint after release = %+v, %v; want applied %d", cp, err, fence)
	}
	r := do(t, a, "acme", command("acc1", aggregate.CmdDeposit, 5))
	warm(t, tgt, "acme", r.Seq)
	if tgt.Lag("acme") != 0 {
		t.Fatalf("target lag %d after catching up", tgt.Lag("acme"))
	}
}

// TestLagIsExact: lag is 0 when caught up, and the stream sequence of the tenant's last event
// minus the applied sequence otherwise, whatever other tenants write; Pending counts the
// unapplied events exactly. A new instance resumes from the stored checkpoint.
func TestLagIsExact(t *testing.T) {
	st := openStore(t)
	a := newAggregate(t, st)
	ctx := context.Background()
	s, stop := newService(t, st, Config{})
	warm(t, s, "acme", 0)
	var last uint64
	for i := range 10 {
		name := aggregate.CmdDeposit
		if i == 0 {
			name = aggregate.CmdOpen
		}
		last = do(t, a, "acme", command("acc1", name, int64(i*10))).Seq
	}
	warm(t, s, "acme", last)
	if lag := s.Lag("acme"); lag != 0 {
		t.Fatalf("caught up: lag %d, want 0", lag)
	}
	info, err := s.TenantInfo(ctx, "acme")
	if err != nil || info.Lag != 0 || info.Pending != 0 || info.Applied != last {
		t.Fatalf("caught up: %+v, %v", info, err)
	}

	stop() // nothing applies acme's events from here on; its views are stored
	applied := s.Applied("acme")
	for range 3 {
		last = do(t, a, "acme", command("acc1", aggregate.CmdDeposit, 1)).Seq
	}
	if lag := s.Lag("acme"); lag != 3 || last-applied != 3 {
		t.Fatalf("3 events unapplied (only acme writes): lag %d, want 3", lag)
	}
	do(t, a, "other", command("x", aggregate.CmdOpen, 0))
	for range 4 {
		do(t, a, "other", command("x", aggregate.CmdDeposit, 1))
		last = do(t, a, "acme", command("acc1", aggregate.CmdDeposit, 1)).Seq
	}
	info, err = s.TenantInfo(ctx, "acme")
	if err != nil {
		t.Fatal(err)
	}
	if info.Lag != last-applied || info.Pending != 7 || s.Lag("acme") != last-applied {
		t.Fatalf("7 acme events unapplied among other tenants' events: %+v; want lag %d, pending 7", info, last-applied)
	}
	if info.Checkpoint.Applied != applied {
		t.Fatalf("checkpoint %+v, want applied %d", info.Checkpoint, applied)
	}

	s2, _ := newService(t, st, Config{})
	warm(t, s2, "acme", 0)
	if s2.Applied("acme") != last || s2.Lag("acme") != 0 {
		t.Fatalf("new instance: applied %d lag %d, want %d and 0", s2.Applied("acme"), s2.Lag("acme"), last)
	}
	res := query(t, s2, "acme", "accounts", Query{})
	if len(res.Items) != 1 || res.Items[0].(AccountRow).Balance != 450+7 || res.Lag != 0 || res.Applied != last {
		t.Fatalf("resumed views: %+v", res)
	}
}

// TestFollowsPlacement: with a shard name, the service consumes the tenants placed on its shard
// or moving to it, drops a tenant once its move away completed, and on reload drops tenants
// not placed here.
func TestFollowsPlacement(t *testing.T) {
	st := openStore(t)
	a := newAggregate(t, st)
	ctx := context.Background()
	for _, tenant := range []string{"acme", "globex"} {
		do(t, a, tenant, command("acc1", aggregate.CmdOpen, 0))
	}
	place := func(tenant, shard string) schema.Placement {
		p, err := st.Placements(Kind).Create(ctx, schema.Placement{Tenant: tenant, Shard: shard, Epoch: 1})
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	step := func(prev schema.Placement, edit func(*schema.Placement)) schema.Placement {
		next := prev
		edit(&next)
		p, err := st.Placements(next.Kind).Update(ctx, prev, next)
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	s, _ := newService(t, st, Config{Shard: "projection-1"})
	acme := place("acme", "projection-1")
	globex := place("globex", "projection-2")
	waitTenants(t, s, "acme")
	warm(t, s, "acme", 0)

	// globex moves here: hosted from warming on.
	globex = step(globex, func(p *schema.Placement) { p.Phase, p.Target = schema.PhaseWarming, "projection-1" })
	waitTenants(t, s, "acme", "globex")
	_ = globex

	// acme moves away: kept while the move is in flight, dropped once it completed.
	acme = step(acme, func(p *schema.Placement) { p.Phase, p.Target = schema.PhaseWarming, "projection-2" })
	acme = step(acme, func(p *schema.Placement) { p.Phase = schema.PhaseHandoff })
	acme = kittest.Commit(t, st, acme, "projection-2")
	if !slices.Contains(s.Tenants(), "acme") {
		t.Fatal("acme dropped before its move completed")
	}
	step(acme, func(p *schema.Placement) { p.Phase, p.Source = schema.PhaseActive, "" })
	waitTenants(t, s, "globex")
	// A tenant hosted here by a query, though not placed here, goes on reload.
	warm(t, s, "stray", 0)
	waitTenants(t, s, "globex", "stray")
	if err := s.Reload(ctx); err != nil {
		t.Fatal(err)
	}
	waitTenants(t, s, "globex")
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		cp, err := s.Checkpoint(ctx, "acme") // stored by the release, just after the drop
		if err == nil && cp.Applied == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("acme's checkpoint after the move: %+v, %v", cp, err)
		}
	}
}

// waitTenants polls (placement is external state) until s hosts exactly want.
func waitTenants(t *testing.T, s *Service, want ...string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !slices.Equal(s.Tenants(), want) {
		if time.Now().After(deadline) {
			t.Fatalf("hosted %v, want %v", s.Tenants(), want)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestCorruptEventSkipped: an event that does not decode is counted and skipped, never a
// crash, and the applied sequence moves past it (lag 0); a first query hosts the tenant.
func TestCorruptEventSkipped(t *testing.T) {
	st := openStore(t)
	a := newAggregate(t, st)
	ctx := context.Background()
	s, _ := newService(t, st, Config{})
	do(t, a, "acme", command("acc1", aggregate.CmdOpen, 0))
	ack, err := st.JS().JetStream().Publish(ctx, schema.EventSubject("acme", aggregate.AccountType, "acc1"), []byte("{not json"))
	if err != nil {
		t.Fatal(err)
	}
	res := query(t, s, "acme", "accounts", Query{}) // hosts acme: catch-up over the corrupt event
	if len(res.Items) != 1 || res.Applied != ack.Sequence || res.Lag != 0 {
		t.Fatalf("after catch-up: %+v (corrupt event at %d)", res, ack.Sequence)
	}
	warm(t, s, "acme", 0)
	if ack, err = st.JS().JetStream().Publish(ctx, schema.EventSubject("acme", aggregate.AccountType, "acc1"), []byte("[]")); err != nil {
		t.Fatal(err)
	}
	// (The aggregate refuses to load a tenant with a corrupt event, so the next event is
	// appended directly.)
	ev, _ := json.Marshal(aggregate.Event{Tenant: "acme", AggregateType: aggregate.AccountType, AggregateID: "acc1",
		Version: 2, Event: aggregate.EvDeposited, Data: json.RawMessage(`{"amount":9}`), At: time.Now().UTC()})
	ack2, err := st.JS().JetStream().Publish(ctx, schema.EventSubject("acme", aggregate.AccountType, "acc1"), ev)
	if err != nil {
		t.Fatal(err)
	}
	last := ack2.Sequence
	warm(t, s, "acme", last) // the tail skips the corrupt event too
	res = query(t, s, "acme", "accounts", Query{})
	if res.Items[0].(AccountRow).Balance != 9 || res.Lag != 0 || last <= ack.Sequence {
		t.Fatalf("after the tail: %+v", res)
	}
}

// received sums the messages the tails received.
func received(s *Service) uint64 {
	var n uint64
	for _, t := range s.tails {
		n += t.received.Load()
	}
	return n
}

// TestConsumesOnlyHostedTenants: the tail consumer receives the hosted tenants' events only,
// not those of tenants hosted elsewhere.
func TestConsumesOnlyHostedTenants(t *testing.T) {
	st := openStore(t)
	a := newAggregate(t, st)
	s, _ := newService(t, st, Config{})
	do(t, a, "acme", command("acc1", aggregate.CmdOpen, 0))
	do(t, a, "other", command("acc1", aggregate.CmdOpen, 0))
	warm(t, s, "acme", 0)
	before := received(s)
	var last uint64
	for range 10 {
		last = do(t, a, "acme", command("acc1", aggregate.CmdDeposit, 1)).Seq
		do(t, a, "other", command("acc1", aggregate.CmdDeposit, 1))
		do(t, a, "other", command("acc1", aggregate.CmdDeposit, 1))
	}
	warm(t, s, "acme", last)
	if got := received(s) - before; got != 10 {
		t.Fatalf("the tail received %d messages for 10 events of its tenant among 20 of another", got)
	}
}

// TestNewerFormatEventRefused: an event stored in a newer format than this binary reads (a
// newer release wrote it, during a rolling upgrade) stops the tenant's views where they are,
// in the catch-up and in the tail alike: nothing after it is applied, and queries are
// answered 503 newer-format, never from views that skipped an event.
func TestNewerFormatEventRefused(t *testing.T) {
	st := openStore(t)
	a := newAggregate(t, st)
	ctx := context.Background()
	s, _ := newService(t, st, Config{})
	newer := func(tenant string) uint64 {
		t.Helper()
		m := nats.NewMsg(schema.EventSubject(tenant, aggregate.AccountType, "acc1"))
		m.Header.Set(events.HeaderFormat, strconv.Itoa(jsx.Format+1))
		m.Data = []byte(`{"format":2}`)
		ack, err := st.JS().JetStream().PublishMsg(ctx, m)
		if err != nil {
			t.Fatal(err)
		}
		return ack.Sequence
	}
	// The aggregate refuses to load a tenant past a newer event, so the next is appended directly.
	deposit := func(tenant string) {
		t.Helper()
		ev, _ := json.Marshal(aggregate.Event{Tenant: tenant, AggregateType: aggregate.AccountType, AggregateID: "acc1",
			Version: 3, Event: aggregate.EvDeposited, Data: json.RawMessage(`{"amount":5}`), At: time.Now().UTC()})
		if _, err := st.JS().JetStream().Publish(ctx, schema.EventSubject(tenant, aggregate.AccountType, "acc1"), ev); err != nil {
			t.Fatal(err)
		}
	}
	refused := func(tenant string) bool {
		_, err := s.Query(ctx, tenant, "accounts", Query{})
		return errors.Is(err, ErrRefused)
	}

	// The catch-up meets it.
	do(t, a, "acme", command("acc1", aggregate.CmdOpen, 0))
	at := newer("acme")
	deposit("acme")
	_, err := s.Query(ctx, "acme", "accounts", Query{})
	if !errors.Is(err, ErrRefused) {
		t.Fatalf("a query over a newer event: %v", err)
	}
	if p, ok := problemOf(err).(*tmhttp.Error); !ok || p.Status != http.StatusServiceUnavailable || p.Type != "newer-format" {
		t.Fatalf("answered as %#v", problemOf(err))
	}
	if got := s.host("acme").appliedSeq(); got >= at {
		t.Fatalf("applied up to %d, past the newer event at %d", got, at)
	}

	// The tail meets it.
	do(t, a, "globex", command("acc1", aggregate.CmdOpen, 0))
	query(t, s, "globex", "accounts", Query{})
	at = newer("globex")
	deposit("globex")
	for deadline := time.Now().Add(10 * time.Second); !refused("globex"); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the tail applied past a newer event")
		}
	}
	if got := s.host("globex").appliedSeq(); got >= at {
		t.Fatalf("applied up to %d, past the newer event at %d", got, at)
	}
}

// TestLeaveKeepsTheConsumer: a tenant leaving (a move's source, at its end) makes no new tail
// consumer, which would hold up the instance's other tenants (a move's target among them)
// while it is made: their events go on arriving through the one they have, the departed
// tenant's are skipped. Once the filters of tenants gone outnumber the live ones, the consumer
// is made again without them.
func TestLeaveKeepsTheConsumer(t *testing.T) {
	st := openStore(t)
	a := newAggregate(t, st)
	s, _ := newService(t, st, Config{TailPartitions: 1})
	ctx := context.Background()
	tenants := []string{"acme", "globex", "initech"}
	deposit := func(tenant string) uint64 {
		return do(t, a, tenant, command("acc1", aggregate.CmdDeposit, 1)).Seq
	}
	for _, tenant := range tenants {
		do(t, a, tenant, command("acc1", aggregate.CmdOpen, 0))
		warm(t, s, tenant, 0)
	}
	waitTailLive(t, s, 3)
	for _, tenant := range tenants { // through the tail: every tenant is in its consumer
		warm(t, s, tenant, deposit(tenant))
	}
	made := tailRebuilds(t, s)

	if err := s.Release(ctx, "acme"); err != nil {
		t.Fatal(err)
	}
	waitTailLive(t, s, 2)
	deposit("acme")
	warm(t, s, "globex", deposit("globex"))
	warm(t, s, "initech", deposit("initech"))
	if got := tailRebuilds(t, s); got != made {
		t.Fatalf("acme's leave made %d new tail consumers, want none", got-made)
	}
	if slices.Contains(s.Tenants(), "acme") {
		t.Fatal("acme still hosted after its release")
	}

	if err := s.Release(ctx, "globex"); err != nil { // 2 gone, 1 live: made again
		t.Fatal(err)
	}
	waitTailLive(t, s, 1)
	warm(t, s, "initech", deposit("initech"))
	if got := tailRebuilds(t, s); got != made+1 {
		t.Fatalf("with 2 tenants gone and 1 live, %d new tail consumers, want 1", got-made)
	}
}

// tailRebuilds is how many tail consumers s has made.
func tailRebuilds(t testing.TB, s *Service) uint64 {
	t.Helper()
	var m dto.Metric
	if err := s.m.rebuilds.Write(&m); err != nil {
		t.Fatal(err)
	}
	return m.GetHistogram().GetSampleCount()
}

// waitTailLive waits (the tails take joins and leaves on their own goroutines) until s's tails
// count n live tenants.
func waitTailLive(t testing.TB, s *Service, n int) {
	t.Helper()
	tmtest.WaitFor(t, 10*time.Second, func() error {
		var m dto.Metric
		if err := s.m.liveTenants.Write(&m); err != nil {
			return err
		}
		if got := int(m.GetGauge().GetValue()); got != n {
			return fmt.Errorf("%d live tenants, want %d", got, n)
		}
		return nil
	})
}
