package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/tenantmesh/tenantmesh/rebalancer"
	"github.com/tenantmesh/tenantmesh/rebalancer/planner"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// PlanCommand is `rebalance plan`.
type PlanCommand struct {
	m *Main
	common
	kind        string
	tolerance   float64
	budget      int
	maxBytes    uint64
	concurrency int
	require     labelsFlag
	to          labelsFlag
	out         string
	dryRun      bool
	collect     time.Duration
}

// PlanOutput is what `rebalance plan --output json` prints and --out writes: the plan and,
// unless it was a dry run or has no moves, the id it is stored under.
type PlanOutput struct {
	ID   string        `json:"id,omitempty"`
	Plan *planner.Plan `json:"plan"`
}

const planAbout = `Plans tenant moves from the instance directory, the placements and a few seconds of load
telemetry, prints the plan (shards before and after, moves) and stores it for
'rebalance apply' (unless --dry-run). Strategies:
  balance            bring every shard's load/capacity within --tolerance of the mean
  evacuate <shard>   move every unpinned tenant off the shard
  fill <shard>       feed a new or underused shard up to the mean
  move <tenant>      move one tenant in several kinds: --to kind=shard,kind=shard
  manual t=shard...  move the named tenants to the named shards (--kind)
Without load telemetry every tenant weighs the same, so balance evens out tenant counts
relative to each shard's capacity.`

const planExamples = `  rebalance plan balance --kind aggregate --tolerance 0.1 --budget 20
  rebalance plan evacuate aggregate-2 --kind aggregate --dry-run
  rebalance plan fill aggregate-3 --kind aggregate --require region=eu
  rebalance plan move acme --to aggregate=aggregate-2,projection=projection-2
  rebalance plan manual --kind aggregate acme=aggregate-2 globex=aggregate-1 --out plan.json
`

// Run plans.
func (c *PlanCommand) Run(ctx context.Context, args []string) error {
	fs := c.m.newFlags("plan", "<strategy> [args] [flags]", planAbout, planExamples)
	c.register(fs)
	fs.StringVar(&c.kind, "kind", "", "the kind to plan for (may be omitted when only one kind has shards)")
	fs.Float64Var(&c.tolerance, "tolerance", 0, "balance: how far above the mean utilisation a shard may end (default 0.05)")
	fs.IntVar(&c.budget, "budget", 0, "the most moves the plan may hold (0: no limit)")
	fs.Uint64Var(&c.maxBytes, "max-bytes", 0, "the most bytes the plan may move, from the tenants' sizes in telemetry (0: no limit)")
	fs.IntVar(&c.concurrency, "concurrency", 0, "moves applied at once (default 4)")
	fs.Var(&c.require, "require", "target shards must carry these labels, k=v[,k=v] (repeatable)")
	fs.Var(&c.to, "to", "move: the target shard per kind, kind=shard[,kind=shard]")
	fs.StringVar(&c.out, "out", "", "also write the plan as JSON to this file (for 'rebalance apply <file>')")
	fs.BoolVar(&c.dryRun, "dry-run", false, "print the plan without storing it")
	fs.DurationVar(&c.collect, "collect", 3*time.Second, "how long to listen to load telemetry (load and tenant sizes) before planning (0: plan by tenant count, warm-ups by the targets' default)")
	pos, err := parse(fs, args)
	if err != nil {
		return err
	}
	if err := c.check(); err != nil {
		return err
	}
	req, err := c.request(pos)
	if err != nil {
		return err
	}
	st, closeFn, err := c.connect(ctx)
	if err != nil {
		return err
	}
	defer closeFn()
	var tel *rebalancer.Telemetry
	if c.collect > 0 {
		kind := c.kind
		if req.Strategy == planner.StrategyMoveTenant {
			kind = ""
		}
		if tel, err = rebalancer.CollectTelemetry(ctx, st, kind, c.collect); err != nil {
			return err
		}
	}
	p, err := rebalancer.MakePlan(ctx, st, req, rebalancer.WorldOptions{Telemetry: tel})
	if err != nil {
		return fmt.Errorf("cannot plan: %w", err)
	}
	if req.Strategy == planner.StrategyEvacuate {
		c.warnDeadSource(ctx, st, req.Kind, req.Shard)
	}
	out := PlanOutput{Plan: p}
	if !c.dryRun && len(p.Moves) > 0 {
		eng, err := rebalancer.New(rebalancer.Config{Store: st, Holder: holder()})
		if err != nil {
			return err
		}
		rec, err := eng.CreatePlan(ctx, p, actor())
		if err != nil {
			return err
		}
		out.ID = rec.ID
	}
	if c.out != "" {
		b, _ := json.MarshalIndent(out, "", "  ")
		if err := os.WriteFile(c.out, append(b, '\n'), 0o644); err != nil {
			return fmt.Errorf("write the plan to %s: %w", c.out, err)
		}
	}
	return c.emit(c.m.Stdout, out, func(w io.Writer) error { return renderPlanOutput(w, out, c.out) })
}

