package jsx

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/tenantmesh/tenantmesh/internal/backoff"
)

// retry runs op until it succeeds, fails for good, or ctx ends, backing off between attempts
// that failed transiently (see ErrUnavailable). retryIf picks the failures worth another
// attempt: any transient one for a read, only "reached nobody" for a write. firstTry, if
// positive, bounds the first attempt, each later one twice the one before, at most 4 x
// firstTry (backoff.Policy.TryTimeout): a short first attempt makes a lost answer cheap (a
// stream leader that stopped answers nothing; its successor answers the next attempt), and
// the longer later ones still let a write through on a server too loaded to answer within the
// first bound. The error returned is op's last, marked ErrUnavailable when transient.
func retry(ctx context.Context, retryIf func(error) bool, firstTry time.Duration, op func(context.Context) error) error {
	return unavailable(backoff.Retry(ctx, backoff.Policy{Initial: 25 * time.Millisecond, Max: 500 * time.Millisecond,
		TryTimeout: firstTry, RetryIf: retryIf}, op))
}

// Read runs op, bounded by ctx or the client's timeout, again while it fails transiently (see
// ErrUnavailable): for reads, which may be made twice.
func (c *Client) Read(ctx context.Context, op func(context.Context) error) error {
	ctx, cancel := c.bound(ctx)
	defer cancel()
	return retry(ctx, transient, 0, op)
}

// PublishOnce publishes data on subject to a stream with message id msgID, made again while
// unanswered: the stream's duplicate window drops a second copy if the first was stored.
func (c *Client) PublishOnce(ctx context.Context, subject string, data []byte, msgID string) error {
	ctx, cancel := c.bound(ctx)
	defer cancel()
	return retry(ctx, transient, WriteTry, func(ctx context.Context) error {
		_, err := c.js.Publish(ctx, subject, data, jetstream.WithMsgID(msgID))
		return err
	})

}

// readAttempt bounds the first attempt of a single-key read (retry): a request whose server
// went away (a stream leader stopped) gets no answer, and the next attempt, after the
// election, should not wait the whole store timeout for it. A read is idempotent, so an
// attempt that timed out is simply made again.
const readAttempt = 400 * time.Millisecond

// Get reads key into v and returns its revision. It reads with a direct get, which any replica
// of the bucket may answer, so on a cluster it can miss a write acknowledged just before (a
// replica that is behind): use Latest where the caller must see its own or another process's
// acknowledged writes.
func (r *Records) Get(ctx context.Context, key string, v any) (uint64, error) {
	c, kv := r.c, r.kv
	ctx, cancel := c.bound(ctx)
	defer cancel()
	var e jetstream.KeyValueEntry
	err := retry(ctx, transient, readAttempt, func(ctx context.Context) (err error) {
		e, err = kv.Get(ctx, key)
		return err
	})

	if err != nil {
		if errors.Is(err, jetstream.ErrKeyNotFound) {
			return 0, fmt.Errorf("%s/%s: %w", kv.Bucket(), key, ErrNotFound)
		}
		return 0, fmt.Errorf("get %s/%s: %w", kv.Bucket(), key, err)
	}
	if err := CheckFormat(e.Value()); err != nil {
		return e.Revision(), fmt.Errorf("%s/%s revision %d: %w", kv.Bucket(), key, e.Revision(), err)
	}
	if err := json.Unmarshal(e.Value(), v); err != nil {
		return e.Revision(), fmt.Errorf("%s/%s revision %d: %w: %v", kv.Bucket(), key, e.Revision(), ErrCorrupt, err)
	}
	return e.Revision(), nil
}

// Latest is Get answered by the bucket's stream leader (JetStream's STREAM.MSG.GET rather than
// a direct get): it sees every write acknowledged before it was sent, by this process or any
// other (a plan just created is always found). While the stream has no leader it fails with
// ErrUnavailable.
func (r *Records) Latest(ctx context.Context, key string, v any) (uint64, error) {
	c, kv := r.c, r.kv
	data, rev, err := c.LeaderGet(ctx, kv.Bucket(), key)
	if err != nil {
		if errors.Is(err, jetstream.ErrKeyNotFound) {
			return 0, fmt.Errorf("%s/%s: %w", kv.Bucket(), key, ErrNotFound)
		}
		return 0, fmt.Errorf("get %s/%s from the leader: %w", kv.Bucket(), key, err)
	}
	if err := CheckFormat(data); err != nil {
		return rev, fmt.Errorf("%s/%s revision %d: %w", kv.Bucket(), key, rev, err)
	}
	if err := json.Unmarshal(data, v); err != nil {
		return rev, fmt.Errorf("%s/%s revision %d: %w: %v", kv.Bucket(), key, rev, ErrCorrupt, err)
	}
	return rev, nil
}

