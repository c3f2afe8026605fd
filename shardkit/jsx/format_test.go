package jsx_test

import (
	"errors"
	"testing"

	"github.com/tenantmesh/tenantmesh/shardkit/jsx"
)

func TestRecordFormat(t *testing.T) {
	for _, tc := range []struct {
		name, given string
		format      int
		refused     bool
	}{
		{"ours", `{"format":1,"a":1}`, 1, false},
		{"before formats", `{"a":1}`, 1, false},
		{"newer", `{"format":2,"a":1}`, 2, true},
		{"much newer", ` {"format":12}`, 12, true},
		{"not a number", `{"format":"x"}`, 1 << 30, true},
		{"format not first", `{"a":1,"format":9}`, 1, false}, // records lead with it; a field deeper is the record's own
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := jsx.RecordFormat([]byte(tc.given)); got != tc.format {
				t.Errorf("RecordFormat(%s) = %d, want %d", tc.given, got, tc.format)
			}
			var v map[string]any
			err := jsx.Unmarshal([]byte(tc.given), &v)
			if refused := errors.Is(err, jsx.ErrNewerFormat); refused != tc.refused {
				t.Errorf("Unmarshal(%s): %v, refused %v, want %v", tc.given, err, refused, tc.refused)
			}
		})
	}
	for _, tc := range []struct {
		given any
		want  string
	}{
		{struct {
			A int `json:"a"`
		}{1}, `{"format":1,"a":1}`},
		{struct{}{}, `{"format":1}`},
		{struct {
			Format int `json:"format"`
		}{3}, `{"format":3}`}, // a record with a format of its own keeps it
		{[]int{1}, `[1]`},
	} {
		b, err := jsx.Marshal(tc.given)
		if err != nil || string(b) != tc.want {
			t.Errorf("Marshal(%+v) = %s %v, want %s", tc.given, b, err, tc.want)
		}
	}
}
