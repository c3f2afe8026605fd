package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"

	"github.com/tenantmesh/tenantmesh/rebalancer"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// VerifyCommand is `rebalance verify`.
type VerifyCommand struct {
	m *Main
	common
	move string
}

const verifyAbout = `Compares each committed move's target state at the fence with its source's, by the digests
every instance of both shards recorded there (aggregate: each account's state at the fence
sequence; projection: the views at that applied sequence; runner: the jobs waiting unclaimed and
the effects nobody is delivering). A move is match, mismatch, unverified (the source left no
digest at the fence, e.g. it had died, or the service makes none), not-moved (it did not commit)
or pending (still running). Exits 4 when a move's target differs from its source.`

const verifyExamples = `  rebalance verify p20260101-120000-0001
  rebalance verify p20260101-120000-0001/m00003
  rebalance verify p20260101-120000-0001 --move m00003 --output json
`

// ErrMismatch means a verified move's target state differs from its source's: exit code 4.
var ErrMismatch = errors.New("a move's target state differs from its source's")

// VerifyResult is `rebalance verify --output json`.
type VerifyResult struct {
	Plan     string                   `json:"plan"`
	Summary  map[string]int           `json:"summary"`
	Verdicts []rebalancer.MoveVerdict `json:"verdicts"`
}

// Run verifies a plan's moves.
func (c *VerifyCommand) Run(ctx context.Context, args []string) error {
	fs := c.m.newFlags("verify", "<plan-id>[/<move-id>] [flags]", verifyAbout, verifyExamples)
	c.register(fs)
	fs.StringVar(&c.move, "move", "", "verify only this move of the plan (m00001)")
	pos, err := parse(fs, args)
	if err != nil {
		return err
	}
	if err := c.check(); err != nil {
		return err
	}
	if len(pos) != 1 {
		return usagef("verify takes one plan id, or a move as <plan-id>/<move-id>")
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
	vs, err := eng.Verify(ctx, pos[0], c.move)
	if err != nil {
		return err
	}
	plan, _, _ := strings.Cut(pos[0], "/")
	res := VerifyResult{Plan: plan, Summary: rebalancer.Summary(vs), Verdicts: vs}
	if res.Verdicts == nil {
		res.Verdicts = []rebalancer.MoveVerdict{}
	}
	if err := c.emit(c.m.Stdout, res, func(w io.Writer) error { return renderVerify(w, res) }); err != nil {
		return err
	}
	if n := res.Summary[schema.VerifyMismatch]; n > 0 {
		fmt.Fprintf(c.m.Stderr, "rebalance: %s: %s differ from their source\n", plan, pluralize(n, "move"))
		return fmt.Errorf("%w: %w", errReported, ErrMismatch)
	}
	return nil
}

// verifyOrder is the order verdict counts are shown in.
var verifyOrder = []string{schema.VerifyMismatch, schema.VerifyMatch, schema.VerifyUnverified, rebalancer.VerifyPending, rebalancer.VerifyNotMoved}

// renderVerify is `rebalance verify`'s table.
func renderVerify(w io.Writer, r VerifyResult) error {
	var parts []string
	for _, k := range verifyOrder {
		if n := r.Summary[k]; n > 0 {
			parts = append(parts, fmt.Sprintf("%d %s", n, k))
		}
	}
	line := fmt.Sprintf("plan %s: %s", r.Plan, pluralize(len(r.Verdicts), "move"))
	if len(parts) > 0 {
		line += ": " + strings.Join(parts, ", ")
	}
	fmt.Fprintln(w, line)
	if len(r.Verdicts) == 0 {
		return nil
	}
	fmt.Fprintln(w)
	tw := newTable(w)
	fmt.Fprintln(tw, "MOVE\tKIND\tTENANT\tFROM\tTO\tRESULT\tFENCE\tSOURCE\tTARGET\tDETAIL")
	for _, v := range r.Verdicts {
		fence := "-"
		if v.Result == schema.VerifyMatch || v.Result == schema.VerifyMismatch || v.Result == schema.VerifyUnverified {
			fence = fmt.Sprint(v.Fence)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", v.Move, v.Kind, v.Tenant, v.From, v.To, v.Result, fence,
			digests(v.Source), digests(v.Target), dash(v.Detail))
	}
	return tw.Flush()
}

// digests is a side's digests in short: the distinct sums (8 digits) and their items.
func digests(recs []schema.DigestRecord) string {
	var out []string
	for _, r := range recs {
		s := "err"
		if r.Digest != nil {
			s = fmt.Sprintf("%.8s/%d", r.Digest.Sum, r.Digest.Items)
		}
		if !slices.Contains(out, s) {
			out = append(out, s)
		}
	}
	if len(out) == 0 {
		return "-"
	}
	return strings.Join(out, ",")
}
