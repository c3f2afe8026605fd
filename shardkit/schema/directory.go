package schema

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net/url"
	"time"

	"github.com/tenantmesh/tenantmesh/shardkit/jsx"
)

// Status is an instance's health as the directory shows it.
type Status string

const (
	StatusOnline   Status = "online"
	StatusDegraded Status = "degraded"
	StatusDraining Status = "draining"
	StatusOffline  Status = "offline"
)

// Instance is one process of a shard, key <kind>.<shard>.<instance> in tm_instances.
type Instance struct {
	InstanceID
	URL      string            `json:"url"`
	Capacity int               `json:"capacity"`
	Labels   map[string]string `json:"labels,omitempty"`
	Version  string            `json:"version,omitempty"`
	Started  time.Time         `json:"started"`
	// Heartbeat is when the instance last wrote this entry.
	Heartbeat time.Time `json:"heartbeat"`
	// RefreshMS is how often the instance rewrites the entry when nothing in it changes (its
	// liveness in between is its load reports); 0: at every heartbeat (writers before it).
	RefreshMS int64 `json:"refresh_ms,omitempty"`
	// Reported is the status the instance reports of itself (online, degraded, draining); the
	// status a reader sees also ages with Heartbeat (see Thresholds.Status).
	Reported Status `json:"status"`
	// Metrics are the instance's last figures (the multi-host design's lastMetrics).
	Metrics *InstanceMetrics `json:"metrics,omitempty"`
	// Flag is the operator's manual flag (SetInstanceFlag); registrations and heartbeats keep it.
	Flag *InstanceFlag `json:"flag,omitempty"`
	// LeaseMS is the lease the instance serves under (KindConfig.Lease when it registered): how
	// long it keeps serving after it last confirmed its placement view. A takeover of its
	// shard's tenants waits the longest lease of the shard's instances. 0: not published
	// (an instance older than leases: the kind's lease applies).
	LeaseMS int64 `json:"lease_ms,omitempty"`

	Revision uint64 `json:"-"`
}

// InstanceMetrics are the last figures an instance sent with its heartbeat.
type InstanceMetrics struct {
	InFlight   int     `json:"in_flight"`
	RatePerSec float64 `json:"rate_per_sec"`
	LatencyMS  float64 `json:"latency_ms"`
	CPU        float64 `json:"cpu"`
	Tenants    int     `json:"tenants"`
	ErrorRate  float64 `json:"error_rate"`
	Running    int     `json:"running,omitempty"`
	// MemBytes, MemPercent, DiskPercent and DiskFreeBytes are the process's memory and its
	// disk's use, as in LoadReport.
	MemBytes      uint64  `json:"mem_bytes,omitempty"`
	MemPercent    float64 `json:"mem_percent,omitempty"`
	DiskPercent   float64 `json:"disk_percent,omitempty"`
	DiskFreeBytes uint64  `json:"disk_free_bytes,omitempty"`
}

// Validate checks the registration.
func (i Instance) Validate() error {
	if err := i.InstanceID.Check(); err != nil {
		return err
	}
	u, err := url.Parse(i.URL)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return fmt.Errorf("%w: instance %s: url %q must be an absolute http(s) URL", ErrInvalid, i.Key(), i.URL)
	}
	if i.Capacity < 0 {
		return fmt.Errorf("%w: instance %s: capacity must be >= 0", ErrInvalid, i.Key())
	}
	return nil
}

// Refresh is how often the instance rewrites its entry when nothing changes (0: at every
// heartbeat).
func (i Instance) Refresh() time.Duration {
	return time.Duration(max(i.RefreshMS, 0)) * time.Millisecond
}

// Thresholds turn heartbeat age into a status. The zero value uses the defaults.
type Thresholds struct {
	// DegradedAfter: an entry this much older than its refresh interval (Instance.Refresh)
	// marks the instance degraded. Default 3s.
	DegradedAfter time.Duration
	// OfflineAfter: no heartbeat for this long marks it offline (the multi-host design). Default 2m.
	OfflineAfter time.Duration
}

