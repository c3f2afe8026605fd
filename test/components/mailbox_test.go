package components_test

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/go-chi/chi/v5"

	"github.com/tenantmesh/tenantmesh/gateway"
	"github.com/tenantmesh/tenantmesh/internal/embednats/natstest"
	"github.com/tenantmesh/tenantmesh/internal/tmtest"
	"github.com/tenantmesh/tenantmesh/services/mailbox"
	"github.com/tenantmesh/tenantmesh/shardkit"
	"github.com/tenantmesh/tenantmesh/shardkit/kittest"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// startMailbox runs one mailbox instance of shard mailbox-1 behind a real HTTP server.
func startMailbox(t *testing.T, st *schema.Store, name string) (*shardkit.Shard, string) {
	t.Helper()
	r := chi.NewRouter()
	srv := httptest.NewUnstartedServer(r)
	t.Cleanup(srv.Close)
	svc := mailbox.New()
	sk, err := shardkit.New(shardkit.Config{Store: st, ID: schema.InstanceID{Kind: mailbox.Kind, Shard: "mailbox-1", Instance: name},
		URL: "http://" + srv.Listener.Addr().String(), Routes: svc.Routes(), Heartbeat: 100 * time.Millisecond,
		DrainTimeout: 2 * time.Second, AdminToken: adminToken})
	if err != nil {
		t.Fatal(err)
	}
	sk.Mount(r)
	svc.SetWaiter(sk)
	svc.Mount(r, sk.Gate)
	srv.Start()
	kittest.Run(t, sk)
	return sk, srv.URL
}

func send(t *testing.T, method, url, body string) (*http.Response, string) {
	t.Helper()
	req, _ := http.NewRequest(method, url, strings.NewReader(body))
	if strings.Contains(url, "/admin/") {
		req.Header.Set("Authorization", "Bearer "+adminToken)
	} else {
		req.Header.Set(tmhttp.HeaderTenant, "t1")
	}
	resp, err := (&http.Client{Timeout: 30 * time.Second}).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, string(b)
}

// End to end through a real gateway: a consumer long-polls one instance; the producer's request
// reaches the gateway, which sends it to that instance (its load reports announce the waiting
// consumer), so the message is handed over locally; with no consumer anywhere, it goes to the
// tenant's usual instance and is kept there.
func TestProducerFindsTheWaitingConsumer(t *testing.T) {
	srv := natstest.Server(t)
	st := kittest.StoreAt(t, srv.URL())
	if _, err := st.Kinds().Put(t.Context(), mailbox.KindConfig()); err != nil {
		t.Fatal(err)
	}
	a, aURL := startMailbox(t, st, "a")
	b, bURL := startMailbox(t, st, "b")
	urls := map[string]string{a.ID().Key(): aURL, b.ID().Key(): bURL}
	shards := map[string]*shardkit.Shard{a.ID().Key(): a, b.ID().Key(): b}

	gwURL := startGateway(t, st, gateway.Config{AdminToken: adminToken})

	// The tenant's first request fixes its usual instance (the load policy's affinity).
	var resp *http.Response
	tmtest.WaitFor(t, 20*time.Second, tmtest.Until("the gateway routing mailbox requests", func() bool {
		resp, _ = send(t, "GET", gwURL+"/mailbox/orders?group=g1&wait=0s", "")
		return resp.StatusCode == http.StatusNoContent
	}))
	usual := resp.Header.Get(tmhttp.HeaderServedBy)
	other := a.ID().Key()
	if other == usual {
		other = b.ID().Key()
	}

	// A consumer waits on the other instance, once that instance has seen the tenant's
	// placement (the consumer calls it directly, without the epoch the gateway would send).
	tmtest.WaitFor(t, 10*time.Second, tmtest.Until("the other instance to see t1's placement", func() bool {
		return shards[other].Epoch("t1") > 0
	}))
	got := make(chan string, 1)
	go func() {
		resp, body := send(t, "GET", urls[other]+"/mailbox/orders?group=g1&wait=20s", "")
		if resp.StatusCode != http.StatusOK {
			body = resp.Status
		}
		got <- body
	}()
	tmtest.WaitFor(t, 20*time.Second, func() error {
		select {
		case msg := <-got:
			t.Fatalf("the consumer on %s returned before any message: %s", other, msg)
		default:
		}
		var bal struct {
			Instances []struct {
				Instance string             `json:"instance"`
				Load     *schema.LoadReport `json:"load"`
			} `json:"instances"`
		}
		resp, body := send(t, "GET", gwURL+"/admin/balance", "")
		if resp.StatusCode != 200 || json.Unmarshal([]byte(body), &bal) != nil {
			return fmt.Errorf("/admin/balance: %d %s", resp.StatusCode, body)
		}
		for _, in := range bal.Instances {
			if in.Instance != other {
				continue
			}
			if in.Load != nil && len(in.Load.Consumers) == 1 && in.Load.Consumers[0] == (schema.ConsumerPresence{Queue: "orders", Group: "g1", Waiting: 1}) {
				return nil
			}
			return fmt.Errorf("the gateway's last load report from %s: %+v", other, in.Load)
		}
		return fmt.Errorf("the gateway does not list %s yet", other)
	})
	resp, body := send(t, "POST", gwURL+"/mailbox/orders?group=g1", "hello")
	if resp.StatusCode != http.StatusOK || resp.Header.Get(tmhttp.HeaderServedBy) != other || !strings.Contains(body, `"consumer"`) {
		t.Fatalf("producer: %d served by %s (consumer on %s, usual %s): %s", resp.StatusCode, resp.Header.Get(tmhttp.HeaderServedBy), other, usual, body)
	}
	select {
	case msg := <-got:
		if msg != "hello" {
			t.Fatalf("the consumer got %q", msg)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("the consumer got nothing")
	}

	// No consumer anywhere for orders:g2: the key's usual instance keeps the message, and the
	// key's next consumer is sent to that same instance (producers and consumers of a key share
	// its affinity, as the GET is a consumer route), so it gets the message.
	resp, _ = send(t, "POST", gwURL+"/mailbox/orders?group=g2", "kept")
	keeper := resp.Header.Get(tmhttp.HeaderServedBy)
	if resp.StatusCode != http.StatusAccepted || keeper == "" {
		t.Fatalf("a message nobody waits for: %d served by %q", resp.StatusCode, keeper)
	}
	resp, body = send(t, "GET", gwURL+"/mailbox/orders?group=g2&wait=1s", "")
	if resp.StatusCode != 200 || body != "kept" || resp.Header.Get(tmhttp.HeaderServedBy) != keeper {
		t.Fatalf("the kept message: %d %q from %s (kept on %s)", resp.StatusCode, body, resp.Header.Get(tmhttp.HeaderServedBy), keeper)
	}
}
