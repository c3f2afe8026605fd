package schema

import (
	"encoding/json"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"
)

// LoadReport is an instance's telemetry, published about once a second on tm.load.<kind>.
// <shard>.<instance>. It is lossy by design: readers keep the newest report per instance.
type LoadReport struct {
	InstanceID
	Time time.Time `json:"time"`
	// InFlight is requests being served now (the Queen coordinator's outstanding).
	InFlight int `json:"in_flight"`
	// Queued is work waiting (the Queen coordinator's poll intentions; runner: queued jobs).
	Queued     int     `json:"queued"`
	RatePerSec float64 `json:"rate_per_sec"`
	// LatencyMS is the mean request latency over the last interval.
	LatencyMS float64 `json:"latency_ms"`
	ErrorRate float64 `json:"error_rate"`
	// CPU is the process's CPU use in percent of one core.
	CPU float64 `json:"cpu"`
	// Capacity is the number of tenants the instance can host; Tenants how many it hosts.
	Capacity int `json:"capacity"`
	Tenants  int `json:"tenants"`
	// Top is the busiest tenants, by rate, at most a few dozen.
	Top []TenantLoad `json:"top,omitempty"`
	// Runs are the instance's most recent job runs, newest first, at most MaxReportRuns (the
	// runner; the multi-host design's recent job runs of a host).
	Runs []RunSummary `json:"runs,omitempty"`
	// Consumers are the affinity keys this instance has consumers waiting for, most waiting
	// first, at most MaxReportConsumers (producer routes: see ProducerRoute).
	Consumers []ConsumerPresence `json:"consumers,omitempty"`
}

// MaxReportRuns bounds LoadReport.Runs.
const MaxReportRuns = 20

// RunSummary is one job run as an instance's telemetry shows it.
type RunSummary struct {
	ID       string     `json:"id"`
	Tenant   string     `json:"tenant"`
	Type     string     `json:"type"`
	Status   string     `json:"status"`
	Attempts int        `json:"attempts"`
	Started  *time.Time `json:"started_at,omitempty"`
	Finished *time.Time `json:"finished_at,omitempty"`
	Error    string     `json:"error,omitempty"`
}

// TenantLoad is one tenant's figures in a LoadReport.
type TenantLoad struct {
	Tenant     string  `json:"tenant"`
	RatePerSec float64 `json:"rate_per_sec"`
	InFlight   int     `json:"in_flight"`
	Errors     uint64  `json:"errors"`
}

// PublishLoad sends a report on its instance's subject (core NATS, no acknowledgement).
func (s *Store) PublishLoad(r LoadReport) error {
	if err := r.InstanceID.Check(); err != nil {
		return err
	}
	if r.Time.IsZero() {
		r.Time = time.Now().UTC()
	}
	b, err := json.Marshal(r)
	if err != nil {
		return fmt.Errorf("schema: encode load report: %w", err)
	}
	return s.js.Conn().Publish(LoadSubject(r.InstanceID), b)
}

// SubscribeLoad calls fn with every load report of kind ("" for all kinds). Corrupt reports are
// skipped. Unsubscribe the returned subscription to stop.
func (s *Store) SubscribeLoad(kind string, fn func(LoadReport)) (*nats.Subscription, error) {
	subj := SubjectLoadAll
	if kind != "" {
		if err := CheckName("kind", kind); err != nil {
			return nil, err
		}
		subj = LoadSubjectKind(kind)
	}
	sub, err := s.js.Conn().Subscribe(subj, func(m *nats.Msg) {
		var r LoadReport
		if err := json.Unmarshal(m.Data, &r); err != nil {
			s.opts.Logger.Warn("skipping corrupt load report", "subject", m.Subject, "err", err)
			return
		}
		fn(r)
	})
	if err != nil {
		return nil, fmt.Errorf("schema: subscribe %s: %w", subj, err)
	}
	return sub, nil
}
