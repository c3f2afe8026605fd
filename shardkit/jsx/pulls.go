package jsx

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/tenantmesh/tenantmesh/internal/backoff"
)

// ErrPullsUnheard: pulls for a new consumer found no responder within the bound.
var ErrPullsUnheard = errors.New("the consumer's server does not hear its pulls")

// pullProbe is a pull request the consumer refuses before it looks at its messages (400, a
// batch that is not a number): the answer proves the pull was heard, and nothing is delivered
// or skipped. (A first version asked for one message of at most one byte, answered 409: 5 of
// 7 chaos runs failed with it, 4 with a restarted gateway whose kinds follower never saw the
// bucket's first key, a last-per-subject consumer's first entry gone with no gap in its
// sequence.)
var pullProbe = []byte(`{"batch":"probe"}`)

// AwaitPulls returns once a pull for the consumer reaches it, trying within bound. A consumer
// made on another server than the connection's is heard of there only once its pull subject's
// interest has crossed between the servers, a moment later; a pull sent before is answered "no
// responders" (3% of such consumers here, more under load). nats.go's message iterator
// ignores that answer and waits for heartbeats that never come: two missed, a second, which
// held a move's warm-up and a restarted process's readiness (docs/decisions.md, "A new
// consumer's first pull"). A probe nobody answers (its server stopped) ends the wait: the
// iterator's own nets take over.
func AwaitPulls(ctx context.Context, nc *nats.Conn, stream string, info *jetstream.ConsumerInfo, bound time.Duration) error {
	server := ConsumerServer(info)
	if server == "" || server == nc.ConnectedServerName() {
		return nil // made where the connection is: its pulls are heard at once
	}
	ctx, cancel := context.WithTimeout(ctx, bound)
	defer cancel()
	subject := "$JS.API.CONSUMER.MSG.NEXT." + stream + "." + info.Name
	probe := func(ctx context.Context) error {
		rctx, rcancel := context.WithTimeout(ctx, 500*time.Millisecond)
		defer rcancel()
		_, err := nc.RequestWithContext(rctx, subject, pullProbe)
		return err
	}
	unheard := func(err error) bool { return errors.Is(err, nats.ErrNoResponders) }
	if err := backoff.Retry(ctx, backoff.Policy{Initial: 2 * time.Millisecond, Max: 100 * time.Millisecond, RetryIf: unheard}, probe); unheard(err) {
		return fmt.Errorf("%w (consumer %s on %s)", ErrPullsUnheard, info.Name, server)
	}
	return nil
}
