package gateway

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/net/http2"

	"github.com/tenantmesh/tenantmesh/gateway/h1"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// h2server is the engine's own HTTP/2 server for a client connection that opens with the
// HTTP/2 preface on a plaintext listener (h2c with prior knowledge: gRPC clients, h2load,
// curl --http2-prior-knowledge). One goroutine (the front end's, for the connection) reads
// the frames; each stream's request runs the stages on a goroutine of its own, started once
// the frames read in one go are handled (so a call's body is usually there when it starts),
// and writes its answer's frames into the connection's output (h2out), where frames of all
// streams written in one turn leave in one system call. Flow control both ways: a stream may
// send 1 MiB the gateway has not passed on, a connection 4 MiB (credited back as the stages
// read it); an answer's DATA waits for the client's windows. Bounds: --max-streams concurrent
// streams (REFUSED_STREAM beyond, whatever the client was told), --max-header-bytes of header
// list (431), 16 KiB frames, the idle timeout while no stream is open, a ping (answered in
// 15 s) when a connection with open streams is silent that long, --write-timeout on each
// write, and --read-header-timeout for the preface and the client's first SETTINGS. TLS
// listeners keep net/http's server (stdfront.go).
type h2server struct {
	cc  *clientConn
	g   *Gateway
	nc  net.Conn
	cr  countingReader
	rd  *bufio.Reader
	fr  *http2.Framer
	hd  *h2headers
	wdl writeDeadline
	ctx context.Context // ends when the connection does
	end context.CancelFunc
	wg  sync.WaitGroup // the streams' goroutines

	mu           sync.Mutex
	out          h2out
	windowCond   sync.Cond
	streams      map[uint32]*h2fstream
	maxID        uint32 // the highest stream id the client opened
	active       int    // streams whose goroutine runs
	peerWindow   int64
	peerMaxFrame int
	sendWindow   int64
	recvAvail    int64
	recvUnacked  int64
	goaway       bool  // GOAWAY sent or received: no new streams
	dead         error // the connection is done
	starting     []*h2fstream
	scratch      []byte

	dl     time.Time // the read deadline set
	pingAt time.Time // a ping sent to a silent connection, unanswered
}

const (
	frontStreamWindow = 1 << 20
	frontConnWindow   = 4 << 20
	frontPingTimeout  = 15 * time.Second
)

var errStreamReset = errors.New("the client reset the stream")

// countingReader counts the bytes read, so that a read deadline met between frames (nothing
// of the next one read) can be told from one met within a frame.
type countingReader struct {
	r io.Reader
	n int64
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n += int64(n)
	return n, err
}

// serveH2 serves the connection as HTTP/2 (it opened with the preface's first line); it
// returns when the connection is done.
func (cc *clientConn) serveH2() {
	g := cc.f.g
	pending := make([]byte, 0, cc.r.Buffered())
	for cc.r.Buffered() > 0 {
		p, _ := cc.r.Next(cc.r.Buffered())
		pending = append(pending, p...)
	}
	sc := &h2server{cc: cc, g: g, nc: cc.c, streams: map[uint32]*h2fstream{}, peerWindow: h2DefaultWindow,
		peerMaxFrame: h2DefaultMaxFrame, sendWindow: h2DefaultWindow, recvAvail: frontConnWindow}
	sc.ctx, sc.end = context.WithCancel(g.reqCtx)
	sc.wdl = writeDeadline{c: cc.c, d: g.cfg.WriteTimeout, slow: g.metrics.slow}
	sc.out.init(&sc.mu, ioOf(cc.c), &sc.wdl)
	sc.windowCond.L = &sc.mu
	sc.cr.r = io.MultiReader(bytes.NewReader(pending), ioOf(cc.c))
	sc.rd = bufio.NewReaderSize(&sc.cr, 32<<10)
	sc.fr = http2.NewFramer(nil, sc.rd)
	sc.hd = newH2Headers(uint32(g.cfg.MaxHeaderBytes))
	sc.fr.SetMaxReadFrameSize(h2DefaultMaxFrame)
	sc.fr.SetReuseFrames()
	cc.f.mu.Lock()
	cc.h2 = sc
	closing := cc.f.closing.Load()
	cc.f.mu.Unlock()
	if closing {
		return
	}
	err := sc.serve()
	sc.close(err)
}

