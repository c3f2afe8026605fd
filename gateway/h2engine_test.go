package gateway

import (
	"bytes"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// Tests of the engine's own HTTP/2 (h2front.go, h2up.go, h2wire.go) at the frame level: raw
// clients of the gateway and raw instances behind it, written with x/net's Framer.

// rawH2 is an HTTP/2 client or server connection driven frame by frame.
type rawH2 struct {
	t   testing.TB
	c   net.Conn
	fr  *http2.Framer
	enc *hpack.Encoder
	hb  bytes.Buffer
}

func newRawH2(t testing.TB, c net.Conn) *rawH2 {
	r := &rawH2{t: t, c: c}
	r.fr = http2.NewFramer(c, c)
	r.fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	r.fr.MaxHeaderListSize = 1 << 20
	r.enc = hpack.NewEncoder(&r.hb)
	return r
}

// dialRawH2 opens an h2c connection to the gateway with the client's settings.
func dialRawH2(t testing.TB, e *env, settings ...http2.Setting) *rawH2 {
	t.Helper()
	c, err := net.DialTimeout("tcp", strings.TrimPrefix(e.url, "http://"), 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	r := newRawH2(t, c)
	if _, err := io.WriteString(c, http2.ClientPreface); err != nil {
		t.Fatal(err)
	}
	if err := r.fr.WriteSettings(settings...); err != nil {
		t.Fatal(err)
	}
	return r
}

// headers sends a header block of name, value pairs on stream id.
func (r *rawH2) headers(id uint32, end bool, kv ...string) {
	r.t.Helper()
	r.hb.Reset()
	for i := 0; i+1 < len(kv); i += 2 {
		_ = r.enc.WriteField(hpack.HeaderField{Name: kv[i], Value: kv[i+1]})
	}
	if err := r.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: r.hb.Bytes(), EndStream: end, EndHeaders: true}); err != nil {
		r.t.Fatal(err)
	}
}

// next reads the next frame that is not SETTINGS, a SETTINGS ack, or a connection
// WINDOW_UPDATE (answering SETTINGS and pings), within 10 s; nil at the connection's end.
func (r *rawH2) next() http2.Frame {
	r.t.Helper()
	_ = r.c.SetReadDeadline(time.Now().Add(10 * time.Second))
	for {
		f, err := r.fr.ReadFrame()
		if err != nil {
			if err == io.EOF || strings.Contains(err.Error(), "reset") || strings.Contains(err.Error(), "closed") {
				return nil
			}
			r.t.Fatalf("reading a frame: %v", err)
		}
		switch f := f.(type) {
		case *http2.SettingsFrame:
			if !f.IsAck() {
				_ = r.fr.WriteSettingsAck()
			}
			continue
		case *http2.WindowUpdateFrame:
			if f.StreamID == 0 {
				continue
			}
		case *http2.PingFrame:
			if !f.IsAck() {
				_ = r.fr.WritePing(true, f.Data)
				continue
			}
		}
		return f
	}
}

var grpcCheck = []string{":method", "POST", ":scheme", "http", ":path", "/grpc.health.v1.Health/Check", ":authority", "gw",
	"content-type", "application/grpc", "te", "trailers"}

// rawInstance is an instance speaking HTTP/2 frame by frame; act decides what it does with
// each call (the connection's number, from 0, and the stream's id).
type rawInstance struct {
	t    testing.TB
	ln   net.Listener
	act  func(conn int, id uint32) string // "answer", "hold", "refuse" (RST_STREAM REFUSED_STREAM), "goaway" (GOAWAY last 0)
	wg   sync.WaitGroup
	mu   sync.Mutex
	n    int                      // connections accepted
	rsts map[uint32]http2.ErrCode // RST_STREAMs received
	hdrs int                      // header blocks received
	cs   []net.Conn
}

