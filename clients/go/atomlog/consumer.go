package atomlog

// The offset consumer: it reads partitions directly by offset (no subscription), one
// Fetch per owning server for all its partitions. read_committed (the default) gets only
// committed data: the servers stop at each partition's max read position and remove
// aborted batches themselves, so the client needs no transaction logic.

import (
	"context"
	"sort"
	"sync"
	"time"

	pb "github.com/atomlog/atomlog/clients/go/gen/atomlog/v1"
)

// Isolation of a reader.
type Isolation int

const (
	// ReadCommitted: only committed data (the default).
	ReadCommitted Isolation = iota
	// ReadUncommitted: everything below the high watermark, open and aborted data too.
	ReadUncommitted
)

func (i Isolation) proto() pb.IsolationLevel {
	if i == ReadUncommitted {
		return pb.IsolationLevel_ISOLATION_LEVEL_READ_UNCOMMITTED
	}
	return pb.IsolationLevel_ISOLATION_LEVEL_READ_COMMITTED
}

// Start is where a consumer (or a new subscription) begins.
type Start int

const (
	// StartEarliest: everything still stored (the default).
	StartEarliest Start = iota
	// StartLatest: only what is written from now on.
	StartLatest
	// StartOffset: at an offset (subscriptions: SubscribeOptions.StartOffset).
	StartOffset
	// StartTimestamp: at the first batch at or after a time (subscriptions only).
	StartTimestamp
)

// ConsumerOptions of NewConsumer; zero values mean the defaults.
type ConsumerOptions struct {
	Isolation Isolation
	// Start: StartEarliest or StartLatest.
	Start Start
	// Partitions to read (nil: every partition of every topic).
	Partitions []int32
	// MaxBytesPerPartition and MaxBytes bound one Fetch (defaults 4 MiB and 8 MiB).
	MaxBytesPerPartition int
	MaxBytes             int
	// MaxRecords bounds what one Poll returns (default 10,000).
	MaxRecords int
}

// Consumer reads partitions by offset. Not safe for concurrent use.
type Consumer struct {
	c         *Client
	opts      ConsumerOptions
	order     []TopicPartition
	positions map[TopicPartition]int64
	buffered  []Message
}

// NewConsumer assigns the consumer every partition of the topics (or opts.Partitions)
// and places it at their start or end.
func (c *Client) NewConsumer(ctx context.Context, topics []string, opts ConsumerOptions) (*Consumer, error) {
	if opts.MaxBytesPerPartition == 0 {
		opts.MaxBytesPerPartition = 4 << 20
	}
	if opts.MaxBytes == 0 {
		opts.MaxBytes = 8 << 20
	}
	if opts.MaxRecords == 0 {
		opts.MaxRecords = 10_000
	}
	if opts.Start != StartEarliest && opts.Start != StartLatest {
		return nil, errorf(ReasonInvalidArgument, "a consumer starts at StartEarliest or StartLatest (Seek for offsets)")
	}
	cs := &Consumer{c: c, opts: opts, positions: map[TopicPartition]int64{}}
	for _, topic := range topics {
		count, err := c.Partitions(ctx, topic)
		if err != nil {
			return nil, err
		}
		for p := int32(0); p < int32(count); p++ {
			if opts.Partitions == nil || containsInt32(opts.Partitions, p) {
				tp := TopicPartition{Topic: topic, Partition: p}
				cs.order = append(cs.order, tp)
				cs.positions[tp] = 0
			}
		}
	}
	if opts.Partitions != nil && len(cs.order) != len(topics)*len(opts.Partitions) {
		return nil, errorf(ReasonUnknownTopicOrPartition, "partitions %v do not all exist in %v", opts.Partitions, topics)
	}
	// Earliest is the log start, not offset 0: after retention or DeleteRecords moved
	// it, a fetch at 0 is OFFSET_OUT_OF_RANGE for good.
	spec := pb.OffsetSpec_OFFSET_SPEC_EARLIEST
	if opts.Start == StartLatest {
		spec = pb.OffsetSpec_OFFSET_SPEC_LATEST
	}
	ends, err := cs.listOffsets(ctx, spec)
	if err != nil {
		return nil, err
	}
	for tp, offset := range ends {
		cs.positions[tp] = offset
	}
	return cs, nil
}

func containsInt32(list []int32, x int32) bool {
	for _, y := range list {
		if y == x {
			return true
		}
	}
	return false
}

// Assignment is every partition of the consumer with the next offset it returns.
func (cs *Consumer) Assignment() map[TopicPartition]int64 {
	out := map[TopicPartition]int64{}
	for _, tp := range cs.order {
		out[tp] = cs.Position(tp)
	}
	return out
}

// Position is the offset Poll goes on from in a partition.
func (cs *Consumer) Position(tp TopicPartition) int64 {
	for _, m := range cs.buffered {
		if m.Topic == tp.Topic && m.Partition == tp.Partition {
			return m.Offset
		}
	}
	return cs.positions[tp]
}

