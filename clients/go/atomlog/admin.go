package atomlog

// A partition described by its owner (DescribePartition): what an operator or a
// monitoring job looks at when a read_committed reader seems stuck.

import (
	"context"
	"strings"
	"sync"
	"time"

	pb "github.com/atomlog/atomlog/clients/go/gen/atomlog/v1"
)

// PartitionDescription is one partition as its owner describes it.
type PartitionDescription struct {
	TopicPartition
	// State: "ONLINE", "LOADING", "DATA_LOSS", ... (partition.proto's PartitionState
	// without its prefix).
	State string
	// LogStartOffset is the first offset still stored; HighWatermark the end of the
	// durable log (exclusive).
	LogStartOffset, HighWatermark int64
	// MaxReadPosition is where read_committed readers stop (exclusive): below the first
	// open transaction's first offset. -1 while the transaction buffer recovers
	// (TransactionBufferReady false).
	MaxReadPosition        int64
	TransactionBufferReady bool
	// OpenTransactions hold data here and no marker yet, oldest first: the first one
	// holds MaxReadPosition down.
	OpenTransactions []OpenTransaction
	// AbortedTransactions in the partition's aborted-transaction index.
	AbortedTransactions uint64
	// Producers tracked for idempotence.
	ProducerCount uint64
	// Raw is the whole answer (producers, subscriptions, snapshots, replication).
	Raw *pb.DescribePartitionResponse
}

// OpenTransaction is a transaction with data on a partition and no marker yet.
type OpenTransaction struct {
	ID TxnID
	// FirstOffset of its first batch here; LastOffset of its last record here.
	FirstOffset, LastOffset int64
	ProducerID              int64
	ProducerEpoch           uint32
	// Age since its first batch here, on the server's clock. One older than the
	// coordinators' maximum transaction timeout may be hanging (`atomlog txn
	// find-hanging`).
	Age time.Duration
}

// DescribePartition asks a partition's owner for its state (retried, as every call,
// while the owner moves or loads). A topic or partition that does not exist fails at
// once with UNKNOWN_TOPIC_OR_PARTITION.
func (c *Client) DescribePartition(ctx context.Context, tp TopicPartition) (PartitionDescription, error) {
	var reply *pb.DescribePartitionResponse
	err := callOwners(ctx, c, []TopicPartition{tp}, func(actx context.Context, stub pb.PartitionServiceClient,
		group []TopicPartition) ([]*pb.ItemError, error) {
		answer, err := stub.DescribePartition(actx, &pb.DescribePartitionRequest{TopicPartition: tp.proto()})
		if err != nil {
			return nil, err
		}
		reply = answer
		return make([]*pb.ItemError, len(group)), nil
	})
	if err != nil {
		return PartitionDescription{}, err
	}
	d := PartitionDescription{
		TopicPartition:         tp,
		State:                  strings.TrimPrefix(reply.GetState().String(), "PARTITION_STATE_"),
		LogStartOffset:         reply.GetLogStartOffset(),
		HighWatermark:          reply.GetHighWatermark(),
		MaxReadPosition:        reply.GetMaxReadPosition(),
		TransactionBufferReady: reply.GetTransactionBufferReady(),
		AbortedTransactions:    reply.GetAbortedTransactionCount(),
		ProducerCount:          reply.GetProducerCount(),
		Raw:                    reply,
	}
	for _, open := range reply.GetOpenTransactions() {
		d.OpenTransactions = append(d.OpenTransactions, OpenTransaction{
			ID: txnIDOf(open.GetTxnId()), FirstOffset: open.GetFirstOffset(), LastOffset: open.GetLastOffset(),
			ProducerID: open.GetProducerId(), ProducerEpoch: open.GetProducerEpoch(),
			Age: time.Duration(open.GetAgeMs()) * time.Millisecond})
	}
	return d, nil
}

// checkPartition fails UNKNOWN_TOPIC_OR_PARTITION unless the topic has the partition
// (the routes read again once first: the topic may have just grown).
func (c *Client) checkPartition(ctx context.Context, tp TopicPartition) error {
	count, err := c.Partitions(ctx, tp.Topic)
	if err == nil && (tp.Partition < 0 || int(tp.Partition) >= count) {
		if err = c.Refresh(ctx, tp.Topic); err == nil {
			count, err = c.Partitions(ctx, tp.Topic)
		}
	}
	if err != nil {
		return err
	}
	if tp.Partition < 0 || int(tp.Partition) >= count {
		return errorf(ReasonUnknownTopicOrPartition, "topic %q has %d partitions; no partition %d",
			tp.Topic, count, tp.Partition)
	}
	return nil
}

// DeleteRecords deletes the records of each partition in before below its offset
// (DeleteRecords; Kafka's deleteRecords): every whole segment that ends at or below
// the offset goes, so the log then starts at the base of the segment holding it (the
// active segment and the data of open transactions stay). It returns each partition's
// log start offset after it. On a replicated topic a partition answers once every
// in-sync replica has deleted too, so no failover shows the records again. Retried, as
// every call, while an owner moves or its in-sync followers are still deleting
// (REQUEST_TIMED_OUT), until ctx ends (or the client's operation timeout); an offset
// past the high watermark fails with OFFSET_OUT_OF_RANGE. Partitions are trimmed
// independently: on an error, those trimmed before it stay trimmed. Needs alter on the
// topic with ACLs.
func (c *Client) DeleteRecords(ctx context.Context, before map[TopicPartition]int64) (map[TopicPartition]int64, error) {
	starts := make(map[TopicPartition]int64, len(before))
	tps := make([]TopicPartition, 0, len(before))
	for tp, offset := range before {
		if offset < 0 {
			return nil, errorf(ReasonInvalidArgument, "%s-%d: offset %d is negative",
				tp.Topic, tp.Partition, offset)
		}
		tps = append(tps, tp)
	}
	var mu sync.Mutex
	err := callOwners(ctx, c, tps, func(actx context.Context, stub pb.PartitionServiceClient,
		group []TopicPartition) ([]*pb.ItemError, error) {
		request := &pb.DeleteRecordsRequest{}
		for _, tp := range group {
			request.Items = append(request.Items, &pb.DeleteRecordsItem{
				Topic: tp.Topic, Partition: uint32(tp.Partition), BeforeOffset: before[tp]})
		}
		answer, err := stub.DeleteRecords(actx, request)
		if err != nil {
			return nil, err
		}
		results := answer.GetResults()
		if len(results) != len(group) {
			return nil, errorf(ReasonInternal, "DeleteRecords answered %d results for %d items",
				len(results), len(group))
		}
		errs := make([]*pb.ItemError, len(group))
		mu.Lock()
		defer mu.Unlock()
		for i, result := range results {
			if result.GetError().GetReason() != "" {
				errs[i] = result.GetError()
				continue
			}
			starts[group[i]] = result.GetLogStartOffset()
		}
		return errs, nil
	})
	if err != nil {
		return nil, err
	}
	return starts, nil
}
