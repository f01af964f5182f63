package atomlog

// Transactions, the streaming way: NewTxn, AddPartitionToTxn / AddSubscriptionToTxn
// before the first write or ack to each target, Produce and Ack carrying the
// transaction id, EndTxn. A transaction lives on one TC partition, chosen by hashing a
// random idempotency key (coordinator.proto's tc_partition_for), so a NewTxn retried
// after a lost answer finds the same transaction instead of opening a second one.
// NewTxn is sent with the first registration (it registers those targets itself), so a
// transaction costs one call fewer, and one that wrote and acked nothing commits without
// a call.

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"sync"
	"time"

	pb "github.com/atomlog/atomlog/clients/go/gen/atomlog/v1"
)

// TxnOptions of BeginTxn.
type TxnOptions struct {
	// Timeout after which the coordinator aborts the transaction (default 60 s; at most
	// the coordinator's maximum, 15 min by default), counted from BeginTxn.
	Timeout time.Duration
	// WaitForMarkers makes Commit return only once every partition and subscription has
	// applied the decision (readers and cursors show it), not as soon as it is durable.
	WaitForMarkers bool
}

type txnState int

const (
	txnOpen txnState = iota
	txnCommitting
	txnCommitted
	txnAborted
)

// Txn is one transaction. Writes join it with InTxn(txn), acks with
// Subscription.Ack(ctx, messages, txn); Commit or Abort ends it. Safe for concurrent use.
type Txn struct {
	c        *Client
	tc       uint32
	key      string
	session  *pb.TransactionalSession
	producer *Producer // the session's producer (learns it was fenced), or nil
	timeout  time.Duration
	wait     bool // WaitForMarkers
	began    time.Time

	openMu sync.Mutex // NewTxn and registrations, one at a time

	mu         sync.Mutex
	id         TxnID
	opened     bool
	partitions map[TopicPartition]bool
	subs       map[subscriptionPartition]bool
	pending    []*outcome // sends and acks Commit waits for
	producers  map[*Producer]bool
	state      txnState
}

// BeginTxn begins a transaction. Nothing is sent yet: the coordinator hears of it with
// its first write or ack (or when ID is asked for).
func (c *Client) BeginTxn(ctx context.Context, opts TxnOptions) (*Txn, error) {
	return c.newTxn(ctx, opts, nil, nil)
}

func (c *Client) newTxn(ctx context.Context, opts TxnOptions, session *pb.TransactionalSession,
	producer *Producer) (*Txn, error) {
	if opts.Timeout == 0 {
		opts.Timeout = 60 * time.Second
	}
	if opts.Timeout < time.Millisecond || opts.Timeout.Milliseconds() > 1<<32-1 {
		return nil, errorf(ReasonInvalidTransactionTimeout, "timeout %s", opts.Timeout)
	}
	count, err := c.tcPartitionCount(ctx)
	if err != nil {
		return nil, err
	}
	t := &Txn{c: c, session: session, producer: producer, timeout: opts.Timeout, wait: opts.WaitForMarkers,
		began:      time.Now(),
		partitions: map[TopicPartition]bool{}, subs: map[subscriptionPartition]bool{},
		producers: map[*Producer]bool{}}
	t.tc, t.key = placeTxn(session != nil, producer, count)
	return t, nil
}

// placeTxn is a new transaction's TC partition and idempotency key: a session's lives on
// tc_partition_for(transactional id), its key whatever it hashes to; any other goes where
// its fresh key hashes.
func placeTxn(inSession bool, producer *Producer, count uint32) (uint32, string) {
	key := randomKey()
	if inSession {
		return producer.sessionTC, key
	}
	return TCPartitionFor(key, count), key
}

func randomKey() string {
	var b [16]byte
	rand.Read(b[:]) //nolint:errcheck // never fails
	return "go-" + hex.EncodeToString(b[:])
}

// ID opens the transaction if needed and returns its id.
func (t *Txn) ID(ctx context.Context) (TxnID, error) {
	if err := t.register(ctx, nil, nil); err != nil {
		return TxnID{}, err
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.id, nil
}

// TCPartition is the TC partition the transaction lives on.
func (t *Txn) TCPartition() uint32 { return t.tc }

func (t *Txn) idIfOpen() TxnID {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.id
}

func (t *Txn) registered(tp TopicPartition) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.partitions[tp]
}

// accepting: new sends and acks, not once a commit began or it ended.
func (t *Txn) accepting(p *Producer) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.state != txnOpen {
		return errorf(ReasonTransactionNotOpen, "transaction %s is %s: it takes no new sends or acks",
			t.name(), t.stateName())
	}
	if p != nil && t.session != nil && p != t.producer {
		return errorf(ReasonInvalidArgument, "a session's transaction takes sends of its own producer only")
	}
	return nil
}

