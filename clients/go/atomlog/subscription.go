package atomlog

// A consumer of a named subscription: the partition servers keep a durable cursor per
// partition, deliver each message to one consumer at a time, and redeliver what is not
// acknowledged within the ack timeout or is negatively acknowledged. An ack with a
// transaction stays pending until the transaction ends: a commit applies it, an abort
// makes the messages redeliverable — the consume side of exactly-once.

import (
	"context"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	pb "github.com/atomlog/atomlog/clients/go/gen/atomlog/v1"
)

// SubscribeOptions of Subscribe; zero values mean the defaults.
type SubscribeOptions struct {
	Isolation Isolation
	// Start places cursors this call creates (existing ones stay where they are):
	// StartEarliest (default), StartLatest, StartOffset or StartTimestamp.
	Start          Start
	StartOffset    int64
	StartTimestamp time.Time
	// AckTimeout: a delivered message not acknowledged within it is redelivered (default 30 s).
	AckTimeout time.Duration
	// MaxBytes bounds one Receive (default 8 MiB).
	MaxBytes int
	// ConsumerID names this consumer to the servers (default: random).
	ConsumerID string
}

// Subscription reads topics through a named subscription. Safe for concurrent use.
type Subscription struct {
	c          *Client
	name       string
	opts       SubscribeOptions
	partitions []TopicPartition
	consumerID string
	// Receives so far: each starts one partition further (receiveOrder).
	turns atomic.Uint64
}

// Subscribe creates the subscription's cursors on every partition of the topics (an
// existing cursor is left where it is) and returns a consumer of it.
func (c *Client) Subscribe(ctx context.Context, topics []string, name string, opts SubscribeOptions) (*Subscription, error) {
	if opts.AckTimeout == 0 {
		opts.AckTimeout = 30 * time.Second
	}
	if opts.MaxBytes == 0 {
		opts.MaxBytes = 8 << 20
	}
	if opts.ConsumerID == "" {
		opts.ConsumerID = name + "-" + randomKey()
	}
	s := &Subscription{c: c, name: name, opts: opts, consumerID: opts.ConsumerID}
	for _, topic := range topics {
		count, err := c.Partitions(ctx, topic)
		if err != nil {
			return nil, err
		}
		for p := int32(0); p < int32(count); p++ {
			s.partitions = append(s.partitions, TopicPartition{Topic: topic, Partition: p})
		}
	}
	position, timestampMs, err := positionOf(opts.Start, opts.StartTimestamp)
	if err != nil {
		return nil, err
	}
	err = callOwners(ctx, c, s.partitions, func(actx context.Context, stub pb.PartitionServiceClient,
		group []TopicPartition) ([]*pb.ItemError, error) {
		request := &pb.CreateSubscriptionRequest{InitialPosition: position, StartOffset: opts.StartOffset,
			TimestampUnixMs: timestampMs}
		for _, tp := range group {
			request.SubscriptionPartitions = append(request.SubscriptionPartitions, s.sp(tp).proto())
		}
		reply, err := stub.CreateSubscription(actx, request)
		if err != nil {
			return nil, err
		}
		return itemErrors(len(group), reply.GetResults(), func(r *pb.CreateSubscriptionResult) *pb.ItemError {
			return r.GetError()
		}), nil
	})
	if err != nil {
		return nil, err
	}
	return s, nil
}

// positionOf is a Start as the wire's position, and a time as Unix milliseconds (0
// for none).
func positionOf(start Start, at time.Time) (pb.SubscriptionInitialPosition, int64, error) {
	position, ok := map[Start]pb.SubscriptionInitialPosition{
		StartEarliest:  pb.SubscriptionInitialPosition_SUBSCRIPTION_INITIAL_POSITION_EARLIEST,
		StartLatest:    pb.SubscriptionInitialPosition_SUBSCRIPTION_INITIAL_POSITION_LATEST,
		StartOffset:    pb.SubscriptionInitialPosition_SUBSCRIPTION_INITIAL_POSITION_OFFSET,
		StartTimestamp: pb.SubscriptionInitialPosition_SUBSCRIPTION_INITIAL_POSITION_TIMESTAMP,
	}[start]
	if !ok {
		return 0, 0, errorf(ReasonInvalidArgument, "unknown start position %d", start)
	}
	var timestampMs int64
	if !at.IsZero() {
		timestampMs = at.UnixMilli()
	}
	return position, timestampMs, nil
}

