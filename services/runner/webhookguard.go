package runner

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"syscall"
	"time"
)

// A webhook's URL comes from a tenant (a job's payload, a saga step), so without a guard the
// runner would POST wherever a tenant says: the cloud's metadata service, the NATS monitoring
// port, a database on the private network (a blind SSRF). The Webhook effect therefore dials
// only addresses its allow-list admits, checked on the address actually dialled (after DNS,
// so a name that resolves to 127.0.0.1 does not get around it), and never follows a
// redirect (a 3xx is a permanent failure).

// PublicAddresses is the allow-list entry that admits any public address.
const PublicAddresses = "public"

// ErrDestination is wrapped by a refused webhook destination (a permanent failure).
var ErrDestination = errors.New("webhook destination not allowed")

// destinations is a parsed allow-list.
type destinations struct {
	public bool
	nets   []netip.Prefix
	hosts  map[string]bool // names admitted at any address (the operator's own receivers)
}

// parseDestinations parses entries: "public", IPs, CIDR prefixes and host names.
func parseDestinations(entries []string) (*destinations, error) {
	d := &destinations{hosts: map[string]bool{}}
	if len(entries) == 0 {
		entries = []string{PublicAddresses}
	}
	for _, e := range entries {
		e = strings.TrimSpace(e)
		switch {
		case e == "":
		case e == PublicAddresses:
			d.public = true
		case strings.Contains(e, "/"):
			p, err := netip.ParsePrefix(e)
			if err != nil {
				return nil, fmt.Errorf("webhook allow-list entry %q: %w", e, err)
			}
			d.nets = append(d.nets, p.Masked())
		default:
			if ip, err := netip.ParseAddr(e); err == nil {
				d.nets = append(d.nets, netip.PrefixFrom(ip, ip.BitLen()))
			} else {
				d.hosts[strings.ToLower(e)] = true
			}
		}
	}
	return d, nil
}

// publicAddr reports whether ip is a public unicast address: not loopback, private (RFC 1918,
// fc00::/7), link-local (169.254/16, where cloud metadata lives, fe80::/10), unspecified,
// multicast, CGNAT (100.64/10) or another reserved range.
func publicAddr(ip netip.Addr) bool {
	ip = ip.Unmap()
	if !ip.IsValid() || ip.IsLoopback() || ip.IsPrivate() || ip.IsLinkLocalUnicast() || ip.IsLinkLocalMulticast() ||
		ip.IsInterfaceLocalMulticast() || ip.IsMulticast() || ip.IsUnspecified() {
		return false
	}
	for _, p := range reserved {
		if p.Contains(ip) {
			return false
		}
	}
	return true
}

var reserved = []netip.Prefix{
	netip.MustParsePrefix("0.0.0.0/8"), netip.MustParsePrefix("100.64.0.0/10"), netip.MustParsePrefix("192.0.0.0/24"),
	netip.MustParsePrefix("192.0.2.0/24"), netip.MustParsePrefix("198.18.0.0/15"), netip.MustParsePrefix("198.51.100.0/24"),
	netip.MustParsePrefix("203.0.113.0/24"), netip.MustParsePrefix("240.0.0.0/4"), netip.MustParsePrefix("64:ff9b::/96"),
	netip.MustParsePrefix("2001:db8::/32"),
}

// admits reports whether a dial to ip is allowed.
func (d *destinations) admits(ip netip.Addr) bool {
	ip = ip.Unmap()
	for _, p := range d.nets {
		if p.Contains(ip) {
			return true
		}
	}
	return d.public && publicAddr(ip)
}

// dialer returns a DialContext that checks each address it dials (allowed host names dial
// unchecked).
func (d *destinations) dialer(timeout time.Duration) func(ctx context.Context, network, addr string) (net.Conn, error) {
	checked := &net.Dialer{Timeout: timeout, KeepAlive: 30 * time.Second, Control: func(_, address string, _ syscall.RawConn) error {
		host, _, err := net.SplitHostPort(address)
		if err != nil {
			return err
		}
		ip, err := netip.ParseAddr(host)
		if err != nil || !d.admits(ip) {
			return fmt.Errorf("%w: %s", ErrDestination, host)
		}
		return nil
	}}
	plain := &net.Dialer{Timeout: timeout, KeepAlive: 30 * time.Second}
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		host, _, _ := net.SplitHostPort(addr)
		if d.hosts[strings.ToLower(host)] {
			return plain.DialContext(ctx, network, addr)
		}
		return checked.DialContext(ctx, network, addr)
	}
}

// guardedClient is the webhook's HTTP client: checked dials, no proxy, no redirects.
func guardedClient(d *destinations, timeout time.Duration) *http.Client {
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.Proxy = nil // a proxy would be dialled instead of the destination, unchecked
	tr.DialContext = d.dialer(timeout)
	tr.MaxIdleConnsPerHost = 64
	return &http.Client{Timeout: timeout, Transport: tr,
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
}
