package shardkit

import (
	"cmp"
	"slices"
	"sync"

	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// consumerKey is one affinity key consumers wait for.
type consumerKey struct{ queue, group string }

// consumers counts the consumers waiting on this instance per affinity key.
type consumers struct {
	mu sync.Mutex
	n  map[consumerKey]int
}

// Waiting records a consumer waiting on this instance for queue (and group; "" when it waits for
// the queue as a whole), until the returned func is called (once; more calls do nothing). Load
// reports carry the counts, so gateways send a producer route's requests for that key here,
// where the consumer is notified locally (the Queen coordinator's producer routing).
func (s *Shard) Waiting(queue, group string) (done func()) {
	k := consumerKey{queue, group}
	c := &s.consumers
	c.mu.Lock()
	if c.n == nil {
		c.n = map[consumerKey]int{}
	}
	c.n[k]++
	c.mu.Unlock()
	var once sync.Once
	return func() {
		once.Do(func() {
			c.mu.Lock()
			defer c.mu.Unlock()
			if c.n[k]--; c.n[k] <= 0 {
				delete(c.n, k)
			}
		})
	}
}

// report is the keys with the most waiting consumers, at most schema.MaxReportConsumers.
func (c *consumers) report() []schema.ConsumerPresence {
	c.mu.Lock()
	if len(c.n) == 0 {
		c.mu.Unlock()
		return nil
	}
	out := make([]schema.ConsumerPresence, 0, len(c.n))
	for k, n := range c.n {
		out = append(out, schema.ConsumerPresence{Queue: k.queue, Group: k.group, Waiting: n})
	}
	c.mu.Unlock()
	slices.SortFunc(out, func(a, b schema.ConsumerPresence) int {
		if d := cmp.Compare(b.Waiting, a.Waiting); d != 0 {
			return d
		}
		if d := cmp.Compare(a.Queue, b.Queue); d != 0 {
			return d
		}
		return cmp.Compare(a.Group, b.Group)
	})
	if len(out) > schema.MaxReportConsumers {
		out = out[:schema.MaxReportConsumers]
	}
	return out
}
