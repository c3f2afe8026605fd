package shardkit

import (
	"errors"
	"net/http"
	"time"

	"github.com/tenantmesh/tenantmesh/internal/gatesig"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// fromGateway checks, when the shard has its kind's gateway key (Config.GatewayKey), that r
// carries a gateway's proof over its request line and the fields the gate acts on; otherwise
// it answers 403 and returns false. A shard's port reached directly, past the gateways,
// proves nothing: without the key, x-tenant-id would be whatever the caller says.
func (g *gatekeeper) fromGateway(w http.ResponseWriter, r *http.Request) bool {
	sig := g.s.cfg.gateProof
	if sig == nil {
		return true
	}
	h := r.Header
	f := gatesig.Fields{Method: r.Method, Target: r.RequestURI, Kind: h.Get(tmhttp.HeaderKind), Shard: h.Get(tmhttp.HeaderShard),
		Tenant: h.Get(tmhttp.HeaderTenant), Epoch: h.Get(tmhttp.HeaderEpoch), Subject: h.Get(tmhttp.HeaderSubject)}
	err := sig.Verify(h.Get(tmhttp.HeaderProof), &f, time.Now(), g.s.cfg.GatewaySkew)
	if err == nil && f.Kind != g.s.kind {
		err = errors.New("the proof is for kind " + f.Kind)
	}
	if err == nil {
		return true
	}
	g.s.metrics.refused.WithLabelValues("no_gateway_proof").Inc()
	g.s.cfg.Logger.Debug("refused a request without a gateway's proof", "remote", r.RemoteAddr, "err", err)
	tmhttp.WriteProblem(w, r, g.s.problem(http.StatusForbidden, "gateway-proof", "Not from a gateway", f.Tenant,
		"this instance serves requests that come through a tenantmesh gateway only ("+err.Error()+")"))
	return false
}
