package otlptest

import (
	"testing"
)

func TestTreeAndPath(t *testing.T) {
	spans := []Span{
		{Service: "b", Name: "apply", SpanID: "4", ParentID: "3"},
		{Service: "a", Name: "POST", SpanID: "1", ParentID: "client"},
		{Service: "a", Name: "command", SpanID: "2", ParentID: "1"},
		{Service: "a", Name: "append", SpanID: "3", ParentID: "2"},
		{Service: "a", Name: "other", SpanID: "5", ParentID: "1"},
	}
	want := "a: POST\n  a: command\n    a: append\n      b: apply\n  a: other\n"
	if got := Tree(spans); got != want {
		t.Fatalf("tree:\n%s\nwant:\n%s", got, want)
	}
	if !Path(spans, "a: POST", "a: append", "b: apply") {
		t.Fatal("a chain of descendants not found")
	}
	if !Path(spans, "a: P*", "b: *") {
		t.Fatal("prefixes not matched")
	}
	if Path(spans, "a: other", "b: apply") {
		t.Fatal("found b: apply below a: other, which is not its ancestor")
	}
	if Path(spans, "b: apply", "a: POST") {
		t.Fatal("found a path upwards")
	}
}
