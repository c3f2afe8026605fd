package runner

import (
	"context"
	"encoding/json"
	"fmt"

	"google.golang.org/grpc"

	runnerv1 "github.com/tenantmesh/tenantmesh/proto/runner/v1"
	"github.com/tenantmesh/tenantmesh/shardkit/tmgrpc"
)

// RegisterGRPC serves runner.v1.JobService (shardmain.GRPCApp): CreateJob as POST /jobs
// (the same Create: an idempotency key creates the job once, over either API), GetJob as GET
// /jobs/{id}.
func (s *Service) RegisterGRPC(r grpc.ServiceRegistrar) {
	runnerv1.RegisterJobServiceServer(r, jobServer{s: s})
}

type jobServer struct {
	runnerv1.UnimplementedJobServiceServer
	s *Service
}

func (j jobServer) CreateJob(ctx context.Context, in *runnerv1.CreateJobRequest) (*runnerv1.Job, error) {
	nj := NewJob{Type: in.GetType(), Instance: in.GetInstance(), IdempotencyKey: in.GetIdempotencyKey(), Delay: in.GetDelay()}
	if p := in.GetPayloadJson(); p != "" {
		if len(p) > MaxBodyBytes || !json.Valid([]byte(p)) {
			return nil, tmgrpc.Status(ctx, problemOf(fmt.Errorf("%w: payload_json must be JSON of at most %d bytes", ErrBadJob, MaxBodyBytes)))
		}
		nj.Payload = json.RawMessage(p)
	}
	if nj.IdempotencyKey == "" {
		nj.IdempotencyKey = tmgrpc.IdempotencyKey(ctx)
	}
	run, created, err := j.s.Create(ctx, tmgrpc.Tenant(ctx), nj)
	if err != nil {
		return nil, tmgrpc.Status(ctx, problemOf(err))
	}
	job := jobOf(run)
	job.Replayed = !created
	return job, nil
}

func (j jobServer) GetJob(ctx context.Context, in *runnerv1.GetJobRequest) (*runnerv1.Job, error) {
	ctx2, cancel := context.WithTimeout(ctx, j.s.cfg.OpTimeout)
	defer cancel()
	run, err := j.s.Get(ctx2, tmgrpc.Tenant(ctx), in.GetId())
	if err != nil {
		return nil, tmgrpc.Status(ctx, problemOf(err))
	}
	return jobOf(run), nil
}

func jobOf(r Run) *runnerv1.Job {
	return &runnerv1.Job{Id: r.ID, Type: r.Type, Status: string(r.Status), Attempts: int32(r.Attempts),
		PayloadJson: string(r.Payload), ResultJson: string(r.Result), Error: r.Error}
}
