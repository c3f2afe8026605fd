package h1

// Request is a parsed request head. Method, Target and the fields are slices of the head.
type Request struct {
	Method, Target []byte
	// Minor is the protocol's minor version: HTTP/1.0 or HTTP/1.1.
	Minor  int
	Fields []Field
	// ContentLength is the body's length, -1 when the head has none (no body unless Chunked).
	ContentLength int64
	Chunked       bool
	// Close: the client asked to close the connection after this exchange (Connection: close,
	// or HTTP/1.0 without keep-alive).
	Close bool
	// Upgrade: the client asks to switch protocols (Upgrade and Connection: upgrade).
	Upgrade bool
	// Expect100: Expect: 100-continue.
	Expect100 bool
	// Host is the Host field's value.
	Host []byte
}

// ParseRequest parses a request head (request line through the empty line) into r, reusing
// r.Fields' storage; at most maxFields fields.
func ParseRequest(head []byte, r *Request, maxFields int) error {
	fields := r.Fields[:0]
	*r = Request{Fields: fields}
	line, rest, err := nextLine(head)
	if err != nil {
		return err
	}
	// method SP request-target SP HTTP-version, single spaces.
	sp1 := indexByte(line, ' ')
	if sp1 <= 0 {
		return bad("malformed request line")
	}
	r.Method = line[:sp1]
	if !isToken(r.Method) {
		return bad("invalid method")
	}
	tail := line[sp1+1:]
	sp2 := indexByte(tail, ' ')
	if sp2 <= 0 {
		return bad("malformed request line")
	}
	r.Target = tail[:sp2]
	switch string(tail[sp2+1:]) {
	case "HTTP/1.1":
		r.Minor = 1
	case "HTTP/1.0":
		r.Minor = 0
	default:
		return bad("unsupported protocol version")
	}
	if r.Target[0] != '/' {
		return bad("request target not in origin form")
	}
	for _, c := range r.Target {
		if c <= ' ' || c >= 0x7f {
			return bad("invalid character in the request target")
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
	if f.te && r.Minor == 0 {
		return bad("Transfer-Encoding in HTTP/1.0")
	}
	r.ContentLength, r.Chunked = f.length, f.chunked
	r.Close = f.close || (r.Minor == 0 && !f.keep)
	hosts := 0
	for _, fl := range r.Fields {
		switch {
		case EqualFold(fl.Name, "Host"):
			hosts++
			r.Host = fl.Value
		case EqualFold(fl.Name, "Upgrade"):
			r.Upgrade = f.upgrade
		case EqualFold(fl.Name, "Expect"):
			if !EqualFold(fl.Value, "100-continue") {
				return &Error{Status: 417, Reason: "unsupported expectation"}
			}
			r.Expect100 = r.Minor == 1
		}
	}
	if hosts > 1 || (hosts == 0 && r.Minor == 1) {
		return bad("missing or repeated Host")
	}
	return nil
}

// Get returns the value of the first field named name (case-insensitive), and how many there are.
func Get(fields []Field, name string) (value []byte, n int) {
	for _, f := range fields {
		if EqualFold(f.Name, name) {
			if n == 0 {
				value = f.Value
			}
			n++
		}
	}
	return value, n
}

func indexByte(b []byte, c byte) int {
	for i, x := range b {
		if x == c {
			return i
		}
	}
	return -1
}
