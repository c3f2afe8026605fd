package cli

import (
	"context"
	"fmt"
)

// RollbackCommand is `rebalance rollback`.
type RollbackCommand struct {
	m *Main
	common
	engineFlags
	yes bool
}

const rollbackAbout = `Reverses a plan: moves not started are skipped, moves before commit are aborted, committed
moves finish first; then every completed move is moved back by a new plan (printed), applied
at once. Like apply it needs the leader lease, and --yes when stdin is not a terminal.`

const rollbackExamples = `  rebalance rollback p20260101-120000-0001 --yes
`

// Run rolls back.
func (c *RollbackCommand) Run(ctx context.Context, args []string) error {
	fs := c.m.newFlags("rollback", "<plan-id> [flags]", rollbackAbout, rollbackExamples)
	c.common.register(fs)
	c.engineFlags.register(fs)
	fs.BoolVar(&c.yes, "yes", false, "roll back without asking")
	pos, err := parse(fs, args)
	if err != nil {
		return err
	}
	if err := c.check(); err != nil {
		return err
	}
	if len(pos) != 1 {
		return usagef("rollback takes one plan id")
	}
	if !c.yes && !c.m.Terminal(c.m.Stdin) {
		return usagef("stdin is not a terminal: pass --yes to roll back without confirmation")
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
	rec, moves, err := eng.Plan(ctx, pos[0])
	if err != nil {
		return err
	}
	if rec.RollbackOf != "" {
		return fmt.Errorf("plan %s is itself the rollback of %s; to undo it, make a new plan", rec.ID, rec.RollbackOf)
	}
	if !c.yes {
		ok, err := confirm(c.m, fmt.Sprintf("Roll back plan %s (%s)?", rec.ID, pluralize(len(moves), "move")))
		if err != nil || !ok {
			return fmt.Errorf("not rolled back")
		}
	}
	prog.start(moves)
	rb, err := eng.Rollback(ctx, rec.ID)
	prog.finish()
	if err != nil {
		return fmt.Errorf("rollback of %s: %w (run it again to resume)", rec.ID, err)
	}
	return c.result(ctx, c.m.Stdout, eng, rb.ID)
}
