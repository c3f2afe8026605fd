package gateway

import (
	"encoding/binary"
	"runtime"
	"sync"

	"github.com/tenantmesh/tenantmesh/gateway/h1"
)

// The HTTP/2 engine's wire code, shared by its two sides (h2front.go: clients over h2c;
// h2up.go: instances): frames appended to a connection's output buffer (h2out), written by one
// system call per batch, and header blocks encoded without HPACK's dynamic table.
//
// Header blocks are encoded as HAProxy encodes them: a field whose name and value are in the
// static table is indexed, any other is a literal "without indexing" (with the static table's
// index of its name when it has one), and nothing is Huffman-coded. Encoding so keeps no
// state, costs a copy, and per-call values (x-request-id, traceparent, the proof) never enter
// or evict a table entry on either side. Blocks received are decoded once (the Framer's
// hpack.Decoder, with the peer's dynamic table).

// Frame types and flags (RFC 9113 section 6).
const (
	frData         = 0x0
	frHeaders      = 0x1
	frRSTStream    = 0x3
	frSettings     = 0x4
	frPing         = 0x6
	frGoAway       = 0x7
	frWindowUpdate = 0x8
	frContinuation = 0x9

	flEndStream  = 0x1
	flAck        = 0x1
	flEndHeaders = 0x4
)

// Settings identifiers.
const (
	setHeaderTableSize      = 0x1
	setEnablePush           = 0x2
	setMaxConcurrentStreams = 0x3
	setInitialWindowSize    = 0x4
	setMaxFrameSize         = 0x5
	setMaxHeaderListSize    = 0x6
)

// Error codes.
const (
	errCodeNo             = 0x0
	errCodeProtocol       = 0x1
	errCodeInternal       = 0x2
	errCodeFlowControl    = 0x3
	errCodeStreamClosed   = 0x5
	errCodeFrameSize      = 0x6
	errCodeRefusedStream  = 0x7
	errCodeCancel         = 0x8
	errCodeEnhanceYourCal = 0xb
)

const (
	h2DefaultWindow   = 65535
	h2MaxWindow       = 1<<31 - 1
	h2DefaultMaxFrame = 16384
)

// appendFrameHeader appends a frame header for a payload of n bytes.
func appendFrameHeader(b []byte, n int, typ, flags byte, stream uint32) []byte {
	return append(b, byte(n>>16), byte(n>>8), byte(n), typ, flags,
		byte(stream>>24)&0x7f, byte(stream>>16), byte(stream>>8), byte(stream))
}

func appendRST(b []byte, stream uint32, code uint32) []byte {
	b = appendFrameHeader(b, 4, frRSTStream, 0, stream)
	return binary.BigEndian.AppendUint32(b, code)
}

func appendWindowUpdate(b []byte, stream uint32, n uint32) []byte {
	b = appendFrameHeader(b, 4, frWindowUpdate, 0, stream)
	return binary.BigEndian.AppendUint32(b, n&0x7fffffff)
}

func appendGoAway(b []byte, last uint32, code uint32, debug string) []byte {
	b = appendFrameHeader(b, 8+len(debug), frGoAway, 0, 0)
	b = binary.BigEndian.AppendUint32(b, last&0x7fffffff)
	b = binary.BigEndian.AppendUint32(b, code)
	return append(b, debug...)
}

// appendSettings appends a SETTINGS frame of (id, value) pairs.
func appendSettings(b []byte, kv ...uint32) []byte {
	b = appendFrameHeader(b, len(kv)/2*6, frSettings, 0, 0)
	for i := 0; i+1 < len(kv); i += 2 {
		b = binary.BigEndian.AppendUint16(b, uint16(kv[i]))
		b = binary.BigEndian.AppendUint32(b, kv[i+1])
	}
	return b
}

// headerBlock encodes one header block after a HEADERS frame header it patches when done
// (end), splitting it into CONTINUATION frames past the peer's frame size.
type headerBlock struct {
	b     []byte
	start int // the HEADERS frame header's offset
}