// serve reads the connection's frames until it ends.
func (sc *h2server) serve() error {
	cfg := &sc.g.cfg
	_ = sc.nc.SetReadDeadline(time.Now().Add(cfg.ReadHeaderTimeout))
	var pre [6]byte
	if _, err := io.ReadFull(sc.rd, pre[:]); err != nil || string(pre[:]) != "SM\r\n\r\n" {
		return errors.New("not the HTTP/2 preface")
	}
	sc.mu.Lock()
	sc.out.buf = appendSettings(sc.out.buf, setMaxConcurrentStreams, uint32(cfg.MaxStreams),
		setInitialWindowSize, frontStreamWindow, setMaxHeaderListSize, uint32(cfg.MaxHeaderBytes))
	sc.out.buf = appendWindowUpdate(sc.out.buf, 0, frontConnWindow-h2DefaultWindow)
	err := sc.out.flushLocked()
	sc.mu.Unlock()
	if err != nil {
		return err
	}
	f, blk, err := sc.hd.readFrame(sc.fr)
	if err != nil {
		return err
	}
	if _, ok := f.(*http2.SettingsFrame); !ok || blk != nil {
		return sc.connError(http2.ConnectionError(errCodeProtocol), "the first frame is not SETTINGS")
	}
	first := true
	for {
		if !first {
			if sc.rd.Buffered() == 0 {
				sc.readDeadline()
			}
			n0, buffered := sc.cr.n, sc.rd.Buffered()
			f, blk, err = sc.hd.readFrame(sc.fr)
			if err != nil {
				var se http2.StreamError
				if errors.As(err, &se) {
					sc.mu.Lock()
					if se.StreamID > sc.maxID && se.StreamID%2 == 1 {
						sc.maxID = se.StreamID
					}
					sc.resetLocked(sc.streams[se.StreamID], se.StreamID, uint32(se.Code))
					sc.mu.Unlock()
					continue
				}
				var ce http2.ConnectionError
				if errors.As(err, &ce) {
					return sc.connError(ce, err.Error())
				}
				if errors.Is(err, http2.ErrFrameTooLarge) {
					return sc.connError(http2.ConnectionError(errCodeFrameSize), err.Error())
				}
				if isTimeout(err) && sc.cr.n == n0 && buffered == 0 && sc.silent() {
					continue // pinged
				}
				return err
			}
		}
		first = false
		sc.mu.Lock()
		sc.pingAt = time.Time{}
		if blk != nil {
			err = sc.headersLocked(blk)
		} else {
			err = sc.frameLocked(f)
		}
		if err == nil && sc.rd.Buffered() == 0 {
			sc.startLocked()
			if len(sc.out.buf) > 0 {
				err = sc.out.flushLocked()
			}
		}
		done := sc.goaway && sc.active == 0
		sc.mu.Unlock()
		if err != nil {
			var ce http2.ConnectionError
			if errors.As(err, &ce) {
				return sc.connError(ce, err.Error())
			}
			return err
		}
		if done {
			return nil
		}
	}
}

// readDeadline bounds the wait for the next frame by the idle timeout (renewed coarsely).
func (sc *h2server) readDeadline() {
	d := sc.g.cfg.IdleTimeout
	now := time.Now()
	if sc.pingAt.IsZero() && sc.dl.Sub(now) > d-d/8 {
		return
	}
	if !sc.pingAt.IsZero() {
		return // the ping's deadline stands
	}
	sc.dl = now.Add(d)
	_ = sc.nc.SetReadDeadline(sc.dl)
}

