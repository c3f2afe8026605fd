package gateway

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"sync"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// upstream is the send stage's HTTP/2 side, the engine's own (docs/decisions.md, "gRPC end to
// end"): connections to instances (h2c with prior knowledge to http:// ones, h2 by ALPN to
// https:// ones), each carrying many calls (streams) at once, with one goroutine per
// connection reading its frames and handing each stream's to the call that waits for it;
// calls write their frames into the connection's output (h2out), batched per write. Flow
// control both ways: a call's DATA waits for the instance's windows; what the instance sends
// is credited back (WINDOW_UPDATE) as the call relays it, so a stream buffers at most its
// window here. It also keeps the calls under way by instance, so that a takeover can abandon
// a tenant's (as engine.abandon does for HTTP/1.1).
type upstream struct {
	cfg Config

	mu      sync.Mutex
	conns   map[string][]*h2conn // by scheme://host
	dials   map[string]*h2dial
	calls   map[string]map[*h2call]struct{} // by host
	closed  bool
	started bool
	stop    chan struct{}
	wg      sync.WaitGroup // the connections' readers and the housekeeping loop
}

// h2call is one attempt under way.
type h2call struct {
	tenant string
	cancel context.CancelCauseFunc
}

// The upstream side's windows: what one stream, and one connection, may have buffered here.
const (
	upStreamWindow = 1 << 20
	upConnWindow   = 16 << 20
	// upMaxStreams bounds the streams of one connection whatever the instance allows.
	upMaxStreams = 1000
	// upIdle: a connection without streams this long is closed; upPingAfter: a connection
	// with streams that has been silent this long is pinged, and closed when the ping is not
	// answered within upPingTimeout.
	upIdle        = 90 * time.Second
	upPingAfter   = 15 * time.Second
	upPingTimeout = 5 * time.Second
)

// errStreamRefused: the instance refused the stream (RST_STREAM REFUSED_STREAM, or past a
// GOAWAY's last stream): it never reached the service, so any call may go again.
var errStreamRefused = errors.New("the instance refused the stream before processing it")

var errUpstreamClosed = errors.New("the gateway is stopping")

func newUpstream(cfg Config) *upstream {
	return &upstream{cfg: cfg, conns: map[string][]*h2conn{}, dials: map[string]*h2dial{},
		calls: map[string]map[*h2call]struct{}{}, stop: make(chan struct{})}
}

func (u *upstream) add(host string, c *h2call) {
	u.mu.Lock()
	m := u.calls[host]
	if m == nil {
		m = map[*h2call]struct{}{}
		u.calls[host] = m
	}
	m[c] = struct{}{}
	u.mu.Unlock()
}

func (u *upstream) remove(host string, c *h2call) {
	u.mu.Lock()
	if m := u.calls[host]; m != nil {
		delete(m, c)
		if len(m) == 0 {
			delete(u.calls, host)
		}
	}
	u.mu.Unlock()
}

// abandon ends tenant's calls under way with the instance at host (errAbandoned).
func (u *upstream) abandon(host, tenant string) int {
	u.mu.Lock()
	defer u.mu.Unlock()
	n := 0
	for c := range u.calls[host] {
		if c.tenant == tenant {
			c.cancel(errAbandoned)
			n++
		}
	}
	return n
}

// close ends every connection and the housekeeping loop, and waits for their goroutines.
func (u *upstream) close() {
	u.mu.Lock()
	if !u.closed {
		u.closed = true
		close(u.stop)
	}
	var all []*h2conn
	for _, cs := range u.conns {
		all = append(all, cs...)
	}
	u.mu.Unlock()
	for _, c := range all {
		c.fail(errUpstreamClosed)
	}
	u.wg.Wait()
}

// h2dial is a connection being made; the calls that need it wait for it.
type h2dial struct {
	done chan struct{}
	c    *h2conn
	err  error
}