func newRawInstance(t testing.TB, act func(conn int, id uint32) string) *rawInstance {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ri := &rawInstance{t: t, ln: ln, act: act, rsts: map[uint32]http2.ErrCode{}}
	ri.wg.Add(1)
	go func() {
		defer ri.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			ri.mu.Lock()
			n := ri.n
			ri.n++
			ri.cs = append(ri.cs, c)
			ri.mu.Unlock()
			ri.wg.Add(1)
			go func() {
				defer ri.wg.Done()
				ri.serve(n, c)
			}()
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		ri.mu.Lock()
		for _, c := range ri.cs {
			c.Close()
		}
		ri.mu.Unlock()
		ri.wg.Wait()
	})
	return ri
}

func (ri *rawInstance) serve(n int, c net.Conn) {
	defer c.Close()
	pre := make([]byte, len(http2.ClientPreface))
	if _, err := io.ReadFull(c, pre); err != nil {
		return
	}
	r := newRawH2(ri.t, c)
	if r.fr.WriteSettings() != nil {
		return
	}
	for {
		f, err := r.fr.ReadFrame()
		if err != nil {
			return
		}
		switch f := f.(type) {
		case *http2.SettingsFrame:
			if !f.IsAck() {
				_ = r.fr.WriteSettingsAck()
			}
		case *http2.PingFrame:
			if !f.IsAck() {
				_ = r.fr.WritePing(true, f.Data)
			}
		case *http2.RSTStreamFrame:
			ri.mu.Lock()
			ri.rsts[f.StreamID] = f.ErrCode
			ri.mu.Unlock()
		case *http2.MetaHeadersFrame:
			ri.mu.Lock()
			ri.hdrs++
			ri.mu.Unlock()
			switch ri.act(n, f.StreamID) {
			case "answer":
				r.headers(f.StreamID, false, ":status", "200", "content-type", "application/grpc", "x-conn", string(rune('0'+n)))
				_ = r.fr.WriteData(f.StreamID, false, []byte{0, 0, 0, 0, 0})
				r.headers(f.StreamID, true, "grpc-status", "0")
			case "refuse":
				_ = r.fr.WriteRSTStream(f.StreamID, http2.ErrCodeRefusedStream)
			case "goaway":
				_ = r.fr.WriteGoAway(0, http2.ErrCodeNo, nil)
			case "answer-goaway":
				r.headers(f.StreamID, false, ":status", "200", "content-type", "application/grpc")
				_ = r.fr.WriteData(f.StreamID, false, []byte{0, 0, 0, 0, 0})
				r.headers(f.StreamID, true, "grpc-status", "0")
				_ = r.fr.WriteGoAway(f.StreamID, http2.ErrCodeNo, nil)
			}
		}
	}
}

func (ri *rawInstance) conns() int {
	ri.mu.Lock()
	defer ri.mu.Unlock()
	return ri.n
}

func (ri *rawInstance) rst(id uint32) (http2.ErrCode, bool) {
	ri.mu.Lock()
	defer ri.mu.Unlock()
	c, ok := ri.rsts[id]
	return c, ok
}

func rawEnv(t *testing.T, cfg Config, act func(conn int, id uint32) string) (*env, *rawInstance) {
	ri := newRawInstance(t, act)
	e := newEnv(t, cfg, []schema.KindConfig{{Kind: "aggregate"}}, func(e *env) {
		e.registerGRPC(&grpcBackend{id: schema.InstanceID{Kind: "aggregate", Shard: "aggregate-1", Instance: "r"}, url: "http://" + ri.ln.Addr().String()}, grpcRoute)
		e.place("aggregate", "t1", "aggregate-1")
	})
	return e, ri
}