// leaderGet asks the stream leader of bucket for key's last message. A deleted or purged key,
// or one never written, is jetstream.ErrKeyNotFound.
func (c *Client) leaderGet(ctx context.Context, bucket, key string) ([]byte, uint64, error) {
	m, err := leaderLast(ctx, c.nc, KVStream(bucket), KVSubject(bucket, key))
	if errors.Is(err, jetstream.ErrMsgNotFound) {
		return nil, 0, jetstream.ErrKeyNotFound
	}
	if err != nil {
		return nil, 0, err
	}
	if len(m.Header) > 0 {
		h, err := nats.DecodeHeadersMsg(m.Header)
		if err != nil {
			return nil, 0, fmt.Errorf("invalid message headers: %w", err)
		}
		// A delete, a purge, or the marker JetStream leaves where a value's TTL ran out.
		if op := h.Get("KV-Operation"); op == "DEL" || op == "PURGE" || h.Get("Nats-Marker-Reason") != "" {
			return nil, 0, jetstream.ErrKeyNotFound
		}
	}
	return m.Data, m.Sequence, nil
}

// storedMsg is a message as JetStream's STREAM.MSG.GET answers it.
type storedMsg struct {
	Sequence uint64 `json:"seq"`
	Header   []byte `json:"hdrs"`
	Data     []byte `json:"data"`
}

// leaderLast asks stream's leader for the last message on subject (wildcards allowed): unlike
// a direct get, which any replica may answer, it sees every write acknowledged before it was
// sent. None is jetstream.ErrMsgNotFound.
func leaderLast(ctx context.Context, nc *nats.Conn, stream, subject string) (*storedMsg, error) {
	req, err := json.Marshal(map[string]string{"last_by_subj": subject})
	if err != nil {
		return nil, err
	}
	msg, err := nc.RequestWithContext(ctx, "$JS.API.STREAM.MSG.GET."+stream, req)
	if err != nil {
		return nil, err
	}
	var resp struct {
		Error   *jetstream.APIError `json:"error"`
		Message *storedMsg          `json:"message"`
	}
	if err := json.Unmarshal(msg.Data, &resp); err != nil {
		return nil, fmt.Errorf("invalid JetStream response: %w", err)
	}
	switch {
	case resp.Error != nil && resp.Error.ErrorCode == jetstream.JSErrCodeMessageNotFound:
		return nil, jetstream.ErrMsgNotFound
	case resp.Error != nil:
		return nil, resp.Error
	case resp.Message == nil:
		return nil, jetstream.ErrInvalidJetStreamResponse
	}
	return resp.Message, nil
}

// LastSeq is the stream sequence of the newest message of stream on subject (wildcards
// allowed; 0 if none), answered by the stream leader, so it covers every append acknowledged
// before the call: a move's fence is read this way. Transient failures are retried within the
// store's timeout.
func (c *Client) LastSeq(ctx context.Context, stream, subject string) (uint64, error) {
	ctx, cancel := c.bound(ctx)
	defer cancel()
	var seq uint64
	err := retry(ctx, transient, readAttempt, func(ctx context.Context) error {
		m, err := leaderLast(ctx, c.nc, stream, subject)
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			seq = 0
			return nil
		}
		if err != nil {
			return err
		}
		seq = m.Sequence
		return nil
	})

	if err != nil {
		return 0, fmt.Errorf("last message of %s on %s: %w", stream, subject, err)
	}
	return seq, nil
}

