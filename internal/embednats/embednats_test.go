package embednats

import (
	"net"
	"strconv"
	"testing"
)

// FreePorts hands out distinct ports that can be bound, below the kernel's ephemeral range
// where it is known (so no outgoing connection takes one before its process binds it).
func TestFreePortsBelowEphemeral(t *testing.T) {
	ports, err := FreePorts("", 8)
	if err != nil {
		t.Fatal(err)
	}
	low, high := belowEphemeral()
	seen := map[int]bool{}
	for _, p := range ports {
		if seen[p] {
			t.Fatalf("port %d handed out twice: %v", p, ports)
		}
		seen[p] = true
		if high > low && (p < low || p >= high) {
			t.Errorf("port %d outside [%d, %d)", p, low, high)
		}
		l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(p)))
		if err != nil {
			t.Errorf("port %d cannot be bound: %v", p, err)
			continue
		}
		l.Close()
	}
}