// silent handles a connection that sent nothing for the idle timeout: without open streams
// it is done (false); with some, it is pinged once (true: read on), and done if still
// silent after frontPingTimeout.
func (sc *h2server) silent() bool {
	sc.mu.Lock()
	defer sc.mu.Unlock()
	if sc.active == 0 || !sc.pingAt.IsZero() {
		sc.out.buf = appendGoAway(sc.out.buf, sc.maxID, errCodeNo, "idle")
		_ = sc.out.flushLocked()
		return false
	}
	sc.pingAt = time.Now()
	sc.dl = sc.pingAt.Add(frontPingTimeout)
	_ = sc.nc.SetReadDeadline(sc.dl)
	sc.out.buf = appendFrameHeader(sc.out.buf, 8, frPing, 0, 0)
	sc.out.buf = append(sc.out.buf, 'g', 'w', 'p', 'i', 'n', 'g', 0, 0)
	return sc.out.flushLocked() == nil
}

// connError ends the connection with a GOAWAY naming code. What the client sent after it is
// read and dropped (up to 256 KiB, for a second) before the connection closes, so that the
// close does not reset it and lose the GOAWAY.
func (sc *h2server) connError(code http2.ConnectionError, why string) error {
	sc.mu.Lock()
	sc.goaway = true
	sc.out.buf = appendGoAway(sc.out.buf, sc.maxID, uint32(code), "")
	err := sc.out.flushLocked()
	sc.mu.Unlock()
	if cw, ok := sc.nc.(interface{ CloseWrite() error }); ok && err == nil && cw.CloseWrite() == nil {
		_ = sc.nc.SetReadDeadline(time.Now().Add(time.Second))
		_, _ = io.CopyN(io.Discard, sc.rd, 256<<10)
	}
	return fmt.Errorf("HTTP/2 connection error %v: %s", http2.ErrCode(code), why)
}

// shutdown (the gateway stopping) tells the client no new streams will be served; the
// connection ends when its streams do.
func (sc *h2server) shutdown() {
	sc.mu.Lock()
	defer sc.mu.Unlock()
	if !sc.goaway && sc.dead == nil {
		sc.goaway = true
		sc.out.buf = appendGoAway(sc.out.buf, sc.maxID, errCodeNo, "")
		_ = sc.out.flushLocked()
	}
	if sc.active == 0 {
		_ = sc.nc.SetReadDeadline(aLongTimeAgo) // the reader ends
	}
}

// close ends every stream, waits for their goroutines and closes the connection.
func (sc *h2server) close(err error) {
	sc.mu.Lock()
	if sc.dead == nil {
		if err == nil {
			err = io.EOF
		}
		sc.dead = err
	}
	for _, s := range sc.streams {
		s.reset = true
		s.wake()
	}
	sc.starting = nil
	sc.windowCond.Broadcast()
	sc.mu.Unlock()
	sc.end()
	sc.nc.Close()
	sc.wg.Wait()
}

// startLocked starts the goroutines of the streams opened by the frames just read.
func (sc *h2server) startLocked() {
	for i, s := range sc.starting {
		sc.wg.Add(1)
		go sc.run(s)
		sc.starting[i] = nil
	}
	sc.starting = sc.starting[:0]
}

