package runner

import "time"

// limiter spaces starts evenly at perMinute, with a burst of one second's worth (GCRA).
type limiter struct {
	interval time.Duration
	burst    time.Duration // tolerance: (burst-1) intervals
	tat      time.Time     // theoretical arrival time of the next start
}

func newLimiter(perMinute int) *limiter {
	l := &limiter{}
	l.setRate(perMinute)
	return l
}

// setRate changes the rate, keeping the starts already taken.
func (l *limiter) setRate(perMinute int) {
	perMinute = max(perMinute, 1)
	l.interval = time.Minute / time.Duration(perMinute)
	l.burst = time.Duration(max(perMinute/60, 1)-1) * l.interval
}

// wait is how long until a start is allowed (0: now).
func (l *limiter) wait(now time.Time) time.Duration {
	if !l.tat.After(now) {
		return 0
	}
	if d := l.tat.Sub(now) - l.burst; d > 0 {
		return d
	}
	return 0
}

// refund gives back the last start taken.
func (l *limiter) refund() { l.tat = l.tat.Add(-l.interval) }

func (l *limiter) take(now time.Time) {
	if l.tat.Before(now) {
		l.tat = now
	}
	l.tat = l.tat.Add(l.interval)
}
