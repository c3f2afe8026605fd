package main

import (
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"
)

const sample = `goos: linux
pkg: github.com/tenantmesh/tenantmesh/services/aggregate
BenchmarkWarm/events=10000/replay-2         	       3	 153317770 ns/op	       151.5 warm-ms	25928248 B/op	  356547 allocs/op
BenchmarkWarm/events=10000/snapshot-2       	       3	  32790392 ns/op	        31.04 warm-ms	13314072 B/op	   38659 allocs/op
--- BENCH: BenchmarkWarm
    bench_test.go:161: loaded 100 events
BenchmarkWarm/events=10000/replay-2         	       3	 143317770 ns/op	       141.5 warm-ms	25928248 B/op	  356547 allocs/op
BenchmarkWarm/events=10000/snapshot-2       	       3	  30790392 ns/op	        29.00 warm-ms	13314072 B/op	   38659 allocs/op
BenchmarkWarm/events=10000/replay-2         	       3	 163317770 ns/op	       100.0 warm-ms	25928248 B/op	  356547 allocs/op
BenchmarkLookup1M                           	1000000	        76.2 ns/op	        48.67 B/placement
PASS
ok  	github.com/tenantmesh/tenantmesh/services/aggregate	4.402s
`

func TestParseAndMedian(t *testing.T) {
	r := parse(sample)
	if got := strings.Join(r.names, ","); got != "Warm/events=10000/replay,Warm/events=10000/snapshot,Lookup1M" {
		t.Fatalf("names %s", got)
	}
	if got := strings.Join(r.units["Warm/events=10000/replay"], ","); got != "ns/op,warm-ms,B/op,allocs/op" {
		t.Fatalf("units %s", got)
	}
	for _, c := range []struct {
		name, unit string
		want       float64
		n          int
	}{
		{"Warm/events=10000/replay", "warm-ms", 141.5, 3},
		{"Warm/events=10000/snapshot", "warm-ms", 30.02, 2},
		{"Lookup1M", "B/placement", 48.67, 1},
	} {
		v, n, ok := r.median(c.name, c.unit)
		if !ok || n != c.n || v != c.want {
			t.Errorf("median %s %s = %v (%d runs, %v), want %v (%d)", c.name, c.unit, v, n, ok, c.want, c.n)
		}
	}
	if _, _, ok := r.median("Lookup1M", "warm-ms"); ok {
		t.Error("median of a unit the benchmark does not report")
	}
}