// frameLocked handles one frame (sc.mu held); an error ends the connection.
func (sc *h2server) frameLocked(f http2.Frame) error {
	switch f := f.(type) {
	case *http2.DataFrame:
		n := int64(f.Header().Length)
		if n > sc.recvAvail {
			return http2.ConnectionError(errCodeFlowControl)
		}
		sc.recvAvail -= n
		s := sc.streams[f.StreamID]
		if s == nil || s.bodyEnd || s.reset || s.finished {
			sc.creditLocked(nil, n)
			if f.StreamID > sc.maxID {
				return http2.ConnectionError(errCodeProtocol) // DATA on an idle stream
			}
			if s == nil {
				sc.out.buf = appendRST(sc.out.buf, f.StreamID, errCodeStreamClosed)
			}
			return nil
		}
		if n > s.recvAvail {
			sc.creditLocked(nil, n)
			sc.resetLocked(s, s.id, errCodeFlowControl)
			return nil
		}
		s.recvAvail -= n
		d := f.Data()
		s.body = append(s.body, d...)
		if pad := n - int64(len(d)); pad > 0 {
			sc.creditLocked(nil, pad)
			s.recvAvail += pad
		}
		if f.StreamEnded() {
			s.bodyEnd = true
		}
		s.wake()
	case *http2.WindowUpdateFrame:
		inc := int64(f.Increment)
		if f.StreamID == 0 {
			if sc.sendWindow+inc > h2MaxWindow {
				return http2.ConnectionError(errCodeFlowControl)
			}
			sc.sendWindow += inc
		} else if s := sc.streams[f.StreamID]; s != nil {
			if s.sendWindow+inc > h2MaxWindow {
				sc.resetLocked(s, s.id, errCodeFlowControl)
				return nil
			}
			s.sendWindow += inc
		}
		sc.windowCond.Broadcast()
	case *http2.RSTStreamFrame:
		if f.StreamID > sc.maxID {
			return http2.ConnectionError(errCodeProtocol)
		}
		if s := sc.streams[f.StreamID]; s != nil {
			s.reset = true
			if s.cancel != nil {
				s.cancel(errStreamReset)
			}
			s.wake()
			sc.windowCond.Broadcast()
		}
	case *http2.SettingsFrame:
		if f.IsAck() {
			return nil
		}
		err := f.ForeachSetting(func(st http2.Setting) error {
			if err := st.Valid(); err != nil {
				return err
			}
			switch st.ID {
			case http2.SettingInitialWindowSize:
				d := int64(st.Val) - sc.peerWindow
				sc.peerWindow = int64(st.Val)
				for _, s := range sc.streams {
					s.sendWindow += d
				}
			case http2.SettingMaxFrameSize:
				sc.peerMaxFrame = int(st.Val)
			}
			return nil
		})
		if err != nil {
			return err
		}
		sc.out.buf = appendFrameHeader(sc.out.buf, 0, frSettings, flAck, 0)
		sc.windowCond.Broadcast()
	case *http2.PingFrame:
		if !f.IsAck() {
			sc.out.buf = appendFrameHeader(sc.out.buf, 8, frPing, flAck, 0)
			sc.out.buf = append(sc.out.buf, f.Data[:]...)
		}
	case *http2.GoAwayFrame:
		sc.goaway = true
	case *http2.PushPromiseFrame:
		return http2.ConnectionError(errCodeProtocol)
	}
	return nil
}

// headersLocked opens a stream (or takes a request's trailers).
func (sc *h2server) headersLocked(f *h2block) error {
	id := f.stream
	if id%2 == 0 {
		return http2.ConnectionError(errCodeProtocol)
	}
	if id <= sc.maxID {
		s := sc.streams[id]
		if s == nil || s.bodyEnd {
			return http2.ConnectionError(errCodeStreamClosed)
		}
		if !f.endStream { // trailers must end the stream
			sc.resetLocked(s, id, errCodeProtocol)
			return nil
		}
		s.bodyEnd = true // the request's trailers are not forwarded
		s.wake()
		return nil
	}
	sc.maxID = id
	switch {
	case sc.goaway:
		sc.out.buf = appendRST(sc.out.buf, id, errCodeRefusedStream)
		return nil
	case f.truncated:
		sc.statusOnly(id, http.StatusRequestHeaderFieldsTooLarge)
		return nil
	case sc.active >= sc.g.cfg.MaxStreams:
		sc.out.buf = appendRST(sc.out.buf, id, errCodeRefusedStream)
		return nil
	}
	s := &h2fstream{sc: sc, id: id, sendWindow: sc.peerWindow, recvAvail: frontStreamWindow, notify: make(chan struct{}, 1)}
	s.bodyR.s = s
	if f.endStream {
		s.bodyEnd = true
	}
	code := sc.request(s, f)
	if code != 0 {
		if code >= 100 {
			sc.statusOnly(id, code)
		} else {
			sc.out.buf = appendRST(sc.out.buf, id, uint32(code))
		}
		if s.x != nil {
			putExchange(s.x)
		}
		return nil
	}
	sc.streams[id] = s
	sc.active++
	sc.starting = append(sc.starting, s)
	return nil
}