// open reserves a stream on a connection to the instance at u (scheme and host), making one
// if none has room.
func (up *upstream) open(ctx context.Context, u *url.URL) (*h2stream, error) {
	key := u.Scheme + "://" + u.Host
	for {
		up.mu.Lock()
		if up.closed {
			up.mu.Unlock()
			return nil, errUpstreamClosed
		}
		for _, c := range up.conns[key] {
			if s := c.reserve(); s != nil {
				up.mu.Unlock()
				return s, nil
			}
		}
		d := up.dials[key]
		if d == nil {
			d = &h2dial{done: make(chan struct{})}
			up.dials[key] = d
			if !up.started {
				up.started = true
				up.wg.Add(1)
				go up.housekeep()
			}
			up.wg.Add(1)
			go up.dial(key, u, d)
		}
		up.mu.Unlock()
		select {
		case <-d.done:
		case <-ctx.Done():
			return nil, context.Cause(ctx)
		}
		if d.err != nil {
			return nil, d.err
		}
	}
}

// dial makes a connection for key and adds it to the pool.
func (up *upstream) dial(key string, u *url.URL, d *h2dial) {
	defer up.wg.Done()
	c, err := up.connect(u)
	up.mu.Lock()
	delete(up.dials, key)
	if err == nil && up.closed {
		err = errUpstreamClosed
	}
	if err == nil {
		c.key = key
		up.conns[key] = append(up.conns[key], c)
		up.wg.Add(1)
		go c.readLoop()
	}
	d.c, d.err = c, err
	up.mu.Unlock()
	if err != nil && c != nil {
		c.nc.Close()
	}
	close(d.done)
}

func (up *upstream) connect(u *url.URL) (*h2conn, error) {
	ctx, cancel := context.WithTimeout(context.Background(), up.cfg.ConnectTimeout+time.Second)
	defer cancel()
	nd := net.Dialer{Timeout: up.cfg.ConnectTimeout, KeepAlive: 30 * time.Second}
	nc, err := nd.DialContext(ctx, "tcp", u.Host)
	if err != nil {
		return nil, err
	}
	if u.Scheme == "https" {
		tc := tls.Client(nc, &tls.Config{RootCAs: up.cfg.UpstreamCAs, ServerName: u.Hostname(), NextProtos: []string{"h2"}, MinVersion: tls.VersionTLS12})
		if err := tc.HandshakeContext(ctx); err != nil {
			nc.Close()
			return nil, err
		}
		if p := tc.ConnectionState().NegotiatedProtocol; p != "h2" {
			nc.Close()
			return nil, fmt.Errorf("instance %s does not speak HTTP/2 over TLS (ALPN %q)", u.Host, p)
		}
		nc = tc
	}
	c := &h2conn{up: up, nc: nc, streams: map[uint32]*h2stream{}, nextID: 1, peerMax: upMaxStreams,
		peerWindow: h2DefaultWindow, peerMaxFrame: h2DefaultMaxFrame, sendWindow: h2DefaultWindow,
		recvAvail: upConnWindow}
	c.wdl = writeDeadline{c: nc, d: up.cfg.WriteTimeout}
	// A sock serves one reader and one writer only if they are not at once: the reader and
	// the writers get one each.
	c.out.init(&c.mu, ioOf(nc), &c.wdl)
	c.windowCond.L = &c.mu
	c.rd = bufio.NewReaderSize(ioOf(nc), 32<<10)
	c.fr = http2.NewFramer(nil, c.rd)
	c.fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	c.fr.MaxHeaderListSize = 1 << 20
	c.fr.SetMaxReadFrameSize(h2DefaultMaxFrame)
	c.fr.SetReuseFrames()
	c.heardAt = time.Now()
	c.mu.Lock()
	b := append(c.out.buf, http2.ClientPreface...)
	b = appendSettings(b, setEnablePush, 0, setInitialWindowSize, upStreamWindow, setMaxHeaderListSize, 1<<20)
	b = appendWindowUpdate(b, 0, upConnWindow-h2DefaultWindow)
	c.out.buf = b
	err = c.out.flushLocked()
	c.mu.Unlock()
	if err != nil {
		nc.Close()
		return nil, err
	}
	return c, nil
}

