// Package gatesig is how a gateway proves to a shard that a request came through it: a shard
// believes x-tenant-id, x-tm-epoch and x-tm-subject only from a gateway, and without a proof
// anyone who reaches a shard's port could name any tenant there, past the edge's identity
// check (docs/security.md, "Shards trust the gateway, not the network").
//
// The proof is an HMAC-SHA256 over the request line and the fields the gate acts on, with the
// time it was made:
//
//	X-Tm-Proof: v1 <unix seconds> <base64url MAC>
//	MAC = HMAC(kind key, "tenantmesh-gate v1\n" time "\n" method "\n" target "\n" kind "\n"
//	           shard "\n" tenant "\n" epoch "\n" subject)
//
// A kind's key is derived from the gateways' master key (KindKey), so a shard holds only its
// kind's key: it cannot prove requests to another kind's shards, and a gateway needs one
// secret for every kind. A shard accepts a proof made within its skew of its own clock (30 s
// by default); one proof fits one request line for one tenant, epoch and subject, so a copy is
// worth little, and TLS on the hop keeps it from being copied at all.
package gatesig

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"fmt"
	"hash"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/tenantmesh/tenantmesh/internal/secretfile"
)

// Version is the proof's format, its first token.
const Version = "v1"

// KeySize is the size of the master key and of the kind keys.
const KeySize = 32

const label = "tenantmesh-gate v1\n"

// KindKey derives kind's key from the master key.
func KindKey(master []byte, kind string) []byte {
	m := hmac.New(sha256.New, master)
	m.Write([]byte("tenantmesh-gate kind key\n" + kind))
	return m.Sum(nil)
}

// Fields are what a proof covers besides the time. The request target is Base followed by
// Target (the gateway writes an instance's base path before the client's target; a shard
// passes its whole request target as Target).
type Fields struct {
	Method, Base, Target, Kind, Shard, Tenant, Epoch, Subject string
}

// Signer makes proofs with one kind's key; it is safe for concurrent use and, once warm,
// allocates nothing.
type Signer struct {
	pool sync.Pool // *macState
}

// macState is an HMAC with the key and a buffer the message is put together in (crypto/hmac
// takes bytes only: writing each string would copy it to the heap).
type macState struct {
	h   hash.Hash
	msg []byte
	sum [sha256.Size]byte
}

// NewSigner makes a Signer with key.
func NewSigner(key []byte) *Signer {
	key = append([]byte(nil), key...)
	return &Signer{pool: sync.Pool{New: func() any { return &macState{h: hmac.New(sha256.New, key), msg: make([]byte, 0, 512)} }}}
}

// mac computes the MAC of f made at ts.
func (s *Signer) mac(ts int64, f *Fields, sum *[sha256.Size]byte) {
	m := s.pool.Get().(*macState)
	b := append(m.msg[:0], label...)
	b = strconv.AppendInt(b, ts, 10)
	b = append(b, '\n')
	b = append(b, f.Method...)
	b = append(b, '\n')
	b = append(b, f.Base...)
	for _, v := range [...]string{f.Target, f.Kind, f.Shard, f.Tenant, f.Epoch, f.Subject} {
		b = append(b, v...)
		b = append(b, '\n')
	}
	m.h.Reset()
	m.h.Write(b)
	m.h.Sum(m.sum[:0]) // into m: a buffer passed to the interface's Sum would escape
	*sum = m.sum
	if cap(b) <= 4<<10 {
		m.msg = b
	}
	s.pool.Put(m)
}

// Append appends the field value of a proof of f made at unix time ts to dst.
func (s *Signer) Append(dst []byte, ts int64, f *Fields) []byte {
	var sum [sha256.Size]byte
	s.mac(ts, f, &sum)
	dst = append(dst, Version...)
	dst = append(dst, ' ')
	dst = strconv.AppendInt(dst, ts, 10)
	dst = append(dst, ' ')
	return base64.RawURLEncoding.AppendEncode(dst, sum[:])
}

// Errors of Verify, wrapped.
var (
	ErrMissing = errors.New("no gateway proof")
	ErrInvalid = errors.New("the gateway proof does not verify")
	ErrStale   = errors.New("the gateway proof is too old or from the future")
)

// Verify checks a proof field value against f, at now, allowing skew either way.
func (s *Signer) Verify(value string, f *Fields, now time.Time, skew time.Duration) error {
	if value == "" {
		return ErrMissing
	}
	ver, rest, ok1 := strings.Cut(value, " ")
	tsStr, macStr, ok2 := strings.Cut(rest, " ")
	if !ok1 || !ok2 || ver != Version {
		return fmt.Errorf("%w: want %q <time> <mac>", ErrInvalid, Version)
	}
	ts, err := strconv.ParseInt(tsStr, 10, 64)
	if err != nil {
		return fmt.Errorf("%w: bad time", ErrInvalid)
	}
	var got [sha256.Size]byte
	if n, err := base64.RawURLEncoding.Decode(got[:], []byte(macStr)); err != nil || n != len(got) || len(macStr) != 43 {
		return fmt.Errorf("%w: bad mac", ErrInvalid)
	}
	var want [sha256.Size]byte
	s.mac(ts, f, &want)
	if !hmac.Equal(got[:], want[:]) {
		return ErrInvalid
	}
	if d := now.Sub(time.Unix(ts, 0)); d > skew || d < -skew {
		return fmt.Errorf("%w: made %v from now, %v allowed", ErrStale, d.Round(time.Second), skew)
	}
	return nil
}

// NewKey makes a random master key.
func NewKey() []byte {
	k := make([]byte, KeySize)
	if _, err := rand.Read(k); err != nil {
		panic(err) // crypto/rand does not fail on supported systems
	}
	return k
}

// ReadKeyFile reads a key file: the key in base64 (standard or URL alphabet), at least
// KeySize bytes.
func ReadKeyFile(path string) ([]byte, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	s := strings.TrimSpace(string(b))
	k, err := base64.StdEncoding.DecodeString(s)
	if err != nil {
		if k, err = base64.RawURLEncoding.DecodeString(strings.TrimRight(s, "=")); err != nil {
			return nil, fmt.Errorf("%s: not a base64 key", path)
		}
	}
	if len(k) < KeySize {
		return nil, fmt.Errorf("%s: the key has %d bytes; at least %d are needed", path, len(k), KeySize)
	}
	return k, nil
}

// WriteKeyFile writes key to path as base64 with mode 0600, through a new file (O_EXCL) renamed
// into place.
func WriteKeyFile(path string, key []byte) error {
	return secretfile.Write(path, []byte(base64.StdEncoding.EncodeToString(key)+"\n"))
}

// LoadOrCreate reads the master key at path, or makes one and keeps it there.
func LoadOrCreate(path string) ([]byte, error) {
	k, err := ReadKeyFile(path)
	if err == nil || !errors.Is(err, os.ErrNotExist) {
		return k, err
	}
	k = NewKey()
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return nil, err
	}
	return k, WriteKeyFile(path, k)
}
