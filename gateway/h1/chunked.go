package h1

import (
	"errors"
	"io"
)

// Bounds of the chunked decoder.
const (
	maxChunkLine   = 4096     // a chunk-size line with its extensions
	maxTrailerSize = 16 << 10 // the whole trailer section
	maxTrailers    = 64
)

// ChunkedReader decodes a chunked body from a Reader, strictly (RFC 9112 section 7.1): hex
// sizes without sign or whitespace, extensions that follow the grammar, CRLF after every chunk.
// After io.EOF, Trailer holds the trailer fields (slices of its own buffer).
type ChunkedReader struct {
	r       *Reader
	left    int64 // bytes left in the current chunk
	inChunk bool
	done    bool
	err     error
	Trailer []Field
	tbuf    []byte
}

// Reset starts decoding a new body from r, keeping the trailer storage.
func (c *ChunkedReader) Reset(r *Reader) {
	c.r, c.left, c.inChunk, c.done, c.err = r, 0, false, false, nil
	c.Trailer, c.tbuf = c.Trailer[:0], c.tbuf[:0]
}

// Read reads decoded body bytes.
func (c *ChunkedReader) Read(p []byte) (int, error) {
	if c.err != nil {
		return 0, c.err
	}
	if c.done {
		return 0, io.EOF
	}
	if !c.inChunk {
		if err := c.nextChunk(); err != nil {
			c.err = err
			return 0, err
		}
		if c.done {
			return 0, io.EOF
		}
	}
	if int64(len(p)) > c.left {
		p = p[:c.left]
	}
	n, err := c.r.Read(p)
	c.left -= int64(n)
	if c.left == 0 {
		line, lerr := c.r.ReadLine(2)
		if lerr != nil || len(line) != 0 {
			c.err = bad("missing CRLF after chunk data")
			if lerr != nil && StatusOf(lerr) == 0 {
				c.err = lerr
			}
			return n, c.err
		}
		c.inChunk = false
	}
	if err != nil {
		if errors.Is(err, io.EOF) {
			err = io.ErrUnexpectedEOF
		}
		c.err = err
		return n, err
	}
	return n, nil
}

// nextChunk reads a chunk-size line; after the last chunk, the trailer section.
func (c *ChunkedReader) nextChunk() error {
	line, err := c.r.ReadLine(maxChunkLine)
	if err != nil {
		return err
	}
	size, err := parseChunkSize(line)
	if err != nil {
		return err
	}
	if size > 0 {
		c.left, c.inChunk = size, true
		return nil
	}
	total := 0
	for {
		line, err := c.r.ReadLine(maxTrailerSize)
		if err != nil {
			return err
		}
		if len(line) == 0 {
			break
		}
		if total += len(line) + 2; total > maxTrailerSize || len(c.Trailer) >= maxTrailers {
			return bad("trailer section too large")
		}
		start := len(c.tbuf)
		c.tbuf = append(c.tbuf, line...)
		c.tbuf = append(c.tbuf, '\r', '\n', '\r', '\n')
		var f framing
		fields, _, err := parseFields(c.tbuf[start:], nil, 1, &f)
		if err != nil {
			return err
		}
		if f.cl || f.te {
			return bad("framing field in the trailer section")
		}
		c.tbuf = c.tbuf[:len(c.tbuf)-2]
		c.Trailer = append(c.Trailer, fields[0])
	}
	// Fields point into tbuf, which append may have moved: parse them again from it.
	c.Trailer = c.Trailer[:0]
	for rest := c.tbuf; len(rest) > 0; {
		line, r, _ := nextLine(rest)
		rest = r
		colon := indexByte(line, ':')
		c.Trailer = append(c.Trailer, Field{Name: line[:colon], Value: trimOWS(line[colon+1:])})
	}
	c.done = true
	return nil
}

// parseChunkSize parses chunk-size [ chunk-ext ]: 1 to 15 hex digits, then extensions
// ( BWS ";" BWS token [ BWS "=" BWS ( token / quoted-string ) ] ).
func parseChunkSize(line []byte) (int64, error) {
	var n int64
	i := 0
	for ; i < len(line); i++ {
		c := line[i]
		var d byte
		switch {
		case c >= '0' && c <= '9':
			d = c - '0'
		case c >= 'a' && c <= 'f':
			d = c - 'a' + 10
		case c >= 'A' && c <= 'F':
			d = c - 'A' + 10
		default:
			goto ext
		}
		if i >= 15 {
			return 0, bad("chunk size too large")
		}
		n = n<<4 | int64(d)
	}
ext:
	if i == 0 {
		return 0, bad("invalid chunk size")
	}
	if err := checkChunkExt(line[i:]); err != nil {
		return 0, err
	}
	return n, nil
}

func checkChunkExt(b []byte) error {
	ws := func() {
		for len(b) > 0 && (b[0] == ' ' || b[0] == '\t') {
			b = b[1:]
		}
	}
	token := func() bool {
		i := 0
		for i < len(b) && tchar[b[i]] {
			i++
		}
		b = b[i:]
		return i > 0
	}
	for len(b) > 0 {
		ws() // BWS only before ";"
		if len(b) == 0 || b[0] != ';' {
			return bad("invalid chunk extension")
		}
		b = b[1:]
		ws()
		if !token() {
			return bad("invalid chunk extension")
		}
		ws()
		if len(b) == 0 || b[0] != '=' {
			continue
		}
		b = b[1:]
		ws()
		if len(b) > 0 && b[0] == '"' {
			if !quoted(&b) {
				return bad("invalid chunk extension")
			}
		} else if !token() {
			return bad("invalid chunk extension")
		}
		if len(b) > 0 && b[0] != ' ' && b[0] != '\t' && b[0] != ';' {
			return bad("invalid chunk extension")
		}
	}
	return nil
}

// quoted consumes a quoted-string at the start of *b.
func quoted(b *[]byte) bool {
	s := *b
	for i := 1; i < len(s); i++ {
		switch c := s[i]; {
		case c == '"':
			*b = s[i+1:]
			return true
		case c == '\\':
			if i+1 >= len(s) || (s[i+1] < ' ' && s[i+1] != '\t') || s[i+1] == 0x7f {
				return false
			}
			i++
		case (c < ' ' && c != '\t') || c == 0x7f:
			return false
		}
	}
	return false
}
