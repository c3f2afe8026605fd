package planner

import (
	"bytes"
	"encoding/json"
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

var update = flag.Bool("update", false, "rewrite testdata/*.golden from the current output")

// goldenInput is a testdata/*.input.json file: a request and the worlds it is planned on.
type goldenInput struct {
	Request Request `json:"request"`
	Worlds  []World `json:"worlds"`
}

// TestGolden plans each testdata/<name>.input.json and compares the dry-run rendering, a
// separator line and the plan's JSON with testdata/<name>.golden (as caddy's adapt tests do).
// Run `go test ./rebalancer/planner -run Golden -update` to accept a deliberate change.
func TestGolden(t *testing.T) {
	inputs, err := filepath.Glob("testdata/*.input.json")
	if err != nil || len(inputs) == 0 {
		t.Fatalf("no golden inputs: %v", err)
	}
	for _, in := range inputs {
		name := strings.TrimSuffix(filepath.Base(in), ".input.json")
		t.Run(name, func(t *testing.T) {
			raw, err := os.ReadFile(in)
			if err != nil {
				t.Fatal(err)
			}
			var gi goldenInput
			dec := json.NewDecoder(bytes.NewReader(raw))
			dec.DisallowUnknownFields()
			if err := dec.Decode(&gi); err != nil {
				t.Fatalf("%s: %v", in, err)
			}
			var got bytes.Buffer
			p, err := Make(gi.Request, gi.Worlds...)
			if err != nil {
				got.WriteString("error: " + err.Error() + "\n")
			} else {
				checkPlan(t, gi.Request.Options, p, gi.Worlds...)
				if err := p.Render(&got); err != nil {
					t.Fatal(err)
				}
				got.WriteString("----------\n")
				js, err := json.MarshalIndent(p, "", "  ")
				if err != nil {
					t.Fatal(err)
				}
				got.Write(append(js, '\n'))
			}
			golden := filepath.Join("testdata", name+".golden")
			if *update {
				if err := os.WriteFile(golden, got.Bytes(), 0o644); err != nil {
					t.Fatal(err)
				}
				return
			}
			want, err := os.ReadFile(golden)
			if err != nil {
				t.Fatalf("%v (run with -update to create it)", err)
			}
			if !bytes.Equal(got.Bytes(), want) {
				t.Errorf("%s differs from %s (run with -update to accept):\n--- got\n%s\n--- want\n%s", name, golden, got.Bytes(), want)
			}
		})
	}
}