func (t Thresholds) withDefaults() Thresholds {
	if t.DegradedAfter <= 0 {
		t.DegradedAfter = 3 * time.Second
	}
	if t.OfflineAfter <= 0 {
		t.OfflineAfter = 2 * time.Minute
	}
	return t
}

// Status derives i's status at now: the worse of what it reports and what its heartbeat age says.
func (t Thresholds) Status(i Instance, now time.Time) Status {
	t = t.withDefaults()
	age := now.Sub(i.Heartbeat)
	switch {
	case age >= t.OfflineAfter:
		return StatusOffline
	case i.Reported == StatusOffline:
		return StatusOffline
	case i.Reported == StatusDraining:
		return StatusDraining
	case age >= i.Refresh()+t.DegradedAfter || i.Reported == StatusDegraded || i.Flag.degraded():
		return StatusDegraded
	}
	return StatusOnline
}

// Live reports whether an instance in status st may receive new requests.
func (st Status) Live() bool { return st == StatusOnline || st == StatusDegraded }

// Directory is tm_instances, the instance directory (each instance's URL, capacity, labels,
// status and last heartbeat), with tm_members, the part of it that changes only when an
// instance's status, URL or labels do (what shards follow), and each instance's status
// history.
type Directory struct{ s *Store }

// Directory is the instance directory.
func (s *Store) Directory() Directory { return Directory{s} }

// Register writes the instance's entry (replacing any previous one of the same id, but keeping
// its operator flag).
func (d Directory) Register(ctx context.Context, i Instance) (Instance, error) {
	now := time.Now().UTC()
	if i.Started.IsZero() {
		i.Started = now
	}
	i.Heartbeat = now
	if i.Reported == "" {
		i.Reported = StatusOnline
	}
	if err := i.Validate(); err != nil {
		return Instance{}, err
	}
	if i.Flag == nil {
		var prev Instance
		if _, err := d.s.js.Records(d.s.instances).Get(ctx, i.Key(), &prev); err == nil {
			i.Flag = prev.Flag
		}
	}
	rev, err := d.s.js.Records(d.s.instances).Put(ctx, i.Key(), i)
	if err != nil {
		return Instance{}, err
	}
	if _, err := d.PutMember(ctx, i); err != nil {
		return Instance{}, err
	}
	i.Revision = rev
	return i, nil
}

// Heartbeat refreshes the entry's heartbeat time and metrics in tm_instances only; the
// membership entry (tm_members) changes only through PutMember, MarkOffline and the removals.
// It re-creates the entry if a sweeper removed it, so an instance that was wrongly declared
// dead comes back. With the revision of the instance's last write (i.Revision) it writes by
// compare-and-set, and when someone else wrote the entry since (an operator's flag, the
// sweeper), it keeps their flag.
func (d Directory) Heartbeat(ctx context.Context, i Instance) (Instance, error) {
	i.Heartbeat = time.Now().UTC()
	if err := i.Validate(); err != nil {
		return Instance{}, err
	}
	if i.Revision != 0 {
		rev, err := d.s.js.Records(d.s.instances).CompareAndSet(ctx, i.Key(), i.Revision, i)
		if err == nil {
			i.Revision = rev
			return i, nil
		}
		if !IsConflict(err) {
			return Instance{}, err
		}
		var cur Instance
		if _, err := d.s.js.Records(d.s.instances).Get(ctx, i.Key(), &cur); err == nil {
			i.Flag = cur.Flag
		}
	}
	rev, err := d.s.js.Records(d.s.instances).Put(ctx, i.Key(), i)
	if err != nil {
		return Instance{}, err
	}
	i.Revision = rev
	return i, nil
}

// Unregister removes the instance's entry. Removing an absent entry is not an error.
func (d Directory) Unregister(ctx context.Context, id InstanceID) error {
	if err := id.Check(); err != nil {
		return err
	}
	if err := d.s.js.Records(d.s.instances).Delete(ctx, id.Key(), 0); err != nil {
		return err
	}
	return d.s.js.Records(d.s.members).Delete(ctx, id.Key(), 0)
}

