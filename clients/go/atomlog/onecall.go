package atomlog

// One-call transactions: the client keeps a small transaction's records and
// transactional acks, and Commit sends them all in one CoordinatorService.CommitTxn call.
// The coordinator stages the parts on the partition servers, logs the decision once
// they are durable, answers, then writes the markers. Nothing is logged before the
// decision (presumed abort), so a transaction that fails simply never commits.
// Retry-safe by its idempotency key: a retried CommitTxn of a committed transaction
// answers already_ended; after an unknown outcome, Abort sends CommitTxn with abort=true,
// which makes sure the key never commits (or says it already did).

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"sync"
	"time"

	pb "github.com/atomlog/atomlog/clients/go/gen/atomlog/v1"
)

// OneCallOptions of NewOneCallTxn.
type OneCallOptions struct {
	// Timeout bounds the whole commit (staging included) and is the transaction's
	// timeout (default 60 s).
	Timeout time.Duration
	// MaxBytes bounds what the transaction keeps (default 1 MiB, the coordinator's
	// default coordinator.one_call_max_bytes).
	MaxBytes int
	// Compression of its batches.
	Compression Compression
	// WaitForMarkers: Commit returns once every partition and subscription applied the
	// decision, not as soon as it is durable.
	WaitForMarkers bool
}

// OneCallTxn is a transaction kept by the client and committed in one CommitTxn call.
// Safe for concurrent use.
type OneCallTxn struct {
	c       *Client
	tc      uint32
	key     string
	session *pb.TransactionalSession
	prod    *Producer
	opts    OneCallOptions
	began   time.Time

	mu      sync.Mutex
	records map[TopicPartition][]Record
	order   []TopicPartition
	acks    map[subscriptionPartition]*ackItem
	size    int
	state   txnState
	unknown bool // a CommitTxn ended with an unknown outcome
	id      TxnID
	results map[TopicPartition]int64
	sticky  map[string]int32
}

// NewOneCallTxn begins a one-call transaction (no call is made until Commit).
func (c *Client) NewOneCallTxn(ctx context.Context, opts OneCallOptions) (*OneCallTxn, error) {
	return c.newOneCall(ctx, opts, nil, nil)
}

// BeginOneCallTxn begins a one-call transaction of this producer's session
// (TransactionalID producers only): fenced like BeginTxn's transactions.
func (p *Producer) BeginOneCallTxn(ctx context.Context, opts OneCallOptions) (*OneCallTxn, error) {
	p.mu.Lock()
	session, fenced := p.session, p.fenced
	p.mu.Unlock()
	if session == nil {
		return nil, errorf(ReasonInvalidArgument, "BeginOneCallTxn needs a producer with a TransactionalID")
	}
	if fenced {
		return nil, errorf(ReasonProducerFenced, "transactional id %q was taken over by a newer producer",
			p.opts.TransactionalID)
	}
	if opts.Timeout == 0 {
		opts.Timeout = p.opts.TransactionTimeout
	}
	return p.c.newOneCall(ctx, opts, session, p)
}

func (c *Client) newOneCall(ctx context.Context, opts OneCallOptions, session *pb.TransactionalSession,
	p *Producer) (*OneCallTxn, error) {
	if opts.Timeout == 0 {
		opts.Timeout = 60 * time.Second
	}
	if opts.MaxBytes == 0 {
		opts.MaxBytes = 1 << 20
	}
	count, err := c.tcPartitionCount(ctx)
	if err != nil {
		return nil, err
	}
	t := &OneCallTxn{c: c, session: session, prod: p, opts: opts, began: time.Now(),
		records: map[TopicPartition][]Record{}, acks: map[subscriptionPartition]*ackItem{},
		sticky: map[string]int32{}}
	var gathered []uint32
	if session == nil && !c.opts.SpreadOneCalls && opts.Timeout <= gatherMaxTimeout {
		c.metaMu.Lock()
		gathered = gatheringTCPartitions(c.tcRoutes)
		c.metaMu.Unlock()
	}
	if len(gathered) > 0 {
		t.tc = gathered[c.oneCallTurns.Add(1)%uint64(len(gathered))]
		t.key = keyFor(t.tc, count)
	} else {
		t.tc, t.key = placeTxn(session != nil, p, count)
	}
	return t, nil
}

// gatherMaxTimeout: only a one-call transaction with a timeout up to this gathers. A
// gathered TC partition holds its coordinator's one-call commits alone, and each finished
// one is remembered until its deadline + transaction.finished_grace_ms, so longer ones
// would fill it (transaction.max_finished_held) at a lower rate.
const gatherMaxTimeout = 60 * time.Second

