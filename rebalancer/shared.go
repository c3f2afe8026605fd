package rebalancer

import (
	"context"
	"sync"

	"github.com/tenantmesh/tenantmesh/shardkit/kvwatch"
)

// shared runs a view's loops while at least one move holds the view: the first acquire starts
// them (after reset clears what a previous run left), the last release stops them and waits.
// The directory view and the signal hub are shared this way by every running move.
type shared struct {
	refMu  sync.Mutex
	refs   int
	cancel context.CancelFunc
	done   sync.WaitGroup
}

// acquire starts loops if the view is not running; every acquire needs a release.
func (s *shared) acquire(reset func(), loops ...func(context.Context)) {
	s.refMu.Lock()
	defer s.refMu.Unlock()
	if s.refs++; s.refs > 1 {
		return
	}
	ctx, cancel := context.WithCancel(context.Background())
	s.cancel = cancel
	reset()
	for _, loop := range loops {
		s.done.Go(func() { loop(ctx) })
	}
}

// release stops the loops once no move holds the view.
func (s *shared) release() {
	s.refMu.Lock()
	defer s.refMu.Unlock()
	if s.refs--; s.refs > 0 {
		return
	}
	s.cancel()
	s.done.Wait()
}

// follow applies bucket to h with a kvwatch follower until ctx ends (an ordered KV watch can
// stall for 8-17 s after a NATS server dies; a follower notices within a second and resumes).
func (e *Engine) follow(ctx context.Context, bucket string, h kvwatch.Handler) {
	f, err := kvwatch.New(kvwatch.Config{
		JS:     e.st.JS().JetStream(),
		Bucket: bucket,
		Logger: e.cfg.Logger.With("watch", bucket),
	}, h)
	if err != nil {
		e.cfg.Logger.Error("watching a bucket", "bucket", bucket, "err", err)
		return
	}
	_ = f.Run(ctx)
}
