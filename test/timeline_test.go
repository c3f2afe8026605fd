package test

import (
	"bufio"
	"context"
	"fmt"
	"math"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// The handoff pause's timeline (issue 38): where each move's milliseconds went, from the steps
// its shards stamped (schema.HandoffSteps, kept on the move record), beside the KV round trip
// measured in the same run and the gateways' delay in seeing the handoff and the commit.

// The pause ends at the commit's stamp, which its writer takes as it sends it (TargetCommit,
// by the same clock); the gateways release the tenant once the stored commit reaches them
// (tm_placement_change_delay_seconds{phase="draining"}, from the server's stamp).

// timelineTable renders the per-step p50/p99/max of the moves that carry a full timeline, with
// each kind's p99 beside, and the count of those that do not (a move the rebalancer committed
// itself, say).
func timelineTable(moves []movePause) string {
	kinds := []string{"aggregate", "projection", "runner"}
	type gaps struct {
		steps  [][]time.Duration
		pauses []time.Duration
	}
	newGaps := func() *gaps { return &gaps{steps: make([][]time.Duration, len(schema.HandoffStepNames))} }
	all, byKind := newGaps(), map[string]*gaps{}
	for _, k := range kinds {
		byKind[k] = newGaps()
	}
	missing := 0
	for _, m := range moves {
		if _, ok := m.steps.Gaps(m.handoff, m.commit); !ok {
			missing++
			continue
		}
		kg := byKind[m.kind]
		gs, _ := m.steps.Gaps(m.handoff, m.commit)
		for i, gap := range gs {
			all.steps[i] = append(all.steps[i], gap)
			if kg != nil {
				kg.steps[i] = append(kg.steps[i], gap)
			}
		}
		all.pauses = append(all.pauses, m.commit.Sub(m.handoff))
		if kg != nil {
			kg.pauses = append(kg.pauses, m.commit.Sub(m.handoff))
		}
	}
	var b strings.Builder
	ms := func(d time.Duration) string { return strconv.FormatFloat(float64(d)/1e6, 'f', 2, 64) }
	fmt.Fprintf(&b, "\n| step, from the one before (ms; %d moves from the handoff's write) | p50 | p99 | max | %s p99 |\n|---|---:|---:|---:|%s\n",
		len(all.pauses), strings.Join(kinds, " p99 | "), strings.Repeat("---:|", len(kinds)))
	row := func(name string, d []time.Duration, per func(*gaps) []time.Duration) {
		fmt.Fprintf(&b, "| %s | %s | %s | %s |", name, ms(pct(d, 0.5)), ms(pct(d, 0.99)), ms(pct(d, 1)))
		for _, k := range kinds {
			fmt.Fprintf(&b, " %s |", ms(pct(per(byKind[k]), 0.99)))
		}
		b.WriteString("\n")
	}
	for i, name := range schema.HandoffStepNames {
		row(name, all.steps[i], func(g *gaps) []time.Duration { return g.steps[i] })
	}
	row("**pause**", all.pauses, func(g *gaps) []time.Duration { return g.pauses })
	if missing > 0 {
		fmt.Fprintf(&b, "(%d moves without a full timeline: committed by the rebalancer, or a takeover)\n", missing)
	}
	return b.String()
}

// kvProbe measures a KV write's round trip (a put to a bucket of its own, replicated as the
// placements are) every interval until stop, on st's connection: the yardstick the pause's
// sequential steps are measured against.
type kvProbe struct {
	mu    sync.Mutex
	rtts  []probeSample
	loads []loadSample // the machine's 1-minute load average, once a second
	done  chan struct{}
}

// probeSample is one probe's round trip and when it was taken.
type probeSample struct {
	at time.Time
	d  time.Duration
}

// loadSample is the load average and when it was read.
type loadSample struct {
	at   time.Time
	load float64
}

func startKVProbe(t testing.TB, st *schema.Store, interval time.Duration, stop <-chan struct{}) *kvProbe {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	js := st.JS().JetStream()
	replicas := 1
	if s, err := js.Stream(ctx, schema.PlacementStream("aggregate")); err == nil {
		replicas = s.CachedInfo().Config.Replicas
	}
	kv, err := js.CreateOrUpdateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "tm_e2e_probe", Replicas: replicas, History: 1})
	if err != nil {
		t.Fatalf("the KV probe's bucket: %v", err)
	}
	p := &kvProbe{done: make(chan struct{})}
	go func() {
		defer close(p.done)
		tick := time.NewTicker(interval)
		defer tick.Stop()
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			case <-tick.C:
			}
			pctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			start := time.Now()
			_, err := kv.Put(pctx, "probe", []byte(strconv.Itoa(i)))
			rtt := time.Since(start)
			cancel()
			p.mu.Lock()
			if err == nil {
				p.rtts = append(p.rtts, probeSample{start, rtt})
			}
			if l, ok := loadAverage(); ok && (len(p.loads) == 0 || start.Sub(p.loads[len(p.loads)-1].at) >= time.Second) {
				p.loads = append(p.loads, loadSample{start, l})
			}
			p.mu.Unlock()
		}
	}()
	return p
}

