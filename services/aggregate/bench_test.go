package aggregate

import (
	"context"
	"encoding/json"
	"fmt"
	"github.com/nats-io/nats.go/jetstream"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// seedEvents appends n deposit events for tenant over 100 accounts straight to the stream
// (as a long-lived tenant would have), returning the last sequence.
func seedEvents(b *testing.B, st *schema.Store, tenant string, n int) {
	js := st.JS().JetStream()
	const accounts = 100
	for i := range n {
		acc := i % accounts
		ev := Event{Tenant: tenant, AggregateType: AccountType, AggregateID: fmt.Sprintf("acc%d", acc),
			Version: uint64(i/accounts + 1), CommandKey: fmt.Sprintf("seed-%d", i), At: time.Now()}
		if ev.Version == 1 {
			ev.Event = EvOpened
		} else {
			ev.Event = EvDeposited
			ev.Data = json.RawMessage(`{"amount":1}`)
		}
		data, _ := json.Marshal(ev)
		msg := &nats.Msg{Subject: schema.EventSubject(tenant, AccountType, ev.AggregateID), Data: data}
		fut, err := js.PublishMsgAsync(msg)
		if err != nil {
			b.Fatal(err)
		}
		if i == 0 {
			select {
			case <-fut.Ok():
			case err := <-fut.Err():
				b.Fatalf("seed: %v", err)
			}
		}
		if i%2000 == 1999 {
			<-js.PublishAsyncComplete()
		}
	}
	<-js.PublishAsyncComplete()
}

// BenchmarkWarm measures a move target's warm-up for tenants of 10k and 100k events, with
// each strategy (the snapshot covers all but the last 1% of events, as after a handoff).
func BenchmarkWarm(b *testing.B) {
	for _, n := range []int{10_000, 100_000} {
		st := openStore(b)
		ctx := context.Background()
		tenant := "big"
		if err := st.EnsureEventsStream(ctx); err != nil {
			b.Fatal(err)
		}
		seedEvents(b, st, tenant, n-n/100)
		src := newService(b, st, Config{Strategy: StrategyReplay})
		if err := src.Warm(ctx, tenant, 0); err != nil {
			b.Fatal(err)
		}
		if err := src.Release(ctx, tenant); err != nil { // writes the snapshot
			b.Fatal(err)
		}
		js := st.JS().JetStream()
		for i := range n / 100 { // the tail after the snapshot
			ev := Event{Tenant: tenant, AggregateType: AccountType, AggregateID: "tail", Version: uint64(i + 1), Event: EvOpened, CommandKey: fmt.Sprintf("tail-%d", i)}
			if i > 0 {
				ev.Event, ev.Data = EvDeposited, json.RawMessage(`{"amount":1}`)
			}
			data, _ := json.Marshal(ev)
			if _, err := js.Publish(ctx, schema.EventSubject(tenant, AccountType, "tail"), data); err != nil {
				b.Fatal(err)
			}
		}
		fence := src.Fence(tenant)
		for _, strategy := range []Strategy{StrategyReplay, StrategySnapshot} {
			b.Run(fmt.Sprintf("events=%d/%s", n, strategy), func(b *testing.B) {
				for b.Loop() {
					tgt := newService(b, st, Config{Strategy: strategy})
					start := time.Now()
					if err := tgt.Warm(ctx, tenant, fence); err != nil {
						b.Fatal(err)
					}
					b.ReportMetric(time.Since(start).Seconds()*1000, "warm-ms")
					tot, _, _ := tgt.Totals(ctx, tenant)
					if tgt.Applied(tenant) < fence || tot.Accounts != 101 {
						b.Fatalf("warmed to %d of fence %d with %d accounts", tgt.Applied(tenant), fence, tot.Accounts)
					}
				}
			})
		}
	}
}

// BenchmarkCommands measures commands per second on one instance: 32 concurrent clients over
// 64 tenants, deposits on 10 accounts each (Service.Handle, one JetStream append per command).
func BenchmarkCommands(b *testing.B) {
	st := openStore(b)
	s := newService(b, st, Config{})
	ctx := context.Background()
	for t := range 64 {
		for a := range 10 {
			if _, err := s.Handle(ctx, fmt.Sprintf("t%d", t), cmd(fmt.Sprintf("a%d", a), CmdOpen, 0, fmt.Sprintf("open-%d", a))); err != nil {
				b.Fatal(err)
			}
		}
	}
	var n atomic.Int64
	b.SetParallelism(16)
	b.ResetTimer()
	start := time.Now()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			i := n.Add(1)
			tenant := fmt.Sprintf("t%d", i%64)
			if _, err := s.Handle(ctx, tenant, cmd(fmt.Sprintf("a%d", (i/64)%10), CmdDeposit, 1, fmt.Sprintf("k%d", i))); err != nil {
				b.Error(err)
				return
			}
		}
	})
	b.ReportMetric(float64(n.Load())/time.Since(start).Seconds(), "cmds/s")
}

// BenchmarkTenantSize compares the two ways of knowing a tenant's stored size: the counter the
// event log keeps as it applies events (what telemetry reads every heartbeat, for every hosted
// tenant) and a subject-filtered stream info of TM_EVENTS (one NATS request per tenant, which
// counts the tenant's messages per subject but not their bytes).
func BenchmarkTenantSize(b *testing.B) {
	st := openStore(b)
	ctx := context.Background()
	if err := st.EnsureEventsStream(ctx); err != nil {
		b.Fatal(err)
	}
	const tenant = "big"
	seedEvents(b, st, tenant, 10_000)
	s := newService(b, st, Config{})
	if err := s.Warm(ctx, tenant, 0); err != nil {
		b.Fatal(err)
	}
	stream, err := st.JS().Stream(ctx, schema.StreamEvents)
	if err != nil {
		b.Fatal(err)
	}
	b.Run("counter", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if z := s.log.Sizes(); len(z) != 1 || z[0].Events != 10_000 {
				b.Fatalf("sizes %+v", z)
			}
		}
	})
	b.Run("stream-info", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, err := stream.Info(ctx, jetstream.WithSubjectFilter(schema.TenantEvents(tenant))); err != nil {
				b.Fatal(err)
			}
		}
	})
}