func itemErrors[R any](n int, results []R, errorOf func(R) *pb.ItemError) []*pb.ItemError {
	out := make([]*pb.ItemError, n)
	for i := range out {
		if i < len(results) {
			out[i] = errorOf(results[i])
		} else {
			out[i] = &pb.ItemError{Reason: ReasonInternal, Message: "the server answered too few results"}
		}
	}
	return out
}

func (s *Subscription) sp(tp TopicPartition) subscriptionPartition {
	return subscriptionPartition{TopicPartition: tp, Subscription: s.name}
}

// Name of the subscription.
func (s *Subscription) Name() string { return s.name }

// Partitions the subscription reads.
func (s *Subscription) Partitions() []TopicPartition {
	return append([]TopicPartition{}, s.partitions...)
}

// Receive returns up to maxMessages messages delivered to this consumer, waiting up to
// maxWait for the first. Each is out to this consumer alone until it is acked, nacked
// or its ack timeout passes.
func (s *Subscription) Receive(ctx context.Context, maxWait time.Duration, maxMessages int) ([]Message, error) {
	deadline := time.Now().Add(maxWait)
	backoff := newBackoff(50*time.Millisecond, time.Second)
	var last error
	for {
		groups, failed := s.c.byOwner(ctx, s.receiveOrder())
		for tp, err := range failed {
			s.c.invalidate(tp.Topic)
			last = err
		}
		remaining := max(time.Until(deadline), 0)
		waitMs := uint32(0)
		if len(groups) == 1 {
			waitMs = uint32(remaining.Milliseconds())
		}
		share := max(1, maxMessages/max(1, len(groups)))
		var mu sync.Mutex
		var wg sync.WaitGroup
		var delivered []Message
		var fatal error
		for address, group := range groups {
			stub, err := s.c.partitionStub(address)
			if err != nil {
				return nil, err
			}
			wg.Add(1)
			go func(group []TopicPartition) {
				defer wg.Done()
				request := &pb.ReceiveRequest{ConsumerId: s.consumerID, IsolationLevel: s.opts.Isolation.proto(),
					MaxWaitMs: waitMs, MaxBytes: uint32(s.opts.MaxBytes),
					AckTimeoutMs: uint32(s.opts.AckTimeout.Milliseconds()), MaxMessages: uint32(share)}
				for _, tp := range group {
					request.SubscriptionPartitions = append(request.SubscriptionPartitions, s.sp(tp).proto())
				}
				actx, cancel := context.WithTimeout(ctx, s.c.opts.RequestTimeout+remaining)
				reply, err := stub.Receive(actx, request)
				cancel()
				err = fromRPC(ctx, err)
				mu.Lock()
				defer mu.Unlock()
				if err != nil {
					if isRoutingError(err) {
						for _, tp := range group {
							s.c.invalidate(tp.Topic)
						}
					}
					if IsRetriable(err) {
						last = err
					} else if fatal == nil {
						fatal = err
					}
					return
				}
				for _, result := range reply.GetResults() {
					if e := itemError(result.GetError()); e != nil {
						if isRoutingError(e) {
							s.c.invalidate(result.GetSubscriptionPartition().GetTopic())
						}
						if e.Retriable() {
							last = e
						} else if fatal == nil {
							fatal = e
						}
						continue
					}
					messages, err := deliveredMessages(result)
					if err != nil && fatal == nil {
						fatal = err
					}
					delivered = append(delivered, messages...)
				}
			}(group)
		}
		wg.Wait()
		if len(delivered) > 0 {
			sort.SliceStable(delivered, func(i, j int) bool {
				a, b := delivered[i], delivered[j]
				return a.Topic < b.Topic || (a.Topic == b.Topic && (a.Partition < b.Partition ||
					(a.Partition == b.Partition && a.Offset < b.Offset)))
			})
			return delivered, fatal
		}
		if fatal != nil {
			return nil, fatal
		}
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		if !time.Now().Before(deadline) {
			return nil, last
		}
		pause := 50 * time.Millisecond // several servers: short polls
		if last != nil {
			pause = backoff.next()
		}
		if len(groups) > 1 || last != nil {
			sleep(ctx, min(pause, max(time.Until(deadline), 0)))
		}
	}
}

