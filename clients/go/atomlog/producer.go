package atomlog

// The idempotent producer. Send adds a record to its partition's open batch; a sender
// goroutine seals batches when they are full or their linger time has passed and sends
// each server one Produce request per round, with at most MaxInFlight batches of a
// partition unanswered (5: what servers remember per producer for de-duplication). The
// requests go on one pipelined connection to the server's link, in send order
// (pipeline.go), or over gRPC when the server has no link or it cannot be used.
//
// Every batch carries the producer id, epoch and a base sequence given when it is first
// sent, so a retry after a lost answer is recognised by the server, which answers with
// the original offsets: each record is written once, in send order per partition.
//
// Retries keep that order: a retriable failure of a batch sends it and every batch
// behind it on the partition again, the same bytes in sequence order, after a backoff
// and a metadata refresh. A sequence refusal of a batch that was sent while an earlier
// one was unanswered only means it overtook that one: it is sent again too. A batch
// refused for good fails its records; the batches behind it take over its sequence
// numbers if none of them was sent yet, else the partition gets a fresh producer id (so
// nothing already on its way can ever be in order again). DeliveryTimeout bounds it all.

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sort"
	"sync"
	"time"
	"unicode/utf8"

	pb "github.com/atomlog/atomlog/clients/go/gen/atomlog/v1"
)

// Partitioner places records that name no partition.
type Partitioner int

const (
	// PartitionSticky: keyed records by CRC32C(key) % partitions; keyless records fill
	// one partition's batch, then move on (the default).
	PartitionSticky Partitioner = iota
	// PartitionRoundRobin: keyed records by key; keyless records one partition after another.
	PartitionRoundRobin
)

// ProducerOptions of NewProducer; zero values mean the defaults.
type ProducerOptions struct {
	// TransactionalID makes a Kafka-style session: the producer id and epoch come from
	// InitProducerId on the id's TC partition, which fences any older producer with the
	// same id (aborting its open transaction); BeginTxn opens transactions bound to it.
	TransactionalID string
	// TransactionTimeout is the session's default transaction timeout (default 60 s).
	TransactionTimeout time.Duration
	// Linger is how long a batch waits for more records (default 5 ms; negative: none).
	Linger time.Duration
	// BatchMaxBytes bounds a batch's records (default 256 KiB, at most 1 MiB - 4 KiB:
	// the servers' partition.max_batch_bytes is 1 MiB by default).
	BatchMaxBytes int
	// MaxInFlight batches per partition sent and unanswered, 1..5 (default 5).
	MaxInFlight int
	// DeliveryTimeout bounds the retries of a batch (default 120 s); then its records
	// fail with REQUEST_TIMED_OUT (outcome unknown).
	DeliveryTimeout time.Duration
	// Compression of the batches' Arrow buffers (default none).
	Compression Compression
	// MaxBufferedBytes bounds the records waiting to be acknowledged (default 64 MiB):
	// Send blocks while the buffer is full.
	MaxBufferedBytes int
	// Partitioner for records sent without ToPartition.
	Partitioner Partitioner
}

const (
	maxRequestBytes = 8 << 20
	recordOverhead  = 24 // Arrow offsets, timestamp and validity per record, roughly
	headerOverhead  = 8
	batchOverhead   = 4 << 10 // header + Arrow metadata stay below this
)

var (
	retriableItemReasons = map[string]bool{
		ReasonNotPartitionOwner: true, ReasonUnknownTopicOrPartition: true,
		ReasonPartitionLoading: true, ReasonServerUnavailable: true, ReasonRequestTimedOut: true,
		ReasonShuttingDown: true, ReasonResourceExhausted: true, ReasonZooKeeperUnavailable: true,
		// the ISR short of min.insync.replicas (nothing was written)
		ReasonNotEnoughReplicas: true,
		// a transactional write being verified with its coordinator
		ReasonConcurrentTransactions: true, ReasonCoordinatorLoading: true, ReasonNotCoordinator: true,
	}
	sequenceRefusals = map[string]bool{ReasonOutOfOrderSequence: true, ReasonUnknownProducerID: true}
	// Refusals that prove nothing of the batch was appended.
	definitelyNotWritten = map[string]bool{
		ReasonBatchTooLarge: true, ReasonCorruptBatch: true, ReasonCRCMismatch: true,
		ReasonInvalidArgument: true, ReasonUnimplemented: true, ReasonDataLoss: true,
		ReasonOffsetOutOfRange: true, ReasonTransactionNotOpen: true, ReasonTransactionAborted: true,
		ReasonTransactionTimedOut: true, ReasonPartitionNotInTransaction: true,
		ReasonUnknownTransaction: true,
	}
	// Of definitelyNotWritten, the ones a server answers without looking for an earlier
	// attempt of the batch (the others come after its producer state told a retry of a
	// written batch, answered as the duplicate it is, from a new one): a partition in
	// DATA_LOSS has no log to look in, and its copy may come back holding an earlier,
	// unanswered attempt.
	uncheckedRefusals = map[string]bool{ReasonDataLoss: true}
	// Answers that prove the attempt they answer appended nothing (refused before any
	// write). Any other failure (no answer, a timeout, a leadership lost while the write
	// waited for its copies, a closing partition) leaves the attempt possibly written.
	refusedUnwritten = func() map[string]bool {
		m := map[string]bool{
			ReasonPartitionLoading: true, ReasonUnknownTopicOrPartition: true,
			ReasonConcurrentTransactions: true, ReasonCoordinatorLoading: true,
			ReasonNotCoordinator: true,
		}
		for r := range definitelyNotWritten {
			m[r] = true
		}
		for r := range sequenceRefusals {
			m[r] = true
		}
		return m
	}()
)