func (t *Txn) name() string {
	if !t.opened {
		return "(not opened yet)"
	}
	return t.id.String()
}

// nameLocked is name() for a caller that does not hold t.mu (the sender goroutine
// sets the id when it opens the transaction).
func (t *Txn) nameLocked() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.name()
}

func (t *Txn) stateName() string {
	return [...]string{"open", "committing", "committed", "aborted"}[t.state]
}

// track makes Commit wait for a send's or ack's outcome (and fail if it failed).
func (t *Txn) track(p *Producer, o *outcome) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.pending = append(t.pending, o)
	if p != nil {
		t.producers[p] = true
	}
}

func (t *Txn) remainingMs() (uint32, error) {
	left := t.timeout - time.Since(t.began)
	if left <= 0 {
		return 0, errorf(ReasonTransactionTimedOut, "the transaction's timeout of %s ran out before "+
			"its first write", t.timeout)
	}
	return uint32(max(left.Milliseconds(), 1)), nil
}

// register adds partitions and subscription partitions to the transaction: the NewTxn
// that opens it carries them, later ones go in AddPartitionToTxn / AddSubscriptionToTxn.
// Cached: a target is registered once.
func (t *Txn) register(ctx context.Context, tps []TopicPartition, sps []subscriptionPartition) error {
	t.openMu.Lock()
	defer t.openMu.Unlock()
	t.mu.Lock()
	if t.state == txnCommitted || t.state == txnAborted {
		name, state := t.name(), t.stateName()
		t.mu.Unlock()
		return errorf(ReasonTransactionNotOpen, "transaction %s is %s", name, state)
	}
	var newTps []TopicPartition
	var newSps []subscriptionPartition
	for _, tp := range tps {
		if !t.partitions[tp] && !containsTP(newTps, tp) {
			newTps = append(newTps, tp)
		}
	}
	for _, sp := range sps {
		if !t.subs[sp] && !containsSP(newSps, sp) {
			newSps = append(newSps, sp)
		}
	}
	opened := t.opened
	t.mu.Unlock()
	if opened && len(newTps) == 0 && len(newSps) == 0 {
		return nil
	}
	if !opened {
		return t.open(ctx, newTps, newSps)
	}
	if len(newTps) > 0 {
		var reply *pb.AddPartitionToTxnResponse
		request := &pb.AddPartitionToTxnRequest{TxnId: t.id.proto(), Session: t.session}
		for _, tp := range newTps {
			request.TopicPartitions = append(request.TopicPartitions, tp.proto())
		}
		err := t.call(ctx, func(actx context.Context, stub pb.CoordinatorServiceClient) (err error) {
			reply, err = stub.AddPartitionToTxn(actx, request)
			return err
		})
		if err != nil {
			return err
		}
		if err := t.settle(newTps, nil, reply.GetResults(), nil); err != nil {
			return err
		}
	}
	if len(newSps) > 0 {
		var reply *pb.AddSubscriptionToTxnResponse
		request := &pb.AddSubscriptionToTxnRequest{TxnId: t.id.proto(), Session: t.session}
		for _, sp := range newSps {
			request.SubscriptionPartitions = append(request.SubscriptionPartitions, sp.proto())
		}
		err := t.call(ctx, func(actx context.Context, stub pb.CoordinatorServiceClient) (err error) {
			reply, err = stub.AddSubscriptionToTxn(actx, request)
			return err
		})
		if err != nil {
			return err
		}
		return t.settle(nil, newSps, nil, reply.GetResults())
	}
	return nil
}

// open is the NewTxn call, registering the first targets.
func (t *Txn) open(ctx context.Context, tps []TopicPartition, sps []subscriptionPartition) error {
	timeoutMs, err := t.remainingMs()
	if err != nil {
		t.mu.Lock()
		t.state = txnAborted
		t.mu.Unlock()
		return err
	}
	request := &pb.NewTxnRequest{TcPartition: t.tc, TimeoutMs: timeoutMs, IdempotencyKey: t.key,
		Session: t.session}
	for _, tp := range tps {
		request.TopicPartitions = append(request.TopicPartitions, tp.proto())
	}
	for _, sp := range sps {
		request.SubscriptionPartitions = append(request.SubscriptionPartitions, sp.proto())
	}
	var reply *pb.NewTxnResponse
	err = t.call(ctx, func(actx context.Context, stub pb.CoordinatorServiceClient) (err error) {
		reply, err = stub.NewTxn(actx, request)
		return err
	})
	if err != nil {
		return err
	}
	if reply.GetState() != pb.TxnState_TXN_STATE_OPEN {
		// Only possible if the key was used before: a fresh random key never is.
		return errorf(ReasonTransactionNotOpen, "NewTxn found transaction %s %s",
			txnIDOf(reply.GetTxnId()), reply.GetState())
	}
	t.mu.Lock()
	t.id, t.opened = txnIDOf(reply.GetTxnId()), true
	t.mu.Unlock()
	return t.settle(tps, sps, reply.GetTopicPartitionResults(), reply.GetSubscriptionPartitionResults())
}

