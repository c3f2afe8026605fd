package jsx

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
)

// Format is the version of the record format this binary writes, and the newest it reads.
// Every JSON record jsx writes (KV values, and stream messages encoded with Marshal) starts
// with it: {"format":1,...}. A record without it predates formats and is format 1. A binary
// that meets a newer format refuses the record (ErrNewerFormat) rather than guess what its
// unknown fields meant; a format change that an older binary can read safely (a field it may
// ignore) keeps the number. docs/decisions.md, "Records carry a format version".
const Format = 1

// ErrNewerFormat is a record written in a newer format than this binary reads.
var ErrNewerFormat = errors.New("written by a newer tenantmesh in a record format this binary cannot read; upgrade this binary to read it")

var formatPrefix = []byte(`{"format":`)

// Marshal encodes v as JSON with "format" as its first key (v must encode as an object;
// one with a "format" field of its own is left as it is).
func Marshal(v any) ([]byte, error) {
	b, err := json.Marshal(v)
	if err != nil || len(b) < 2 || b[0] != '{' || bytes.Contains(b, []byte(`"format":`)) {
		return b, err
	}
	out := make([]byte, 0, len(b)+len(formatPrefix)+2)
	out = append(out, formatPrefix...)
	out = strconv.AppendInt(out, Format, 10)
	if len(b) > 2 {
		out = append(out, ',')
	}
	return append(out, b[1:]...), nil
}

// RecordFormat is the format of a record Marshal wrote (1 for one without: it predates
// formats), read from its first key without decoding it.
func RecordFormat(b []byte) int {
	b = bytes.TrimLeft(b, " \t\r\n")
	if !bytes.HasPrefix(b, formatPrefix) {
		return 1
	}
	b = b[len(formatPrefix):]
	n := 0
	for n < len(b) && b[n] >= '0' && b[n] <= '9' {
		n++
	}
	f, err := strconv.Atoi(string(b[:n]))
	if err != nil {
		return 1 << 30 // "format" leads but is no number: not ours to guess
	}
	return f
}

// CheckFormat refuses a record of a newer format than this binary reads.
func CheckFormat(b []byte) error {
	if f := RecordFormat(b); f > Format {
		return fmt.Errorf("record format %d (this binary reads up to %d): %w", f, Format, ErrNewerFormat)
	}
	return nil
}

// Unmarshal decodes a record into v, refusing a newer format (ErrNewerFormat).
func Unmarshal(b []byte, v any) error {
	if err := CheckFormat(b); err != nil {
		return err
	}
	return json.Unmarshal(b, v)
}
