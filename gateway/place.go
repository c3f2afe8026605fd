package gateway

import (
	"context"
	"errors"
	"net/http"
	"time"

	"github.com/tenantmesh/tenantmesh/shardkit/placement"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// place is the second stage: the tenant's placement from the kind's watcher (a lock-free
// lookup); an unplaced tenant is assigned to the least-loaded shard with room, or refused, as the
// kind says, unless the kind's policy places its tenants itself (affinity).
func (g *Gateway) place(x *exchange) error {
	entry, ok := x.ke.lookup(x.tenant)
	if !ok && !x.policy.placesTenants() {
		if !x.ke.placementsIn() {
			return errStarting // not "not placed", nor an assignment on a guess
		}
		if x.ke.config().Unplaced == schema.UnplacedReject {
			if x.ke.cutOff() {
				return errCutOff // the tenant may be placed where the view cannot see
			}
			return tmhttp.Errorf(http.StatusNotFound, "tenant-not-placed", "Tenant not placed",
				"the tenant has no placement for kind "+x.ke.name+" and the kind does not assign new tenants")
		}
		ctx := x.ctx
		if ctx == nil {
			ctx = g.reqCtx
		}
		if c := g.assignUnderWay(x.ke.name, x.tenant); c != nil {
			// Another request is assigning this tenant: this one waits for that assignment
			// and takes none of the client's or the kind's budget (a client's first burst for
			// a new tenant is one assignment, not one per request).
			g.metrics.assignJoined.WithLabelValues(x.ke.name).Inc()
			var err error
			if entry, err = c.wait(ctx); err != nil {
				return err
			}
		} else if err := g.assigns.allow(g.metrics, x.ke.name, x.remoteIP, x.start); err != nil {
			// Not an assignment if the tenant is placed where this gateway's view cannot see
			// yet: behind, or cut off from the bucket's stream while its server catches up
			// (the netfault harness's 2|1 split, after the heal). Refused only if it is not.
			if !g.unseen.Allow() {
				return err
			}
			if entry, ok = g.placedUnseen(ctx, x.ke.name, x.tenant); !ok {
				return err
			}
		} else if entry, err = g.assign(ctx, g.reg.snap.Load(), x.ke, x.tenant); err != nil {
			return err
		}
	}
	x.entry = entry
	return nil
}

// errCutOff answers a tenant missing from a view that cannot follow its bucket: not a final
// "not placed".
var errCutOff = &tmhttp.Error{Status: http.StatusServiceUnavailable, Type: "placements-unfollowed", Title: "Placements cannot be followed",
	Detail: "the gateway is cut off from the kind's placements and cannot tell whether the tenant is placed; retry shortly", RetryAfter: time.Second}

// unseenPerSec bounds placedUnseen's reads per gateway (and their burst): enough for the
// placements a view is behind on, not a way to load the bucket.
const unseenPerSec = 50

// entryOf is a placement read from the bucket, as the view keeps it.
func entryOf(p schema.Placement) placement.Entry {
	return placement.Entry{Shard: p.Shard, Epoch: p.Epoch, Phase: p.Phase, Target: p.Target, Source: p.Source,
		Owners: p.Owners, Pinned: p.Pinned, Revision: p.Revision}
}

// placedUnseen reads tenant's placement of kind from the bucket's leader (bounded by assignTimeout): the
// placement a view that has yet to see it missed.
func (g *Gateway) placedUnseen(ctx context.Context, kind, tenant string) (placement.Entry, bool) {
	ctx, cancel := context.WithTimeout(ctx, assignTimeout)
	defer cancel()
	p, err := g.store.Placements(kind).Latest(ctx, tenant)
	if err != nil {
		return placement.Entry{}, false
	}
	return entryOf(p), true
}

// assignTimeout bounds the KV create (and audit) of one assignment.
const assignTimeout = 3 * time.Second

type assignCall struct {
	done  chan struct{}
	entry placement.Entry
	err   error
	ended time.Time // set with done; the sweep forgets the call after assignedKeep
}

// assignedKeep is how long a finished assignment answers for its tenant while the view has yet
// to apply it (the view follows in milliseconds; this bounds the entry, not the wait).
const assignedKeep = 5 * time.Second

// assignUnderWay returns the assignment of tenant of kind in progress on this gateway, or one
// that ended well and that the view has not applied yet, or nil.
func (g *Gateway) assignUnderWay(kind, tenant string) *assignCall {
	g.assignMu.Lock()
	defer g.assignMu.Unlock()
	k := holdKey{kind, tenant}
	c := g.assigning[k]
	if c == nil {
		return nil
	}
	select {
	case <-c.done:
		if time.Since(c.ended) > assignedKeep {
			delete(g.assigning, k) // too old to stand for the view: the next sweep's work, done now
			return nil
		}
	default:
	}
	return c
}

// wait returns c's placement once its assignment is done, or ctx's error first.
func (c *assignCall) wait(ctx context.Context) (placement.Entry, error) {
	select {
	case <-c.done:
		return c.entry, c.err
	case <-ctx.Done():
		return placement.Entry{}, ctx.Err()
	}
}

// assign places an unplaced tenant on the least-loaded shard of its kind that has room, by KV
// create: every gateway racing on the tenant ends up with the placement that won. Concurrent
// requests for the same tenant share one assignment, and so do those that come after it ended
// and before the view applied it (sweepAssigned forgets it then): neither spends the budget.
func (g *Gateway) assign(ctx context.Context, snap *snapshot, ke *kindEntry, tenant string) (placement.Entry, error) {
	k := holdKey{ke.name, tenant}
	g.assignMu.Lock()
	if c := g.assigning[k]; c != nil {
		g.assignMu.Unlock()
		return c.wait(ctx)
	}
	c := &assignCall{done: make(chan struct{})}
	g.assigning[k] = c
	g.assignMu.Unlock()

	c.entry, c.err = g.doAssign(snap, ke, tenant)
	c.ended = time.Now()
	g.assignMu.Lock()
	if c.err != nil {
		delete(g.assigning, k) // the next request tries again, within its budget
	}
	g.assignMu.Unlock()
	close(c.done)
	return c.entry, c.err
}

// sweepAssigned forgets the assignments that ended before now-assignedKeep or that the view of
// their kind has applied.
func (g *Gateway) sweepAssigned(snap *snapshot, now time.Time) {
	g.assignMu.Lock()
	defer g.assignMu.Unlock()
	for k, c := range g.assigning {
		select {
		case <-c.done:
		default:
			continue // under way
		}
		ke := snap.kinds[k.kind]
		if now.Sub(c.ended) > assignedKeep || ke == nil {
			delete(g.assigning, k)
		} else if _, seen := ke.lookup(k.tenant); seen {
			delete(g.assigning, k)
		}
	}
}

func (g *Gateway) doAssign(snap *snapshot, ke *kindEntry, tenant string) (placement.Entry, error) {
	shard, err := chooseShard(snap, ke, g.cfg.Assign.MaxPlacements)
	if err != nil {
		var te *tmhttp.Error
		if errors.As(err, &te) && te.Type == "placement-cap" {
			g.metrics.assignRefused.WithLabelValues(ke.name, "cap").Inc()
		}
		return placement.Entry{}, err
	}
	// Not the request's context: a client that goes away must not leave a half-done assignment.
	ctx, cancel := context.WithTimeout(g.bgCtx, assignTimeout)
	defer cancel()
	p, created, err := g.store.Placements(ke.name).Ensure(ctx, schema.Placement{
		Kind: ke.name, Tenant: tenant, Shard: shard, Phase: schema.PhaseActive, Epoch: 1,
		UpdatedBy: "gateway/" + g.cfg.ID,
	})
	if err != nil {
		g.log.Warn("assigning tenant failed", "kind", ke.name, "err", err)
		return placement.Entry{}, &tmhttp.Error{Status: http.StatusServiceUnavailable, Type: "assign-failed", Title: "Tenant could not be placed",
			Detail: "the tenant has no placement and the gateway could not write one; retry shortly", RetryAfter: time.Second, Err: err}
	}
	if created {
		ke.metrics.m.assigned.WithLabelValues(ke.name).Inc()
		if err := g.store.Audit().Append(ctx, schema.AuditEvent{
			Actor: "gateway/" + g.cfg.ID, Action: "placement.assign", Kind: ke.name, Tenant: tenant,
			After: p, Revision: p.Revision, Detail: "unplaced tenant assigned on first request to the least-loaded shard with room",
		}); err != nil {
			g.log.Warn("audit of assignment failed", "kind", ke.name, "err", err)
		}
	}
	return entryOf(p), nil
}

// chooseShard returns the live shard with the lowest tenants/capacity that still has room,
// unless the kind already holds maxPlacements (<= 0: no cap).
func chooseShard(snap *snapshot, ke *kindEntry, maxPlacements int) (string, error) {
	shards := snap.shards[ke.name]
	if len(shards) == 0 {
		return "", &tmhttp.Error{Status: http.StatusServiceUnavailable, Type: "no-live-instance", Title: "No live instance",
			Detail: "kind " + ke.name + " has no live shard to place the tenant on", RetryAfter: time.Second}
	}
	var counts map[string]int
	if w := ke.w.Load(); w != nil {
		counts = w.ShardCounts(ke.name)
	}
	if maxPlacements > 0 {
		total := 0
		for _, n := range counts {
			total += n
		}
		if total >= maxPlacements {
			return "", &tmhttp.Error{Status: http.StatusServiceUnavailable, Type: "placement-cap", Title: "No room for new tenants",
				Detail: "kind " + ke.name + " holds as many placements as the gateway may assign; an operator places more", RetryAfter: 60 * time.Second}
		}
	}
	best, bestUtil := "", 0.0
	for _, s := range shards {
		n := counts[s.name]
		if s.capacity <= 0 || n >= s.capacity {
			continue
		}
		u := float64(n) / float64(s.capacity)
		if best == "" || u < bestUtil {
			best, bestUtil = s.name, u
		}
	}
	if best == "" {
		return "", &tmhttp.Error{Status: http.StatusServiceUnavailable, Type: "no-room", Title: "No shard with room",
			Detail: "every live shard of kind " + ke.name + " is at capacity", RetryAfter: 5 * time.Second}
	}
	return best, nil
}
