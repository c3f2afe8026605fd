package tmtest

import (
	"fmt"
	"strings"
	"testing"
	"time"
)

type fatalRecorder struct {
	testing.TB
	msg string
}

func (f *fatalRecorder) Helper() {}
func (f *fatalRecorder) Fatalf(format string, args ...any) {
	f.msg = fmt.Sprintf(format, args...)
}

func TestWaitFor(t *testing.T) {
	n := 0
	WaitFor(t, time.Second, func() error {
		if n++; n < 3 {
			return fmt.Errorf("attempt %d", n)
		}
		return nil
	})
	if n != 3 {
		t.Fatalf("cond ran %d times, want 3", n)
	}
	// A timeout says what was still missing.
	rec := &fatalRecorder{TB: t}
	WaitFor(rec, 20*time.Millisecond, Until("the gateway to see 3 instances", func() bool { return false }))
	if !strings.Contains(rec.msg, "the gateway to see 3 instances: not yet") {
		t.Fatalf("timeout message %q does not say what it waited for", rec.msg)
	}
}

// cleanupRecorder keeps a test's cleanups and errors for the test to run and read.
type cleanupRecorder struct {
	testing.TB
	cleanups []func()
	errs     []string
}

func (c *cleanupRecorder) Helper()          {}
func (c *cleanupRecorder) Failed() bool     { return false }
func (c *cleanupRecorder) Cleanup(f func()) { c.cleanups = append(c.cleanups, f) }
func (c *cleanupRecorder) Errorf(format string, args ...any) {
	c.errs = append(c.errs, fmt.Sprintf(format, args...))
}

// A goroutine the test started and did not stop is reported; one it stopped is not.
func TestResourceCheck(t *testing.T) {
	defer func(d time.Duration) { leakWait = d }(leakWait)
	leakWait = 100 * time.Millisecond
	for _, stop := range []bool{false, true} {
		rec := &cleanupRecorder{TB: t}
		ResourceCheck(rec)
		release := make(chan struct{})
		done := make(chan struct{})
		go func() { defer close(done); <-release }()
		if stop {
			close(release)
			<-done
		}
		for _, f := range rec.cleanups {
			f()
		}
		if leaked := len(rec.errs) > 0 && strings.Contains(rec.errs[0], "TestResourceCheck"); leaked == stop {
			t.Errorf("stopped %v: reported %q", stop, rec.errs)
		}
		if !stop {
			close(release)
			<-done
		}
	}
}
