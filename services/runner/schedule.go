package runner

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/robfig/cron/v3"

	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// Schedule is a tenant's recurring job, key <tenant>.<id> in KV tm_runner_schedules (the
// Cloudlysis PRD's "schedule due items by tenant"). Next is the next due time; the instance
// that fires it creates the due time's job with an idempotency key made of the schedule and
// the due time, then advances Next by compare-and-set. A second instance (a sibling, a move's
// other shard, the successor of an instance that died between the two writes) that fires the
// same due time gets the first job back, so every due time makes exactly one job, and a due
// time that passed while nobody fired it is fired late, not skipped.
type Schedule struct {
	ID     string `json:"id"`
	Tenant string `json:"tenant"`
	// Cron is a standard five-field cron expression (minute hour day month weekday, UTC unless
	// it starts with CRON_TZ=<zone>) or a descriptor: @hourly, @daily, @every 90s.
	Cron string `json:"cron"`
	// Job is the job each due time creates (its idempotency key is the scheduler's).
	Job       NewJob    `json:"job"`
	Next      time.Time `json:"next"`
	CreatedAt time.Time `json:"created_at"`
	// Last is the newest due time fired; Fired counts the due times fired.
	Last  *time.Time `json:"last,omitempty"`
	Fired uint64     `json:"fired"`

	rev uint64
}

// NewSchedule is what a client submits (POST /schedules).
type NewSchedule struct {
	// ID names the schedule (1 to 64 characters of [A-Za-z0-9_-]); empty: one is made.
	ID   string `json:"id,omitempty"`
	Cron string `json:"cron"`
	Job  NewJob `json:"job"`
}

// Schedule errors, mapped to HTTP in writeErr.
var (
	ErrBadSchedule    = errors.New("bad schedule")
	ErrNoSchedule     = errors.New("no such schedule")
	ErrScheduleExists = errors.New("schedule exists")
)

// MinScheduleInterval is the shortest time between two due times of a schedule.
const MinScheduleInterval = time.Second

var scheduleID = regexp.MustCompile(`^[A-Za-z0-9_-]{1,64}$`)

// parseCron parses expr (robfig/cron's standard parser: five fields or a descriptor) and checks
// that due times are at least MinScheduleInterval apart.
func parseCron(expr string, now time.Time) (cron.Schedule, error) {
	if len(expr) > 200 {
		return nil, fmt.Errorf("%w: the cron expression is longer than 200 bytes", ErrBadSchedule)
	}
	sc, err := cron.ParseStandard(expr)
	if err != nil {
		return nil, fmt.Errorf("%w: cron %q: %v (five fields: minute hour day month weekday, or @hourly, @every 90s)", ErrBadSchedule, expr, err)
	}
	a := sc.Next(now)
	if a.IsZero() {
		return nil, fmt.Errorf("%w: cron %q never comes due", ErrBadSchedule, expr)
	}
	if b := sc.Next(a); b.Sub(a) < MinScheduleInterval {
		return nil, fmt.Errorf("%w: cron %q comes due every %v; at least %v apart", ErrBadSchedule, expr, b.Sub(a), MinScheduleInterval)
	}
	return sc, nil
}

// check validates ns for tenant against the job types s knows.
func (sc *Scheduler) check(tenant string, ns NewSchedule, now time.Time) (cron.Schedule, error) {
	if err := schema.CheckTenant(tenant); err != nil {
		return nil, err
	}
	if ns.ID != "" && !scheduleID.MatchString(ns.ID) {
		return nil, fmt.Errorf("%w: id %q must be 1 to 64 characters of [A-Za-z0-9_-]", ErrBadSchedule, ns.ID)
	}
	if ns.Job.IdempotencyKey != "" || ns.Job.RunAt != nil || ns.Job.Delay != "" {
		return nil, fmt.Errorf("%w: a scheduled job takes no idempotency_key, run_at or delay: the schedule sets them", ErrBadSchedule)
	}
	if !jobType.MatchString(ns.Job.Type) || sc.s.handlers[ns.Job.Type] == nil {
		return nil, fmt.Errorf("%w: job type %q: this runner knows %s", ErrBadSchedule, ns.Job.Type, strings.Join(sc.s.types(), ", "))
	}
	if len(ns.Job.Payload) > MaxPayloadBytes {
		return nil, fmt.Errorf("%w: payload is %d bytes, at most %d", ErrBadSchedule, len(ns.Job.Payload), MaxPayloadBytes)
	}
	return parseCron(ns.Cron, now)
}