// StreamLastSeq is the sequence of stream's newest message, from its leader's stream info:
// LastSeq over the whole stream at a constant cost. The leader finds the last message on a
// wildcard subject by walking the stream's subjects, which at 1M keys cost a placement
// watcher's confirmation (once a second) seconds of the leader's time: 30 watchers starved a
// 3-node cluster (make scale, 996 instances). Transient failures are retried within the
// store's timeout.
func (c *Client) StreamLastSeq(ctx context.Context, stream string) (uint64, error) {
	ctx, cancel := c.bound(ctx)
	defer cancel()
	var seq uint64
	err := retry(ctx, transient, readAttempt, func(ctx context.Context) error {
		st, err := c.js.Stream(ctx, stream)
		if err != nil {
			return err
		}
		seq = st.CachedInfo().State.LastSeq
		return nil
	})
	if err != nil {
		return 0, fmt.Errorf("last sequence of %s: %w", stream, err)
	}
	return seq, nil
}

// DirectLastSeq is LastSeq answered by any replica of st (a direct get; the stream must allow
// it), which may be a little behind the leader: for figures such as a lag, not for fences.
// Each try is bounded, so a call made while a leader is elected does not wait out nats.go's
// whole 5 s timeout.
func (c *Client) DirectLastSeq(ctx context.Context, st jetstream.Stream, subject string) (uint64, error) {
	var seq uint64
	err := c.ReadTries(ctx, func(ctx context.Context) error {
		m, err := st.GetLastMsgForSubject(ctx, subject)
		switch {
		case errors.Is(err, jetstream.ErrMsgNotFound):
			seq = 0
		case err != nil:
			return err
		default:
			seq = m.Sequence
		}
		return nil
	})
	if err != nil {
		return 0, fmt.Errorf("last message on %s: %w", subject, err)
	}
	return seq, nil
}

// ReadTries is Read with each attempt bounded (400 ms, doubling up to 1.6 s): for a read on a
// move's path, so that an answer lost while NATS elects a leader costs a short try, not the
// whole timeout.
func (c *Client) ReadTries(ctx context.Context, op func(context.Context) error) error {
	ctx, cancel := c.bound(ctx)
	defer cancel()
	return retry(ctx, transient, readAttempt, op)
}

// CompareAndSet writes v to key if its revision is still rev (0: only if absent) and returns
// the new revision. A lost race is a *ConflictError.
//
// Each attempt is bounded to WriteTry, and an attempt that went unanswered is made again: after
// a stream leader dies, the next leader answers in about two seconds, and waiting out the
// store's whole timeout would hold a move's handoff that long. An unanswered attempt may have
// been stored, so a conflict after one is checked against the key's newest value: if it is
// what this call wrote, the write was ours and succeeded.
func (r *Records) CompareAndSet(ctx context.Context, key string, rev uint64, v any) (uint64, error) {
	c, kv := r.c, r.kv
	b, err := Marshal(v)
	if err != nil {
		return 0, fmt.Errorf("encode %s/%s: %w", kv.Bucket(), key, err)
	}
	ctx, cancel := c.bound(ctx)
	defer cancel()
	var newRev uint64
	var doubt inDoubt
	err = writeCAS(ctx, &doubt, func(ctx context.Context) (err error) {
		if rev == 0 {
			newRev, err = kv.Create(ctx, key, b)
		} else {
			newRev, err = kv.Update(ctx, key, b, rev)
		}
		return err
	})

	if err != nil && IsConflict(err) && doubt.was {
		if got, ok := c.recognise(ctx, kv.Bucket(), key, b, rev, writeInFlight(err)); ok {
			return got, nil
		}
	}
	if err != nil {
		if IsConflict(err) {
			return 0, &ConflictError{Bucket: kv.Bucket(), Key: key, Expected: rev, Err: err}
		}
		return 0, fmt.Errorf("write %s/%s: %w", kv.Bucket(), key, err)
	}
	return newRev, nil
}

// writeCAS makes a conditional write: again while unanswered (doubt notes that it may have
// been stored), and again while the stream leader has a write of the key in flight.
//
// A leader refuses a conditional write while another write of its key is proposed and not yet
// applied there, with "wrong last sequence" and no sequence (err_code 10164). That is not a
// lost race: the write in flight may be the very one the caller read (a follower applies a
// write, and delivers it to a watch, before the leader has), and it may yet fail. Taken for a
// conflict, both targets of a move gave up their commit and the handoff waited 2 s for the
// rebalancer's (make scale). Once the write in flight is applied, the next try wins or loses
// for real; the pauses are short, as a write is applied within milliseconds. The tries are
// few (inFlightTries, about 30-60 ms in all): a leader too loaded to apply its writes soon
// gets no storm of them, and the caller gets the refusal as a conflict, as before.
func writeCAS(ctx context.Context, doubt *inDoubt, write func(context.Context) error) error {
	inFlight := backoff.Policy{Initial: time.Millisecond, Max: 32 * time.Millisecond, Jitter: backoff.Half,
		Tries: inFlightTries, RetryIf: writeInFlight}
	return backoff.Retry(ctx, inFlight, func(ctx context.Context) error { return retry(ctx, doubt.note, WriteTry, write) })
}

