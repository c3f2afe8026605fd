package promreg

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// Two instances' collectors on one registry: both count into the registered series.
func TestSecondRegistrationSharesTheSeries(t *testing.T) {
	reg := prometheus.NewRegistry()
	newCounter := func() prometheus.Counter {
		return prometheus.NewCounter(prometheus.CounterOpts{Name: "tm_test_total", Help: "test"})
	}
	a := Register(reg, newCounter())
	b := Register(reg, newCounter())
	a.Inc()
	b.Inc()
	if got := testutil.ToFloat64(a); got != 2 {
		t.Fatalf("registered series has %v, want 2 (both instances)", got)
	}
	if Register[prometheus.Counter](nil, newCounter()) == nil {
		t.Fatal("nil registry returned nil")
	}
	defer func() {
		if recover() == nil {
			t.Error("a name reused with other labels did not panic")
		}
	}()
	Register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{Name: "tm_test_total", Help: "test"}, []string{"x"}))
}
