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

// ConsumerPresence is how many consumers wait on an instance for one affinity key (a long poll,
// an open subscription): Queue, and Group ("" when they wait for the queue as a whole).
type ConsumerPresence struct {
	Queue   string `json:"queue"`
	Group   string `json:"group,omitempty"`
	Waiting int    `json:"waiting"`
}

// MaxReportConsumers bounds LoadReport.Consumers: the keys with the most waiting consumers.
const MaxReportConsumers = 256
