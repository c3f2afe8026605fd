package scale

import (
	"cmp"
	"fmt"
	"io"
	"slices"
	"strings"
	"time"

	"github.com/tenantmesh/tenantmesh/rebalancer"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// row is one line of the table: a figure per fleet size.
type row struct {
	name string
	vals []float64
	unit string
}

func perConn(r rates, f func(rates) float64) float64 {
	if r.Conns == 0 {
		return 0
	}
	return f(r) / float64(r.Conns)
}

func pct(d []time.Duration, p float64) time.Duration {
	if len(d) == 0 {
		return 0
	}
	s := slices.Clone(d)
	slices.Sort(s)
	i := int(float64(len(s)-1) * p)
	return s[i]
}

// report prints the run's table in Markdown.
func report(w io.Writer, p params, loaded time.Duration, colds []coldStart, rs []fleetResult, total time.Duration) {
	budget := "off"
	if p.PauseBudget >= 0 {
		budget = cmp.Or(p.PauseBudget, rebalancer.DefaultPauseBudget).String()
	}
	rate := "as fast as they can"
	if p.Rate > 0 {
		rate = fmt.Sprintf("%d req/s", p.Rate)
	}
	fmt.Fprintf(w, "\n## Scale run: %d tenants x %d kinds, fleets %v, %d moves per fleet at concurrency %d, replicas %d, traffic %s for %d tenants, pause budget %s (%s)\n\n",
		p.Tenants, len(kinds), p.Fleets, p.Moves, p.Concurrency, p.Replicas, rate, p.Live, budget, total.Round(time.Second))
	fmt.Fprintf(w, "placements loaded in %s (%.0f/s)\n\n", loaded.Round(time.Millisecond),
		float64(p.Tenants*len(kinds))/loaded.Seconds())
	placements := float64(p.Tenants * len(kinds))
	fmt.Fprintf(w, "| gateway cold start at %.0f placements (from snapshots; a process each) | ready (/readyz 200) | RSS then | B/placement |\n|---|---:|---:|---:|\n", placements)
	var rss int64
	for i, c := range colds {
		fmt.Fprintf(w, "| gateway %d | %s | %.1f MiB | %.1f |\n", i+1, c.Ready.Round(time.Millisecond), mib(c.RSS), float64(c.RSS)/placements)
		rss += c.RSS
	}
	if len(colds) > 0 {
		rss /= int64(len(colds))
	}
	fmt.Fprintf(w, "| the %d gateways' mean | | %.1f MiB | %.1f |\n\n", len(colds), mib(rss), float64(rss)/placements)

	var rows []row
	add := func(name, unit string, f func(fleetResult) float64) {
		r := row{name: name, unit: unit}
		for _, x := range rs {
			r.vals = append(r.vals, f(x))
		}
		rows = append(rows, r)
	}
	roleRows := func(phase string, get func(fleetResult) map[string]rates) {
		add(phase+": shard instance receives (each)", "msgs/s", func(x fleetResult) float64 {
			return perConn(get(x)[roleShard], func(r rates) float64 { return r.RecvMsgs })
		})
		add(phase+": shard instance receives (each)", "B/s", func(x fleetResult) float64 {
			return perConn(get(x)[roleShard], func(r rates) float64 { return r.RecvBytes })
		})
		add(phase+": shard instance sends (each)", "msgs/s", func(x fleetResult) float64 {
			return perConn(get(x)[roleShard], func(r rates) float64 { return r.SentMsgs })
		})
		add(phase+": all shard instances receive", "msgs/s", func(x fleetResult) float64 { return get(x)[roleShard].RecvMsgs })
		add(phase+": gateway receives (each)", "msgs/s", func(x fleetResult) float64 {
			return perConn(get(x)[roleGateway], func(r rates) float64 { return r.RecvMsgs })
		})
		add(phase+": gateway receives (each)", "B/s", func(x fleetResult) float64 {
			return perConn(get(x)[roleGateway], func(r rates) float64 { return r.RecvBytes })
		})
		add(phase+": rebalancer receives", "msgs/s", func(x fleetResult) float64 { return get(x)[roleRebalancer].RecvMsgs })
		add(phase+": rebalancer receives", "B/s", func(x fleetResult) float64 { return get(x)[roleRebalancer].RecvBytes })
		add(phase+": rebalancer sends", "msgs/s", func(x fleetResult) float64 { return get(x)[roleRebalancer].SentMsgs })
		add(phase+": placement watchers receive (all: one per kind in each shard group)", "msgs/s", func(x fleetResult) float64 { return get(x)[roleWatcher].RecvMsgs })
	}
	// What the processes used, summed by role: cores over the window, resident memory at its
	// end (RSS) and, after the moves, the peak since each process started (VmHWM).
	roles := []struct{ role, what string }{{procNATS, "NATS nodes (all 3)"}, {procShards, "shard groups (all)"},
		{roleGateway, "gateways (all)"}, {roleRebalancer, "rebalancer"}, {roleHarness, "harness (the test process: clients, plans)"}}
	cores := func(u procUse) float64 { return u.Cores }
	memRows := func(phase, name string, f func(procUse) float64, get func(fleetResult) []procUse) {
		for _, r := range roles {
			add(fmt.Sprintf("%s: %s, %s", phase, name, r.what), "MiB", func(x fleetResult) float64 { s, _ := byRole(get(x), r.role, f); return s })
		}
		add(fmt.Sprintf("%s: %s, largest shard group", phase, name), "MiB", func(x fleetResult) float64 {
			top := 0.0
			for _, u := range get(x) {
				if u.Role == procShards {
					top = max(top, f(u))
				}
			}
			return top
		})
		add(fmt.Sprintf("%s: %s, per shard instance", phase, name), "MiB", func(x fleetResult) float64 {
			s, _ := byRole(get(x), procShards, f)
			return s / float64(max(x.Instances, 1))
		})
	}
	procRows := func(phase string, get func(fleetResult) []procUse) {
		for _, r := range roles {
			add(fmt.Sprintf("%s: CPU, %s", phase, r.what), "cores", func(x fleetResult) float64 { s, _ := byRole(get(x), r.role, cores); return s })
		}
		add(phase+": CPU, each NATS node (mean)", "cores", func(x fleetResult) float64 { return mean(byRole(get(x), procNATS, cores)) })
		add(phase+": CPU, each gateway (mean)", "cores", func(x fleetResult) float64 { return mean(byRole(get(x), roleGateway, cores)) })
		add(phase+": CPU, per shard instance", "cores", func(x fleetResult) float64 {
			s, _ := byRole(get(x), procShards, cores)
			return s / float64(max(x.Instances, 1))
		})
		add(phase+": CPU, every process", "cores", func(x fleetResult) float64 {
			s := 0.0
			for _, u := range get(x) {
				s += u.Cores
			}
			return s
		})
		memRows(phase, "RSS", func(u procUse) float64 { return mib(u.RSS) }, get)
	}
	add("instances", "", func(x fleetResult) float64 { return float64(x.Instances) })
	add("shard group processes", "", func(x fleetResult) float64 { return float64(x.Groups) })
	add("time to start the added instances", "s", func(x fleetResult) float64 { return x.Start.Seconds() })
	roleRows("steady", func(x fleetResult) map[string]rates { return x.Steady })
	procRows("steady", func(x fleetResult) []procUse { return x.SteadyProcs })
	roleRows("moves", func(x fleetResult) map[string]rates { return x.Moves })
	procRows("moves", func(x fleetResult) []procUse { return x.MovesProcs })
	memRows("moves", "peak RSS (since start)", func(u procUse) float64 { return mib(u.HWM) }, func(x fleetResult) []procUse { return x.MovesProcs })
	add("moves done", "", func(x fleetResult) float64 { return float64(x.Applied) })
	add("moves aborted (handoff over its time limit; the tenant stays)", "", func(x fleetResult) float64 { return float64(x.Aborted) })
	add("plan apply", "moves/s", func(x fleetResult) float64 { return float64(x.Applied) / x.Apply.Seconds() })
	ms := func(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
	add("moves at once (the pause budget's limit, median of 2/s samples)", "", func(x fleetResult) float64 {
		if len(x.Limits) == 0 {
			return 0
		}
		s := slices.Clone(x.Limits)
		slices.Sort(s)
		return float64(s[len(s)/2])
	})
	add("move pause p50", "ms", func(x fleetResult) float64 { return ms(pct(x.Pauses, 0.5)) })
	add("move pause p99", "ms", func(x fleetResult) float64 { return ms(pct(x.Pauses, 0.99)) })
	add("move pause max", "ms", func(x fleetResult) float64 { return ms(pct(x.Pauses, 1)) })
	for i, name := range schema.HandoffStepNames {
		step := func(x fleetResult) []time.Duration {
			if i < len(x.Steps) {
				return x.Steps[i]
			}
			return nil
		}
		add("pause step p50: "+name, "ms", func(x fleetResult) float64 { return ms(pct(step(x), 0.5)) })
		add("pause step p99: "+name, "ms", func(x fleetResult) float64 { return ms(pct(step(x), 0.99)) })
	}
	add("move start -> handoff p50 (warm-up)", "ms", func(x fleetResult) float64 { return ms(pct(x.Warm, 0.5)) })
	add("move start -> handoff p99", "ms", func(x fleetResult) float64 { return ms(pct(x.Warm, 0.99)) })
	add("move commit -> finished p50 (source drained)", "ms", func(x fleetResult) float64 { return ms(pct(x.Finish, 0.5)) })
	add("move commit -> finished p99", "ms", func(x fleetResult) float64 { return ms(pct(x.Finish, 0.99)) })
	add("requests through the gateways", "", func(x fleetResult) float64 { return float64(x.Requests) })
	add("requests through the gateways, per second (offered: TM_SCALE_RATE)", "req/s", func(x fleetResult) float64 {
		return float64(x.Requests) / x.Apply.Seconds()
	})
	add("failed requests", "", func(x fleetResult) float64 { return float64(x.Failed) })

	var hdr strings.Builder
	hdr.WriteString("| figure | unit |")
	sep := "|---|---|"
	for _, x := range rs {
		fmt.Fprintf(&hdr, " %d instances |", x.Instances)
		sep += "---:|"
	}
	if len(rs) > 1 {
		fmt.Fprintf(&hdr, " ratio %d -> %d |", rs[0].Instances, rs[len(rs)-1].Instances)
		sep += "---:|"
	}
	fmt.Fprintln(w, hdr.String())
	fmt.Fprintln(w, sep)
	for _, r := range rows {
		fmt.Fprintf(w, "| %s | %s |", r.name, r.unit)
		for _, v := range r.vals {
			fmt.Fprintf(w, " %s |", num(v))
		}
		if len(r.vals) > 1 {
			if first := r.vals[0]; first != 0 {
				fmt.Fprintf(w, " %.2fx |", r.vals[len(r.vals)-1]/first)
			} else {
				fmt.Fprint(w, " - |")
			}
		}
		fmt.Fprintln(w)
	}
	fmt.Fprintln(w)
	for _, x := range rs {
		processTable(w, x)
	}
}

// processTable prints what each process used at one fleet size.
func processTable(w io.Writer, x fleetResult) {
	fmt.Fprintf(w, "| process (%d instances) | role | steady: cores | moves: cores | RSS after the moves | peak RSS |\n|---|---|---:|---:|---:|---:|\n", x.Instances)
	steady := map[string]procUse{}
	for _, u := range x.SteadyProcs {
		steady[u.Name] = u
	}
	for _, u := range x.MovesProcs {
		fmt.Fprintf(w, "| %s | %s | %s | %s | %.0f MiB | %.0f MiB |\n", u.Name, u.Role, num(steady[u.Name].Cores), num(u.Cores), mib(u.RSS), mib(u.HWM))
	}
	fmt.Fprintln(w)
}

func mib(b int64) float64 { return float64(b) / (1 << 20) }

// mean is sum / n (0 for none).
func mean(sum float64, n int) float64 {
	if n == 0 {
		return 0
	}
	return sum / float64(n)
}

func num(v float64) string {
	switch {
	case v >= 100:
		return fmt.Sprintf("%.0f", v)
	case v >= 10:
		return fmt.Sprintf("%.1f", v)
	case v != 0 && v < 0.1:
		return fmt.Sprintf("%.4f", v)
	}
	return fmt.Sprintf("%.2f", v)
}