// statusOnly answers a stream with a status and nothing else.
func (sc *h2server) statusOnly(id uint32, status int) {
	hb := headerBlock{b: sc.scratch[:0]}
	hb.status(status)
	blk := append([]byte(nil), hb.b...)
	sc.out.buf = appendHeaderFrames(sc.out.buf, id, blk, true, sc.peerMaxFrame, &sc.scratch)
}

// request fills the stream's exchange from its header block; a code >= 100 is a status to
// answer, another non-zero one an RST_STREAM code (a malformed request, RFC 9113 8.1.1).
func (sc *h2server) request(s *h2fstream, f *h2block) int {
	x := getExchange()
	s.x = x
	var method, path, scheme, authority string
	fields := x.req.Fields[:0]
	var ct string
	clen := int64(-1)
	for _, hf := range f.fields {
		if hf.IsPseudo() {
			switch hf.Name {
			case ":method":
				method = hf.Value
			case ":path":
				path = hf.Value
			case ":scheme":
				scheme = hf.Value
			case ":authority":
				authority = hf.Value
			default:
				return errCodeProtocol
			}
			continue
		}
		n := hf.Name
		switch n {
		case "connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade":
			return errCodeProtocol
		case "te":
			if hf.Value != "trailers" {
				return errCodeProtocol
			}
		case "content-type":
			ct = hf.Value
		case "content-length":
			v, err := strconv.ParseInt(hf.Value, 10, 64)
			if err != nil || v < 0 {
				return errCodeProtocol
			}
			clen = v
		case "host":
			if authority == "" {
				authority = hf.Value
			}
		}
		if len(fields) == maxRequestFields {
			return http.StatusRequestHeaderFieldsTooLarge
		}
		fields = append(fields, h1.Field{Name: str2b(n), Value: str2b(hf.Value)})
	}
	x.req.Fields, x.fields = fields, fields
	if method == "CONNECT" {
		return http.StatusMethodNotAllowed
	}
	if method == "" || scheme == "" || path == "" || (path[0] != '/' && !(method == "OPTIONS" && path == "*")) {
		return errCodeProtocol
	}
	x.method = methodString(str2b(method))
	x.target, x.host = str2b(path), str2b(authority)
	x.path, _, _ = strings.Cut(path, "?")
	x.remoteIP = sc.cc.ip
	x.out = s
	if _, n := h1.Get(fields, tmhttp.HeaderTenant); n == 0 && isAdminPath(x.path) {
		s.admin = true
		return 0
	}
	x.grpc = strings.HasPrefix(ct, "application/grpc") && (len(ct) == 16 || ct[16] == '+' || ct[16] == ';')
	if x.grpc {
		s.ctx, s.cancel = context.WithCancelCause(sc.ctx)
		x.ctx, x.cancelable, x.streamCtx = s.ctx, true, true
		if !s.bodyEnd {
			x.rbody = newReplayBody(&s.bodyR, sc.g.cfg.MaxReplayBody)
		}
	} else if !s.bodyEnd && clen != 0 {
		s.bodyR.idle = sc.g.cfg.BodyReadTimeout
		x.body, x.bodyLen = &s.bodyR, clen
	}
	return 0
}

