package projection

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"slices"
	"strconv"
	"strings"
	"time"
)

// The query language (README.md has the walkthrough). A query is one JSON object:
//
//	{"filter": [{"field": "balance", "op": "gte", "value": 100}],
//	 "sort":   [{"field": "balance", "desc": true}],
//	 "limit":  50,
//	 "cursor": "<next_cursor of the previous page>"}
//
// Filters are ANDed. Ops: eq, ne, lt, lte, gt, gte on strings, integers and times (RFC 3339
// strings); prefix on strings; eq, ne on booleans. Rows are ordered by the sort keys, then by
// the view's key, so pages are stable; limit is 1 to MaxLimit (default DefaultLimit).

// Query limits.
const (
	DefaultLimit  = 50
	MaxLimit      = 1000
	MaxFilters    = 20
	MaxSortKeys   = 4
	MaxQueryBytes = 64 << 10
)

// Query errors, mapped to HTTP in writeErr.
var (
	ErrBadQuery    = errors.New("bad query")
	ErrUnknownView = errors.New("unknown view type")
	ErrWarming     = errors.New("tenant is still catching up")
	ErrRefused     = errors.New("this instance cannot read the tenant's newest events (a newer release wrote them); an upgraded instance serves them")
)

// Query is the body of POST /query/{view_type}.
type Query struct {
	Filter []Filter  `json:"filter,omitempty"`
	Sort   []SortKey `json:"sort,omitempty"`
	Limit  int       `json:"limit,omitempty"`
	Cursor string    `json:"cursor,omitempty"`
}

// Filter is one condition on a field.
type Filter struct {
	Field string          `json:"field"`
	Op    string          `json:"op"`
	Value json.RawMessage `json:"value"`
}

// SortKey orders rows by a field.
type SortKey struct {
	Field string `json:"field"`
	Desc  bool   `json:"desc,omitempty"`
}

type fieldType int

const (
	tString fieldType = iota
	tInt
	tBool
	tTime
)

func (t fieldType) String() string {
	return [...]string{"string", "integer", "boolean", "time"}[t]
}

// ops allowed per field type, in the order the error messages list them.
var typeOps = map[fieldType][]string{
	tString: {"eq", "ne", "lt", "lte", "gt", "gte", "prefix"},
	tInt:    {"eq", "ne", "lt", "lte", "gt", "gte"},
	tTime:   {"eq", "ne", "lt", "lte", "gt", "gte"},
	tBool:   {"eq", "ne"},
}

// value is a field's value: strings in s, integers, booleans (0/1) and times (Unix ns) in i.
type value struct {
	s string
	i int64
}

func cmpValue(t fieldType, a, b value) int {
	if t == tString {
		return strings.Compare(a.s, b.s)
	}
	switch {
	case a.i < b.i:
		return -1
	case a.i > b.i:
		return 1
	}
	return 0
}

type field struct {
	name string
	typ  fieldType
	get  func(row any) value
}

// view is one queryable view type over a tenant's state.
type view struct {
	name   string
	about  string
	key    string // unique field, the last sort key
	fields []field
	// scan calls fn with a pointer to each row; the caller holds ts.mu (read).
	scan func(ts *tenantState, fn func(row any))
	// item copies a row for the response.
	item func(row any) any
}

func (v *view) field(name string) (field, bool) {
	for _, f := range v.fields {
		if f.name == name {
			return f, true
		}
	}
	return field{}, false
}

func (v *view) fieldList() string {
	parts := make([]string, len(v.fields))
	for i, f := range v.fields {
		parts[i] = f.name + " (" + f.typ.String() + ")"
	}
	return strings.Join(parts, ", ")
}

func boolValue(b bool) value {
	if b {
		return value{i: 1}
	}
	return value{}
}

func timeValue(t time.Time) value { return value{i: t.UnixNano()} }

func acct(row any) *AccountRow { return row.(*AccountRow) }
func txn(row any) *TxRow       { return row.(*TxRow) }

