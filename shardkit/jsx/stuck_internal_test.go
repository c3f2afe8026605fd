package jsx

import (
	"strconv"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/tenantmesh/tenantmesh/internal/embednats/natstest"
)

// A connection whose JetStream API requests keep timing out moves to another server of its
// cluster: after three timeouts in a row spanning 5 s, and then not again for 30 s; an
// answered request in between starts the count again.
func TestStuckServerIsLeft(t *testing.T) {
	c := natstest.NewCluster(t)
	now := time.Unix(1_000_000, 0)
	stuckClock = func() time.Time { return now }
	t.Cleanup(func() { stuckClock = time.Now })
	reconnected := make(chan string, 4)
	discovered := make(chan struct{}, 4)
	nc := natstest.Connect(t, "nats://127.0.0.1:"+strconv.Itoa(c.Configs[2].Port),
		nats.ReconnectHandler(func(nc *nats.Conn) { reconnected <- nc.ConnectedServerName() }),
		nats.DiscoveredServersHandler(func(*nats.Conn) { discovered <- struct{}{} }))
	first := nc.ConnectedServerName()
	for len(nc.Servers()) < 3 { // the other two, from the cluster's gossip
		select {
		case <-discovered:
		case <-time.After(10 * time.Second):
			t.Fatalf("the connection knows %v, not the cluster's three servers", nc.Servers())
		}
	}

	step := func(d time.Duration) bool { now = now.Add(d); return APITimedOut(nc) }
	if step(0) || step(2*time.Second) {
		t.Fatal("moved after two timeouts")
	}
	APIAnswered(nc)
	if step(time.Second) || step(2*time.Second) || step(2*time.Second) {
		t.Fatal("moved though a request was answered since the first timeouts")
	}
	if !step(time.Second) { // the fourth in a row, 5 s after the first
		t.Fatal("did not move after four timeouts over 5 s")
	}
	select {
	case to := <-reconnected:
		if to == first {
			t.Fatalf("reconnected to %s, the server it left", to)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the connection did not reconnect")
	}
	for range 3 {
		if step(3 * time.Second) {
			t.Fatal("moved again within 30 s")
		}
	}
	if !step(30 * time.Second) {
		t.Fatal("did not move again 30 s later")
	}
}
