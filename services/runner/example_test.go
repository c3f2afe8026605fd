package runner_test

import (
	"encoding/json"
	"fmt"

	"github.com/tenantmesh/tenantmesh/services/aggregate"
	"github.com/tenantmesh/tenantmesh/services/runner"
)

// A saga turns events into effects; the runner gives each effect its dedupe key, records it in
// the outbox and delivers it once.
func ExampleWelcome() {
	ev := aggregate.Event{Tenant: "acme", AggregateType: aggregate.AccountType, AggregateID: "acc1",
		Event: aggregate.EvOpened, Data: json.RawMessage(`{"owner":"ada@example.com"}`)}
	for _, req := range (runner.Welcome{}).Step(ev) {
		var text string
		_ = json.Unmarshal(req.Body, &text)
		fmt.Println(req.Effect, req.To, req.Subject)
		fmt.Println(text)
	}
	// Output:
	// email ada@example.com Welcome
	// Welcome, ada@example.com: your account acc1 is open.
}
