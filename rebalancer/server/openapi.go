package server

import (
	_ "embed"
	"net/http"
	"slices"
)

// openAPI is the HTTP API's OpenAPI 3.1 document. openapi_test.go checks it against the router
// (every route documented, every documented path served), validates its examples against their
// schemas and real responses of a running server against its response schemas.
//
//go:embed openapi.json
var openAPI []byte

// OpenAPI returns the API's OpenAPI 3.1 document (JSON), as GET /openapi.json serves it.
func OpenAPI() []byte { return slices.Clone(openAPI) }

func handleOpenAPI(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-cache")
	_, _ = w.Write(openAPI)
}