// inFlightTries bounds the tries of a conditional write the stream leader refuses for a write
// of its key in flight (writeCAS).
const inFlightTries = 7

// WriteTry bounds the first attempt of a write (see Records.CompareAndSet). A healthy write takes
// milliseconds, under load tens of them; an answer lost with a stream leader that stopped is
// waited for this long before the next attempt reaches the new leader.
const WriteTry = 500 * time.Millisecond

// inDoubt is a write's retry rule that remembers whether an attempt may have been stored: any
// transient failure but "reached nobody" leaves the outcome unknown.
type inDoubt struct{ was bool }

func (d *inDoubt) note(err error) bool {
	if !transient(err) {
		return false
	}
	if !noResponders(err) {
		d.was = true
	}
	return true
}

// recognise reports whether key's newest value, read from the stream leader, is exactly b (a
// write whose answer was lost landed), and its revision. Values written through the store
// carry their write time, so another writer's value does not match by accident.
//
// inFlight says the last refusal was for a write of the key in flight (writeCAS), likely the
// unanswered attempt itself on a leader slow to apply it: the read-back then waits while the key
// is still at prev (0: absent), until the write in flight lands or the timeout.
func (c *Client) recognise(ctx context.Context, bucket, key string, b []byte, prev uint64, inFlight bool) (uint64, bool) {
	// The read-back has the client's whole timeout, each try bounded: answering "conflict" for
	// a write that landed (because a loaded server was slow to answer the read) is worse than a
	// slower right answer.
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), c.opts.Timeout)
	defer cancel()
	pauses := backoff.Policy{Initial: 5 * time.Millisecond, Max: 200 * time.Millisecond, Jitter: backoff.Half}.Pauses()
	for {
		var data []byte
		var rev uint64
		err := retry(rctx, transient, readAttempt, func(ctx context.Context) (err error) {
			data, rev, err = c.leaderGet(ctx, bucket, key)
			if errors.Is(err, jetstream.ErrKeyNotFound) {
				return nil // rev 0
			}
			return err
		})
		if err != nil {
			return 0, false
		}
		if !inFlight || rev != prev || !pauses.Wait(rctx) {
			return rev, rev != 0 && bytes.Equal(data, b)
		}
	}
}

// Put writes v to key unconditionally. An unanswered attempt is simply made again (see
// CompareAndSet): writing the same value twice leaves the same value.
func (r *Records) Put(ctx context.Context, key string, v any) (uint64, error) {
	c, kv := r.c, r.kv
	b, err := Marshal(v)
	if err != nil {
		return 0, fmt.Errorf("encode %s/%s: %w", kv.Bucket(), key, err)
	}
	ctx, cancel := c.bound(ctx)
	defer cancel()
	var rev uint64
	err = retry(ctx, transient, WriteTry, func(ctx context.Context) (err error) {
		rev, err = kv.Put(ctx, key, b)
		return err
	})

	if err != nil {
		return 0, fmt.Errorf("put %s/%s: %w", kv.Bucket(), key, err)
	}
	return rev, nil
}

// Delete deletes key; with rev > 0 only if its revision is still rev (0: unconditionally). An
// unanswered attempt is made again; a conflict after one, with the key gone, was our delete.
func (r *Records) Delete(ctx context.Context, key string, rev uint64) error {
	c, kv := r.c, r.kv
	ctx, cancel := c.bound(ctx)
	defer cancel()
	var opts []jetstream.KVDeleteOpt
	if rev > 0 {
		opts = append(opts, jetstream.LastRevision(rev))
	}
	var doubt inDoubt
	err := writeCAS(ctx, &doubt, func(ctx context.Context) error { return kv.Delete(ctx, key, opts...) })
	if err != nil && IsConflict(err) && doubt.was {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), c.opts.Timeout)
		var gerr error
		_ = retry(rctx, transient, readAttempt, func(ctx context.Context) error {
			_, _, gerr = c.leaderGet(ctx, kv.Bucket(), key)
			return gerr
		})

		cancel()
		if errors.Is(gerr, jetstream.ErrKeyNotFound) {
			return nil
		}
	}
	if err != nil {
		if IsConflict(err) {
			return &ConflictError{Bucket: kv.Bucket(), Key: key, Expected: rev, Err: err}
		}
		return fmt.Errorf("delete %s/%s: %w", kv.Bucket(), key, err)
	}
	return nil
}

