// Package natsinbox names the reply inbox of a NATS user: the one contract the connecting side
// (shardkit/natsconn, which reads the user's name from its creds file) and the granting side
// (internal/natsauth, whose roles may subscribe to nothing else for replies) share. It sits on
// the bottom floor so that both can import it.
package natsinbox

// Prefix is the reply prefix of user name: _INBOX_<name>.
func Prefix(name string) string { return "_INBOX_" + name }
