package h1

import (
	"bytes"
	"errors"
	"io"
	"strings"
	"testing"
)

func TestParseRequest(t *testing.T) {
	ok := func(head string) string { return head }
	tests := []struct {
		name, given string
		status      int // 0: accepted
		cl          int64
		chunked     bool
		close       bool
	}{
		{"plain", ok("GET /a?b=1 HTTP/1.1\r\nHost: h\r\nX-Tenant-Id: t1\r\n\r\n"), 0, -1, false, false},
		{"content length", "POST /a HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\n\r\n", 0, 5, false, false},
		{"chunked", "POST /a HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: Chunked\r\n\r\n", 0, -1, true, false},
		{"http/1.0 closes", "GET / HTTP/1.0\r\n\r\n", 0, -1, false, true},
		{"http/1.0 keep-alive", "GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n", 0, -1, false, false},
		{"connection close", "GET / HTTP/1.1\r\nHost: h\r\nConnection: foo, close\r\n\r\n", 0, -1, false, true},
		{"CL and TE", "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n", 400, 0, false, false},
		{"TE and CL", "POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n", 400, 0, false, false},
		{"two CL", "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n", 400, 0, false, false},
		{"two equal CL", "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\n", 400, 0, false, false},
		{"CL list", "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 5, 5\r\n\r\n", 400, 0, false, false},
		{"CL sign", "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: +5\r\n\r\n", 400, 0, false, false},
		{"CL negative", "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: -1\r\n\r\n", 400, 0, false, false},
		{"CL hex", "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 0x5\r\n\r\n", 400, 0, false, false},
		{"CL empty", "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: \r\n\r\n", 400, 0, false, false},
		{"CL huge", "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 99999999999999999999\r\n\r\n", 400, 0, false, false},
		{"TE gzip chunked", "POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", 400, 0, false, false},
		{"TE chunked twice", "POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked, chunked\r\n\r\n", 400, 0, false, false},
		{"TE two fields", "POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n", 400, 0, false, false},
		{"TE identity", "POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: identity\r\n\r\n", 400, 0, false, false},
		{"TE xchunked", "POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: xchunked\r\n\r\n", 400, 0, false, false},
		{"TE vertical tab", "POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: \x0bchunked\r\n\r\n", 400, 0, false, false},
		{"TE in HTTP/1.0", "POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n", 400, 0, false, false},
		{"space before colon", "POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding : chunked\r\n\r\n", 400, 0, false, false},
		{"obs-fold", "GET / HTTP/1.1\r\nHost: h\r\nX-A: a\r\n b\r\n\r\n", 400, 0, false, false},
		{"obs-fold TE", "POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding:\r\n chunked\r\n\r\n", 400, 0, false, false},
		{"bare LF", "GET / HTTP/1.1\nHost: h\n\n", 400, 0, false, false},
		{"bare LF in field", "GET / HTTP/1.1\r\nHost: h\nX: y\r\n\r\n", 400, 0, false, false},
		{"bare CR", "GET / HTTP/1.1\r\nHost: h\rX: y\r\n\r\n", 400, 0, false, false},
		{"NUL in value", "GET / HTTP/1.1\r\nHost: h\r\nX: a\x00b\r\n\r\n", 400, 0, false, false},
		{"absolute form", "GET http://evil/a HTTP/1.1\r\nHost: h\r\n\r\n", 400, 0, false, false},
		{"authority form", "CONNECT evil:443 HTTP/1.1\r\nHost: h\r\n\r\n", 400, 0, false, false},
		{"asterisk form", "OPTIONS * HTTP/1.1\r\nHost: h\r\n\r\n", 400, 0, false, false},
		{"no host", "GET / HTTP/1.1\r\n\r\n", 400, 0, false, false},
		{"two hosts", "GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400, 0, false, false},
		{"double space", "GET  / HTTP/1.1\r\nHost: h\r\n\r\n", 400, 0, false, false},
		{"space in target", "GET /a b HTTP/1.1\r\nHost: h\r\n\r\n", 400, 0, false, false},
		{"version", "GET / HTTP/1.2\r\nHost: h\r\n\r\n", 400, 0, false, false},
		{"h2 preface", "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 400, 0, false, false},
		{"empty name", "GET / HTTP/1.1\r\nHost: h\r\n: v\r\n\r\n", 400, 0, false, false},
		{"expectation", "GET / HTTP/1.1\r\nHost: h\r\nExpect: tea\r\n\r\n", 417, 0, false, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var r Request
			err := ParseRequest([]byte(tc.given), &r, 100)
			if got := StatusOf(err); got != tc.status || (err != nil) != (tc.status != 0) {
				t.Fatalf("status %d (%v), want %d", got, err, tc.status)
			}
			if err == nil && (r.ContentLength != tc.cl || r.Chunked != tc.chunked || r.Close != tc.close) {
				t.Fatalf("cl %d chunked %v close %v", r.ContentLength, r.Chunked, r.Close)
			}
		})
	}
}

func TestFieldLimit(t *testing.T) {
	head := "GET / HTTP/1.1\r\nHost: h\r\n" + strings.Repeat("X: y\r\n", 10) + "\r\n"
	var r Request
	if err := ParseRequest([]byte(head), &r, 5); StatusOf(err) != 431 {
		t.Fatalf("err %v, want 431", err)
	}
	rd := NewReader(strings.NewReader("GET / HTTP/1.1\r\nHost: h\r\nX: "+strings.Repeat("a", 5000)+"\r\n\r\n"), 1024)
	if _, err := rd.ReadHead(4096); StatusOf(err) != 431 {
		t.Fatalf("err %v, want 431", err)
	}
}

func TestParseResponse(t *testing.T) {
	tests := []struct {
		given  string
		ok     bool
		length int64
		head   bool
	}{
		{"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\n", true, 3, false},
		{"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\n", true, 0, true},
		{"HTTP/1.1 204 No Content\r\n\r\n", true, 0, false},
		{"HTTP/1.1 304 Not Modified\r\nContent-Length: 9\r\n\r\n", true, 0, false},
		{"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", true, BodyChunked, false},
		{"HTTP/1.1 200 OK\r\n\r\n", true, BodyUntilClose, false},
		{"HTTP/1.1 200\r\nContent-Length: 1\r\n\r\n", true, 1, false},
		{"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n", false, 0, false},
		{"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\n", false, 0, false},
		{"HTTP/1.1 20 OK\r\n\r\n", false, 0, false},
		{"HTTP/2.0 200 OK\r\n\r\n", false, 0, false},
		{"HTTP/1.1 200 OK\nContent-Length: 3\n\n", false, 0, false},
		{"HTTP/1.1 200 OK\r\nX: a\r\n b\r\n\r\n", false, 0, false},
	}
	for _, tc := range tests {
		var r Response
		err := ParseResponse([]byte(tc.given), &r, 100)
		if (err == nil) != tc.ok {
			t.Fatalf("%q: err %v", tc.given, err)
		}
		if err == nil && r.BodyLength(tc.head) != tc.length {
			t.Fatalf("%q: length %d, want %d", tc.given, r.BodyLength(tc.head), tc.length)
		}
	}
}

func TestChunked(t *testing.T) {
	tests := []struct {
		given, body string
		ok          bool
		trailer     string
	}{
		{"5\r\nhello\r\n0\r\n\r\n", "hello", true, ""},
		{"5;a=b;c=\"d e\"\r\nhello\r\n6 ; x\r\n world\r\n0\r\nX-Sum: 1\r\n\r\n", "hello world", true, "X-Sum: 1"},
		{"A\r\n0123456789\r\n0\r\n\r\n", "0123456789", true, ""},
		{"-5\r\nhello\r\n0\r\n\r\n", "", false, ""},
		{"0x5\r\nhello\r\n0\r\n\r\n", "", false, ""},
		{" 5\r\nhello\r\n0\r\n\r\n", "", false, ""},
		{"5 \r\nhello\r\n0\r\n\r\n", "", false, ""},
		{"fffffffffffffffff\r\n", "", false, ""},
		{"5;\r\nhello\r\n0\r\n\r\n", "", false, ""},
		{"5;a=\"b\r\nhello\r\n0\r\n\r\n", "", false, ""},
		{"5\r\nhelloXX0\r\n\r\n", "", false, ""},
		{"5\nhello\n0\n\n", "", false, ""},
		{"5\r\nhello\r\n0\r\nContent-Length: 5\r\n\r\n", "", false, ""},
		{"5\r\nhel", "", false, ""},
	}
	for _, tc := range tests {
		var c ChunkedReader
		c.Reset(NewReader(strings.NewReader(tc.given), 64))
		got, err := io.ReadAll(&c)
		if (err == nil) != tc.ok || (tc.ok && string(got) != tc.body) {
			t.Fatalf("%q: body %q err %v", tc.given, got, err)
		}
		if tc.trailer != "" && (len(c.Trailer) != 1 || string(c.Trailer[0].Name)+": "+string(c.Trailer[0].Value) != tc.trailer) {
			t.Fatalf("%q: trailer %q", tc.given, c.Trailer)
		}
	}
}

func TestReadHeadPipelined(t *testing.T) {
	in := "\r\nGET /1 HTTP/1.1\r\nHost: h\r\n\r\nGET /2 HTTP/1.1\r\nHost: h\r\n\r\n"
	rd := NewReader(strings.NewReader(in), 16)
	for _, want := range []string{"/1", "/2"} {
		head, err := rd.ReadHead(1024)
		if err != nil {
			t.Fatal(err)
		}
		var r Request
		if err := ParseRequest(head, &r, 10); err != nil || string(r.Target) != want {
			t.Fatalf("target %q err %v", r.Target, err)
		}
	}
	if _, err := rd.ReadHead(1024); !errors.Is(err, io.EOF) {
		t.Fatalf("err %v, want EOF", err)
	}
}

// FuzzParseRequest: any head either parses into something unambiguous or is refused with a
// status; nothing panics.
func FuzzParseRequest(f *testing.F) {
	for _, s := range []string{
		"GET / HTTP/1.1\r\nHost: h\r\n\r\n",
		"POST /a HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n",
		"POST /a HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\nConnection: close, upgrade\r\nUpgrade: x\r\n\r\n",
		"GET / HTTP/1.0\r\nX: a\r\n b\r\n\r\n",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, head []byte) {
		var r Request
		err := ParseRequest(head, &r, 64)
		if err != nil {
			if s := StatusOf(err); s != 400 && s != 431 && s != 417 {
				t.Fatalf("error without a status: %v", err)
			}
			return
		}
		if r.Chunked && r.ContentLength >= 0 {
			t.Fatal("both chunked and a length")
		}
		if len(r.Target) == 0 || r.Target[0] != '/' {
			t.Fatalf("target %q", r.Target)
		}
		if !bytes.HasSuffix(head, []byte("\r\n\r\n")) {
			t.Fatal("accepted a head that does not end with an empty line")
		}
		for _, f := range r.Fields {
			if bytes.ContainsAny(f.Name, " \t\r\n:") || bytes.ContainsAny(f.Value, "\r\n\x00") {
				t.Fatalf("field %q: %q", f.Name, f.Value)
			}
		}
	})
}

