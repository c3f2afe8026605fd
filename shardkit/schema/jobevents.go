package schema

import (
	"encoding/json"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"
)

// Job events (the multi-host design's WebSocket job.created and job_run.done): a runner
// instance announces each job it creates and each attempt it finishes on core NATS, subject
// tm.job.<event>.<kind>.<tenant>; the rebalancer passes them to its live event stream
// (GET /api/events). Like load reports they are lossy: the run records are the truth.

// Job event names, as the live event stream types them.
const (
	JobCreated = "job.created"
	JobRunDone = "job_run.done"
)

// SubjectJobEventsAll matches every job event.
const SubjectJobEventsAll = "tm.job.>"

const subjectJobPrefix = "tm.job."

// jobEventToken is the subject token of an event name.
func jobEventToken(event string) string {
	switch event {
	case JobCreated:
		return "created"
	case JobRunDone:
		return "run_done"
	}
	return "other"
}

// JobEventSubject is the subject of one job event of kind's tenant.
func JobEventSubject(event, kind, tenant string) string {
	return subjectJobPrefix + jobEventToken(event) + "." + kind + "." + tenant
}

// JobEventSubjectKind matches the job events of kind (what its instances may publish).
func JobEventSubjectKind(kind string) string { return subjectJobPrefix + "*." + kind + ".*" }

// JobEvent is one job event.
type JobEvent struct {
	Event  string    `json:"event"` // JobCreated or JobRunDone
	Time   time.Time `json:"time"`
	Kind   string    `json:"kind"`
	Tenant string    `json:"tenant"`
	Job    string    `json:"job"`
	Type   string    `json:"type"`
	// Instance is the instance the job is pinned to ("": any of its shard); RanOn the
	// instance that ran the attempt (job_run.done).
	Instance string `json:"instance,omitempty"`
	RanOn    string `json:"ran_on,omitempty"`
	// Status is the run's status after the event: pending on creation; after an attempt
	// succeeded, failed, or pending again for a retry.
	Status   string `json:"status"`
	Attempts int    `json:"attempts,omitempty"`
	Error    string `json:"error,omitempty"`
}

// PublishJobEvent announces ev (core NATS: no acknowledgement, lost when nobody listens).
func (s *Store) PublishJobEvent(ev JobEvent) error {
	if err := CheckTenant(ev.Tenant); err != nil {
		return err
	}
	if err := CheckName("kind", ev.Kind); err != nil {
		return err
	}
	if ev.Time.IsZero() {
		ev.Time = time.Now().UTC()
	}
	b, err := json.Marshal(ev)
	if err != nil {
		return fmt.Errorf("schema: encode job event: %w", err)
	}
	return s.js.Conn().Publish(JobEventSubject(ev.Event, ev.Kind, ev.Tenant), b)
}

// SubscribeJobEvents calls fn with every job event, as published. fn runs on the
// subscription's goroutine and must not block. Malformed events are dropped.
func (s *Store) SubscribeJobEvents(fn func(raw []byte, ev JobEvent)) (*nats.Subscription, error) {
	sub, err := s.js.Conn().Subscribe(SubjectJobEventsAll, func(m *nats.Msg) {
		var ev JobEvent
		if json.Unmarshal(m.Data, &ev) != nil || (ev.Event != JobCreated && ev.Event != JobRunDone) || CheckTenant(ev.Tenant) != nil {
			return
		}
		fn(m.Data, ev)
	})
	if err != nil {
		return nil, fmt.Errorf("schema: subscribe %s: %w", SubjectJobEventsAll, err)
	}
	return sub, nil
}