// run is a stream's goroutine: the stages (or an admin endpoint), then the stream's end.
func (sc *h2server) run(s *h2fstream) {
	defer sc.wg.Done()
	x := s.x
	if s.admin {
		sc.serveAdmin(s)
	} else {
		sc.g.serve(x)
	}
	sc.mu.Lock()
	switch {
	case s.reset || sc.dead != nil:
	case !s.ended:
		sc.out.buf = appendRST(sc.out.buf, s.id, errCodeInternal) // the answer was cut
	case !s.bodyEnd:
		sc.out.buf = appendRST(sc.out.buf, s.id, errCodeNo) // answered: the rest is not needed
	}
	s.finished = true
	sc.creditLocked(nil, int64(len(s.body)-s.bodyPos)) // what was not read
	s.body, s.bodyPos = nil, 0
	delete(sc.streams, s.id)
	sc.active--
	if sc.goaway && sc.active == 0 {
		_ = sc.out.flushLocked()
		_ = sc.nc.SetReadDeadline(aLongTimeAgo) // the reader ends the connection
	}
	s.wake()
	sc.mu.Unlock()
	_ = sc.out.flush()
	if s.cancel != nil {
		s.cancel(context.Canceled)
	}
	putExchange(x)
	s.x = nil
}

// creditLocked returns n bytes to the client's windows: the connection's always, s's while its
// request is open. WINDOW_UPDATEs go once a quarter of a window is owed.
func (sc *h2server) creditLocked(s *h2fstream, n int64) {
	if n <= 0 {
		return
	}
	sc.recvUnacked += n
	if sc.recvUnacked >= frontConnWindow/4 {
		sc.out.buf = appendWindowUpdate(sc.out.buf, 0, uint32(sc.recvUnacked))
		sc.recvAvail += sc.recvUnacked
		sc.recvUnacked = 0
	}
	if s != nil && !s.bodyEnd && !s.reset {
		s.recvUnacked += n
		if s.recvUnacked >= frontStreamWindow/4 {
			sc.out.buf = appendWindowUpdate(sc.out.buf, s.id, uint32(s.recvUnacked))
			s.recvAvail += s.recvUnacked
			s.recvUnacked = 0
		}
	}
}

// resetLocked resets stream id (s, if open) with code.
func (sc *h2server) resetLocked(s *h2fstream, id uint32, code uint32) {
	sc.out.buf = appendRST(sc.out.buf, id, code)
	if s != nil {
		s.reset = true
		if s.cancel != nil {
			s.cancel(errStreamReset)
		}
		s.wake()
		sc.windowCond.Broadcast()
	}
}

// h2fstream is one client stream: its request's body as it comes, and the responder its
// answer is written with.
type h2fstream struct {
	sc     *h2server
	id     uint32
	x      *exchange
	admin  bool
	ctx    context.Context // gRPC calls: ends with the stream
	cancel context.CancelCauseFunc
	notify chan struct{}
	bodyR  h2body

	// Under sc.mu.
	body        []byte // received, not yet read from bodyPos
	bodyPos     int
	bodyEnd     bool // END_STREAM received
	reset       bool // RST_STREAM either way, or the connection ended
	ended       bool // the answer ended (END_STREAM or RST_STREAM sent)
	finished    bool // the stream's goroutine is done
	sendWindow  int64
	recvAvail   int64
	recvUnacked int64
}

func (s *h2fstream) wake() {
	select {
	case s.notify <- struct{}{}:
	default:
	}
}

// h2body reads a stream's request body.
type h2body struct {
	s    *h2fstream
	idle time.Duration // each wait's bound (BodyReadTimeout); 0: none (gRPC streams)
}

// ready: a Read would not wait.
func (b *h2body) ready() bool {
	s := b.s
	s.sc.mu.Lock()
	defer s.sc.mu.Unlock()
	return s.bodyPos < len(s.body) || s.bodyEnd || s.reset || s.finished
}

