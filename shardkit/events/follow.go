package events

import (
	"context"
	"fmt"
	"time"

	"github.com/tenantmesh/tenantmesh/shardkit/jsx"
)

// followFor bounds how long a warmed target keeps following a tenant it does not own yet.
const followFor = 5 * time.Minute

// follow keeps a move target's copy of a tenant current with the stream from the moment it is
// warm until it takes its first command (or is released, or followFor passes): at handoff the
// source's fence is then usually applied already, so the target reports ready without a
// replay on the cutover's critical path. Caller holds ts.mu.
func (l *Log[S]) follow(ts *tenant[S]) {
	if ts.unfollow != nil {
		return
	}
	l.mu.Lock()
	base := l.base
	if base != nil {
		l.follows.Add(1)
	}
	l.mu.Unlock()
	if base == nil {
		return // Run is not running: Warm catches up by polling instead
	}
	ctx, cancel := context.WithTimeout(base, followFor)
	token := new(int)
	ts.unfollow, ts.followToken = cancel, token
	from := ts.contig
	go func() {
		defer l.follows.Done()
		defer cancel()
		err := l.tail(ctx, ts, from)
		ts.mu.Lock()
		if ts.followToken == token {
			ts.unfollow, ts.followToken = nil, nil
		}
		ts.mu.Unlock()
		if err != nil && ctx.Err() == nil {
			l.cfg.Logger.Warn("following a warmed tenant stopped; warm-up polls instead", "tenant", ts.name, "err", err)
		}
	}()
}

// stopFollow stops ts's follow, if any. Caller holds ts.mu.
func (ts *tenant[S]) stopFollow() {
	if ts.unfollow != nil {
		ts.unfollow()
		ts.unfollow, ts.followToken = nil, nil
	}
}

// tail applies the tenant's events after sequence from as they are stored, until ctx ends.
func (l *Log[S]) tail(ctx context.Context, ts *tenant[S], from uint64) error {
	r, err := jsx.Read(ctx, l.es.js, l.es.name, jsx.ReadConfig{Filters: []string{l.es.tenantFilter(ts.name)}, Start: from + 1, Logger: l.cfg.Logger})
	if err != nil {
		return err
	}
	defer r.Stop()
	for {
		m, md, err := r.Next(ctx)
		if err != nil {
			return err
		}
		if err := CheckFormat(m.Headers()); err != nil {
			return fmt.Errorf("tail of %s at %d: %w", ts.name, md.Sequence.Stream, err)
		}
		ev := l.es.decode(ts.name, m, md.Sequence.Stream)
		ts.mu.Lock()
		err = ts.add(ev)
		// The consumer delivers every event of the tenant after from, in order.
		ts.contig = max(ts.contig, ev.Seq)
		close(ts.advanced)
		ts.advanced = make(chan struct{})
		ts.mu.Unlock()
		if err != nil {
			return err
		}
	}
}