// settle records the targets registered and returns the first refusal.
func (t *Txn) settle(tps []TopicPartition, sps []subscriptionPartition,
	tpResults []*pb.TxnPartitionResult, spResults []*pb.TxnSubscriptionResult) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	var first error
	for i, tp := range tps {
		if i < len(tpResults) {
			if e := itemError(tpResults[i].GetError()); e != nil {
				first = errors.Join(first, fmt.Errorf("%s: %w", tp, e))
				continue
			}
			t.partitions[tp] = true
		}
	}
	for i, sp := range sps {
		if i < len(spResults) {
			if e := itemError(spResults[i].GetError()); e != nil {
				first = errors.Join(first, fmt.Errorf("%s/%s: %w", sp.TopicPartition, sp.Subscription, e))
				continue
			}
			t.subs[sp] = true
		}
	}
	return first
}

// call is a coordinator call about this transaction; a PRODUCER_FENCED answer tells
// the session's producer.
func (t *Txn) call(ctx context.Context, fn func(context.Context, pb.CoordinatorServiceClient) error) error {
	err := t.c.coordinatorCall(ctx, t.tc, fn)
	if errors.Is(err, ErrProducerFenced) && t.producer != nil {
		t.producer.noteFenced()
	}
	return err
}

// Commit waits for the transaction's sends and acks, then commits it. It returns once
// the decision is durable: committed. Safe to call again (a commit retried after an
// unknown outcome is answered "already committed"). Errors: TRANSACTION_ABORTED or
// TRANSACTION_TIMED_OUT when it cannot commit, PRODUCER_FENCED when a newer producer
// took its transactional id; if a send or ack failed, the transaction is aborted and
// that failure returned.
func (t *Txn) Commit(ctx context.Context) error {
	t.mu.Lock()
	switch t.state {
	case txnCommitted:
		t.mu.Unlock()
		return nil
	case txnAborted:
		t.mu.Unlock()
		return errorf(ReasonTransactionAborted, "transaction %s was aborted; it cannot commit", t.nameLocked())
	}
	t.state = txnCommitting
	producers := make([]*Producer, 0, len(t.producers))
	for p := range t.producers {
		producers = append(producers, p)
	}
	pending := t.pending
	t.mu.Unlock()
	for _, p := range producers {
		p.flushTxn(t)
	}
	var failed error
	for _, o := range pending {
		select {
		case <-o.done:
		case <-ctx.Done():
			return fmt.Errorf("transaction %s: waiting for its sends: %w", t.nameLocked(), ctx.Err())
		}
		if o.err != nil && failed == nil {
			failed = o.err
		}
	}
	if failed != nil {
		abortErr := t.Abort(ctx)
		if errors.Is(abortErr, ErrProducerFenced) {
			return fmt.Errorf("transaction %s: %w (and a send failed: %v)", t.nameLocked(), abortErr, failed)
		}
		return fmt.Errorf("transaction %s aborted: a send or ack failed: %w", t.nameLocked(), failed)
	}
	t.mu.Lock()
	opened := t.opened
	t.mu.Unlock()
	if !opened {
		if _, err := t.remainingMs(); err != nil {
			t.setState(txnAborted)
			return err
		}
		t.setState(txnCommitted) // nothing was written or acked: nothing to commit
		return nil
	}
	if err := t.end(ctx, pb.TxnDecision_TXN_DECISION_COMMIT); err != nil {
		if errors.Is(err, ErrTransactionAborted) || errors.Is(err, ErrTransactionTimedOut) {
			t.setState(txnAborted)
		}
		return err
	}
	t.setState(txnCommitted)
	return nil
}

