package jsx

import (
	"context"
	"fmt"
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// TestTransient: what is worth another try. A try stopped waiting for (WriteTry) may still be
// being stored when the next arrives with the same message id: JetStream answers that one
// "duplicate message id is in process", and the try after gets the stored message's ack.
func TestTransient(t *testing.T) {
	for _, c := range []struct {
		err  error
		want bool
	}{
		{nats.ErrNoResponders, true},
		{fmt.Errorf("publish: %w", context.DeadlineExceeded), true},
		{&jetstream.APIError{Code: 503, ErrorCode: jsErrClusterNotAvail}, true},
		{&jetstream.APIError{Code: 409, ErrorCode: jsErrDuplicateInProcess, Description: "duplicate message id is in process"}, true},
		{&jetstream.APIError{Code: 400, ErrorCode: jetstream.JSErrCodeStreamWrongLastSequence}, false},
		{context.Canceled, false},
		{nil, false},
	} {
		if got := transient(c.err); got != c.want {
			t.Errorf("transient(%v) = %v, want %v", c.err, got, c.want)
		}
	}
}
