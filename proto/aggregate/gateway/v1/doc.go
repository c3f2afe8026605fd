// Package aggregatev1 is the Go code generated from command.proto (make generate): the
// aggregate's gRPC command API, aggregate.gateway.v1.CommandService.
package aggregatev1