// Seek makes the next Poll of a partition start at offset.
func (cs *Consumer) Seek(tp TopicPartition, offset int64) error {
	if _, ok := cs.positions[tp]; !ok {
		return errorf(ReasonInvalidArgument, "%s is not assigned to this consumer", tp)
	}
	if offset < 0 {
		return errorf(ReasonInvalidArgument, "offset %d < 0", offset)
	}
	cs.positions[tp] = offset
	kept := cs.buffered[:0]
	for _, m := range cs.buffered {
		if m.Topic != tp.Topic || m.Partition != tp.Partition {
			kept = append(kept, m)
		}
	}
	cs.buffered = kept
	return nil
}

// EndOffsets is, per partition, the offset after the last readable record: the max read
// position under read_committed, else the high watermark.
func (cs *Consumer) EndOffsets(ctx context.Context) (map[TopicPartition]int64, error) {
	spec := pb.OffsetSpec_OFFSET_SPEC_MAX_READ_POSITION
	if cs.opts.Isolation == ReadUncommitted {
		spec = pb.OffsetSpec_OFFSET_SPEC_LATEST
	}
	return cs.listOffsets(ctx, spec)
}

func (cs *Consumer) listOffsets(ctx context.Context, spec pb.OffsetSpec) (map[TopicPartition]int64, error) {
	out := map[TopicPartition]int64{}
	var mu sync.Mutex // callOwners calls the servers at once
	err := callOwners(ctx, cs.c, cs.order, func(actx context.Context, stub pb.PartitionServiceClient,
		group []TopicPartition) ([]*pb.ItemError, error) {
		request := &pb.ListOffsetsRequest{}
		for _, tp := range group {
			request.Items = append(request.Items, &pb.ListOffsetsItem{TopicPartition: tp.proto(), Spec: spec})
		}
		reply, err := stub.ListOffsets(actx, request)
		if err != nil {
			return nil, err
		}
		errs := make([]*pb.ItemError, len(group))
		mu.Lock()
		defer mu.Unlock()
		for i, result := range reply.GetResults() {
			if i < len(group) {
				errs[i] = result.GetError()
				if result.GetError().GetReason() == "" {
					out[group[i]] = result.GetOffset()
				}
			}
		}
		return errs, nil
	})
	return out, err
}

// Poll returns up to MaxRecords messages, waiting up to maxWait for the first. An empty
// answer means nothing came. Retriable failures are retried within maxWait (and returned
// if nothing else came); a batch that cannot be read (CORRUPT_BATCH, CRC_MISMATCH)
// fails every Poll until Seek moves past it: nothing is skipped silently.
func (cs *Consumer) Poll(ctx context.Context, maxWait time.Duration) ([]Message, error) {
	deadline := time.Now().Add(maxWait)
	backoff := newBackoff(50*time.Millisecond, time.Second)
	var last error
	for len(cs.buffered) == 0 {
		remaining := time.Until(deadline)
		err := cs.fetch(ctx, max(remaining, 0))
		if err != nil {
			if ctx.Err() != nil {
				return nil, ctx.Err()
			}
			if !IsRetriable(err) {
				return nil, err
			}
			last = err
			if !sleep(ctx, min(backoff.next(), max(time.Until(deadline), 0))) {
				return nil, ctx.Err()
			}
		} else {
			last = nil
		}
		if len(cs.buffered) > 0 || !time.Now().Before(deadline) {
			break
		}
	}
	if len(cs.buffered) == 0 {
		return nil, last
	}
	n := min(len(cs.buffered), cs.opts.MaxRecords)
	out := append([]Message{}, cs.buffered[:n]...)
	cs.buffered = cs.buffered[n:]
	return out, nil
}

type fetchAnswer struct {
	group []TopicPartition
	reply *pb.FetchResponse
	err   error
}

