package main

import (
	"bytes"
	"net"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/encoding"
	"google.golang.org/grpc/metadata"
)

// rawCodec passes messages through as bytes: the backend answers any method without protos.
type rawCodec struct{}

func (rawCodec) Marshal(v any) ([]byte, error) { return *(v.(*[]byte)), nil }
func (rawCodec) Unmarshal(b []byte, v any) error {
	*(v.(*[]byte)) = append((*(v.(*[]byte)))[:0], b...)
	return nil
}
func (rawCodec) Name() string { return "proto" }

var _ encoding.Codec = rawCodec{}

// serveGRPC answers every call: Stream methods with stream messages, the rest with one.
func serveGRPC(addr, name string, size, stream int) error {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	answer := bytes.Repeat([]byte{'x'}, size)
	gs := grpc.NewServer(grpc.ForceServerCodec(rawCodec{}), grpc.UnknownServiceHandler(func(_ any, ss grpc.ServerStream) error {
		var in []byte
		if err := ss.RecvMsg(&in); err != nil {
			return err
		}
		_ = ss.SetHeader(metadata.Pairs("x-backend", name))
		method, _ := grpc.MethodFromServerStream(ss)
		n := 1
		if strings.HasSuffix(method, "/Stream") {
			n = stream
		}
		for range n {
			if err := ss.SendMsg(&answer); err != nil {
				return err
			}
		}
		return nil
	}))
	return gs.Serve(ln)
}
