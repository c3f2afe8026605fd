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