// ListJSON decodes every live value of r under filter, calling fn once per key (in key order) with
// its newest value. Corrupt values are logged and skipped; their count is returned.
//
// It reads the bucket's stream with an ordered consumer delivering the last message per key,
// until the server reports nothing pending. (nats.go's KeyValue.Watch marks the end of the
// initial values after the first message when its consumer-info call fails, which truncates a
// list under load.)
//
// On a cluster, making the consumer or fetching from it can fail for a moment (no responders
// while a leader is elected or before the new consumer's interest reached this server): such
// a read is started again, with a new consumer, within the store's timeout.
//
// (A function, not a method of Records: a method cannot have type parameters.)
func ListJSON[T any](ctx context.Context, r *Records, filter string, fn func(key string, rev uint64, v T)) (corrupt int, err error) {
	c, kv := r.c, r.kv
	ctx, cancel := c.bound(ctx)
	defer cancel()
	var latest map[string]listItem
	err = retry(ctx, transient, 0, func(ctx context.Context) (err error) {
		latest, err = r.listLatest(ctx, filter, false)
		return err
	})

	if err != nil {
		return 0, fmt.Errorf("list %s: %w", kv.Bucket(), err)
	}
	keys := make([]string, 0, len(latest))
	for k, it := range latest {
		if !it.del {
			keys = append(keys, k)
		}
	}
	slices.Sort(keys)
	var newer error
	for _, k := range keys {
		it := latest[k]
		var v T
		if err := CheckFormat(it.data); err != nil {
			// Refused, and the listing with it: a caller acting on a list that silently lacks
			// a record (a placement, a plan) would misread the whole.
			if newer == nil {
				newer = fmt.Errorf("list %s: key %s revision %d: %w", kv.Bucket(), k, it.rev, err)
			}
			continue
		}
		if err := json.Unmarshal(it.data, &v); err != nil {
			corrupt++
			c.opts.Logger.Warn("skipping corrupt value", "bucket", kv.Bucket(), "key", k, "revision", it.rev, "err", err)
			continue
		}
		fn(k, it.rev, v)
	}
	return corrupt, newer
}

// listItem is the newest message of one key, as listLatest read it.
type listItem struct {
	rev  uint64
	data []byte
	del  bool
}

// Keys lists the live keys under filter (a KV key filter such as "acme.*"), sorted. Unlike
// jetstream.KeyValue.ListKeys, it reads until the server reports nothing pending, so a list made
// under load is never cut short (see ListJSON); it reads headers only.
func (r *Records) Keys(ctx context.Context, filter string) ([]string, error) {
	c, kv := r.c, r.kv
	ctx, cancel := c.bound(ctx)
	defer cancel()
	var latest map[string]listItem
	err := retry(ctx, transient, 0, func(ctx context.Context) (err error) {
		latest, err = r.listLatest(ctx, filter, true)
		return err
	})

	if err != nil {
		return nil, fmt.Errorf("list keys of %s: %w", kv.Bucket(), err)
	}
	keys := make([]string, 0, len(latest))
	for k, it := range latest {
		if !it.del {
			keys = append(keys, k)
		}
	}
	slices.Sort(keys)
	return keys, nil
}

