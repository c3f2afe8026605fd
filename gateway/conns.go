package gateway

import (
	"net"
	"sync"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
)

// connLimiter counts the client connections open, overall and per address, and refuses one
// beyond Config.MaxConns or MaxConnsPerIP: a client cannot take every file descriptor and
// goroutine the gateway has by opening connections (Envoy's and nginx's connection limits).
type connLimiter struct {
	max, perIP int // <= 0: no bound
	refused    *prometheus.CounterVec

	mu    sync.Mutex
	total int
	byIP  map[string]int
}

func newConnLimiter(cfg Config) *connLimiter {
	return &connLimiter{max: cfg.MaxConns, perIP: cfg.MaxConnsPerIP, byIP: map[string]int{}}
}

// acquire counts a new connection from ip; false: it is over a bound and must be closed.
func (l *connLimiter) acquire(ip string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.max > 0 && l.total >= l.max {
		l.refused.WithLabelValues("total").Inc()
		return false
	}
	if l.perIP > 0 && l.byIP[ip] >= l.perIP {
		l.refused.WithLabelValues("per_ip").Inc()
		return false
	}
	l.total++
	l.byIP[ip]++
	return true
}

// release uncounts a connection from ip.
func (l *connLimiter) release(ip string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.total--
	if n := l.byIP[ip] - 1; n > 0 {
		l.byIP[ip] = n
	} else {
		delete(l.byIP, ip)
	}
}

// open is the number of connections counted now.
func (l *connLimiter) open() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.total
}

// remoteIP is the address part of c's remote address.
func remoteIP(c net.Conn) string {
	ip, _, err := net.SplitHostPort(c.RemoteAddr().String())
	if err != nil {
		return c.RemoteAddr().String()
	}
	return ip
}

// limitListener applies the limiter to the connections net/http's server accepts (TLS
// listeners): one over a bound is closed at once, the others are uncounted when closed.
type limitListener struct {
	net.Listener
	l *connLimiter
}

func (ll limitListener) Accept() (net.Conn, error) {
	for {
		c, err := ll.Listener.Accept()
		if err != nil {
			return nil, err
		}
		ip := remoteIP(c)
		if !ll.l.acquire(ip) {
			c.Close()
			continue
		}
		return &countedConn{Conn: c, release: func() { ll.l.release(ip) }}, nil
	}
}

// countedConn uncounts itself once, when closed.
type countedConn struct {
	net.Conn
	closed  atomic.Bool
	release func()
}

func (c *countedConn) Close() error {
	if c.closed.CompareAndSwap(false, true) {
		c.release()
	}
	return c.Conn.Close()
}
