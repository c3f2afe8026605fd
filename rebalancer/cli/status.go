package cli

import (
	"context"
	"io"

	"github.com/tenantmesh/tenantmesh/rebalancer"
)

// StatusCommand is `rebalance status`.
type StatusCommand struct {
	m *Main
	common
	limit int
}

const statusAbout = `Without an argument, lists plans newest first with their moves counted by state. With a
plan id, shows that plan's moves: state, how long the tenant's requests were held (pause) and
why a move was skipped, aborted or failed.`

const statusExamples = `  rebalance status
  rebalance status p20260101-120000-0001 --output json
`

// Run shows plans.
func (c *StatusCommand) Run(ctx context.Context, args []string) error {
	fs := c.m.newFlags("status", "[plan-id] [flags]", statusAbout, statusExamples)
	c.register(fs)
	fs.IntVar(&c.limit, "limit", 20, "list at most this many plans (0: all)")
	pos, err := parse(fs, args)
	if err != nil {
		return err
	}
	if err := c.check(); err != nil {
		return err
	}
	if len(pos) > 1 {
		return usagef("status takes at most one plan id")
	}
	st, closeFn, err := c.connect(ctx)
	if err != nil {
		return err
	}
	defer closeFn()
	eng, err := rebalancer.New(rebalancer.Config{Store: st, Holder: holder()})
	if err != nil {
		return err
	}
	if len(pos) == 1 {
		rec, moves, err := eng.Plan(ctx, pos[0])
		if err != nil {
			return err
		}
		if moves == nil {
			moves = []rebalancer.MoveRecord{}
		}
		return c.emit(c.m.Stdout, PlanResult{Plan: rec, Moves: moves}, func(w io.Writer) error { return renderPlanDetail(w, rec, moves) })
	}
	sums, err := eng.Summaries(ctx, c.limit)
	if err != nil {
		return err
	}
	if sums == nil {
		sums = []rebalancer.PlanSummary{}
	}
	return c.emit(c.m.Stdout, sums, func(w io.Writer) error { return renderPlans(w, sums) })
}
