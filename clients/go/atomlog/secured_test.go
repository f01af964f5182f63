//go:build secured

package atomlog

// Tests of WithTLS, WithBearerToken and WithBearerTokenFile against a real cluster with
// mutual TLS, auth.mode=mtls_or_token and ACLs; tests/test_acl_go.py starts it, sets the
// environment below and runs `go test -tags secured`. Without the tag they are not built.

import (
	"context"
	"errors"
	"os"
	"testing"
	"time"
)

func securedEnv(t *testing.T, name string) string {
	t.Helper()
	value := os.Getenv(name)
	if value == "" {
		t.Fatalf("%s is not set (tests/test_acl_go.py sets it)", name)
	}
	return value
}

func securedTLS(t *testing.T) TLSConfig {
	return TLSConfig{CAFile: securedEnv(t, "ATOMLOG_TLS_CA"), CertFile: securedEnv(t, "ATOMLOG_TLS_CERT"),
		KeyFile: securedEnv(t, "ATOMLOG_TLS_KEY")}
}

// send produces one record and waits for its answer.
func send(t *testing.T, options ...func(*Options)) error {
	t.Helper()
	return sendWithin(t, 30*time.Second, options...)
}

// sendWithin is send with a deadline of its own: a send that can only fail (plaintext to
// a TLS server) is retried as SERVER_UNAVAILABLE until its deadline.
func sendWithin(t *testing.T, within time.Duration, options ...func(*Options)) error {
	t.Helper()
	c, err := Dial(securedEnv(t, "ATOMLOG_BOOTSTRAP"), append(options, WithRequestTimeout(10*time.Second))...)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), within)
	defer cancel()
	producer, err := c.NewProducer(ctx, ProducerOptions{})
	if err != nil {
		return err
	}
	defer producer.Close(ctx)
	future, err := producer.Send(ctx, securedEnv(t, "ATOMLOG_TOPIC"), Record{Value: []byte("go")})
	if err != nil {
		return err
	}
	_, err = future.Wait(ctx)
	return err
}

func reason(err error) string {
	var e *Error
	if errors.As(err, &e) {
		return e.Reason
	}
	return ""
}

func TestSecuredTokenOverMutualTLS(t *testing.T) {
	// The token's principal (allowed to write) rather than the certificate's.
	if err := send(t, WithTLS(securedTLS(t)), WithBearerToken(securedEnv(t, "ATOMLOG_TOKEN_ALLOWED"))); err != nil {
		t.Fatalf("an allowed principal's send failed: %v", err)
	}
}

func TestSecuredTokenFileWithoutPermission(t *testing.T) {
	err := send(t, WithTLS(securedTLS(t)), WithBearerTokenFile(securedEnv(t, "ATOMLOG_TOKEN_FILE_DENIED")))
	if reason(err) != ReasonPermissionDenied {
		t.Fatalf("want PERMISSION_DENIED, got %v", err)
	}
	var e *Error
	errors.As(err, &e)
	if e.Retriable() || e.Metadata["resource_type"] != "topic" {
		t.Fatalf("want a fatal denial naming the topic, got %+v", e)
	}
}

func TestSecuredCertificatePrincipalWithoutToken(t *testing.T) {
	// No token: the certificate's principal (no ACL) is refused too.
	if err := send(t, WithTLS(securedTLS(t))); reason(err) != ReasonPermissionDenied {
		t.Fatalf("want PERMISSION_DENIED, got %v", err)
	}
}

func TestSecuredPlaintextAndBadOptionsAreRefused(t *testing.T) {
	// Retried until the deadline, which is all the time it takes: 5 s, not send's 30 s.
	if err := sendWithin(t, 5*time.Second, WithBearerToken(securedEnv(t, "ATOMLOG_TOKEN_ALLOWED"))); reason(err) != ReasonServerUnavailable {
		t.Fatalf("want SERVER_UNAVAILABLE without TLS, got %v", err)
	}
	bootstrap := securedEnv(t, "ATOMLOG_BOOTSTRAP")
	for _, options := range [][]func(*Options){
		{WithTLS(TLSConfig{CAFile: "/nonexistent/ca.crt"})},
		{WithTLS(TLSConfig{CAFile: securedEnv(t, "ATOMLOG_TLS_CA"), CertFile: securedEnv(t, "ATOMLOG_TLS_CERT")})},
		{WithBearerToken("two words")},
		{WithBearerToken("a"), WithBearerTokenFile("/nonexistent")},
		{WithBearerTokenFile("/nonexistent/token")},
	} {
		if _, err := Dial(bootstrap, options...); reason(err) != ReasonInvalidArgument {
			t.Errorf("want INVALID_ARGUMENT from Dial, got %v", err)
		}
	}
}

func TestSecuredOneCallCommitsOnTheLink(t *testing.T) {
	// The one-call commit goes on the coordinator's link over TLS, with the token; an
	// allowed principal commits, a denied one gets PERMISSION_DENIED from the link.
	topic := securedEnv(t, "ATOMLOG_TOPIC")
	for _, allowed := range []bool{true, false} {
		token := WithBearerToken(securedEnv(t, "ATOMLOG_TOKEN_ALLOWED"))
		if !allowed {
			token = WithBearerTokenFile(securedEnv(t, "ATOMLOG_TOKEN_FILE_DENIED"))
		}
		c, err := Dial(securedEnv(t, "ATOMLOG_BOOTSTRAP"), WithTLS(securedTLS(t)), token,
			WithRequestTimeout(10*time.Second))
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		txn, err := c.NewOneCallTxn(ctx, OneCallOptions{})
		if err == nil {
			err = txn.Send(ctx, topic, Record{Value: []byte("go-one-call")})
		}
		if err == nil {
			_, err = txn.Commit(ctx)
		}
		cancel()
		onLinks := c.linkCalls.Load()
		c.Close()
		if allowed && err != nil {
			t.Fatalf("an allowed principal's commit failed: %v", err)
		}
		if !allowed && reason(err) != ReasonPermissionDenied {
			t.Fatalf("want PERMISSION_DENIED, got %v", err)
		}
		if onLinks == 0 {
			t.Fatalf("allowed=%v: the commit was not answered on the link", allowed)
		}
	}
}