// Instance reads one entry.
func (d Directory) Instance(ctx context.Context, id InstanceID) (Instance, error) {
	if err := id.Check(); err != nil {
		return Instance{}, err
	}
	var i Instance
	rev, err := d.s.js.Records(d.s.instances).Get(ctx, id.Key(), &i)
	if err != nil {
		return Instance{}, err
	}
	i.Revision = rev
	return i, nil
}

// Instances lists the directory, optionally only one kind ("" for all).
func (d Directory) Instances(ctx context.Context, kind string) ([]Instance, error) {
	filter := ">"
	if kind != "" {
		if err := CheckName("kind", kind); err != nil {
			return nil, err
		}
		filter = kind + ".>"
	}
	var out []Instance
	_, err := jsx.ListJSON(ctx, d.s.js.Records(d.s.instances), filter, func(_ string, rev uint64, i Instance) {
		i.Revision = rev
		out = append(out, i)
	})
	return out, err
}

// MarkOffline records that the sweeper found the instance offline, by CAS on the revision read,
// so a heartbeat that lands meanwhile wins; then it marks the membership entry offline, which
// is how shard instances (which follow memberships, not heartbeats) learn of it. An instance
// that is alive after all sees its own membership turn offline and writes it back.
func (d Directory) MarkOffline(ctx context.Context, i Instance) error {
	i.Reported = StatusOffline
	if _, err := d.s.js.Records(d.s.instances).CompareAndSet(ctx, i.Key(), i.Revision, i); err != nil {
		return err
	}
	_, err := d.PutMember(ctx, i)
	return err
}

// RemoveInstance deletes an entry if it is unchanged since it was read (sweeper), and its
// membership entry.
func (d Directory) RemoveInstance(ctx context.Context, i Instance) error {
	err := d.s.js.Records(d.s.instances).Delete(ctx, i.Key(), i.Revision)
	if errors.Is(err, ErrNotFound) {
		err = nil
	}
	if err != nil {
		return err
	}
	err = d.s.js.Records(d.s.members).Delete(ctx, i.Key(), 0)
	if errors.Is(err, ErrNotFound) {
		return nil
	}
	return err
}

// Member is i as its membership entry holds it: no metrics, no operator flag (a flag only
// degrades, which shards treat as live), Heartbeat the time of the change.
func (i Instance) Member() Instance {
	i.Metrics = nil
	i.Flag = nil
	i.Revision = 0
	if i.Reported == "" {
		i.Reported = StatusOnline
	}
	return i
}

// SameMember reports whether i and o agree on everything a membership entry holds but its
// time: a heartbeat that changes none of it writes no membership.
func (i Instance) SameMember(o Instance) bool {
	a, b := i.Member(), o.Member()
	return a.InstanceID == b.InstanceID && a.URL == b.URL && a.Capacity == b.Capacity && a.Version == b.Version &&
		a.Started.Equal(b.Started) && a.Reported == b.Reported && maps.Equal(a.Labels, b.Labels)
}

// PutMember writes i's membership entry (tm_members), stamped with the time of the change.
// Instances call it when what it holds changes, never per heartbeat: every instance of the
// kind receives every write.
func (d Directory) PutMember(ctx context.Context, i Instance) (uint64, error) {
	i = i.Member()
	i.Heartbeat = time.Now().UTC()
	if err := i.Validate(); err != nil {
		return 0, err
	}
	return d.s.js.Records(d.s.members).Put(ctx, i.Key(), i)
}

// Members lists the membership entries, optionally only one kind ("" for all).
func (d Directory) Members(ctx context.Context, kind string) ([]Instance, error) {
	filter := ">"
	if kind != "" {
		if err := CheckName("kind", kind); err != nil {
			return nil, err
		}
		filter = kind + ".>"
	}
	var out []Instance
	_, err := jsx.ListJSON(ctx, d.s.js.Records(d.s.members), filter, func(_ string, rev uint64, i Instance) {
		i.Revision = rev
		out = append(out, i)
	})
	return out, err
}