// wait waits for the probe to stop (its stop channel closed) and returns its round trips.
func (p *kvProbe) wait() []time.Duration {
	<-p.done
	return durations(p.rtts, time.Time{}, time.Time{})
}

// durations are the figures of samples taken in [from, to] (zero times: no bound).
func durations(samples []probeSample, from, to time.Time) []time.Duration {
	var out []time.Duration
	for _, s := range samples {
		if (from.IsZero() || !s.at.Before(from)) && (to.IsZero() || !s.at.After(to)) {
			out = append(out, s.d)
		}
	}
	return out
}

// loadAverage is the machine's 1-minute load average (Linux), the other work the run shares
// the cores with.
func loadAverage() (float64, bool) {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return 0, false
	}
	f, _, _ := strings.Cut(string(b), " ")
	l, err := strconv.ParseFloat(f, 64)
	return l, err == nil
}

// byQuarter gives, for each quarter of moves in order, the pause's p50/p99/max beside the KV
// round trip's p99 and the machine's mean load average over the same minutes: a pause that
// grows while its yardstick does not is the platform's; one that grows with it, the machine's.
func (p *kvProbe) byQuarter(moves []movePause) string {
	<-p.done
	var b strings.Builder
	b.WriteString("\n| quarter | pause p50 | p99 | max | KV p99 | pause p99 / KV p99 | load average |\n|---|---:|---:|---:|---:|---:|---:|\n")
	ms := func(d time.Duration) string { return strconv.FormatFloat(float64(d)/1e6, 'f', 1, 64) + " ms" }
	for q := range 4 {
		part := moves[q*len(moves)/4 : (q+1)*len(moves)/4]
		if len(part) == 0 {
			continue
		}
		var pauses []time.Duration
		from, to := part[0].handoff, part[0].commit
		for _, m := range part {
			pauses = append(pauses, m.pause)
			from, to = minTime(from, m.handoff), maxTime(to, m.commit)
		}
		kv := durations(p.rtts, from, to)
		load, n := 0.0, 0
		for _, l := range p.loads {
			if !l.at.Before(from) && !l.at.After(to) {
				load, n = load+l.load, n+1
			}
		}
		loadCol := "-" // no reading in a quarter shorter than the readings' second
		if n > 0 {
			loadCol = strconv.FormatFloat(load/float64(n), 'f', 1, 64)
		}
		fmt.Fprintf(&b, "| %d | %s | %s | %s | %s | %.1fx | %s |\n", q+1, ms(pct(pauses, 0.5)), ms(pct(pauses, 0.99)), ms(pct(pauses, 1)),
			ms(pct(kv, 0.99)), float64(pct(pauses, 0.99))/float64(max(pct(kv, 0.99), 1)), loadCol)
	}
	return b.String()
}

func minTime(a, b time.Time) time.Time {
	if b.Before(a) {
		return b
	}
	return a
}

func maxTime(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}

