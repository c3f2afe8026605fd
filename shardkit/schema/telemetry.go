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
	// MemBytes is the process's resident memory, MemPercent that share of the machine's RAM;
	// DiskPercent how full the instance's disk is and DiskFreeBytes what is left on it (the
	// multi-host design's last CPU/RAM/disk). 0: not measured.
	MemBytes      uint64  `json:"mem_bytes,omitempty"`
	MemPercent    float64 `json:"mem_percent,omitempty"`
	DiskPercent   float64 `json:"disk_percent,omitempty"`
	DiskFreeBytes uint64  `json:"disk_free_bytes,omitempty"`
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
	// StoredBytes is the sum of Bytes over every tenant the instance hosts; Sizes the largest
	// of them (by bytes, then depth), as many as Top.
	StoredBytes uint64       `json:"stored_bytes,omitempty"`
	Sizes       []TenantSize `json:"sizes,omitempty"`
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

// TenantSize is a tenant's stored state as its owning instance measures it (the Cloudlysis
// PRD's "storage size per tenant"), for every kind: events (aggregate), views (projection),
// queue, outbox and due schedules (runner). It travels in load reports (the largest tenants)
// and in /admin/tenants, and the rebalancer's planner weighs moves by its Bytes.
type TenantSize struct {
	Tenant string `json:"tenant"`
	// Events and EventBytes are the tenant's events and their stored bytes (subject, headers
	// and body) in TM_EVENTS; SnapshotBytes is its newest snapshot.
	Events        uint64 `json:"events,omitempty"`
	EventBytes    uint64 `json:"event_bytes,omitempty"`
	SnapshotBytes uint64 `json:"snapshot_bytes,omitempty"`
	// ViewBytes is the size of the tenant's stored views.
	ViewBytes uint64 `json:"view_bytes,omitempty"`
	// Queued is the tenant's unfinished jobs, Outbox its undelivered effects, Due its schedules
	// whose due time came and whose job is not created yet.
	Queued int `json:"queued,omitempty"`
	Outbox int `json:"outbox,omitempty"`
	Due    int `json:"due,omitempty"`
}

// Bytes is what a move of the tenant carries to its new owner: the events it replays (or the
// snapshot it loads instead, when smaller) and the views it loads.
func (t TenantSize) Bytes() uint64 {
	ev := t.EventBytes
	if t.SnapshotBytes > 0 && t.SnapshotBytes < ev {
		ev = t.SnapshotBytes
	}
	return ev + t.ViewBytes
}

// Depth is the tenant's waiting work: queued jobs, undelivered effects and due schedules.
func (t TenantSize) Depth() int { return t.Queued + t.Outbox + t.Due }
