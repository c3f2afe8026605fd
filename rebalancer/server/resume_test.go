package server

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/rebalancer"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// An apply that NATS interrupts is started again while the rebalancer leads; any other error,
// or the end of leadership, ends it.
func TestResumedAfterNATSInterruption(t *testing.T) {
	log := slog.New(slog.DiscardHandler)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	calls := 0
	rec, err := resumed(ctx, log, "p1", func(context.Context) (rebalancer.PlanRecord, error) {
		if calls++; calls == 1 {
			return rebalancer.PlanRecord{}, fmt.Errorf("save move: %w", schema.ErrUnavailable)
		}
		return rebalancer.PlanRecord{ID: "p1", Status: rebalancer.PlanDone}, nil
	})
	if err != nil || calls != 2 || rec.Status != rebalancer.PlanDone {
		t.Fatalf("after one interruption: %d calls, %+v, %v; want 2 calls and done", calls, rec, err)
	}

	calls = 0
	other := errors.New("plan p1 not found")
	if _, err := resumed(ctx, log, "p1", func(context.Context) (rebalancer.PlanRecord, error) {
		calls++
		return rebalancer.PlanRecord{}, other
	}); !errors.Is(err, other) || calls != 1 {
		t.Fatalf("another error: %d calls, %v; want 1 call and the error", calls, err)
	}

	ended, end := context.WithCancel(ctx)
	calls = 0
	if _, err := resumed(ended, log, "p1", func(context.Context) (rebalancer.PlanRecord, error) {
		calls++
		end() // leadership ends during the apply
		return rebalancer.PlanRecord{}, schema.ErrUnavailable
	}); !errors.Is(err, schema.ErrUnavailable) || calls != 1 {
		t.Fatalf("interrupted after leadership ended: %d calls, %v; want 1 call", calls, err)
	}
}
