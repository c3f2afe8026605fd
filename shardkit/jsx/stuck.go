package jsx

import (
	"math/rand/v2"
	"runtime"
	"sync"
	"time"
	"weak"

	"github.com/nats-io/nats.go"
)

// A NATS server cut from its cluster's meta leader (a node in the minority, or one that has
// rejoined and is still catching up) keeps its clients' connections and answers their core
// traffic, but lets the JetStream API requests that need the cluster time out; nats.go stays
// on it, since the connection is fine. The netfault harness's 2|1 split found a gateway on
// such a node that could not make a consumer for 30 s and more after the heal while the two
// other nodes served. APITimedOut and APIAnswered, called by whoever makes such requests,
// move the connection to another server when its API requests keep timing out.
const (
	// stuckAfter API requests timed out in a row, the first at least stuckFor (plus up to
	// stuckSpread, at random per run) before the last, with none answered in between, make the
	// connection move. The random part spreads a fleet's moves over a second when the whole
	// cluster is without a meta leader and every connection times out at once; more would
	// delay the move of a connection on a node that is truly in the minority.
	stuckAfter  = 3
	stuckFor    = 5 * time.Second
	stuckSpread = time.Second
	// stuckEvery bounds the moves of one connection, doubling up to stuckEveryMax while none of
	// its requests is answered: with the whole cluster without a meta leader, every server
	// times out, and moving buys nothing but a reconnect.
	stuckEvery    = 30 * time.Second
	stuckEveryMax = 8 * stuckEvery
)

// stuckClock is the clock of APITimedOut, stuckJitter its random part in [0, 1) (a test's
// fakes).
var (
	stuckClock  = time.Now
	stuckJitter = rand.Float64
)

// apiHealth is one connection's run of timed-out API requests.
type apiHealth struct {
	mu       sync.Mutex
	timeouts int           // in a row
	first    time.Time     // of the run
	wait     time.Duration // the run's span before a move: stuckFor and its random part
	moved    time.Time     // the last forced reconnect
	streak   int           // moves since a request was last answered
}

// apiHealths is keyed weakly: an entry goes with its connection.
var apiHealths = struct {
	sync.Mutex
	m map[weak.Pointer[nats.Conn]]*apiHealth
}{m: map[weak.Pointer[nats.Conn]]*apiHealth{}}

func healthOf(nc *nats.Conn) *apiHealth {
	k := weak.Make(nc)
	apiHealths.Lock()
	defer apiHealths.Unlock()
	h := apiHealths.m[k]
	if h == nil {
		h = &apiHealth{}
		apiHealths.m[k] = h
		runtime.AddCleanup(nc, func(k weak.Pointer[nats.Conn]) {
			apiHealths.Lock()
			delete(apiHealths.m, k)
			apiHealths.Unlock()
		}, k)
	}
	return h
}

// APITimedOut notes a JetStream API request on nc that got no answer in its bound while nc was
// connected. It reports whether this one moved the connection to another server of the ones
// nc knows (nats.go's reconnect puts the current server last); requests in flight on nc then
// fail and their callers try again, as after any reconnect.
func APITimedOut(nc *nats.Conn) bool {
	if !nc.IsConnected() || len(nc.Servers()) < 2 {
		return false
	}
	h := healthOf(nc)
	now := stuckClock()
	h.mu.Lock()
	if h.timeouts == 0 {
		h.first = now
		h.wait = stuckFor + time.Duration(stuckJitter()*float64(stuckSpread))
	}
	h.timeouts++
	every := min(stuckEvery<<max(h.streak-1, 0), stuckEveryMax)
	move := h.timeouts >= stuckAfter && now.Sub(h.first) >= h.wait &&
		(h.moved.IsZero() || now.Sub(h.moved) >= every)
	if move {
		h.timeouts, h.moved = 0, now
		h.streak++
	}
	h.mu.Unlock()
	return move && nc.ForceReconnect() == nil
}

// APIAnswered notes an answered JetStream API request on nc: its server is not stuck, and the
// next run of timeouts may move it again after stuckEvery.
func APIAnswered(nc *nats.Conn) {
	h := healthOf(nc)
	h.mu.Lock()
	h.timeouts, h.streak = 0, 0
	h.mu.Unlock()
}
