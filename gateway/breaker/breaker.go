// Package breaker is the gateway's per-instance circuit breaker (the Queen coordinator): closed, open after a
// number of consecutive failures, half-open after a wait that doubles with every failed probe up
// to a maximum, closed again by a successful probe.
//
// The closed state costs one atomic load per request; only failures and state changes lock.
package breaker

import (
	"sync"
	"sync/atomic"
	"time"
)

// State is a breaker's state.
type State int32

const (
	Closed State = iota
	Open
	HalfOpen
)

func (s State) String() string {
	switch s {
	case Closed:
		return "closed"
	case Open:
		return "open"
	case HalfOpen:
		return "half-open"
	}
	return "unknown"
}

// Config sets a breaker's numbers. The zero value uses the Queen coordinator's: open after 3 consecutive
// failures, half-open after 5s, the wait doubling up to 5 minutes.
type Config struct {
	Failures int           // consecutive failures that open the circuit; default 3
	Wait     time.Duration // first wait before a probe; default 5s
	MaxWait  time.Duration // longest wait; default 5m
	// Now is the clock; default time.Now. Tests inject their own.
	Now func() time.Time
}

func (c Config) withDefaults() Config {
	if c.Failures <= 0 {
		c.Failures = 3
	}
	if c.Wait <= 0 {
		c.Wait = 5 * time.Second
	}
	if c.MaxWait <= 0 {
		c.MaxWait = 5 * time.Minute
	}
	if c.MaxWait < c.Wait {
		c.MaxWait = c.Wait
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	return c
}

// Breaker guards one instance. It is safe for concurrent use.
type Breaker struct {
	cfg Config

	state    atomic.Int32 // State
	failures atomic.Int32 // consecutive failures while closed

	mu       sync.Mutex
	until    time.Time     // open: when a probe may go
	wait     time.Duration // the current open period
	probing  bool          // half-open: a probe is out
	opened   atomic.Uint64 // times the circuit opened
	lastOpen time.Time
}

// New makes a closed breaker.
func New(cfg Config) *Breaker {
	b := &Breaker{cfg: cfg.withDefaults()}
	b.wait = b.cfg.Wait
	return b
}

// State is the breaker's state now (an open breaker whose wait is over reports half-open).
func (b *Breaker) State() State {
	st := State(b.state.Load())
	if st == Open {
		b.mu.Lock()
		defer b.mu.Unlock()
		if !b.cfg.Now().Before(b.until) {
			return HalfOpen
		}
	}
	return st
}

// Available reports, without side effects, whether Allow could say yes now.
func (b *Breaker) Available() bool {
	switch State(b.state.Load()) {
	case Closed:
		return true
	case Open:
		b.mu.Lock()
		defer b.mu.Unlock()
		return !b.cfg.Now().Before(b.until)
	default: // half-open
		b.mu.Lock()
		defer b.mu.Unlock()
		return !b.probing
	}
}

// Allow reports whether a request may go to the instance. In half-open it lets one probe through
// at a time; the caller must then report the probe's outcome with Success or Failure.
func (b *Breaker) Allow() bool {
	if State(b.state.Load()) == Closed {
		return true
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	switch State(b.state.Load()) {
	case Closed:
		return true
	case Open:
		if b.cfg.Now().Before(b.until) {
			return false
		}
		b.state.Store(int32(HalfOpen))
		b.probing = true
		return true
	default:
		if b.probing {
			return false
		}
		b.probing = true
		return true
	}
}

// Success records a successful call: it resets the failure count and closes a half-open circuit.
func (b *Breaker) Success() {
	if State(b.state.Load()) == Closed {
		if b.failures.Load() != 0 {
			b.failures.Store(0)
		}
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if State(b.state.Load()) == HalfOpen {
		b.state.Store(int32(Closed))
		b.failures.Store(0)
		b.probing = false
		b.wait = b.cfg.Wait
	}
}

// Failure records a failed call. It opens a closed circuit after Failures in a row, and reopens a
// half-open one with the wait doubled.
func (b *Breaker) Failure() {
	if State(b.state.Load()) == Closed {
		if b.failures.Add(1) < int32(b.cfg.Failures) {
			return
		}
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	now := b.cfg.Now()
	switch State(b.state.Load()) {
	case Closed:
		if b.failures.Load() < int32(b.cfg.Failures) {
			return
		}
		b.wait = b.cfg.Wait
	case HalfOpen:
		b.wait = min(2*b.wait, b.cfg.MaxWait)
		b.probing = false
	case Open:
		return // late failures of calls let through before it opened
	}
	b.state.Store(int32(Open))
	b.until = now.Add(b.wait)
	b.lastOpen = now
	b.opened.Add(1)
}

// Abandon returns a probe let through by Allow whose outcome is unknown (the client went away),
// so another probe may go.
func (b *Breaker) Abandon() {
	if State(b.state.Load()) == Closed {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if State(b.state.Load()) == HalfOpen {
		b.probing = false
	}
}

// Reset closes the circuit and forgets its failures and backoff: the instance it guards was
// replaced by a new process (the failures were the old one's).
func (b *Breaker) Reset() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.state.Store(int32(Closed))
	b.failures.Store(0)
	b.probing = false
	b.wait = b.cfg.Wait
	b.until = time.Time{}
}

// Snapshot describes a breaker for /admin/balance.
type Snapshot struct {
	State    string        `json:"state"`
	Failures int           `json:"failures"`
	Wait     time.Duration `json:"wait_ns,omitempty"`
	RetryAt  time.Time     `json:"retry_at,omitzero"`
	Opened   uint64        `json:"opened_total"`
}

// Snapshot returns the breaker's figures.
func (b *Breaker) Snapshot() Snapshot {
	st := b.State()
	b.mu.Lock()
	defer b.mu.Unlock()
	s := Snapshot{State: st.String(), Failures: int(b.failures.Load()), Opened: b.opened.Load()}
	if st != Closed {
		s.Wait, s.RetryAt = b.wait, b.until
	}
	return s
}
