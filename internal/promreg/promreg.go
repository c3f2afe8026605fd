// Package promreg registers Prometheus collectors the one way tenantmesh does: a collector
// already registered (a second instance, shard or watcher on the same registry) is not an error,
// and the caller gets the registered one back, so both report into the same series.
package promreg

import (
	"errors"

	"github.com/prometheus/client_golang/prometheus"
)

// Register registers c with reg and returns the collector now registered under its
// descriptors: c, or the equal one registered before. A nil reg registers nothing and returns
// c. Any other registration error (a name reused with other labels) is a programming error and
// panics.
func Register[C prometheus.Collector](reg prometheus.Registerer, c C) C {
	if reg == nil {
		return c
	}
	err := reg.Register(c)
	if err == nil {
		return c
	}
	var are prometheus.AlreadyRegisteredError
	if errors.As(err, &are) {
		if existing, ok := are.ExistingCollector.(C); ok {
			return existing
		}
		return c // registered before with another Go type: it keeps reporting there
	}
	panic(err)
}
