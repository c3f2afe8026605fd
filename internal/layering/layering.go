// Package layering holds the test that keeps tenantmesh's floors apart: a package imports only
// from the floors below its own and from its own component on its floor (docs/design.md, "Floors
// and imports"). The test reads the import graph with go list, so it needs the go command; it
// fails naming each import that breaks a rule, and the rule it breaks.
//
// Like Go's go/build/deps_test.go, the rules are a small table in code (floors in
// layering_test.go), not a list of allowed edges: a new package falls under its directory's
// floor without an edit here.
package layering