// changeDelays scrapes tm_placement_change_delay_seconds from a process's /metrics and returns
// the p50 and p99 per phase over every kind (from the histogram's buckets, interpolated as
// Prometheus's histogram_quantile does).
func changeDelays(t testing.TB, metricsURL string) map[string][2]time.Duration {
	t.Helper()
	resp, err := adminClient.Get(metricsURL)
	if err != nil {
		t.Logf("scraping %s: %v", metricsURL, err)
		return nil
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Logf("scraping %s: %s", metricsURL, resp.Status)
		return nil
	}
	const name = "tm_placement_change_delay_seconds_bucket{"
	buckets := map[string]map[float64]float64{} // phase -> le -> cumulative count, summed over kinds
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, name) {
			continue
		}
		labels, value, ok := strings.Cut(line[len(name):], "} ")
		if !ok {
			continue
		}
		var phase string
		le := math.Inf(1)
		for l := range strings.SplitSeq(labels, ",") {
			k, v, _ := strings.Cut(l, "=")
			v = strings.Trim(v, `"`)
			switch k {
			case "phase":
				phase = v
			case "le":
				if v != "+Inf" {
					le, _ = strconv.ParseFloat(v, 64)
				}
			}
		}
		n, _ := strconv.ParseFloat(value, 64)
		if buckets[phase] == nil {
			buckets[phase] = map[float64]float64{}
		}
		buckets[phase][le] += n
	}
	out := map[string][2]time.Duration{}
	for phase, bs := range buckets {
		out[phase] = [2]time.Duration{bucketQuantile(bs, 0.5), bucketQuantile(bs, 0.99)}
	}
	return out
}

// bucketQuantile is q of a cumulative histogram (le -> count), interpolated within its bucket.
func bucketQuantile(bs map[float64]float64, q float64) time.Duration {
	les := make([]float64, 0, len(bs))
	for le := range bs {
		les = append(les, le)
	}
	slices.Sort(les)
	if len(les) == 0 || bs[les[len(les)-1]] == 0 {
		return 0
	}
	rank := q * bs[les[len(les)-1]]
	lower, below := 0.0, 0.0
	for _, le := range les {
		if c := bs[le]; c >= rank {
			if math.IsInf(le, 1) {
				return time.Duration(lower * float64(time.Second))
			}
			frac := 0.0
			if c > below {
				frac = (rank - below) / (c - below)
			}
			return time.Duration((lower + (le-lower)*frac) * float64(time.Second))
		}
		lower, below = le, bs[le]
	}
	return 0
}

// pauseReport is the timeline, the KV round trip beside it, and the gateway's delays, for a
// test's log and docs/benchmarks.md.
func pauseReport(t testing.TB, moves []movePause, rtts []time.Duration, gatewayMetrics string) string {
	var b strings.Builder
	b.WriteString(timelineTable(moves))
	var pauses []time.Duration
	for _, m := range moves {
		pauses = append(pauses, m.commit.Sub(m.handoff))
	}
	// Sequential KV steps in the pause: the handoff's write reaching the source (a delivery),
	// the note (a hop), the commit's write. The goal: p99 <= (steps + 2) x the KV p99.
	const kvSteps = 3
	rtt99 := pct(rtts, 0.99)
	fmt.Fprintf(&b, "KV write round trip in the same run (%d probes): p50 %s p99 %s max %s; pause p99 %s = %.1fx the KV p99 (bound: (%d steps + 2) x = %s)\n",
		len(rtts), pct(rtts, 0.5).Round(10*time.Microsecond), rtt99.Round(10*time.Microsecond), pct(rtts, 1).Round(10*time.Microsecond),
		pct(pauses, 0.99).Round(10*time.Microsecond), float64(pct(pauses, 0.99))/float64(max(rtt99, 1)), kvSteps, (kvSteps+2)*rtt99)
	if d := changeDelays(t, gatewayMetrics); d != nil {
		fmt.Fprintf(&b, "the gateway sees the handoff (holds from then) p50 %s p99 %s; the commit (releases then) p50 %s p99 %s\n",
			d["handoff"][0].Round(10*time.Microsecond), d["handoff"][1].Round(10*time.Microsecond),
			d["draining"][0].Round(10*time.Microsecond), d["draining"][1].Round(10*time.Microsecond))
	}
	return b.String()
}
