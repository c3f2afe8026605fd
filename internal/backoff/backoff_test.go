package backoff

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"
)

var errBusy = errors.New("busy")

func TestPausesDouble(t *testing.T) {
	tests := []struct {
		name   string
		policy Policy
		want   []time.Duration
	}{
		{"doubling to max", Policy{Initial: 10, Max: 50, Jitter: None}, []time.Duration{10, 20, 40, 50, 50}},
		{"max below initial", Policy{Initial: 10, Max: 5, Jitter: None}, []time.Duration{10, 10, 10}},
		{"defaults", Policy{Jitter: None}, []time.Duration{100 * time.Millisecond, 200 * time.Millisecond, 400 * time.Millisecond,
			800 * time.Millisecond, 1600 * time.Millisecond, 3200 * time.Millisecond, 5 * time.Second, 5 * time.Second}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := tt.policy.Pauses()
			var got []time.Duration
			for range tt.want {
				got = append(got, s.Next())
			}
			if !slices.Equal(got, tt.want) {
				t.Errorf("pauses %v, want %v", got, tt.want)
			}
			s.Reset()
			if d := s.Next(); d != tt.want[0] {
				t.Errorf("after Reset: %v, want %v", d, tt.want[0])
			}
		})
	}
}

func TestJitterBounds(t *testing.T) {
	for _, tt := range []struct {
		j      Jitter
		lo, hi time.Duration // of a pause of 1000
	}{{Full, 0, 1000}, {Half, 500, 1000}, {None, 1000, 1000}} {
		seen := map[time.Duration]bool{}
		for range 1000 {
			s := Policy{Initial: 1000, Jitter: tt.j}.Pauses()
			d := s.Next()
			if d < tt.lo || d > tt.hi {
				t.Fatalf("jitter %d: pause %v outside [%v, %v]", tt.j, d, tt.lo, tt.hi)
			}
			seen[d] = true
		}
		if tt.lo != tt.hi && len(seen) < 10 {
			t.Errorf("jitter %d: only %d distinct pauses of 1000", tt.j, len(seen))
		}
	}
}

func TestRetry(t *testing.T) {
	ctx := context.Background()
	tests := []struct {
		name      string
		policy    Policy
		fails     int   // tries that fail before one succeeds
		failWith  error // what they fail with
		wantTries int
		wantErr   error
	}{
		{"succeeds at once", Policy{}, 0, errBusy, 1, nil},
		{"succeeds after failures", Policy{Initial: 1, Max: 4}, 5, errBusy, 6, nil},
		{"permanent stops", Policy{Initial: 1}, 5, Permanent(errBusy), 1, errBusy},
		{"retryIf refuses", Policy{Initial: 1, RetryIf: func(err error) bool { return false }}, 5, errBusy, 1, errBusy},
		{"tries bound", Policy{Initial: 1, Tries: 3}, 5, errBusy, 3, errBusy},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tries, retries := 0, 0
			tt.policy.OnRetry = func(err error, _ time.Duration) { retries++ }
			err := Retry(ctx, tt.policy, func(context.Context) error {
				tries++
				if tries <= tt.fails {
					return tt.failWith
				}
				return nil
			})
			if !errors.Is(err, tt.wantErr) || (tt.wantErr == nil) != (err == nil) {
				t.Errorf("err %v, want %v", err, tt.wantErr)
			}
			if _, ok := err.(*permanent); ok {
				t.Error("Retry returned the Permanent wrapper")
			}
			if tries != tt.wantTries || retries != tries-1 && err == nil {
				t.Errorf("%d tries, %d retries; want %d tries", tries, retries, tt.wantTries)
			}
		})
	}
}

func TestRetryCtx(t *testing.T) {
	t.Run("ended ctx: one try, its error", func(t *testing.T) {
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		tries := 0
		err := Retry(ctx, Policy{Initial: time.Hour}, func(context.Context) error { tries++; return errBusy })
		if tries != 1 || !errors.Is(err, errBusy) {
			t.Errorf("%d tries, err %v", tries, err)
		}
	})
	t.Run("ctx ends during a pause", func(t *testing.T) {
		ctx, cancel := context.WithCancel(context.Background())
		tries := 0
		p := Policy{Initial: time.Hour, OnRetry: func(error, time.Duration) { cancel() }}
		err := Retry(ctx, p, func(context.Context) error { tries++; return errBusy })
		if tries != 1 || !errors.Is(err, errBusy) {
			t.Errorf("%d tries, err %v", tries, err)
		}
	})
	t.Run("detached tries run after ctx ended", func(t *testing.T) {
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		var tryErr error
		_ = Retry(ctx, Policy{Detach: true, TryTimeout: time.Hour}, func(ctx context.Context) error {
			tryErr = ctx.Err()
			return nil
		})
		if tryErr != nil {
			t.Errorf("a detached try saw %v", tryErr)
		}
	})
}

func TestRetryTryTimeout(t *testing.T) {
	var bounds []time.Duration
	start := time.Now()
	err := Retry(context.Background(), Policy{Initial: 1, Tries: 5, TryTimeout: time.Hour}, func(ctx context.Context) error {
		dl, ok := ctx.Deadline()
		if !ok {
			t.Fatal("a try without a deadline")
		}
		bounds = append(bounds, dl.Sub(start).Round(time.Hour)/time.Hour)
		return errBusy
	})
	if !errors.Is(err, errBusy) {
		t.Fatal(err)
	}
	if want := []time.Duration{1, 2, 4, 4, 4}; !slices.Equal(bounds, want) {
		t.Errorf("try bounds %v hours, want %v", bounds, want)
	}
}

func TestPausesWait(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	s := Policy{Initial: 1, Jitter: None}.Pauses()
	if !s.Wait(ctx) {
		t.Error("a pause that ran out reported false")
	}
	cancel()
	s = Policy{Initial: time.Hour}.Pauses()
	if s.Wait(ctx) {
		t.Error("a cancelled pause reported true")
	}
}
