// Package backoff holds the one retry loop and the one series of pauses the packages share: a
// pause that starts at Policy.Initial, doubles after each try up to Policy.Max, and is
// jittered (full jitter by default, so that writers that failed together do not try again
// together, as after a NATS leader election).
//
// Retry is the loop for a call made again while it fails (a NATS request during an election, a
// webhook); Pauses is the series alone, for loops that are not a simple retry (a follower that
// resumes, a poll for a revision).
package backoff

import (
	"context"
	"errors"
	"math/rand/v2"
	"time"

	"github.com/tenantmesh/tenantmesh/internal/ctxtime"
)

// Jitter says how much of each pause is random.
type Jitter uint8

const (
	// Full pauses for a uniformly random time in [0, d] (the default): spreads the tries of
	// callers that failed together the most.
	Full Jitter = iota
	// Half pauses for d/2 plus a random time in [0, d/2]: spread, but never much shorter.
	Half
	// None pauses for exactly d: for polling a local state, where nobody is competing.
	None
)

// Policy is how a caller tries again. Its zero value pauses 100 ms, doubling up to 5 s, with
// full jitter, and tries until ctx ends.
type Policy struct {
	// Initial is the pause after the first failed try (default 100 ms).
	Initial time.Duration
	// Max bounds a pause (default 5 s, and at least Initial).
	Max time.Duration
	// Jitter is how much of each pause is random (default Full).
	Jitter Jitter

	// Tries bounds the tries Retry makes (default 0: until ctx ends).
	Tries int
	// TryTimeout bounds Retry's first try; each later one gets twice the one before, at most
	// 4 x TryTimeout: a try whose answer was lost (a leader that stopped) costs little, and a
	// server too loaded to answer within the first bound still gets through. 0: tries are
	// bounded only by ctx.
	TryTimeout time.Duration
	// Detach makes Retry's tries run even after ctx has ended (context.WithoutCancel, still
	// bounded by TryTimeout), so the first try is always made; only the pauses end with ctx.
	Detach bool
	// RetryIf picks the errors worth another try (default: every error but a Permanent one).
	RetryIf func(error) bool
	// OnRetry, if set, is called before each pause with the try's error and the pause (to log
	// or count the retries).
	OnRetry func(err error, pause time.Duration)
}

const (
	defaultInitial = 100 * time.Millisecond
	defaultMax     = 5 * time.Second
)

// Pauses returns the series of pauses of p, from its first.
func (p Policy) Pauses() Pauses {
	if p.Initial <= 0 {
		p.Initial = defaultInitial
	}
	if p.Max <= 0 {
		p.Max = max(defaultMax, p.Initial)
	}
	p.Max = max(p.Max, p.Initial)
	return Pauses{initial: p.Initial, max: p.Max, jitter: p.Jitter, next: p.Initial}
}

// Pauses is a series of pauses: Initial, doubling up to Max, each jittered. Its zero value is
// not usable; get one from Policy.Pauses. It is a value without pointers, so a loop keeps it
// on its stack (or in a request's state) without allocating.
type Pauses struct {
	initial, max, next time.Duration
	jitter             Jitter
}

// Next returns the next pause (jittered) and doubles the one after it, up to Max.
func (s *Pauses) Next() time.Duration {
	d := s.next
	s.next = min(2*s.next, s.max)
	switch s.jitter {
	case Half:
		return d/2 + rand.N(d/2+1)
	case None:
		return d
	default:
		return rand.N(d + 1)
	}
}

// Reset starts the series again from Initial (after a success).
func (s *Pauses) Reset() { s.next = s.initial }

// Wait pauses for Next or until ctx ends; it reports whether the pause ran out.
func (s *Pauses) Wait(ctx context.Context) bool { return ctxtime.Sleep(ctx, s.Next()) }

// Retry calls op until it returns nil, an error p.RetryIf refuses (a Permanent one by
// default), p.Tries tries were made, or ctx ends (after a try, or during a pause), pausing
// between tries as p says. The first try is made whatever ctx's state; each is bounded as
// p.TryTimeout says. It returns op's last error (unwrapped from Permanent), or nil: a caller
// that must tell "ctx ended" apart checks ctx.Err().
func Retry(ctx context.Context, p Policy, op func(context.Context) error) error {
	pauses := p.Pauses()
	tryCtx, bound := ctx, p.TryTimeout
	if p.Detach {
		tryCtx = context.WithoutCancel(ctx)
	}
	for try := 1; ; try++ {
		err := call(tryCtx, bound, op)
		bound = min(2*bound, 4*p.TryTimeout)
		if err == nil {
			return nil
		}
		var perm *permanent
		if errors.As(err, &perm) {
			return perm.err
		}
		if (p.RetryIf != nil && !p.RetryIf(err)) || (p.Tries > 0 && try >= p.Tries) || ctx.Err() != nil {
			return err
		}
		d := pauses.Next()
		if p.OnRetry != nil {
			p.OnRetry(err, d)
		}
		if !ctxtime.Sleep(ctx, d) {
			return err
		}
	}
}

// call is op, bounded by bound if it is positive.
func call(ctx context.Context, bound time.Duration, op func(context.Context) error) error {
	if bound <= 0 {
		return op(ctx)
	}
	ctx, cancel := context.WithTimeout(ctx, bound)
	defer cancel()
	return op(ctx)
}

// Permanent marks err as not worth another try: Retry returns err at once.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &permanent{err}
}

type permanent struct{ err error }

func (p *permanent) Error() string { return p.err.Error() }
func (p *permanent) Unwrap() error { return p.err }