// housekeep closes idle connections and pings silent ones, until the upstream closes.
func (up *upstream) housekeep() {
	defer up.wg.Done()
	t := time.NewTicker(upPingTimeout / 2)
	defer t.Stop()
	for {
		select {
		case <-up.stop:
			return
		case <-t.C:
		}
		now := time.Now()
		up.mu.Lock()
		var check []*h2conn
		for _, cs := range up.conns {
			check = append(check, cs...)
		}
		up.mu.Unlock()
		for _, c := range check {
			c.housekeep(now)
		}
	}
}

// h2conn is one HTTP/2 connection to an instance.
type h2conn struct {
	up  *upstream
	key string
	nc  net.Conn
	rd  *bufio.Reader
	fr  *http2.Framer
	wdl writeDeadline

	mu           sync.Mutex
	out          h2out
	windowCond   sync.Cond // signalled when a send window opens or the connection fails
	streams      map[uint32]*h2stream
	nextID       uint32
	active       int   // streams open or reserved
	peerMax      int   // the instance's MAX_CONCURRENT_STREAMS (at most upMaxStreams)
	peerWindow   int64 // the instance's initial stream window
	peerMaxFrame int   // the instance's MAX_FRAME_SIZE
	sendWindow   int64 // the connection's send window
	recvAvail    int64 // what the instance may still send on the connection
	recvUnacked  int64 // relayed, not yet credited
	goaway       bool  // no new streams (GOAWAY received, or failing)
	dead         error // the connection failed
	scratch      []byte
	// Liveness, without a clock read per frame: the frames read, and what housekeeping
	// last saw of them (when the count last moved, a ping sent, since when no stream).
	frames     uint64
	seenFrames uint64
	heardAt    time.Time
	pingAt     time.Time
	idleAt     time.Time
}

// reserve takes a stream slot if the connection has one (up.mu held).
func (c *h2conn) reserve() *h2stream {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.goaway || c.dead != nil || c.active >= c.peerMax || c.nextID >= 1<<31-1 {
		return nil
	}
	c.active++
	s := upStreams.Get().(*h2stream)
	s.c = c
	return s
}

// upStreams keeps streams (and their buffers) for the next calls.
var upStreams = sync.Pool{New: func() any { return &h2stream{notify: make(chan struct{}, 1)} }}

// housekeep closes c when idle too long, pings it when silent, fails it when a ping is not
// answered.
func (c *h2conn) housekeep(now time.Time) {
	c.mu.Lock()
	if c.frames != c.seenFrames {
		c.seenFrames, c.heardAt, c.pingAt = c.frames, now, time.Time{}
	}
	switch {
	case c.active > 0:
		c.idleAt = time.Time{}
	case c.idleAt.IsZero():
		c.idleAt = now
	case now.Sub(c.idleAt) > upIdle:
		c.mu.Unlock()
		c.fail(errors.New("idle"))
		return
	}
	switch {
	case !c.pingAt.IsZero() && now.Sub(c.pingAt) > upPingTimeout:
		c.mu.Unlock()
		c.fail(errors.New("the instance did not answer a ping"))
		return
	case c.active > 0 && c.pingAt.IsZero() && now.Sub(c.heardAt) > upPingAfter:
		c.pingAt = now
		c.out.buf = appendFrameHeader(c.out.buf, 8, frPing, 0, 0)
		c.out.buf = append(c.out.buf, 't', 'm', 'p', 'i', 'n', 'g', 0, 0)
		_ = c.out.flushLocked()
	}
	c.mu.Unlock()
}

