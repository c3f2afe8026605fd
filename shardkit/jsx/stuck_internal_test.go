package jsx

import (
	"math/rand/v2"
	"strconv"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/tenantmesh/tenantmesh/internal/embednats/natstest"
)

// A connection whose JetStream API requests keep timing out moves to another server of its
// cluster: after three timeouts in a row spanning 5 s (and a random part of up to 1 s), and then not again
// for 30 s, doubled at each move while nothing is answered; an answered request in between
// starts the count again.
func TestStuckServerIsLeft(t *testing.T) {
	c := natstest.NewCluster(t)
	now := time.Unix(1_000_000, 0)
	stuckClock = func() time.Time { return now }
	jitter := 0.0
	stuckJitter = func() float64 { return jitter }
	t.Cleanup(func() { stuckClock, stuckJitter = time.Now, rand.Float64 })
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
	awaitReconnect := func() {
		t.Helper()
		select {
		case <-reconnected:
		case <-time.After(10 * time.Second):
			t.Fatal("the connection did not reconnect")
		}
	}
	awaitReconnect()
	// Nothing answered since: the next move waits twice as long.
	if step(3*time.Second) || step(4*time.Second) || step(30*time.Second) {
		t.Fatal("moved again within 60 s of the second move")
	}
	if !step(23 * time.Second) {
		t.Fatal("did not move 60 s after the second move")
	}
	awaitReconnect()
	// An answer ends the run and the doubling; this run's random part is half a second.
	APIAnswered(nc)
	jitter = 0.5
	if step(30*time.Second) || step(3*time.Second) || step(2*time.Second) {
		t.Fatal("moved before 5.5 s of timeouts")
	}
	if !step(time.Second) {
		t.Fatal("did not move after 6 s of timeouts, 30 s after the last move")
	}
}
