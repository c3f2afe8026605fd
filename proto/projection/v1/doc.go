// Package projectionv1 is the Go code generated from query.proto (make generate): the
// projection's gRPC query API, projection.v1.QueryService.
package projectionv1
