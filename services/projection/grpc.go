package projection

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"

	"google.golang.org/grpc"

	projectionv1 "github.com/tenantmesh/tenantmesh/proto/projection/v1"
	"github.com/tenantmesh/tenantmesh/shardkit"
	"github.com/tenantmesh/tenantmesh/shardkit/tmgrpc"
	"github.com/tenantmesh/tenantmesh/shardkit/tmhttp"
)

// RegisterGRPC serves projection.v1.QueryService (shardmain.GRPCApp): Query as POST
// /query/{view}, and Watch, a server stream of the query's answer whenever the tenant's views
// move on, which ends with UNAVAILABLE when the tenant leaves the instance.
func (s *Service) RegisterGRPC(r grpc.ServiceRegistrar) {
	projectionv1.RegisterQueryServiceServer(r, queryServer{s: s})
}

type queryServer struct {
	projectionv1.UnimplementedQueryServiceServer
	s *Service
}

// query decodes and runs one query request.
func (q queryServer) query(ctx context.Context, in *projectionv1.QueryRequest) (*projectionv1.QueryResponse, error) {
	var qq Query
	if in.GetQueryJson() != "" {
		if err := tmhttp.DecodeJSON(strings.NewReader(in.GetQueryJson()), &qq); err != nil {
			return nil, badQuery("query_json must be one JSON object {\"filter\", \"sort\", \"limit\", \"cursor\"}: %v", err)
		}
	}
	res, err := q.s.Query(ctx, tmgrpc.Tenant(ctx), in.GetView(), qq)
	if err != nil {
		return nil, err
	}
	items, err := json.Marshal(res.Items)
	if err != nil {
		return nil, fmt.Errorf("encoding the items: %w", err)
	}
	return &projectionv1.QueryResponse{View: res.View, ItemsJson: string(items), NextCursor: res.NextCursor, Applied: res.Applied, Lag: res.Lag}, nil
}

func (q queryServer) Query(ctx context.Context, in *projectionv1.QueryRequest) (*projectionv1.QueryResponse, error) {
	if len(in.GetQueryJson()) > MaxQueryBytes {
		return nil, tmgrpc.Status(ctx, problemOf(badQuery("query_json is over %d bytes", MaxQueryBytes)))
	}
	res, err := q.query(ctx, in)
	if err != nil {
		return nil, tmgrpc.Status(ctx, problemOf(err))
	}
	return res, nil
}

// Watch sends the answer now and again each time the tenant's applied sequence moves past
// the last answer's, until the client goes away or the tenant leaves this instance
// (shardkit.Leaving: UNAVAILABLE, so the client calls again and reaches the new owner).
func (q queryServer) Watch(in *projectionv1.QueryRequest, stream grpc.ServerStreamingServer[projectionv1.QueryResponse]) error {
	ctx := stream.Context()
	if len(in.GetQueryJson()) > MaxQueryBytes {
		return tmgrpc.Status(ctx, problemOf(badQuery("query_json is over %d bytes", MaxQueryBytes)))
	}
	leaving := shardkit.Leaving(ctx)
	ts := q.s.host(tmgrpc.Tenant(ctx))
	for {
		res, err := q.query(ctx, in)
		if err != nil {
			return tmgrpc.Status(ctx, problemOf(err))
		}
		if err := stream.Send(res); err != nil {
			return err
		}
		select {
		case <-ts.waitApplied(res.Applied + 1):
		case <-leaving:
			return tmgrpc.Moved()
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}
