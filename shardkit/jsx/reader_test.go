package jsx_test

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/tenantmesh/tenantmesh/internal/embednats/natstest"
	"github.com/tenantmesh/tenantmesh/shardkit/jsx"
)

// readN reads n messages and checks they are m<from>..m<from+n-1>, in order: no gap, no
// duplicate.
func readN(t *testing.T, r *jsx.Reader, from, n int, within time.Duration) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), within)
	defer cancel()
	for i := from; i < from+n; i++ {
		m, md, err := r.Next(ctx)
		if err != nil {
			t.Fatalf("reading m%d: %v", i, err)
		}
		if got := string(m.Data()); got != "m"+strconv.Itoa(i) || md.Sequence.Stream != uint64(i) {
			t.Fatalf("got %s at sequence %d, want m%d at %d", got, md.Sequence.Stream, i, i)
		}
	}
}

func publish(t *testing.T, js jetstream.JetStream, from, n int) {
	t.Helper()
	for i := from; i < from+n; i++ {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		for {
			// After a server stop the stream may be electing a leader: try again.
			actx, acancel := context.WithTimeout(ctx, 2*time.Second)
			_, err := js.Publish(actx, "r.x", []byte("m"+strconv.Itoa(i)), jetstream.WithMsgID("m"+strconv.Itoa(i)))
			acancel()
			if err == nil {
				break
			}
			if ctx.Err() != nil {
				t.Fatalf("publish m%d: %v", i, err)
			}
		}
		cancel()
	}
}

// consumers lists the stream's consumers and the servers they live on.
func consumers(t *testing.T, js jetstream.JetStream, stream string) map[string]string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	st, err := js.Stream(ctx, stream)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]string{}
	l := st.ListConsumers(ctx)
	for info := range l.Info() {
		server := ""
		if info.Cluster != nil {
			server = info.Cluster.Leader
		}
		out[info.Name] = server
	}
	if err := l.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// A reader whose consumer is deleted under it makes another and goes on after the last
// message it returned; Stop deletes its consumer.
func TestReaderResumesAfterItsConsumerIsDeleted(t *testing.T) {
	srv := natstest.Server(t)
	nc := natstest.Connect(t, srv.URL())
	js, _ := jetstream.New(nc)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "R", Subjects: []string{"r.>"}}); err != nil {
		t.Fatal(err)
	}
	publish(t, js, 1, 10)
	r, err := jsx.Read(ctx, js, "R", jsx.ReadConfig{Filters: []string{"r.>"}, Start: 3, Batch: 4})
	if err != nil {
		t.Fatal(err)
	}
	if r.Pending() != 8 {
		t.Errorf("pending = %d, want 8 (m3..m10)", r.Pending())
	}
	readN(t, r, 3, 5, 10*time.Second)
	for name := range consumers(t, js, "R") {
		if err := js.DeleteConsumer(ctx, "R", name); err != nil {
			t.Fatal(err)
		}
	}
	publish(t, js, 11, 5)
	readN(t, r, 8, 8, 20*time.Second)
	r.Stop()
	// Stop deletes the consumer in the background: polling the stream's list, no event to
	// await.
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		left := consumers(t, js, "R")
		if len(left) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("consumers left 10 s after Stop: %v", left)
		}
	}
	if _, _, err := r.Next(ctx); err != jetstream.ErrMsgIteratorClosed {
		t.Errorf("Next after Stop = %v, want ErrMsgIteratorClosed", err)
	}
}

// TestReaderLeavesAStoppedServer stops the server a reader's consumer lives on (not its
// connection's) while it reads, and after the reader was made and before its first read: it
// makes its consumer again on a server still up and reads on without gap or duplicate. In
// both, the stream leader advisory that lists the server offline makes it make its consumer
// again: heartbeats of 14 s would take 28 s, past the test's wait. The reader is made before
// the stream has messages, so its consumer has nothing to deliver when made and the first
// message's short wait does not cover for the advisory (it did by chance until CI's run on
// 51133aa made a reader on a replica that had not yet stored them, and the advisory heard
// before the first read was dropped).
func TestReaderLeavesAStoppedServer(t *testing.T) {
	for _, tc := range []struct {
		name      string
		readFirst bool
	}{{"while reading", true}, {"before the first read", false}} {
		t.Run(tc.name, func(t *testing.T) { readerLeavesAStoppedServer(t, tc.readFirst) })
	}
}

