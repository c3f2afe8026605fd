package rebalancer

import (
	"context"
	"errors"
	"testing"
	"time"
)

const ms = time.Millisecond

// take acquires n slots without waiting (it fails the test if one is not free) and returns
// their epochs.
func take(t *testing.T, p *pacer, n int) []uint64 {
	t.Helper()
	var out []uint64
	for range n {
		e, err := p.acquire(canceled()) // a free slot is taken before ctx is looked at
		if err != nil {
			t.Fatalf("slot %d of %d not free (limit %d): %v", len(out)+1, n, p.Limit(), err)
		}
		out = append(out, e)
	}
	return out
}

func TestPacerWithoutBudgetRunsTheConcurrency(t *testing.T) {
	p := newPacer(10, -1, nil)
	epochs := take(t, p, 10)
	if _, err := p.acquire(canceled()); !errors.Is(err, context.Canceled) {
		t.Fatalf("11th slot: err %v, want to wait (context.Canceled)", err)
	}
	finish(p, epochs[0], time.Second, true) // no budget: nothing is learned
	if p.Limit() != 10 {
		t.Fatalf("limit %d, want 10", p.Limit())
	}
	take(t, p, 1)
}

func TestPacerSlowStartThenHalvesOncePerSpell(t *testing.T) {
	var cuts []int
	p := newPacer(50, 50*ms, func(limit int, _ time.Duration) { cuts = append(cuts, limit) })
	if p.Limit() != startLimit {
		t.Fatalf("starts at %d, want %d", p.Limit(), startLimit)
	}
	// Slow start: every move within half the budget adds one.
	for range 12 {
		e := take(t, p, 1)
		finish(p, e[0], 25*ms, false)
	}
	if p.Limit() != 16 {
		t.Fatalf("after 12 good moves: limit %d, want 16", p.Limit())
	}
	// 16 moves run; the first over half the budget halves the limit, the others of the same
	// spell do not.
	epochs := take(t, p, 16)
	finish(p, epochs[0], 30*ms, false) // over half the budget: the tail would pass it
	if p.Limit() != 8 || len(cuts) != 1 || cuts[0] != 8 {
		t.Fatalf("after a slow move: limit %d, cuts %v; want 8, [8]", p.Limit(), cuts)
	}
	for _, e := range epochs[1:8] {
		finish(p, e, 300*ms, false)
	}
	if p.Limit() != 8 {
		t.Fatalf("moves started before the cut cut again: limit %d, want 8", p.Limit())
	}
	// 8 still hold slots: none is free until they go below the limit.
	if _, err := p.acquire(canceled()); err == nil {
		t.Fatal("a slot was free with 8 running at limit 8")
	}
	for _, e := range epochs[8:] {
		finish(p, e, 10*ms, false)
	}
	// Past slow start the limit grows by 1/limit per good move: about one per round of moves
	// (the 8 above and 8 more: 8 -> 9.85).
	for range 8 {
		e := take(t, p, 1)
		finish(p, e[0], 10*ms, false)
	}
	if l := p.Limit(); l != 9 {
		t.Fatalf("after two rounds of good moves from limit 8: limit %d, want 9 (additive increase)", l)
	}
	// A move aborted in its handoff is a slow move: the limit halves, and never below 1.
	for range 10 {
		e := take(t, p, 1)
		finish(p, e[0], 0, true)
	}
	if p.Limit() != 1 {
		t.Fatalf("after repeated aborts: limit %d, want 1", p.Limit())
	}
	// A move without a pause (skipped, aborted while warming) teaches nothing.
	e := take(t, p, 1)
	finish(p, e[0], 0, false)
	if p.Limit() != 1 {
		t.Fatalf("a move without a pause changed the limit to %d", p.Limit())
	}
}

func TestPacerNeverExceedsTheConcurrency(t *testing.T) {
	p := newPacer(3, 50*ms, nil)
	if p.Limit() != 3 {
		t.Fatalf("starts at %d, want the plan's concurrency 3", p.Limit())
	}
	for range 20 {
		e := take(t, p, 1)
		finish(p, e[0], ms, false)
	}
	if p.Limit() != 3 {
		t.Fatalf("limit %d, want 3", p.Limit())
	}
}

func TestPacerAcquireWakesOnRelease(t *testing.T) {
	p := newPacer(1, -1, nil)
	e := take(t, p, 1)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	got := make(chan error, 1)
	go func() {
		_, err := p.acquire(ctx)
		got <- err
	}()
	finish(p, e[0], 0, false)
	if err := <-got; err != nil {
		t.Fatalf("acquire after a release: %v", err)
	}
}

// finish is a move ending: its pause learned, its slot freed.
func finish(p *pacer, epoch uint64, pause time.Duration, abortedInHandoff bool) {
	p.learn(epoch, pause, abortedInHandoff)
	p.release()
}

func canceled() context.Context {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	return ctx
}
