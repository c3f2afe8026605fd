package planner

import (
	"fmt"
	"slices"
)

// Strategy names how a plan is made.
type Strategy string

const (
	StrategyBalance    Strategy = "balance"
	StrategyEvacuate   Strategy = "evacuate"
	StrategyFill       Strategy = "fill"
	StrategyManual     Strategy = "manual"
	StrategyMoveTenant Strategy = "move-tenant"
	// StrategyFailover takes over the tenants of shards that have no live instance (see
	// [Failover]): every move is a takeover.
	StrategyFailover Strategy = "failover"
)

// Shard is one shard of a kind as the planner sees it.
type Shard struct {
	Name string `json:"name"`
	// Capacity is the load the shard is sized for, in the unit of Tenant.Load. It is the
	// denominator of utilisation and a hard limit: no plan moves a tenant onto a shard whose
	// load would then exceed it. It must be > 0 unless the shard is Draining.
	Capacity float64 `json:"capacity"`
	// MaxTenants is the number of tenants the shard can host (the sum of its instances'
	// capacity in the directory). 0: no limit.
	MaxTenants int `json:"max_tenants,omitempty"`
	// Labels are the shard's labels (those every instance of the shard carries).
	Labels map[string]string `json:"labels,omitempty"`
	// Draining shards receive no tenant and are left out of utilisation figures.
	Draining bool `json:"draining,omitempty"`
}

// Tenant is one tenant's placement in a kind, with its load.
type Tenant struct {
	ID string `json:"id"`
	// Shard is the current owner; it must name a shard of the world.
	Shard string `json:"shard"`
	// Load is the tenant's load (for example its request rate); 0 if unknown.
	Load float64 `json:"load"`
	// Revision is the placement's KV revision; the plan copies it into the tenant's move.
	Revision uint64 `json:"revision,omitempty"`
	// Pinned tenants are never moved (the operator's pin).
	Pinned bool `json:"pinned,omitempty"`
	// Moving tenants are in the middle of a move that owns them: no plan moves them, but a
	// failover takes them over when the move's source is dead.
	Moving bool `json:"moving,omitempty"`
	// Cooling tenants were moved by the autopilot within its cool-down: no plan moves them
	// until it ends, but a failover does.
	Cooling bool `json:"cooling,omitempty"`
	// Requires are labels a shard must carry to host the tenant (for example region=eu).
	Requires map[string]string `json:"requires,omitempty"`
	// Bytes is what a move of the tenant carries (events replayed or snapshot loaded, views):
	// the planner's second dimension beside Load. 0 if unknown.
	Bytes uint64 `json:"bytes,omitempty"`
	// ReplayBytes is what a cold replay reads (the tenant's events) and SnapshotBytes its
	// newest snapshot (0: none): the inputs of the warm-up strategy (see [Warmup]).
	ReplayBytes   uint64 `json:"replay_bytes,omitempty"`
	SnapshotBytes uint64 `json:"snapshot_bytes,omitempty"`
}

// fixed reports whether a plan may not move the tenant: pinned, in a move already, or cooling
// down.
func (t *Tenant) fixed() bool { return t.staying() != "" }

// staying says why a plan may not move the tenant, "" if it may.
func (t *Tenant) staying() string {
	switch {
	case t.Pinned:
		return "pinned"
	case t.Moving:
		return "moving"
	case t.Cooling:
		return "cooling down"
	}
	return ""
}

// World is a snapshot of one kind: its shards and its tenants. The planner reads it and never
// modifies it. Ties between equal loads are broken by the order of Tenants (list placements
// sorted by key for plans that are stable across runs) and by shard name.
type World struct {
	Kind    string   `json:"kind"`
	Shards  []Shard  `json:"shards"`
	Tenants []Tenant `json:"tenants"`
	// Warmup, if set, makes the plan choose each move's warm-up strategy (see [Warmup]).
	Warmup *Warmup `json:"warmup,omitempty"`
}

