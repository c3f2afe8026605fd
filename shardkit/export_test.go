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
