// Package certfile serves a TLS certificate from PEM files and picks up a renewed one without a
// restart: the files are checked at most once a second, on handshakes, and loaded again when
// they change. A pair that does not load (a renewal half written) keeps the previous
// certificate in use and is logged.
package certfile

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"time"
)

// Reloader holds the certificate of CertFile and KeyFile.
type Reloader struct {
	certFile, keyFile string
	log               *slog.Logger
	now               func() time.Time

	mu      sync.Mutex
	cert    *tls.Certificate
	mod     time.Time // newest modification time of the two files when loaded
	checked time.Time
}

// New loads the pair; an error names the files.
func New(certFile, keyFile string, log *slog.Logger) (*Reloader, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	r := &Reloader{certFile: certFile, keyFile: keyFile, log: log, now: time.Now}
	mod, err := r.modTime()
	if err != nil {
		return nil, err
	}
	if err := r.load(mod); err != nil {
		return nil, err
	}
	return r, nil
}

func (r *Reloader) modTime() (time.Time, error) {
	var newest time.Time
	for _, f := range []string{r.certFile, r.keyFile} {
		fi, err := os.Stat(f)
		if err != nil {
			return time.Time{}, fmt.Errorf("certfile: %w", err)
		}
		if fi.ModTime().After(newest) {
			newest = fi.ModTime()
		}
	}
	return newest, nil
}

func (r *Reloader) load(mod time.Time) error {
	c, err := tls.LoadX509KeyPair(r.certFile, r.keyFile)
	if err != nil {
		return fmt.Errorf("certfile: load %s and %s: %w", r.certFile, r.keyFile, err)
	}
	if c.Leaf == nil && len(c.Certificate) > 0 {
		c.Leaf, _ = x509.ParseCertificate(c.Certificate[0])
	}
	r.cert, r.mod = &c, mod
	return nil
}

// GetCertificate is tls.Config's hook.
func (r *Reloader) GetCertificate(*tls.ClientHelloInfo) (*tls.Certificate, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	now := r.now()
	if now.Sub(r.checked) >= time.Second {
		r.checked = now
		if mod, err := r.modTime(); err == nil && !mod.Equal(r.mod) {
			if err := r.load(mod); err != nil {
				r.log.Warn("renewed certificate does not load; serving the previous one", "err", err)
			} else {
				r.log.Info("certificate reloaded", "file", r.certFile, "not_after", r.cert.Leaf.NotAfter)
			}
		}
	}
	if r.cert == nil {
		return nil, errors.New("certfile: no certificate")
	}
	return r.cert, nil
}

// ServerConfig is a TLS 1.2+ server config that serves the reloaded certificate.
func (r *Reloader) ServerConfig() *tls.Config {
	return &tls.Config{GetCertificate: r.GetCertificate, MinVersion: tls.VersionTLS12}
}

// Pool reads a PEM file of CA certificates, for clients that verify servers with them.
func Pool(caFile string) (*x509.CertPool, error) {
	b, err := os.ReadFile(caFile)
	if err != nil {
		return nil, fmt.Errorf("certfile: %w", err)
	}
	p := x509.NewCertPool()
	if !p.AppendCertsFromPEM(b) {
		return nil, fmt.Errorf("certfile: %s holds no PEM certificate", caFile)
	}
	return p, nil
}
