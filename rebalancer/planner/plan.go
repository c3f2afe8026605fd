package planner

import (
	"cmp"
	"fmt"
	"slices"
)

// Plan is the planner's output: the moves, in order, and the predicted effect per shard.
// It is JSON with stable snake_case field names.
type Plan struct {
	Strategy    Strategy `json:"strategy"`
	Tolerance   float64  `json:"tolerance"`
	Budget      int      `json:"budget,omitempty"`
	Concurrency int      `json:"concurrency"`
	// Waves is how many groups of at most Concurrency moves the moves form (see Move.Wave).
	Waves int    `json:"waves"`
	Moves []Move `json:"moves"`
	// Shards are every shard's figures before and after the plan, by kind then shard name.
	Shards []ShardDiff `json:"shards"`
	// Kinds are each kind's imbalance before and after.
	Kinds []KindSummary `json:"kinds"`
	// Complete is true when the strategy's goal is reached: balance within tolerance, the shard
	// evacuated or filled, every requested move planned. Notes say why not.
	Complete bool     `json:"complete"`
	Notes    []string `json:"notes,omitempty"`
	// MinMoves is, for balance, a lower bound on the moves any plan needs to reach the tolerance
	// (see [Balance]); 0 for other strategies.
	MinMoves int `json:"min_moves,omitempty"`
	// Bytes is the sum of the moves' bytes; WarmupSeconds the sum of their predicted warm-ups.
	Bytes         uint64  `json:"bytes,omitempty"`
	WarmupSeconds float64 `json:"warmup_seconds,omitempty"`
}

// Move is one tenant changing owner in one kind.
type Move struct {
	Kind   string  `json:"kind"`
	Tenant string  `json:"tenant"`
	From   string  `json:"from"`
	To     string  `json:"to"`
	Load   float64 `json:"load"`
	// Revision is the placement revision the move was planned from; apply skips the move if
	// the placement has changed since.
	Revision uint64 `json:"revision"`
	// Wave is the move's group, from 1: the engine runs wave n+1 after wave n.
	Wave int `json:"wave"`
	// Bytes is what the move carries (the tenant's Bytes).
	Bytes uint64 `json:"bytes,omitempty"`
	// Warmup is the warm-up strategy chosen for the target ("snapshot" or "replay"; empty: the
	// target's default), WarmupSeconds its predicted time and WarmupReason why it was chosen.
	Warmup        string  `json:"warmup,omitempty"`
	WarmupSeconds float64 `json:"warmup_seconds,omitempty"`
	WarmupReason  string  `json:"warmup_reason,omitempty"`
	// Takeover moves the tenant without its source's drain (the source has no live instance):
	// the target fences the source in the store and loads the tenant from it (docs/design.md,
	// "Failover").
	Takeover bool `json:"takeover,omitempty"`
	// Goal says what the move is for: the plan's goal as it applies to this move.
	Goal string `json:"goal,omitempty"`
}

// ShardDiff is one shard's predicted change.
type ShardDiff struct {
	Kind          string  `json:"kind"`
	Shard         string  `json:"shard"`
	Capacity      float64 `json:"capacity"`
	MaxTenants    int     `json:"max_tenants,omitempty"`
	Draining      bool    `json:"draining,omitempty"`
	LoadBefore    float64 `json:"load_before"`
	LoadAfter     float64 `json:"load_after"`
	TenantsBefore int     `json:"tenants_before"`
	TenantsAfter  int     `json:"tenants_after"`
	In            int     `json:"in"`
	Out           int     `json:"out"`
}

// UtilBefore and UtilAfter are load/capacity (0 for a shard without capacity).
func (d ShardDiff) UtilBefore() float64 { return ratio(d.LoadBefore, d.Capacity) }
func (d ShardDiff) UtilAfter() float64  { return ratio(d.LoadAfter, d.Capacity) }

// KindSummary is one kind's imbalance before and after the plan.
type KindSummary struct {
	Kind   string    `json:"kind"`
	Before Imbalance `json:"before"`
	After  Imbalance `json:"after"`
}

// Imbalance summarises utilisation over a kind's shards (draining and evacuated shards left out).
type Imbalance struct {
	// Mean is total load / total capacity.
	Mean float64 `json:"mean_utilisation"`
	// Max is the largest shard utilisation (load/capacity).
	Max float64 `json:"max_utilisation"`
	// MaxOverMean is Max/Mean, 1 when perfectly balanced (0 when there is no load).
	MaxOverMean float64 `json:"max_over_mean"`
}