// fail ends the connection and every stream on it with err.
func (c *h2conn) fail(err error) {
	c.mu.Lock()
	if c.dead != nil {
		c.mu.Unlock()
		return
	}
	c.dead, c.goaway = err, true
	for _, s := range c.streams {
		if s.err == nil {
			s.err = err
		}
		s.wake()
	}
	c.windowCond.Broadcast()
	c.mu.Unlock()
	c.nc.Close()
	c.up.mu.Lock()
	cs := c.up.conns[c.key]
	for i, x := range cs {
		if x == c {
			cs = append(cs[:i], cs[i+1:]...)
			break
		}
	}
	if len(cs) == 0 {
		delete(c.up.conns, c.key)
	} else {
		c.up.conns[c.key] = cs
	}
	c.up.mu.Unlock()
}

// readLoop reads the instance's frames until the connection fails.
func (c *h2conn) readLoop() {
	defer c.up.wg.Done()
	for {
		f, err := c.fr.ReadFrame()
		if err != nil {
			var se http2.StreamError
			if errors.As(err, &se) {
				c.mu.Lock()
				if s := c.streams[se.StreamID]; s != nil {
					c.resetLocked(s, uint32(se.Code), fmt.Errorf("the instance's answer is not valid HTTP/2: %w", err))
				}
				c.mu.Unlock()
				continue
			}
			var ce http2.ConnectionError
			if errors.As(err, &ce) {
				c.mu.Lock()
				c.out.buf = appendGoAway(c.out.buf, 0, uint32(ce), "")
				_ = c.out.flushLocked()
				c.mu.Unlock()
			}
			c.fail(fmt.Errorf("connection to the instance: %w", err))
			return
		}
		c.mu.Lock()
		c.frames++
		err = c.frameLocked(f)
		if err == nil && c.rd.Buffered() == 0 && len(c.out.buf) > 0 {
			_ = c.out.flushLocked()
		}
		c.mu.Unlock()
		if err != nil {
			c.fail(err)
			return
		}
		if _, ok := f.(*http2.GoAwayFrame); ok {
			c.up.forget(c) // no new streams on c; its streams under way finish
		}
	}
}

// frameLocked handles one frame (c.mu held).
func (c *h2conn) frameLocked(f http2.Frame) error {
	switch f := f.(type) {
	case *http2.MetaHeadersFrame:
		s := c.streams[f.StreamID]
		if s == nil {
			return nil
		}
		if f.Truncated {
			c.resetLocked(s, errCodeProtocol, errors.New("the instance's header list is too large"))
			return nil
		}
		if !s.gotHead {
			st := f.PseudoValue("status")
			if len(st) == 3 && st[0] == '1' {
				return nil // an informational answer: the final one follows
			}
			s.gotHead, s.head, s.status = true, f.RegularFields(), 0
			for _, ch := range []byte(st) {
				s.status = s.status*10 + int(ch-'0')
			}
		} else {
			s.trailer = f.RegularFields()
			if !f.StreamEnded() {
				c.resetLocked(s, errCodeProtocol, errors.New("the instance sent trailers without ending the stream"))
				return nil
			}
		}
		if f.StreamEnded() {
			s.ended = true
		}
		s.wake()
	case *http2.DataFrame:
		n := int64(f.Header().Length)
		if n > c.recvAvail {
			return errors.New("the instance sent past the connection's window")
		}
		c.recvAvail -= n
		s := c.streams[f.StreamID]
		if s == nil || s.err != nil || s.ended {
			c.creditLocked(nil, n) // nobody will read it
			return nil
		}
		if n > s.recvAvail {
			c.creditLocked(nil, n)
			c.resetLocked(s, errCodeFlowControl, errors.New("the instance sent past the stream's window"))
			return nil
		}
		s.recvAvail -= n
		d := f.Data()
		s.data = append(s.data, d...)
		if pad := n - int64(len(d)); pad > 0 {
			c.creditLocked(nil, pad)
			s.recvAvail += pad // padding is credited at once
		}
		if f.StreamEnded() {
			s.ended = true
		}
		s.wake()
	case *http2.WindowUpdateFrame:
		inc := int64(f.Increment)
		if f.StreamID == 0 {
			if c.sendWindow+inc > h2MaxWindow {
				return errors.New("the instance's connection window overflowed")
			}
			c.sendWindow += inc
		} else if s := c.streams[f.StreamID]; s != nil {
			if s.sendWindow+inc > h2MaxWindow {
				c.resetLocked(s, errCodeFlowControl, errors.New("the instance's stream window overflowed"))
				return nil
			}
			s.sendWindow += inc
		}
		c.windowCond.Broadcast()
	case *http2.RSTStreamFrame:
		if s := c.streams[f.StreamID]; s != nil {
			err := error(http2.StreamError{StreamID: f.StreamID, Code: f.ErrCode})
			if f.ErrCode == http2.ErrCodeRefusedStream {
				err = errStreamRefused
			}
			if s.err == nil {
				s.err = err
			}
			c.removeLocked(s)
			s.wake()
			c.windowCond.Broadcast()
		}
	case *http2.SettingsFrame:
		if f.IsAck() {
			return nil
		}
		err := f.ForeachSetting(func(st http2.Setting) error {
			switch st.ID {
			case http2.SettingMaxConcurrentStreams:
				c.peerMax = int(min(st.Val, upMaxStreams))
			case http2.SettingInitialWindowSize:
				d := int64(st.Val) - c.peerWindow
				c.peerWindow = int64(st.Val)
				for _, s := range c.streams {
					s.sendWindow += d
				}
			case http2.SettingMaxFrameSize:
				c.peerMaxFrame = int(st.Val)
			}
			return nil
		})
		if err != nil {
			return err
		}
		c.out.buf = appendFrameHeader(c.out.buf, 0, frSettings, flAck, 0)
		c.windowCond.Broadcast()
	case *http2.PingFrame:
		if !f.IsAck() {
			c.out.buf = appendFrameHeader(c.out.buf, 8, frPing, flAck, 0)
			c.out.buf = append(c.out.buf, f.Data[:]...)
		}
	case *http2.GoAwayFrame:
		c.goaway = true
		for id, s := range c.streams {
			if id > f.LastStreamID && s.err == nil {
				s.err = errStreamRefused
				s.wake()
			}
		}
		c.windowCond.Broadcast()
	case *http2.PushPromiseFrame:
		return errors.New("the instance pushed a stream (push is disabled)")
	}
	return nil
}

