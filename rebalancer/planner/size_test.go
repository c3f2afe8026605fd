package planner

import (
	"strings"
	"testing"
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
