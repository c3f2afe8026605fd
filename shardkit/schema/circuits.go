package schema

import (
	"encoding/json"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"
)

// Circuit telemetry: each gateway publishes, about every few seconds on tm.circuit.<gateway>,
// the instances whose circuit breaker is not closed in its view, so the rebalancer can show an
// instance's circuit as the gateways see it. Core NATS, lossy like load telemetry.
const (
	subjectCircuitPrefix = "tm.circuit."
	// SubjectCircuitAll matches every gateway's circuit report.
	SubjectCircuitAll = "tm.circuit.>"
)

// MaxCircuitReport bounds the circuits one report lists (the rest are counted in Omitted).
const MaxCircuitReport = 256

// CircuitReport is one gateway's view of the circuits it does not hold closed; an instance it
// does not list is closed (or unknown) in its view.
type CircuitReport struct {
	Gateway  string         `json:"gateway"`
	Time     time.Time      `json:"time"`
	Circuits []CircuitState `json:"circuits,omitempty"`
	Omitted  int            `json:"omitted,omitempty"`
}

// CircuitState is one instance's breaker in one gateway's view.
type CircuitState struct {
	Instance  string    `json:"instance"` // instance key
	State     string    `json:"state"`    // open, half-open
	Failures  int       `json:"failures"`
	OpenUntil time.Time `json:"open_until,omitzero"`
}

// PublishCircuits sends a gateway's circuit report (core NATS, no acknowledgement).
func (s *Store) PublishCircuits(r CircuitReport) error {
	if err := CheckName("gateway", r.Gateway); err != nil {
		return err
	}
	if r.Time.IsZero() {
		r.Time = time.Now().UTC()
	}
	if n := len(r.Circuits); n > MaxCircuitReport {
		r.Circuits, r.Omitted = r.Circuits[:MaxCircuitReport], r.Omitted+n-MaxCircuitReport
	}
	b, err := json.Marshal(r)
	if err != nil {
		return fmt.Errorf("schema: encode circuit report: %w", err)
	}
	return s.js.Conn().Publish(subjectCircuitPrefix+r.Gateway, b)
}

// SubscribeCircuits calls fn with every gateway's circuit reports; corrupt ones are skipped.
func (s *Store) SubscribeCircuits(fn func(CircuitReport)) (*nats.Subscription, error) {
	sub, err := s.js.Conn().Subscribe(SubjectCircuitAll, func(m *nats.Msg) {
		var r CircuitReport
		if err := json.Unmarshal(m.Data, &r); err != nil {
			s.opts.Logger.Warn("skipping corrupt circuit report", "subject", m.Subject, "err", err)
			return
		}
		fn(r)
	})
	if err != nil {
		return nil, fmt.Errorf("schema: subscribe %s: %w", SubjectCircuitAll, err)
	}
	return sub, nil
}