// receiveOrder is the partitions starting one further at each Receive. A server takes a
// Receive's messages partition by partition in request order until maxMessages: in the
// same order every time, a partition with a steady backlog starved the ones after it.
func (s *Subscription) receiveOrder() []TopicPartition {
	n := len(s.partitions)
	if n == 0 {
		return nil
	}
	k := int(s.turns.Add(1) % uint64(n))
	return append(append(make([]TopicPartition, 0, n), s.partitions[k:]...), s.partitions[:k]...)
}

// deliveredMessages decodes the records of a Receive result that lie in its delivered
// ranges (the server sends whole batches and names the offsets that are this consumer's).
func deliveredMessages(result *pb.ReceiveResult) ([]Message, error) {
	sp := result.GetSubscriptionPartition()
	tp := TopicPartition{Topic: sp.GetTopic(), Partition: int32(sp.GetPartition())}
	var out []Message
	ranges := result.GetDeliveredRanges()
	if len(ranges) == 0 {
		return nil, nil
	}
	all, err := decodeFrom(tp, result.GetRecordBatches(), ranges[0].GetStartOffset(), -1)
	if err != nil {
		return nil, err
	}
	for _, m := range all {
		for _, r := range ranges {
			if m.Offset >= r.GetStartOffset() && m.Offset < r.GetEndOffset() {
				out = append(out, m)
				break
			}
		}
	}
	return out, nil
}

// offsetRanges groups messages per partition into sorted, merged [start, end) ranges.
func offsetRanges(messages []Message) map[TopicPartition][]*pb.OffsetRange {
	offsets := map[TopicPartition][]int64{}
	for _, m := range messages {
		tp := TopicPartition{Topic: m.Topic, Partition: m.Partition}
		offsets[tp] = append(offsets[tp], m.Offset)
	}
	out := map[TopicPartition][]*pb.OffsetRange{}
	for tp, list := range offsets {
		sort.Slice(list, func(i, j int) bool { return list[i] < list[j] })
		var ranges []*pb.OffsetRange
		for _, o := range list {
			if n := len(ranges); n > 0 && ranges[n-1].EndOffset >= o {
				ranges[n-1].EndOffset = max(ranges[n-1].EndOffset, o+1)
				continue
			}
			ranges = append(ranges, &pb.OffsetRange{StartOffset: o, EndOffset: o + 1})
		}
		out[tp] = ranges
	}
	return out
}

type ackItem struct {
	cumulative int64
	ranges     []*pb.OffsetRange
}

// Ack acknowledges messages individually, durably. With a transaction the acks stay
// pending until it ends (commit applies them, abort redelivers the messages); acking a
// message pending in another open transaction fails with TRANSACTION_CONFLICT.
func (s *Subscription) Ack(ctx context.Context, messages []Message, txn *Txn) error {
	items := map[TopicPartition]ackItem{}
	for tp, ranges := range offsetRanges(messages) {
		items[tp] = ackItem{ranges: ranges}
	}
	return s.ack(ctx, items, txn)
}