// gatheringTCPartitions are the TC partitions one-call transactions gather on: the
// lowest-numbered one each coordinator owns in routes (TC partition -> owner's address,
// "" for none), ascending. Every client picks the same partition of a coordinator, so its
// one-call commits share that TC partition's log appends under load (docs/coordinator.md,
// "Gathered one-call commits"); a transaction takes each coordinator's in turn.
func gatheringTCPartitions(routes map[uint32]string) []uint32 {
	lowest := map[string]uint32{}
	for k, address := range routes {
		if address == "" {
			continue
		}
		if held, ok := lowest[address]; !ok || k < held {
			lowest[address] = k
		}
	}
	out := make([]uint32, 0, len(lowest))
	for _, k := range lowest {
		out = append(out, k)
	}
	sort.Slice(out, func(i, j int) bool { return out[i] < out[j] })
	return out
}

// keyFor is a fresh random idempotency key that hashes to tc (TCPartitionFor).
func keyFor(tc, count uint32) string {
	for {
		if key := randomKey(); TCPartitionFor(key, count) == tc {
			return key
		}
	}
}

// Key is the transaction's idempotency key (what a retried CommitTxn names).
func (t *OneCallTxn) Key() string { return t.key }

// ID is the transaction's id once Commit succeeded (zero before).
func (t *OneCallTxn) ID() TxnID {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.id
}

func (t *OneCallTxn) checkOpen() error {
	if t.state != txnOpen {
		return errorf(ReasonTransactionNotOpen, "the one-call transaction is %s: it takes nothing more",
			[...]string{"open", "committing", "committed", "aborted"}[t.state])
	}
	if t.unknown {
		// A commit whose outcome is unknown: what it sent may be committed under its key,
		// and a retry with more in it would be answered "already ended", the rest dropped.
		return errorf(ReasonTransactionNotOpen, "the one-call transaction's commit has an unknown "+
			"outcome: Commit again (same key) or Abort; it takes nothing more")
	}
	return nil
}

// Send keeps a record for the commit (partitioned as a producer would: ToPartition, or
// by key, or one partition per topic for keyless records).
func (t *OneCallTxn) Send(ctx context.Context, topic string, record Record, options ...SendOption) error {
	o := sendOptions{partition: -1}
	for _, option := range options {
		option(&o)
	}
	if o.txn != nil {
		return errorf(ReasonInvalidArgument, "a one-call transaction's records take no InTxn")
	}
	count, err := t.c.Partitions(ctx, topic)
	if err != nil {
		return err
	}
	if o.partition >= int32(count) {
		return errorf(ReasonUnknownTopicOrPartition, "topic %q has %d partitions; no partition %d",
			topic, count, o.partition)
	}
	if o.partition < 0 && record.Key != nil {
		o.partition = int32(CRC32C(record.Key) % uint32(count))
	}
	if record.Timestamp.IsZero() {
		record.Timestamp = time.Now()
	}
	size := recordSize(record)
	t.mu.Lock()
	defer t.mu.Unlock()
	if err := t.checkOpen(); err != nil {
		return err
	}
	if o.partition < 0 {
		sticky, ok := t.sticky[topic]
		if !ok {
			sticky = int32(CRC32C([]byte(t.key+topic)) % uint32(count))
			t.sticky[topic] = sticky
		}
		o.partition = sticky
	}
	if t.size+size > t.opts.MaxBytes {
		return errorf(ReasonInvalidArgument, "the one-call transaction would hold more than %d bytes "+
			"(MaxBytes); use a streaming transaction (BeginTxn) for more", t.opts.MaxBytes)
	}
	tp := TopicPartition{Topic: topic, Partition: o.partition}
	if _, ok := t.records[tp]; !ok {
		t.order = append(t.order, tp)
	}
	t.records[tp] = append(t.records[tp], record)
	t.size += size
	return nil
}

// Ack keeps individual acks of messages of a subscription for the commit.
func (t *OneCallTxn) Ack(s *Subscription, messages []Message) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if err := t.checkOpen(); err != nil {
		return err
	}
	for tp, ranges := range offsetRanges(messages) {
		item := t.acks[s.sp(tp)]
		if item == nil {
			item = &ackItem{}
			t.acks[s.sp(tp)] = item
		}
		item.ranges = mergeRanges(append(item.ranges, ranges...))
		t.size += 64 + 16*len(ranges)
	}
	return nil
}

