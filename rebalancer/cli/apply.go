package cli

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/tenantmesh/tenantmesh/internal/envflag"
	"github.com/tenantmesh/tenantmesh/rebalancer"
	"github.com/tenantmesh/tenantmesh/rebalancer/planner"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// ApplyCommand is `rebalance apply`.
type ApplyCommand struct {
	m *Main
	common
	engineFlags
	yes                bool
	server, adminToken string
}

// engineFlags are the move timeouts apply and rollback take.
type engineFlags struct {
	warm, handoff, drain time.Duration
	leaseTTL             time.Duration
	pauseBudget          time.Duration
}

func (e *engineFlags) register(fs interface {
	DurationVar(*time.Duration, string, time.Duration, string)
}) {
	fs.DurationVar(&e.warm, "warm-timeout", 2*time.Minute, "abort a move whose target is not ready within this")
	fs.DurationVar(&e.handoff, "handoff-timeout", 10*time.Second, "abort a move whose handoff cannot commit within this (requests are held meanwhile)")
	fs.DurationVar(&e.drain, "drain-timeout", 30*time.Second, "after commit, how long to wait for the former owner to drain")
	fs.DurationVar(&e.leaseTTL, "lease-ttl", 10*time.Second, "the leader lease's lifetime while applying")
	fs.DurationVar(&e.pauseBudget, "pause-budget", rebalancer.DefaultPauseBudget, "run fewer moves at once while handoff pauses exceed this (0: always the plan's concurrency)")
}

// pauseBudget is a --pause-budget value as rebalancer.Config takes it (0 turns pacing off).
func pauseBudget(d time.Duration) time.Duration {
	if d <= 0 {
		return -1
	}
	return d
}

func (e *engineFlags) engine(st *schema.Store, progress func(rebalancer.MoveRecord)) (*rebalancer.Engine, error) {
	return rebalancer.New(rebalancer.Config{Store: st, Holder: holder(), LeaseTTL: e.leaseTTL, WarmTimeout: e.warm,
		HandoffTimeout: e.handoff, DrainTimeout: e.drain, PauseBudget: pauseBudget(e.pauseBudget), Progress: progress})
}

// PlanResult is what apply, rollback and `status <id>` print as JSON: the plan and its moves.
type PlanResult struct {
	Plan  rebalancer.PlanRecord   `json:"plan"`
	Moves []rebalancer.MoveRecord `json:"moves"`
}

const applyAbout = `Applies a plan: every move goes warming -> handoff -> commit -> done, at most the plan's
concurrency at a time, fewer while moves' handoff pauses (the time the gateways hold a moving
tenant's requests) exceed --pause-budget: the limit halves on a pause over half the budget and
grows back while pauses keep within that. It takes the leader lease, so it refuses while a rebalancer service (or
another apply) leads. An interrupted apply (Ctrl-C, crash) is resumed by running it again.
It asks for confirmation on a terminal; elsewhere it needs --yes. The argument is a plan id
(from 'rebalance plan' or 'rebalance status') or a file written by 'rebalance plan --out'.
Exit code 0: every move done; 3: finished, but moves were skipped, aborted or failed.`

const applyExamples = `  rebalance apply p20260101-120000-0001
  rebalance apply plan.json --yes
  TM_ADMIN_TOKEN=... rebalance apply p20260101-120000-0001 --yes --server http://127.0.0.1:8090   # through a running rebalancer service
`

