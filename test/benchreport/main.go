// Command benchreport is `make bench`: it runs tenantmesh's benchmark suite (suite.go) with
// `go test -bench`, takes the median of every reported metric over the -count runs, and rewrites
// the generated section of docs/benchmarks.md, between "<!-- make bench: begin -->" and
// "<!-- make bench: end -->", with the commands, the medians, peer ratios and the machine. The
// hand-written sections around it are left as they are.
//
//	go run ./test/benchreport [-count N] [-benchtime D] [-only REGEXP] [-doc FILE] [-raw FILE]
package main

import (
	"bytes"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"time"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "benchreport:", err)
		os.Exit(1)
	}
}

func run() error {
	doc := flag.String("doc", "docs/benchmarks.md", "the document whose generated section is rewritten")
	count := flag.Int("count", 0, "-count for every benchmark (0: each entry's own, 2-3)")
	benchtime := flag.String("benchtime", "", "-benchtime for the time-based entries (those with a fixed iteration count, e.g. 3x, keep it)")
	only := flag.String("only", "", "run only the entries whose title or package matches; prints the section instead of writing the document")
	raw := flag.String("raw", "", "also write the raw go test output to this file")
	goBin := flag.String("go", "go", "the go command")
	flag.Parse()

	var sel *regexp.Regexp
	if *only != "" {
		var err error
		if sel, err = regexp.Compile(*only); err != nil {
			return fmt.Errorf("-only: %w", err)
		}
	}
	var rawOut io.Writer = io.Discard
	if *raw != "" {
		f, err := os.Create(*raw)
		if err != nil {
			return err
		}
		defer f.Close()
		rawOut = f
	}
	if sel == nil {
		if _, err := os.Stat(*doc); err != nil {
			return err
		}
	}

	m := machine{start: time.Now(), load0: loadavg(), cpus: runtime.NumCPU(), cpu: cpuModel(), goVersion: goVersion(*goBin)}
	var reports []entryReport
	failed := 0
	for _, e := range suite {
		if sel != nil && !sel.MatchString(e.title) && !sel.MatchString(e.pkg) {
			continue
		}
		args, shown := e.command(*count, *benchtime)
		fmt.Fprintf(os.Stderr, "==> %s\n", shown)
		var buf bytes.Buffer
		cmd := exec.Command(*goBin, args...)
		if e.script != "" {
			cmd = exec.Command("bash", "-c", e.script)
		}
		cmd.Stdout = io.MultiWriter(&buf, rawOut, os.Stderr)
		cmd.Stderr = io.MultiWriter(&buf, rawOut, os.Stderr)
		t0 := time.Now()
		err := cmd.Run()
		r := entryReport{entry: e, command: shown, took: time.Since(t0), results: parse(buf.String())}
		if e.script != "" {
			r.table = lastTable(buf.String())
		}
		if err != nil {
			failed++
			r.failure = fmt.Sprintf("%v: %s", err, failureDetail(buf.String()))
		}
		reports = append(reports, r)
	}
	m.end, m.load1 = time.Now(), loadavg()
	section := render(m, reports)
	if sel != nil {
		fmt.Print(section)
	} else {
		old, err := os.ReadFile(*doc)
		if err != nil {
			return err
		}
		updated, err := splice(string(old), section)
		if err != nil {
			return err
		}
		if err := os.WriteFile(*doc, []byte(updated), 0o644); err != nil {
			return err
		}
		fmt.Fprintf(os.Stderr, "wrote the generated section of %s (%s)\n", *doc, m.end.Sub(m.start).Round(time.Second))
	}
	if failed > 0 {
		return fmt.Errorf("%d of %d benchmark runs failed (shown in the section)", failed, len(reports))
	}
	return nil
}