// A GOAWAY from an instance: its streams under way finish, new calls go on a new connection;
// a stream past the GOAWAY's last id, or refused, never reached the service and goes again
// (a call without an idempotency key too).
func TestH2UpstreamGoAwayAndRefused(t *testing.T) {
	e, ri := rawEnv(t, Config{}, func(conn int, id uint32) string {
		switch conn {
		case 0:
			return "answer-goaway" // the first call is answered, then GOAWAY
		case 1:
			return "goaway" // the second call's stream is past the GOAWAY
		case 2:
			if id == 1 {
				return "refuse"
			}
		}
		return "answer"
	})
	c := e.grpcClient()
	for i := range 3 {
		ctx, cancel := tenantCtx("t1")
		_, err := c.Check(ctx, &healthpb.HealthCheckRequest{})
		cancel()
		if err != nil {
			t.Fatalf("call %d: %v", i, err)
		}
	}
	if n := ri.conns(); n != 3 {
		t.Fatalf("the instance saw %d connections, want 3 (one per GOAWAY)", n)
	}
}

// A call the client cancels is reset at the instance (RST_STREAM CANCEL), and the stream's
// goroutines end.
func TestH2ResetRelayed(t *testing.T) {
	e, ri := rawEnv(t, Config{}, func(int, uint32) string { return "hold" })
	c := e.grpcClient()
	ctx, cancel := tenantCtx("t1")
	done := make(chan error, 1)
	go func() {
		_, err := c.Check(ctx, &healthpb.HealthCheckRequest{})
		done <- err
	}()
	eventually(t, 10*time.Second, "the call's head at the instance", func() bool {
		ri.mu.Lock()
		defer ri.mu.Unlock()
		return ri.hdrs == 1
	})
	cancel()
	if err := <-done; status.Code(err) != codes.Canceled {
		t.Fatalf("canceled call: %v", err)
	}
	eventually(t, 10*time.Second, "RST_STREAM at the instance", func() bool {
		code, ok := ri.rst(1)
		return ok && code == http2.ErrCodeCancel
	})
}

// The kind's upstream timeout bounds an attempt's wait for the answer's head (the upstream's
// housekeeping ends it: DEADLINE_EXCEEDED, the stream reset at the instance).
func TestH2UpstreamTimeout(t *testing.T) {
	ri := newRawInstance(t, func(int, uint32) string { return "hold" })
	e := newEnv(t, Config{}, []schema.KindConfig{{Kind: "aggregate", UpstreamTimeout: schema.Duration(300 * time.Millisecond)}}, func(e *env) {
		e.registerGRPC(&grpcBackend{id: schema.InstanceID{Kind: "aggregate", Shard: "aggregate-1", Instance: "r"}, url: "http://" + ri.ln.Addr().String()}, grpcRoute)
		e.place("aggregate", "t1", "aggregate-1")
	})
	c := e.grpcClient()
	ctx, cancel := tenantCtx("t1")
	defer cancel()
	t0 := time.Now()
	if _, err := c.Check(ctx, &healthpb.HealthCheckRequest{}); status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("a call the instance holds: %v", err)
	}
	if d := time.Since(t0); d < 300*time.Millisecond || d > 5*time.Second {
		t.Fatalf("the call ended after %v, want about 300 ms", d)
	}
	eventually(t, 10*time.Second, "RST_STREAM at the instance", func() bool {
		code, ok := ri.rst(1)
		return ok && code == http2.ErrCodeCancel
	})
}

