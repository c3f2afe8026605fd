package projection

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	dto "github.com/prometheus/client_model/go"

	"github.com/tenantmesh/tenantmesh/services/aggregate"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// publisher appends ledger events straight to the stream (as a busy aggregate shard would),
// asynchronously, and remembers each tenant's last sequence.
type publisher struct {
	b       testing.TB
	js      jetstream.JetStream
	n       int
	version map[string]uint64
	futs    []pubFut
	last    map[string]uint64
}

type pubFut struct {
	tenant string
	f      jetstream.PubAckFuture
}

func newPublisher(b testing.TB, st *schema.Store) *publisher {
	if err := st.EnsureEventsStream(context.Background()); err != nil {
		b.Fatal(err)
	}
	return &publisher{b: b, js: st.JS().JetStream(), version: map[string]uint64{}, last: map[string]uint64{}}
}

// add publishes one event for tenant on one of 10 accounts: an open first, then deposits.
func (p *publisher) add(tenant string) {
	acc := fmt.Sprintf("acc%d", p.n%10)
	key := tenant + "." + acc
	p.version[key]++
	ev := aggregate.Event{Tenant: tenant, AggregateType: aggregate.AccountType, AggregateID: acc, Version: p.version[key],
		CommandKey: fmt.Sprintf("seed-%d", p.n), At: time.Now().UTC()}
	if ev.Version == 1 {
		ev.Event = aggregate.EvOpened
	} else {
		ev.Event, ev.Data = aggregate.EvDeposited, json.RawMessage(`{"amount":1}`)
	}
	data, _ := json.Marshal(ev)
	f, err := p.js.PublishMsgAsync(&nats.Msg{Subject: schema.EventSubject(tenant, aggregate.AccountType, acc), Data: data})
	if err != nil {
		p.b.Fatal(err)
	}
	p.futs = append(p.futs, pubFut{tenant, f})
	p.n++
	if p.n%2000 == 0 {
		p.wait()
	}
}

// addN publishes n events for tenant and waits for them.
func (p *publisher) addN(tenant string, n int) {
	for range n {
		p.add(tenant)
	}
	p.wait()
}

// wait waits for every publish so far and records the tenants' last sequences.
func (p *publisher) wait() {
	select {
	case <-p.js.PublishAsyncComplete():
	case <-time.After(30 * time.Second):
		p.b.Fatal("publishes not acknowledged in 30s")
	}
	for _, f := range p.futs {
		select {
		case ack := <-f.f.Ok():
			p.last[f.tenant] = max(p.last[f.tenant], ack.Sequence)
		case err := <-f.f.Err():
			p.b.Fatal(err)
		}
	}
	p.futs = p.futs[:0]
}

// BenchmarkWarm measures a move target's warm-up for a tenant with 100k events: cold (replay of
// the whole history) and from the views the source stored (replay of the last 1%).
func BenchmarkWarm(b *testing.B) {
	const n = 100_000
	st := openStore(b)
	ctx := context.Background()
	p := newPublisher(b, st)
	for range n - n/100 {
		p.add("big")
	}
	p.wait()
	src, _ := newService(b, st, Config{})
	warm(b, src, "big", p.last["big"])
	if err := src.Release(ctx, "big"); err != nil { // stores the views
		b.Fatal(err)
	}
	for range n / 100 {
		p.add("big")
	}
	p.wait()
	fence := p.last["big"]
	for _, stored := range []bool{false, true} {
		name := "cold"
		if stored {
			name = "stored-views"
		}
		b.Run(fmt.Sprintf("events=%d/%s", n, name), func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if !stored {
					if err := src.st.views.Delete(ctx, "big"); err != nil {
						b.Fatal(err)
					}
				}
				tgt, stop := newService(b, st, Config{CheckpointInterval: time.Hour})
				start := time.Now()
				warm(b, tgt, "big", fence)
				took := time.Since(start)
				b.ReportMetric(took.Seconds()*1000, "warm-ms")
				if !stored {
					b.ReportMetric(float64(n)/took.Seconds(), "events/s")
				}
				if tgt.Applied("big") != fence || tgt.Lag("big") != 0 {
					b.Fatalf("warmed to %d of %d", tgt.Applied("big"), fence)
				}
				ts := tgt.lookup("big")
				ts.mu.RLock()
				rows := len(ts.txs)
				ts.mu.RUnlock()
				if rows != n-10 {
					b.Fatalf("%d transactions, want %d", rows, n-10)
				}
				stop()
				if stored {
					if err := tgt.Release(ctx, "big"); err != nil {
						b.Fatal(err)
					}
				}
			}
		})
		if !stored {
			// Restore the stored views for the next sub-benchmark.
			warm(b, src, "big", fence)
			if err := src.Release(ctx, "big"); err != nil {
				b.Fatal(err)
			}
		}
	}
}

