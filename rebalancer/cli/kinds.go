package cli

import (
	"context"
	"errors"
	"flag"
	"io"
	"time"

	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// KindsCommand is `rebalance kinds` and `rebalance kinds set`.
type KindsCommand struct {
	m *Main
	common
	policy, unplaced      string
	capacity, multiplex   int
	holdBudget, upstream  time.Duration
	overlap, singleWriter bool
	idempotent, verify    bool
	rateLimit             float64
	rateBurst             int
	degradedErrorRate     float64
	queueThreshold        int
}

const kindsAbout = `Lists the registered kinds and their config, or with 'set <kind>' registers a kind or changes
the given fields of its config (the others keep their values). Gateways, shards and the
rebalancer pick changes up from tm_kinds.`

const kindsExamples = `  rebalance kinds
  rebalance kinds set aggregate --unplaced reject
  rebalance kinds set render --policy affinity --capacity 4 --multiplex 2
  rebalance kinds set projection --overlap --hold-budget 1s
  rebalance kinds set aggregate --verify
`

// Run lists or sets kinds.
func (c *KindsCommand) Run(ctx context.Context, args []string) error {
	fs := c.m.newFlags("kinds", "[set <kind>] [flags]", kindsAbout, kindsExamples)
	c.register(fs)
	fs.StringVar(&c.policy, "policy", "", "set: managed, affinity or load")
	fs.StringVar(&c.unplaced, "unplaced", "", "set: what the gateway does with an unplaced tenant: assign or reject")
	fs.IntVar(&c.capacity, "capacity", 0, "set: default tenants per instance")
	fs.IntVar(&c.multiplex, "multiplex", 0, "set: affinity owners per tenant (M)")
	fs.DurationVar(&c.holdBudget, "hold-budget", 0, "set: how long gateways hold a tenant's requests during a handoff")
	fs.DurationVar(&c.upstream, "upstream-timeout", 0, "set: bound on one proxied request")
	fs.BoolVar(&c.overlap, "overlap", false, "set: the kind only reads; moves skip the hold")
	fs.BoolVar(&c.singleWriter, "single-writer", false, "set: send each tenant's requests to one instance of its shard (--single-writer=false: any instance)")
	fs.BoolVar(&c.idempotent, "idempotent", false, "set: the kind's services apply a request with an Idempotency-Key once, so gateways may resend one whose answer was lost (--idempotent=false: never)")
	fs.BoolVar(&c.verify, "verify", false, "set: verify every move of the kind as it ends: the source keeps the tenant until the target's state digest at the fence equals its own (--verify=false: off)")
	fs.Float64Var(&c.rateLimit, "rate-limit", 0, "set: per-tenant requests per second (0: unchanged, -1: remove)")
	fs.IntVar(&c.rateBurst, "rate-burst", 0, "set: per-tenant burst with --rate-limit (default: the rate, at least 1)")
	fs.Float64Var(&c.degradedErrorRate, "degraded-error-rate", 0, "set: error rate at which an instance reports itself degraded (negative: never)")
	fs.IntVar(&c.queueThreshold, "queue-affinity-threshold", 0, "set (load policy): groups of a queue beyond which a producer route's key is the queue alone")
	pos, err := parse(fs, args)
	if err != nil {
		return err
	}
	if err := c.check(); err != nil {
		return err
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	switch {
	case len(pos) == 0:
	case pos[0] == "set" && len(pos) == 2:
		if err := schema.CheckName("kind", pos[1]); err != nil {
			return usagef("%v", err)
		}
	case pos[0] == "set":
		return usagef("kinds set takes one kind")
	default:
		return usagef("kinds takes no argument, or 'set <kind>'")
	}
	st, closeFn, err := c.connect(ctx)
	if err != nil {
		return err
	}
	defer closeFn()
	if len(pos) == 0 {
		kcs, err := st.Kinds().List(ctx)
		if err != nil {
			return err
		}
		if kcs == nil {
			kcs = []schema.KindConfig{}
		}
		return c.emit(c.m.Stdout, kcs, func(w io.Writer) error { return renderKinds(w, kcs) })
	}
	kc, err := c.set(ctx, st, pos[1], set)
	if err != nil {
		return err
	}
	return c.emit(c.m.Stdout, kc, func(w io.Writer) error { return renderKinds(w, []schema.KindConfig{kc}) })
}

func (c *KindsCommand) set(ctx context.Context, st *schema.Store, kind string, set map[string]bool) (schema.KindConfig, error) {
	before, err := st.Kinds().Get(ctx, kind)
	if errors.Is(err, schema.ErrUnknownKind) {
		before, err = schema.KindConfig{Kind: kind}, nil
	}
	if err != nil {
		return schema.KindConfig{}, err
	}
	kc := before
	if set["policy"] {
		kc.Policy = schema.Policy(c.policy)
		if kc.Policy != before.Policy {
			kc.Affinity, kc.Load = nil, nil // defaults of the new policy
		}
	}
	if set["unplaced"] {
		kc.Unplaced = schema.Unplaced(c.unplaced)
	}
	if set["capacity"] {
		kc.Capacity = c.capacity
	}
	if set["hold-budget"] {
		kc.HoldBudget = schema.Duration(c.holdBudget)
	}
	if set["upstream-timeout"] {
		kc.UpstreamTimeout = schema.Duration(c.upstream)
	}
	if set["overlap"] {
		kc.Overlap = c.overlap
	}
	if set["single-writer"] {
		kc.SingleWriter = c.singleWriter
	}
	if set["idempotent"] {
		kc.Idempotent = c.idempotent
	}
	if set["verify"] {
		kc.Verify = c.verify
	}
	if set["multiplex"] {
		if kc.Policy != schema.PolicyAffinity {
			return schema.KindConfig{}, usagef("--multiplex applies to the affinity policy; kind %s is %s", kind, kc.Policy)
		}
		a := schema.AffinityConfig{}
		if kc.Affinity != nil {
			a = *kc.Affinity
		}
		a.Multiplex = c.multiplex
		kc.Affinity = &a
	}
	if set["degraded-error-rate"] {
		kc.DegradedErrorRate = c.degradedErrorRate
	}
	if set["queue-affinity-threshold"] {
		if kc.Policy != schema.PolicyLoad {
			return schema.KindConfig{}, usagef("--queue-affinity-threshold applies to the load policy; kind %s is %s", kind, kc.Policy)
		}
		l := schema.LoadConfig{}
		if kc.Load != nil {
			l = *kc.Load
		}
		l.QueueAffinityThreshold = c.queueThreshold
		kc.Load = &l
	}
	switch {
	case set["rate-limit"] && c.rateLimit < 0:
		kc.RateLimit = nil
	case set["rate-limit"]:
		burst := c.rateBurst
		if burst <= 0 {
			burst = max(int(c.rateLimit), 1)
		}
		kc.RateLimit = &schema.RateLimit{PerSecond: c.rateLimit, Burst: burst}
	}
	kc, err = st.Kinds().Put(ctx, kc)
	if err != nil {
		return schema.KindConfig{}, err
	}
	if err := st.Audit().Append(ctx, schema.AuditEvent{Actor: actor(), Action: "kind.set", Kind: kind, Before: before, After: kc}); err != nil {
		return kc, err
	}
	return kc, nil
}
