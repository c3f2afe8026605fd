package rebalancer

import (
	"cmp"
	"slices"
	"strings"

	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// TenantSizeView is one tenant's stored size as the instances of its shard report it in
// telemetry (the largest tenants of each instance): events and their bytes, snapshot, views,
// queue, outbox and due schedules, and Bytes, what a move of it carries.
type TenantSizeView struct {
	Kind     string `json:"kind"`
	Shard    string `json:"shard"`
	Instance string `json:"instance"`
	schema.TenantSize
	// MoveBytes is TenantSize.Bytes: what the planner weighs the tenant's move by.
	MoveBytes uint64 `json:"bytes"`
}

// LargestTenants lists the tenants the reports name, once per kind and tenant (the largest
// figure any instance reports: a runner's siblings report the same queue), the largest first
// (bytes, then waiting work, then name), at most limit (0: all).
func LargestTenants(reports []schema.LoadReport, limit int) []TenantSizeView {
	by := map[string]TenantSizeView{}
	for _, r := range reports {
		for _, z := range r.Sizes {
			key := r.Kind + "\x00" + z.Tenant
			cur, ok := by[key]
			if ok && (z.Bytes() < cur.MoveBytes || z.Bytes() == cur.MoveBytes && z.Depth() <= cur.Depth()) {
				continue
			}
			by[key] = TenantSizeView{Kind: r.Kind, Shard: r.Shard, Instance: r.Instance, TenantSize: z, MoveBytes: z.Bytes()}
		}
	}
	out := make([]TenantSizeView, 0, len(by))
	for _, v := range by {
		out = append(out, v)
	}
	slices.SortFunc(out, func(a, b TenantSizeView) int {
		if c := cmp.Compare(b.MoveBytes, a.MoveBytes); c != 0 {
			return c
		}
		if c := cmp.Compare(b.Depth(), a.Depth()); c != 0 {
			return c
		}
		if c := strings.Compare(a.Kind, b.Kind); c != 0 {
			return c
		}
		return strings.Compare(a.Tenant, b.Tenant)
	})
	if limit > 0 && len(out) > limit {
		out = out[:limit]
	}
	return out
}
