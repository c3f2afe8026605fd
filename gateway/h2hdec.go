package gateway

import (
	"errors"
	"strings"

	"golang.org/x/net/http/httpguts"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// h2headers decodes a connection's header blocks (HEADERS and its CONTINUATION frames) as
// they are read: the connection's hpack.Decoder emits each field into one reused slice, with
// the checks x/net's Framer makes when it builds a MetaHeadersFrame (field names and values,
// pseudo-fields first, not repeated, not mixed between request and response; the header
// list's bound; the connection ended on a block far over it or on an HPACK error). What it
// saves per block is the Framer's: a MetaHeadersFrame, its emit closure and the variables it
// captures, a fields slice grown from nothing.
//
// Unlike the Framer, a single field longer than the bound (up to twice it) makes the block
// truncated (the front end answers 431) rather than a decoding error that ends the
// connection.
type h2headers struct {
	dec        *hpack.Decoder
	max        uint32
	remain     uint32
	sawRegular bool
	invalid    error
	blk        h2block
}

// h2block is a decoded header block; its fields are valid until the next block is read.
type h2block struct {
	stream    uint32
	endStream bool
	// truncated: the header list was over the bound; fields has what came before.
	truncated bool
	fields    []hpack.HeaderField
}

func newH2Headers(max uint32) *h2headers {
	hd := &h2headers{max: max}
	hd.dec = hpack.NewDecoder(4096, hd.emit)
	hd.dec.SetMaxStringLength(int(2 * max))
	return hd
}

var errPseudoAfterRegular = errors.New("pseudo-header field after a regular one")

func (hd *h2headers) emit(f hpack.HeaderField) {
	if !httpguts.ValidHeaderFieldValue(f.Value) {
		hd.invalid = errors.New("invalid value of header field " + f.Name)
	}
	if strings.HasPrefix(f.Name, ":") {
		if hd.sawRegular {
			hd.invalid = errPseudoAfterRegular
		}
	} else {
		hd.sawRegular = true
		if !validFieldName(f.Name) {
			hd.invalid = errors.New("invalid header field name")
		}
	}
	if hd.invalid != nil {
		hd.dec.SetEmitEnabled(false)
		return
	}
	if size := f.Size(); size > hd.remain {
		hd.dec.SetEmitEnabled(false)
		hd.blk.truncated = true
		hd.remain = 0
		return
	} else {
		hd.remain -= size
	}
	hd.blk.fields = append(hd.blk.fields, f)
}

// validFieldName: a token in lower case (RFC 9113 section 8.2.1).
func validFieldName(v string) bool {
	if v == "" {
		return false
	}
	for i := 0; i < len(v); i++ {
		c := v[i]
		if c >= 0x80 || !httpguts.IsTokenRune(rune(c)) || ('A' <= c && c <= 'Z') {
			return false
		}
	}
	return true
}

// readFrame reads the next frame from fr; a header block is decoded and returned as a block
// (nil frame) once its last CONTINUATION frame is read. Errors are the Framer's kinds:
// http2.ConnectionError ends the connection, http2.StreamError resets the stream.
func (hd *h2headers) readFrame(fr *http2.Framer) (http2.Frame, *h2block, error) {
	f, err := fr.ReadFrame()
	if err != nil {
		return nil, nil, err
	}
	hf, ok := f.(*http2.HeadersFrame)
	if !ok {
		return f, nil, nil
	}
	b := &hd.blk
	b.stream, b.endStream, b.truncated, b.fields = hf.StreamID, hf.StreamEnded(), false, b.fields[:0]
	hd.remain, hd.sawRegular, hd.invalid = hd.max, false, nil
	hd.dec.SetEmitEnabled(true)
	frag, ended := hf.HeaderBlockFragment(), hf.HeadersEnded()
	for {
		// As the Framer: a fragment far over what is left of the bound, or one following
		// an invalid field, ends the connection (the block is not decoded to be dropped).
		if int64(len(frag)) > 4*int64(hd.remain) || hd.invalid != nil {
			return nil, nil, http2.ConnectionError(http2.ErrCodeProtocol)
		}
		if _, err := hd.dec.Write(frag); err != nil {
			return nil, nil, http2.ConnectionError(http2.ErrCodeCompression)
		}
		if ended {
			break
		}
		f, err = fr.ReadFrame()
		if err != nil {
			return nil, nil, err
		}
		cf := f.(*http2.ContinuationFrame) // the Framer checks the frames' order
		frag, ended = cf.HeaderBlockFragment(), cf.HeadersEnded()
	}
	if err := hd.dec.Close(); err != nil {
		return nil, nil, http2.ConnectionError(http2.ErrCodeCompression)
	}
	if hd.invalid == nil {
		hd.invalid = checkPseudos(b.fields)
	}
	if hd.invalid != nil {
		return nil, nil, http2.StreamError{StreamID: b.stream, Code: http2.ErrCodeProtocol, Cause: hd.invalid}
	}
	return nil, b, nil
}

// checkPseudos: known pseudo-fields, none twice, not those of a request and a response.
func checkPseudos(fields []hpack.HeaderField) error {
	var req, resp bool
	for i, f := range fields {
		if !f.IsPseudo() {
			break
		}
		switch f.Name {
		case ":method", ":path", ":scheme", ":authority", ":protocol":
			req = true
		case ":status":
			resp = true
		default:
			return errors.New("invalid pseudo-header field " + f.Name)
		}
		for _, g := range fields[:i] {
			if g.Name == f.Name {
				return errors.New("duplicate pseudo-header field " + f.Name)
			}
		}
	}
	if req && resp {
		return errors.New("mix of request and response pseudo-header fields")
	}
	return nil
}

// pseudo is the value of pseudo-field name (":status") in b, "" if absent.
func (b *h2block) pseudo(name string) string {
	for _, f := range b.fields {
		if !f.IsPseudo() {
			break
		}
		if f.Name == name {
			return f.Value
		}
	}
	return ""
}

// regular is b's fields after the pseudo-fields.
func (b *h2block) regular() []hpack.HeaderField {
	for i, f := range b.fields {
		if !f.IsPseudo() {
			return b.fields[i:]
		}
	}
	return nil
}
