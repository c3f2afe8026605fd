package shardkit

import "github.com/tenantmesh/tenantmesh/shardkit/schema"

// PeerForTest returns the forward-mode directory view's entry for id and a channel closed at
// the view's next change.
func (s *Shard) PeerForTest(id schema.InstanceID) (schema.Instance, bool, <-chan struct{}) {
	return s.peers.instance(id.Key())
}

// PeerVersionForTest is how many entries the membership view has applied.
func (s *Shard) PeerVersionForTest() uint64 {
	s.peers.mu.RLock()
	defer s.peers.mu.RUnlock()
	return s.peers.version
}

// SignalsForTest returns the signal view's signals of tenant from shard's instances and a
// channel closed at the view's next change.
func (s *Shard) SignalsForTest(tenant, shard string) (map[string]schema.TenantSignal, <-chan struct{}) {
	return s.signals.shard(tenant, shard)
}
