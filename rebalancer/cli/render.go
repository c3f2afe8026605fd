package cli

import (
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/tenantmesh/tenantmesh/rebalancer"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

const timeLayout = "2006-01-02 15:04:05"

func stamp(t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	return t.UTC().Format(timeLayout)
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func newTable(w io.Writer) *tabwriter.Writer { return tabwriter.NewWriter(w, 0, 0, 2, ' ', 0) }

// moveStates is the order move counts are shown in.
var moveStates = []rebalancer.MoveState{rebalancer.MoveDone, rebalancer.MovePending, rebalancer.MoveWarming, rebalancer.MoveHandoff,
	rebalancer.MoveCommitted, rebalancer.MoveSkipped, rebalancer.MoveAborted, rebalancer.MoveFailed}

// countLine is "6 moves: 4 done, 1 skipped, 1 aborted".
func countLine(s rebalancer.PlanSummary) string {
	total := 0
	var parts []string
	for _, st := range moveStates {
		if n := s.Moves[st]; n > 0 {
			parts = append(parts, fmt.Sprintf("%d %s", n, st))
			total += n
		}
	}
	line := pluralize(total, "move")
	if len(parts) > 0 {
		line += ": " + strings.Join(parts, ", ")
	}
	return line
}

// renderPlans is `rebalance status`: one line per plan.
func renderPlans(w io.Writer, plans []rebalancer.PlanSummary) error {
	if len(plans) == 0 {
		_, err := fmt.Fprintln(w, "no plans yet; make one with: rebalance plan balance --kind <kind>")
		return err
	}
	tw := newTable(w)
	fmt.Fprintln(tw, "PLAN\tSTATUS\tSTRATEGY\tMOVES\tDONE\tSKIPPED\tABORTED\tFAILED\tCREATED\tACTOR\tNOTE")
	for _, p := range plans {
		note := ""
		switch {
		case p.RollbackOf != "":
			note = "rollback of " + p.RollbackOf
		case p.RolledBackBy != "":
			note = "rolled back by " + p.RolledBackBy
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%d\t%d\t%d\t%d\t%s\t%s\t%s\n", p.ID, p.Status, p.Plan.Strategy, len(p.Plan.Moves),
			p.Count(rebalancer.MoveDone), p.Count(rebalancer.MoveSkipped), p.Count(rebalancer.MoveAborted), p.Count(rebalancer.MoveFailed),
			stamp(p.Created), p.Actor, dash(note))
	}
	return tw.Flush()
}

// renderPlanDetail is `rebalance status <id>` and the end of apply and rollback.
func renderPlanDetail(w io.Writer, rec rebalancer.PlanRecord, moves []rebalancer.MoveRecord) error {
	fmt.Fprintf(w, "plan %s: %s\n", rec.ID, rec.Status)
	fmt.Fprintf(w, "strategy %s, %s in %s (concurrency %d), created %s by %s\n", rec.Plan.Strategy,
		pluralize(len(rec.Plan.Moves), "move"), pluralize(rec.Plan.Waves, "wave"), max(rec.Plan.Concurrency, 1), stamp(rec.Created), rec.Actor)
	if rec.RollbackOf != "" {
		fmt.Fprintf(w, "rollback of plan %s\n", rec.RollbackOf)
	}
	if rec.RolledBackBy != "" {
		fmt.Fprintf(w, "rolled back by plan %s\n", rec.RolledBackBy)
	}
	fmt.Fprintln(w, countLine(rebalancer.Summarize(rec, moves)))
	if len(moves) == 0 {
		return nil
	}
	fmt.Fprintln(w)
	tw := newTable(w)
	fmt.Fprintln(tw, "MOVE\tWAVE\tKIND\tTENANT\tFROM\tTO\tWARM-UP\tSTATE\tPAUSE\tREASON")
	for _, m := range moves {
		pause := "-"
		if d := m.Pause(); d > 0 {
			pause = d.Round(time.Millisecond).String()
		}
		fmt.Fprintf(tw, "%s\t%d\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", m.ID, m.Wave, m.Kind, m.Tenant, m.From, m.To, warmup(m), m.State, pause, dash(m.Reason))
	}
	return tw.Flush()
}

// renderInstances is `rebalance instances`: the multi-host design's host view.
func renderInstances(w io.Writer, insts []rebalancer.InstanceView) error {
	if len(insts) == 0 {
		_, err := fmt.Fprintln(w, "no instances registered")
		return err
	}
	tw := newTable(w)
	fmt.Fprintln(tw, "INSTANCE\tSTATUS\tHEARTBEAT\tCAPACITY\tTENANTS\tIN-FLIGHT\tRATE/S\tLATENCY\tERRORS\tCPU\tMEM\tDISK\tVERSION\tLABELS\tURL")
	for _, i := range insts {
		tenants, inflight, rate, lat, errs, cpu, mem, disk := "-", "-", "-", "-", "-", "-", "-", "-"
		if m := i.Metrics; m != nil {
			tenants, inflight = fmt.Sprint(m.Tenants), fmt.Sprint(m.InFlight)
			rate, lat = fmt.Sprintf("%.1f", m.RatePerSec), fmt.Sprintf("%.1fms", m.LatencyMS)
			errs, cpu = fmt.Sprintf("%.1f%%", 100*m.ErrorRate), fmt.Sprintf("%.0f%%", m.CPU)
			if m.MemBytes > 0 {
				mem = fmt.Sprintf("%.0fMiB", float64(m.MemBytes)/(1<<20))
			}
			if m.DiskPercent > 0 {
				disk = fmt.Sprintf("%.0f%%", m.DiskPercent)
			}
		}
		fmt.Fprintf(tw, "%s\t%s\t%s ago\t%d\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", i.Key, i.Status, age(i.HeartbeatAge), i.Capacity,
			tenants, inflight, rate, lat, errs, cpu, mem, disk, dash(i.Version), dash(rebalancer.LabelString(i.Labels)), i.URL)
	}
	return tw.Flush()
}

// renderInstance renders one instance's page: fields, then tenants, runs, circuits and history.
func renderInstance(w io.Writer, d rebalancer.InstanceDetail, now time.Time) error {
	if err := renderInstances(w, []rebalancer.InstanceView{d.InstanceView}); err != nil {
		return err
	}
	if f := d.Flag; f != nil && f.Degraded {
		fmt.Fprintf(w, "\nflagged degraded by %s %s ago: %s\n", dash(f.By), age(now.Sub(f.Since).Seconds()), dash(f.Reason))
	}
	fmt.Fprintf(w, "\nTENANTS (%d", d.TenantsTotal)
	if len(d.Tenants) < d.TenantsTotal {
		fmt.Fprintf(w, ", first %d", len(d.Tenants))
	}
	fmt.Fprintln(w, ")")
	tw := newTable(w)
	for _, t := range d.Tenants {
		fmt.Fprintf(tw, "  %s\t%s\tepoch %d\n", t.Tenant, t.Phase, t.Epoch)
	}
	tw.Flush()
	fmt.Fprintln(w, "\nRECENT RUNS")
	if len(d.Runs) == 0 {
		fmt.Fprintln(w, "  none reported")
	}
	tw = newTable(w)
	for _, r := range d.Runs {
		when := "-"
		if r.Finished != nil {
			when = age(now.Sub(*r.Finished).Seconds()) + " ago"
		}
		fmt.Fprintf(tw, "  %s\t%s\t%s\t%s\tattempts %d\t%s\t%s\n", r.ID, r.Tenant, r.Type, r.Status, r.Attempts, when, r.Error)
	}
	tw.Flush()
	fmt.Fprintln(w, "\nCIRCUITS (per gateway)")
	if len(d.Circuits) == 0 {
		fmt.Fprintln(w, "  no gateway reported")
	}
	tw = newTable(w)
	for _, c := range d.Circuits {
		fmt.Fprintf(tw, "  %s\t%s\tfailures %d\n", c.Gateway, c.State, c.Failures)
	}
	tw.Flush()
	fmt.Fprintln(w, "\nSTATUS HISTORY")
	tw = newTable(w)
	for _, c := range d.History {
		fmt.Fprintf(tw, "  %s\t%s\t%s\n", c.Time.UTC().Format(time.RFC3339), c.To, c.Reason)
	}
	return tw.Flush()
}

// age renders seconds as a short duration: 4s, 2m5s, 3h0m.
func age(sec float64) string {
	d := time.Duration(sec * float64(time.Second))
	switch {
	case d < 0:
		return "0s"
	case d < time.Hour:
		return d.Round(time.Second).String()
	}
	return strings.TrimSuffix(d.Round(time.Minute).String(), "0s")
}

// renderAudit is `rebalance audit`.
func renderAudit(w io.Writer, evs []schema.AuditEvent) error {
	if len(evs) == 0 {
		_, err := fmt.Fprintln(w, "no audit events match")
		return err
	}
	tw := newTable(w)
	fmt.Fprintln(tw, "TIME\tACTOR\tACTION\tKIND\tTENANT\tMOVE\tREVISION\tDETAIL")
	for _, e := range evs {
		mv := "-"
		if e.Plan != "" {
			mv = e.Plan + "/" + e.Move
		}
		rev := "-"
		if e.Revision > 0 {
			rev = fmt.Sprint(e.Revision)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", stamp(e.Time), e.Actor, e.Action, dash(e.Kind), dash(e.Tenant), mv, rev, dash(e.Detail))
	}
	return tw.Flush()
}

// renderKinds is `rebalance kinds`.
func renderKinds(w io.Writer, kcs []schema.KindConfig) error {
	if len(kcs) == 0 {
		_, err := fmt.Fprintln(w, "no kinds registered")
		return err
	}
	tw := newTable(w)
	fmt.Fprintln(tw, "KIND\tPOLICY\tUNPLACED\tCAPACITY\tHOLD-BUDGET\tOVERLAP\tSINGLE-WRITER\tIDEMPOTENT\tVERIFY\tUPSTREAM-TIMEOUT\tMULTIPLEX\tRATE-LIMIT")
	for _, k := range kcs {
		mux, rl := "-", "-"
		if k.Affinity != nil {
			mux = fmt.Sprint(k.Affinity.Multiplex)
		}
		if k.RateLimit != nil {
			rl = fmt.Sprintf("%g/s burst %d", k.RateLimit.PerSecond, k.RateLimit.Burst)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t%t\t%t\t%t\t%t\t%s\t%s\t%s\n", k.Kind, k.Policy, k.Unplaced, k.Capacity, k.HoldBudget.D(), k.Overlap, k.SingleWriter, k.Idempotent, k.Verify, k.UpstreamTimeout.D(), mux, rl)
	}
	return tw.Flush()
}

// renderMoveList lists up to n moves (what apply is about to do), then how many more.
func renderMoveList(w io.Writer, moves []rebalancer.MoveRecord, n int) {
	tw := newTable(w)
	for i, m := range moves {
		if i == n {
			fmt.Fprintf(tw, "  ... and %d more\n", len(moves)-n)
			break
		}
		fmt.Fprintf(tw, "  %s\t%s\t%s\t%s -> %s\t%s\n", m.ID, m.Kind, m.Tenant, m.From, m.To, m.State)
	}
	tw.Flush()
}

// warmup is a move's warm-up strategy and predicted time, "default" if none was chosen.
func warmup(m rebalancer.MoveRecord) string {
	if m.Strategy == "" {
		return "default"
	}
	if m.WarmupSeconds > 0 {
		return fmt.Sprintf("%s (~%v)", m.Strategy, time.Duration(m.WarmupSeconds*float64(time.Second)).Round(time.Millisecond))
	}
	return m.Strategy
}
