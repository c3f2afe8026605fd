package jsx

import (
	"context"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// QuickHeartbeat is the idle heartbeat to pull an ordered consumer's messages with. nats.go's
// default is 5 s, and an ordered consumer notices its server went away only after two missed
// heartbeats: a consumer whose stream leader or server died (a NATS node stopped) went silent
// for 10 s before it was made again, which held a projection's warm-up, and so a move, that
// long. With 500 ms (kvwatch's followers' too) it is made again within about a second; the
// price is two heartbeat messages a second per open consumer.
var QuickHeartbeat jetstream.PullMessagesOpt = jetstream.PullHeartbeat(500 * time.Millisecond)

// OrderedRead makes an ordered consumer for a one-off read of stream. Unlike nats.go's default
// (an inactive ordered consumer lingers 5 minutes), it expires 5 s after its last pull, and done
// deletes it at once, so frequent reads cannot pile up consumers on the server.
func OrderedRead(ctx context.Context, js jetstream.JetStream, stream string, cfg jetstream.OrderedConsumerConfig) (jetstream.Consumer, func(), error) {
	if cfg.InactiveThreshold == 0 {
		cfg.InactiveThreshold = 5 * time.Second
	}
	cons, err := js.OrderedConsumer(ctx, stream, cfg)
	if err != nil {
		return nil, nil, err
	}
	done := func() {
		name := cons.CachedInfo().Name
		dctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_ = js.DeleteConsumer(dctx, stream, name)
	}
	return cons, done, nil
}
