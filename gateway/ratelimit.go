package gateway

import (
	"sync"
	"time"
)

// tenantLimiter is a token bucket per tenant for one kind. Buckets idle for a while are dropped
// by sweep, so memory follows the active tenants.
type tenantLimiter struct {
	rate  float64 // tokens per second
	burst float64
	m     sync.Map // tenant -> *bucket
}

type bucket struct {
	mu     sync.Mutex
	tokens float64
	last   time.Time
}

func newTenantLimiter(perSecond float64, burst int) *tenantLimiter {
	return &tenantLimiter{rate: perSecond, burst: float64(max(burst, 1))}
}

// allow takes a token for tenant at now; if none is left it returns false and how long until one is.
func (l *tenantLimiter) allow(tenant string, now time.Time) (bool, time.Duration) {
	v, ok := l.m.Load(tenant)
	if !ok {
		v, _ = l.m.LoadOrStore(tenant, &bucket{tokens: l.burst, last: now})
	}
	b := v.(*bucket)
	b.mu.Lock()
	defer b.mu.Unlock()
	if el := now.Sub(b.last); el > 0 {
		b.tokens = min(l.burst, b.tokens+el.Seconds()*l.rate)
		b.last = now
	}
	if b.tokens >= 1 {
		b.tokens--
		return true, 0
	}
	return false, time.Duration((1 - b.tokens) / l.rate * float64(time.Second))
}

// empty reports whether key's bucket has no token left at now (without taking one).
func (l *tenantLimiter) empty(key string, now time.Time) bool {
	v, ok := l.m.Load(key)
	if !ok {
		return false
	}
	b := v.(*bucket)
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.tokens+now.Sub(b.last).Seconds()*l.rate < 1
}

// sweep drops buckets that have been full (idle) since before cutoff.
func (l *tenantLimiter) sweep(now time.Time, idle time.Duration) {
	l.m.Range(func(k, v any) bool {
		b := v.(*bucket)
		b.mu.Lock()
		full := b.tokens+now.Sub(b.last).Seconds()*l.rate >= l.burst && now.Sub(b.last) > idle
		b.mu.Unlock()
		if full {
			l.m.Delete(k)
		}
		return true
	})
}
