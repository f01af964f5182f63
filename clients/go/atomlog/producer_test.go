package atomlog

// The producer's retry rules against a small in-process stand-in for a partition server
// that keeps sequence numbers as atomlog's servers do (per producer id: a new one starts
// at 0, a retry of one of the last 5 batches is a duplicate, a gap is refused) and can be
// told to lose answers or refuse batches.

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/atomlog/atomlog/clients/go/gen/atomlog/v1"
)

type window struct{ base, last int32 }

type fakeProducerState struct {
	lastSeq int32
	recent  []window
	offsets map[int32]int64 // base sequence -> base offset
}

type fakeServer struct {
	pb.UnimplementedMetadataServiceServer
	pb.UnimplementedPartitionServiceServer
	pb.UnimplementedCoordinatorServiceServer
	address string

	mu        sync.Mutex
	log       []string // values, in offset order
	producers map[int64]*fakeProducerState
	nextPID   int64
	requests  int
	// fault decides what happens to the n-th produced batch (1-based, counting every
	// arrival): "" normal, "lose" append but fail the call, or a reason to refuse it.
	fault func(n int, value string) string
	// CommitTxn: keys committed (each call commits and loses its answer; an abort by a
	// committed key answers TRANSACTION_ALREADY_COMMITTED).
	committedKeys map[string]bool
	// EndTxn answers endState; GetTxnStatus calls are counted and answer COMMITTED.
	endState    pb.TxnState
	statusCalls int
	// ListOffsets calls are counted and answer logStart; Fetch refuses below it.
	logStart    int64
	listOffsets int
}

func startFake(t *testing.T) *fakeServer {
	t.Helper()
	listener, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	f := &fakeServer{address: listener.Addr().String(), producers: map[int64]*fakeProducerState{}, nextPID: 1000}
	server := grpc.NewServer()
	pb.RegisterMetadataServiceServer(server, f)
	pb.RegisterPartitionServiceServer(server, f)
	pb.RegisterCoordinatorServiceServer(server, f)
	go server.Serve(listener)
	t.Cleanup(server.Stop)
	return f
}

func (f *fakeServer) GetMetadata(context.Context, *pb.GetMetadataRequest) (*pb.GetMetadataResponse, error) {
	return &pb.GetMetadataResponse{
		Servers: []*pb.ServerInfo{{Name: "fake", Role: pb.ServerRole_SERVER_ROLE_COORDINATOR, GrpcAddress: f.address}},
		Topics: []*pb.TopicMetadata{{Name: "t", Partitions: []*pb.PartitionMetadata{
			{Partition: 0, ServerName: "fake", ServerAddress: f.address, Available: true}}}},
		TcPartitionCount: 16,
		TcPartitions:     f.tcPartitions(),
	}, nil
}

func (f *fakeServer) tcPartitions() []*pb.TcPartitionMetadata {
	var out []*pb.TcPartitionMetadata
	for k := uint32(0); k < 16; k++ {
		out = append(out, &pb.TcPartitionMetadata{TcPartition: k, CoordinatorName: "fake",
			CoordinatorAddress: f.address})
	}
	return out
}

func (f *fakeServer) InitProducerId(context.Context, *pb.InitProducerIdRequest) (*pb.InitProducerIdResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.nextPID++
	return &pb.InitProducerIdResponse{ProducerId: f.nextPID}, nil
}

func (f *fakeServer) Produce(_ context.Context, request *pb.ProduceRequest) (*pb.ProduceResponse, error) {
	reply := &pb.ProduceResponse{}
	lose := false
	for _, item := range request.GetItems() {
		result, lost := f.produce(item.GetRecordBatch())
		result.TopicPartition = item.GetTopicPartition()
		reply.Results = append(reply.Results, result)
		lose = lose || lost
	}
	if lose {
		return nil, status.Error(codes.Unavailable, "the answer was lost")
	}
	return reply, nil
}