// request turns the positional arguments into a planner request.
func (c *PlanCommand) request(pos []string) (planner.Request, error) {
	if len(pos) == 0 {
		return planner.Request{}, usagef("name a strategy: balance, evacuate <shard>, fill <shard>, move <tenant>, manual <tenant>=<shard>... (see rebalance plan --help)")
	}
	req := planner.Request{Kind: c.kind, Options: planner.Options{Tolerance: c.tolerance, Budget: c.budget, MaxBytes: c.maxBytes, Concurrency: c.concurrency, Require: c.require.m}}
	strategy, rest := pos[0], pos[1:]
	want := func(n int, what string) error {
		if len(rest) != n {
			return usagef("plan %s takes %s; got %q", strategy, what, rest)
		}
		return nil
	}
	switch strategy {
	case "balance":
		req.Strategy = planner.StrategyBalance
		return req, want(0, "no arguments")
	case "evacuate", "fill":
		req.Strategy = planner.Strategy(strategy)
		if err := want(1, "one shard"); err != nil {
			return req, err
		}
		req.Shard = rest[0]
		return req, schema.CheckName("shard", req.Shard)
	case "move", "move-tenant":
		req.Strategy = planner.StrategyMoveTenant
		if err := want(1, "one tenant"); err != nil {
			return req, err
		}
		if len(c.to.m) == 0 {
			return req, usagef("plan move needs --to kind=shard[,kind=shard]")
		}
		req.Tenant, req.Targets = rest[0], c.to.m
		return req, nil
	case "manual":
		req.Strategy = planner.StrategyManual
		if len(rest) == 0 {
			return req, usagef("plan manual takes moves as tenant=shard arguments")
		}
		for _, a := range rest {
			t, sh, ok := strings.Cut(a, "=")
			if !ok || t == "" || sh == "" {
				return req, usagef("manual move %q: want tenant=shard", a)
			}
			req.Moves = append(req.Moves, planner.ManualMove{Tenant: t, To: sh})
		}
		return req, nil
	}
	return req, usagef("unknown strategy %q: use balance, evacuate, fill, move or manual", strategy)
}

func renderPlanOutput(w io.Writer, out PlanOutput, file string) error {
	if err := out.Plan.Render(w); err != nil {
		return err
	}
	fmt.Fprintln(w)
	if file != "" {
		fmt.Fprintf(w, "plan written to %s\n", file)
	}
	switch {
	case len(out.Plan.Moves) == 0:
		fmt.Fprintln(w, "nothing to move: the plan was not stored")
	case out.ID == "":
		fmt.Fprintln(w, "dry run: the plan was not stored")
	default:
		fmt.Fprintf(w, "plan %s stored; apply it with: rebalance apply %s\n", out.ID, out.ID)
	}
	return nil
}

// labelsFlag is a repeatable k=v[,k=v] flag.
type labelsFlag struct{ m map[string]string }

func (l *labelsFlag) String() string {
	if l == nil || len(l.m) == 0 {
		return ""
	}
	keys := slices.Sorted(maps.Keys(l.m))
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = k + "=" + l.m[k]
	}
	return strings.Join(parts, ",")
}

func (l *labelsFlag) Set(s string) error {
	if l.m == nil {
		l.m = map[string]string{}
	}
	for _, kv := range strings.Split(s, ",") {
		k, v, ok := strings.Cut(strings.TrimSpace(kv), "=")
		if !ok || k == "" || v == "" {
			return fmt.Errorf("%q: want key=value", kv)
		}
		l.m[k] = v
	}
	return nil
}

// warnDeadSource warns that moves off a shard without a live instance will abort at handoff:
// the engine waits for the source's instances to drain and report their fence.
func (c *PlanCommand) warnDeadSource(ctx context.Context, st *schema.Store, kind, shard string) {
	insts, err := st.Directory().Instances(ctx, kind)
	if err != nil {
		return
	}
	for _, i := range insts {
		if i.Shard == shard && (schema.Thresholds{}).Status(i, c.m.Now()).Live() {
			return
		}
	}
	fmt.Fprintf(c.m.Stderr, "warning: shard %s has no live instance; its moves will abort at handoff, which needs the source to drain (start an instance of %s first)\n", shard, shard)
}
