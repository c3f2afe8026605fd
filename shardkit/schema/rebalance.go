package schema

import "github.com/tenantmesh/tenantmesh/shardkit/jsx"

// Keys in tm_rebalance.
const (
	// LeaderLease is the key of the rebalancer's leader lease.
	LeaderLease = "lease.leader"
	// AutopilotState is the key of the autopilot's state: the operators' freezes and
	// maintenance marks, and the moves it made lately (its budgets and cool-downs).
	AutopilotState = "autopilot.state"
)

// PlanKey is the key of a plan record.
func PlanKey(id string) string { return "plan." + id }

// MoveKey is the key of one move's workflow record.
func MoveKey(plan, move string) string { return "move." + plan + "." + move }

// MovesOf is the watch/list filter for every move of a plan.
func MovesOf(plan string) string { return "move." + plan + ".*" }

// Rebalance is tm_rebalance's records: plans (PlanKey), moves (MoveKey) and the rebalancer's
// leader lease (LeaderLease).
func (s *Store) Rebalance() *jsx.Records { return s.js.Records(s.rebalance) }
