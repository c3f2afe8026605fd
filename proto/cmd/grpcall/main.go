// Command grpcall calls a method of tenantmesh's gRPC APIs (the services of proto/, compiled
// in: no server reflection needed) with a JSON request, grpcurl-style, and prints the answer
// (each message of a server stream) as JSON.
//
// Usage:
//
//	grpcall [-H key=value]... [-timeout 10s] [-max N] ADDR SERVICE/METHOD [JSON]
//
// Example, through the gateway of `make run`:
//
//	grpcall -H x-tenant-id=acme localhost:8080 aggregate.gateway.v1.CommandService/SubmitCommand \
//	    '{"aggregate_type":"account","aggregate_id":"main","command":"deposit","payload_json":"{\"amount\":50}","idempotency_key":"g-1"}'
//
// ADDR is host:port, over HTTP/2 with prior knowledge (h2c); https://host:port uses TLS with
// the system's roots (-ca adds a CA file). A failed call prints its status and trailers and
// exits 1.
package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/dynamicpb"

	_ "github.com/tenantmesh/tenantmesh/proto/aggregate/gateway/v1"
	_ "github.com/tenantmesh/tenantmesh/proto/projection/v1"
	_ "github.com/tenantmesh/tenantmesh/proto/runner/v1"
)

type headers []string

func (h *headers) String() string     { return strings.Join(*h, ",") }
func (h *headers) Set(v string) error { *h = append(*h, v); return nil }

func main() {
	if err := run(os.Args[1:], os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "grpcall:", err)
		os.Exit(1)
	}
}

func run(args []string, out io.Writer) error {
	fs := flag.NewFlagSet("grpcall", flag.ContinueOnError)
	var hdrs headers
	fs.Var(&hdrs, "H", "metadata key=value (repeat), e.g. -H x-tenant-id=acme")
	timeout := fs.Duration("timeout", 10*time.Second, "bound on the call (sent as grpc-timeout)")
	maxMsgs := fs.Int("max", 0, "stop a server stream after this many messages (0: when it ends)")
	ca := fs.String("ca", "", "CA file for https:// addresses")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() < 2 || fs.NArg() > 3 {
		return errors.New("usage: grpcall [-H key=value]... ADDR SERVICE/METHOD [JSON]; services: " + strings.Join(services(), ", "))
	}
	addr, full := fs.Arg(0), strings.TrimPrefix(fs.Arg(1), "/")
	svc, meth, ok := strings.Cut(full, "/")
	d, err := protoregistry.GlobalFiles.FindDescriptorByName(protoreflect.FullName(svc))
	sd, isSvc := d.(protoreflect.ServiceDescriptor)
	if !ok || err != nil || !isSvc || sd.Methods().ByName(protoreflect.Name(meth)) == nil {
		return fmt.Errorf("%s: no such method; services: %s", full, strings.Join(services(), ", "))
	}
	md := sd.Methods().ByName(protoreflect.Name(meth))
	in := dynamicpb.NewMessage(md.Input())
	if fs.NArg() == 3 {
		if err := protojson.Unmarshal([]byte(fs.Arg(2)), in); err != nil {
			return fmt.Errorf("request JSON for %s: %w", md.Input().FullName(), err)
		}
	}
	creds := insecure.NewCredentials()
	if rest, ok := strings.CutPrefix(addr, "https://"); ok {
		cfg := &tls.Config{MinVersion: tls.VersionTLS12}
		if *ca != "" {
			pem, err := os.ReadFile(*ca)
			if err != nil {
				return err
			}
			cfg.RootCAs = x509.NewCertPool()
			cfg.RootCAs.AppendCertsFromPEM(pem)
		}
		addr, creds = rest, credentials.NewTLS(cfg)
	}
	addr = strings.TrimPrefix(addr, "http://")
	cc, err := grpc.NewClient("passthrough:///"+addr, grpc.WithTransportCredentials(creds))
	if err != nil {
		return err
	}
	defer cc.Close()
	var kv []string
	for _, h := range hdrs {
		k, v, ok := strings.Cut(h, "=")
		if !ok {
			k, v, ok = strings.Cut(h, ":")
		}
		if !ok {
			return fmt.Errorf("-H %q: want key=value", h)
		}
		kv = append(kv, strings.ToLower(strings.TrimSpace(k)), strings.TrimSpace(v))
	}
	ctx, cancel := context.WithTimeout(metadata.AppendToOutgoingContext(context.Background(), kv...), *timeout)
	defer cancel()
	show := func(m *dynamicpb.Message) error {
		b, err := protojson.MarshalOptions{Multiline: true, UseProtoNames: true}.Marshal(m)
		if err == nil {
			_, err = fmt.Fprintf(out, "%s\n", b)
		}
		return err
	}
	var hdr, tr metadata.MD
	method := "/" + svc + "/" + meth
	if !md.IsStreamingClient() && !md.IsStreamingServer() {
		res := dynamicpb.NewMessage(md.Output())
		if err := cc.Invoke(ctx, method, in, res, grpc.Header(&hdr), grpc.Trailer(&tr)); err != nil {
			return failed(err, hdr, tr)
		}
		fmt.Fprintf(out, "served by %s\n", strings.Join(hdr.Get("x-served-by"), ","))
		return show(res)
	}
	st, err := cc.NewStream(ctx, &grpc.StreamDesc{ServerStreams: true, ClientStreams: md.IsStreamingClient()}, method)
	if err != nil {
		return failed(err, nil, nil)
	}
	if err := st.SendMsg(in); err != nil {
		return failed(err, nil, nil)
	}
	if err := st.CloseSend(); err != nil {
		return failed(err, nil, nil)
	}
	for n := 0; *maxMsgs == 0 || n < *maxMsgs; n++ {
		res := dynamicpb.NewMessage(md.Output())
		if err := st.RecvMsg(res); err != nil {
			if errors.Is(err, io.EOF) {
				return nil
			}
			h, _ := st.Header()
			return failed(err, h, st.Trailer())
		}
		if n == 0 {
			h, _ := st.Header()
			fmt.Fprintf(out, "served by %s\n", strings.Join(h.Get("x-served-by"), ","))
		}
		if err := show(res); err != nil {
			return err
		}
	}
	return nil
}

// failed describes a call's error status with its metadata.
func failed(err error, hdr, tr metadata.MD) error {
	s := status.Convert(err)
	msg := fmt.Sprintf("%s: %s", s.Code(), s.Message())
	for _, md := range []metadata.MD{hdr, tr} {
		for k, v := range md {
			msg += fmt.Sprintf("\n  %s: %s", k, strings.Join(v, ", "))
		}
	}
	return errors.New(msg)
}

// services lists the services compiled in.
func services() []string {
	var out []string
	protoregistry.GlobalFiles.RangeFiles(func(f protoreflect.FileDescriptor) bool {
		for i := 0; i < f.Services().Len(); i++ {
			out = append(out, string(f.Services().Get(i).FullName()))
		}
		return true
	})
	return out
}
