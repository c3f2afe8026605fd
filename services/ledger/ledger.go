// Package ledger is the contract between the ledger's services: the events the aggregate
// service stores on TM_EVENTS (events.<tenant>.account.<id>) and the projection and runner
// services read. It holds names and the event's shape only, so a reader depends on the
// contract, not on the service that writes it.
package ledger

import (
	"encoding/json"
	"time"
)

// AccountType is the only aggregate type of the ledger.
const AccountType = "account"

// Events (the "event" field of an Event).
const (
	EvOpened    = "opened"
	EvDeposited = "deposited"
	EvWithdrawn = "withdrawn"
	EvClosed    = "closed"
)

// Event is one stored fact, the JSON body of a message on events.<tenant>.<type>.<id>.
type Event struct {
	Tenant        string          `json:"tenant"`
	AggregateType string          `json:"aggregate_type"`
	AggregateID   string          `json:"aggregate_id"`
	Version       uint64          `json:"version"`
	Event         string          `json:"event"`
	Data          json.RawMessage `json:"data,omitempty"`
	CommandKey    string          `json:"command_key"`
	At            time.Time       `json:"at"`
	// Seq is the event's stream sequence (set when read, not stored).
	Seq uint64 `json:"-"`
}
