package runner

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/textproto"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tenantmesh/tenantmesh/services/aggregate"
)

func openAccounts(t *testing.T, agg *aggregate.Service, tenant string, from, to int, owner func(i int) string) {
	t.Helper()
	for i := from; i < to; i++ {
		payload, _ := json.Marshal(map[string]string{"owner": owner(i)})
		_, err := agg.Handle(context.Background(), tenant, aggregate.Command{AggregateType: aggregate.AccountType,
			AggregateID: fmt.Sprintf("acc%d", i), Command: aggregate.CmdOpen, Payload: payload, IdempotencyKey: fmt.Sprintf("open-%d", i)})
		if err != nil {
			t.Fatal(err)
		}
	}
}

// Account opened -> welcome webhook, once per account, with a checkpoint; a new instance
// resumes from the checkpoint without repeating an effect.
func TestSagaWelcome(t *testing.T) {
	st := openStore(t)
	rc := newReceiver(t)
	agg, err := aggregate.New(context.Background(), aggregate.Config{Store: st})
	if err != nil {
		t.Fatal(err)
	}
	const tenant = "acme"
	place(t, st, tenant, "runner-1")
	cfg := Config{Sagas: []Saga{Welcome{Effect: "webhook", URL: rc.URL}}}
	openAccounts(t, agg, tenant, 0, 5, func(i int) string { return fmt.Sprintf("owner%d@example.com", i) })
	// A deposit is not a saga trigger.
	if _, err := agg.Handle(context.Background(), tenant, aggregate.Command{AggregateType: aggregate.AccountType, AggregateID: "acc0",
		Command: aggregate.CmdDeposit, Payload: json.RawMessage(`{"amount":5}`), IdempotencyKey: "dep"}); err != nil {
		t.Fatal(err)
	}
	s1, stop := startStoppable(t, st, "runner-1", "a", cfg)
	rc.await(t, 5, 10*time.Second)
	waitUntil(t, 5*time.Second, "checkpoint at the deposit", func() bool {
		cp, _ := s1.Checkpoint(context.Background(), tenant)
		return cp == 6
	})
	// Live events are handled too.
	openAccounts(t, agg, tenant, 5, 7, func(i int) string { return fmt.Sprintf("owner%d@example.com", i) })
	rc.await(t, 2, 10*time.Second)
	waitUntil(t, 5*time.Second, "checkpoint at the last event", func() bool {
		cp, _ := s1.Checkpoint(context.Background(), tenant)
		return cp == 8
	})
	stop()
	// A second instance of the shard (or the next owner) starts from the checkpoint: only new
	// events give effects.
	s2 := startService(t, st, "runner-1", "b", cfg)
	owning(t, s2, tenant, true)
	openAccounts(t, agg, tenant, 7, 8, func(i int) string { return fmt.Sprintf("owner%d@example.com", i) })
	rc.await(t, 1, 10*time.Second)
	counts, total := rc.snapshot()
	if total != 8 || len(counts) != 8 {
		t.Fatalf("receiver got %d deliveries over %d keys, want 8 over 8: %v", total, len(counts), counts)
	}
	for k, c := range counts {
		if c != 1 || !strings.HasPrefix(k, tenant+".saga.welcome.") {
			t.Fatalf("key %s delivered %d times", k, c)
		}
	}
}

// smtpReceiver is a minimal SMTP server on 127.0.0.1 that keeps each message's DATA.
type smtpReceiver struct {
	ln   net.Listener
	mu   sync.Mutex
	msgs []string
	got  chan struct{}
}

func newSMTPReceiver(t *testing.T) *smtpReceiver {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	r := &smtpReceiver{ln: ln, got: make(chan struct{}, 100)}
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Go(func() { r.session(c) })
		}
	})
	t.Cleanup(func() { ln.Close(); wg.Wait() })
	return r
}

func (r *smtpReceiver) session(c net.Conn) {
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	tp := textproto.NewConn(c)
	_ = tp.PrintfLine("220 test ESMTP")
	for {
		line, err := tp.ReadLine()
		if err != nil {
			return
		}
		cmd := strings.ToUpper(strings.SplitN(line, " ", 2)[0])
		switch cmd {
		case "EHLO", "HELO":
			_ = tp.PrintfLine("250 test")
		case "MAIL", "RCPT", "RSET", "NOOP":
			_ = tp.PrintfLine("250 ok")
		case "DATA":
			_ = tp.PrintfLine("354 go ahead")
			data, err := tp.ReadDotBytes()
			if err != nil {
				return
			}
			r.mu.Lock()
			r.msgs = append(r.msgs, string(data))
			r.mu.Unlock()
			_ = tp.PrintfLine("250 queued")
			r.got <- struct{}{}
		case "QUIT":
			_ = tp.PrintfLine("221 bye")
			return
		default:
			_ = tp.PrintfLine("502 not implemented")
		}
	}
}