func (b *h2body) Read(p []byte) (int, error) {
	s, sc := b.s, b.s.sc
	var timer *time.Timer
	sc.mu.Lock()
	for s.bodyPos == len(s.body) && !s.bodyEnd && !s.reset && !s.finished {
		sc.mu.Unlock()
		if b.idle > 0 {
			if timer == nil {
				timer = time.NewTimer(b.idle)
				defer timer.Stop()
			} else {
				timer.Reset(b.idle)
			}
			select {
			case <-s.notify:
			case <-timer.C:
				sc.g.metrics.slow.WithLabelValues("body").Inc()
				return 0, errBodyTimeout
			}
		} else {
			<-s.notify
		}
		sc.mu.Lock()
	}
	defer sc.mu.Unlock()
	if s.bodyPos < len(s.body) {
		n := copy(p, s.body[s.bodyPos:])
		s.bodyPos += n
		if s.bodyPos == len(s.body) {
			s.body, s.bodyPos = s.body[:0], 0
		}
		k := len(sc.out.buf)
		sc.creditLocked(s, int64(n))
		if len(sc.out.buf) > k { // a WINDOW_UPDATE
			_ = sc.out.flushLocked()
		}
		return n, nil
	}
	if s.bodyEnd {
		return 0, io.EOF
	}
	return 0, errStreamReset
}

var errBodyTimeout = &tmhttp.Error{Status: http.StatusRequestTimeout, Type: "body-timeout", Title: "Request body too slow",
	Detail: "the request body stopped arriving"}

// The responder: the answer as HEADERS, DATA and trailing HEADERS frames.

func (s *h2fstream) writeHead(status int, fields []h1.Field, n int64, noBody bool) error {
	x := s.x
	hb := headerBlock{b: x.h2blk[:0]}
	hb.status(status)
	for _, f := range fields {
		if !h2Forbidden(f.Name) && !h1.EqualFold(f.Name, "Content-Length") {
			hb.field(f.Name, f.Value)
		}
	}
	if !noBody && n >= 0 {
		hb.field(str2b("content-length"), strconv.AppendInt(x.num[:0], n, 10))
	}
	x.h2blk = hb.b
	sc := s.sc
	sc.mu.Lock()
	defer sc.mu.Unlock()
	if s.reset || s.ended || sc.dead != nil {
		return errStreamReset
	}
	sc.out.buf = appendHeaderFrames(sc.out.buf, s.id, hb.b, noBody, sc.peerMaxFrame, &sc.scratch)
	if noBody {
		s.ended = true
	}
	return nil
}

func (s *h2fstream) write(p []byte) error {
	sc := s.sc
	sc.mu.Lock()
	defer sc.mu.Unlock()
	for len(p) > 0 {
		if s.reset || s.ended || sc.dead != nil {
			return errStreamReset
		}
		n := int64(min(len(p), sc.peerMaxFrame))
		n = min(n, s.sendWindow, sc.sendWindow)
		if n <= 0 {
			if len(sc.out.buf) > 0 { // the client must see what it has, to credit more
				if err := sc.out.flushLocked(); err != nil {
					return err
				}
				continue // the lock was let go: look at the windows again
			}
			sc.windowCond.Wait()
			continue
		}
		if err := sc.out.roomLocked(); err != nil {
			return err
		}
		sc.out.buf = appendFrameHeader(sc.out.buf, int(n), frData, 0, s.id)
		sc.out.buf = append(sc.out.buf, p[:n]...)
		s.sendWindow -= n
		sc.sendWindow -= n
		p = p[n:]
	}
	return nil
}

func (s *h2fstream) flush() error {
	sc := s.sc
	sc.mu.Lock()
	bad := s.reset || sc.dead != nil
	sc.mu.Unlock()
	if bad {
		return errStreamReset
	}
	return sc.out.flush()
}

func (s *h2fstream) finish(trailer []h1.Field) error {
	var blk []byte
	if len(trailer) > 0 {
		hb := headerBlock{b: s.x.h2blk[:0]}
		for _, f := range trailer {
			if !h2Forbidden(f.Name) {
				hb.field(f.Name, f.Value)
			}
		}
		s.x.h2blk = hb.b
		blk = hb.b
	}
	sc := s.sc
	sc.mu.Lock()
	defer sc.mu.Unlock()
	if s.reset || s.ended || sc.dead != nil {
		return errStreamReset
	}
	if blk != nil {
		sc.out.buf = appendHeaderFrames(sc.out.buf, s.id, blk, true, sc.peerMaxFrame, &sc.scratch)
	} else {
		sc.out.buf = appendFrameHeader(sc.out.buf, 0, frData, flEndStream, s.id)
	}
	s.ended = true
	return nil
}