// AckCumulative acknowledges every message of the message's partition up to and
// including it.
func (s *Subscription) AckCumulative(ctx context.Context, message Message, txn *Txn) error {
	tp := TopicPartition{Topic: message.Topic, Partition: message.Partition}
	return s.ack(ctx, map[TopicPartition]ackItem{tp: {cumulative: message.Offset + 1}}, txn)
}

func (s *Subscription) ack(ctx context.Context, items map[TopicPartition]ackItem, txn *Txn) error {
	if len(items) == 0 {
		return nil
	}
	tps := make([]TopicPartition, 0, len(items))
	for tp := range items {
		tps = append(tps, tp)
	}
	var txnID *pb.TxnId
	if txn != nil {
		if err := txn.accepting(nil); err != nil {
			return err
		}
		sps := make([]subscriptionPartition, len(tps))
		for i, tp := range tps {
			sps[i] = s.sp(tp)
		}
		if err := txn.register(ctx, nil, sps); err != nil {
			return err
		}
		txnID = txn.idIfOpen().proto()
	}
	return callOwners(ctx, s.c, tps, func(actx context.Context, stub pb.PartitionServiceClient,
		group []TopicPartition) ([]*pb.ItemError, error) {
		request := &pb.AckRequest{}
		for _, tp := range group {
			request.Items = append(request.Items, &pb.AckItem{SubscriptionPartition: s.sp(tp).proto(),
				CumulativeEndOffset: items[tp].cumulative, IndividualRanges: items[tp].ranges, TxnId: txnID})
		}
		reply, err := stub.Ack(actx, request)
		if err != nil {
			return nil, err
		}
		return itemErrors(len(group), reply.GetResults(), func(r *pb.AckResult) *pb.ItemError {
			return r.GetError()
		}), nil
	})
}

// Nack redelivers messages (to any consumer of the subscription) after delay.
func (s *Subscription) Nack(ctx context.Context, messages []Message, delay time.Duration) error {
	ranges := offsetRanges(messages)
	tps := make([]TopicPartition, 0, len(ranges))
	for tp := range ranges {
		tps = append(tps, tp)
	}
	return s.nack(ctx, tps, ranges, delay)
}

func (s *Subscription) nack(ctx context.Context, tps []TopicPartition, ranges map[TopicPartition][]*pb.OffsetRange,
	delay time.Duration) error {
	if delay < 0 || delay.Milliseconds() > 1<<32-1 {
		// (Sent as uint32 milliseconds: -5 s became about 49.7 days.)
		return errorf(ReasonInvalidArgument, "a Nack delay of %s", delay)
	}
	return callOwners(ctx, s.c, tps, func(actx context.Context, stub pb.PartitionServiceClient,
		group []TopicPartition) ([]*pb.ItemError, error) {
		request := &pb.NackRequest{ConsumerId: s.consumerID, RedeliveryDelayMs: uint32(delay.Milliseconds())}
		for _, tp := range group {
			request.Items = append(request.Items, &pb.NackItem{SubscriptionPartition: s.sp(tp).proto(),
				Ranges: ranges[tp]})
		}
		reply, err := stub.Nack(actx, request)
		if err != nil {
			return nil, err
		}
		return itemErrors(len(group), reply.GetResults(), func(r *pb.NackResult) *pb.ItemError {
			return r.GetError()
		}), nil
	})
}

// Cursor is the durable state of the subscription on one partition.
type Cursor struct {
	TopicPartition
	// CumulativeEndOffset: every offset below it is acknowledged.
	CumulativeEndOffset int64
	// IndividualAcks above it, as [start, end) pairs.
	IndividualAcks [][2]int64
	// PendingTransactions holding acks on it.
	PendingTransactions []TxnID
	// Delivered and not acknowledged yet; waiting for redelivery.
	DeliveredUnacknowledged, RedeliveryBacklog uint64
	// BacklogRecords estimates what is left to consume.
	BacklogRecords int64
}