// The client's windows bound what the gateway sends; the gateway's bound what it accepts;
// a call larger than every window goes through both sides.
func TestH2FlowControl(t *testing.T) {
	var a *grpcBackend
	big := strings.Repeat("x", 64<<10)
	h1b := newBackend(t, "aggregate", "aggregate-1", "h")
	h1b.setHandler(func(w http.ResponseWriter, r *http.Request) { _, _ = io.WriteString(w, big) })
	e := newEnv(t, Config{}, []schema.KindConfig{{Kind: "aggregate"}}, func(e *env) {
		a = newGRPCBackend(t, "aggregate", "aggregate-1", "a")
		e.registerGRPC(a, grpcRoute)
		e.register(h1b, "", 10, schema.Route{Method: "GET", Prefix: "/big", Kind: "aggregate"})
		e.place("aggregate", "t1", "aggregate-1")
	})

	// 3 MiB in one call: past the gateway's stream (1 MiB) and connection windows, and the
	// instance's.
	c := e.grpcClient()
	ctx, cancel := tenantCtx("t1")
	defer cancel()
	if _, err := c.Check(ctx, &healthpb.HealthCheckRequest{Service: strings.Repeat("s", 3<<20)}); err != nil {
		t.Fatalf("a 3 MiB call: %v", err)
	}

	// A client with a 1,000-byte stream window gets 1,000 bytes, and the rest as it credits.
	r := dialRawH2(t, e, http2.Setting{ID: http2.SettingInitialWindowSize, Val: 1000})
	r.headers(1, true, ":method", "GET", ":scheme", "http", ":path", "/big", ":authority", "gw", "x-tenant-id", "t1")
	got, ended := 0, false
	for got < 1000 {
		switch f := r.next().(type) {
		case *http2.MetaHeadersFrame:
			if f.PseudoValue("status") != "200" {
				t.Fatalf("status %q", f.PseudoValue("status"))
			}
		case *http2.DataFrame:
			got += len(f.Data())
		case nil:
			t.Fatal("the connection ended")
		}
	}
	_ = r.fr.WritePing(false, [8]byte{1})
	for {
		f := r.next()
		if p, ok := f.(*http2.PingFrame); ok && p.IsAck() {
			break
		}
		if d, ok := f.(*http2.DataFrame); ok {
			got += len(d.Data())
		}
	}
	if got != 1000 {
		t.Fatalf("the gateway sent %d bytes on a 1,000-byte window", got)
	}
	for !ended {
		_ = r.fr.WriteWindowUpdate(1, 16<<10)
		_ = r.fr.WriteWindowUpdate(0, 16<<10)
		for {
			f := r.next()
			d, ok := f.(*http2.DataFrame)
			if !ok {
				if f == nil {
					t.Fatal("the connection ended")
				}
				continue
			}
			got += len(d.Data())
			if d.StreamEnded() {
				ended = true
				break
			}
			if got%(16<<10) == 1000%(16<<10) {
				break // the window is used up again
			}
		}
	}
	if got != len(big) {
		t.Fatalf("got %d bytes, want %d", got, len(big))
	}
}

