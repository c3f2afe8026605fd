package runner

import (
	"time"

	"golang.org/x/time/rate"
)

// limiter spaces starts at perMinute, with a burst of one second's worth: a token bucket
// (golang.org/x/time/rate) asked how long until a start is allowed (wait) before one is taken
// (take), and given back when the start did not happen (refund).
type limiter struct {
	lim      *rate.Limiter
	interval time.Duration // between starts at the steady rate
}

func newLimiter(perMinute int) *limiter {
	interval, burst := limits(perMinute)
	return &limiter{lim: rate.NewLimiter(rate.Every(interval), burst), interval: interval}
}

// limits are the interval between starts and the burst of perMinute (at least one a minute).
func limits(perMinute int) (time.Duration, int) {
	perMinute = max(perMinute, 1)
	return time.Minute / time.Duration(perMinute), max(perMinute/60, 1)
}

// setRate changes the rate, keeping the starts already taken.
func (l *limiter) setRate(perMinute int) {
	now := time.Now()
	interval, burst := limits(perMinute)
	l.interval = interval
	l.lim.SetLimitAt(now, rate.Every(interval))
	l.lim.SetBurstAt(now, burst)
}

// wait is how long until a start is allowed (0: now).
func (l *limiter) wait(now time.Time) time.Duration {
	if t := l.lim.TokensAt(now); t < 1 {
		return time.Duration((1 - t) * float64(l.interval))
	}
	return 0
}

// refund gives back the last start taken.
func (l *limiter) refund() { l.lim.ReserveN(time.Now(), -1) }

// take takes a start at now, allowed or not (see wait).
func (l *limiter) take(now time.Time) { l.lim.ReserveN(now, 1) }