// Run applies.
func (c *ApplyCommand) Run(ctx context.Context, args []string) error {
	fs := c.m.newFlags("apply", "<plan-id|plan.json> [flags]", applyAbout, applyExamples)
	c.common.register(fs)
	c.engineFlags.register(fs)
	fs.BoolVar(&c.yes, "yes", false, "apply without asking")
	fs.StringVar(&c.server, "server", os.Getenv("TM_REBALANCER_URL"), "URL of a running rebalancer service (rebalance serve) to apply through; needed while one holds the leader lease (env TM_REBALANCER_URL)")
	envflag.Secret(fs, &c.adminToken, "admin-token", "the service's admin token, sent with --server")
	pos, err := parse(fs, args)
	if err != nil {
		return err
	}
	if err := c.check(); err != nil {
		return err
	}
	if len(pos) != 1 {
		return usagef("apply takes one plan id or plan file (see rebalance apply --help)")
	}
	interactive := c.m.Terminal(c.m.Stdin)
	if !c.yes && !interactive {
		return usagef("stdin is not a terminal: pass --yes to apply without confirmation")
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
	id, err := c.resolve(ctx, eng, pos[0])
	if err != nil {
		return err
	}
	rec, moves, err := eng.Plan(ctx, id)
	if err != nil {
		return err
	}
	switch {
	case rec.Status.Finished():
		return fmt.Errorf("plan %s is already %s; see rebalance status %s", id, rec.Status, id)
	case rec.Status == rebalancer.PlanPaused:
		return fmt.Errorf("plan %s is paused (by %s); resume it with rebalance resume %s", id, rec.ControlBy, id)
	}
	if len(moves) == 0 {
		fmt.Fprintf(c.m.Stderr, "plan %s has no moves\n", id)
	}
	if !c.yes {
		renderMoveList(c.m.Stderr, moves, 20)
		ok, err := confirm(c.m, fmt.Sprintf("Apply plan %s: %s (%s, concurrency %d)?", id, pluralize(len(moves), "move"), rec.Plan.Strategy, max(rec.Plan.Concurrency, 1)))
		if err != nil || !ok {
			return errors.Join(errors.New("not applied"), err)
		}
	}
	prog.start(moves)
	if c.server != "" {
		err = c.applyThrough(ctx, eng, id, prog)
	} else {
		_, err = eng.Apply(ctx, id)
	}
	prog.finish()
	if err != nil {
		if ctx.Err() != nil {
			return fmt.Errorf("interrupted: the plan is resumable; run `rebalance apply %s` again", id)
		}
		if errors.Is(err, schema.ErrLeaseHeld) {
			return fmt.Errorf("apply %s: %w; if that is a rebalancer service, apply through it: rebalance apply %s --server <its URL>", id, err, id)
		}
		return fmt.Errorf("apply %s: %w (resume with `rebalance apply %s`)", id, err, id)
	}
	return c.result(ctx, c.m.Stdout, eng, id)
}

// applyThrough asks a rebalancer service to apply the plan, then follows its moves in the
// store until the plan is finished.
func (c *ApplyCommand) applyThrough(ctx context.Context, eng *rebalancer.Engine, id string, prog *progress) error {
	url := strings.TrimSuffix(c.server, "/") + "/api/plans/" + id + "/apply"
	rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	req, err := http.NewRequestWithContext(rctx, http.MethodPost, url, nil)
	if err != nil {
		cancel()
		return err
	}
	if c.adminToken != "" {
		req.Header.Set("Authorization", "Bearer "+c.adminToken)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		cancel()
		return fmt.Errorf("ask %s to apply: %w", c.server, err)
	}
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	resp.Body.Close()
	cancel()
	switch {
	case resp.StatusCode == http.StatusUnauthorized && c.adminToken == "":
		return fmt.Errorf("%s needs the rebalancer's admin token: set --admin-token or TM_ADMIN_TOKEN", url)
	case resp.StatusCode == http.StatusUnauthorized:
		return fmt.Errorf("%s refused the admin token: set --admin-token or TM_ADMIN_TOKEN to the token the rebalancer was started with", url)
	case resp.StatusCode == http.StatusForbidden:
		return fmt.Errorf("%s refuses applies: the rebalancer has no admin token; start it with --admin-token or TM_ADMIN_TOKEN, and pass the same here", url)
	case resp.StatusCode != http.StatusAccepted:
		return fmt.Errorf("%s answered %s: %s", url, resp.Status, strings.TrimSpace(string(body)))
	}
	seen := map[string]rebalancer.MoveState{}
	tick := time.NewTicker(200 * time.Millisecond)
	defer tick.Stop()
	for {
		rec, moves, err := eng.Plan(ctx, id)
		if err == nil {
			for _, m := range moves {
				if seen[m.ID] != m.State {
					seen[m.ID] = m.State
					prog.update(m)
				}
			}
			if rec.Status.Finished() || rec.Status == rebalancer.PlanPaused {
				return nil
			}
		}
		select {
		case <-tick.C: // the service writes the move records; polling them is the progress feed
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// result prints a finished plan and returns ErrPartial unless every move is done.
func (c *common) result(ctx context.Context, w io.Writer, eng *rebalancer.Engine, id string) error {
	rec, moves, err := eng.Plan(ctx, id)
	if err != nil {
		return err
	}
	if moves == nil {
		moves = []rebalancer.MoveRecord{}
	}
	if err := c.emit(w, PlanResult{Plan: rec, Moves: moves}, func(w io.Writer) error { return renderPlanDetail(w, rec, moves) }); err != nil {
		return err
	}
	if rec.Status == rebalancer.PlanPartial {
		return fmt.Errorf("%w: plan %s: %s", ErrPartial, rec.ID, countLine(rebalancer.Summarize(rec, moves)))
	}
	return nil
}

// resolve returns the plan id for arg: a stored plan's id, or a plan file (stored first if it
// is not stored yet).
func (c *ApplyCommand) resolve(ctx context.Context, eng *rebalancer.Engine, arg string) (string, error) {
	if _, err := os.Stat(arg); err != nil {
		if strings.HasSuffix(arg, ".json") {
			return "", fmt.Errorf("read plan file: %w", err)
		}
		return arg, nil
	}
	raw, err := os.ReadFile(arg)
	if err != nil {
		return "", fmt.Errorf("read plan file: %w", err)
	}
	var out PlanOutput
	if err := json.Unmarshal(raw, &out); err != nil || out.Plan == nil {
		var p planner.Plan
		if err2 := json.Unmarshal(raw, &p); err2 != nil || p.Strategy == "" {
			return "", fmt.Errorf("%s is not a plan file (write one with rebalance plan --out): %v", arg, errors.Join(err, err2))
		}
		out.Plan = &p
	}
	if out.ID != "" {
		if _, _, err := eng.Plan(ctx, out.ID); err == nil {
			return out.ID, nil
		}
	}
	rec, err := eng.CreatePlan(ctx, out.Plan, actor())
	if err != nil {
		return "", err
	}
	fmt.Fprintf(c.m.Stderr, "plan file %s stored as plan %s\n", arg, rec.ID)
	return rec.ID, nil
}

func confirm(m *Main, question string) (bool, error) {
	fmt.Fprintf(m.Stderr, "%s [y/N] ", question)
	line, err := bufio.NewReader(m.Stdin).ReadString('\n')
	if err != nil && !errors.Is(err, io.EOF) {
		return false, err
	}
	a := strings.ToLower(strings.TrimSpace(line))
	return a == "y" || a == "yes", nil
}

// progress shows moves as they go: on a terminal one status line rewritten in place (phase of
// the latest move, done/total, ETA) with a permanent line per finished move; elsewhere one
// plain line per change.
type progress struct {
	mu      sync.Mutex
	w       io.Writer
	tty     bool
	total   int
	done    map[string]bool
	started time.Time
	now     func() time.Time
}

func newProgress(m *Main, toStderr bool) *progress {
	w := m.Stdout
	if toStderr {
		w = m.Stderr
	}
	return &progress{w: w, tty: m.Terminal(w), done: map[string]bool{}, now: m.Now}
}

func (p *progress) start(moves []rebalancer.MoveRecord) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.total, p.started = len(moves), p.now()
	for _, m := range moves {
		if m.State.Terminal() {
			p.done[m.ID] = true
		}
	}
}

func (p *progress) update(m rebalancer.MoveRecord) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if m.State.Terminal() {
		p.done[m.ID] = true
	}
	n := len(p.done)
	line := fmt.Sprintf("%s %s/%s %s -> %s: %s", m.ID, m.Kind, m.Tenant, m.From, m.To, m.State)
	if m.State.Terminal() && m.Reason != "" {
		line += " (" + m.Reason + ")"
	}
	if !p.tty {
		fmt.Fprintf(p.w, "[%d/%d] %s\n", n, p.total, line)
		return
	}
	eta := "?"
	if n > 0 && n < p.total {
		el := p.now().Sub(p.started)
		eta = (el / time.Duration(n) * time.Duration(p.total-n)).Round(time.Second).String()
	} else if n >= p.total {
		eta = "0s"
	}
	if m.State.Terminal() {
		if m.State == rebalancer.MoveDone {
			line += fmt.Sprintf(" (paused %s)", m.Pause().Round(time.Millisecond))
		}
		fmt.Fprintf(p.w, "\r\033[K%s\n", line)
	}
	fmt.Fprintf(p.w, "\r\033[K[%d/%d] %s | ETA %s", n, p.total, line, eta)
}

func (p *progress) finish() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.tty {
		fmt.Fprint(p.w, "\r\033[K")
	}
}

func pluralize(n int, noun string) string {
	if n == 1 {
		return "1 " + noun
	}
	return fmt.Sprintf("%d %ss", n, noun)
}