// Options tune every strategy. The zero value works.
type Options struct {
	// Tolerance is how far above the mean utilisation a shard may end: balance stops when
	// max/mean <= 1+Tolerance, fill stops when the shard reaches (1-Tolerance) of the mean.
	// Default 0.05.
	Tolerance float64 `json:"tolerance"`
	// Budget is the most moves a plan may hold. 0: no limit.
	Budget int `json:"budget,omitempty"`
	// Concurrency is how many moves the engine may run at once; the plan groups its moves into
	// waves of at most that many. Default 4.
	Concurrency int `json:"concurrency"`
	// Require restricts target shards to those carrying these labels (for example region=eu).
	Require map[string]string `json:"require,omitempty"`
	// MaxBytes is the most bytes (Tenant.Bytes) a plan may move: a tenant that would go over
	// it is not moved, and a lighter one is chosen where one does. 0: no limit.
	MaxBytes uint64 `json:"max_bytes,omitempty"`
}

// DefaultTolerance and DefaultConcurrency are the values a zero Options field stands for.
const (
	DefaultTolerance   = 0.05
	DefaultConcurrency = 4
)

func (o Options) withDefaults() (Options, error) {
	if o.Tolerance < 0 || o.Tolerance != o.Tolerance {
		return o, fmt.Errorf("%w: tolerance %v must be >= 0 (0.05 means within 5%% of the mean)", ErrInvalid, o.Tolerance)
	}
	if o.Tolerance == 0 {
		o.Tolerance = DefaultTolerance
	}
	if o.Budget < 0 {
		return o, fmt.Errorf("%w: budget %d must be >= 0 (0: no limit)", ErrInvalid, o.Budget)
	}
	if o.Concurrency < 0 {
		return o, fmt.Errorf("%w: concurrency %d must be >= 0 (0: default %d)", ErrInvalid, o.Concurrency, DefaultConcurrency)
	}
	if o.Concurrency == 0 {
		o.Concurrency = DefaultConcurrency
	}
	return o, nil
}

// ManualMove is an operator's request to move one tenant to one shard.
type ManualMove struct {
	Tenant string `json:"tenant"`
	To     string `json:"to"`
}

// Request is a plan request as the CLI and HTTP API carry it; [Make] dispatches it.
type Request struct {
	Strategy Strategy `json:"strategy"`
	// Kind selects the world for single-kind strategies; it may be empty if there is one world.
	Kind string `json:"kind,omitempty"`
	// Shard is the shard to evacuate or fill.
	Shard string `json:"shard,omitempty"`
	// Moves are the manual moves.
	Moves []ManualMove `json:"moves,omitempty"`
	// Tenant and Targets (kind -> shard) describe a move-tenant request.
	Tenant  string            `json:"tenant,omitempty"`
	Targets map[string]string `json:"targets,omitempty"`
	Options
}

// Make builds the plan req asks for from worlds (one per kind).
func Make(req Request, worlds ...World) (*Plan, error) {
	if req.Strategy == StrategyMoveTenant {
		return MoveTenant(worlds, req.Tenant, req.Targets, req.Options)
	}
	var w *World
	for i := range worlds {
		if worlds[i].Kind == req.Kind || (req.Kind == "" && len(worlds) == 1) {
			w = &worlds[i]
			break
		}
	}
	if w == nil {
		kinds := make([]string, 0, len(worlds))
		for _, x := range worlds {
			kinds = append(kinds, x.Kind)
		}
		slices.Sort(kinds)
		return nil, fmt.Errorf("%w: no world for kind %q (have %v): name one of them", ErrInvalid, req.Kind, kinds)
	}
	switch req.Strategy {
	case StrategyBalance:
		return Balance(*w, req.Options)
	case StrategyEvacuate:
		return Evacuate(*w, req.Shard, req.Options)
	case StrategyFill:
		return Fill(*w, req.Shard, req.Options)
	case StrategyManual:
		return Manual(*w, req.Moves, req.Options)
	case StrategyFailover:
		return Failover(*w, []string{req.Shard}, req.Options)
	}
	return nil, fmt.Errorf("%w: strategy %q is not one of balance, evacuate, fill, manual, move-tenant, failover", ErrInvalid, req.Strategy)
}

// matches reports whether labels carry every key=value of req.
func matches(labels, req map[string]string) bool {
	for k, v := range req {
		if got, ok := labels[k]; !ok || got != v {
			return false
		}
	}
	return true
}
