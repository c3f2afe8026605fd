package jsx

import (
	"encoding/json"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
)

// SubjectLeaderElected is where JetStream announces a stream's new leader, with the stream's
// replicas and which of them are offline. A stopping server hands off its stream leaderships,
// so the announcements name it offline within about 100 ms of its stop: a consumer there went
// with it. Readers and kvwatch's followers listen (every role may subscribe to it).
const SubjectLeaderElected = "$JS.EVENT.ADVISORY.STREAM.LEADER_ELECTED.>"

// offlineFor is how long a server an advisory listed offline is not trusted with a consumer:
// one made while the cluster still counts a stopping server as a peer can land on it.
const offlineFor = 10 * time.Second

// ServerWatch hears which NATS servers the stream leader advisories list offline. The watches
// of one connection share one subscription: a process runs many readers and followers, and a
// fleet of a thousand processes would otherwise receive each advisory many thousand times.
type ServerWatch struct {
	l  *serverListener
	fn func(stream string, offline []string)
}

type serverListener struct {
	nc      *nats.Conn
	sub     *nats.Subscription
	watches map[*ServerWatch]struct{} // guarded by serverListeners

	mu      sync.Mutex
	offline map[string]time.Time // servers listed offline, and when
}

var serverListeners = struct {
	sync.Mutex
	m map[*nats.Conn]*serverListener
}{m: map[*nats.Conn]*serverListener{}}

// WatchServers calls fn with each advisory on nc that lists servers offline (the stream it
// announces, the offline servers), from the connection's delivery goroutine: fn must not block.
// Without permission to subscribe, fn is never called and Offline always reports false. Leave
// ends the watch.
func WatchServers(nc *nats.Conn, fn func(stream string, offline []string)) *ServerWatch {
	serverListeners.Lock()
	defer serverListeners.Unlock()
	l := serverListeners.m[nc]
	if l == nil {
		l = &serverListener{nc: nc, watches: map[*ServerWatch]struct{}{}}
		sub, err := nc.Subscribe(SubjectLeaderElected, l.dispatch)
		if err != nil {
			return &ServerWatch{}
		}
		l.sub = sub
		serverListeners.m[nc] = l
	}
	w := &ServerWatch{l: l, fn: fn}
	l.watches[w] = struct{}{}
	return w
}

// Offline reports whether an advisory listed server offline within the last 10 s (and none
// listed it online since).
func (w *ServerWatch) Offline(server string) bool {
	if w.l == nil || server == "" {
		return false
	}
	w.l.mu.Lock()
	defer w.l.mu.Unlock()
	at, ok := w.l.offline[server]
	return ok && time.Since(at) < offlineFor
}

// Leave ends the watch; the connection's last one unsubscribes.
func (w *ServerWatch) Leave() {
	if w.l == nil {
		return
	}
	serverListeners.Lock()
	defer serverListeners.Unlock()
	delete(w.l.watches, w)
	if len(w.l.watches) == 0 && serverListeners.m[w.l.nc] == w.l {
		_ = w.l.sub.Unsubscribe()
		delete(serverListeners.m, w.l.nc)
	}
}

// leaderAdvisory is what a watch reads of a stream leader advisory.
type leaderAdvisory struct {
	Stream   string `json:"stream"`
	Replicas []struct {
		Name    string `json:"name"`
		Offline bool   `json:"offline"`
	} `json:"replicas"`
}

func (l *serverListener) dispatch(m *nats.Msg) {
	var adv leaderAdvisory
	if json.Unmarshal(m.Data, &adv) != nil {
		return
	}
	var offline []string
	l.mu.Lock()
	for _, r := range adv.Replicas {
		switch {
		case r.Offline && l.offline == nil:
			l.offline = map[string]time.Time{r.Name: time.Now()}
			offline = append(offline, r.Name)
		case r.Offline:
			l.offline[r.Name] = time.Now()
			offline = append(offline, r.Name)
		default:
			delete(l.offline, r.Name) // back
		}
	}
	l.mu.Unlock()
	if len(offline) == 0 {
		return
	}
	serverListeners.Lock()
	ws := make([]*ServerWatch, 0, len(l.watches))
	for w := range l.watches {
		ws = append(ws, w)
	}
	serverListeners.Unlock()
	for _, w := range ws {
		w.fn(adv.Stream, offline)
	}
}