func (s *h2fstream) abort() { s.rst(errCodeInternal) }

func (s *h2fstream) rst(code uint32) {
	sc := s.sc
	sc.mu.Lock()
	defer sc.mu.Unlock()
	if !s.reset && !s.ended && sc.dead == nil {
		sc.out.buf = appendRST(sc.out.buf, s.id, code)
		s.ended = true
	}
}

func (s *h2fstream) problem(status int, body []byte, retryAfter int, extra ...h1.Field) {
	if body == nil {
		s.rst(errCodeCancel) // the client went away
		return
	}
	x := s.x
	fields := append(x.rfields[:0], h1.Field{Name: []byte("content-type"), Value: []byte(tmhttp.ContentTypeProblem)},
		h1.Field{Name: []byte("cache-control"), Value: []byte("no-store")})
	if retryAfter > 0 {
		fields = append(fields, h1.Field{Name: []byte("retry-after"), Value: strconv.AppendInt(x.pnum[:0], int64(retryAfter), 10)})
	}
	fields = append(fields, extra...)
	x.rfields = fields
	if s.writeHead(status, fields, int64(len(body)), false) != nil {
		return
	}
	if s.write(body) == nil {
		_ = s.finish(nil)
	}
}

func (s *h2fstream) hijack() (io.ReadWriteCloser, error) {
	return nil, errors.New("no protocol switch over HTTP/2")
}

// serveAdmin serves one of the gateway's own endpoints on the stream (net/http's handler).
func (sc *h2server) serveAdmin(s *h2fstream) {
	x := s.x
	u, err := url.ParseRequestURI(str(x.target))
	if err != nil {
		s.problem(http.StatusBadRequest, []byte("{}\n"), 0)
		return
	}
	h := make(http.Header, len(x.fields))
	for _, f := range x.fields {
		k := http.CanonicalHeaderKey(string(f.Name))
		h[k] = append(h[k], string(f.Value))
	}
	var body io.ReadCloser = http.NoBody
	if !s.bodyEnd {
		s.bodyR.idle = sc.g.cfg.BodyReadTimeout
		body = io.NopCloser(&s.bodyR)
	}
	r := (&http.Request{Method: x.method, URL: u, Proto: "HTTP/2.0", ProtoMajor: 2, Header: h, Body: body,
		Host: string(x.host), RemoteAddr: sc.nc.RemoteAddr().String(), RequestURI: string(x.target), ContentLength: -1}).WithContext(sc.ctx)
	w := &h2adminWriter{s: s, h: http.Header{}}
	sc.g.admin.ServeHTTP(w, r)
	w.WriteHeader(http.StatusOK)
	_ = s.finish(nil)
}

// h2adminWriter is http.ResponseWriter on a stream, for the admin endpoints.
type h2adminWriter struct {
	s     *h2fstream
	h     http.Header
	wrote bool
}

func (w *h2adminWriter) Header() http.Header { return w.h }

func (w *h2adminWriter) WriteHeader(code int) {
	if w.wrote {
		return
	}
	w.wrote = true
	var fields []h1.Field
	for k, vv := range w.h {
		for _, v := range vv {
			fields = append(fields, h1.Field{Name: []byte(k), Value: []byte(v)})
		}
	}
	_ = w.s.writeHead(code, fields, -1, false)
}

func (w *h2adminWriter) Write(p []byte) (int, error) {
	w.WriteHeader(http.StatusOK)
	if err := w.s.write(p); err != nil {
		return 0, err
	}
	return len(p), nil
}

func (w *h2adminWriter) Flush() { _ = w.s.flush() }