// FuzzParseResponse: the same for response heads.
func FuzzParseResponse(f *testing.F) {
	for _, s := range []string{
		"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\n",
		"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n",
		"HTTP/1.0 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 1\r\n\r\n",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, head []byte) {
		var r Response
		if err := ParseResponse(head, &r, 64); err != nil {
			if StatusOf(err) == 0 {
				t.Fatalf("error without a status: %v", err)
			}
			return
		}
		if r.Chunked && r.ContentLength >= 0 {
			t.Fatal("both chunked and a length")
		}
		if r.Status < 100 || r.Status > 999 {
			t.Fatalf("status %d", r.Status)
		}
	})
}

// FuzzChunked: decoding any input ends (with the body, or an error) without panicking, and
// never returns more bytes than the input holds.
func FuzzChunked(f *testing.F) {
	for _, s := range []string{"5\r\nhello\r\n0\r\n\r\n", "5;a=\"b\\\"c\"\r\nhello\r\n0\r\nX: y\r\n\r\n", "fffffffffffffff\r\n"} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		var c ChunkedReader
		c.Reset(NewReader(bytes.NewReader(in), 32))
		got, _ := io.ReadAll(io.LimitReader(&c, int64(len(in))+1))
		if len(got) > len(in) {
			t.Fatalf("decoded %d bytes from %d", len(got), len(in))
		}
	})
}

// FuzzReadHead: reading heads from any stream ends without panicking; every head returned is
// within the bound and ends with an empty line.
func FuzzReadHead(f *testing.F) {
	f.Add([]byte("GET / HTTP/1.1\r\nHost: h\r\n\r\nGET / HTTP/1.1\r\n\r\n"))
	f.Add([]byte("\r\n\n\nGET / HTTP/1.1\nHost: h\n\n"))
	f.Fuzz(func(t *testing.T, in []byte) {
		rd := NewReader(bytes.NewReader(in), 16)
		for range 64 {
			head, err := rd.ReadHead(256)
			if err != nil {
				return
			}
			if len(head) > 260 || !bytes.HasSuffix(head, []byte("\n\n")) && !bytes.HasSuffix(head, []byte("\n\r\n")) {
				t.Fatalf("head %q", head)
			}
		}
	})
}
