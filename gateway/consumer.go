package gateway

import (
	"strings"

	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// Consumer routes (the Queen coordinator's consumer routes, for load-policy kinds): the load
// policy's soft affinity is kept per affinity key (queue:group, queue:partition:group,
// namespace:task:group, read from the request as the route says) rather than per tenant, so a
// tenant's queues spread over its shard's instances, each sticking to where it was assigned.
// Routes that are not consumer routes pay one nil check.

// consumerSpec is a consumer route's key, parsed once per snapshot.
type consumerSpec struct {
	parts []keySource
}

func newConsumerSpec(c *schema.ConsumerRoute) *consumerSpec {
	if c == nil || len(c.Key) == 0 {
		return nil
	}
	cs := &consumerSpec{}
	for _, src := range c.Key {
		cs.parts = append(cs.parts, parseKeySource(src))
	}
	return cs
}

// affinityKey is the request's key in the load tracker: the tenant, a NUL, and the key's parts
// joined by ":" (a tenant id holds no NUL, so keys of different tenants never meet).
func (c *consumerSpec) affinityKey(x *exchange, prefix string) string {
	var b strings.Builder
	b.WriteString(x.tenant)
	b.WriteByte(0)
	for i, ks := range c.parts {
		if i > 0 {
			b.WriteByte(':')
		}
		b.WriteString(ks.read(x, prefix))
	}
	return b.String()
}

// keyProducers marks the producer routes of kinds that have consumer routes: their usual pick
// (where a message goes when no instance has consumers waiting for its key, and is kept for
// the next one) is then keyed by the request's queue:group like the consumers' affinity, so
// a key's producers and consumers meet on one instance. A kind without consumer routes keeps
// both keyed by the tenant.
func keyProducers(routes []*route) {
	consumers := map[string]bool{}
	for _, rt := range routes {
		if rt.consumer != nil {
			consumers[rt.kind] = true
		}
	}
	for _, rt := range routes {
		if rt.producer != nil {
			rt.producerKeyed = consumers[rt.kind]
		}
	}
}

// producerAffinityKey is a keyed producer route's key in the load tracker: the tenant, a NUL,
// queue:group (the queue alone without a group), as a consumer route over the same parts makes
// it; the tenant alone when the request lacks a queue.
func producerAffinityKey(x *exchange) string {
	q, g, ok := x.rt.producer.key(x, x.rt.prefix)
	if !ok {
		return x.tenant
	}
	if g == "" {
		return x.tenant + "\x00" + q
	}
	return x.tenant + "\x00" + q + ":" + g
}