// Describe reads the subscription's cursor on every partition.
func (s *Subscription) Describe(ctx context.Context) ([]Cursor, error) {
	var mu sync.Mutex
	var out []Cursor
	err := callOwners(ctx, s.c, s.partitions, func(actx context.Context, stub pb.PartitionServiceClient,
		group []TopicPartition) ([]*pb.ItemError, error) {
		request := &pb.DescribeSubscriptionRequest{}
		for _, tp := range group {
			request.SubscriptionPartitions = append(request.SubscriptionPartitions, s.sp(tp).proto())
		}
		reply, err := stub.DescribeSubscription(actx, request)
		if err != nil {
			return nil, err
		}
		mu.Lock()
		defer mu.Unlock()
		for i, cursor := range reply.GetCursors() {
			if i >= len(group) || cursor.GetError().GetReason() != "" {
				continue
			}
			c := Cursor{TopicPartition: group[i], CumulativeEndOffset: cursor.GetCumulativeEndOffset(),
				DeliveredUnacknowledged: cursor.GetDeliveredUnacknowledgedCount(),
				RedeliveryBacklog:       cursor.GetRedeliveryBacklogCount(), BacklogRecords: cursor.GetBacklogRecords()}
			for _, r := range cursor.GetIndividualRanges() {
				c.IndividualAcks = append(c.IndividualAcks, [2]int64{r.GetStartOffset(), r.GetEndOffset()})
			}
			for _, pending := range cursor.GetPendingAcks() {
				c.PendingTransactions = append(c.PendingTransactions, txnIDOf(pending.GetTxnId()))
			}
			out = append(out, c)
		}
		return itemErrors(len(group), reply.GetCursors(), func(r *pb.SubscriptionCursor) *pb.ItemError {
			return r.GetError()
		}), nil
	})
	sort.Slice(out, func(i, j int) bool {
		return out[i].Topic < out[j].Topic || (out[i].Topic == out[j].Topic && out[i].Partition < out[j].Partition)
	})
	return out, err
}

// Reset moves the subscription's cursor on every partition it reads (for every
// consumer of it): to StartEarliest, StartLatest, StartOffset (offset, clamped to what
// each partition holds) or StartTimestamp (the first batch at or after at). What was
// acknowledged past the new position is read again; what lay before it is skipped.
// A cursor holding a transaction's pending acks refuses (TRANSACTION_CONFLICT). Returns
// each partition's new position (the offset below which everything counts as acked).
func (s *Subscription) Reset(ctx context.Context, to Start, offset int64, at time.Time) (map[TopicPartition]int64, error) {
	position, timestampMs, err := positionOf(to, at)
	if err != nil {
		return nil, err
	}
	var mu sync.Mutex
	out := map[TopicPartition]int64{}
	err = callOwners(ctx, s.c, s.partitions, func(actx context.Context, stub pb.PartitionServiceClient,
		group []TopicPartition) ([]*pb.ItemError, error) {
		request := &pb.ResetSubscriptionRequest{Position: position, Offset: offset,
			TimestampUnixMs: timestampMs}
		for _, tp := range group {
			request.SubscriptionPartitions = append(request.SubscriptionPartitions, s.sp(tp).proto())
		}
		reply, err := stub.ResetSubscription(actx, request)
		if err != nil {
			return nil, err
		}
		mu.Lock()
		defer mu.Unlock()
		for i, result := range reply.GetResults() {
			if i < len(group) && result.GetError().GetReason() == "" {
				out[group[i]] = result.GetCumulativeEndOffset()
			}
		}
		return itemErrors(len(group), reply.GetResults(), func(r *pb.ResetSubscriptionResult) *pb.ItemError {
			return r.GetError()
		}), nil
	})
	return out, err
}

// Close hands back what is out to this consumer (redelivered to others at once).
func (s *Subscription) Close(ctx context.Context) error {
	empty := map[TopicPartition][]*pb.OffsetRange{}
	return s.nack(ctx, s.partitions, empty, 0)
}