func (f *fakeServer) produce(batch []byte) (*pb.ProduceResult, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	h, records, err := DecodeBatch(batch)
	if err != nil {
		return &pb.ProduceResult{Error: &pb.ItemError{Reason: Reason(err), Message: err.Error()}, BaseOffset: -1, LastOffset: -1}, false
	}
	f.requests++
	fault := ""
	if f.fault != nil {
		fault = f.fault(f.requests, string(records[0].Value))
	}
	if fault != "" && fault != "lose" {
		return &pb.ProduceResult{Error: &pb.ItemError{Reason: fault}, BaseOffset: -1, LastOffset: -1}, false
	}
	last := h.BaseSequence + h.LastOffsetDelta
	state := f.producers[h.ProducerID]
	refuse := func(reason string) (*pb.ProduceResult, bool) {
		return &pb.ProduceResult{Error: &pb.ItemError{Reason: reason}, BaseOffset: -1, LastOffset: -1}, false
	}
	switch {
	case state == nil && h.BaseSequence != 0:
		return refuse(ReasonUnknownProducerID)
	case state != nil:
		for _, w := range state.recent {
			if w.base == h.BaseSequence && w.last == last {
				base := state.offsets[w.base]
				return &pb.ProduceResult{BaseOffset: base, LastOffset: base + int64(h.LastOffsetDelta),
					Duplicate: true}, fault == "lose"
			}
		}
		if h.BaseSequence != state.lastSeq+1 {
			return refuse(ReasonOutOfOrderSequence)
		}
	}
	if state == nil {
		state = &fakeProducerState{offsets: map[int32]int64{}}
		f.producers[h.ProducerID] = state
	}
	base := int64(len(f.log))
	for _, r := range records {
		f.log = append(f.log, string(r.Value))
	}
	state.lastSeq = last
	state.offsets[h.BaseSequence] = base
	state.recent = append(state.recent, window{h.BaseSequence, last})
	if len(state.recent) > 5 {
		state.recent = state.recent[1:]
	}
	return &pb.ProduceResult{BaseOffset: base, LastOffset: base + int64(h.LastOffsetDelta)}, fault == "lose"
}

// produceAll sends n one-record batches and returns each record's outcome.
func produceAll(t *testing.T, f *fakeServer, n int, opts ProducerOptions) ([]RecordMetadata, []error, *Producer) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, err := Dial(f.address, WithRequestTimeout(5*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	opts.Linger = -1 // one batch per record
	p, err := c.NewProducer(ctx, opts)
	if err != nil {
		t.Fatal(err)
	}
	futures := make([]*Future, n)
	for i := range futures {
		if futures[i], err = p.Send(ctx, "t", Record{Value: []byte(fmt.Sprintf("v%03d", i))}); err != nil {
			t.Fatal(err)
		}
	}
	if err := p.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	metas, errs := make([]RecordMetadata, n), make([]error, n)
	for i, future := range futures {
		metas[i], errs[i] = future.Wait(ctx)
	}
	return metas, errs, p
}

func (f *fakeServer) values() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string{}, f.log...)
}

// Lost answers: the batches are sent again, byte for byte, and the server's
// de-duplication answers them; every record is written once, in send order.
func TestProducerRetriesLostAnswersWithoutDuplicates(t *testing.T) {
	f := startFake(t)
	f.fault = func(n int, _ string) string {
		if n%4 == 0 {
			return "lose"
		}
		return ""
	}
	metas, errs, p := produceAll(t, f, 60, ProducerOptions{})
	log := f.values()
	if len(log) != 60 {
		t.Fatalf("%d records written, want 60: %v", len(log), log)
	}
	for i := range metas {
		if errs[i] != nil {
			t.Fatalf("record %d: %v", i, errs[i])
		}
		if want := fmt.Sprintf("v%03d", i); log[i] != want || metas[i].Offset != int64(i) {
			t.Fatalf("offset %d holds %s, record %d was acknowledged at %d", i, log[i], i, metas[i].Offset)
		}
	}
	if p.Stats().Retries[ReasonServerUnavailable] == 0 {
		t.Fatal("no retry after a lost answer")
	}
}

// A batch refused for good leaves no hole: with nothing sent behind it, the batches after
// it take over its sequence numbers under the same producer id.
func TestProducerResequencesAfterARefusedBatch(t *testing.T) {
	f := startFake(t)
	f.fault = func(_ int, value string) string {
		if value == "v003" {
			return ReasonBatchTooLarge
		}
		return ""
	}
	_, errs, p := produceAll(t, f, 10, ProducerOptions{MaxInFlight: 1})
	for i, err := range errs {
		if (i == 3) != (err != nil) || (i == 3 && Reason(err) != ReasonBatchTooLarge) {
			t.Fatalf("record %d: %v", i, err)
		}
	}
	if got := fmt.Sprint(f.values()); got != "[v000 v001 v002 v004 v005 v006 v007 v008 v009]" {
		t.Fatalf("log %s", got)
	}
	f.mu.Lock()
	producers := len(f.producers)
	f.mu.Unlock()
	if producers != 1 || p.Stats().Failed[ReasonBatchTooLarge] != 1 {
		t.Fatalf("%d producer ids used, stats %+v", producers, p.Stats())
	}
}

