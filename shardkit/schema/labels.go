package schema

// LabelTenants, set to TenantsAll on every instance of a shard, marks a shard that consumes
// every tenant (a multi-tenant projection shard, the Cloudlysis PRD's first mode) rather than
// the tenants placed on it: the rebalancer plans no move to or from it, since a move needs a
// shard that filters by placement at both ends.
const (
	LabelTenants = "tm-tenants"
	TenantsAll   = "all"
)