// BenchmarkTenants10k hosts 10,000 tenants on one instance and measures the time to host them
// all (batched catch-ups, then the tail consumer) and the rate at which the tail applies a
// backlog of 100k events for the hosted tenants (with noise=1x, as many events for tenants
// hosted elsewhere are interleaved). 10,000 tenants exceed MaxFilters (1000), so the tail
// reads events.> and filters here.
func BenchmarkTenants10k(b *testing.B) {
	const tenants, events = 10_000, 100_000
	for _, mode := range []struct {
		name       string
		partitions int
		noise      bool
	}{
		{"partitions=1/noise=0", 1, false},
		{"partitions=1/noise=1x", 1, true},
	} {
		b.Run(mode.name, func(b *testing.B) {
			for b.Loop() {
				benchTenants(b, tenants, events, mode.partitions, mode.noise, true)
			}
		})
	}
}

// BenchmarkTenants1kLive hosts 1,000 tenants (within MaxFilters, so the tail lists them as
// filter subjects) and publishes 20k events for them interleaved with 20k for tenants hosted
// elsewhere, at about 20k events/s, while the tail runs: read/applied near 1 shows that the
// other tenants' events are not delivered. (A tail that falls more than FilterBacklog events
// behind reads events.> until it caught up, and then reads about 2 per applied here.)
func BenchmarkTenants1kLive(b *testing.B) {
	for b.Loop() {
		benchTenants(b, 1000, 20_000, 1, true, false)
	}
}

func benchTenants(b *testing.B, tenants, events, partitions int, noise, backlog bool) {
	st := openStore(b)
	p := newPublisher(b, st)
	name := func(i int) string { return fmt.Sprintf("t%05d", i) }
	for i := range tenants { // one event each, so every catch-up replays something
		p.add(name(i))
	}
	p.wait()

	s, _ := newService(b, st, Config{TailPartitions: partitions, CheckpointInterval: time.Hour, CheckpointEvery: 1 << 30})
	start := time.Now()
	for i := range tenants {
		s.host(name(i))
	}
	for i := range tenants {
		warm(b, s, name(i), p.last[name(i)])
	}
	waitLive(b, s, tenants)
	b.ReportMetric(time.Since(start).Seconds()*1000, "host-ms")

	applied0, received0 := appliedTotal(s), received(s)
	hold := make(chan struct{})
	if backlog {
		s.hold.Store(&hold)
	}
	start = time.Now()
	for i := range events {
		p.add(name(i % tenants))
		if noise {
			p.add(fmt.Sprintf("elsewhere%05d", i%tenants))
		}
		if !backlog && i%1000 == 999 { // pace a live run at about 20k events/s
			time.Sleep(time.Until(start.Add(time.Duration(p.n-tenants) * time.Second / 20_000)))
		}
	}
	p.wait()
	if backlog {
		start = time.Now()
		s.hold.Store(nil)
	}
	close(hold)
	for i := range tenants {
		warm(b, s, name(i), p.last[name(i)])
	}
	took := time.Since(start)
	if got := appliedTotal(s) - applied0; got != uint64(events) {
		b.Fatalf("applied %d events, want %d", got, events)
	}
	b.ReportMetric(float64(events)/took.Seconds(), "applied/s")
	b.ReportMetric(float64(received(s)-received0)/float64(events), "read/applied")
}

// BenchmarkFilterConsumer measures JetStream's creation time of one consumer listing n tenant
// filter subjects, on a stream of 10,000 tenants: the cost of a tail rebuild (it grows with the
// square of n).
func BenchmarkFilterConsumer(b *testing.B) {
	st := openStore(b)
	ctx := context.Background()
	p := newPublisher(b, st)
	for i := range 10_000 {
		p.add(fmt.Sprintf("t%05d", i))
	}
	p.wait()
	for _, n := range []int{100, 1000, 2000, 10_000} {
		filters := make([]string, n)
		for i := range filters {
			filters[i] = schema.TenantEvents(fmt.Sprintf("t%05d", i))
		}
		b.Run(fmt.Sprintf("filters=%d", n), func(b *testing.B) {
			for b.Loop() {
				cctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
				start := time.Now()
				cons, err := st.JS().JetStream().OrderedConsumer(cctx, schema.StreamEvents, jetstream.OrderedConsumerConfig{
					FilterSubjects: filters, DeliverPolicy: jetstream.DeliverNewPolicy})
				cancel()
				if err != nil {
					b.Fatal(err)
				}
				b.ReportMetric(time.Since(start).Seconds()*1000, "create-ms")
				_ = st.JS().JetStream().DeleteConsumer(ctx, schema.StreamEvents, cons.CachedInfo().Name)
			}
		})
	}
}