// Abort aborts the transaction (safe to call again, and after the coordinator aborted
// it itself). Its unsent records are dropped. A transaction that acked messages returns
// once its ABORT markers released those acks (within ctx's deadline), so the next
// transaction may ack them at once.
func (t *Txn) Abort(ctx context.Context) error {
	t.mu.Lock()
	if t.state == txnAborted {
		t.mu.Unlock()
		return nil
	}
	if t.state == txnCommitted {
		t.mu.Unlock()
		return errorf(ReasonTransactionAlreadyCommitted, "transaction %s committed", t.nameLocked())
	}
	producers := make([]*Producer, 0, len(t.producers))
	for p := range t.producers {
		producers = append(producers, p)
	}
	t.mu.Unlock()
	aborted := errorf(ReasonTransactionAborted, "transaction %s was aborted", t.nameLocked())
	for _, p := range producers {
		p.dropTxn(t, aborted)
	}
	t.openMu.Lock() // no NewTxn in flight
	t.mu.Lock()
	opened := t.opened
	if !opened {
		t.state = txnAborted
	}
	t.mu.Unlock()
	t.openMu.Unlock()
	if !opened {
		return nil
	}
	err := t.end(ctx, pb.TxnDecision_TXN_DECISION_ABORT)
	if err == nil || errors.Is(err, ErrTransactionAborted) || errors.Is(err, ErrTransactionTimedOut) {
		t.setState(txnAborted)
		return nil
	}
	return err
}

func (t *Txn) setState(s txnState) {
	t.mu.Lock()
	t.state = s
	t.mu.Unlock()
}

func (t *Txn) end(ctx context.Context, decision pb.TxnDecision) error {
	wait := t.wait && decision == pb.TxnDecision_TXN_DECISION_COMMIT
	if decision == pb.TxnDecision_TXN_DECISION_ABORT {
		// An abort of a transaction that acked waits for its ABORT markers (within the
		// call's deadline): they release the pending acks, which the next transaction
		// could not ack again before (TRANSACTION_CONFLICT).
		t.mu.Lock()
		wait = len(t.subs) > 0
		t.mu.Unlock()
	}
	request := &pb.EndTxnRequest{TxnId: t.id.proto(), Decision: decision, Session: t.session,
		WaitForMarkers: wait}
	var reply *pb.EndTxnResponse
	err := t.call(ctx, func(actx context.Context, stub pb.CoordinatorServiceClient) (err error) {
		reply, err = stub.EndTxn(actx, request)
		return err
	})
	if err == nil && request.WaitForMarkers && reply.GetState() == pb.TxnState_TXN_STATE_COMMITTING {
		// The coordinator's wait ended at the call's deadline: the markers are still on
		// their way. Wait for COMMITTED as WaitForMarkers promises.
		waitCommitted(ctx, t.c, t.tc, t.id, time.Now().Add(t.timeout))
	}
	return err
}

// waitCommitted polls GetTxnStatus until the transaction is COMMITTED, ctx ends or
// `until` passes. It returns nothing: the transaction committed either way, and a
// caller that took a failure for "not committed" would write it twice.
func waitCommitted(ctx context.Context, c *Client, tc uint32, id TxnID, until time.Time) {
	for time.Now().Before(until) && ctx.Err() == nil {
		var reply *pb.GetTxnStatusResponse
		err := c.coordinatorCall(ctx, tc, func(actx context.Context, stub pb.CoordinatorServiceClient) (err error) {
			reply, err = stub.GetTxnStatus(actx, &pb.GetTxnStatusRequest{TxnId: id.proto()})
			return err
		})
		if err == nil && reply.GetState() == pb.TxnState_TXN_STATE_COMMITTED {
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// State asks the coordinator for the transaction's state ("OPEN", "COMMITTING", ...);
// a transaction not opened yet answers from here.
func (t *Txn) State(ctx context.Context) (string, error) {
	t.mu.Lock()
	opened, state := t.opened, t.state
	t.mu.Unlock()
	if !opened {
		switch state {
		case txnCommitted:
			return "COMMITTED", nil
		case txnAborted:
			return "ABORTED", nil
		}
		return "OPEN", nil
	}
	var reply *pb.GetTxnStatusResponse
	err := t.c.coordinatorCall(ctx, t.tc, func(actx context.Context, stub pb.CoordinatorServiceClient) (err error) {
		reply, err = stub.GetTxnStatus(actx, &pb.GetTxnStatusRequest{TxnId: t.id.proto()})
		return err
	})
	if err != nil {
		return "", err
	}
	return reply.GetState().String()[len("TXN_STATE_"):], nil
}

func containsTP(list []TopicPartition, tp TopicPartition) bool {
	for _, x := range list {
		if x == tp {
			return true
		}
	}
	return false
}

func containsSP(list []subscriptionPartition, sp subscriptionPartition) bool {
	for _, x := range list {
		if x == sp {
			return true
		}
	}
	return false
}
