package scale

import (
	"bytes"
	"compress/gzip"
	"context"
	"fmt"
	"io"
	"os"
	"runtime/pprof"

	"google.golang.org/protobuf/encoding/protowire"
)

// Every role runs in one process, so CPU per role comes from a CPU profile: each role's
// goroutines carry the pprof label role=<role> (goroutines inherit their creator's labels, so
// a gateway's connection and request goroutines carry "gateway", a NATS server's client
// goroutines "nats"), and the samples are summed by that label. Work the runtime does for no
// goroutine in particular (background GC) shows as "runtime".

// withRole runs fn with the pprof label role=role on its goroutine and all it creates.
func withRole(role string, fn func()) {
	pprof.Do(context.Background(), pprof.Labels("role", role), func(context.Context) { fn() })
}

// cpuProfile records a CPU profile until stop is called; stop returns CPU seconds by role.
// With keep, the profile is also written to that file.
func cpuProfile(keep string) (stop func() (map[string]float64, error), err error) {
	var buf bytes.Buffer
	if err := pprof.StartCPUProfile(&buf); err != nil {
		return nil, fmt.Errorf("cpu profile: %w", err)
	}
	return func() (map[string]float64, error) {
		pprof.StopCPUProfile()
		if keep != "" {
			if err := os.WriteFile(keep, buf.Bytes(), 0o644); err != nil {
				return nil, err
			}
		}
		return cpuByLabel(buf.Bytes(), "role")
	}, nil
}

// cpuByLabel sums a CPU profile's cpu nanoseconds (the samples' second value) by the value of
// label key, in seconds. It reads the profile.proto wire format with protowire: Profile.sample
// = 2, Profile.string_table = 6; Sample.value = 2, Sample.label = 3; Label.key = 1, Label.str = 2.
func cpuByLabel(gz []byte, key string) (map[string]float64, error) {
	zr, err := gzip.NewReader(bytes.NewReader(gz))
	if err != nil {
		return nil, err
	}
	raw, err := io.ReadAll(io.LimitReader(zr, 256<<20))
	if err != nil {
		return nil, err
	}
	type sample struct {
		ns     int64
		labels [][2]int64
	}
	var samples []sample
	var strs []string
	err = fields(raw, func(num protowire.Number, typ protowire.Type, v []byte, _ uint64) error {
		switch {
		case num == 2 && typ == protowire.BytesType:
			var s sample
			var vals []int64
			err := fields(v, func(num protowire.Number, typ protowire.Type, v []byte, x uint64) error {
				switch {
				case num == 2 && typ == protowire.VarintType:
					vals = append(vals, int64(x))
				case num == 2 && typ == protowire.BytesType: // packed
					for len(v) > 0 {
						x, n := protowire.ConsumeVarint(v)
						if n < 0 {
							return protowire.ParseError(n)
						}
						vals = append(vals, int64(x))
						v = v[n:]
					}
				case num == 3 && typ == protowire.BytesType:
					var l [2]int64
					err := fields(v, func(num protowire.Number, typ protowire.Type, _ []byte, x uint64) error {
						if typ == protowire.VarintType && (num == 1 || num == 2) {
							l[num-1] = int64(x)
						}
						return nil
					})
					if err != nil {
						return err
					}
					s.labels = append(s.labels, l)
				}
				return nil
			})
			if err != nil {
				return err
			}
			if len(vals) >= 2 {
				s.ns = vals[1]
			}
			samples = append(samples, s)
		case num == 6 && typ == protowire.BytesType:
			strs = append(strs, string(v))
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	str := func(i int64) string {
		if i < 0 || int(i) >= len(strs) {
			return ""
		}
		return strs[i]
	}
	out := map[string]float64{}
	for _, s := range samples {
		role := "runtime"
		for _, l := range s.labels {
			if str(l[0]) == key {
				role = str(l[1])
			}
		}
		out[role] += float64(s.ns) / 1e9
	}
	return out, nil
}

// fields calls fn for each field of a protobuf message: v is a bytes field's value, x a
// varint's.
func fields(b []byte, fn func(num protowire.Number, typ protowire.Type, v []byte, x uint64) error) error {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return protowire.ParseError(n)
		}
		b = b[n:]
		var v []byte
		var x uint64
		switch typ {
		case protowire.VarintType:
			x, n = protowire.ConsumeVarint(b)
		case protowire.BytesType:
			v, n = protowire.ConsumeBytes(b)
		default:
			n = protowire.ConsumeFieldValue(num, typ, b)
		}
		if n < 0 {
			return protowire.ParseError(n)
		}
		b = b[n:]
		if err := fn(num, typ, v, x); err != nil {
			return err
		}
	}
	return nil
}
