// Package rebalancer moves tenants between shards: it records plans made by the planner and
// drives each move through docs/design.md's workflow (active -> warming -> handoff -> draining ->
// active) over the placement KV, resumably and under a leader lease.
//
// # Overview
//
// A [PlanRecord] and one [MoveRecord] per move live in tm_rebalance. Every step of a move is a
// compare-and-set on the tenant's placement key, audited to TM_AUDIT, and followed by an update
// of the move record. A move's true state is read back from the placement (which names the move
// while it runs), so an engine that crashed between the two writes resumes correctly: the
// [Engine] can be killed at any step and started again.
//
// Before commit a move can be aborted (warm-up or handoff timeout, rollback): the placement
// goes back to active on the source. After commit it always finishes forward; rolling back a
// committed move is a new move in the other direction.
package rebalancer

import (
	"fmt"
	"time"

	"github.com/tenantmesh/tenantmesh/rebalancer/planner"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// PlanStatus is where a plan stands.
type PlanStatus string

const (
	PlanPlanned    PlanStatus = "planned"
	PlanApplying   PlanStatus = "applying"
	PlanDone       PlanStatus = "done"
	PlanPartial    PlanStatus = "partial" // finished, but some moves were skipped, aborted or failed
	PlanRolledBack PlanStatus = "rolled_back"
	// PlanPaused: an operator paused it (or the autopilot yielded to an operator's plan): no
	// move starts until it is resumed; the moves under way finished.
	PlanPaused PlanStatus = "paused"
	// PlanCancelled: cancelled; the moves past their handoff finished, the rest were aborted or
	// skipped.
	PlanCancelled PlanStatus = "cancelled"
)

// Finished reports whether the plan will not change any more.
func (s PlanStatus) Finished() bool {
	return s == PlanDone || s == PlanPartial || s == PlanRolledBack || s == PlanCancelled
}

// Control is an operator's instruction to a plan being applied.
type Control string

const (
	// ControlPause: start no more moves; the plan becomes paused once those under way end.
	ControlPause Control = "pause"
	// ControlCancel: start no more moves, abort those warming, let those past their handoff
	// finish; the plan becomes cancelled.
	ControlCancel Control = "cancel"
)

// Trigger says why the autopilot made a plan: which detector, what it measured on what, and
// the threshold that crossed.
type Trigger struct {
	// Detector is failover, balance, fill or evacuate.
	Detector string `json:"detector"`
	// Subject is what the detector looked at: kind/shard, or the kind.
	Subject string `json:"subject"`
	// Figure is what it measured ("no live instance: 2 registered, 2 gone"; "max/mean 1.42").
	Figure string `json:"figure"`
	// Threshold is the rule the figure crossed ("max/mean > 1.20 for 5m0s").
	Threshold string `json:"threshold"`
	// Since is when the condition began.
	Since time.Time `json:"since,omitzero"`
}

// PlanRecord is a plan as stored, key plan.<id> in tm_rebalance.
type PlanRecord struct {
	ID      string       `json:"id"`
	Status  PlanStatus   `json:"status"`
	Actor   string       `json:"actor"`
	Created time.Time    `json:"created"`
	Updated time.Time    `json:"updated"`
	Plan    planner.Plan `json:"plan"`
	// RollbackOf names the plan this one reverses; RolledBackBy the plan that reversed this one.
	RollbackOf   string `json:"rollback_of,omitempty"`
	RolledBackBy string `json:"rolled_back_by,omitempty"`
	// Origin is who made the plan: "operator" (the CLI, the API, the dashboard) or "autopilot".
	Origin string `json:"origin,omitempty"`
	// Trigger is why the autopilot made it (nil for an operator's plan).
	Trigger *Trigger `json:"trigger,omitempty"`
	// Proposed marks an autopilot plan made in dry-run mode: never applied unless an operator
	// applies it.
	Proposed bool `json:"proposed,omitempty"`
	// Control is the last instruction given to the plan, by ControlBy.
	Control   Control `json:"control,omitempty"`
	ControlBy string  `json:"control_by,omitempty"`

	Revision uint64 `json:"-"`
}

// MoveState is where one move stands.
type MoveState string

const (
	MovePending   MoveState = "pending"
	MoveWarming   MoveState = "warming"
	MoveHandoff   MoveState = "handoff"
	MoveTakeover  MoveState = "takeover"  // placement takeover(from -> to): it only goes forward
	MoveCommitted MoveState = "committed" // placement draining(to, epoch+1): it will finish forward
	MoveDone      MoveState = "done"
	MoveAborted   MoveState = "aborted" // back to active on the source, before commit
	MoveSkipped   MoveState = "skipped" // the tenant changed since the plan
	MoveFailed    MoveState = "failed"  // gave up; the placement is consistent, see Reason
)

// Terminal reports whether the move will not change any more.
func (s MoveState) Terminal() bool {
	return s == MoveDone || s == MoveAborted || s == MoveSkipped || s == MoveFailed
}

// MoveRecord is one move's workflow state, key move.<plan>.<id> in tm_rebalance.
type MoveRecord struct {
	Plan string `json:"plan"`
	ID   string `json:"id"`
	planner.Move
	// Strategy is the warm-up strategy the target is told to use ("" = its default).
	Strategy string    `json:"strategy,omitempty"`
	State    MoveState `json:"state"`
	// Epoch is the placement's epoch when the move started; the new owner gets Epoch+1.
	Epoch uint64 `json:"epoch,omitempty"`
	// Fence is the source's last applied sequence at handoff.
	Fence uint64 `json:"fence,omitempty"`
	// Fenced says how a takeover knew that no instance of the former owner could still serve
	// the tenant when it committed: its live instances drained, all of them were gone (their
	// NATS connections closed), or their lease ran out.
	Fenced   string    `json:"fenced,omitempty"`
	Reason   string    `json:"reason,omitempty"`
	Started  time.Time `json:"started,omitzero"`
	Handoff  time.Time `json:"handoff,omitzero"`
	Commit   time.Time `json:"commit,omitzero"`
	Finished time.Time `json:"finished,omitzero"`
	Updated  time.Time `json:"updated"`
	// Steps is where the handoff's pause went, as its shards stamped it (Handoff to Commit):
	// the target's report, kept when the move finishes; nil for a takeover, or a target of an
	// older release.
	Steps *schema.HandoffSteps `json:"steps,omitempty"`

	// RecordRev is the record's own KV revision (not stored); Move.Revision is the placement
	// revision the move was planned from.
	RecordRev uint64 `json:"-"`
}

// Key is the move's name in placements (Placement.Move) and audit events.
func (m *MoveRecord) Key() string { return m.Plan + "/" + m.ID }

// Pause is how long the tenant's requests were held: from handoff (a takeover's start) to
// commit.
func (m *MoveRecord) Pause() time.Duration {
	if m.Handoff.IsZero() || m.Commit.IsZero() {
		return 0
	}
	return m.Commit.Sub(m.Handoff)
}

func moveID(i int) string { return fmt.Sprintf("m%05d", i+1) }

// NewPlanID makes a sortable, key-safe plan id.
func NewPlanID(now time.Time) string {
	return fmt.Sprintf("p%s-%04d", now.UTC().Format("20060102-150405"), now.Nanosecond()/100000)
}