// Views are the view types, by name.
var Views = map[string]*view{
	"accounts": {
		name: "accounts", key: "id", about: "one row per account: its owner, balance and state",
		fields: []field{
			{"id", tString, func(r any) value { return value{s: acct(r).ID} }},
			{"owner", tString, func(r any) value { return value{s: acct(r).Owner} }},
			{"balance", tInt, func(r any) value { return value{i: acct(r).Balance} }},
			{"closed", tBool, func(r any) value { return boolValue(acct(r).Closed) }},
			{"version", tInt, func(r any) value { return value{i: int64(acct(r).Version)} }},
			{"last_seq", tInt, func(r any) value { return value{i: int64(acct(r).LastSeq)} }},
			{"opened_at", tTime, func(r any) value { return timeValue(acct(r).OpenedAt) }},
			{"updated_at", tTime, func(r any) value { return timeValue(acct(r).UpdatedAt) }},
		},
		scan: func(ts *tenantState, fn func(any)) {
			for _, a := range ts.accounts {
				fn(a)
			}
		},
		item: func(r any) any { return *acct(r) },
	},
	"transactions": {
		name: "transactions", key: "seq", about: "one row per deposit or withdrawal, in stream order",
		fields: []field{
			{"seq", tInt, func(r any) value { return value{i: int64(txn(r).Seq)} }},
			{"account", tString, func(r any) value { return value{s: txn(r).Account} }},
			{"kind", tString, func(r any) value { return value{s: txn(r).Kind} }},
			{"amount", tInt, func(r any) value { return value{i: txn(r).Amount} }},
			{"at", tTime, func(r any) value { return timeValue(txn(r).At) }},
		},
		scan: func(ts *tenantState, fn func(any)) {
			for i := range ts.txs {
				fn(&ts.txs[i])
			}
		},
		item: func(r any) any { return *txn(r) },
	},
}

// ViewNames lists the view types, sorted.
func ViewNames() []string {
	out := make([]string, 0, len(Views))
	for n := range Views {
		out = append(out, n)
	}
	slices.Sort(out)
	return out
}

func unknownView(name string) error {
	return fmt.Errorf("%w %q: the view types are %s", ErrUnknownView, name, strings.Join(ViewNames(), ", "))
}

// plan is a validated query.
type plan struct {
	v      *view
	conds  []cond
	sort   []sortField
	limit  int
	after  []value // from the cursor: the sort values of the previous page's last row
	digest string  // identifies filter and sort, so a cursor is only used with its query
}

type cond struct {
	f   field
	op  string
	val value
}

type sortField struct {
	f    field
	desc bool
}

func badQuery(format string, args ...any) error {
	return fmt.Errorf("%w: "+format, append([]any{ErrBadQuery}, args...)...)
}

// compile validates q against the view and returns its plan.
func compile(v *view, q Query) (*plan, error) {
	p := &plan{v: v, limit: q.Limit}
	if q.Limit == 0 {
		p.limit = DefaultLimit
	}
	if p.limit < 1 || p.limit > MaxLimit {
		return nil, badQuery("limit %d is out of range: use 1 to %d (default %d)", q.Limit, MaxLimit, DefaultLimit)
	}
	if len(q.Filter) > MaxFilters {
		return nil, badQuery("%d filters: at most %d are allowed", len(q.Filter), MaxFilters)
	}
	for i, fl := range q.Filter {
		c, err := compileFilter(v, i, fl)
		if err != nil {
			return nil, err
		}
		p.conds = append(p.conds, c)
	}
	if len(q.Sort) > MaxSortKeys {
		return nil, badQuery("%d sort keys: at most %d are allowed", len(q.Sort), MaxSortKeys)
	}
	hasKey := false
	for i, sk := range q.Sort {
		f, ok := v.field(sk.Field)
		if !ok {
			return nil, badQuery("sort[%d]: unknown field %q for view %q; its fields are %s", i, sk.Field, v.name, v.fieldList())
		}
		p.sort = append(p.sort, sortField{f, sk.Desc})
		hasKey = hasKey || f.name == v.key
	}
	if !hasKey {
		f, _ := v.field(v.key)
		p.sort = append(p.sort, sortField{f: f})
	}
	spec, _ := json.Marshal(struct {
		V string
		F []Filter
		S []SortKey
	}{v.name, q.Filter, q.Sort})
	h := fnv.New64a()
	h.Write(spec)
	p.digest = strconv.FormatUint(h.Sum64(), 36)
	if q.Cursor != "" {
		after, err := p.decodeCursor(q.Cursor)
		if err != nil {
			return nil, err
		}
		p.after = after
	}
	return p, nil
}

func compileFilter(v *view, i int, fl Filter) (cond, error) {
	f, ok := v.field(fl.Field)
	if !ok {
		return cond{}, badQuery("filter[%d]: unknown field %q for view %q; its fields are %s", i, fl.Field, v.name, v.fieldList())
	}
	ops := typeOps[f.typ]
	if !slices.Contains(ops, fl.Op) {
		return cond{}, badQuery("filter[%d]: op %q is not allowed on %s field %q; use one of %s", i, fl.Op, f.typ, f.name, strings.Join(ops, ", "))
	}
	val, err := parseValue(f, fl.Value)
	if err != nil {
		return cond{}, badQuery("filter[%d]: %v", i, err)
	}
	return cond{f, fl.Op, val}, nil
}

