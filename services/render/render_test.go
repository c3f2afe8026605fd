package render_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-chi/chi/v5"

	"github.com/tenantmesh/tenantmesh/services/render"
)

type fakeReleaser struct {
	mu       sync.Mutex
	released []string
	done     chan string
}

func (f *fakeReleaser) Release(_ context.Context, tenant string) error {
	f.mu.Lock()
	f.released = append(f.released, tenant)
	f.mu.Unlock()
	f.done <- tenant
	return nil
}

func post(t testing.TB, h http.Handler, tenant string) *httptest.ResponseRecorder {
	t.Helper()
	req := httptest.NewRequest("POST", "/render", strings.NewReader(`{"path":"/p"}`))
	req.Header.Set("X-Tenant-Id", tenant)
	w := httptest.NewRecorder()
	h.ServeHTTP(w, req)
	return w
}

// The page pool: fixed capacity, LRU disposal, Release called for the disposed tenant (the
// prerender manager: "on disposeRealm, calls the manager's DELETE").
func TestPagePoolLRU(t *testing.T) {
	s := render.New(render.Config{Capacity: 2, LoadTime: time.Microsecond, RenderTime: time.Microsecond})
	rel := &fakeReleaser{done: make(chan string, 4)}
	s.SetReleaser(rel)
	r := chi.NewRouter()
	s.Mount(r, func(h http.Handler) http.Handler { return h }, nil)
	for _, tn := range []string{"t1", "t2", "t1"} {
		if w := post(t, r, tn); w.Code != 200 {
			t.Fatal(w.Code, w.Body.String())
		}
	}
	if w := post(t, r, "t1"); w.Header().Get(render.HeaderCache) != "hit" {
		t.Fatal("t1 not warm")
	}
	post(t, r, "t3") // evicts t2, the least recently used
	select {
	case got := <-rel.done:
		if got != "t2" {
			t.Fatalf("released %s, want t2", got)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("no Release within 5s")
	}
	if p := s.Pages(); !slices.Equal(p, []string{"t3", "t1"}) {
		t.Fatalf("pages %v", p)
	}
	hits, misses, ev := s.Stats()
	if hits != 2 || misses != 3 || ev != 1 {
		t.Fatalf("hits %d misses %d evictions %d", hits, misses, ev)
	}
	w := httptest.NewRecorder()
	r.ServeHTTP(w, httptest.NewRequest("GET", "/", nil))
	if w.Code != 200 || strings.Join(strings.Fields(w.Body.String()), "") != `{"ready":true}` {
		t.Fatalf("GET / %d %s", w.Code, w.Body.String())
	}
}