// The bounds at the edge over h2c: concurrent streams, header list size, frame size, idle
// connections.
func TestH2Limits(t *testing.T) {
	e, _ := rawEnv(t, Config{MaxStreams: 2, MaxHeaderBytes: 4096, IdleTimeout: 500 * time.Millisecond}, func(int, uint32) string { return "hold" })

	// Streams past --max-streams are refused (REFUSED_STREAM: the client may send them again).
	r := dialRawH2(t, e)
	for _, id := range []uint32{1, 3, 5} {
		r.headers(id, true, append(grpcCheck, "x-tenant-id", "t1")...)
	}
	for {
		f := r.next()
		if rst, ok := f.(*http2.RSTStreamFrame); ok {
			if rst.StreamID != 5 || rst.ErrCode != http2.ErrCodeRefusedStream {
				t.Fatalf("RST_STREAM %v on stream %d", rst.ErrCode, rst.StreamID)
			}
			break
		}
		if f == nil {
			t.Fatal("the connection ended")
		}
	}

	// A header list over --max-header-bytes: 431.
	r = dialRawH2(t, e)
	big := append(grpcCheck, "x-tenant-id", "t1")
	for i := range 8 {
		big = append(big, "x-big-"+string(rune('a'+i)), strings.Repeat("b", 1<<10))
	}
	r.headers(1, true, big...)
	for {
		f := r.next()
		if h, ok := f.(*http2.MetaHeadersFrame); ok {
			if h.PseudoValue("status") != "431" {
				t.Fatalf("a large header list answered %q", h.PseudoValue("status"))
			}
			break
		}
		if f == nil {
			t.Fatal("the connection ended")
		}
	}

	// So does a single field longer than --max-header-bytes, and the connection serves on.
	r = dialRawH2(t, e)
	r.headers(1, true, append(grpcCheck, "x-tenant-id", "t1", "x-long", strings.Repeat("l", 6<<10))...)
	for {
		f := r.next()
		if h, ok := f.(*http2.MetaHeadersFrame); ok {
			if h.PseudoValue("status") != "431" {
				t.Fatalf("a long header field answered %q", h.PseudoValue("status"))
			}
			break
		}
		if f == nil {
			t.Fatal("the connection ended")
		} else if g, ok := f.(*http2.GoAwayFrame); ok {
			t.Fatalf("a long header field ended the connection: GOAWAY %v", g.ErrCode)
		}
	}
	_ = r.fr.WritePing(false, [8]byte{'a', 'l', 'i', 'v', 'e'})
	if p, ok := r.next().(*http2.PingFrame); !ok || !p.IsAck() {
		t.Fatal("the connection did not answer a ping after the 431")
	}

	// A frame over 16 KiB ends the connection (FRAME_SIZE_ERROR).
	r = dialRawH2(t, e)
	r.headers(1, false, append(grpcCheck, "x-tenant-id", "t1")...)
	_ = r.fr.WriteData(1, true, make([]byte, 20<<10))
	for {
		f := r.next()
		if g, ok := f.(*http2.GoAwayFrame); ok {
			if g.ErrCode != http2.ErrCodeFrameSize {
				t.Fatalf("GOAWAY %v, want FRAME_SIZE_ERROR", g.ErrCode)
			}
			break
		}
		if f == nil {
			t.Fatal("the connection ended without GOAWAY")
		}
	}

	// A connection without streams is closed after the idle timeout, with a GOAWAY.
	r = dialRawH2(t, e)
	for {
		f := r.next()
		if _, ok := f.(*http2.GoAwayFrame); ok {
			break
		}
		if f == nil {
			t.Fatal("the connection ended without GOAWAY")
		}
	}
	if f := r.next(); f != nil {
		t.Fatalf("after GOAWAY: %v", f)
	}
}

// A server stream under way when its tenant's shard is taken over ends UNAVAILABLE (the
// gateway abandons it), and the client's next call streams from the new owner.
func TestH2StreamThroughTakeover(t *testing.T) {
	e, bs := grpcEnv(t, Config{}, schema.KindConfig{Kind: "aggregate", HoldBudget: schema.Duration(20 * time.Second)}, 2, "t1")
	b := bs[1]
	c := e.grpcClient()
	ctx, cancel := tenantCtx("t1")
	defer cancel()
	st, err := c.Watch(ctx, &healthpb.HealthCheckRequest{})
	if err != nil {
		t.Fatal(err)
	}
	recvN(t, st, 3, "the stream")
	e.move("aggregate", "t1", func(p *schema.Placement) { p.Phase, p.Target = schema.PhaseTakeover, "aggregate-2" })
	if _, err := st.Recv(); status.Code(err) != codes.Unavailable {
		t.Fatalf("the stream at the former owner ended with %v, want UNAVAILABLE", err)
	}
	e.move("aggregate", "t1", func(p *schema.Placement) {
		p.Phase, p.Shard, p.Target, p.Epoch = schema.PhaseActive, "aggregate-2", "", p.Epoch+1
	})
	st, err = c.Watch(ctx, &healthpb.HealthCheckRequest{})
	if err != nil {
		t.Fatal(err)
	}
	recvN(t, st, 3, "the resumed stream")
	h, _ := st.Header()
	if got := h.Get("x-served-by"); len(got) != 1 || got[0] != b.id.Key() {
		t.Fatalf("the resumed stream was served by %v", got)
	}
}
