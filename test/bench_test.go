package test

import (
	"testing"
	"time"
)

// BenchmarkCutoverPause is the handoff pause under load: the whole platform as processes (dev
// stack: embedded NATS, gateway, rebalancer, 2 shards of each kind), 6 tenants sending
// commands, queries and webhook jobs through the gateway, while each iteration moves one
// tenant across all three kinds through the rebalancer API. The pause is handoff -> commit of
// each kind move: the time the gateway holds the tenant's requests; and the moved tenants'
// request latency during their moves against outside them. Requests that failed are
// reported, not asserted (TestMovesUnderLoad asserts them).
func BenchmarkCutoverPause(b *testing.B) {
	s := startStack(b)
	st, l, _, stopLoad := underLoad(b, s)
	var pauses []time.Duration
	byKind := map[string][]time.Duration{}
	var windows []window
	b.ResetTimer()
	for i := range b.N {
		tenant := loadTenants[i%len(loadTenants)]
		windows = append(windows, moveWindow(tenant, func() {
			for _, m := range moveAcrossKinds(b, st, s.rebalancer, tenant) {
				pauses = append(pauses, m.pause)
				byKind[m.kind] = append(byKind[m.kind], m.pause)
			}
		}))
	}
	b.StopTimer()
	stopLoad()
	in, out := l.latencyAround(windows)
	ms := func(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
	b.ReportMetric(ms(pct(pauses, 0.5)), "pause-p50-ms")
	b.ReportMetric(ms(pct(pauses, 0.99)), "pause-p99-ms")
	b.ReportMetric(ms(pct(pauses, 1)), "pause-max-ms")
	for kind, ps := range byKind {
		b.ReportMetric(ms(pct(ps, 0.5)), kind+"-pause-p50-ms")
		b.ReportMetric(ms(pct(ps, 0.99)), kind+"-pause-p99-ms")
	}
	// What a client of a moved tenant feels: its requests while a move is in flight against
	// the same tenants' requests outside any move.
	b.ReportMetric(ms(pct(in, 0.5)), "during-move-p50-ms")
	b.ReportMetric(ms(pct(in, 0.99)), "during-move-p99-ms")
	b.ReportMetric(ms(pct(out, 0.5)), "outside-p50-ms")
	b.ReportMetric(ms(pct(out, 0.99)), "outside-p99-ms")
	b.ReportMetric(float64(len(pauses)), "kind-moves")
	b.ReportMetric(float64(l.requests.Load()), "requests")
	b.ReportMetric(float64(len(l.failures)), "failed-requests")
	s.stop(b)
}
