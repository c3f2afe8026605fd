// Package runnerv1 is the Go code generated from jobs.proto (make generate): the runner's gRPC
// job API, runner.v1.JobService.
package runnerv1