// AckCumulative keeps a cumulative ack (everything up to and including message).
func (t *OneCallTxn) AckCumulative(s *Subscription, message Message) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if err := t.checkOpen(); err != nil {
		return err
	}
	sp := s.sp(TopicPartition{Topic: message.Topic, Partition: message.Partition})
	item := t.acks[sp]
	if item == nil {
		item = &ackItem{}
		t.acks[sp] = item
	}
	item.cumulative = max(item.cumulative, message.Offset+1)
	t.size += 64
	return nil
}

func mergeRanges(ranges []*pb.OffsetRange) []*pb.OffsetRange {
	sort.Slice(ranges, func(i, j int) bool { return ranges[i].StartOffset < ranges[j].StartOffset })
	var out []*pb.OffsetRange
	for _, r := range ranges {
		if n := len(out); n > 0 && out[n-1].EndOffset >= r.StartOffset {
			out[n-1].EndOffset = max(out[n-1].EndOffset, r.EndOffset)
			continue
		}
		out = append(out, &pb.OffsetRange{StartOffset: r.StartOffset, EndOffset: r.EndOffset})
	}
	return out
}

// notCommitted: CommitTxn answers these only when the transaction did not commit and
// never will (refused before its decision was logged). Any other failure leaves the
// outcome unknown: Commit may be called again (same key), Abort makes sure.
var notCommitted = map[string]bool{
	ReasonInvalidArgument: true, ReasonCorruptBatch: true, ReasonBatchTooLarge: true,
	ReasonCRCMismatch: true, ReasonUnknownTopicOrPartition: true, ReasonProducerFenced: true,
	ReasonInvalidTransactionTimeout: true, ReasonTransactionAborted: true,
	ReasonTransactionTimedOut: true, ReasonTransactionConflict: true, ReasonTransactionNotOpen: true,
	ReasonDataLoss: true, ReasonOffsetOutOfRange: true, ReasonUnimplemented: true,
}

// OneCallResult says where a committed one-call transaction's batches went.
type OneCallResult struct {
	ID TxnID
	// BaseOffsets per partition; empty when the commit was answered by a retry of an
	// earlier call that committed (already ended).
	BaseOffsets map[TopicPartition]int64
	// AlreadyEnded: an earlier call with the same key had committed it.
	AlreadyEnded bool
}