// forget takes c out of the pool (no new streams); it is closed when its last stream ends.
func (up *upstream) forget(c *h2conn) {
	up.mu.Lock()
	cs := up.conns[c.key]
	for i, x := range cs {
		if x == c {
			up.conns[c.key] = append(cs[:i:i], cs[i+1:]...)
			break
		}
	}
	if len(up.conns[c.key]) == 0 {
		delete(up.conns, c.key)
	}
	up.mu.Unlock()
	c.mu.Lock()
	idle := c.active == 0
	c.mu.Unlock()
	if idle {
		c.fail(errors.New("the instance sent GOAWAY"))
	}
}

// creditLocked returns n bytes to the instance's windows: the connection's always, s's if
// it is still open. WINDOW_UPDATEs go once a quarter of a window is owed.
func (c *h2conn) creditLocked(s *h2stream, n int64) {
	c.recvUnacked += n
	if c.recvUnacked >= upConnWindow/4 {
		c.out.buf = appendWindowUpdate(c.out.buf, 0, uint32(c.recvUnacked))
		c.recvAvail += c.recvUnacked
		c.recvUnacked = 0
	}
	if s != nil && s.id != 0 && !s.ended && s.err == nil {
		s.recvUnacked += n
		if s.recvUnacked >= upStreamWindow/4 {
			c.out.buf = appendWindowUpdate(c.out.buf, s.id, uint32(s.recvUnacked))
			s.recvAvail += s.recvUnacked
			s.recvUnacked = 0
		}
	}
}

// resetLocked ends s with err, telling the instance (RST_STREAM code).
func (c *h2conn) resetLocked(s *h2stream, code uint32, err error) {
	if s.err == nil {
		s.err = err
	}
	if s.id != 0 {
		c.out.buf = appendRST(c.out.buf, s.id, code)
	}
	c.removeLocked(s)
	s.wake()
	c.windowCond.Broadcast()
}

