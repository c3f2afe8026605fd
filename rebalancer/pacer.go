package rebalancer

import (
	"context"
	"sync"
	"time"
)

// startLimit is how many moves a paced apply starts with before its pauses have said anything.
const startLimit = 4

// pacer bounds how many of a plan's moves run at once. Without a pause budget that is the
// plan's concurrency. With one, the limit follows the pauses the moves report, as TCP's window
// follows losses: it starts at startLimit, grows by one with every move whose pause (handoff
// -> commit, the time the gateways hold the tenant's requests) kept within half the budget
// until the first that did not (slow start), then by 1/limit per move (about one per round of
// moves); a move over half the budget, or aborted during its handoff, halves it. Half, because
// the moves already in their handoffs when the limit is cut still finish at the old pace: the
// cut must come before the pauses reach the budget for the tail to stay within it. Only moves
// started since the last cut can cut again, so one slow spell halves the limit once. The limit
// never exceeds the plan's concurrency and never falls below 1: a plan always progresses, just
// more slowly on a loaded platform.
//
// A plan's pauses are what its tenants feel; how fast it finishes is not. On a machine the
// moves themselves saturate, 50 moves at once turn a 20 ms pause into 100-900 ms (docs/scale.md).
type pacer struct {
	max    int
	budget time.Duration // <= 0: no pacing, the limit is max
	onCut  func(limit int, pause time.Duration)

	mu      sync.Mutex
	limit   float64
	slow    bool   // in slow start
	running int    // moves holding a slot
	epoch   uint64 // bumped by each cut
	wake    chan struct{}
}

func newPacer(max int, budget time.Duration, onCut func(limit int, pause time.Duration)) *pacer {
	p := &pacer{max: max, budget: budget, onCut: onCut, limit: float64(max), wake: make(chan struct{})}
	if budget > 0 {
		p.limit, p.slow = float64(min(max, startLimit)), true
	}
	return p
}

// Limit is how many moves may run at once now.
func (p *pacer) Limit() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return int(p.limit)
}

// acquire waits for a slot, or for ctx to end. It returns the epoch the move starts in, for
// release.
func (p *pacer) acquire(ctx context.Context) (uint64, error) {
	for {
		p.mu.Lock()
		if p.running < int(p.limit) {
			p.running++
			e := p.epoch
			p.mu.Unlock()
			return e, nil
		}
		wake := p.wake
		p.mu.Unlock()
		select {
		case <-ctx.Done():
			return 0, ctx.Err()
		case <-wake:
		}
	}
}

// release frees a move's slot.
func (p *pacer) release() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.running--
	p.wakeLocked()
}

func (p *pacer) wakeLocked() {
	close(p.wake)
	p.wake = make(chan struct{})
}

// learn takes in how a move's handoff went, as soon as it is known (at the commit, not when
// the source has drained): pause is its handoff -> commit (0 when it never committed),
// abortedInHandoff whether it was aborted after holding the tenant's requests. epoch is what
// acquire returned for the move.
func (p *pacer) learn(epoch uint64, pause time.Duration, abortedInHandoff bool) {
	if p.budget <= 0 {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	defer p.wakeLocked()
	switch {
	case pause > p.budget/2 || abortedInHandoff:
		if epoch != p.epoch {
			return // started before the last cut: that cut already answered this spell
		}
		p.limit, p.slow = max(1, float64(int(p.limit)/2)), false
		p.epoch++
		if p.onCut != nil {
			p.onCut(int(p.limit), pause)
		}
	case pause > 0:
		if p.slow {
			p.limit++
		} else {
			p.limit += 1 / p.limit
		}
		p.limit = min(p.limit, float64(p.max))
	}
}