func appliedTotal(s *Service) uint64 {
	var n uint64
	for _, ts := range s.hosted() {
		ts.mu.RLock()
		n += uint64(len(ts.txs) + len(ts.accounts)) // deposits, and one open per account
		ts.mu.RUnlock()
	}
	return n
}

// waitLive polls until the tails apply n tenants (the joins are internal to the tails).
func waitLive(b testing.TB, s *Service, n int) {
	deadline := time.Now().Add(60 * time.Second)
	for {
		live := 0
		for _, ts := range s.hosted() {
			ts.mu.RLock()
			if ts.phase == phaseLive {
				live++
			}
			ts.mu.RUnlock()
		}
		if live == n {
			return
		}
		if time.Now().After(deadline) {
			b.Fatalf("%d of %d tenants live after 60s", live, n)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// BenchmarkApplyDuringFlush measures how long the tail takes to apply a small tenant's event
// while a tenant with 60,000 transactions on the same tail has its views stored again and
// again (as the periodic flush and a move's release do late in a long run): publish ->
// applied, p50 / p99 / max. The big tenant's events keep coming: encoding its views under its
// lock held the tail at the next of them for the rest of the encoding, and the small tenant's
// event behind it.
func BenchmarkApplyDuringFlush(b *testing.B) {
	st := openStore(b)
	p := newPublisher(b, st)
	const bigTxs = 60_000
	for range bigTxs {
		p.add("big")
	}
	p.add("small")
	p.wait()
	s, _ := newService(b, st, Config{TailPartitions: 1, CheckpointInterval: time.Hour, CheckpointEvery: 1 << 30})
	for _, tenant := range []string{"big", "small"} {
		s.host(tenant)
		warm(b, s, tenant, p.last[tenant])
	}
	big := s.lookup("big")

	ctx, cancel := context.WithCancel(context.Background())
	flushes := make(chan int, 1)
	go func() {
		n := 0
		defer func() { flushes <- n }()
		for ctx.Err() == nil {
			big.mu.Lock()
			big.flushed = 0 // as if changed: the flush stores the views
			big.mu.Unlock()
			if err := s.flush(ctx, big); err == nil {
				n++
			}
		}
	}()
	js := st.JS().JetStream()
	var lat []time.Duration
	b.ResetTimer()
	for i := range b.N {
		p.add("big") // the big tenant's events keep coming too: the tail takes its lock for each
		ev, _ := json.Marshal(aggregate.Event{Tenant: "small", AggregateType: aggregate.AccountType, AggregateID: "acc0",
			Version: uint64(i + 2), Event: aggregate.EvDeposited, Data: json.RawMessage(`{"amount":1}`), At: time.Now().UTC()})
		start := time.Now()
		ack, err := js.Publish(context.Background(), schema.EventSubject("small", aggregate.AccountType, "acc0"), ev)
		if err != nil {
			b.Fatal(err)
		}
		select {
		case <-s.lookup("small").waitApplied(ack.Sequence):
		case <-time.After(10 * time.Second):
			b.Fatalf("event %d not applied within 10s", ack.Sequence)
		}
		lat = append(lat, time.Since(start))
	}
	b.StopTimer()
	cancel()
	n := <-flushes
	p.wait()
	slices.Sort(lat)
	b.ReportMetric(float64(lat[len(lat)/2].Microseconds()), "p50-µs")
	b.ReportMetric(float64(lat[len(lat)*99/100].Microseconds()), "p99-µs")
	b.ReportMetric(float64(lat[len(lat)-1].Microseconds()), "max-µs")
	b.ReportMetric(float64(n), "flushes")
}

// BenchmarkFlush measures storing the views of a tenant with 60,000 transactions after 100
// more arrived, as the periodic store does late in a long run: time and bytes written per
// store.
func BenchmarkFlush(b *testing.B) {
	st := openStore(b)
	p := newPublisher(b, st)
	p.addN("big", 60_000)
	s, _ := newService(b, st, Config{CheckpointInterval: time.Hour, CheckpointEvery: 1 << 30})
	s.host("big")
	warm(b, s, "big", p.last["big"])
	ts := s.lookup("big")
	ctx := context.Background()
	if err := s.flush(ctx, ts); err != nil { // the first store writes everything
		b.Fatal(err)
	}
	written := func() float64 {
		var m dto.Metric
		_ = s.m.flushBytes.Write(&m)
		return m.GetHistogram().GetSampleSum()
	}
	before := written()
	b.ResetTimer()
	for range b.N {
		b.StopTimer()
		p.addN("big", 100)
		warm(b, s, "big", p.last["big"])
		b.StartTimer()
		if err := s.flush(ctx, ts); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric((written()-before)/float64(b.N)/1024, "KiB/op")
}
