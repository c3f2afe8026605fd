package breaker

import (
	"testing"
	"time"
)

type clock struct{ t time.Time }

func (c *clock) now() time.Time { return c.t }

func TestBreakerLifecycle(t *testing.T) {
	c := &clock{t: time.Unix(1000, 0)}
	b := New(Config{Now: c.now})
	for i := range 2 {
		if !b.Allow() {
			t.Fatalf("closed breaker refused call %d", i)
		}
		b.Failure()
	}
	if b.State() != Closed {
		t.Fatalf("state after 2 failures = %v, want closed", b.State())
	}
	b.Success() // resets the count
	for range 3 {
		b.Failure()
	}
	if b.State() != Open || b.Allow() {
		t.Fatalf("after 3 failures: state %v, want open and refusing", b.State())
	}
	// Half-open after 5s, one probe at a time.
	waits := []time.Duration{5 * time.Second, 10 * time.Second, 20 * time.Second, 40 * time.Second,
		80 * time.Second, 160 * time.Second, 5 * time.Minute, 5 * time.Minute}
	for i, w := range waits {
		c.t = c.t.Add(w - time.Millisecond)
		if b.Allow() {
			t.Fatalf("round %d: probe allowed before %v", i, w)
		}
		c.t = c.t.Add(time.Millisecond)
		if b.State() != HalfOpen {
			t.Fatalf("round %d: state %v after %v, want half-open", i, b.State(), w)
		}
		if !b.Allow() {
			t.Fatalf("round %d: probe refused after %v", i, w)
		}
		if b.Allow() {
			t.Fatalf("round %d: second concurrent probe allowed", i)
		}
		b.Failure() // probe fails: reopen with the wait doubled (capped at 5m)
		if b.State() != Open {
			t.Fatalf("round %d: failed probe left state %v", i, b.State())
		}
	}
	c.t = c.t.Add(5 * time.Minute)
	if !b.Allow() {
		t.Fatal("probe refused after the capped wait")
	}
	b.Success()
	if b.State() != Closed || !b.Allow() {
		t.Fatalf("successful probe left state %v", b.State())
	}
	// The wait starts over at 5s after closing.
	for range 3 {
		b.Failure()
	}
	c.t = c.t.Add(5 * time.Second)
	if !b.Allow() {
		t.Fatal("wait did not reset to 5s after the circuit closed")
	}
	if s := b.Snapshot(); s.Opened != 10 || s.State != "half-open" {
		t.Fatalf("snapshot = %+v", s)
	}
}
