package schema

import (
	"fmt"
	"strconv"
	"strings"
)

// ProducerRoute marks a route a producer route (the Queen coordinator's producer routes): for a
// kind with the load policy, the gateway sends its requests to an instance of the tenant's shard
// that has consumers waiting for the request's affinity key, so they are notified locally, and
// to its usual pick when that one has such consumers too or when none has any.
//
// The affinity key is queue, or queue:group. Each names where the gateway reads that part:
// "tenant" (the tenant id), "path:N" (the Nth path segment after the route's prefix, from 0),
// "query:NAME" (a query parameter, as sent) or "header:NAME" (a header). The key is queue:group
// while the queue has at most the kind's queue_affinity_threshold groups with waiting consumers,
// and queue alone beyond that (the source design's dynamic granularity), or when Group is empty.
// A single_writer kind ignores it: the tenant's writer takes every request.
type ProducerRoute struct {
	// Queue is where the key's first part is read. Default "tenant".
	Queue string `json:"queue,omitempty"`
	// Group is where the key's second part is read; empty: the key is the queue alone.
	Group string `json:"group,omitempty"`
}

// Validate checks both key sources.
func (p ProducerRoute) Validate() error {
	for _, src := range []string{p.Queue, p.Group} {
		if src == "" {
			continue
		}
		if _, _, err := ParseKeySource(src); err != nil {
			return err
		}
	}
	return nil
}

// KeySource kinds, as ParseKeySource returns them.
const (
	KeyTenant = "tenant"
	KeyPath   = "path"
	KeyQuery  = "query"
	KeyHeader = "header"
)

// ParseKeySource splits an affinity key source ("tenant", "path:N", "query:NAME",
// "header:NAME") into its kind and argument.
func ParseKeySource(src string) (kind, arg string, err error) {
	kind, arg, _ = strings.Cut(src, ":")
	switch kind {
	case KeyTenant:
		if arg == "" {
			return kind, "", nil
		}
	case KeyPath:
		if n, err := strconv.Atoi(arg); err == nil && n >= 0 && n < 64 {
			return kind, arg, nil
		}
	case KeyQuery, KeyHeader:
		if arg != "" && len(arg) <= 128 && isToken(arg) {
			return kind, arg, nil
		}
	}
	return "", "", fmt.Errorf("%w: affinity key source %q must be tenant, path:N (0-63), query:NAME or header:NAME", ErrInvalid, truncate(src, 40))
}

// ConsumerRoute marks a consumer route of a load-policy kind (the Queen coordinator's consumer
// routes): the gateway's soft affinity (TTL, migrate and break thresholds) is kept per
// affinity key instead of per tenant, so one tenant's queues and groups spread over its shard's
// instances by load, each staying where it was assigned. Key names where each part of the key
// is read ("tenant", "path:N", "query:NAME", "header:NAME", as for ProducerRoute); the parts are
// joined with ":": the source design's queue:group (pop from a queue),
// queue:partition:group (pop from a partition) and namespace:task:group (pop by namespace). A
// part the request lacks reads as "". The key is scoped to the tenant. A single_writer kind
// ignores it.
type ConsumerRoute struct {
	Key []string `json:"key"`
}

// Validate checks the key's sources: one to eight of them.
func (c ConsumerRoute) Validate() error {
	if len(c.Key) == 0 || len(c.Key) > 8 {
		return fmt.Errorf("%w: a consumer route's key has 1 to 8 parts, not %d", ErrInvalid, len(c.Key))
	}
	for _, src := range c.Key {
		if _, _, err := ParseKeySource(src); err != nil {
			return err
		}
	}
	return nil
}

// ConsumerPresence is how many consumers wait on an instance for one affinity key (a long poll,
// an open subscription): Queue, and Group ("" when they wait for the queue as a whole).
type ConsumerPresence struct {
	Queue   string `json:"queue"`
	Group   string `json:"group,omitempty"`
	Waiting int    `json:"waiting"`
}

// MaxReportConsumers bounds LoadReport.Consumers: the keys with the most waiting consumers.
const MaxReportConsumers = 256
