package gateway

import (
	"fmt"
	"testing"
)

// TestInternedIsBounded (item 1): valid tenant ids are interned, by bytes: with 20,000 ids of
// 128 characters and a 256 KiB generation, the table never holds more than two generations,
// and an id in use stays interned.
func TestInternedIsBounded(t *testing.T) {
	tab := interned{max: 256 << 10}
	hot := tab.get([]byte("hot"))
	for i := range 20000 {
		id := fmt.Sprintf("%0128d", i)
		if got := tab.get([]byte(id)); got != id {
			t.Fatalf("get(%q) = %q", id, got)
		}
		if i%100 == 0 {
			if got := tab.get([]byte("hot")); got != hot {
				t.Fatal("the hot id changed")
			}
		}
		if s := tab.size(); s > 2*tab.max {
			t.Fatalf("after %d ids the table holds %d bytes, more than two generations of %d", i+1, s, tab.max)
		}
	}
	if testing.AllocsPerRun(100, func() { tab.get([]byte("hot")) }) != 0 {
		t.Fatal("an interned id allocates")
	}
}
