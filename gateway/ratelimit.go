package gateway

import (
	"sync"
	"time"

	"golang.org/x/time/rate"
)

// tenantLimiter is a token bucket (golang.org/x/time/rate) per key (a tenant of one kind, a
// client). Buckets idle for a while are dropped by sweep, so memory follows the active keys.
type tenantLimiter struct {
	limit rate.Limit // tokens per second
	burst int
	m     sync.Map // key -> *rate.Limiter
}

func newTenantLimiter(perSecond float64, burst int) *tenantLimiter {
	return &tenantLimiter{limit: rate.Limit(perSecond), burst: max(burst, 1)}
}

// allow takes a token for key at now; if none is left it returns false and how long until one is.
func (l *tenantLimiter) allow(key string, now time.Time) (bool, time.Duration) {
	v, ok := l.m.Load(key)
	if !ok {
		v, _ = l.m.LoadOrStore(key, rate.NewLimiter(l.limit, l.burst))
	}
	lim := v.(*rate.Limiter)
	if lim.AllowN(now, 1) {
		return true, 0
	}
	return false, time.Duration((1 - lim.TokensAt(now)) / float64(l.limit) * float64(time.Second))
}

// empty reports whether key's bucket has no token left at now (without taking one).
func (l *tenantLimiter) empty(key string, now time.Time) bool {
	v, ok := l.m.Load(key)
	return ok && v.(*rate.Limiter).TokensAt(now) < 1
}

// sweep drops the buckets that have been full (idle) since before now-idle: full then, and no
// token taken since.
func (l *tenantLimiter) sweep(now time.Time, idle time.Duration) {
	cutoff := now.Add(-idle)
	l.m.Range(func(k, v any) bool {
		if v.(*rate.Limiter).TokensAt(cutoff) >= float64(l.burst) {
			l.m.Delete(k)
		}
		return true
	})
}