// removeLocked takes s off the connection (once).
func (c *h2conn) removeLocked(s *h2stream) {
	if s.removed {
		return
	}
	s.removed = true
	if s.id != 0 {
		delete(c.streams, s.id)
	}
	c.active--
	if c.active == 0 && c.goaway && c.dead == nil {
		// The instance said GOAWAY (forget took c out of the pool) and its last stream is
		// done: close it; the reader ends.
		c.dead = errors.New("the instance sent GOAWAY")
		c.nc.Close()
	}
}

// h2stream is one call's stream on an instance's connection. The call's goroutine writes
// its head and body; the connection's reader fills the answer and wakes it.
type h2stream struct {
	c      *h2conn
	id     uint32
	notify chan struct{}
	copier bool // a goroutine of sendBody holds the stream

	// Under c.mu.
	sendWindow  int64
	recvAvail   int64
	recvUnacked int64
	sentEnd     bool
	removed     bool
	gotHead     bool
	status      int
	head        []hpack.HeaderField
	trailer     []hpack.HeaderField
	data        []byte // received, not yet taken
	ended       bool   // END_STREAM received
	err         error  // reset, refused, or the connection failed
	spare       []byte
}

func (s *h2stream) wake() {
	select {
	case s.notify <- struct{}{}:
	default:
	}
}

// writeHead sends the call's header block (encoded, without the frame) and, with end, ends
// the request stream. It registers the stream: ids go out in order.
func (s *h2stream) writeHead(blk []byte, end bool) error {
	c := s.c
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.dead != nil {
		s.err = c.dead
		c.removeLocked(s)
		return c.dead
	}
	s.id = c.nextID
	c.nextID += 2
	s.sendWindow, s.recvAvail = c.peerWindow, upStreamWindow
	c.streams[s.id] = s
	c.out.buf = appendHeaderFrames(c.out.buf, s.id, blk, end, c.peerMaxFrame, &c.scratch)
	s.sentEnd = end
	return nil
}

// writeData sends p (and with end, ends the request stream), waiting for the windows; flush
// sends what is pending first when it must wait.
func (s *h2stream) writeData(p []byte, end bool) error {
	c := s.c
	c.mu.Lock()
	defer c.mu.Unlock()
	for {
		if s.err != nil {
			return s.err
		}
		if c.dead != nil {
			return c.dead
		}
		if len(p) == 0 {
			if end {
				c.out.buf = appendFrameHeader(c.out.buf, 0, frData, flEndStream, s.id)
				s.sentEnd = true
			}
			return nil
		}
		n := int64(min(len(p), c.peerMaxFrame))
		n = min(n, s.sendWindow, c.sendWindow)
		if n <= 0 {
			if len(c.out.buf) > 0 { // the instance must see what it has, to credit more
				if err := c.out.flushLocked(); err != nil {
					return err
				}
				continue // the lock was let go: look at the windows again
			}
			c.windowCond.Wait()
			continue
		}
		if err := c.out.roomLocked(); err != nil {
			return err
		}
		last := end && int(n) == len(p)
		var fl byte
		if last {
			fl = flEndStream
			s.sentEnd = true
		}
		c.out.buf = appendFrameHeader(c.out.buf, int(n), frData, fl, s.id)
		c.out.buf = append(c.out.buf, p[:n]...)
		s.sendWindow -= n
		c.sendWindow -= n
		p = p[n:]
		if last {
			return nil
		}
	}
}

// flush sends what is pending on the connection (with the frames of the other calls of this
// turn).
func (s *h2stream) flush() error { return s.c.out.flush() }

// awaitHead waits for the answer's header block, or the stream's end.
func (s *h2stream) awaitHead(ctx context.Context) error {
	for {
		s.c.mu.Lock()
		got, err := s.gotHead, s.err
		s.c.mu.Unlock()
		if got {
			return nil
		}
		if err != nil {
			return err
		}
		select {
		case <-s.notify:
		case <-ctx.Done():
			return context.Cause(ctx)
		}
	}
}

