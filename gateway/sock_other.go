//go:build !linux

package gateway

import "net"

// ioOf returns how to read and write c: through c, on systems without sock_linux.go.
func ioOf(c net.Conn) socketIO { return &connIO{Conn: c} }
