package schema

import (
	"context"
	"fmt"
	"strings"
	"time"
)

// InstanceFlag is an operator's manual mark on an instance (the multi-host design's "degraded:
// manual flag"). A flagged instance's status is degraded, which the gateway, the planner and
// the dashboard treat like any degraded instance.
type InstanceFlag struct {
	Degraded bool      `json:"degraded"`
	Reason   string    `json:"reason,omitempty"`
	By       string    `json:"by,omitempty"`
	Since    time.Time `json:"since"`
}

func (f *InstanceFlag) degraded() bool { return f != nil && f.Degraded }

// DegradedMinRequests is how many requests a heartbeat interval needs before its error rate can
// make an instance degraded (KindConfig.DegradedErrorRate): one failed request is no trend.
const DegradedMinRequests = 5

// maxFlagReason bounds a flag's reason.
const maxFlagReason = 256

// SetInstanceFlag sets (f non-nil) or clears (nil) the operator flag of instance id, by
// compare-and-set so a heartbeat landing meanwhile keeps it. An absent instance is ErrNotFound.
func (d Directory) SetInstanceFlag(ctx context.Context, id InstanceID, f *InstanceFlag) (Instance, error) {
	if err := id.Check(); err != nil {
		return Instance{}, err
	}
	if f != nil {
		if len(f.Reason) > maxFlagReason || strings.ContainsAny(f.Reason, "\r\n") {
			return Instance{}, fmt.Errorf("%w: a flag's reason is one line of at most %d bytes", ErrInvalid, maxFlagReason)
		}
		if f.Since.IsZero() {
			f.Since = time.Now().UTC()
		}
	}
	for try := 0; ; try++ {
		var i Instance
		rev, err := d.s.js.Records(d.s.instances).Get(ctx, id.Key(), &i)
		if err != nil {
			return Instance{}, err
		}
		i.Flag = f
		nrev, err := d.s.js.Records(d.s.instances).CompareAndSet(ctx, id.Key(), rev, i)
		if err == nil {
			i.Revision = nrev
			return i, nil
		}
		if !IsConflict(err) || try == 4 {
			return Instance{}, err
		}
	}
}
