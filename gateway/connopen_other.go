//go:build !unix

package gateway

import "net"

// connOpen cannot peek on this platform; the retry of idempotent requests still applies.
func connOpen(net.Conn) bool { return true }
