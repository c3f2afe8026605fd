package runner

import (
	"context"
	"encoding/json"
	"fmt"
	"net/mail"
	"time"
)

// Handler runs one attempt of a job of its type. It returns the job's result and the effects
// to execute; the runner records them in the outbox and delivers each exactly once (see the
// package doc), so a handler never calls a provider itself and may be retried freely.
type Handler func(ctx context.Context, r Run) (Output, error)

// Output is what a handler produces. Effects get their dedupe keys from the runner.
type Output struct {
	Result  json.RawMessage
	Effects []Request
}

func builtinHandlers() map[string]Handler {
	return map[string]Handler{
		"webhook": webhookJob,
		"email":   emailJob,
		"log":     logJob,
		"sleep":   sleepJob,
		"noop":    func(context.Context, Run) (Output, error) { return Output{Result: json.RawMessage(`{}`)}, nil },
	}
}

func (s *Service) types() []string {
	out := make([]string, 0, len(s.handlers))
	for t := range s.handlers {
		out = append(out, t)
	}
	return sorted(out)
}

// webhookJob: payload {"url": ..., "body": any JSON} -> one webhook effect.
func webhookJob(_ context.Context, r Run) (Output, error) {
	var p struct {
		URL  string          `json:"url"`
		Body json.RawMessage `json:"body"`
	}
	if err := json.Unmarshal(r.Payload, &p); err != nil || p.URL == "" {
		return Output{}, fmt.Errorf("%w: webhook jobs take {\"url\": string, \"body\": any}", ErrPermanent)
	}
	return Output{Result: json.RawMessage(`{"effects":1}`), Effects: []Request{{Effect: "webhook", To: p.URL, Body: p.Body}}}, nil
}

// emailJob: payload {"to", "subject", "text"} -> one email effect.
func emailJob(_ context.Context, r Run) (Output, error) {
	var p struct {
		To      string `json:"to"`
		Subject string `json:"subject"`
		Text    string `json:"text"`
	}
	if err := json.Unmarshal(r.Payload, &p); err != nil {
		return Output{}, fmt.Errorf("%w: email jobs take {\"to\", \"subject\", \"text\"}", ErrPermanent)
	}
	if _, err := mail.ParseAddress(p.To); err != nil {
		return Output{}, fmt.Errorf("%w: email recipient %q: %w", ErrPermanent, p.To, err)
	}
	body, _ := json.Marshal(p.Text)
	return Output{Result: json.RawMessage(`{"effects":1}`), Effects: []Request{{Effect: "email", To: p.To, Subject: p.Subject, Body: body}}}, nil
}

// logJob: any payload -> one log effect.
func logJob(_ context.Context, r Run) (Output, error) {
	return Output{Result: json.RawMessage(`{"effects":1}`), Effects: []Request{{Effect: "log", Body: r.Payload}}}, nil
}

// sleepJob: payload {"ms": n} (at most 60000) -> waits, no effect. For load tests.
func sleepJob(ctx context.Context, r Run) (Output, error) {
	var p struct {
		MS int `json:"ms"`
	}
	if len(r.Payload) > 0 {
		if err := json.Unmarshal(r.Payload, &p); err != nil || p.MS < 0 || p.MS > 60000 {
			return Output{}, fmt.Errorf("%w: sleep jobs take {\"ms\": 0 to 60000}", ErrPermanent)
		}
	}
	t := time.NewTimer(time.Duration(p.MS) * time.Millisecond)
	defer t.Stop()
	select {
	case <-t.C:
		return Output{Result: json.RawMessage(`{}`)}, nil
	case <-ctx.Done():
		return Output{}, ctx.Err()
	}
}
