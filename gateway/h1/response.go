package h1

// Response is a parsed response head. Reason and the fields are slices of the head.
type Response struct {
	Minor  int
	Status int
	Reason []byte
	Fields []Field
	// ContentLength is the Content-Length field, -1 when absent.
	ContentLength int64
	Chunked       bool
	// Close: the server closes the connection after this response (Connection: close, or
	// HTTP/1.0 without keep-alive).
	Close bool
}

// Body lengths that are not a byte count, from BodyLength.
const (
	BodyChunked    = -1 // chunked transfer coding
	BodyUntilClose = -2 // delimited by the connection's close
)

// ParseResponse parses a response head (status line through the empty line) into r, reusing
// r.Fields' storage; at most maxFields fields.
func ParseResponse(head []byte, r *Response, maxFields int) error {
	fields := r.Fields[:0]
	*r = Response{Fields: fields}
	line, rest, err := nextLine(head)
	if err != nil {
		return err
	}
	// HTTP-version SP 3DIGIT SP [reason]
	if len(line) < 12 || string(line[:7]) != "HTTP/1." || line[8] != ' ' || (len(line) > 12 && line[12] != ' ') {
		return bad("malformed status line")
	}
	switch line[7] {
	case '0':
		r.Minor = 0
	case '1':
		r.Minor = 1
	default:
		return bad("unsupported protocol version")
	}
	for _, c := range line[9:12] {
		if c < '0' || c > '9' {
			return bad("malformed status code")
		}
		r.Status = r.Status*10 + int(c-'0')
	}
	if r.Status < 100 {
		return bad("malformed status code")
	}
	if len(line) > 13 {
		r.Reason = line[13:]
		if !validValue(r.Reason) {
			return bad("control character in the reason phrase")
		}
	}
	var f framing
	r.Fields, rest, err = parseFields(rest, fields, maxFields, &f)
	if err != nil {
		return err
	}
	if len(rest) != 0 {
		return bad("bytes after the head")
	}
	if f.te && f.cl {
		return bad("both Content-Length and Transfer-Encoding")
	}
	r.ContentLength, r.Chunked = f.length, f.chunked
	r.Close = f.close || (r.Minor == 0 && !f.keep)
	return nil
}

// BodyLength is the length of the body that follows the head (RFC 9112 section 6.3): 0 for
// answers to HEAD and for 1xx, 204 and 304; else the chunked coding, Content-Length, or until
// the connection closes.
func (r *Response) BodyLength(head bool) int64 {
	switch {
	case head || r.Status < 200 || r.Status == 204 || r.Status == 304:
		return 0
	case r.Chunked:
		return BodyChunked
	case r.ContentLength >= 0:
		return r.ContentLength
	}
	return BodyUntilClose
}
