package atomlog

import (
	"context"
	"fmt"
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

func (f *fakeServer) NewTxn(_ context.Context, r *pb.NewTxnRequest) (*pb.NewTxnResponse, error) {
	return &pb.NewTxnResponse{TxnId: &pb.TxnId{TcPartition: r.GetTcPartition(), Sequence: 7},
		State: pb.TxnState_TXN_STATE_OPEN}, nil
}

func (f *fakeServer) EndTxn(context.Context, *pb.EndTxnRequest) (*pb.EndTxnResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return &pb.EndTxnResponse{State: f.endState}, nil
}

func (f *fakeServer) GetTxnStatus(context.Context, *pb.GetTxnStatusRequest) (*pb.GetTxnStatusResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.statusCalls++
	return &pb.GetTxnStatusResponse{State: pb.TxnState_TXN_STATE_COMMITTED}, nil
}

func (f *fakeServer) ListOffsets(_ context.Context, r *pb.ListOffsetsRequest) (*pb.ListOffsetsResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.listOffsets++
	reply := &pb.ListOffsetsResponse{}
	for _, item := range r.GetItems() {
		reply.Results = append(reply.Results, &pb.ListOffsetsResult{TopicPartition: item.GetTopicPartition(),
			Offset: f.logStart, LogStartOffset: f.logStart})
	}
	return reply, nil
}

func (f *fakeServer) Fetch(_ context.Context, r *pb.FetchRequest) (*pb.FetchResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	reply := &pb.FetchResponse{}
	for _, item := range r.GetItems() {
		result := &pb.FetchResult{TopicPartition: item.GetTopicPartition(), NextFetchOffset: item.GetFetchOffset()}
		if item.GetFetchOffset() < f.logStart {
			result.Error = &pb.ItemError{Reason: ReasonOffsetOutOfRange,
				Message: fmt.Sprintf("offset %d is below the log start %d", item.GetFetchOffset(), f.logStart)}
		}
		reply.Results = append(reply.Results, result)
	}
	return reply, nil
}

// EndTxn with wait_for_markers answers COMMITTING when its wait ends at the call's
// deadline: Commit returned then, before the records were readable. It now polls
// GetTxnStatus until COMMITTED, as WaitForMarkers promises.
func TestCommitWaitingForMarkersPollsUntilCommitted(t *testing.T) {
	f := startFake(t)
	f.endState = pb.TxnState_TXN_STATE_COMMITTING
	c, err := Dial(f.address, WithRequestTimeout(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	txn, err := c.BeginTxn(ctx, TxnOptions{WaitForMarkers: true})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := txn.ID(ctx); err != nil {
		t.Fatal(err)
	}
	if err := txn.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.statusCalls == 0 {
		t.Errorf("Commit returned on COMMITTING without asking GetTxnStatus")
	}
}

// StartEarliest began at offset 0, not the log start: after retention moved it, every
// Poll failed OFFSET_OUT_OF_RANGE. It is resolved with ListOffsets now.
func TestConsumerStartsEarliestAtTheLogStart(t *testing.T) {
	f := startFake(t)
	f.logStart = 100
	c, err := Dial(f.address, WithRequestTimeout(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx := context.Background()
	cs, err := c.NewConsumer(ctx, []string{"t"}, ConsumerOptions{Start: StartEarliest})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cs.Poll(ctx, 50*time.Millisecond); err != nil {
		t.Errorf("Poll: %v", err)
	}
}

// A TransactionalID producer's plain sends after one of its partitions was abandoned
// (a refusal that may have written): only BeginTxn bumped the epoch, so every later
// plain send to that partition carried a sequence the partition could not take, refused
// one after the other for good. The next plain send now bumps the epoch first. (Batches
// queued before the refusal still fail: they were numbered under the broken sequence.)
func TestSessionPlainSendsAfterAnAbandonedPartitionGoOn(t *testing.T) {
	f := startFake(t)
	f.fault = func(_ int, value string) string {
		if value == "v003" {
			return ReasonInternal // maybe written, not retriable: the partition is abandoned
		}
		return ""
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, err := Dial(f.address, WithRequestTimeout(5*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	p, err := c.NewProducer(ctx, ProducerOptions{MaxInFlight: 1, TransactionalID: "plain-1", Linger: -1})
	if err != nil {
		t.Fatal(err)
	}
	send := func(i int) error {
		future, err := p.Send(ctx, "t", Record{Value: []byte(fmt.Sprintf("v%03d", i))})
		if err != nil {
			return err
		}
		_, err = future.Wait(ctx)
		return err
	}
	for i := 0; i < 4; i++ {
		if err := send(i); (err != nil) != (i == 3) {
			t.Fatalf("record %d: %v", i, err)
		}
	}
	for i := 4; i < 8; i++ {
		if err := send(i); err != nil {
			t.Errorf("record %d after the abandoned one: %v", i, err)
		}
	}
}

// UNKNOWN_PRODUCER_ID for the oldest unanswered batch: the partition forgot the
// producer (idle past its expiry). The records, never written, failed; they are now sent
// again under a fresh producer id from sequence 0 (KIP-360).
func TestRecordsRefusedAsOfAnUnknownProducerGoAgainUnderANewID(t *testing.T) {
	f := startFake(t)
	f.fault = func(_ int, value string) string {
		if value == "v005" {
			for id := range f.producers { // (f.mu held) the partition forgot them
				delete(f.producers, id)
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
	if log := f.values(); len(log) != 10 {
		t.Errorf("log %v", log)
	}
}