// Summary returns the kind's summary (the zero value if the plan does not cover it).
func (p *Plan) Summary(kind string) KindSummary {
	for _, k := range p.Kinds {
		if k.Kind == kind {
			return k
		}
	}
	return KindSummary{}
}

func ratio(a, b float64) float64 {
	if b <= 0 {
		return 0
	}
	return a / b
}

func newPlan(st Strategy, o Options) *Plan {
	return &Plan{Strategy: st, Tolerance: o.Tolerance, Budget: o.Budget, Concurrency: o.Concurrency, Moves: []Move{}, Shards: []ShardDiff{}}
}

// add appends state s's moves, shard figures and summary to the plan.
func (p *Plan) add(s *state) {
	p.Moves = append(p.Moves, s.moves...)
	if s.bytesBlocked {
		p.Notes = append(p.Notes, fmt.Sprintf("%s: the byte budget of %s left tenants unmoved: raise max_bytes or plan again after these moves", s.w.Kind, HumanBytes(s.opts.MaxBytes)))
	}
	for _, si := range s.order {
		sh := &s.w.Shards[si]
		p.Shards = append(p.Shards, ShardDiff{
			Kind: s.w.Kind, Shard: sh.Name, Capacity: sh.Capacity, MaxTenants: sh.MaxTenants, Draining: sh.Draining,
			LoadBefore: s.load0[si], LoadAfter: s.load[si],
			TenantsBefore: int(s.count0[si]), TenantsAfter: int(s.count[si]),
			In: int(s.in[si]), Out: int(s.out[si]),
		})
	}
	p.Kinds = append(p.Kinds, KindSummary{Kind: s.w.Kind, Before: s.imbalance(s.load0), After: s.imbalance(s.load)})
}

func (s *state) imbalance(load []float64) Imbalance {
	var l, c, mx float64
	for i, sh := range s.w.Shards {
		if s.excluded[i] {
			continue
		}
		l += load[i]
		c += sh.Capacity
		mx = max(mx, ratio(load[i], sh.Capacity))
	}
	im := Imbalance{Mean: ratio(l, c), Max: mx}
	im.MaxOverMean = ratio(im.Max, im.Mean)
	return im
}

// finish numbers the waves: moves keep their order; a wave holds at most Concurrency moves and
// never two moves of the same tenant, so a tenant's moves across kinds run one after the other.
func (p *Plan) finish() *Plan {
	wave, inWave := 0, 0
	seen := map[string]bool{}
	for i := range p.Moves {
		m := &p.Moves[i]
		if wave == 0 || inWave == p.Concurrency || seen[m.Tenant] {
			wave++
			inWave = 0
			clear(seen)
		}
		seen[m.Tenant] = true
		inWave++
		m.Wave = wave
	}
	p.Waves = wave
	p.Bytes, p.WarmupSeconds = 0, 0
	for i := range p.Moves {
		m := &p.Moves[i]
		p.Bytes += m.Bytes
		p.WarmupSeconds += m.WarmupSeconds
		if m.Goal == "" {
			m.Goal = p.goal(m)
		}
	}
	slices.SortStableFunc(p.Kinds, func(a, b KindSummary) int { return cmp.Compare(kindRank(a.Kind), kindRank(b.Kind)) })
	return p
}

// goal says what move m is for, from the plan's strategy and figures.
func (p *Plan) goal(m *Move) string {
	switch p.Strategy {
	case StrategyBalance:
		sum := p.Summary(m.Kind)
		return fmt.Sprintf("balance %s: max/mean %.2f -> %.2f (tolerance %.0f%%); %s is above the mean", m.Kind,
			sum.Before.MaxOverMean, sum.After.MaxOverMean, 100*p.Tolerance, m.From)
	case StrategyEvacuate:
		return "empty " + m.Kind + "/" + m.From
	case StrategyFill:
		return "feed " + m.Kind + "/" + m.To + " towards the mean"
	case StrategyFailover:
		return "take over from " + m.Kind + "/" + m.From + ", which has no live instance"
	}
	return "requested: " + m.Kind + "/" + m.Tenant + " to " + m.To
}

// kindOrder is the order a tenant's moves across kinds run in; other kinds follow by name.
var kindOrder = []string{"aggregate", "projection", "runner"}

func kindRank(k string) int {
	if i := slices.Index(kindOrder, k); i >= 0 {
		return i
	}
	return len(kindOrder)
}
