package h1

import (
	"errors"
	"io"
)

// Reader reads heads, lines and bodies from a connection through one buffer that grows, up to a
// bound, only when a head or line needs it. Body reads never move buffered bytes.
type Reader struct {
	rd   io.Reader
	buf  []byte
	r, w int
	scan int // where the search for the head's end resumes

	// BeforeHeadRead, if set, is called before ReadHead reads from the connection: the head is
	// not all buffered (a server sets the head's read deadline there, and only there).
	BeforeHeadRead func()
}

// NewReader reads from rd with a buffer of size bytes to start with.
func NewReader(rd io.Reader, size int) *Reader { return &Reader{rd: rd, buf: make([]byte, size)} }

// Reset discards buffered bytes and reads from rd.
func (b *Reader) Reset(rd io.Reader) {
	b.rd, b.r, b.w, b.scan, b.BeforeHeadRead = rd, 0, 0, 0, nil
}

// Buffered is the number of bytes read from the connection and not consumed yet.
func (b *Reader) Buffered() int { return b.w - b.r }

// fill reads more into the buffer, compacting it first and growing it up to max.
func (b *Reader) fill(max int) error {
	if b.r > 0 && b.w == len(b.buf) {
		copy(b.buf, b.buf[b.r:b.w])
		b.w -= b.r
		b.scan -= b.r
		b.r = 0
	}
	if b.w == len(b.buf) {
		if len(b.buf) >= max {
			return ErrHeadTooLarge
		}
		nb := make([]byte, min(max, 2*len(b.buf)))
		copy(nb, b.buf[b.r:b.w])
		b.w -= b.r
		b.scan -= b.r
		b.r = 0
		b.buf = nb
	}
	n, err := b.rd.Read(b.buf[b.w:])
	b.w += n
	if n > 0 {
		return nil
	}
	if err == nil {
		err = io.ErrNoProgress
	}
	return err
}

// ReadHead returns the next head, from its first line through the empty line that ends it,
// valid until the next call on b. Empty lines before it are skipped (RFC 9112 section 2.2). A
// head whose lines end in a bare LF is returned too, for the parser to refuse. io.EOF: the
// connection closed cleanly between heads.
func (b *Reader) ReadHead(max int) ([]byte, error) {
	b.scan = b.r
	for {
		for b.scan < b.w {
			c := b.buf[b.scan]
			if b.scan == b.r && (c == '\r' || c == '\n') && b.leadingBlank() {
				continue
			}
			if c == '\n' {
				if end := b.endAt(b.scan); end > 0 {
					head := b.buf[b.r:end]
					b.r = end
					return head, nil
				} else if end < 0 {
					break // need more bytes to decide
				}
			}
			b.scan++
		}
		if b.w-b.r >= max {
			return nil, ErrHeadTooLarge
		}
		if b.BeforeHeadRead != nil {
			b.BeforeHeadRead()
		}
		if err := b.fill(max + 4); err != nil {
			if errors.Is(err, io.EOF) {
				if b.w == b.r {
					return nil, io.EOF
				}
				return nil, io.ErrUnexpectedEOF
			}
			return nil, err
		}
	}
}

// leadingBlank consumes one empty line at the head's start; false if more bytes are needed.
func (b *Reader) leadingBlank() bool {
	switch {
	case b.buf[b.r] == '\n':
		b.r++
	case b.r+1 < b.w && b.buf[b.r+1] == '\n':
		b.r += 2
	default:
		return false
	}
	b.scan = b.r
	return true
}

// endAt looks after the LF at i for the empty line that ends a head: the end offset, 0 if this
// LF does not end it, -1 if more bytes are needed.
func (b *Reader) endAt(i int) int {
	if i+1 >= b.w {
		return -1
	}
	switch b.buf[i+1] {
	case '\n':
		return i + 2
	case '\r':
		if i+2 >= b.w {
			return -1
		}
		if b.buf[i+2] == '\n' {
			return i + 3
		}
	}
	return 0
}

// ReadLine returns the next line without its CRLF (valid until the next call on b); a bare LF,
// or a line longer than max, is an error.
func (b *Reader) ReadLine(max int) ([]byte, error) {
	start := b.r
	i := start
	for {
		for ; i < b.w; i++ {
			if b.buf[i] == '\n' {
				if i == b.r || b.buf[i-1] != '\r' {
					return nil, bad("bare LF")
				}
				line := b.buf[b.r : i-1]
				b.r = i + 1
				for _, c := range line {
					if c == '\r' {
						return nil, bad("bare CR")
					}
				}
				return line, nil
			}
		}
		if b.w-b.r > max {
			return nil, bad("line too long")
		}
		off := i - b.r
		if err := b.fill(max + 2); err != nil {
			if err == ErrHeadTooLarge {
				return nil, bad("line too long")
			}
			if err == io.EOF {
				err = io.ErrUnexpectedEOF
			}
			return nil, err
		}
		i = b.r + off
	}
}

// Read reads body bytes: buffered ones first, then from the connection straight into p.
func (b *Reader) Read(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	if b.r < b.w {
		n := copy(p, b.buf[b.r:b.w])
		b.r += n
		return n, nil
	}
	return b.rd.Read(p)
}

// Next returns up to n buffered bytes without copying, reading from the connection into the
// buffer first if none are buffered; the slice is valid until the next call on b.
func (b *Reader) Next(n int) ([]byte, error) {
	if b.r == b.w {
		b.r, b.w = 0, 0
		m, err := b.rd.Read(b.buf)
		b.w = m
		if m == 0 {
			if err == nil {
				err = io.ErrNoProgress
			}
			return nil, err
		}
	}
	m := min(n, b.w-b.r)
	p := b.buf[b.r : b.r+m]
	b.r += m
	return p, nil
}

// Wait blocks until at least one byte is buffered.
func (b *Reader) Wait() error {
	if b.r < b.w {
		return nil
	}
	b.r, b.w = 0, 0
	for b.w == 0 {
		n, err := b.rd.Read(b.buf)
		b.w = n
		if n == 0 && err == nil {
			err = io.ErrNoProgress
		}
		if n == 0 {
			return err
		}
	}
	return nil
}
