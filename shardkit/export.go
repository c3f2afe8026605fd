package shardkit

import "net/http"

// RequireAdmin wraps a service's own admin handler in the same bearer-token check as /admin/*.
func (s *Shard) RequireAdmin(next http.Handler) http.Handler { return s.requireToken(next) }