// next takes what the stream has received since the last call, waiting for something (or
// its end) unless wait is false. The bytes are valid until the next call. eof: the answer
// ended (its trailers are in s.trailer).
func (s *h2stream) next(ctx context.Context, wait bool) (p []byte, eof bool, err error) {
	c := s.c
	for {
		c.mu.Lock()
		if len(s.data) > 0 {
			p, s.data, s.spare = s.data, s.spare[:0], s.data
			n := len(c.out.buf)
			c.creditLocked(s, int64(len(p)))
			if len(c.out.buf) > n { // a WINDOW_UPDATE
				_ = c.out.flushLocked()
			}
			c.mu.Unlock()
			return p, false, nil
		}
		eof, err = s.ended, s.err
		c.mu.Unlock()
		if eof || err != nil || !wait {
			return nil, eof, err
		}
		select {
		case <-s.notify:
		case <-ctx.Done():
			return nil, false, context.Cause(ctx)
		}
	}
}

// done ends the stream: reset if either side is still open, and off the connection.
func (s *h2stream) done() {
	c := s.c
	c.mu.Lock()
	if !s.removed {
		if s.id != 0 && s.err == nil && (!s.ended || !s.sentEnd) && c.dead == nil {
			c.out.buf = appendRST(c.out.buf, s.id, errCodeCancel)
			_ = c.out.flushLocked()
		}
		if s.err == nil {
			s.err = errStreamDone
		}
		c.removeLocked(s)
		c.windowCond.Broadcast()
	}
	c.mu.Unlock()
	if !s.copier { // nothing else holds s: it serves another call
		data, spare, notify := s.data[:0], s.spare[:0], s.notify
		if cap(data) > 64<<10 || cap(spare) > 64<<10 {
			data, spare = nil, nil
		}
		select {
		case <-notify:
		default:
		}
		*s = h2stream{notify: notify, data: data, spare: spare}
		upStreams.Put(s)
	}
}

var errStreamDone = errors.New("the call is over")

// appendHeaderFrames frames an encoded header block as HEADERS and CONTINUATION frames.
func appendHeaderFrames(b []byte, stream uint32, blk []byte, endStream bool, maxFrame int, scratch *[]byte) []byte {
	hb := beginHeaders(b)
	hb.b = append(hb.b, blk...)
	return hb.end(stream, endStream, maxFrame, scratch)
}

// sendBody sends the request stream body: what is ready now goes with the head (batched);
// the rest, if the stream is still open, by a goroutine of its own that ends with the body or
// the stream. ready reports whether body has bytes (or its end) without waiting.
func (s *h2stream) sendBody(body io.Reader, ready func() bool) {
	bp := copyBufs.Get().(*[]byte)
	for ready() {
		n, err := body.Read(*bp)
		if err == io.EOF {
			_ = s.writeData((*bp)[:n], true)
			_ = s.flush()
			copyBufs.Put(bp)
			return
		}
		if n > 0 && s.writeData((*bp)[:n], false) != nil {
			copyBufs.Put(bp)
			return
		}
		if err != nil {
			s.c.mu.Lock()
			s.c.resetLocked(s, errCodeCancel, err)
			_ = s.c.out.flushLocked()
			s.c.mu.Unlock()
			copyBufs.Put(bp)
			return
		}
	}
	_ = s.flush()
	s.copier = true
	go func() {
		defer copyBufs.Put(bp)
		for {
			n, err := body.Read(*bp)
			if err == io.EOF {
				_ = s.writeData((*bp)[:n], true)
				_ = s.flush()
				return
			}
			if n > 0 {
				if s.writeData((*bp)[:n], false) != nil {
					return
				}
				_ = s.flush()
			}
			if err != nil {
				s.c.mu.Lock()
				if !s.removed {
					s.c.resetLocked(s, errCodeCancel, err)
					_ = s.c.out.flushLocked()
				}
				s.c.mu.Unlock()
				return
			}
		}
	}()
}
