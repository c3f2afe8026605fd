// Package h1 is the gateway's HTTP/1.1 wire code: strict parsers for request and response heads
// that work in place on the caller's buffer (fields are slices of it, nothing is allocated), a
// connection reader with a bounded buffer, and a strict chunked body decoder.
//
// Anything whose framing could be read two ways is refused rather than guessed (RFC 9112
// section 6.3, and what HAProxy and nginx refuse): Content-Length together with
// Transfer-Encoding, a repeated or non-numeric Content-Length, a Transfer-Encoding other than a
// single "chunked", obs-fold, bare LF or CR, whitespace before a field's colon, control
// characters, request targets that are not origin-form, and chunk sizes or extensions that do
// not follow the grammar. A request refused here is answered 400 (431 for oversized heads) and
// never forwarded.
package h1

import (
	"errors"
	"strconv"
)

// Field is one header field: Name and Value are slices of the head it was parsed from, the
// value without surrounding whitespace.
type Field struct{ Name, Value []byte }

// Error is a head or body that is not acceptable HTTP/1.1; Status is the answer a server gives
// (400, or 431 for a head over its bounds).
type Error struct {
	Status int
	Reason string
}

func (e *Error) Error() string { return "h1: " + e.Reason + " (" + strconv.Itoa(e.Status) + ")" }

func bad(reason string) error { return &Error{Status: 400, Reason: reason} }

// ErrHeadTooLarge: no end of the head within the bound.
var ErrHeadTooLarge = &Error{Status: 431, Reason: "head larger than allowed"}

// ErrTooManyFields: more header fields than allowed.
var ErrTooManyFields = &Error{Status: 431, Reason: "too many header fields"}

// StatusOf returns the status an error from this package answers with, or 0 for other errors
// (a network failure: nothing to answer).
func StatusOf(err error) int {
	var e *Error
	if errors.As(err, &e) {
		return e.Status
	}
	return 0
}

// tchar is RFC 9110's token character set.
var tchar = func() (t [256]bool) {
	for c := '0'; c <= '9'; c++ {
		t[c] = true
	}
	for c := 'a'; c <= 'z'; c++ {
		t[c] = true
		t[c-'a'+'A'] = true
	}
	for _, c := range "!#$%&'*+-.^_`|~" {
		t[c] = true
	}
	return t
}()

func isToken(b []byte) bool {
	if len(b) == 0 {
		return false
	}
	for _, c := range b {
		if !tchar[c] {
			return false
		}
	}
	return true
}

// validValue: field-value characters (VCHAR, obs-text, SP, HTAB), no other control characters.
func validValue(b []byte) bool {
	for _, c := range b {
		if (c < ' ' && c != '\t') || c == 0x7f {
			return false
		}
	}
	return true
}

// EqualFold reports whether b equals the ASCII string s, ignoring case.
func EqualFold(b []byte, s string) bool {
	if len(b) != len(s) {
		return false
	}
	for i := 0; i < len(b); i++ {
		x, y := b[i], s[i]
		if x == y {
			continue
		}
		if x|0x20 != y|0x20 || x|0x20 < 'a' || x|0x20 > 'z' {
			return false
		}
	}
	return true
}

// HasPrefixFold reports whether b starts with the ASCII string s, ignoring case.
func HasPrefixFold(b []byte, s string) bool { return len(b) >= len(s) && EqualFold(b[:len(s)], s) }

func trimOWS(b []byte) []byte {
	for len(b) > 0 && (b[0] == ' ' || b[0] == '\t') {
		b = b[1:]
	}
	for len(b) > 0 && (b[len(b)-1] == ' ' || b[len(b)-1] == '\t') {
		b = b[:len(b)-1]
	}
	return b
}

// parseLength parses a Content-Length value: digits only, at most 18 of them.
func parseLength(b []byte) (int64, bool) {
	if len(b) == 0 || len(b) > 18 {
		return 0, false
	}
	var n int64
	for _, c := range b {
		if c < '0' || c > '9' {
			return 0, false
		}
		n = n*10 + int64(c-'0')
	}
	return n, true
}

// HasToken reports whether the comma-separated list v contains tok (case-insensitive).
func HasToken(v []byte, tok string) bool {
	for len(v) > 0 {
		i := 0
		for i < len(v) && v[i] != ',' {
			i++
		}
		if EqualFold(trimOWS(v[:i]), tok) {
			return true
		}
		if i == len(v) {
			break
		}
		v = v[i+1:]
	}
	return false
}

// nextLine returns the line at the start of b (without its CRLF) and the rest; a bare LF or a CR
// inside the line is an error.
func nextLine(b []byte) (line, rest []byte, err error) {
	for i := 0; i < len(b); i++ {
		switch b[i] {
		case '\n':
			return nil, nil, bad("bare LF")
		case '\r':
			if i+1 >= len(b) || b[i+1] != '\n' {
				return nil, nil, bad("bare CR")
			}
			return b[:i], b[i+2:], nil
		}
	}
	return nil, nil, bad("unterminated line")
}

// framing holds what the fields say about the body, as they are parsed.
type framing struct {
	length  int64
	chunked bool
	te, cl  bool
	close   bool
	keep    bool
	upgrade bool
}

// parseFields parses the field lines of a head (after the start line, through the empty line)
// into fields, appending; f accumulates framing. Requests and responses share it.
func parseFields(b []byte, fields []Field, maxFields int, f *framing) ([]Field, []byte, error) {
	f.length = -1
	for {
		line, rest, err := nextLine(b)
		if err != nil {
			return fields, nil, err
		}
		b = rest
		if len(line) == 0 {
			return fields, b, nil
		}
		if line[0] == ' ' || line[0] == '\t' {
			return fields, nil, bad("obs-fold")
		}
		colon := -1
		for i, c := range line {
			if c == ':' {
				colon = i
				break
			}
		}
		if colon <= 0 {
			return fields, nil, bad("field without a name")
		}
		name, value := line[:colon], trimOWS(line[colon+1:])
		if !isToken(name) {
			return fields, nil, bad("invalid field name")
		}
		if !validValue(value) {
			return fields, nil, bad("control character in a field value")
		}
		if len(fields) >= maxFields {
			return fields, nil, ErrTooManyFields
		}
		fields = append(fields, Field{Name: name, Value: value})
		switch {
		case EqualFold(name, "Content-Length"):
			n, ok := parseLength(value)
			if !ok || f.cl {
				return fields, nil, bad("invalid or repeated Content-Length")
			}
			f.cl, f.length = true, n
		case EqualFold(name, "Transfer-Encoding"):
			if f.te || !EqualFold(value, "chunked") {
				return fields, nil, bad("Transfer-Encoding other than one chunked")
			}
			f.te, f.chunked = true, true
		case EqualFold(name, "Connection"):
			f.close = f.close || HasToken(value, "close")
			f.keep = f.keep || HasToken(value, "keep-alive")
			f.upgrade = f.upgrade || HasToken(value, "upgrade")
		}
	}
}
