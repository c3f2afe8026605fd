package planner

import (
	"strings"
	"testing"
	"time"
)

// withBytes sets tenants' bytes: id=bytes.
func withBytes(w World, bytes map[string]uint64) World {
	for i := range w.Tenants {
		if b, ok := bytes[w.Tenants[i].ID]; ok {
			w.Tenants[i].Bytes = b
		}
	}
	return w
}

// Bytes are the second dimension: between tenants of equal load the one with less to carry
// moves, and a byte budget keeps a heavy-bytes tenant where it is in favour of a lighter one.
func TestBalanceWeighsBytes(t *testing.T) {
	base := world("aggregate", []string{"a:10", "b:10"}, "t1@a=3", "t2@a=3", "t3@a=3", "t4@b=1")
	w := withBytes(base, map[string]uint64{"t1": 900, "t2": 100, "t3": 500})
	p, err := Balance(w, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if len(p.Moves) != 1 || p.Moves[0].Tenant != "t2" || p.Moves[0].Bytes != 100 || p.Bytes != 100 {
		t.Fatalf("moves %+v (bytes %d): want t2, the equal-load tenant with the fewest bytes", p.Moves, p.Bytes)
	}

	// A budget below every one of a's tenants' bytes but t4's: nothing from a can go.
	w = withBytes(base, map[string]uint64{"t1": 900, "t2": 800, "t3": 700})
	p, err = Balance(w, Options{MaxBytes: 500})
	if err != nil {
		t.Fatal(err)
	}
	if len(p.Moves) != 0 || p.Complete || !strings.Contains(strings.Join(p.Notes, "\n"), "byte budget") {
		t.Fatalf("with a 500-byte budget: moves %+v complete %v notes %q", p.Moves, p.Complete, p.Notes)
	}
	p, err = Balance(w, Options{MaxBytes: 750})
	if err != nil {
		t.Fatal(err)
	}
	if len(p.Moves) != 1 || p.Moves[0].Tenant != "t3" {
		t.Fatalf("with a 750-byte budget: moves %+v, want t3 (700 bytes) only", p.Moves)
	}
}

// Each move gets the strategy its tenant's size calls for, with a predicted warm-up time, and
// the dry run shows both.
func TestWarmupChoice(t *testing.T) {
	w := world("aggregate", []string{"a:10", "b:10"}, "big@a=1", "small@a=1", "fresh@a=1", "slow@a=1")
	sizes := map[string][2]uint64{ // replay bytes, snapshot bytes
		"big": {8 << 20, 1 << 20}, "small": {10 << 10, 2 << 10}, "fresh": {3 << 20, 0}, "slow": {900 << 10, 100 << 10},
	}
	for i := range w.Tenants {
		s := sizes[w.Tenants[i].ID]
		w.Tenants[i].ReplayBytes, w.Tenants[i].SnapshotBytes = s[0], s[1]
	}
	// Replay 1 MiB/s, snapshot 10 MiB/s; snapshot above 1 MiB of events; SLO 500ms.
	w.Warmup = &Warmup{SnapshotAbove: 1 << 20, SLO: 500 * time.Millisecond, ReplayBytesPerSec: 1 << 20, SnapshotBytesPerSec: 10 << 20}
	p, err := Manual(w, []ManualMove{{"big", "b"}, {"small", "b"}, {"fresh", "b"}, {"slow", "b"}}, Options{})
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]struct {
		warmup string
		secs   float64
	}{
		"big":   {WarmupSnapshot, 0.1},               // 8 MiB of events > 1 MiB: the 1 MiB snapshot at 10 MiB/s
		"small": {WarmupReplay, 10.0 / 1024},         // 10 KiB at 1 MiB/s
		"fresh": {WarmupReplay, 3},                   // no snapshot
		"slow":  {WarmupSnapshot, 100.0 / 1024 / 10}, // a 900 KiB replay (0.88s) misses the 500ms SLO
	}
	for _, m := range p.Moves {
		wnt := want[m.Tenant]
		if m.Warmup != wnt.warmup || m.WarmupSeconds < wnt.secs*0.99 || m.WarmupSeconds > wnt.secs*1.01 || m.WarmupReason == "" {
			t.Errorf("%s: %s in %.4fs (%s), want %s in %.4fs", m.Tenant, m.Warmup, m.WarmupSeconds, m.WarmupReason, wnt.warmup, wnt.secs)
		}
	}
	out := p.String()
	for _, s := range []string{"WARM-UP", "PREDICTED", "snapshot", "replay", "predicted warm-up"} {
		if !strings.Contains(out, s) {
			t.Errorf("the dry run does not show %q:\n%s", s, out)
		}
	}
	t.Log("\n" + out)
}