// Create records a schedule; its first due time is the cron's next after now.
func (sc *Scheduler) Create(ctx context.Context, tenant string, ns NewSchedule) (Schedule, error) {
	now := sc.now().UTC()
	cs, err := sc.check(tenant, ns, now)
	if err != nil {
		return Schedule{}, err
	}
	ctx, cancel := context.WithTimeout(ctx, sc.s.cfg.OpTimeout)
	defer cancel()
	ids, err := sc.keys(ctx, tenant)
	if err != nil {
		return Schedule{}, err
	}
	if len(ids) >= sc.s.cfg.MaxSchedules {
		return Schedule{}, fmt.Errorf("%w: tenant %s has %d schedules, the most allowed; delete one first", ErrBadSchedule, tenant, len(ids))
	}
	if ns.ID == "" {
		var b [8]byte
		_, _ = rand.Read(b[:])
		ns.ID = hex.EncodeToString(b[:])
	}
	sch := Schedule{ID: ns.ID, Tenant: tenant, Cron: ns.Cron, Job: ns.Job, Next: cs.Next(now).UTC(), CreatedAt: now}
	b, _ := json.Marshal(sch)
	rev, err := sc.kv.Create(ctx, runKey(tenant, sch.ID), b)
	if errors.Is(err, jetstream.ErrKeyExists) {
		return Schedule{}, fmt.Errorf("%w: %s: delete it first or pick another id", ErrScheduleExists, sch.ID)
	}
	if err != nil {
		return Schedule{}, fmt.Errorf("runner: record schedule %s: %w", sch.ID, err)
	}
	sch.rev = rev
	sc.remember(sch)
	nudge(sc.wake)
	return sch, nil
}

// Get reads one schedule.
func (sc *Scheduler) Get(ctx context.Context, tenant, id string) (Schedule, error) {
	if !scheduleID.MatchString(id) {
		return Schedule{}, fmt.Errorf("%w: %q", ErrNoSchedule, id)
	}
	e, err := sc.kv.Get(ctx, runKey(tenant, id))
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return Schedule{}, fmt.Errorf("%w: %s", ErrNoSchedule, id)
	}
	if err != nil {
		return Schedule{}, fmt.Errorf("runner: read schedule %s: %w", id, err)
	}
	return decodeSchedule(id, e.Value(), e.Revision())
}

// latest reads one schedule from its stream's leader: a fire decides on what it reads.
func (sc *Scheduler) latest(ctx context.Context, tenant, id string) (Schedule, error) {
	b, rev, err := sc.s.st.JS().LeaderGet(ctx, sc.kv.Bucket(), runKey(tenant, id))
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return Schedule{}, fmt.Errorf("%w: %s", ErrNoSchedule, id)
	}
	if err != nil {
		return Schedule{}, fmt.Errorf("runner: read schedule %s: %w", id, err)
	}
	return decodeSchedule(id, b, rev)
}

func decodeSchedule(id string, b []byte, rev uint64) (Schedule, error) {
	var sch Schedule
	if err := json.Unmarshal(b, &sch); err != nil {
		return Schedule{}, fmt.Errorf("runner: schedule %s is corrupt: %w", id, err)
	}
	sch.rev = rev
	return sch, nil
}

// keys lists the ids of tenant's schedules, sorted.
func (sc *Scheduler) keys(ctx context.Context, tenant string) ([]string, error) {
	keys, err := sc.s.st.JS().Records(sc.kv).Keys(ctx, tenant+".*")
	if err != nil {
		return nil, fmt.Errorf("runner: list schedules of %s: %w", tenant, err)
	}
	ids := make([]string, 0, len(keys))
	for _, k := range keys {
		_, id, _ := strings.Cut(k, ".")
		ids = append(ids, id)
	}
	return ids, nil
}

// List reads every schedule of tenant, by id.
func (sc *Scheduler) List(ctx context.Context, tenant string) ([]Schedule, error) {
	if err := schema.CheckTenant(tenant); err != nil {
		return nil, err
	}
	ids, err := sc.keys(ctx, tenant)
	if err != nil {
		return nil, err
	}
	out := []Schedule{}
	for _, id := range ids {
		sch, err := sc.Get(ctx, tenant, id)
		if errors.Is(err, ErrNoSchedule) {
			continue
		}
		if err != nil {
			return nil, err
		}
		out = append(out, sch)
	}
	return out, nil
}

// Delete removes a schedule; jobs it created stay.
func (sc *Scheduler) Delete(ctx context.Context, tenant, id string) error {
	if _, err := sc.Get(ctx, tenant, id); err != nil {
		return err
	}
	if err := sc.kv.Delete(ctx, runKey(tenant, id)); err != nil {
		return fmt.Errorf("runner: delete schedule %s: %w", id, err)
	}
	sc.forget(tenant, id)
	return nil
}

// dueKey is the idempotency key of a schedule's job for one due time.
func dueKey(id string, due time.Time) string {
	return "schedule:" + id + ":" + due.UTC().Format(time.RFC3339Nano)
}
