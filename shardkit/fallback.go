package shardkit

import (
	"fmt"
	"net/http"

	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// checkFallback refuses ForwardFallback for a kind that needs a single writer: a fallback runs
// the request on an instance that does not own the tenant.
func (s *Shard) checkFallback(kc schema.KindConfig) error {
	if s.cfg.ForwardFallback && kc.SingleWriter {
		return fmt.Errorf("%w: ForwardFallback is refused for kind %s: it is single_writer in %s, and a fallback "+
			"would let an instance that does not own a tenant write its state; turn ForwardFallback off for this kind",
			ErrConfig, kc.Kind, schema.BucketKinds)
	}
	return nil
}

// fallbackHandler returns next if a failed forward may fall back to it now, else nil. The kind's
// config is read per request, so a kind switched to single_writer stops falling back at once.
func (fw *forwarder) fallbackHandler(next http.Handler) http.Handler {
	if next == nil || !fw.s.cfg.ForwardFallback {
		return nil
	}
	if kc := fw.s.kindCfg.Load(); kc == nil || kc.SingleWriter {
		return nil
	}
	return next
}

// serveFallback serves a request for a tenant this instance does not own, after forwarding it to
// the owner failed: the answer says so with X-Fallback: true beside X-Served-By.
func (fw *forwarder) serveFallback(next http.Handler, w http.ResponseWriter, r *http.Request) {
	fw.s.metrics.forwards.WithLabelValues("fallback").Inc()
	h := w.Header()
	delete(h, tmhttp.HeaderRefused)
	h[tmhttp.HeaderServedBy] = fw.s.servedBy
	h[tmhttp.HeaderFallback] = fallbackValue
	fw.s.inflight.Add(1)
	defer fw.s.gk.releaseInstance()
	next.ServeHTTP(w, r)
}

var fallbackValue = []string{"true"}
