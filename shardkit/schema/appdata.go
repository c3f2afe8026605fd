package schema

import (
	"context"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// EnsureEventsStream creates TM_EVENTS (events.<tenant>.<type>.<id>), the aggregate service's
// event store, read by projections and runners.
func (s *Store) EnsureEventsStream(ctx context.Context) error {
	return s.js.EnsureStream(ctx, jetstream.StreamConfig{
		Name:              StreamEvents,
		Description:       "tenantmesh application events",
		Subjects:          []string{SubjectEventsAll},
		Retention:         jetstream.LimitsPolicy,
		Discard:           jetstream.DiscardOld,
		Duplicates:        2 * time.Minute,
		AllowDirect:       true,
		AllowMsgCounter:   false,
		MaxMsgsPerSubject: -1,
	})
}

// EnsureJobsStream creates TM_JOBS (jobs.<tenant>.>), the runner's per-tenant queues.
func (s *Store) EnsureJobsStream(ctx context.Context) error {
	return s.js.EnsureStream(ctx, jetstream.StreamConfig{
		Name:        StreamJobs,
		Description: "tenantmesh per-tenant job queues",
		Subjects:    []string{SubjectJobsAll},
		Retention:   jetstream.LimitsPolicy,
		Duplicates:  2 * time.Minute,
		AllowDirect: true,
	})
}
