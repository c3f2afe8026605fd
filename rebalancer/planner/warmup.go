package planner

import (
	"fmt"
	"time"
)

// Warm-up strategies a move's target may be told to use (shardkit/events' names).
const (
	WarmupSnapshot = "snapshot"
	WarmupReplay   = "replay"
)

// Warmup is a kind's rule for choosing each move's warm-up strategy from the tenant's size (the
// Cloudlysis PRD's "the rebalancer selecting the strategy based on tenant size/SLO"): snapshot
// migration (load the newest snapshot, replay the events after it) or cold replay (rebuild
// from the first event).
//
// A tenant whose size is unknown (no telemetry names it: it is small or there is none) keeps
// the target's default. A tenant without a snapshot replays. Otherwise it loads its snapshot when its events weigh
// more than SnapshotAbove, or when a replay is predicted to take longer than SLO; else it
// replays (a small tenant's replay is cheaper than reading a snapshot and avoids trusting an
// old one). The prediction is bytes over throughput: ReplayBytes/ReplayBytesPerSec for a
// replay, SnapshotBytes/SnapshotBytesPerSec for a snapshot load.
type Warmup struct {
	SnapshotAbove       uint64        `json:"snapshot_above_bytes"`
	SLO                 time.Duration `json:"slo"`
	ReplayBytesPerSec   float64       `json:"replay_bytes_per_sec"`
	SnapshotBytesPerSec float64       `json:"snapshot_bytes_per_sec"`
}

// Predict returns the predicted warm-up of a tenant with each strategy.
func (w *Warmup) Predict(t *Tenant) (replay, snapshot time.Duration) {
	replay = seconds(float64(t.ReplayBytes) / w.ReplayBytesPerSec)
	snapshot = seconds(float64(t.SnapshotBytes) / w.SnapshotBytesPerSec)
	return replay, snapshot
}

// choose sets m's warm-up strategy, predicted time and reason for tenant t (nothing if w is nil).
func (w *Warmup) choose(m *Move, t *Tenant) {
	if w == nil || !(w.ReplayBytesPerSec > 0) || !(w.SnapshotBytesPerSec > 0) {
		return
	}
	if t.ReplayBytes == 0 && t.SnapshotBytes == 0 {
		return // size unknown (no telemetry, or too small for any top list): the target's default
	}
	replay, snap := w.Predict(t)
	switch {
	case t.SnapshotBytes == 0:
		m.Warmup, m.WarmupSeconds = WarmupReplay, replay.Seconds()
		m.WarmupReason = fmt.Sprintf("no snapshot: replay %s", HumanBytes(t.ReplayBytes))
	case t.ReplayBytes > w.SnapshotAbove:
		m.Warmup, m.WarmupSeconds = WarmupSnapshot, snap.Seconds()
		m.WarmupReason = fmt.Sprintf("events %s > threshold %s: load the %s snapshot", HumanBytes(t.ReplayBytes), HumanBytes(w.SnapshotAbove), HumanBytes(t.SnapshotBytes))
	case w.SLO > 0 && replay > w.SLO && snap < replay:
		m.Warmup, m.WarmupSeconds = WarmupSnapshot, snap.Seconds()
		m.WarmupReason = fmt.Sprintf("a replay of %s would take %v > SLO %v: load the snapshot", HumanBytes(t.ReplayBytes), replay.Round(time.Millisecond), w.SLO)
	default:
		m.Warmup, m.WarmupSeconds = WarmupReplay, replay.Seconds()
		m.WarmupReason = fmt.Sprintf("events %s <= threshold %s: replay", HumanBytes(t.ReplayBytes), HumanBytes(w.SnapshotAbove))
	}
}

func seconds(f float64) time.Duration { return time.Duration(f * float64(time.Second)) }
