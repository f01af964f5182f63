package atomlog

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"os"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/status"
)

// TLSConfig reaches a cluster serving TLS (tls.enabled on the servers;
// docs/operations.md#tls-and-mutual-tls). CAFile (PEM) verifies the servers'
// certificates; CertFile and KeyFile (PEM) are the client certificate servers with
// tls.client_auth=require ask for (its CN is the caller's principal under
// auth.mode=mtls); ServerName, when set, is checked against every server's certificate
// instead of the host dialed (servers sharing one certificate, e.g. on Kubernetes:
// "atomlog-server"). The files are read by Dial.
type TLSConfig struct {
	CAFile     string
	CertFile   string
	KeyFile    string
	ServerName string
}

// WithTLS makes every connection of the client use TLS (instead of plaintext).
func WithTLS(config TLSConfig) func(*Options) {
	return func(o *Options) { o.TLS = &config }
}

// WithBearerToken sends `authorization: Bearer <token>` on every call (servers with
// auth.mode=token or mtls_or_token: a signed JWT or a static token).
func WithBearerToken(token string) func(*Options) {
	return func(o *Options) { o.Token = token }
}

// WithBearerTokenFile sends the token held in a file on every call; the file is read
// again (at most once a second) when it changes, so a renewed JWT is used from then on.
func WithBearerTokenFile(path string) func(*Options) {
	return func(o *Options) { o.TokenFile = path }
}

// transportCredentials builds the TLS credentials of TLSConfig (nil: plaintext), and the
// settings they wrap (the coordinators' links use them too).
func transportCredentials(config *TLSConfig) (credentials.TransportCredentials, *tls.Config, error) {
	if config == nil {
		return nil, nil, nil
	}
	if config.CAFile == "" {
		return nil, nil, errorf(ReasonInvalidArgument, "TLS needs a CA file (the CA that signed the servers)")
	}
	if (config.CertFile == "") != (config.KeyFile == "") {
		return nil, nil, errorf(ReasonInvalidArgument, "a client certificate needs both CertFile and KeyFile")
	}
	pem, err := os.ReadFile(config.CAFile)
	if err != nil {
		return nil, nil, errorf(ReasonInvalidArgument, "TLS CA file: %v", err)
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(pem) {
		return nil, nil, errorf(ReasonInvalidArgument, "TLS CA file %s holds no PEM certificate", config.CAFile)
	}
	settings := &tls.Config{RootCAs: roots, ServerName: config.ServerName, MinVersion: tls.VersionTLS12}
	if config.CertFile != "" {
		pair, err := tls.LoadX509KeyPair(config.CertFile, config.KeyFile)
		if err != nil {
			return nil, nil, errorf(ReasonInvalidArgument, "TLS client certificate: %v", err)
		}
		settings.Certificates = []tls.Certificate{pair}
	}
	return credentials.NewTLS(settings), settings, nil
}

// bearer is the per-call credential of WithBearerToken / WithBearerTokenFile.
type bearer struct {
	token string
	file  string

	mu        sync.Mutex
	checkedAt time.Time
	modified  time.Time
	size      int64
}

const tokenRecheckInterval = time.Second

func newBearer(token, file string) (*bearer, error) {
	if token != "" && file != "" {
		return nil, errorf(ReasonInvalidArgument, "give a bearer token or a token file, not both")
	}
	if token == "" && file == "" {
		return nil, nil
	}
	b := &bearer{token: strings.TrimSpace(token), file: file}
	if file != "" {
		if err := b.reload(); err != nil {
			return nil, errorf(ReasonInvalidArgument, "%v", err)
		}
	} else if err := checkToken(b.token, "the token"); err != nil {
		return nil, errorf(ReasonInvalidArgument, "%v", err)
	}
	return b, nil
}

func checkToken(token, what string) error {
	if token == "" || strings.ContainsAny(token, " \t\r\n") {
		return fmt.Errorf("%s must be one token without spaces", what)
	}
	return nil
}

// reload reads the token file when it changed since the last read (b.mu held or not
// shared yet).
func (b *bearer) reload() error {
	info, err := os.Stat(b.file)
	if err != nil {
		return fmt.Errorf("token file: %v", err)
	}
	if info.ModTime().Equal(b.modified) && info.Size() == b.size && b.token != "" {
		return nil
	}
	data, err := os.ReadFile(b.file)
	if err != nil {
		return fmt.Errorf("token file: %v", err)
	}
	token := strings.TrimSpace(string(data))
	if err := checkToken(token, "token file "+b.file); err != nil {
		return err
	}
	b.token, b.modified, b.size = token, info.ModTime(), info.Size()
	return nil
}

// GetRequestMetadata implements credentials.PerRPCCredentials.
func (b *bearer) GetRequestMetadata(ctx context.Context, uri ...string) (map[string]string, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.file != "" && time.Since(b.checkedAt) >= tokenRecheckInterval {
		b.checkedAt = time.Now()
		if err := b.reload(); err != nil && b.token == "" {
			return nil, status.Error(codes.Unauthenticated, err.Error())
		}
		// A changed file that cannot be used: the previous token stays in use.
	}
	return map[string]string{"authorization": "Bearer " + b.token}, nil
}

// RequireTransportSecurity implements credentials.PerRPCCredentials: tokens are sent over
// plaintext too, as the servers accept them there (use TLS to keep them secret).
func (b *bearer) RequireTransportSecurity() bool { return false }