// RecordMetadata says where a record was written.
type RecordMetadata struct {
	Topic         string
	Partition     int32
	Offset        int64
	LogAppendTime time.Time
}

// outcome is what happened to one batch, shared by its records' futures.
type outcome struct {
	done       chan struct{}
	baseOffset int64
	appendMs   int64
	err        error
}

// Future is the outcome of one Send.
type Future struct {
	tp    TopicPartition
	o     *outcome
	index int
}

// Done is closed once the record is acknowledged or has failed.
func (f *Future) Done() <-chan struct{} { return f.o.done }

// Wait returns where the record was written, or why it was not. A REQUEST_TIMED_OUT
// error means its fate is unknown (the DeliveryTimeout passed).
func (f *Future) Wait(ctx context.Context) (RecordMetadata, error) {
	select {
	case <-f.o.done:
	case <-ctx.Done():
		return RecordMetadata{}, ctx.Err()
	}
	if f.o.err != nil {
		return RecordMetadata{}, f.o.err
	}
	return RecordMetadata{Topic: f.tp.Topic, Partition: f.tp.Partition,
		Offset: f.o.baseOffset + int64(f.index), LogAppendTime: time.UnixMilli(f.o.appendMs)}, nil
}

type batch struct {
	tp         TopicPartition
	records    []Record
	size       int
	txn        *Txn
	o          *outcome
	fields     BatchFields
	sequenced  bool // fields hold the batch's producer id, epoch and sequence
	payload    []byte
	attempts   int // sends under its current sequence numbers
	sends      int // every send, never reset: tells a stale answer from the last one
	notBefore  time.Time
	deadline   time.Time
	sentBehind bool // sent while an earlier batch of the partition was unanswered
	finished   bool
	// An attempt under its current sequence numbers failed without proof that nothing was
	// appended (refusedUnwritten): it may be written, so its sequence numbers are never
	// handed to other records.
	maybeWritten bool
}

type partState struct {
	open      []Record
	openTxn   *Txn
	openBytes int
	openOut   *outcome
	openedAt  time.Time
	ready     []*batch // sealed, waiting to be sent (in sequence order once sequenced)
	inFlight  []*batch // sent, unanswered, in sequence order
	// window: every batch sent since the oldest one not yet acknowledged, in sequence
	// order, acknowledged ones included. The server recognises a retry only among a
	// producer's last 5 batches on the partition, so a new batch goes out only while
	// this holds fewer than MaxInFlight: else a batch whose answer was lost could fall
	// out of the server's memory before its retry arrives (and be refused as out of
	// order although it was written).
	window     []*batch
	hasID      bool
	producerID int64
	epoch      uint16
	nextSeq    int32
	needNewID  bool // an outcome is unknown: a fresh producer id before the next batch
}

type completion struct {
	b       *batch
	attempt int // which send of the batch this answers
	err     error
	result  *pb.ProduceResult
}

// Producer is an idempotent (and, with a TransactionalID, transactional) producer.
// Safe for concurrent use.
type Producer struct {
	c    *Client
	opts ProducerOptions

	mu          sync.Mutex
	changed     chan struct{} // closed and replaced on every change (waiters)
	wake        chan struct{}
	parts       map[TopicPartition]*partState
	sticky      map[string]int32
	rr          uint64
	buffered    int
	unfinished  int
	completions []completion
	closed      bool
	stopped     chan struct{}

	producerID  int64
	epoch       uint16
	session     *pb.TransactionalSession
	sessionTC   uint32
	fenced      bool
	needsReinit bool

	stats ProducerStats
}

// ProducerStats counts what the producer did, for monitoring and tests.
type ProducerStats struct {
	// Batches acknowledged, and records in them.
	Batches, Records int
	// Retries: batches sent again, by the reason of the failure that made them resend.
	Retries map[string]int
	// Failed batches, by reason.
	Failed map[string]int
}

// Stats is a copy of the producer's counters.
func (p *Producer) Stats() ProducerStats {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := ProducerStats{Batches: p.stats.Batches, Records: p.stats.Records,
		Retries: map[string]int{}, Failed: map[string]int{}}
	for k, v := range p.stats.Retries {
		out.Retries[k] = v
	}
	for k, v := range p.stats.Failed {
		out.Failed[k] = v
	}
	return out
}