// An email job is delivered over SMTP with the dedupe key as Message-ID; the welcome saga's
// default effect is the same email provider.
func TestSMTPEmail(t *testing.T) {
	st := openStore(t)
	mail := newSMTPReceiver(t)
	const tenant = "acme"
	place(t, st, tenant, "runner-1")
	s := startService(t, st, "runner-1", "a", Config{
		Effects: map[string]Effect{"email": &SMTP{Addr: mail.ln.Addr().String(), From: "Tenantmesh <noreply@example.com>"}},
		Sagas:   []Saga{Welcome{}},
	})
	owning(t, s, tenant, true)
	payload, _ := json.Marshal(map[string]string{"to": "ada@example.com", "subject": "Réinitialiser", "text": "Your link: https://x/reset\n.dot line"})
	ids := create(t, s, tenant, 1, NewJob{Type: "email", Payload: payload})
	runs := waitDone(t, s, tenant, ids, 10*time.Second)
	if r := runs[ids[0]]; r.Status != StatusSucceeded {
		t.Fatalf("email job: %+v", r)
	}
	<-mail.got
	agg, err := aggregate.New(context.Background(), aggregate.Config{Store: st})
	if err != nil {
		t.Fatal(err)
	}
	openAccounts(t, agg, tenant, 0, 1, func(int) string { return "grace@example.com" })
	select {
	case <-mail.got:
	case <-time.After(10 * time.Second):
		t.Fatal("no welcome email")
	}
	mail.mu.Lock()
	defer mail.mu.Unlock()
	m, err := textproto.NewReader(bufio.NewReader(strings.NewReader(mail.msgs[0]))).ReadMIMEHeader()
	if err != nil {
		t.Fatal(err)
	}
	if want := "<acme.job." + ids[0] + ".0@example.com>"; m.Get("Message-Id") != want || m.Get("To") != "<ada@example.com>" ||
		!strings.HasPrefix(m.Get("Subject"), "=?utf-8?q?") {
		t.Fatalf("email headers %v", m)
	}
	if !strings.Contains(mail.msgs[0], "\n.dot line") || !strings.Contains(mail.msgs[1], "To: <grace@example.com>") {
		t.Fatalf("messages:\n%s\n---\n%s", mail.msgs[0], mail.msgs[1])
	}
}

func TestSMTPMessage(t *testing.T) {
	s := &SMTP{From: "noreply@example.com"}
	for _, tc := range []struct {
		name string
		req  Request
		ok   bool
	}{
		{"plain", Request{Key: "t.job.1.0", To: "a@example.com", Subject: "Hi", Body: json.RawMessage(`"hello"`)}, true},
		{"bad recipient", Request{Key: "k", To: "not an address"}, false},
		{"header injection", Request{Key: "k", To: "a@example.com", Subject: "x\r\nBcc: evil@example.com"}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b, err := s.Message(tc.req)
			if (err == nil) != tc.ok {
				t.Fatalf("Message: %v", err)
			}
			if tc.ok && !strings.Contains(string(b), "Message-ID: <t.job.1.0@example.com>\r\n") {
				t.Fatalf("message:\n%s", b)
			}
		})
	}
}

// The per-tenant figures show the saga's position against the tenant's events.
func TestTenantStats(t *testing.T) {
	st := openStore(t)
	agg, err := aggregate.New(context.Background(), aggregate.Config{Store: st})
	if err != nil {
		t.Fatal(err)
	}
	place(t, st, "acme", "runner-9") // nobody runs it: everything stays
	s := startService(t, st, "runner-1", "a", Config{Sagas: []Saga{Welcome{Effect: "log"}}})
	openAccounts(t, agg, "acme", 0, 3, func(i int) string { return fmt.Sprintf("o%d", i) })
	create(t, s, "acme", 4, NewJob{Type: "noop"})
	got, err := s.Stats(context.Background(), "acme")
	if err != nil {
		t.Fatal(err)
	}
	if got.Queued != 4 || got.Outbox != 0 || got.LastEvent != 3 || got.SagaCheckpoint != 0 || !got.SagaBehind || got.Acquired {
		t.Fatalf("stats %+v", got)
	}
	if _, err := s.Stats(context.Background(), "bad tenant"); err == nil {
		t.Fatal("bad tenant id accepted")
	}
}
