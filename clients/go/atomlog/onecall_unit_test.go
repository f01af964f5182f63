package atomlog

import (
	"context"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/atomlog/atomlog/clients/go/gen/atomlog/v1"
)

// CommitTxn of the fake: every commit is taken and its answer lost; an abort by key
// answers TRANSACTION_ALREADY_COMMITTED for a committed key.
func (f *fakeServer) CommitTxn(_ context.Context, r *pb.CommitTxnRequest) (*pb.CommitTxnResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.committedKeys == nil {
		f.committedKeys = map[string]bool{}
	}
	if r.GetAbort() {
		if f.committedKeys[r.GetIdempotencyKey()] {
			return nil, statusOf(ReasonTransactionAlreadyCommitted, "committed", nil)
		}
		return &pb.CommitTxnResponse{}, nil
	}
	f.committedKeys[r.GetIdempotencyKey()] = true
	return nil, status.Error(codes.Unavailable, "committed, but the answer was lost")
}

// A one-call commit whose answer was lost ran out of its timeout (the retries of the
// unknown outcome take that long): the next Commit reported TRANSACTION_TIMED_OUT
// without asking, and Abort said nil, for a transaction that had committed; a caller
// redoing the work wrote it twice. Now the outcome is settled by aborting the key, and
// nothing more is taken once a commit's outcome is unknown.
func TestOneCallCommitAfterAnUnknownOutcomeSettlesIt(t *testing.T) {
	f := startFake(t)
	c, err := Dial(f.address, WithRequestTimeout(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx := context.Background()
	txn, err := c.NewOneCallTxn(ctx, OneCallOptions{Timeout: 800 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if err := txn.Send(ctx, "t", Record{Value: []byte("r1")}); err != nil {
		t.Fatal(err)
	}
	if _, err := txn.Commit(ctx); err == nil || !IsRetriable(err) {
		t.Fatalf("first Commit: %v, want an unknown outcome", err)
	}
	if err := txn.Send(ctx, "t", Record{Value: []byte("r2")}); Reason(err) != ReasonTransactionNotOpen {
		t.Errorf("Send after an unknown commit outcome: %v, want TRANSACTION_NOT_OPEN", err)
	}
	result, err := txn.Commit(ctx)
	if err != nil || !result.AlreadyEnded {
		t.Fatalf("second Commit: %+v, %v; want the commit it had made (already ended)", result, err)
	}
}

// NOT_ENOUGH_REPLICAS (retriable: nothing was written) is retried, not failed.
func TestNotEnoughReplicasIsRetried(t *testing.T) {
	f := startFake(t)
	seen := 0
	f.fault = func(_ int, value string) string {
		if value == "v003" {
			seen++
			if seen == 1 {
				return ReasonNotEnoughReplicas
			}
		}
		return ""
	}
	_, errs, _ := produceAll(t, f, 10, ProducerOptions{MaxInFlight: 1})
	for i, err := range errs {
		if err != nil {
			t.Errorf("record %d: %v", i, err)
		}
	}
}