func beginHeaders(b []byte) headerBlock {
	hb := headerBlock{b: b, start: len(b)}
	hb.b = append(hb.b, 0, 0, 0, 0, 0, 0, 0, 0, 0)
	return hb
}

// indexed adds a field of the static table by its index (both name and value).
func (hb *headerBlock) indexed(i int) { hb.b = append(hb.b, 0x80|byte(i)) }

// field adds name: value as a literal without indexing; name is sent in lower case.
func (hb *headerBlock) field(name, value []byte) {
	if i := staticNameIndex(name); i > 0 {
		if i < 15 {
			hb.b = append(hb.b, byte(i))
		} else {
			hb.b = append(hb.b, 0x0f, byte(i-15))
		}
	} else {
		hb.b = append(hb.b, 0)
		hb.b = appendHpackInt(hb.b, 7, 0, len(name))
		for _, c := range name {
			if 'A' <= c && c <= 'Z' {
				c += 'a' - 'A'
			}
			hb.b = append(hb.b, c)
		}
	}
	hb.b = appendHpackInt(hb.b, 7, 0, len(value))
	hb.b = append(hb.b, value...)
}

func (hb *headerBlock) fieldStr(name, value string) { hb.field(str2b(name), str2b(value)) }

// status adds :status.
func (hb *headerBlock) status(code int) {
	switch code {
	case 200:
		hb.indexed(8)
	case 204:
		hb.indexed(9)
	case 304:
		hb.indexed(11)
	case 400:
		hb.indexed(12)
	case 404:
		hb.indexed(13)
	case 500:
		hb.indexed(14)
	default:
		var d [3]byte
		d[0], d[1], d[2] = byte('0'+code/100%10), byte('0'+code/10%10), byte('0'+code%10)
		hb.b = append(hb.b, 0x08, 3, d[0], d[1], d[2]) // name :status (8), literal value
	}
}

// end finishes the block as HEADERS (and CONTINUATION frames) on stream; scratch is reused
// storage for a block larger than maxFrame.
func (hb *headerBlock) end(stream uint32, endStream bool, maxFrame int, scratch *[]byte) []byte {
	b := hb.b
	n := len(b) - hb.start - 9
	var fl byte
	if endStream {
		fl = flEndStream
	}
	if n <= maxFrame {
		appendFrameHeader(b[hb.start:hb.start], n, frHeaders, fl|flEndHeaders, stream)
		return b
	}
	*scratch = append((*scratch)[:0], b[hb.start+9:]...)
	blk := *scratch
	b = b[:hb.start]
	typ := byte(frHeaders)
	for len(blk) > 0 {
		k := min(len(blk), maxFrame)
		f := fl
		if k == len(blk) {
			f |= flEndHeaders
		}
		b = appendFrameHeader(b, k, typ, f, stream)
		b = append(b, blk[:k]...)
		blk = blk[k:]
		typ, fl = frContinuation, 0
	}
	return b
}

// appendHpackInt appends v with an n-bit prefix (RFC 7541 section 5.1); first holds the
// prefix byte's other bits.
func appendHpackInt(b []byte, n uint, first byte, v int) []byte {
	max := 1<<n - 1
	if v < max {
		return append(b, first|byte(v))
	}
	b = append(b, first|byte(max))
	v -= max
	for v >= 128 {
		b = append(b, byte(v&0x7f)|0x80)
		v >>= 7
	}
	return append(b, byte(v))
}

