package atomlog

import (
	"fmt"
	"time"

	pb "github.com/atomlog/atomlog/clients/go/gen/atomlog/v1"
)

// RecordHeader is one header of a record (keys are UTF-8, values bytes).
type RecordHeader struct {
	Key   string
	Value []byte
}

// Record is what a producer sends: a key (nil: none), a value (nil: a null value),
// headers and a timestamp (zero: the time of the send).
type Record struct {
	Key       []byte
	Value     []byte
	Headers   []RecordHeader
	Timestamp time.Time
}

// Message is a record read from a partition.
type Message struct {
	Topic     string
	Partition int32
	Offset    int64
	Record
}

// TxnID is a transaction id: the TC partition that owns it and its sequence there.
// The zero TxnID means "no transaction".
type TxnID struct {
	TCPartition uint32
	Sequence    uint64
}

// IsZero: no transaction.
func (t TxnID) IsZero() bool { return t.TCPartition == 0 && t.Sequence == 0 }

// String is "<tc partition>:<sequence>", as `atomlog txn describe` takes it.
func (t TxnID) String() string { return fmt.Sprintf("%d:%d", t.TCPartition, t.Sequence) }

func (t TxnID) proto() *pb.TxnId {
	return &pb.TxnId{TcPartition: t.TCPartition, Sequence: t.Sequence}
}

func txnIDOf(p *pb.TxnId) TxnID {
	return TxnID{TCPartition: p.GetTcPartition(), Sequence: p.GetSequence()}
}

// TopicPartition names one partition of a topic.
type TopicPartition struct {
	Topic     string
	Partition int32
}

func (tp TopicPartition) String() string { return fmt.Sprintf("%s-%d", tp.Topic, tp.Partition) }

func (tp TopicPartition) proto() *pb.TopicPartition {
	return &pb.TopicPartition{Topic: tp.Topic, Partition: uint32(tp.Partition)}
}

// subscriptionPartition names one cursor: a subscription on one partition.
type subscriptionPartition struct {
	TopicPartition
	Subscription string
}

func (sp subscriptionPartition) proto() *pb.SubscriptionPartition {
	return &pb.SubscriptionPartition{Topic: sp.Topic, Partition: uint32(sp.Partition),
		Subscription: sp.Subscription}
}
