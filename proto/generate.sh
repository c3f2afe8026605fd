#!/usr/bin/env bash
# Generates the Go code of proto/ with Debian's protoc (package protobuf-compiler, which `make
# generate` installs when missing) and protoc-gen-go / protoc-gen-go-grpc, pinned as tools in
# go.mod. The generated files are committed. With an argument, it writes there instead of into
# proto/ (`make generate-check`, part of `make test`, compares the two).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-proto}
bin=$(mktemp -d)
trap 'rm -rf "$bin"' EXIT
go build -o "$bin/" google.golang.org/protobuf/cmd/protoc-gen-go google.golang.org/grpc/cmd/protoc-gen-go-grpc
mkdir -p "$out"
PATH="$bin:$PATH" protoc -I proto \
  --go_out="$out" --go_opt=paths=source_relative \
  --go-grpc_out="$out" --go-grpc_opt=paths=source_relative \
  $(find proto -name '*.proto' | sort)
