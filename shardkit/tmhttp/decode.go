package tmhttp

import (
	"encoding/json"
	"errors"
	"io"
	"net/http"
)

// ErrNotOneValue is DecodeJSON's error for input that holds more than one JSON value.
var ErrNotOneValue = errors.New("the body must hold exactly one JSON value")

// DecodeJSON decodes the one JSON value rd holds into v, strictly: a field v does not have is
// an error, and so is anything but white space after the value (ErrNotOneValue). Empty input
// is io.EOF, for callers to whom a body is optional.
func DecodeJSON(rd io.Reader, v any) error {
	dec := json.NewDecoder(rd)
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return err
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return ErrNotOneValue
	}
	return nil
}

// ReadJSON is DecodeJSON of r's body, of which it reads at most limit bytes (a longer one is an
// error that is a *http.MaxBytesError, and the connection is closed after the answer).
func ReadJSON(w http.ResponseWriter, r *http.Request, limit int64, v any) error {
	return DecodeJSON(http.MaxBytesReader(w, r.Body, limit), v)
}
