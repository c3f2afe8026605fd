package planner

import (
	"fmt"
	"io"
	"maps"
	"slices"
	"strings"
	"text/tabwriter"
	"time"
)

// String renders the plan as Render does.
func (p *Plan) String() string {
	var b strings.Builder
	_ = p.Render(&b)
	return b.String()
}

// Render writes the plan as the dry run of `rebalance plan` shows it: a header, each kind's
// imbalance, a table of shards (load before and after, capacity, utilisation, tenants in and
// out) and the list of moves.
func (p *Plan) Render(w io.Writer) error {
	var b strings.Builder
	fmt.Fprintf(&b, "plan: %s, %s in %s (concurrency %d), tolerance %s", p.Strategy, count(len(p.Moves), "move"), count(p.Waves, "wave"), p.Concurrency, pct(p.Tolerance))
	if p.Budget > 0 {
		fmt.Fprintf(&b, ", budget %d", p.Budget)
	}
	if p.MinMoves > 0 {
		fmt.Fprintf(&b, ", lower bound %s", count(p.MinMoves, "move"))
	}
	b.WriteString("\n")
	status := "complete"
	if !p.Complete {
		status = "incomplete"
	}
	fmt.Fprintf(&b, "status: %s\n", status)
	if p.Bytes > 0 || p.WarmupSeconds > 0 {
		fmt.Fprintf(&b, "to move: %s, predicted warm-up %s in total\n", HumanBytes(p.Bytes), secs(p.WarmupSeconds))
	}
	for _, n := range p.Notes {
		fmt.Fprintf(&b, "note: %s\n", n)
	}
	for _, k := range p.Kinds {
		fmt.Fprintf(&b, "%s: max/mean %.3f -> %.3f, max utilisation %s -> %s, mean %s\n",
			k.Kind, k.Before.MaxOverMean, k.After.MaxOverMean, pct(k.Before.Max), pct(k.After.Max), pct(k.After.Mean))
	}
	b.WriteString("\n")
	tw := tabwriter.NewWriter(&b, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "KIND\tSHARD\tBEFORE\tAFTER\tCAPACITY\tUTILISATION\tTENANTS\tIN\tOUT")
	for _, d := range p.Shards {
		name := d.Shard
		if d.Draining {
			name += " (draining)"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s -> %s\t%d -> %d\t%s\t%s\n", d.Kind, name, num(d.LoadBefore), num(d.LoadAfter), capacity(d),
			pct(d.UtilBefore()), pct(d.UtilAfter()), d.TenantsBefore, d.TenantsAfter, plus(d.In), minus(d.Out))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if len(p.Moves) > 0 {
		b.WriteString("\nmoves:\n")
		tw = tabwriter.NewWriter(&b, 0, 0, 2, ' ', 0)
		sized := p.Bytes > 0 || slices.ContainsFunc(p.Moves, func(m Move) bool { return m.Warmup != "" })
		if sized {
			fmt.Fprintln(tw, "#\tWAVE\tKIND\tTENANT\tFROM\tTO\tLOAD\tREVISION\tBYTES\tWARM-UP\tPREDICTED\tWHY")
		} else {
			fmt.Fprintln(tw, "#\tWAVE\tKIND\tTENANT\tFROM\tTO\tLOAD\tREVISION")
		}
		for i, m := range p.Moves {
			fmt.Fprintf(tw, "%d\t%d\t%s\t%s\t%s\t%s\t%s\t%d", i+1, m.Wave, m.Kind, m.Tenant, m.From, m.To, num(m.Load), m.Revision)
			if sized {
				warm, pred := "default", "-"
				if m.Warmup != "" {
					warm, pred = m.Warmup, secs(m.WarmupSeconds)
				}
				fmt.Fprintf(tw, "\t%s\t%s\t%s\t%s", HumanBytes(m.Bytes), warm, pred, m.WarmupReason)
			}
			fmt.Fprintln(tw)
		}
		if err := tw.Flush(); err != nil {
			return err
		}
	}
	_, err := io.WriteString(w, b.String())
	return err
}

// secs renders a predicted duration in seconds, to the millisecond.
func secs(f float64) string { return seconds(f).Round(time.Millisecond).String() }

func count(n int, noun string) string {
	if n == 1 {
		return "1 " + noun
	}
	return fmt.Sprintf("%d %ss", n, noun)
}

func pct(f float64) string { return fmt.Sprintf("%.1f%%", 100*f) }

func num(f float64) string {
	s := fmt.Sprintf("%.2f", f)
	s = strings.TrimRight(strings.TrimRight(s, "0"), ".")
	if s == "-0" {
		s = "0"
	}
	return s
}

func capacity(d ShardDiff) string {
	s := num(d.Capacity)
	if d.MaxTenants > 0 {
		s += fmt.Sprintf(" (%d tenants)", d.MaxTenants)
	}
	return s
}

func plus(n int) string {
	if n == 0 {
		return "-"
	}
	return fmt.Sprintf("+%d", n)
}

func minus(n int) string {
	if n == 0 {
		return "-"
	}
	return fmt.Sprintf("-%d", n)
}

// labelString renders labels as k=v,k=v sorted by key.
func labelString(l map[string]string) string {
	keys := slices.Sorted(maps.Keys(l))
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = k + "=" + l[k]
	}
	return strings.Join(parts, ",")
}