// With batches already sent behind the refused one, renumbering them could write a
// stale attempt twice: the partition moves to a fresh producer id instead, and nothing
// but the refused record is lost, nothing duplicated, nothing reordered.
func TestProducerTakesAFreshIDWhenLaterBatchesWereSent(t *testing.T) {
	f := startFake(t)
	f.fault = func(_ int, value string) string {
		if value == "v005" { // refused every time, as a server refuses the same bytes
			return ReasonCorruptBatch
		}
		return ""
	}
	_, errs, _ := produceAll(t, f, 40, ProducerOptions{MaxInFlight: 5})
	var want []string
	for i, err := range errs {
		if i == 5 {
			if Reason(err) != ReasonCorruptBatch {
				t.Fatalf("record 5: %v", err)
			}
			continue
		}
		if err != nil {
			t.Fatalf("record %d: %v", i, err)
		}
		want = append(want, fmt.Sprintf("v%03d", i))
	}
	if got := f.values(); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("log %v\nwant %v", got, want)
	}
}

// A batch whose first attempt was written but unanswered, and whose retry is refused
// for good (a server started without the partition's copy answers DATA_LOSS; the copy
// comes back later): the refusal proves nothing about the first attempt, so its
// sequence numbers must not pass to the next records. Reused, the next batch would be
// answered as a duplicate of it and never written (found by the chaos harness: log
// workload, seed 2924, misplace). Every acknowledged record is where its answer says,
// and the refused one's error says it may have been written.
func TestProducerNeverReusesTheSequenceOfABatchThatMayBeWritten(t *testing.T) {
	f := startFake(t)
	arrivals := 0
	f.fault = func(_ int, value string) string {
		if value != "v003" {
			return ""
		}
		arrivals++
		if arrivals == 1 {
			return "lose"
		}
		return ReasonDataLoss
	}
	metas, errs, _ := produceAll(t, f, 10, ProducerOptions{MaxInFlight: 1})
	log := f.values()
	if Reason(errs[3]) != ReasonDataLoss || !strings.Contains(errs[3].Error(), "may or may not") {
		t.Fatalf("record 3: %v", errs[3])
	}
	acknowledged := 0
	for i, err := range errs {
		if err != nil {
			continue
		}
		acknowledged++
		if want := fmt.Sprintf("v%03d", i); metas[i].Offset >= int64(len(log)) || log[metas[i].Offset] != want {
			t.Fatalf("record %d acknowledged at %d, which holds %v (log %v)", i, metas[i].Offset,
				log[min(int(metas[i].Offset), len(log)-1)], log)
		}
	}
	if acknowledged < 7 || errs[9] != nil {
		t.Fatalf("%d acknowledged, errors %v", acknowledged, errs)
	}
	f.mu.Lock()
	producers := len(f.producers)
	f.mu.Unlock()
	if producers != 2 {
		t.Fatalf("%d producer ids used, want a fresh one after the refusal", producers)
	}
}

// TestDurationsSentAsMillisecondsAreChecked: a TransactionTimeout or a Nack delay goes on
// the wire as uint32 milliseconds: under 1 ms a timeout became the server's default
// (60 s), past 49.7 days it wrapped, and a negative Nack delay became about 49.7 days.
// They are refused before anything is sent.
func TestDurationsSentAsMillisecondsAreChecked(t *testing.T) {
	f := startFake(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := Dial(f.address, WithRequestTimeout(5*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	for _, timeout := range []time.Duration{time.Microsecond, 50 * 24 * time.Hour} {
		_, err := c.NewProducer(ctx, ProducerOptions{TransactionalID: "t", TransactionTimeout: timeout})
		var typed *Error
		if !errors.As(err, &typed) || typed.Reason != ReasonInvalidTransactionTimeout {
			t.Fatalf("TransactionTimeout %s: %v", timeout, err)
		}
	}
	s := &Subscription{c: c, consumerID: "c"}
	for _, delay := range []time.Duration{-5 * time.Second, 50 * 24 * time.Hour} {
		err := s.nack(ctx, []TopicPartition{{Topic: "t"}}, nil, delay)
		var typed *Error
		if !errors.As(err, &typed) || typed.Reason != ReasonInvalidArgument {
			t.Fatalf("Nack delay %s: %v", delay, err)
		}
	}
}
