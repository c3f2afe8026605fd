package schema

import (
	"context"
	"errors"
	"time"
)

// StatusChange is one transition of an instance's derived status, as the leader's sweeper saw it.
type StatusChange struct {
	From   Status    `json:"from,omitempty"`
	To     Status    `json:"to"`
	Time   time.Time `json:"time"`
	Reason string    `json:"reason,omitempty"`
}

// StatusHistory is an instance's recent status changes, oldest first, at most MaxStatusHistory;
// key history.<kind>.<shard>.<instance> in tm_rebalance.
type StatusHistory struct {
	Instance string         `json:"instance"`
	Changes  []StatusChange `json:"changes"`
}

// MaxStatusHistory bounds an instance's status history.
const MaxStatusHistory = 50

// HistoryKey is the tm_rebalance key of an instance's status history.
func HistoryKey(id InstanceID) string { return "history." + id.Key() }

// InstanceHistory reads an instance's status history (empty when it has none).
func (d Directory) InstanceHistory(ctx context.Context, id InstanceID) (StatusHistory, uint64, error) {
	if err := id.Check(); err != nil {
		return StatusHistory{}, 0, err
	}
	h := StatusHistory{Instance: id.Key()}
	rev, err := d.s.js.Records(d.s.rebalance).Get(ctx, HistoryKey(id), &h)
	if errors.Is(err, ErrNotFound) {
		return StatusHistory{Instance: id.Key()}, 0, nil
	}
	return h, rev, err
}

// AppendStatus adds c to id's status history unless its newest change already ends in c.To,
// keeping the newest MaxStatusHistory changes. Only the rebalancer writes it.
func (d Directory) AppendStatus(ctx context.Context, id InstanceID, c StatusChange) error {
	for try := 0; ; try++ {
		h, rev, err := d.InstanceHistory(ctx, id)
		if err != nil {
			return err
		}
		if n := len(h.Changes); n > 0 && h.Changes[n-1].To == c.To {
			return nil
		}
		h.Changes = append(h.Changes, c)
		if n := len(h.Changes); n > MaxStatusHistory {
			h.Changes = h.Changes[n-MaxStatusHistory:]
		}
		_, err = d.s.js.Records(d.s.rebalance).CompareAndSet(ctx, HistoryKey(id), rev, h)
		if err == nil || !IsConflict(err) || try == 4 {
			return err
		}
	}
}

// DeleteHistory removes an instance's status history (when the instance leaves the directory).
func (d Directory) DeleteHistory(ctx context.Context, id InstanceID) error {
	err := d.s.js.Records(d.s.rebalance).Delete(ctx, HistoryKey(id), 0)
	if errors.Is(err, ErrNotFound) {
		return nil
	}
	return err
}