// fetch sends one Fetch per owning server (long-polling when there is one) and takes
// what comes into the buffer.
func (cs *Consumer) fetch(ctx context.Context, wait time.Duration) error {
	groups, failed := cs.c.byOwner(ctx, cs.order)
	var first error
	for tp, err := range failed {
		cs.c.invalidate(tp.Topic)
		first = err
	}
	if len(groups) == 0 {
		if first == nil {
			first = errorf(ReasonServerUnavailable, "no owner of any partition is reachable")
		}
		return first
	}
	waitMs := uint32(0)
	if len(groups) == 1 {
		waitMs = uint32(wait.Milliseconds())
	}
	answers := make(chan fetchAnswer, len(groups))
	for address, group := range groups {
		request := &pb.FetchRequest{IsolationLevel: cs.opts.Isolation.proto(), MaxWaitMs: waitMs,
			MaxBytes: uint32(cs.opts.MaxBytes)}
		for _, tp := range group {
			request.Items = append(request.Items, &pb.FetchItem{TopicPartition: tp.proto(),
				FetchOffset: cs.positions[tp], MaxBytes: uint32(cs.opts.MaxBytesPerPartition)})
		}
		stub, err := cs.c.partitionStub(address)
		if err != nil {
			return err
		}
		go func(group []TopicPartition) {
			actx, cancel := context.WithTimeout(ctx, cs.c.opts.RequestTimeout+wait)
			defer cancel()
			reply, err := stub.Fetch(actx, request)
			answers <- fetchAnswer{group: group, reply: reply, err: fromRPC(ctx, err)}
		}(group)
	}
	var results []*pb.FetchResult
	for range groups {
		answer := <-answers
		if answer.err != nil {
			if isRoutingError(answer.err) {
				for _, tp := range answer.group {
					cs.c.invalidate(tp.Topic)
				}
			}
			first = answer.err
			continue
		}
		for _, result := range answer.reply.GetResults() {
			if e := itemError(result.GetError()); e != nil {
				if isRoutingError(e) {
					cs.c.invalidate(result.GetTopicPartition().GetTopic())
				}
				if first == nil || IsRetriable(first) {
					first = e
				}
				continue
			}
			results = append(results, result)
		}
	}
	sort.Slice(results, func(i, j int) bool { // a stable order for callers
		a, b := results[i].GetTopicPartition(), results[j].GetTopicPartition()
		return a.GetTopic() < b.GetTopic() || (a.GetTopic() == b.GetTopic() && a.GetPartition() < b.GetPartition())
	})
	for _, result := range results {
		tp := TopicPartition{Topic: result.GetTopicPartition().GetTopic(),
			Partition: int32(result.GetTopicPartition().GetPartition())}
		messages, err := decodeFrom(tp, result.GetRecordBatches(), cs.positions[tp], -1)
		if err != nil {
			return err // the partition stays before the bad batch
		}
		cs.buffered = append(cs.buffered, messages...)
		if next := result.GetNextFetchOffset(); next > cs.positions[tp] {
			cs.positions[tp] = next
		}
	}
	if len(cs.buffered) == 0 && len(groups) > 1 && wait > 0 && first == nil {
		sleep(ctx, min(wait, 50*time.Millisecond)) // several servers: short polls
	}
	if len(cs.buffered) > 0 && first != nil && IsRetriable(first) {
		return nil
	}
	return first
}

// decodeFrom decodes the data batches of a Fetch or Receive result, keeping records at
// or above `from` (and below `to`, when to >= 0).
func decodeFrom(tp TopicPartition, data []byte, from, to int64) ([]Message, error) {
	var out []Message
	err := SplitBatches(data, func(batch []byte, h Header) error {
		if h.IsControl() || h.LastOffset() < from || (to >= 0 && h.BaseOffset >= to) {
			return nil
		}
		_, records, err := DecodeBatch(batch)
		if err != nil {
			return err
		}
		for i, r := range records {
			offset := h.BaseOffset + int64(i)
			if offset >= from && (to < 0 || offset < to) {
				out = append(out, Message{Topic: tp.Topic, Partition: tp.Partition, Offset: offset, Record: r})
			}
		}
		return nil
	})
	return out, err
}

// callOwners calls fn once per owning server with its partitions (the servers at once)
// and retries partitions whose item failed with a retriable reason (after a metadata
// refresh for routing ones) until ctx ends (or 60 s); the first fatal item error is
// returned. fn returns one ItemError per partition of its group. A partition the
// routes do not know, and still do not after a refresh, fails it at once with
// UNKNOWN_TOPIC_OR_PARTITION (a topic deleted, a partition index it never had).
func callOwners(ctx context.Context, c *Client, tps []TopicPartition,
	fn func(context.Context, pb.PartitionServiceClient, []TopicPartition) ([]*pb.ItemError, error)) error {
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, defaultOperationTimeout)
		defer cancel()
	}
	pending := tps
	backoff := newBackoff(50*time.Millisecond, time.Second)
	var last error
	for len(pending) > 0 {
		groups, failed := c.byOwner(ctx, pending)
		var retry []TopicPartition
		var fatal error
		for tp, err := range failed {
			if Reason(err) == ReasonUnknownTopicOrPartition {
				if known := c.checkPartition(ctx, tp); Reason(known) == ReasonUnknownTopicOrPartition {
					return known
				}
			}
			retry = append(retry, tp)
			last = err
		}
		var mu sync.Mutex
		var wg sync.WaitGroup
		for address, group := range groups {
			stub, err := c.partitionStub(address)
			if err != nil {
				return err
			}
			wg.Add(1)
			go func(group []TopicPartition) {
				defer wg.Done()
				actx, cancel := c.attempt(ctx)
				errs, err := fn(actx, stub, group)
				cancel()
				err = fromRPC(ctx, err)
				mu.Lock()
				defer mu.Unlock()
				if err != nil {
					if IsRetriable(err) {
						retry = append(retry, group...)
						last = err
					} else if fatal == nil {
						fatal = err
					}
					return
				}
				for i, tp := range group {
					e := itemError(errs[i])
					switch {
					case e == nil:
					case e.Retriable():
						retry = append(retry, tp)
						last = e
					case fatal == nil:
						fatal = e
					}
				}
			}(group)
		}
		wg.Wait()
		if fatal != nil {
			return fatal
		}
		for _, tp := range retry {
			c.invalidate(tp.Topic)
		}
		pending = retry
		if len(pending) > 0 && !sleep(ctx, backoff.next()) {
			return lastOr(last, ctx.Err())
		}
	}
	return nil
}