// command is the go test argument list of e and the same as a shell command to show.
func (e entry) command(count int, benchtime string) (args []string, shown string) {
	if e.script != "" {
		return nil, e.script
	}
	bt := e.benchtime
	if benchtime != "" && !strings.HasSuffix(bt, "x") {
		bt = benchtime
	}
	if count <= 0 {
		count = e.count
	}
	args = []string{"test", "-run", "^$", "-bench", e.bench, "-benchtime", bt, "-count", strconv.Itoa(count), "-timeout", "30m"}
	if e.benchmem {
		args = append(args, "-benchmem")
	}
	args = append(args, e.pkg)
	parts := []string{"go"}
	for _, a := range args {
		parts = append(parts, shellQuote(a))
	}
	shown = strings.Join(parts, " ")
	if n := os.Getenv("TM_BENCH_PLACEMENTS"); n != "" && strings.Contains(e.bench, "ColdStart") {
		shown = "TM_BENCH_PLACEMENTS=" + n + " " + shown
	}
	return args, shown
}

// lastTable is the last markdown table (consecutive lines starting with "|") in out.
func lastTable(out string) string {
	var table, cur []string
	for line := range strings.SplitSeq(out, "\n") {
		if strings.HasPrefix(line, "|") {
			cur = append(cur, line)
			continue
		}
		if len(cur) > 0 {
			table, cur = cur, nil
		}
	}
	if len(cur) > 0 {
		table = cur
	}
	if len(table) == 0 {
		return ""
	}
	return strings.Join(table, "\n") + "\n"
}

func shellQuote(s string) string {
	if s != "" && strings.Trim(s, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_./=:,") == "" {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

// failureDetail is the first failing benchmark and its message from go test output, or the
// output's last lines.
func failureDetail(out string) string {
	lines := strings.Split(strings.TrimSpace(out), "\n")
	for i, l := range lines {
		if strings.HasPrefix(l, "--- FAIL: ") {
			detail := []string{strings.TrimPrefix(l, "--- FAIL: ")}
			for _, m := range lines[i+1 : min(len(lines), i+3)] {
				if strings.HasPrefix(m, "    ") {
					detail = append(detail, strings.TrimSpace(m))
				}
			}
			return strings.Join(detail, ": ")
		}
	}
	return strings.Join(lines[max(0, len(lines)-3):], " / ")
}

// machine is what the section says about where and when it was measured.
type machine struct {
	start, end   time.Time
	load0, load1 string
	cpus         int
	cpu          string
	goVersion    string
}

func loadavg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "?"
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "?"
	}
	return strings.Join(f[:3], " ")
}

func cpuModel() string {
	b, err := os.ReadFile("/proc/cpuinfo")
	if err != nil {
		return "unknown CPU"
	}
	for line := range strings.SplitSeq(string(b), "\n") {
		if k, v, ok := strings.Cut(line, ":"); ok && strings.TrimSpace(k) == "model name" {
			return strings.TrimSpace(v)
		}
	}
	return "unknown CPU"
}

func goVersion(goBin string) string {
	out, err := exec.Command(goBin, "env", "GOVERSION").Output()
	if err != nil {
		return runtime.Version()
	}
	return strings.TrimSpace(string(out))
}

// Markers around the generated section.
const (
	beginMarker = "<!-- make bench: begin -->"
	endMarker   = "<!-- make bench: end -->"
)

// splice puts section (markers included) in place of the one in doc, or, the first time,
// before the document's first "## " heading.
func splice(doc, section string) (string, error) {
	b, e := strings.Index(doc, beginMarker), strings.Index(doc, endMarker)
	switch {
	case b < 0 && e < 0:
		at := strings.Index(doc, "\n## ")
		if at < 0 {
			return strings.TrimRight(doc, "\n") + "\n\n" + section, nil
		}
		return doc[:at+1] + section + "\n" + doc[at+1:], nil
	case b < 0 || e < b:
		return "", errors.New("the document's make bench markers are missing or out of order")
	}
	return doc[:b] + section + strings.TrimPrefix(doc[e+len(endMarker):], "\n"), nil
}
