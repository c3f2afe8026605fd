package shardkit

import (
	"cmp"
	"slices"
	"strings"

	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// sizes are the hosted tenants' stored sizes from the service's Sizes hook, largest first (by
// bytes, then depth, then name), and their total bytes.
func (rp *reporter) sizes() ([]schema.TenantSize, uint64) {
	if rp.s.cfg.Hooks.Sizes == nil {
		return nil, 0
	}
	all := rp.s.cfg.Hooks.Sizes()
	var total uint64
	for _, z := range all {
		total += z.Bytes()
	}
	slices.SortFunc(all, func(a, b schema.TenantSize) int {
		if c := cmp.Compare(b.Bytes(), a.Bytes()); c != 0 {
			return c
		}
		if c := cmp.Compare(b.Depth(), a.Depth()); c != 0 {
			return c
		}
		return strings.Compare(a.Tenant, b.Tenant)
	})
	return all, total
}

// topSizes fills r's StoredBytes and its largest TopN tenants' sizes.
func (rp *reporter) topSizes(r *schema.LoadReport) {
	all, total := rp.sizes()
	r.StoredBytes = total
	if len(all) > rp.s.cfg.TopN {
		all = all[:rp.s.cfg.TopN]
	}
	r.Sizes = all
}
