package gateway

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/tenantmesh/tenantmesh/gateway/policy/affinity"
	"github.com/tenantmesh/tenantmesh/internal/promreg"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// The prerender manager's "Metrics (future)": the realm hit ratio and server utilisation, for
// affinity kinds. A request's realm (tenant) is a hit when one of its owners served it, where the
// page pool holds it warm; otherwise it was assigned to a server with room, sent there in
// pressure mode, or to the fallback attempt. The hit ratio is
// sum(rate(tm_gateway_affinity_requests_total{result="hit"}[5m])) / sum(rate(tm_gateway_affinity_requests_total[5m])).

// Results of tm_gateway_affinity_requests_total.
const (
	affinityHit      = "hit"
	affinityAssigned = "assigned"
	affinityPressure = "pressure"
	affinityFallback = "fallback"
)

// affinityResult names how attempt a came to serve its request.
func affinityResult(a affinity.Attempt) string {
	switch {
	case !a.New:
		return affinityHit
	case a.Fallback:
		return affinityFallback
	case a.Pressure:
		return affinityPressure
	}
	return affinityAssigned
}

func newAffinityRequests(reg prometheus.Registerer) *prometheus.CounterVec {
	return promreg.Register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tm_gateway_affinity_requests_total",
		Help: "Requests of affinity kinds served, by how their server was chosen: hit (an owner of the realm: its page pool holds it), assigned (a new owner with room), pressure (every server full: the owner of the least-recently-used realm), fallback (the owners failed).",
	}, []string{"kind", "result"}))
}

// affinityCollector exports each affinity server's utilisation at scrape time: the realms it
// owns over its capacity (above 1 in pressure mode, until the server releases some).
type affinityCollector struct{ g *Gateway }

var affinityUtilDesc = prometheus.NewDesc("tm_gateway_affinity_server_utilisation",
	"Realms (tenants) each live server of an affinity kind owns, over its capacity.", []string{"kind", "server"}, nil)

func (c *affinityCollector) Describe(ch chan<- *prometheus.Desc) { ch <- affinityUtilDesc }

func (c *affinityCollector) Collect(ch chan<- prometheus.Metric) {
	snap := c.g.reg.snap.Load()
	if snap == nil {
		return
	}
	for name, ke := range snap.kinds {
		cfg := ke.config()
		if cfg == nil || cfg.Policy != schema.PolicyAffinity {
			continue
		}
		for _, sh := range snap.shards[name] {
			for _, in := range sh.instances {
				capacity := int(in.capacity.Load())
				if capacity <= 0 {
					capacity = cfg.Capacity
				}
				if capacity <= 0 {
					continue
				}
				ch <- prometheus.MustNewConstMetric(affinityUtilDesc, prometheus.GaugeValue,
					float64(ke.aff.Count(in.key))/float64(capacity), name, in.key)
			}
		}
	}
}
