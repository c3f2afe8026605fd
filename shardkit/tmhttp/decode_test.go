package tmhttp

import (
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

func TestReadJSON(t *testing.T) {
	type body struct {
		A int `json:"a"`
	}
	tests := []struct {
		name    string
		given   string
		want    int
		wantErr func(error) bool
	}{
		{"one value", `{"a": 1}` + "\n", 1, nil},
		{"empty", ``, 0, func(err error) bool { return errors.Is(err, io.EOF) }},
		{"unknown field", `{"b": 1}`, 0, func(err error) bool { return err != nil && strings.Contains(err.Error(), "unknown field") }},
		{"two values", `{"a": 1} {"a": 2}`, 1, func(err error) bool { return errors.Is(err, ErrNotOneValue) }},
		{"trailing garbage", `{"a": 1} x`, 1, func(err error) bool { return errors.Is(err, ErrNotOneValue) }},
		{"too long", `{"a": 1` + strings.Repeat(" ", 64) + `}`, 0, func(err error) bool {
			var mbe *http.MaxBytesError
			return errors.As(err, &mbe)
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := httptest.NewRequest(http.MethodPost, "/", strings.NewReader(tt.given))
			var got body
			err := ReadJSON(httptest.NewRecorder(), r, 32, &got)
			if tt.wantErr == nil && err != nil || tt.wantErr != nil && !tt.wantErr(err) {
				t.Fatalf("err = %v", err)
			}
			if got.A != tt.want {
				t.Errorf("decoded %d, want %d", got.A, tt.want)
			}
		})
	}
}
