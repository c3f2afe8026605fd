package planner

import "errors"

var (
	// ErrInvalid means the world or the request is malformed (unknown shard, bad option).
	ErrInvalid = errors.New("invalid plan request")
	// ErrNoCapacity means the eligible shards cannot take the load or tenants that must move.
	ErrNoCapacity = errors.New("not enough capacity")
	// ErrPinned means a move would touch a tenant that must stay: pinned, moving, or cooling down.
	ErrPinned = errors.New("tenant must stay")
	// ErrLabels means no shard satisfies a tenant's or the request's label requirements.
	ErrLabels = errors.New("no shard matches the required labels")
	// ErrBudget means the move budget is too small for a plan that must be complete (evacuate,
	// manual moves, moving a tenant).
	ErrBudget = errors.New("move budget exceeded")
	// ErrUnknownTenant means a tenant named in the request has no placement in the world.
	ErrUnknownTenant = errors.New("unknown tenant")
)