func readerLeavesAStoppedServer(t *testing.T, readFirst bool) {
	c, ajs, ctx := clusterR3(t, 90*time.Second)
	admin := ajs.Conn()

	// A reader connected to one server whose consumer lives on another (placement is random:
	// a few tries).
	names := map[string]int{}
	for i, s := range c.Servers {
		names[s.Name()] = i
	}
	var (
		r        *jsx.Reader
		nc       *nats.Conn
		stopped  = -1
		connName string
	)
	for try := 0; try < 12 && stopped < 0; try++ {
		if r != nil {
			r.Stop()
		}
		via := try % len(c.Servers)
		nc = natstest.Connect(t, fmt.Sprintf("nats://127.0.0.1:%d", c.Configs[via].Port), nats.NoReconnect())
		connName = nc.ConnectedServerName()
		js, _ := jetstream.New(nc)
		var err error
		if r, err = jsx.Read(ctx, js, "R", jsx.ReadConfig{Filters: []string{"r.>"}, Heartbeat: 14 * time.Second}); err != nil {
			t.Fatal(err)
		}
		for _, server := range consumers(t, ajs, "R") {
			if server != "" && server != connName {
				stopped = names[server]
			}
		}
	}
	defer r.Stop()
	if stopped < 0 {
		t.Fatal("no reader had its consumer on another server than its connection's in 12 tries")
	}
	if r.Pending() != 0 {
		t.Fatalf("pending = %d before any publish", r.Pending())
	}
	publish(t, ajs, 1, 3)
	from := 1
	if readFirst {
		readN(t, r, 1, 3, 20*time.Second)
		from = 4
	}
	// The reader's connection hears the advisories; this watch on it tells when one has listed
	// the server offline (the reader's own watch has then heard it too).
	heard := make(chan struct{})
	var once sync.Once
	w := jsx.WatchServers(nc, func(_ string, offline []string) {
		if slices.Contains(offline, c.Servers[stopped].Name()) {
			once.Do(func() { close(heard) })
		}
	})
	defer w.Leave()
	// The stream's leader moves to that server (if it is not there already), so that its stop
	// elects a new one: the advisory the reader hears.
	if _, err := admin.Request("$JS.API.STREAM.LEADER.STEPDOWN.R",
		[]byte(`{"placement":{"preferred":"`+c.Servers[stopped].Name()+`"}}`), 5*time.Second); err != nil {
		t.Fatal(err)
	}
	c.Servers[stopped].Stop()
	select {
	case <-heard:
	case <-time.After(20 * time.Second):
		t.Fatal("no stream leader advisory listed the stopped server offline within 20s")
	}
	for i := range c.Servers {
		if i != stopped && c.Servers[i].Name() != connName {
			wnc := natstest.Connect(t, fmt.Sprintf("nats://127.0.0.1:%d", c.Configs[i].Port))
			wjs, _ := jetstream.New(wnc)
			publish(t, wjs, 4, 3)
			break
		}
	}
	readN(t, r, from, 7-from, 20*time.Second)
}

// TestAwaitPulls makes consumers on other servers than their connection's and pulls from each
// at once after AwaitPulls: every first pull must be heard. Without the wait, about 3% of such
// first pulls are answered "no responders" (the consumer's pull subject not yet known on the
// connection's server), which nats.go's iterator ignores until two heartbeats are missed: with
// 14 s heartbeats, past the test's wait.
func TestAwaitPulls(t *testing.T) {
	c, ajs, ctx := clusterR3(t, 120*time.Second)
	publish(t, ajs, 1, 1)
	var jss []jetstream.JetStream
	for i := range c.Servers {
		js, _ := jetstream.New(natstest.Connect(t, fmt.Sprintf("nats://127.0.0.1:%d", c.Configs[i].Port)))
		jss = append(jss, js)
	}
	cross := 0
	for i := 0; cross < 100 && i < 1000; i++ {
		js := jss[i%len(jss)]
		deliver := jetstream.DeliverAllPolicy
		if i%2 == 1 { // as kvwatch's followers start
			deliver = jetstream.DeliverLastPerSubjectPolicy
		}
		cons, err := js.CreateConsumer(ctx, "R", jetstream.ConsumerConfig{AckPolicy: jetstream.AckNonePolicy,
			MemoryStorage: true, Replicas: 1, InactiveThreshold: 5 * time.Second, FilterSubject: "r.>", DeliverPolicy: deliver})
		if err != nil {
			t.Fatal(err)
		}
		if jsx.ConsumerServer(cons.CachedInfo()) == js.Conn().ConnectedServerName() {
			continue
		}
		cross++
		if err := jsx.AwaitPulls(ctx, js.Conn(), "R", cons.CachedInfo(), 5*time.Second); err != nil {
			t.Fatal(err)
		}
		it, err := cons.Messages(jetstream.PullHeartbeat(14*time.Second), jetstream.WithMessagesErrOnMissingHeartbeat(true))
		if err != nil {
			t.Fatal(err)
		}
		nctx, ncancel := context.WithTimeout(ctx, 10*time.Second)
		m, err := it.Next(jetstream.NextContext(nctx))
		ncancel()
		it.Stop()
		if err != nil {
			t.Fatalf("consumer %d (on %s, pulled through %s): first message: %v", cross, jsx.ConsumerServer(cons.CachedInfo()),
				js.Conn().ConnectedServerName(), err)
		}
		md, err := m.Metadata()
		if err != nil {
			t.Fatal(err)
		}
		if string(m.Data()) != "m1" || md.Sequence.Consumer != 1 {
			t.Fatalf("first message %q, consumer sequence %d, want m1 at 1 (%s: the probe must not take or skip it)",
				m.Data(), md.Sequence.Consumer, deliver)
		}
		_ = js.DeleteConsumer(ctx, "R", cons.CachedInfo().Name)
	}
	if cross < 100 {
		t.Fatalf("only %d consumers landed on another server than their connection's", cross)
	}
}

// clusterR3 starts a 3-node cluster with stream R (r.>, 3 replicas, memory), and returns it, a
// JetStream connected to every server, and a context that ends within d (or with the test).
func clusterR3(t *testing.T, d time.Duration) (*natstest.Cluster, jetstream.JetStream, context.Context) {
	t.Helper()
	c := natstest.NewCluster(t)
	js, _ := jetstream.New(natstest.Connect(t, c.URLs()))
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	for {
		// Right after start-up, the meta leader may not know every peer yet ("no suitable
		// peers for placement"): polling, no event to await.
		actx, acancel := context.WithTimeout(ctx, 5*time.Second)
		_, err := js.CreateStream(actx, jetstream.StreamConfig{Name: "R", Subjects: []string{"r.>"}, Replicas: 3, Storage: jetstream.MemoryStorage})
		acancel()
		if err == nil {
			return c, js, ctx
		}
		if ctx.Err() != nil {
			t.Fatal(err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}
