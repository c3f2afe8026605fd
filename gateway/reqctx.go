package gateway

import (
	"context"
	"time"
)

// reqContext is the context of a request of the gateway's own front end: its deadline is known
// at once, but the channel and timer of a real context are made only when something waits on
// Done (a hold, a refresh after a 421, a dial): a request on a pooled connection never does, so
// it costs no allocation. Only the request's goroutine uses it.
type reqContext struct {
	parent   context.Context
	deadline time.Time
	inner    context.Context
	cancel   context.CancelFunc
}

func (c *reqContext) Deadline() (time.Time, bool) { return c.deadline, true }

func (c *reqContext) Done() <-chan struct{} {
	if c.inner == nil {
		c.inner, c.cancel = context.WithDeadline(c.parent, c.deadline)
	}
	return c.inner.Done()
}

func (c *reqContext) Err() error {
	if c.inner != nil {
		return c.inner.Err()
	}
	if err := c.parent.Err(); err != nil {
		return err
	}
	if !time.Now().Before(c.deadline) {
		return context.DeadlineExceeded
	}
	return nil
}

func (c *reqContext) Value(key any) any { return c.parent.Value(key) }

// realContext returns a context that may have children (a dial, an attempt's timeout): the
// standard one behind a reqContext, made on first use; other contexts as they are. Children of a
// reqContext itself would be watched by goroutines of package context, which must not see it.
func realContext(ctx context.Context) context.Context {
	if c, ok := ctx.(*reqContext); ok {
		c.Done()
		return c.inner
	}
	return ctx
}

// end releases the timer of a context made by Done.
func (c *reqContext) end() {
	if c.cancel != nil {
		c.cancel()
	}
}
