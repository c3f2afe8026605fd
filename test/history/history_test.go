package history

import (
	"fmt"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"
)

// The checker tells a linearizable ledger history from one that lost a deposit, read a stale
// balance, or let a withdrawal through on a balance that was not there, and lets an operation
// whose answer never came take effect or not.
func TestModel(t *testing.T) {
	at := func(ms int) time.Time { return time.Unix(0, 0).Add(time.Duration(ms) * time.Millisecond) }
	dep := func(n int64) Input { return Input{Kind: Deposit, Tenant: "t", Account: "a", Amount: n} }
	wd := func(n int64) Input { return Input{Kind: Withdraw, Tenant: "t", Account: "a", Amount: n} }
	rd := Input{Kind: Read, Tenant: "t", Account: "a"}
	ok := Output{Known: true, OK: true}
	bal := func(n int64) Output { return Output{Known: true, OK: true, Balance: n} }
	type op struct {
		in        Input
		out       Output
		call, ret int
	}
	for _, tc := range []struct {
		name string
		ops  []op
		want porcupine.CheckResult
	}{
		{"sequential", []op{{dep(5), ok, 0, 1}, {rd, bal(5), 2, 3}, {wd(3), ok, 4, 5}, {rd, bal(2), 6, 7}}, porcupine.Ok},
		{"concurrent deposits", []op{{dep(5), ok, 0, 10}, {dep(3), ok, 1, 9}, {rd, bal(8), 11, 12}}, porcupine.Ok},
		{"a read during a deposit sees before or after", []op{{dep(5), ok, 0, 10}, {rd, bal(0), 1, 2}, {rd, bal(5), 3, 4}}, porcupine.Ok},
		{"a lost deposit", []op{{dep(5), ok, 0, 1}, {dep(3), ok, 2, 3}, {rd, bal(5), 4, 5}}, porcupine.Illegal},
		{"a stale read", []op{{dep(5), ok, 0, 1}, {rd, bal(0), 2, 3}}, porcupine.Illegal},
		{"a read going back", []op{{dep(5), ok, 0, 10}, {rd, bal(5), 1, 2}, {rd, bal(0), 3, 4}}, porcupine.Illegal},
		{"a withdrawal over the balance", []op{{dep(5), ok, 0, 1}, {wd(6), ok, 2, 3}}, porcupine.Illegal},
		{"a wrong rejection", []op{{dep(5), ok, 0, 1}, {wd(3), Output{Known: true}, 2, 3}}, porcupine.Illegal},
		{"an unknown deposit that happened", []op{{dep(5), Output{}, 0, 1}, {rd, bal(5), 2, 3}}, porcupine.Ok},
		{"an unknown deposit that did not", []op{{dep(5), Output{}, 0, 1}, {rd, bal(0), 2, 3}}, porcupine.Ok},
		{"a deposit applied twice", []op{{dep(5), ok, 0, 1}, {rd, bal(10), 2, 3}}, porcupine.Illegal},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := &Recorder{start: at(0)}
			for i, o := range tc.ops {
				r.Record(i, o.in, o.out, at(o.call), at(o.ret))
			}
			if got, err := r.Check(5*time.Second, ""); err != nil || got != tc.want {
				t.Fatalf("%s: %v (%v), want %s", tc.name, got, err, tc.want)
			}
		})
	}
}

// errRecorder is a testing.TB that keeps what Errorf reports.
type errRecorder struct {
	testing.TB
	errs []string
}

func (e *errRecorder) Helper()             {}
func (e *errRecorder) Logf(string, ...any) {}
func (e *errRecorder) Errorf(format string, a ...any) {
	e.errs = append(e.errs, fmt.Sprintf(format, a...))
}

// The receiver allows an effect delivered twice only when it was first delivered within a
// window a fault put in doubt, and never three times.
func TestReceiverInDoubt(t *testing.T) {
	deliver := func(r *Receiver, key string, times int) {
		for range times {
			req := httptest.NewRequest("POST", "/", strings.NewReader("{}"))
			req.Header.Set("Idempotency-Key", key)
			r.ServeHTTP(httptest.NewRecorder(), req)
		}
	}
	r := NewReceiver()
	deliver(r, "twice", 2)
	r.InDoubt(time.Now().Add(10*time.Second), time.Now().Add(20*time.Second))
	rec := &errRecorder{TB: t}
	if r.CheckOnce(rec, 1); len(rec.errs) != 1 || !strings.Contains(rec.errs[0], "twice delivered 2 times") {
		t.Fatalf("a repeat outside any window: %q", rec.errs)
	}

	r = NewReceiver()
	from := time.Now()
	deliver(r, "twice", 2)
	deliver(r, "thrice", 3)
	r.InDoubt(from, time.Now())
	deliver(r, "once", 1)
	rec = &errRecorder{TB: t}
	if r.CheckOnce(rec, 3); len(rec.errs) != 1 || !strings.Contains(rec.errs[0], "thrice delivered 3 times") {
		t.Fatalf("repeats within a window: %q", rec.errs)
	}
}