// NewProducer makes a producer: a fresh producer id from a coordinator, or with
// TransactionalID the session's (fencing older producers of that id).
func (c *Client) NewProducer(ctx context.Context, opts ProducerOptions) (*Producer, error) {
	if opts.Linger == 0 {
		opts.Linger = 5 * time.Millisecond
	}
	if opts.BatchMaxBytes == 0 {
		opts.BatchMaxBytes = 256 << 10
	}
	if opts.BatchMaxBytes < 1024 || opts.BatchMaxBytes > 1<<20-batchOverhead {
		return nil, errorf(ReasonInvalidArgument, "BatchMaxBytes must be 1024 .. %d", 1<<20-batchOverhead)
	}
	if opts.MaxInFlight == 0 {
		opts.MaxInFlight = 5
	}
	if opts.MaxInFlight < 1 || opts.MaxInFlight > 5 {
		return nil, errorf(ReasonInvalidArgument, "MaxInFlight must be 1..5 (servers de-duplicate the last 5 batches)")
	}
	if opts.DeliveryTimeout == 0 {
		opts.DeliveryTimeout = 120 * time.Second
	}
	if opts.MaxBufferedBytes == 0 {
		opts.MaxBufferedBytes = 64 << 20
	}
	if opts.TransactionTimeout == 0 {
		opts.TransactionTimeout = 60 * time.Second
	}
	if opts.TransactionTimeout < time.Millisecond || opts.TransactionTimeout.Milliseconds() > 1<<32-1 {
		// (Sent as uint32 milliseconds: under 1 ms became the server's default, 60 s; past
		// 49.7 days it wrapped around.)
		return nil, errorf(ReasonInvalidTransactionTimeout, "TransactionTimeout %s", opts.TransactionTimeout)
	}
	if opts.Compression < CompressionNone || opts.Compression > CompressionLZ4 {
		return nil, errorf(ReasonInvalidArgument, "unknown compression %d", opts.Compression)
	}
	p := &Producer{c: c, opts: opts, changed: make(chan struct{}), wake: make(chan struct{}, 1),
		parts: map[TopicPartition]*partState{}, sticky: map[string]int32{},
		stopped: make(chan struct{})}
	if opts.TransactionalID != "" {
		if err := p.initSession(ctx); err != nil {
			return nil, err
		}
	} else {
		id, epoch, err := c.allocateProducerID(ctx)
		if err != nil {
			return nil, err
		}
		p.producerID, p.epoch = id, epoch
	}
	go p.run()
	return p, nil
}

// ProducerID and Epoch the producer writes with (a partition may have rotated to a
// fresh id after an unknown outcome).
func (p *Producer) ProducerID() (int64, uint16) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.producerID, p.epoch
}

// ------------------------------------------------------------------- sessions