// staticNameIndex is the static table's index of name (case-insensitive), 0 if absent.
func staticNameIndex(name []byte) int {
	var lb [32]byte
	if len(name) > len(lb) {
		return 0
	}
	l := lb[:len(name)]
	for i, c := range name {
		if 'A' <= c && c <= 'Z' {
			c += 'a' - 'A'
		}
		l[i] = c
	}
	switch string(l) {
	case ":authority":
		return 1
	case ":method":
		return 2
	case ":path":
		return 4
	case ":scheme":
		return 6
	case ":status":
		return 8
	case "accept-encoding":
		return 16
	case "accept-language":
		return 17
	case "accept":
		return 19
	case "authorization":
		return 23
	case "cache-control":
		return 24
	case "content-encoding":
		return 26
	case "content-length":
		return 28
	case "content-type":
		return 31
	case "cookie":
		return 32
	case "date":
		return 33
	case "etag":
		return 34
	case "expires":
		return 36
	case "host":
		return 38
	case "last-modified":
		return 44
	case "location":
		return 46
	case "retry-after":
		return 53
	case "server":
		return 54
	case "set-cookie":
		return 55
	case "user-agent":
		return 58
	case "vary":
		return 59
	case "www-authenticate":
		return 61
	}
	return 0
}

// h2out is a connection's output: frames are appended under the connection's mutex by
// whichever goroutine has them, and written by one of them at a time, everything pending in
// one write. While a write is under way the others append and go on; the writer, back from
// its system call, writes what they appended, so frames written in one turn of the
// connection's goroutines leave in one system call (HAProxy's batched sends).
type h2out struct {
	mu      *sync.Mutex // the connection's
	drained sync.Cond   // signalled when a write ends (appenders over maxPending wait)
	w       socketIO
	dl      *writeDeadline
	buf     []byte
	spare   []byte
	writing bool
	err     error // the first write's error: the connection is done
}

// maxPending bounds what waits for the connection's writer; an appender beyond it waits.
const maxPending = 256 << 10

func (o *h2out) init(mu *sync.Mutex, w socketIO, dl *writeDeadline) {
	o.mu, o.w, o.dl = mu, w, dl
	o.drained.L = mu
	o.buf = make([]byte, 0, 16<<10)
	o.spare = make([]byte, 0, 16<<10)
}

// flushLocked writes what is pending, unless another goroutine is writing (it writes it).
// Called and returns with mu held; mu is released during the write.
func (o *h2out) flushLocked() error {
	if o.writing {
		return o.err
	}
	o.writing = true
	for len(o.buf) > 0 && o.err == nil {
		b := o.buf
		o.buf = o.spare[:0]
		o.mu.Unlock()
		o.dl.renew()
		_, err := o.w.Write(b)
		err = o.dl.check(err)
		o.mu.Lock()
		if cap(b) <= 1<<20 {
			o.spare = b[:0]
		} else {
			o.spare = make([]byte, 0, 16<<10)
		}
		if err != nil {
			o.err = err
		}
	}
	if o.err != nil {
		o.buf = o.buf[:0]
	}
	o.writing = false
	o.drained.Broadcast()
	return o.err
}

// flush writes what is pending. It first yields to the goroutines ready to run: the other
// streams' goroutines woken in this turn write their frames, which leave in the same write
// (one system call for a turn's frames instead of one per stream).
func (o *h2out) flush() error {
	o.mu.Lock()
	if o.writing || len(o.buf) == 0 {
		err := o.err
		o.mu.Unlock()
		return err
	}
	o.mu.Unlock()
	runtime.Gosched()
	o.mu.Lock()
	err := o.flushLocked()
	o.mu.Unlock()
	return err
}

// roomLocked waits while more than maxPending is pending and being written.
func (o *h2out) roomLocked() error {
	for len(o.buf) > maxPending && o.writing && o.err == nil {
		o.drained.Wait()
	}
	if len(o.buf) > maxPending && o.err == nil {
		return o.flushLocked()
	}
	return o.err
}

// h1 fields the engine never forwards over HTTP/2 (connection-specific, RFC 9113 8.2.2).
func h2Forbidden(name []byte) bool {
	return h1.EqualFold(name, "Connection") || h1.EqualFold(name, "Keep-Alive") || h1.EqualFold(name, "Proxy-Connection") ||
		h1.EqualFold(name, "Transfer-Encoding") || h1.EqualFold(name, "Upgrade") || h1.EqualFold(name, "Host")
}
