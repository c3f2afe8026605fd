package mailbox

import (
	"bytes"
	"fmt"
	"net/http"
	"net/http/httptest"
	"runtime"
	"testing"

	"github.com/go-chi/chi/v5"

	"github.com/tenantmesh/tenantmesh/internal/tmtest"
)

func heapInUse() uint64 {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc
}

// TestAttackMailboxMemory (item 12): a tenant names its queues, and every queue kept up to 100
// messages of 64 KiB, so one tenant posting to 1,000 queues made the instance keep 64 MB (and
// any more it liked). A tenant now has at most MaxBoxes queues and MaxTenantBytes kept on an
// instance; the rest is answered 503, and another tenant is still served.
func TestAttackMailboxMemory(t *testing.T) {
	s := New()
	r := chi.NewRouter()
	s.Mount(r, func(h http.Handler) http.Handler { return h })
	srv := httptest.NewServer(r)
	t.Cleanup(srv.Close)
	msg := bytes.Repeat([]byte("m"), MaxMessage)
	post := func(tenant, queue string) int {
		req, _ := http.NewRequest("POST", srv.URL+"/mailbox/"+queue, bytes.NewReader(msg))
		req.Header.Set("x-tenant-id", tenant)
		resp, err := tmtest.HTTP.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	before := heapInUse()
	kept := 0
	for i := range 1000 {
		if post("greedy", fmt.Sprintf("q%d", i)) == http.StatusAccepted {
			kept++
		}
	}
	grew := int64(heapInUse()) - int64(before)
	t.Logf("one tenant posting 64 KiB to 1,000 queues: %d kept, heap %+.1f MB", kept, float64(grew)/(1<<20))
	if int64(kept)*MaxMessage > MaxTenantBytes {
		t.Fatalf("the instance kept %d messages (%d MB) for one tenant", kept, int64(kept)*MaxMessage>>20)
	}
	if code := post("other", "q0"); code != http.StatusAccepted {
		t.Fatalf("another tenant: status %d", code)
	}
}