// Commit sends the whole transaction in one CommitTxn call (retried on retriable
// answers until its timeout). On an error, Abort makes sure it never commits; calling
// Commit again retries with the same key. A transaction with nothing in it commits
// without a call.
func (t *OneCallTxn) Commit(ctx context.Context) (OneCallResult, error) {
	t.mu.Lock()
	switch t.state {
	case txnCommitted:
		t.mu.Unlock()
		return OneCallResult{ID: t.id, BaseOffsets: t.results}, nil
	case txnAborted:
		t.mu.Unlock()
		return OneCallResult{}, errorf(ReasonTransactionAborted, "the one-call transaction was aborted")
	}
	t.state = txnCommitting
	left := t.opts.Timeout - time.Since(t.began)
	if left <= 0 && t.unknown {
		// An earlier Commit's outcome is unknown: it may have committed. Settled by
		// aborting the key, which says so when it committed, never assumed.
		t.state = txnOpen
		t.mu.Unlock()
		return t.settleUnknown(ctx)
	}
	if left <= 0 {
		t.state = txnAborted
		t.mu.Unlock()
		return OneCallResult{}, errorf(ReasonTransactionTimedOut, "the transaction's timeout of %s ran out "+
			"before it was committed", t.opts.Timeout)
	}
	if len(t.order) == 0 && len(t.acks) == 0 {
		t.state = txnCommitted
		t.mu.Unlock()
		return OneCallResult{}, nil
	}
	request := &pb.CommitTxnRequest{TcPartition: t.tc, IdempotencyKey: t.key,
		TimeoutMs: uint32(max(left.Milliseconds(), 1)), Session: t.session, WaitForMarkers: t.opts.WaitForMarkers}
	for _, tp := range t.order {
		batch, err := EncodeColumnBatch(t.records[tp], BatchFields{BaseSequence: NoSequence,
			Compression: t.opts.Compression})
		if err != nil {
			t.state = txnOpen
			t.mu.Unlock()
			return OneCallResult{}, err
		}
		request.Batches = append(request.Batches, &pb.ProduceItem{TopicPartition: tp.proto(), RecordBatch: batch})
	}
	sps := make([]subscriptionPartition, 0, len(t.acks))
	for sp := range t.acks {
		sps = append(sps, sp)
	}
	sort.Slice(sps, func(i, j int) bool {
		return fmt.Sprint(sps[i]) < fmt.Sprint(sps[j])
	})
	for _, sp := range sps {
		item := t.acks[sp]
		request.Acks = append(request.Acks, &pb.AckItem{SubscriptionPartition: sp.proto(),
			CumulativeEndOffset: item.cumulative, IndividualRanges: item.ranges})
	}
	order := append([]TopicPartition{}, t.order...)
	t.mu.Unlock()

	callCtx, cancel := context.WithTimeout(ctx, left)
	defer cancel()
	var reply *pb.CommitTxnResponse
	err := t.c.coordinatorCall(callCtx, t.tc, func(actx context.Context, stub pb.CoordinatorServiceClient) (err error) {
		reply, err = stub.CommitTxn(actx, request)
		return err
	})
	if err == nil && request.WaitForMarkers && reply.GetState() == pb.TxnState_TXN_STATE_COMMITTING {
		// The coordinator's wait ended at the call's deadline: wait for COMMITTED.
		waitCommitted(ctx, t.c, t.tc, txnIDOf(reply.GetTxnId()), time.Now().Add(t.opts.Timeout))
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if err != nil {
		if notCommitted[Reason(err)] {
			t.state = txnAborted
			if errors.Is(err, ErrProducerFenced) && t.prod != nil {
				go t.prod.noteFenced()
			}
		} else {
			t.state, t.unknown = txnOpen, true // Commit again (same key) or Abort
		}
		return OneCallResult{}, err
	}
	t.state = txnCommitted
	t.id = txnIDOf(reply.GetTxnId())
	t.results = map[TopicPartition]int64{}
	for i, result := range reply.GetBatchResults() {
		if i < len(order) {
			t.results[order[i]] = result.GetBaseOffset()
		}
	}
	return OneCallResult{ID: t.id, BaseOffsets: t.results, AlreadyEnded: reply.GetAlreadyEnded()}, nil
}

// settleUnknown ends a transaction whose earlier Commit had an unknown outcome and
// whose timeout ran out: Abort by key tells which it was. Committed: the result (its
// offsets not known: AlreadyEnded); aborted now: TRANSACTION_TIMED_OUT, definitely not
// committed; neither known yet: the error (retriable), still unknown.
func (t *OneCallTxn) settleUnknown(ctx context.Context) (OneCallResult, error) {
	err := t.Abort(ctx)
	switch {
	case err == nil:
		return OneCallResult{}, errorf(ReasonTransactionTimedOut, "the transaction's timeout of %s "+
			"ran out after a commit whose outcome was unknown; it did not commit (aborted by key)",
			t.opts.Timeout)
	case errors.Is(err, ErrTransactionAlreadyCommitted):
		t.mu.Lock()
		defer t.mu.Unlock()
		return OneCallResult{ID: t.id, BaseOffsets: t.results, AlreadyEnded: true}, nil
	}
	return OneCallResult{}, err
}

// Abort gives the transaction up. Nothing was sent unless a Commit failed with an
// unknown outcome: then CommitTxn with abort=true makes sure the key never commits
// (TRANSACTION_ALREADY_COMMITTED if it did).
func (t *OneCallTxn) Abort(ctx context.Context) error {
	t.mu.Lock()
	if t.state == txnAborted {
		t.mu.Unlock()
		return nil
	}
	if t.state == txnCommitted {
		t.mu.Unlock()
		return errorf(ReasonTransactionAlreadyCommitted, "the one-call transaction committed")
	}
	if !t.unknown {
		t.state = txnAborted
		t.mu.Unlock()
		return nil
	}
	t.mu.Unlock()
	err := t.c.coordinatorCall(ctx, t.tc, func(actx context.Context, stub pb.CoordinatorServiceClient) error {
		_, err := stub.CommitTxn(actx, &pb.CommitTxnRequest{TcPartition: t.tc, IdempotencyKey: t.key,
			Session: t.session, Abort: true})
		return err
	})
	t.mu.Lock()
	defer t.mu.Unlock()
	switch {
	case err == nil:
		t.state = txnAborted
	case errors.Is(err, ErrTransactionAlreadyCommitted):
		t.state = txnCommitted
	}
	return err
}
