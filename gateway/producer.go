package gateway

import (
	"bytes"
	"net/url"
	"slices"
	"strconv"
	"strings"

	"github.com/tenantmesh/tenantmesh/gateway/h1"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// Producer routes (the Queen coordinator's producer routing, for load-policy kinds): a route
// marked producer sends its requests to an instance of the tenant's shard that has consumers
// waiting for the request's affinity key (instances announce them in their load reports), so
// the consumers are notified locally; the usual pick keeps the request when it has such
// consumers itself, or when no instance has any. Routes that are not producer routes pay one
// nil check.

// keySource is where one part of a producer route's affinity key is read.
type keySource struct {
	kind string // schema.KeyTenant, KeyPath, KeyQuery, KeyHeader; "" none
	n    int    // path: the segment after the prefix
	name string // query, header: the name
}

func parseKeySource(src string) keySource {
	if src == "" {
		return keySource{}
	}
	kind, arg, err := schema.ParseKeySource(src)
	if err != nil {
		return keySource{}
	}
	ks := keySource{kind: kind, name: arg}
	if kind == schema.KeyPath {
		ks.n, _ = strconv.Atoi(arg)
	}
	return ks
}

// producerSpec is a producer route's key, parsed once per snapshot.
type producerSpec struct {
	queue, group keySource
}

func newProducerSpec(p *schema.ProducerRoute) *producerSpec {
	if p == nil {
		return nil
	}
	ps := &producerSpec{queue: parseKeySource(p.Queue), group: parseKeySource(p.Group)}
	if ps.queue.kind == "" {
		ps.queue = keySource{kind: schema.KeyTenant}
	}
	return ps
}

// key reads the request's affinity key parts; ok is false when the queue part is missing. The
// strings may point into the request and do not outlive it.
func (p *producerSpec) key(x *exchange, prefix string) (queue, group string, ok bool) {
	queue = p.queue.read(x, prefix)
	if queue == "" {
		return "", "", false
	}
	return queue, p.group.read(x, prefix), true
}

func (ks keySource) read(x *exchange, prefix string) string {
	switch ks.kind {
	case schema.KeyTenant:
		return x.tenant
	case schema.KeyPath:
		return pathSegment(strings.TrimPrefix(x.path, prefix), ks.n)
	case schema.KeyQuery:
		return queryParam(x.target, ks.name)
	case schema.KeyHeader:
		v, _ := h1.Get(x.fields, ks.name)
		return str(v)
	}
	return ""
}

// pathSegment is the nth '/'-separated segment of rest (leading slashes skipped).
func pathSegment(rest string, n int) string {
	rest = strings.TrimLeft(rest, "/")
	for i := 0; ; i++ {
		seg, tail, more := strings.Cut(rest, "/")
		if i == n {
			return seg
		}
		if !more {
			return ""
		}
		rest = tail
	}
}

// queryParam is the first value of name in the target's query; it is decoded only when it needs
// to be (the one case that allocates).
func queryParam(target []byte, name string) string {
	i := bytes.IndexByte(target, '?')
	if i < 0 {
		return ""
	}
	q := target[i+1:]
	for len(q) > 0 {
		var pair []byte
		if j := bytes.IndexByte(q, '&'); j >= 0 {
			pair, q = q[:j], q[j+1:]
		} else {
			pair, q = q, nil
		}
		k, v, _ := bytes.Cut(pair, []byte{'='})
		if string(k) != name {
			continue
		}
		if bytes.IndexByte(v, '%') < 0 && bytes.IndexByte(v, '+') < 0 {
			return str(v)
		}
		d, err := url.QueryUnescape(string(v))
		if err != nil {
			return ""
		}
		return d
	}
	return ""
}

// consumerSet is one instance's announced waiting consumers, by queue, from its newest load
// report (immutable; replaced per report).
type consumerSet map[string]*queueConsumers

type queueConsumers struct {
	total  int            // every consumer waiting on the queue, any group
	groups map[string]int // group -> waiting ("" for the queue as a whole)
}

func newConsumerSet(ps []schema.ConsumerPresence) *consumerSet {
	if len(ps) == 0 {
		return nil
	}
	cs := consumerSet{}
	for _, p := range ps {
		if p.Waiting <= 0 {
			continue
		}
		qc := cs[p.Queue]
		if qc == nil {
			qc = &queueConsumers{groups: map[string]int{}}
			cs[p.Queue] = qc
		}
		qc.total += p.Waiting
		qc.groups[p.Group] += p.Waiting
	}
	return &cs
}

func (in *instance) queue(q string) *queueConsumers {
	cs := in.consumers.Load()
	if cs == nil {
		return nil
	}
	return (*cs)[q]
}

// waitingFor is how many consumers in waits with for the key: the queue as a whole (group "")
// or queue:group.
func (in *instance) waitingFor(q, g string, byQueue bool) int {
	qc := in.queue(q)
	switch {
	case qc == nil:
		return 0
	case byQueue:
		return qc.total
	}
	return qc.groups[g]
}

// groupCount counts the distinct groups of queue q with waiting consumers on insts, stopping once
// it passes limit.
func groupCount(insts []*instance, q string, limit int) int {
	n := 0
	for i, in := range insts {
		qc := in.queue(q)
		if qc == nil {
			continue
		}
	groups:
		for g := range qc.groups {
			if g == "" {
				continue
			}
			for _, prev := range insts[:i] {
				if pq := prev.queue(q); pq != nil && pq.groups[g] > 0 {
					continue groups
				}
			}
			if n++; n > limit {
				return n
			}
		}
	}
	return n
}

// producerTarget redirects a producer request from usual, the kind's usual pick, to an instance
// with consumers waiting for its key, when usual has none. The seed's cases: the usual pick has
// consumers: it keeps the request (they are notified locally); another has: the one with the
// most; none has: the usual pick.
func (ke *kindEntry) producerTarget(x *exchange, insts, tried []*instance, usual *instance) *instance {
	q, g, ok := x.rt.producer.key(x, x.rt.prefix)
	if !ok {
		return usual
	}
	threshold := 10
	if c := ke.config(); c != nil && c.Load != nil && c.Load.QueueAffinityThreshold > 0 {
		threshold = c.Load.QueueAffinityThreshold
	}
	byQueue := g == "" || groupCount(insts, q, threshold) > threshold
	if usual != nil && usual.waitingFor(q, g, byQueue) > 0 {
		ke.metrics.producer[producerLocal].Inc()
		return usual
	}
	var best *instance
	bestN := 0
	for _, in := range insts {
		if in == usual || slices.Contains(tried, in) || !in.breaker.Available() {
			continue
		}
		if n := in.waitingFor(q, g, byQueue); n > bestN {
			best, bestN = in, n
		}
	}
	if best == nil || !best.breaker.Allow() {
		ke.metrics.producer[producerNone].Inc()
		return usual
	}
	if usual != nil {
		usual.breaker.Abandon() // the usual pick's probe slot, if it took one, is not used
	}
	ke.metrics.producer[producerConsumer].Inc()
	return best
}