// listLatest is one attempt of ListJSON (or Keys, headersOnly): the newest message of every key
// under filter.
func (rs *Records) listLatest(ctx context.Context, filter string, headersOnly bool) (map[string]listItem, error) {
	c, kv := rs.c, rs.kv
	prefix := KVSubject(kv.Bucket(), "")
	stream := KVStream(kv.Bucket())
	r, err := Read(ctx, c.js, stream, ReadConfig{
		Filters:        []string{prefix + filter},
		LastPerSubject: true,
		HeadersOnly:    headersOnly,
		Batch:          1000,
	})
	if err != nil {
		return nil, err
	}
	defer r.Stop()
	latest := map[string]listItem{}
	caught := NewCaughtUp(c.nc, stream, prefix+filter)
	var seq, pending uint64
	for pending = r.Pending(); ; {
		if pending == 0 {
			if caught.Asks() == maxListChecks {
				// Each ask found something newer: the keys under the filter are written
				// faster than one round trip. Rather than chase them, fail (the caller's
				// retry lists again, later).
				return nil, fmt.Errorf("%w: %s changed during each of %d reads to its end", ErrUnavailable, prefix+filter, maxListChecks)
			}
			cctx, cancel := context.WithTimeout(ctx, readAttempt)
			done, err := caught.Check(cctx, seq)
			cancel()
			if err != nil {
				return nil, err
			}
			if done {
				return latest, nil
			}
		}
		wctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		m, md, err := r.Next(wctx)
		cancel()
		if err != nil {
			if ctx.Err() == nil && errors.Is(err, context.DeadlineExceeded) {
				// Nothing arrived though messages are pending: the consumer is stuck; a
				// new one may do better.
				err = fmt.Errorf("%w: no progress with %d pending", ErrUnavailable, pending)
			}
			return nil, err
		}
		seq, pending = md.Sequence.Stream, md.NumPending
		op := m.Headers().Get("KV-Operation")
		del := op == "DEL" || op == "PURGE" || m.Headers().Get("Nats-Marker-Reason") != ""
		latest[strings.TrimPrefix(m.Subject(), prefix)] = listItem{rev: md.Sequence.Stream, data: m.Data(), del: del}
	}
}

// maxListChecks bounds how often a list asks the stream leader whether it has read to the end.
// Each ask that finds a newer message under the filter costs a round trip and reads on to it;
// a filter whose keys are written more than about once a round trip would keep a list going.
// (A thousand instances' heartbeats, every 15 s, write the directory 67 times a second: with a
// round trip of 3 ms, an ask finds something newer about one time in five.)
const maxListChecks = 16

// CaughtUp tells a read of the newest message of every subject under a filter (a last-per-
// subject consumer, or one from a revision on) when it has seen them all. The consumer's own
// count of what is left cannot say: when a write replaces a subject's only message (a KV
// bucket of history 1) before the consumer reached it, the server takes the old message off
// the count at once and adds the new one a moment later, so the count can read 0 with the new
// message unsent, and a read that stopped there would miss the subject altogether.
type CaughtUp struct {
	nc              *nats.Conn
	stream, subject string
	target          uint64
	asks            int
}

// Asks is how many times Check asked the stream leader.
func (c *CaughtUp) Asks() int { return c.asks }

// NewCaughtUp checks reads of stream's messages on subject (wildcards allowed).
func NewCaughtUp(nc *nats.Conn, stream, subject string) *CaughtUp {
	return &CaughtUp{nc: nc, stream: stream, subject: subject}
}

// Check reports whether a read whose consumer counts nothing left, and whose newest message
// received is at stream sequence seq, has seen the newest message of every subject: whether
// nothing on the subject is newer than seq, as the stream leader sees it. One request, within
// ctx; until the read has reached the newest message the last Check found, it asks nothing.
// Reaching that message is not the end: a subject replaced while the read went there has its
// successor beyond it, so the read asks again, until an ask finds nothing newer.
func (c *CaughtUp) Check(ctx context.Context, seq uint64) (bool, error) {
	if seq < c.target {
		return false, nil
	}
	c.asks++
	m, err := leaderLast(ctx, c.nc, c.stream, c.subject)
	switch {
	case errors.Is(err, jetstream.ErrMsgNotFound):
		return true, nil
	case err != nil:
		return false, fmt.Errorf("last message on %s: %w", c.subject, unavailable(err))
	case m.Sequence <= seq:
		return true, nil
	}
	c.target = m.Sequence
	return false, nil
}

// KVStream is the stream that holds KV bucket's values.
func KVStream(bucket string) string { return "KV_" + bucket }

// KVSubject is the subject key's values of KV bucket are stored on.
func KVSubject(bucket, key string) string { return "$KV." + bucket + "." + key }
