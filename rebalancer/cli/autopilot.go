package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"net/http"
	"os"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/tenantmesh/tenantmesh/internal/envflag"
	"github.com/tenantmesh/tenantmesh/rebalancer"
	"github.com/tenantmesh/tenantmesh/rebalancer/autopilot"
	"github.com/tenantmesh/tenantmesh/rebalancer/planner"
)

// service is a running rebalancer's API, for the commands that can go through it.
type service struct {
	url, token string
}

func (s *service) register(fs interface {
	StringVar(*string, string, string, string)
}, what string) {
	fs.StringVar(&s.url, "server", os.Getenv("TM_REBALANCER_URL"), "URL of the rebalancer service (rebalance serve) "+what+" (env TM_REBALANCER_URL)")
}

// call sends method path with body (nil: none) to the service and decodes a 2xx answer into
// out (nil: drop it); other answers become errors that say what to do.
func (s *service) call(ctx context.Context, method, path string, body, out any) error {
	var rd io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return err
		}
		rd = bytes.NewReader(b)
	}
	rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	url := strings.TrimSuffix(s.url, "/") + path
	req, err := http.NewRequestWithContext(rctx, method, url, rd)
	if err != nil {
		return err
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	if s.token != "" {
		req.Header.Set("Authorization", "Bearer "+s.token)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("%s %s: %w", method, url, err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(io.LimitReader(resp.Body, 4<<20))
	switch {
	case resp.StatusCode == http.StatusUnauthorized:
		return fmt.Errorf("%s needs the rebalancer's admin token: set --admin-token or TM_ADMIN_TOKEN to the one it was started with", url)
	case resp.StatusCode == http.StatusForbidden:
		return fmt.Errorf("%s refuses changes: the rebalancer has no admin token; start it with --admin-token", url)
	case resp.StatusCode >= 300:
		var p struct{ Detail string }
		if json.Unmarshal(raw, &p) == nil && p.Detail != "" {
			return fmt.Errorf("%s %s: %s: %s", method, url, resp.Status, p.Detail)
		}
		return fmt.Errorf("%s %s: %s: %s", method, url, resp.Status, strings.TrimSpace(string(raw)))
	}
	if out == nil {
		return nil
	}
	return json.Unmarshal(raw, out)
}

// ControlCommand is `rebalance pause|resume|cancel <plan>`.
type ControlCommand struct {
	m *Main
	common
	engineFlags
	svc     service
	control rebalancer.Control
	name    string
}

var controlAbout = map[string]string{
	"pause": `Pauses a plan: no move starts until it is resumed, and the moves under way finish. A plan
being applied (by a rebalancer service or an apply) becomes paused at its next move.`,
	"resume": `Resumes a paused plan from where it stopped. Through a rebalancer service (--server, or
TM_REBALANCER_URL) the service applies it; without one this command applies it here, taking
the leader lease like apply. A plan the autopilot paused to let an operator's plan go first is
resumed by the autopilot itself.`,
	"cancel": `Cancels a plan: moves past their handoff (handoff, takeover, committed) finish, moves warming
are aborted (the tenant stays on its source), moves not started are skipped. The plan ends
cancelled.`,
}

// Run pauses, resumes or cancels.
func (c *ControlCommand) Run(ctx context.Context, args []string) error {
	fs := c.m.newFlags(c.name, "<plan-id> [flags]", controlAbout[c.name], fmt.Sprintf("  rebalance %s p20260101-120000-0001\n  TM_REBALANCER_URL=http://127.0.0.1:8090 TM_ADMIN_TOKEN=... rebalance %s p20260101-120000-0001\n", c.name, c.name))
	c.common.register(fs)
	c.engineFlags.register(fs)
	c.svc.register(fs, "to send it through")
	envflag.Secret(fs, &c.svc.token, "admin-token", "the service's admin token, sent with --server")
	pos, err := parse(fs, args)
	if err != nil {
		return err
	}
	if err := c.check(); err != nil {
		return err
	}
	if len(pos) != 1 {
		return usagef("%s takes one plan id", c.name)
	}
	id := pos[0]
	var rec rebalancer.PlanRecord
	if c.svc.url != "" {
		err = c.svc.call(ctx, http.MethodPost, "/api/plans/"+id+"/"+c.name, map[string]string{"actor": actor()}, &rec)
		if err != nil {
			return err
		}
		return c.emit(c.m.Stdout, rec, func(w io.Writer) error {
			_, err := fmt.Fprintf(w, "plan %s: %s (%s by %s)\n", rec.ID, rec.Status, c.name, actor())
			return err
		})
	}
	st, closeFn, err := c.connect(ctx)
	if err != nil {
		return err
	}
	defer closeFn()
	prog := newProgress(c.m, c.output == "json")
	eng, err := c.engine(st, prog.update)
	if err != nil {
		return err
	}
	if rec, err = eng.SetControl(ctx, id, c.control, actor()); err != nil {
		return err
	}
	if c.control != "" {
		return c.emit(c.m.Stdout, rec, func(w io.Writer) error {
			note := ""
			if rec.Status == rebalancer.PlanApplying {
				note = "; it stops at its next move"
			}
			_, err := fmt.Fprintf(w, "plan %s: %s by %s (%s)%s\n", rec.ID, c.control, actor(), rec.Status, note)
			return err
		})
	}
	_, moves, err := eng.Plan(ctx, id)
	if err != nil {
		return err
	}
	prog.start(moves)
	_, err = eng.Apply(ctx, id)
	prog.finish()
	if err != nil {
		return fmt.Errorf("resume %s: %w (run it again to resume)", id, err)
	}
	return c.result(ctx, c.m.Stdout, eng, id)
}

// FreezeCommand is `rebalance freeze`.
type FreezeCommand struct {
	m *Main
	common
	forD   time.Duration
	until  string
	reason string
	off    bool
}

const freezeAbout = `Freezes the autopilot: until the freeze ends it makes no balance, fill or evacuate plan
(failover still runs: it brings tenants back, it does not rearrange them). --off ends every
freeze in force. Operators' plans are never frozen.`

const freezeExamples = `  rebalance freeze --for 2h --reason "release 4.2 rolling out"
  rebalance freeze --until 2026-12-24T00:00:00Z --reason "holiday change freeze"
  rebalance freeze --off
`

// Run freezes or unfreezes.
func (c *FreezeCommand) Run(ctx context.Context, args []string) error {
	fs := c.m.newFlags("freeze", "[flags]", freezeAbout, freezeExamples)
	c.register(fs)
	fs.DurationVar(&c.forD, "for", 0, "how long the freeze lasts")
	fs.StringVar(&c.until, "until", "", "when the freeze ends (RFC 3339)")
	fs.StringVar(&c.reason, "reason", "", "why: shown with every plan the freeze stops")
	fs.BoolVar(&c.off, "off", false, "end every freeze in force")
	pos, err := parse(fs, args)
	if err != nil {
		return err
	}
	if err := c.check(); err != nil {
		return err
	}
	if len(pos) > 0 {
		return usagef("freeze takes no arguments")
	}
	var until time.Time
	switch {
	case c.off:
	case c.forD > 0 && c.until == "":
		until = c.m.Now().Add(c.forD)
	case c.forD == 0 && c.until != "":
		if until, err = time.Parse(time.RFC3339, c.until); err != nil {
			return usagef("--until %q: use RFC 3339, such as 2026-12-24T00:00:00Z", c.until)
		}
	default:
		return usagef("say how long: --for 2h or --until <time> (or --off)")
	}
	if !c.off && c.reason == "" {
		return usagef("--reason is required: it is shown with every plan the freeze stops")
	}
	st, closeFn, err := c.connect(ctx)
	if err != nil {
		return err
	}
	defer closeFn()
	var s autopilot.State
	if c.off {
		s, err = autopilot.Unfreeze(ctx, st)
	} else {
		s, err = autopilot.FreezeUntil(ctx, st, until, c.reason, actor())
	}
	if err != nil {
		return err
	}
	return c.emit(c.m.Stdout, s, func(w io.Writer) error { return renderAutopilotState(w, s, c.m.Now()) })
}

// MaintenanceCommand is `rebalance maintenance <kind> <shard>`.
type MaintenanceCommand struct {
	m *Main
	common
	reason string
	off    bool
}

const maintenanceAbout = `Marks a shard for maintenance: the autopilot (in mode on) empties it with an evacuate plan and
moves nothing onto it until the mark is cleared with --off. The mark is an operator's request:
no maintenance window holds it back, a change freeze does.`

const maintenanceExamples = `  rebalance maintenance aggregate aggregate-3 --reason "kernel upgrade"
  rebalance maintenance aggregate aggregate-3 --off
`

// Run marks or clears.
func (c *MaintenanceCommand) Run(ctx context.Context, args []string) error {
	fs := c.m.newFlags("maintenance", "<kind> <shard> [flags]", maintenanceAbout, maintenanceExamples)
	c.register(fs)
	fs.StringVar(&c.reason, "reason", "", "why the shard goes down")
	fs.BoolVar(&c.off, "off", false, "clear the mark")
	pos, err := parse(fs, args)
	if err != nil {
		return err
	}
	if err := c.check(); err != nil {
		return err
	}
	if len(pos) != 2 {
		return usagef("maintenance takes a kind and a shard")
	}
	if !c.off && c.reason == "" {
		return usagef("--reason is required")
	}
	st, closeFn, err := c.connect(ctx)
	if err != nil {
		return err
	}
	defer closeFn()
	s, err := autopilot.SetMaintenance(ctx, st, pos[0], pos[1], !c.off, c.reason, actor())
	if err != nil {
		return err
	}
	return c.emit(c.m.Stdout, s, func(w io.Writer) error { return renderAutopilotState(w, s, c.m.Now()) })
}

// AutopilotCommand is `rebalance autopilot`.
type AutopilotCommand struct {
	m *Main
	common
	svc service
}

const autopilotAbout = `Shows the autopilot of a running rebalancer service (--server or TM_REBALANCER_URL): its mode,
guardrails and what it used of its budgets, freezes and maintenance marks, shards without a
live instance, its plans under way and its latest decisions (each with the detector, the figure
it measured, the threshold, and the guardrail that stopped it, if one did). Without a service it
shows the stored state only. The mode and guardrails are rebalance serve's --autopilot* flags.`

const autopilotExamples = `  TM_REBALANCER_URL=http://127.0.0.1:8090 rebalance autopilot
  rebalance autopilot --server http://127.0.0.1:8090 --output json
`

// Run shows the autopilot.
func (c *AutopilotCommand) Run(ctx context.Context, args []string) error {
	fs := c.m.newFlags("autopilot", "[flags]", autopilotAbout, autopilotExamples)
	c.register(fs)
	c.svc.register(fs, "to ask")
	pos, err := parse(fs, args)
	if err != nil {
		return err
	}
	if err := c.check(); err != nil {
		return err
	}
	if len(pos) > 0 {
		return usagef("autopilot takes no arguments")
	}
	if c.svc.url == "" {
		st, closeFn, err := c.connect(ctx)
		if err != nil {
			return err
		}
		defer closeFn()
		s, err := autopilot.ReadState(ctx, st)
		if err != nil {
			return err
		}
		return c.emit(c.m.Stdout, s, func(w io.Writer) error {
			fmt.Fprintln(w, "(no --server: the stored state only; the mode, guardrails and decisions are the service's)")
			return renderAutopilotState(w, s, c.m.Now())
		})
	}
	var s autopilot.Status
	if err := c.svc.call(ctx, http.MethodGet, "/api/autopilot", nil, &s); err != nil {
		return err
	}
	return c.emit(c.m.Stdout, s, func(w io.Writer) error { return renderAutopilot(w, s, c.m.Now()) })
}

func renderAutopilot(w io.Writer, s autopilot.Status, now time.Time) error {
	g := s.Guardrails
	lead := "not leading (another rebalancer decides)"
	if s.Leading {
		lead = "leading"
	}
	fmt.Fprintf(w, "autopilot: %s, %s\n", s.Mode, lead)
	fmt.Fprintf(w, "budget: %d of %d moves, %s of %s in %s; cool-down %s per tenant\n", s.Used.Moves, g.MaxMoves,
		planner.HumanBytes(s.Used.Bytes), planner.HumanBytes(g.MaxBytes), g.Window, g.Cooldown)
	fmt.Fprintf(w, "balance: above max/mean %.2f for %s, aiming at %.2f, at most %d moves a plan\n", 1+g.Trigger, g.Sustain, 1+g.Tolerance, g.MaxPlanMoves)
	if len(s.Windows) > 0 {
		fmt.Fprintf(w, "maintenance windows (UTC): %s\n", strings.Join(s.Windows, "; "))
	}
	if s.Running != "" {
		fmt.Fprintf(w, "plan under way: %s\n", s.Running)
	}
	if s.Yielded != "" {
		fmt.Fprintf(w, "plan paused for an operator's: %s\n", s.Yielded)
	}
	for subject, id := range s.Failing {
		what := "failover"
		if !strings.Contains(subject, "/") {
			what = "retake" // a kind's held takeovers
		}
		fmt.Fprintf(w, "%s under way: %s (plan %s)\n", what, subject, id)
	}
	for _, kind := range slices.Sorted(maps.Keys(s.Held)) {
		fmt.Fprintf(w, "%s: %d tenants held in a takeover that no move drives (their requests wait); retake takes them over again\n", kind, s.Held[kind])
	}
	if err := renderAutopilotState(w, s.State, now); err != nil {
		return err
	}
	if len(s.Down) > 0 {
		fmt.Fprintln(w, "\nshards without a live instance:")
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
		fmt.Fprintln(tw, "KIND\tSHARD\tTENANTS\tREGISTERED\tGONE\tSILENT\tDOWN FOR")
		for _, d := range s.Down {
			since := "-"
			if !d.Since.IsZero() {
				since = now.Sub(d.Since).Round(time.Second).String()
			}
			fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%d\t%d\t%s\n", d.Kind, d.Shard, d.Tenants, d.Registered, d.Gone, d.Silent, since)
		}
		tw.Flush()
	}
	fmt.Fprintln(w, "\ndecisions (newest first):")
	if len(s.Decisions) == 0 {
		fmt.Fprintln(w, "  none yet")
		return nil
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "TIME\tDETECTOR\tSUBJECT\tOUTCOME\tPLAN\tDETAIL")
	for _, d := range s.Decisions {
		outcome := d.Outcome
		if d.Guardrail != "" {
			outcome += " (" + d.Guardrail + ")"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", d.Time.Local().Format("15:04:05"), d.Detector, d.Subject, outcome, dash(d.Plan), d.Detail)
	}
	return tw.Flush()
}

func renderAutopilotState(w io.Writer, s autopilot.State, now time.Time) error {
	if f, ok := s.Frozen(now); ok {
		fmt.Fprintf(w, "frozen until %s (%s left) by %s: %s\n", f.Until.Local().Format(time.RFC3339), f.Until.Sub(now).Round(time.Second), f.By, f.Reason)
	} else {
		fmt.Fprintln(w, "not frozen")
	}
	if len(s.Maintenance) == 0 {
		fmt.Fprintln(w, "no shard marked for maintenance")
		return nil
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "MAINTENANCE\tSHARD\tBY\tSINCE\tREASON")
	for _, m := range s.Maintenance {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", m.Kind, m.Shard, m.By, m.At.Local().Format(time.RFC3339), m.Reason)
	}
	return tw.Flush()
}