func TestRender(t *testing.T) {
	e := entry{title: "Aggregate", pkg: "./services/aggregate/", ratios: []ratio{
		same("warm-ms", "Warm/events=10000/snapshot", "Warm/events=10000/replay"),
		same("warm-ms", "Missing", "Warm/events=10000/replay"),
	}}
	now := time.Date(2026, 11, 22, 14, 0, 0, 0, time.UTC)
	out := render(machine{start: now, end: now.Add(time.Minute), cpus: 2, cpu: "AMD EPYC", goVersion: "go1.26.0"},
		[]entryReport{{entry: e, command: "go test -bench x", results: parse(sample)}})
	for _, want := range []string{
		beginMarker, endMarker, "2 cores (nproc), AMD EPYC", "2026-11-22 14:00 UTC",
		"| benchmark | runs | ns/op | warm-ms | B/op | allocs/op | B/placement |",
		"| Warm/events=10000/replay | 3 | 153,317,770 | 142 | 25,928,248 | 356,547 |  |",
		"| Warm/events=10000/snapshot vs Warm/events=10000/replay, warm-ms | 0.212x |",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("render lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(out, "Missing") {
		t.Error("a ratio with a missing side is rendered")
	}
}

func TestTableScalesNsPerOp(t *testing.T) {
	var b strings.Builder
	writeTable(&b, parse(strings.ReplaceAll(sample, "BenchmarkLookup1M ", "Lookup1M ")))
	if want := "| Warm/events=10000/snapshot | 2 | 31.8 | 30.0 |"; !strings.Contains(b.String(), "ms/op") || !strings.Contains(b.String(), want) {
		t.Errorf("table lacks ms/op or %q:\n%s", want, b.String())
	}
}

func TestTransposedTableDropsCommonParent(t *testing.T) {
	var b strings.Builder
	writeTable(&b, parse("BenchmarkP/n=1-2 10 5 ns/op 1 a 2 b 3 c 4 d\nBenchmarkP/n=3-2 10 6 ns/op 1 a 2 b 3 c 4 d\n"))
	if want := "| median, P/ | n=1 | n=3 |\n|---|---:|---:|\n| runs | 1 | 1 |\n| ns/op | 5 | 6 |\n| a | 1 | 1 |"; !strings.HasPrefix(b.String(), want) {
		t.Errorf("table:\n%s\nwant it to start with\n%s", b.String(), want)
	}
}

func TestFailureDetail(t *testing.T) {
	out := "goos: linux\n--- FAIL: BenchmarkColdStart\n    bench_test.go:154: nats: stalled\nFAIL\nexit status 1\n"
	if got, want := failureDetail(out), "BenchmarkColdStart: bench_test.go:154: nats: stalled"; got != want {
		t.Errorf("failureDetail = %q, want %q", got, want)
	}
	if got, want := failureDetail("a\nb\nc\nd\n"), "b / c / d"; got != want {
		t.Errorf("failureDetail = %q, want %q", got, want)
	}
}

func TestSplice(t *testing.T) {
	doc := "# Benchmarks\n\nIntro.\n\n## Hand written\n\ntext\n"
	sec := beginMarker + "\ngenerated 1\n" + endMarker + "\n"
	first, err := splice(doc, sec)
	if err != nil {
		t.Fatal(err)
	}
	if want := "# Benchmarks\n\nIntro.\n\n" + sec + "\n## Hand written\n\ntext\n"; first != want {
		t.Fatalf("first splice:\n%q\nwant\n%q", first, want)
	}
	sec2 := beginMarker + "\ngenerated 2\n" + endMarker + "\n"
	second, err := splice(first, sec2)
	if err != nil {
		t.Fatal(err)
	}
	if want := strings.Replace(first, sec, sec2, 1); second != want {
		t.Fatalf("second splice:\n%q\nwant\n%q", second, want)
	}
	if _, err := splice(endMarker+"\n"+beginMarker, sec); err == nil {
		t.Error("markers out of order accepted")
	}
}

func TestNum3(t *testing.T) {
	for v, want := range map[float64]string{0: "0", 0.01234: "0.0123", 1.0499: "1.05", 48.67: "48.7", 187.1: "187", 25891: "25,891", 93: "93", 2.5: "2.50", 1234567: "1,234,567", -2500: "-2,500"} {
		if got := num3(v); got != want {
			t.Errorf("num3(%v) = %q, want %q", v, got, want)
		}
	}
}

// TestSuiteCoversEveryBenchmark keeps `make bench` complete: every Benchmark function in the
// repository is selected by an entry of the suite for its package.
func TestSuiteCoversEveryBenchmark(t *testing.T) {
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	decl := regexp.MustCompile(`(?m)^func (Benchmark\w*)\(`)
	found := 0
	err = filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && path != root && (strings.HasPrefix(d.Name(), ".") || d.Name() == "testdata") {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(path, "_test.go") {
			return nil
		}
		src, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, filepath.Dir(path))
		pkg := "./" + filepath.ToSlash(rel) + "/"
		for _, m := range decl.FindAllStringSubmatch(string(src), -1) {
			found++
			covered := false
			for _, e := range suite {
				if e.pkg == pkg && regexp.MustCompile(e.bench).MatchString(m[1]) {
					covered = true
				}
			}
			if !covered {
				t.Errorf("%s in %s is not in the make bench suite (test/benchreport/suite.go)", m[1], pkg)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if found == 0 {
		t.Fatal("found no benchmarks")
	}
}

func TestLastTable(t *testing.T) {
	out := "work dir /tmp/x\n| a | b |\n|---|---|\n| 1 | 2 |\nround 1\n\n| target | req/s |\n|---|---:|\n| haproxy | 24,000 |\n"
	want := "| target | req/s |\n|---|---:|\n| haproxy | 24,000 |\n"
	if got := lastTable(out); got != want {
		t.Fatalf("lastTable = %q, want %q", got, want)
	}
	if got := lastTable("no table\n"); got != "" {
		t.Fatalf("lastTable without a table = %q", got)
	}
}