// initSession is InitProducerId for the transactional id on its TC partition: a new
// epoch that fences any older session of the id and aborts its open transaction.
func (p *Producer) initSession(ctx context.Context) error {
	count, err := p.c.tcPartitionCount(ctx)
	if err != nil {
		return err
	}
	tc := TCPartitionFor(p.opts.TransactionalID, count)
	request := &pb.InitProducerIdRequest{TransactionalId: p.opts.TransactionalID,
		TransactionTimeoutMs: uint32(p.opts.TransactionTimeout.Milliseconds())}
	if p.session != nil {
		request.ProducerId, request.ProducerEpoch = p.session.ProducerId, p.session.ProducerEpoch
	}
	var reply *pb.InitProducerIdResponse
	err = p.c.coordinatorCall(ctx, tc, func(actx context.Context, stub pb.CoordinatorServiceClient) (err error) {
		reply, err = stub.InitProducerId(actx, request)
		return err
	})
	if err != nil {
		if errors.Is(err, ErrProducerFenced) {
			p.mu.Lock()
			p.fenced = true
			p.mu.Unlock()
		}
		return err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.producerID, p.epoch = reply.GetProducerId(), uint16(reply.GetProducerEpoch())
	p.sessionTC = tc
	p.session = &pb.TransactionalSession{TransactionalId: p.opts.TransactionalID,
		ProducerId: reply.GetProducerId(), ProducerEpoch: reply.GetProducerEpoch()}
	return nil
}

// BeginTxn opens a transaction of this producer's session (TransactionalID producers
// only). A session has at most one undecided transaction: end the previous one first.
// opts.Timeout 0 is the session's TransactionTimeout.
// reinit: an earlier write's outcome is unknown, or a partition's sequences broke: a
// new epoch of the same session makes every partition start its sequences afresh
// (KIP-360's epoch bump). At the next BeginTxn, or the next send outside a transaction
// (until 2026-12-06 such sends went on with the broken sequences, each refused).
func (p *Producer) reinit(ctx context.Context) error {
	if err := p.Flush(ctx); err != nil {
		return err
	}
	if err := p.initSession(ctx); err != nil {
		return err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, st := range p.parts {
		st.hasID, st.nextSeq = false, 0
	}
	p.needsReinit = false
	return nil
}

func (p *Producer) BeginTxn(ctx context.Context, opts TxnOptions) (*Txn, error) {
	timeout, waitForMarkers := opts.Timeout, opts.WaitForMarkers
	p.mu.Lock()
	session, fenced, reinit := p.session, p.fenced, p.needsReinit
	p.mu.Unlock()
	if session == nil {
		return nil, errorf(ReasonInvalidArgument, "BeginTxn needs a producer with a TransactionalID; "+
			"otherwise use Client.BeginTxn")
	}
	if fenced {
		return nil, newError(ReasonProducerFenced, fmt.Sprintf("transactional id %q was taken over by a "+
			"newer producer; make a new one", p.opts.TransactionalID), nil)
	}
	if reinit {
		if err := p.reinit(ctx); err != nil {
			return nil, err
		}
		p.mu.Lock()
		session = p.session
		p.mu.Unlock()
	}
	if timeout == 0 {
		timeout = p.opts.TransactionTimeout
	}
	return p.c.newTxn(ctx, TxnOptions{Timeout: timeout, WaitForMarkers: waitForMarkers}, session, p)
}

func (p *Producer) noteFenced() {
	p.mu.Lock()
	p.fenced = true
	p.mu.Unlock()
}

// ------------------------------------------------------------------- sending

// SendOption adjusts one Send.
type SendOption func(*sendOptions)

type sendOptions struct {
	partition int32
	txn       *Txn
}

// ToPartition sends the record to this partition instead of the partitioner's choice.
func ToPartition(partition int32) SendOption {
	return func(o *sendOptions) { o.partition = partition }
}

// InTxn makes the record part of a transaction: visible to read_committed readers only
// once it commits (Commit waits for it).
func InTxn(txn *Txn) SendOption { return func(o *sendOptions) { o.txn = txn } }

func recordSize(r Record) int {
	size := recordOverhead + len(r.Key) + len(r.Value)
	for _, h := range r.Headers {
		size += len(h.Key) + len(h.Value) + headerOverhead
	}
	return size
}

// Send queues one record and returns its future. It blocks while MaxBufferedBytes are
// waiting (until ctx ends). Errors here mean nothing was queued.
func (p *Producer) Send(ctx context.Context, topic string, record Record, options ...SendOption) (*Future, error) {
	o := sendOptions{partition: -1}
	for _, option := range options {
		option(&o)
	}
	for _, h := range record.Headers {
		if !utf8.ValidString(h.Key) {
			return nil, errorf(ReasonInvalidArgument, "header key %q is not UTF-8", h.Key)
		}
	}
	size := recordSize(record)
	if size > p.opts.BatchMaxBytes {
		return nil, errorf(ReasonBatchTooLarge, "a record of about %d bytes does not fit a batch of %d bytes "+
			"(BatchMaxBytes)", size, p.opts.BatchMaxBytes)
	}
	count, err := p.c.Partitions(ctx, topic)
	if err != nil {
		return nil, err
	}
	if o.partition >= int32(count) {
		return nil, errorf(ReasonUnknownTopicOrPartition, "topic %q has %d partitions; no partition %d",
			topic, count, o.partition)
	}
	if o.txn != nil {
		if err := o.txn.accepting(p); err != nil {
			return nil, err
		}
	} else {
		p.mu.Lock()
		reinit := p.needsReinit && p.session != nil
		p.mu.Unlock()
		if reinit {
			if err := p.reinit(ctx); err != nil {
				return nil, err
			}
		}
	}
	if o.partition < 0 && record.Key != nil {
		o.partition = int32(CRC32C(record.Key) % uint32(count))
	}
	if record.Timestamp.IsZero() {
		record.Timestamp = time.Now()
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.waitForRoom(ctx, size); err != nil {
		return nil, err
	}
	if o.partition < 0 {
		if p.opts.Partitioner == PartitionRoundRobin {
			o.partition = int32(p.rr % uint64(count))
			p.rr++
		} else {
			sticky, ok := p.sticky[topic]
			if !ok || sticky >= int32(count) {
				sticky = int32(p.rr % uint64(count))
				p.rr++
				p.sticky[topic] = sticky
			}
			o.partition = sticky
		}
	}
	tp := TopicPartition{Topic: topic, Partition: o.partition}
	st := p.parts[tp]
	if st == nil {
		st = &partState{}
		p.parts[tp] = st
	}
	if len(st.open) > 0 && (st.openTxn != o.txn || st.openBytes+size > p.opts.BatchMaxBytes) {
		p.seal(tp, st)
	}
	if len(st.open) == 0 {
		st.openedAt = time.Now()
		st.openOut = &outcome{done: make(chan struct{})}
		st.openTxn = o.txn
		if o.txn != nil {
			o.txn.track(p, st.openOut)
		}
	}
	future := &Future{tp: tp, o: st.openOut, index: len(st.open)}
	st.open = append(st.open, record)
	st.openBytes += size
	p.buffered += size
	p.unfinished++
	if st.openBytes >= p.opts.BatchMaxBytes || p.opts.Linger < 0 {
		p.seal(tp, st)
	}
	p.signal()
	return future, nil
}

// waitForRoom blocks (lock held, released while waiting) until size more bytes fit.
func (p *Producer) waitForRoom(ctx context.Context, size int) error {
	for p.buffered > 0 && p.buffered+size > p.opts.MaxBufferedBytes {
		if p.closed {
			return errorf(ReasonInvalidArgument, "the producer is closed")
		}
		changed := p.changed
		p.mu.Unlock()
		select {
		case <-changed:
		case <-ctx.Done():
			p.mu.Lock()
			return ctx.Err()
		}
		p.mu.Lock()
	}
	if p.closed {
		return errorf(ReasonInvalidArgument, "the producer is closed")
	}
	return nil
}

// Flush sends everything now and waits until every record sent so far is acknowledged
// or failed (failures are in the futures).
func (p *Producer) Flush(ctx context.Context) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	for tp, st := range p.parts {
		p.seal(tp, st)
	}
	p.signal()
	for p.unfinished > 0 {
		changed := p.changed
		p.mu.Unlock()
		select {
		case <-changed:
		case <-ctx.Done():
			p.mu.Lock()
			return ctx.Err()
		}
		p.mu.Lock()
	}
	return nil
}

// flushTxn seals the open batches of a transaction (its commit is about to wait).
func (p *Producer) flushTxn(t *Txn) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for tp, st := range p.parts {
		if len(st.open) > 0 && st.openTxn == t {
			p.seal(tp, st)
		}
	}
	p.signal()
}

// dropTxn fails the batches of an aborted transaction that were never sent (no
// sequence numbers given yet), so they are not sent for nothing.
func (p *Producer) dropTxn(t *Txn, err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for tp, st := range p.parts {
		if len(st.open) > 0 && st.openTxn == t {
			p.seal(tp, st)
		}
		kept := st.ready[:0]
		for _, b := range st.ready {
			if b.txn == t && !b.sequenced {
				p.finish(b, 0, 0, err)
				continue
			}
			kept = append(kept, b)
		}
		st.ready = kept
	}
	p.signal()
}

// Close flushes (bounded by ctx) and stops the sender.
func (p *Producer) Close(ctx context.Context) error {
	err := p.Flush(ctx)
	p.mu.Lock()
	if !p.closed {
		p.closed = true
		close(p.changed)
		p.changed = make(chan struct{})
	}
	p.mu.Unlock()
	p.signal()
	select {
	case <-p.stopped:
	case <-ctx.Done():
		if err == nil {
			err = ctx.Err()
		}
	}
	return err
}

// ------------------------------------------------------------------- sender (lock held)

func (p *Producer) signal() {
	select {
	case p.wake <- struct{}{}:
	default:
	}
}

func (p *Producer) notify() {
	close(p.changed)
	p.changed = make(chan struct{})
}

func (p *Producer) seal(tp TopicPartition, st *partState) {
	if len(st.open) == 0 {
		return
	}
	b := &batch{tp: tp, records: st.open, size: st.openBytes, txn: st.openTxn, o: st.openOut,
		deadline: st.openedAt.Add(p.opts.DeliveryTimeout)}
	st.open, st.openBytes, st.openTxn, st.openOut = nil, 0, nil, nil
	st.ready = append(st.ready, b)
	if p.sticky[tp.Topic] == tp.Partition {
		delete(p.sticky, tp.Topic) // the next keyless record moves on
	}
}

func (p *Producer) finish(b *batch, baseOffset, appendMs int64, err error) {
	if b.finished {
		return
	}
	b.finished = true
	if err == nil {
		p.stats.Batches++
		p.stats.Records += len(b.records)
	} else {
		if p.stats.Failed == nil {
			p.stats.Failed = map[string]int{}
		}
		p.stats.Failed[reasonOrOther(err)]++
	}
	b.o.baseOffset, b.o.appendMs, b.o.err = baseOffset, appendMs, err
	close(b.o.done)
	p.buffered -= b.size
	p.unfinished -= len(b.records)
	p.notify()
}

func remove(list []*batch, b *batch) []*batch {
	for i, x := range list {
		if x == b {
			return append(list[:i], list[i+1:]...)
		}
	}
	return list
}

func (st *partState) discard(b *batch) {
	st.inFlight = remove(st.inFlight, b)
	st.ready = remove(st.ready, b)
	st.trimWindow()
}

// trimWindow drops the window's acknowledged (or failed) batches up to the first that
// is not.
func (st *partState) trimWindow() {
	for len(st.window) > 0 && st.window[0].finished {
		st.window = st.window[1:]
	}
}

// forget takes batches whose sequence numbers are given up (renumbered, or failed with
// the partition's producer id) out of the window.
func (st *partState) forget(batches []*batch) {
	for _, b := range batches {
		st.window = remove(st.window, b)
	}
	st.trimWindow()
}

// registrations: transactional batches at the head of a partition whose partition is
// not registered with their transaction yet (NewTxn or AddPartitionToTxn comes first).
type registration struct {
	txn *Txn
	tps []TopicPartition
}

// sendable pops the batches to send now, giving each its producer id, epoch and
// sequence numbers; it stops at a transactional batch whose partition is not yet
// registered with its transaction and returns those registrations instead.
func (p *Producer) sendable(now time.Time) (out []*batch, regs map[*Txn][]TopicPartition, ids []*partState) {
	regs = map[*Txn][]TopicPartition{}
	for tp, st := range p.parts {
		for len(st.ready) > 0 && len(st.inFlight) < p.opts.MaxInFlight && !st.ready[0].notBefore.After(now) {
			b := st.ready[0]
			if b.attempts > 0 && len(st.inFlight) > 0 {
				break // a retry goes out alone, after everything before it is answered
			}
			if b.attempts == 0 && len(st.window) >= p.opts.MaxInFlight {
				break
			}
			if b.txn != nil && !b.txn.registered(tp) {
				regs[b.txn] = append(regs[b.txn], tp)
				break
			}
			if !b.sequenced {
				if st.needNewID {
					// A fresh producer id only once everything sent under the old one is
					// answered: the server would otherwise take the new id's batches
					// ahead of the old one's still on their way (send order lost).
					if len(st.inFlight) == 0 && len(st.window) == 0 {
						ids = append(ids, st)
					}
					break
				}
				if !st.hasID {
					st.hasID, st.producerID, st.epoch, st.nextSeq = true, p.producerID, p.epoch, 0
				}
				if int64(st.nextSeq)+int64(len(b.records)) > math.MaxInt32 {
					st.needNewID = true // sequences may not wrap: rotate to a fresh id
					break
				}
				b.fields = BatchFields{ProducerID: st.producerID, ProducerEpoch: st.epoch,
					BaseSequence: st.nextSeq, Compression: p.opts.Compression}
				if b.txn != nil {
					b.fields.Txn = b.txn.idIfOpen()
				}
				b.sequenced = true
				b.payload = nil
				st.nextSeq += int32(len(b.records))
			}
			st.ready = st.ready[1:]
			if b.attempts == 0 {
				st.window = append(st.window, b)
			}
			b.sentBehind = len(st.inFlight) > 0

			st.inFlight = append(st.inFlight, b)
			out = append(out, b)
		}
	}
	return out, regs, ids
}

func (p *Producer) nextWake(now time.Time) time.Duration {
	wake := time.Second
	for _, st := range p.parts {
		if len(st.open) > 0 {
			wake = min(wake, st.openedAt.Add(p.opts.Linger).Sub(now))
		}
		if len(st.ready) > 0 && !p.waitsForAnswers(st) {
			wake = min(wake, st.ready[0].notBefore.Sub(now))
		}
	}
	return max(wake, 500*time.Microsecond)
}

// waitsForAnswers: the partition's next batch may go out only after answers to what
// is in flight (an answer wakes the sender; no timer is needed).
func (p *Producer) waitsForAnswers(st *partState) bool {
	b := st.ready[0]
	return len(st.inFlight) >= p.opts.MaxInFlight ||
		(b.attempts > 0 && len(st.inFlight) > 0) ||
		(b.attempts == 0 && len(st.window) >= p.opts.MaxInFlight) ||
		(!b.sequenced && st.needNewID && (len(st.inFlight) > 0 || len(st.window) > 0))
}

func (p *Producer) sealLingering(now time.Time) {
	for tp, st := range p.parts {
		if len(st.open) > 0 && now.Sub(st.openedAt) >= p.opts.Linger {
			p.seal(tp, st)
		}
	}
}

func (p *Producer) run() {
	defer close(p.stopped)
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for {
		p.mu.Lock()
		p.drainCompletions()
		now := time.Now()
		p.sealLingering(now)
		out, regs, ids := p.sendable(now)
		if p.closed && p.unfinished == 0 && len(out) == 0 {
			p.mu.Unlock()
			return
		}
		wait := p.nextWake(now)
		p.mu.Unlock()
		if len(regs) > 0 || len(ids) > 0 {
			p.register(regs)
			p.rotate(ids)
		}
		if len(out) > 0 {
			p.send(out)
		}
		if len(out) > 0 || len(regs) > 0 || len(ids) > 0 {
			continue
		}
		timer.Reset(wait)
		select {
		case <-p.wake:
			timer.Stop()
		case <-timer.C:
		}
	}
}

// register adds partitions to their transactions (one call per transaction); a failure
// fails the transaction's unsent batches of those partitions.
func (p *Producer) register(regs map[*Txn][]TopicPartition) {
	for txn, tps := range regs {
		ctx, cancel := context.WithTimeout(context.Background(), p.c.opts.RequestTimeout)
		err := txn.register(ctx, tps, nil)
		cancel()
		if err == nil {
			continue
		}
		p.mu.Lock()
		for _, tp := range tps {
			st := p.parts[tp]
			kept := st.ready[:0]
			for _, b := range st.ready {
				if b.txn == txn && !b.sequenced {
					p.finish(b, 0, 0, err)
					continue
				}
				kept = append(kept, b)
			}
			st.ready = kept
		}
		p.mu.Unlock()
	}
}

// rotate gives partitions that need one a fresh producer id from a coordinator.
func (p *Producer) rotate(states []*partState) {
	for _, st := range states {
		ctx, cancel := context.WithTimeout(context.Background(), p.c.opts.RequestTimeout)
		id, epoch, err := p.c.allocateProducerID(ctx)
		cancel()
		p.mu.Lock()
		if err == nil {
			st.hasID, st.producerID, st.epoch, st.nextSeq, st.needNewID = true, id, epoch, 0, false
		} else {
			// No coordinator now: the waiting batches fail when their time is up.
			now := time.Now()
			for _, b := range append([]*batch{}, st.ready...) {
				if !now.Before(b.deadline) {
					st.discard(b)
					p.finish(b, 0, 0, fmt.Errorf("no fresh producer id for %s: %w", b.tp, err))
				}
			}
		}
		p.mu.Unlock()
	}
}

// send frames the batches and sends them, grouped per server: the k-th batch of each
// partition in the k-th request, each request at most maxRequestBytes.
func (p *Producer) send(batches []*batch) {
	ctx := context.Background()
	byAddress := map[string][]*batch{}
	var failed []completion
	for _, b := range batches {
		b.attempts++
		b.sends++
		if b.payload == nil {
			if b.txn != nil && b.fields.Txn.IsZero() {
				b.fields.Txn = b.txn.idIfOpen()
			}
			payload, err := EncodeColumnBatch(b.records, b.fields)
			if err != nil {
				failed = append(failed, completion{b: b, attempt: b.sends, err: err})
				continue
			}
			b.payload = payload
		}
		address, err := p.c.owner(ctx, b.tp)
		if err != nil {
			failed = append(failed, completion{b: b, attempt: b.sends, err: err})
			continue
		}
		byAddress[address] = append(byAddress[address], b)
	}
	for address, group := range byAddress {
		stub, err := p.c.partitionStub(address)
		if err != nil {
			for _, b := range group {
				failed = append(failed, completion{b: b, attempt: b.sends, err: err})
			}
			continue
		}
		for _, request := range requests(group) {
			// What the call needs is taken here, in the sender: the batches' fields may
			// change under the producer's lock while the call is on its way.
			attempts := make([]int, len(request))
			items := make([]*pb.ProduceItem, len(request))
			for i, b := range request {
				attempts[i] = b.sends
				items[i] = &pb.ProduceItem{TopicPartition: b.tp.proto(), RecordBatch: b.payload}
			}
			produce := &pb.ProduceRequest{Items: items}
			// On the server's link, written here in send order (pipeline.go); over
			// gRPC when it has none or it cannot be used.
			if call, ok := p.c.produceOn(address, produce); ok {
				go p.answered(address, request, attempts, call)
				continue
			}
			go p.produce(stub, request, produce, attempts)
		}
	}
	if len(failed) > 0 {
		p.mu.Lock()
		p.completions = append(p.completions, failed...)
		p.mu.Unlock()
		p.signal()
	}
}

func requests(batches []*batch) [][]*batch {
	var rounds [][]*batch
	seen := map[TopicPartition]int{}
	for _, b := range batches {
		k := seen[b.tp]
		seen[b.tp] = k + 1
		if k == len(rounds) {
			rounds = append(rounds, nil)
		}
		rounds[k] = append(rounds[k], b)
	}
	var out [][]*batch
	for _, round := range rounds {
		var group []*batch
		size := 0
		for _, b := range round {
			if len(group) > 0 && size+len(b.payload) > maxRequestBytes {
				out = append(out, group)
				group, size = nil, 0
			}
			group = append(group, b)
			size += len(b.payload)
		}
		out = append(out, group)
	}
	return out
}

func (p *Producer) produce(stub pb.PartitionServiceClient, group []*batch, request *pb.ProduceRequest, attempts []int) {
	ctx, cancel := context.WithTimeout(context.Background(), p.c.opts.RequestTimeout)
	reply, err := stub.Produce(ctx, request)
	cancel()
	p.complete(group, attempts, reply, err)
}

// answered waits for a Produce call on a link's pipeline.
func (p *Producer) answered(address string, group []*batch, attempts []int, call *pipelinedCall) {
	reply := &pb.ProduceResponse{}
	if err := call.wait(address, reply); err != nil {
		p.complete(group, attempts, nil, err)
		return
	}
	p.complete(group, attempts, reply, nil)
}

// complete queues each batch's outcome of a Produce call for the sender.
func (p *Producer) complete(group []*batch, attempts []int, reply *pb.ProduceResponse, err error) {
	err = fromRPC(context.Background(), err)
	results := make([]completion, len(group))
	for i, b := range group {
		results[i] = completion{b: b, attempt: attempts[i], err: err}
	}
	if err == nil {
		if len(reply.GetResults()) != len(group) {
			err = errorf(ReasonInternal, "the server answered %d results for %d batches",
				len(reply.GetResults()), len(group))
			for i := range results {
				results[i].err = err
			}
		} else {
			for i, result := range reply.GetResults() {
				if e := itemError(result.GetError()); e != nil {
					results[i].err = e
				} else {
					results[i].result = result
				}
			}
		}
	}
	p.mu.Lock()
	p.completions = append(p.completions, results...)
	p.mu.Unlock()
	p.signal()
}

func (p *Producer) drainCompletions() {
	completions := p.completions
	p.completions = nil
	refresh := map[string]bool{}
	for _, c := range completions {
		b := c.b
		if b.finished {
			continue // failed for good already; a late answer changes nothing
		}
		if c.err != nil && c.attempt != b.sends {
			// The failure of an earlier send of a batch sent again since: the last
			// send's answer decides (a success of any send stands: it was written).
			continue
		}
		st := p.parts[b.tp]
		if c.err == nil {
			p.finish(b, c.result.GetBaseOffset(), c.result.GetLogAppendTimeUnixMs(), nil)
			st.discard(b)
			continue
		}
		if isRoutingError(c.err) {
			refresh[b.tp.Topic] = true
		}
		p.handleFailure(b, st, c.err)
	}
	for topic := range refresh {
		p.c.invalidate(topic)
	}
}

func reasonOrOther(err error) string {
	if reason := Reason(err); reason != "" {
		return reason
	}
	return "OTHER"
}

func indexOf(list []*batch, b *batch) int {
	for i, x := range list {
		if x == b {
			return i
		}
	}
	return -1
}

func (p *Producer) handleFailure(b *batch, st *partState, err error) {
	index := indexOf(st.inFlight, b)
	if index < 0 {
		return // rewound by an earlier failure: it is queued to be sent again
	}
	reason := Reason(err)
	now := time.Now()
	if !refusedUnwritten[reason] {
		b.maybeWritten = true
	}
	retriable := retriableItemReasons[reason] ||
		(sequenceRefusals[reason] && (index > 0 || b.sentBehind))

	if retriable && now.Before(b.deadline) {
		if p.stats.Retries == nil {
			p.stats.Retries = map[string]int{}
		}
		p.stats.Retries[reason]++
		// Send this batch and every later one of the partition again, in order: at once
		// when it only overtook an earlier batch (it goes out when that one is answered),
		// else after a backoff.
		later := append([]*batch{}, st.inFlight[index:]...)
		st.inFlight = st.inFlight[:index]
		for _, l := range later[1:] { // sent, and their answers no longer awaited
			l.maybeWritten = true
		}
		delay := time.Duration(0)
		if !sequenceRefusals[reason] {
			backoff := newBackoff(20*time.Millisecond, time.Second)
			for range b.attempts - 1 {
				backoff.next()
			}
			delay = backoff.next()
		}
		for _, l := range later {
			l.notBefore = now.Add(delay)
		}
		st.ready = append(later, st.ready...)
		return
	}
	switch {
	case retriable: // out of time: the outcome of this batch is unknown
		p.abandonPartition(st, b, &Error{Reason: ReasonRequestTimedOut, Code: ErrRequestTimedOut.Code,
			Message: fmt.Sprintf("%d records to %s not acknowledged within %s; they may or may not "+
				"have been written. Last error: %v", len(b.records), b.tp, p.opts.DeliveryTimeout, err)})
	case definitelyNotWritten[reason] && !(b.maybeWritten && uncheckedRefusals[reason]):
		p.finish(b, 0, 0, err)
		st.discard(b)
		p.resequenceAfter(b, st)
	case definitelyNotWritten[reason]:
		// The refusal proves only that this attempt wrote nothing (uncheckedRefusals). An
		// earlier one failed unanswered and may have been written: its sequence numbers
		// must never be handed to other records, or a later batch would be answered as a
		// duplicate of these and never written (found by the chaos harness: log workload,
		// seed 2924, misplace).
		message, metadata := err.Error(), map[string]string(nil)
		if e, ok := err.(*Error); ok {
			message, metadata = e.Message, e.Metadata
		}
		p.abandonPartition(st, b, newError(reason, fmt.Sprintf("%s; an earlier attempt of these "+
			"%d records got no answer, so they may or may not have been written",
			message, len(b.records)), metadata))
	case reason == ReasonUnknownProducerID && now.Before(b.deadline) && p.resetIdentity(b, st):
		// sent again under a fresh producer id (resetIdentity)
	default: // the server lost or refuses this producer's state (fenced, out of order)
		if reason == ReasonProducerFenced && p.session != nil {
			p.fenced = true
		}
		p.abandonPartition(st, b, err)
	}
}

// resetIdentity: UNKNOWN_PRODUCER_ID for the oldest unanswered batch of a partition, so
// the partition forgot this producer (idle past its expiry, or a new leader whose log
// start had passed the producer's last batch). When no attempt of that batch or of any
// batch after it may have been written (and no session or transaction binds them to
// the id), they are sent again under a fresh producer id from sequence 0 (Kafka's
// KIP-360 reset), as the Python SDK does; else false: they fail.
func (p *Producer) resetIdentity(b *batch, st *partState) bool {
	if p.session != nil {
		return false
	}
	batches := []*batch{b}
	for _, x := range append(append([]*batch{}, st.inFlight...), st.ready...) {
		if x != b && x.sequenced && x.fields.BaseSequence > b.fields.BaseSequence {
			batches = append(batches, x)
		}
	}
	for _, x := range batches {
		if x.txn != nil || x.maybeWritten {
			return false
		}
	}
	sort.Slice(batches, func(i, j int) bool {
		return batches[i].fields.BaseSequence < batches[j].fields.BaseSequence
	})
	for _, x := range batches {
		st.inFlight = remove(st.inFlight, x)
		st.ready = remove(st.ready, x)
		st.window = remove(st.window, x)
		x.sequenced, x.payload, x.attempts, x.sentBehind = false, nil, 0, false
	}
	st.ready = append(batches, st.ready...)
	st.needNewID = true // (once nothing of the old id is unanswered)
	return true
}

// abandonPartition fails b and every sequenced batch behind it, and gives the partition
// a fresh producer id, so nothing already sent can be confused with what comes next. A
// session keeps its producer id: its next BeginTxn bumps the epoch instead.
func (p *Producer) abandonPartition(st *partState, b *batch, err error) {
	var doomed []*batch
	for _, x := range append(append([]*batch{}, st.inFlight...), st.ready...) {
		if x == b || (x.sequenced && x.fields.BaseSequence > b.fields.BaseSequence) {
			doomed = append(doomed, x)
		}
	}
	for _, x := range doomed {
		p.finish(x, 0, 0, err)
		st.discard(x)
	}
	st.forget(doomed)
	for _, x := range st.ready {
		x.sequenced, x.payload = false, nil
	}
	if p.session != nil {
		p.needsReinit = true
		return
	}
	st.needNewID = true
}

// resequenceAfter: nothing of `failed` was written, so the batches behind it take over
// its sequence numbers, unless one of them was sent already (an attempt of it may still
// be on its way, and renumbered it would be in order again: its records twice). Then the
// partition takes a fresh producer id instead; a session fails them (their transaction
// aborts) and bumps its epoch at the next BeginTxn.
func (p *Producer) resequenceAfter(failed *batch, st *partState) {
	if !failed.sequenced {
		return
	}
	var later []*batch
	for _, x := range append(append([]*batch{}, st.inFlight...), st.ready...) {
		if x.sequenced && x.fields.BaseSequence > failed.fields.BaseSequence {
			later = append(later, x)
		}
	}
	sort.Slice(later, func(i, j int) bool { return later[i].fields.BaseSequence < later[j].fields.BaseSequence })
	sent := false
	for _, x := range later {
		sent = sent || x.attempts > 0
	}
	if sent && p.session != nil {
		p.abandonPartition(st, later[0], errorf(ReasonOutOfOrderSequence,
			"a batch to %s sent before this one was refused; what was sent after it cannot be "+
				"renumbered safely", failed.tp))
		return
	}
	for _, x := range later {
		st.discard(x)
		x.sequenced, x.payload, x.notBefore = false, nil, time.Time{}
		x.attempts, x.maybeWritten = 0, false // renumbered: a new batch to the server
	}
	st.forget(later)
	if sent {
		st.needNewID = true
	} else {
		st.nextSeq = failed.fields.BaseSequence
	}
	st.ready = append(later, st.ready...)
}