func parseValue(f field, raw json.RawMessage) (value, error) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || string(raw) == "null" {
		return value{}, fmt.Errorf("field %q needs a value (%s)", f.name, f.typ)
	}
	switch f.typ {
	case tString:
		var s string
		if err := json.Unmarshal(raw, &s); err != nil {
			return value{}, fmt.Errorf("field %q is a string: give a JSON string, not %s", f.name, raw)
		}
		return value{s: s}, nil
	case tInt:
		n, err := strconv.ParseInt(string(raw), 10, 64)
		if err != nil {
			return value{}, fmt.Errorf("field %q is an integer: give a JSON integer, not %s", f.name, raw)
		}
		return value{i: n}, nil
	case tBool:
		var b bool
		if err := json.Unmarshal(raw, &b); err != nil {
			return value{}, fmt.Errorf("field %q is a boolean: give true or false, not %s", f.name, raw)
		}
		return boolValue(b), nil
	default:
		var s string
		if err := json.Unmarshal(raw, &s); err == nil {
			if t, err := time.Parse(time.RFC3339Nano, s); err == nil {
				return timeValue(t), nil
			}
		}
		return value{}, fmt.Errorf("field %q is a time: give an RFC 3339 string such as \"2026-01-02T15:04:05Z\", not %s", f.name, raw)
	}
}

func (c cond) match(row any) bool {
	got := c.f.get(row)
	if c.op == "prefix" {
		return strings.HasPrefix(got.s, c.val.s)
	}
	n := cmpValue(c.f.typ, got, c.val)
	switch c.op {
	case "eq":
		return n == 0
	case "ne":
		return n != 0
	case "lt":
		return n < 0
	case "lte":
		return n <= 0
	case "gt":
		return n > 0
	default: // gte
		return n >= 0
	}
}

// cmpRow orders rows (or a row against cursor values) by the plan's sort keys.
func (p *plan) cmpVals(a, b []value) int {
	for i, sf := range p.sort {
		n := cmpValue(sf.f.typ, a[i], b[i])
		if sf.desc {
			n = -n
		}
		if n != 0 {
			return n
		}
	}
	return 0
}

func (p *plan) keyOf(row any) []value {
	k := make([]value, len(p.sort))
	for i, sf := range p.sort {
		k[i] = sf.f.get(row)
	}
	return k
}

// cursor is the opaque next_cursor: the last row's sort values and the query's digest.
type cursor struct {
	D string   `json:"d"`
	S []string `json:"s,omitempty"`
	I []int64  `json:"i,omitempty"`
}

func (p *plan) encodeCursor(k []value) string {
	c := cursor{D: p.digest}
	for i, sf := range p.sort {
		if sf.f.typ == tString {
			c.S = append(c.S, k[i].s)
		} else {
			c.I = append(c.I, k[i].i)
		}
	}
	b, _ := json.Marshal(c)
	return base64.RawURLEncoding.EncodeToString(b)
}

func (p *plan) decodeCursor(s string) ([]value, error) {
	b, err := base64.RawURLEncoding.DecodeString(s)
	var c cursor
	if err == nil {
		err = json.Unmarshal(b, &c)
	}
	if err != nil {
		return nil, badQuery("cursor is not one this service issued: pass next_cursor from the previous page unchanged")
	}
	if c.D != p.digest {
		return nil, badQuery("cursor belongs to a different query: keep filter and sort unchanged while paging, or drop the cursor to start over")
	}
	k := make([]value, len(p.sort))
	si, ii := 0, 0
	for i, sf := range p.sort {
		if sf.f.typ == tString {
			if si >= len(c.S) {
				return nil, badQuery("cursor is damaged: pass next_cursor unchanged")
			}
			k[i].s = c.S[si]
			si++
		} else {
			if ii >= len(c.I) {
				return nil, badQuery("cursor is damaged: pass next_cursor unchanged")
			}
			k[i].i = c.I[ii]
			ii++
		}
	}
	return k, nil
}

type hit struct {
	row any
	key []value
}

// run executes the plan over the tenant's views; the caller holds ts.mu (read).
func (p *plan) run(ts *tenantState) (items []any, next string, scanned int) {
	var hits []hit
	p.v.scan(ts, func(row any) {
		scanned++
		for _, c := range p.conds {
			if !c.match(row) {
				return
			}
		}
		k := p.keyOf(row)
		if p.after != nil && p.cmpVals(k, p.after) <= 0 {
			return
		}
		hits = append(hits, hit{row, k})
	})
	slices.SortFunc(hits, func(a, b hit) int { return p.cmpVals(a.key, b.key) })
	n := min(len(hits), p.limit)
	items = make([]any, n)
	for i := range n {
		items[i] = p.v.item(hits[i].row)
	}
	if len(hits) > n {
		next = p.encodeCursor(hits[n-1].key)
	}
	return items, next, scanned
}
