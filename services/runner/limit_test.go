package runner

import (
	"testing"
	"time"
)

func TestLimiter(t *testing.T) {
	t0 := time.Unix(1000, 0)
	tests := []struct {
		name      string
		perMinute int
		// starts taken at t0, then the wait for the next one
		starts int
		want   time.Duration
	}{
		{"fresh", 60, 0, 0},
		{"one a second, one taken", 60, 1, time.Second},
		{"burst of a second's worth", 600, 10, 100 * time.Millisecond},
		{"inside the burst", 600, 9, 0},
		{"below one a minute is one a minute", 0, 1, time.Minute},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			l := newLimiter(tt.perMinute)
			for range tt.starts {
				if w := l.wait(t0); w != 0 {
					t.Fatalf("wait inside the burst: %v", w)
				}
				l.take(t0)
			}
			if got := l.wait(t0); got != tt.want {
				t.Fatalf("wait = %v, want %v", got, tt.want)
			}
		})
	}
	t.Run("refund", func(t *testing.T) {
		l := newLimiter(60)
		l.take(t0)
		l.refund()
		if w := l.wait(t0); w != 0 {
			t.Fatalf("after a refund: wait %v", w)
		}
	})
	t.Run("steady", func(t *testing.T) {
		l := newLimiter(120) // 2/s, burst 2
		now, n := t0, 0
		for now.Before(t0.Add(10 * time.Second)) {
			if w := l.wait(now); w > 0 {
				now = now.Add(w)
				continue
			}
			l.take(now)
			n++
		}
		if n > 2+20 || n < 20 {
			t.Fatalf("%d starts in 10s at 2/s with a burst of 2", n)
		}
	})
}
