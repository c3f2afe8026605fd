package gatesig

import (
	"errors"
	"testing"
	"time"
)

func TestProof(t *testing.T) {
	key := KindKey(NewKey(), "aggregate")
	s := NewSigner(key)
	f := Fields{Method: "GET", Base: "/svc", Target: "/agg/x?y=1", Kind: "aggregate", Shard: "aggregate-1", Tenant: "t1", Epoch: "3", Subject: "u"}
	now := time.Now()
	proof := string(s.Append(nil, now.Unix(), &f))
	whole := f
	whole.Base, whole.Target = "", "/svc/agg/x?y=1" // what the shard sees: the whole target
	if err := s.Verify(proof, &whole, now, 30*time.Second); err != nil {
		t.Fatal(err)
	}
	for name, edit := range map[string]func(*Fields){
		"target": func(f *Fields) { f.Target += "&z=2" }, "tenant": func(f *Fields) { f.Tenant = "t2" },
		"epoch": func(f *Fields) { f.Epoch = "4" }, "subject": func(f *Fields) { f.Subject = "admin" },
		"shard": func(f *Fields) { f.Shard = "aggregate-2" }, "method": func(f *Fields) { f.Method = "POST" },
	} {
		g := whole
		edit(&g)
		if err := s.Verify(proof, &g, now, 30*time.Second); !errors.Is(err, ErrInvalid) {
			t.Errorf("another %s: %v", name, err)
		}
	}
	if err := s.Verify(proof, &whole, now.Add(time.Minute), 30*time.Second); !errors.Is(err, ErrStale) {
		t.Errorf("a minute later: %v", err)
	}
	if err := NewSigner(KindKey(NewKey(), "aggregate")).Verify(proof, &whole, now, 30*time.Second); !errors.Is(err, ErrInvalid) {
		t.Errorf("another key: %v", err)
	}
	for _, bad := range []string{"", "v1", "v1 x y", "v2 1 abc", "v1 1 !!!"} {
		if err := s.Verify(bad, &whole, now, 30*time.Second); err == nil {
			t.Errorf("%q verified", bad)
		}
	}
}

// BenchmarkAppend is what a proof costs the gateway per request.
func BenchmarkAppend(b *testing.B) {
	s := NewSigner(KindKey(NewKey(), "aggregate"))
	f := Fields{Method: "POST", Target: "/commands", Kind: "aggregate", Shard: "aggregate-1", Tenant: "acme", Epoch: "7", Subject: "user-7"}
	buf := make([]byte, 0, 80)
	b.ReportAllocs()
	for b.Loop() {
		buf = s.Append(buf[:0], 1790000000, &f)
	}
}
