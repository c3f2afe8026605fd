package aggregate

import (
	"context"
	"encoding/json"
	"fmt"

	"google.golang.org/grpc"

	aggregatev1 "github.com/tenantmesh/tenantmesh/proto/aggregate/gateway/v1"
	"github.com/tenantmesh/tenantmesh/shardkit/tmgrpc"
)

// RegisterGRPC serves aggregate.gateway.v1.CommandService (shardmain.GRPCApp): the same
// commands as POST /commands, through the same Handle (the append fence, the idempotency
// window), so a command sent over either API with the same key is applied once.
func (s *Service) RegisterGRPC(r grpc.ServiceRegistrar) {
	aggregatev1.RegisterCommandServiceServer(r, commandServer{s: s})
}

type commandServer struct {
	aggregatev1.UnimplementedCommandServiceServer
	s *Service
}

func (c commandServer) SubmitCommand(ctx context.Context, in *aggregatev1.SubmitCommandRequest) (*aggregatev1.SubmitCommandResponse, error) {
	cmd := Command{AggregateType: in.GetAggregateType(), AggregateID: in.GetAggregateId(), Command: in.GetCommand(),
		ExpectedVersion: in.ExpectedVersion, IdempotencyKey: in.GetIdempotencyKey()}
	if p := in.GetPayloadJson(); p != "" {
		if !json.Valid([]byte(p)) {
			return nil, tmgrpc.Status(ctx, problemOf(fmt.Errorf("%w: payload_json is not JSON", ErrBadPayload)))
		}
		cmd.Payload = json.RawMessage(p)
	}
	if cmd.IdempotencyKey == "" {
		cmd.IdempotencyKey = tmgrpc.IdempotencyKey(ctx)
	}
	res, err := c.s.Handle(ctx, tmgrpc.Tenant(ctx), cmd)
	if err != nil {
		return nil, tmgrpc.Status(ctx, problemOf(err))
	}
	return &aggregatev1.SubmitCommandResponse{AggregateType: res.AggregateType, AggregateId: res.AggregateID, Version: res.Version,
		Event: res.Event, Seq: res.Seq, Replayed: res.Replayed}, nil
}

func (c commandServer) GetAggregate(ctx context.Context, in *aggregatev1.GetAggregateRequest) (*aggregatev1.Aggregate, error) {
	if typ := in.GetAggregateType(); typ != AccountType {
		return nil, tmgrpc.Status(ctx, problemOf(fmt.Errorf("%w %q: the ledger has only %q", ErrUnknownAggregate, typ, AccountType)))
	}
	acc, err := c.s.Account(ctx, tmgrpc.Tenant(ctx), in.GetAggregateId())
	if err != nil {
		return nil, tmgrpc.Status(ctx, problemOf(err))
	}
	b, _ := json.Marshal(acc)
	return &aggregatev1.Aggregate{AggregateType: AccountType, AggregateId: acc.ID, StateJson: string(b)}, nil
}
