package atomlog

// Tests against a real cluster: ATOMLOG_BOOTSTRAP names any server of it
// (tests/test_go_client.py runs them against the suite's cluster). Without it they skip.

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"os"
	"sort"
	"testing"
	"time"

	pb "github.com/atomlog/atomlog/clients/go/gen/atomlog/v1"
)

func cluster(t *testing.T) (*Client, context.Context) {
	t.Helper()
	bootstrap := os.Getenv("ATOMLOG_BOOTSTRAP")
	if bootstrap == "" {
		t.Skip("ATOMLOG_BOOTSTRAP is not set (no cluster to test against)")
	}
	c, err := Dial(bootstrap, WithRequestTimeout(10*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	t.Cleanup(func() {
		cancel()
		c.Close()
	})
	return c, ctx
}

// topic creates a fresh topic and waits until every partition serves.
func topic(t *testing.T, ctx context.Context, c *Client, prefix string, partitions int) string {
	t.Helper()
	name := fmt.Sprintf("go-%s-%s", prefix, randomKey()[3:11])
	if _, err := c.CreateTopic(ctx, name, partitions, nil); err != nil {
		t.Fatal(err)
	}
	consumer, err := c.NewConsumer(ctx, []string{name}, ConsumerOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := consumer.EndOffsets(ctx); err != nil { // retried while PARTITION_LOADING
		t.Fatal(err)
	}
	return name
}

// readAll reads a topic from the start until `expected` messages came and then for a
// quiet half second more (so a duplicate would show).
func readAll(t *testing.T, ctx context.Context, c *Client, topic string, isolation Isolation, expected int) []Message {
	t.Helper()
	consumer, err := c.NewConsumer(ctx, []string{topic}, ConsumerOptions{Isolation: isolation})
	if err != nil {
		t.Fatal(err)
	}
	var out []Message
	quietSince := time.Now()
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		messages, err := consumer.Poll(ctx, 200*time.Millisecond)
		if err != nil && !IsRetriable(err) {
			t.Fatal(err)
		}
		if len(messages) > 0 {
			out = append(out, messages...)
			quietSince = time.Now()
		} else if len(out) >= expected && time.Since(quietSince) > 500*time.Millisecond {
			break
		}
	}
	return out
}

// withoutLinks is a second client of the test cluster that makes every call over gRPC.
func withoutLinks(t *testing.T) *Client {
	t.Helper()
	plain, err := Dial(os.Getenv("ATOMLOG_BOOTSTRAP"), WithRequestTimeout(10*time.Second), WithoutLinks())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { plain.Close() })
	return plain
}

// checkLinkCalls fails the test unless `client` answered at least `atLeast` calls on
// links since `before` when it is `linked`, and none when it is not.
func checkLinkCalls(t *testing.T, client *Client, linked bool, before, atLeast int64, what string) {
	t.Helper()
	onLinks := client.linkCalls.Load() - before
	if linked && onLinks < atLeast {
		t.Fatalf("%d calls on %s", onLinks, what)
	}
	if !linked && onLinks != 0 {
		t.Fatalf("WithoutLinks: %d calls on the links", onLinks)
	}
}

// preload writes prefix00, prefix01, ... (n values) round-robin over `partitions`.
func preload(t *testing.T, ctx context.Context, c *Client, topic, prefix string, n, partitions int) {
	t.Helper()
	producer, err := c.NewProducer(ctx, ProducerOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer producer.Close(ctx)
	for i := 0; i < n; i++ {
		producer.Send(ctx, topic, Record{Value: []byte(fmt.Sprintf("%s%02d", prefix, i))}, ToPartition(int32(i%partitions)))
	}
	if err := producer.Flush(ctx); err != nil {
		t.Fatal(err)
	}
}

func values(messages []Message) []string {
	out := make([]string, len(messages))
	for i, m := range messages {
		out[i] = string(m.Value)
	}
	return out
}

func TestClusterIdempotentProducerKeepsOrder(t *testing.T) {
	c, ctx := cluster(t)
	name := topic(t, ctx, c, "order", 3)
	producer, err := c.NewProducer(ctx, ProducerOptions{Linger: time.Millisecond, BatchMaxBytes: 4096,
		Compression: CompressionLZ4})
	if err != nil {
		t.Fatal(err)
	}
	defer producer.Close(ctx)
	const n = 3000
	futures := make([]*Future, n)
	for i := range futures {
		futures[i], err = producer.Send(ctx, name, Record{Key: []byte(fmt.Sprint(i % 7)),
			Value: []byte(fmt.Sprintf("r%05d", i)), Headers: []RecordHeader{{Key: "i", Value: []byte(fmt.Sprint(i))}}})
		if err != nil {
			t.Fatal(err)
		}
	}
	if err := producer.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	where := map[string]RecordMetadata{}
	for i, f := range futures {
		meta, err := f.Wait(ctx)
		if err != nil {
			t.Fatalf("record %d: %v", i, err)
		}
		if want := int32(CRC32C([]byte(fmt.Sprint(i%7))) % 3); meta.Partition != want {
			t.Fatalf("record %d went to partition %d, its key says %d", i, meta.Partition, want)
		}
		where[fmt.Sprintf("r%05d", i)] = meta
	}
	messages := readAll(t, ctx, c, name, ReadCommitted, n)
	if len(messages) != n {
		t.Fatalf("read %d messages, sent %d", len(messages), n)
	}
	last := map[int32]int{}
	for _, m := range messages {
		meta := where[string(m.Value)]
		if meta.Partition != m.Partition || meta.Offset != m.Offset {
			t.Fatalf("%s read at %d/%d, acknowledged at %d/%d", m.Value, m.Partition, m.Offset, meta.Partition, meta.Offset)
		}
		var i int
		fmt.Sscanf(string(m.Value), "r%05d", &i)
		if prev, ok := last[m.Partition]; ok && i <= prev {
			t.Fatalf("partition %d: r%05d after r%05d (send order lost)", m.Partition, i, prev)
		}
		last[m.Partition] = i
		if len(m.Headers) != 1 || string(m.Headers[0].Value) != fmt.Sprint(i) {
			t.Fatalf("headers %+v", m.Headers)
		}
	}
}

// A stale route (as after a partition moved) meets NOT_PARTITION_OWNER, which the
// client answers by refreshing its metadata and sending again.
func TestClusterRoutingRefreshOnNotPartitionOwner(t *testing.T) {
	c, ctx := cluster(t)
	name := topic(t, ctx, c, "routing", 3)
	routes, err := c.routes(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	wrong := routes[1].address
	if wrong == routes[0].address {
		wrong = routes[2].address
	}
	if wrong == routes[0].address {
		t.Skip("all partitions on one server")
	}
	// What the raw API answers at the wrong server.
	stub, _ := c.partitionStub(wrong)
	batch, _ := EncodeColumnBatch([]Record{{Value: []byte("x")}}, BatchFields{BaseSequence: NoSequence})
	reply, err := stub.Produce(ctx, &pb.ProduceRequest{Items: []*pb.ProduceItem{{
		TopicPartition: TopicPartition{Topic: name, Partition: 0}.proto(), RecordBatch: batch}}})
	if err != nil {
		t.Fatal(err)
	}
	e := itemError(reply.GetResults()[0].GetError())
	if e == nil || e.Reason != ReasonNotPartitionOwner || !e.Retriable() || e.Metadata["owner_address"] != routes[0].address {
		t.Fatalf("the wrong server answered %v (metadata %v)", e, e.Metadata)
	}
	// Poison the cache: partition 0 "belongs" to the wrong server.
	c.metaMu.Lock()
	poisoned := append([]route{}, routes...)
	poisoned[0] = route{serverName: "stale", address: wrong}
	c.topics[name] = poisoned
	before := c.refreshes
	c.metaMu.Unlock()
	producer, err := c.NewProducer(ctx, ProducerOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer producer.Close(ctx)
	future, err := producer.Send(ctx, name, Record{Value: []byte("routed")}, ToPartition(0))
	if err != nil {
		t.Fatal(err)
	}
	meta, err := future.Wait(ctx)
	if err != nil || meta.Partition != 0 {
		t.Fatalf("%+v %v", meta, err)
	}
	c.metaMu.Lock()
	refreshed := c.refreshes > before && c.topics[name][0].address == routes[0].address
	c.topics[name] = poisoned // and once more for a consumer
	c.metaMu.Unlock()
	if !refreshed {
		t.Fatal("the producer did not refresh the stale route")
	}
	messages := readAll(t, ctx, c, name, ReadCommitted, 1)
	if len(messages) != 1 || string(messages[0].Value) != "routed" {
		t.Fatalf("read %v", values(messages))
	}
}

func TestClusterTypedErrors(t *testing.T) {
	c, ctx := cluster(t)
	name := topic(t, ctx, c, "errors", 1)
	_, err := c.CreateTopic(ctx, name, 1, nil)
	if !errors.Is(err, ErrTopicAlreadyExists) || IsRetriable(err) {
		t.Fatalf("creating it again: %v", err)
	}
	var e *Error
	if !errors.As(err, &e) || e.Code.String() != "AlreadyExists" || e.Outcome() != Fatal {
		t.Fatalf("%#v", err)
	}
	_, err = c.CreateTopic(ctx, "bad name!", 1, nil)
	if Reason(err) != "INVALID_TOPIC_NAME" {
		t.Fatalf("a bad name: %v", err)
	}
	_, err = c.AlterTopicConfig(ctx, name, map[string]string{"retention.ms": "soon"}, nil)
	if Reason(err) != "INVALID_TOPIC_CONFIG" || IsRetriable(err) {
		t.Fatalf("a bad setting: %v", err)
	}
	config, err := c.AlterTopicConfig(ctx, name, map[string]string{"retention.ms": "60000"}, nil)
	if err != nil || len(config) != 1 || config["retention.ms"] != "60000" {
		t.Fatalf("a setting: %v %v", config, err)
	}
	config, err = c.AlterTopicConfig(ctx, name, nil, []string{"retention.ms"})
	if err != nil || len(config) != 0 {
		t.Fatalf("a setting deleted: %v %v", config, err)
	}
	consumer, _ := c.NewConsumer(ctx, []string{name}, ConsumerOptions{})
	consumer.Seek(TopicPartition{Topic: name, Partition: 0}, 1_000_000)
	_, err = consumer.Poll(ctx, 100*time.Millisecond)
	if Reason(err) != ReasonOffsetOutOfRange || IsRetriable(err) {
		t.Fatalf("past the end: %v", err)
	}
	count, _ := c.tcPartitionCount(ctx)
	err = c.coordinatorCall(ctx, 0, func(actx context.Context, stub pb.CoordinatorServiceClient) error {
		_, err := stub.GetTxnStatus(actx, &pb.GetTxnStatusRequest{TxnId: &pb.TxnId{TcPartition: 0, Sequence: 1 << 60}})
		return err
	})
	if Reason(err) != ReasonUnknownTransaction || count != 16 {
		t.Fatalf("an unknown transaction: %v (%d TC partitions)", err, count)
	}
}

func TestClusterTransactions(t *testing.T) {
	c, ctx := cluster(t)
	a := topic(t, ctx, c, "txn-a", 2)
	b := topic(t, ctx, c, "txn-b", 2)
	producer, err := c.NewProducer(ctx, ProducerOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer producer.Close(ctx)
	send := func(txn *Txn, prefix string) []*Future {
		var out []*Future
		for i := 0; i < 10; i++ {
			for _, name := range []string{a, b} {
				f, err := producer.Send(ctx, name, Record{Value: []byte(fmt.Sprintf("%s-%d", prefix, i))},
					ToPartition(int32(i%2)), InTxn(txn))
				if err != nil {
					t.Fatal(err)
				}
				out = append(out, f)
			}
		}
		return out
	}
	aborted, _ := c.BeginTxn(ctx, TxnOptions{Timeout: 20 * time.Second})
	for _, f := range send(aborted, "aborted") {
		if _, err := f.Wait(ctx); err != nil { // written, open
			t.Fatal(err)
		}
	}
	id, _ := aborted.ID(ctx)
	if state, _ := aborted.State(ctx); state != "OPEN" {
		t.Fatalf("state %s", state)
	}
	if err := aborted.Abort(ctx); err != nil {
		t.Fatal(err)
	}
	if err := aborted.Commit(ctx); !errors.Is(err, ErrTransactionAborted) {
		t.Fatalf("commit after abort: %v", err)
	}
	committed, _ := c.BeginTxn(ctx, TxnOptions{})
	send(committed, "committed")
	if err := committed.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := committed.Commit(ctx); err != nil { // again: a no-op
		t.Fatal(err)
	}
	for _, name := range []string{a, b} {
		got := values(readAll(t, ctx, c, name, ReadCommitted, 10))
		sort.Strings(got)
		if len(got) != 10 || got[0] != "committed-0" || got[9] != "committed-9" {
			t.Fatalf("%s read_committed: %v (aborted was %s)", name, got, id)
		}
		if n := len(readAll(t, ctx, c, name, ReadUncommitted, 20)); n != 20 {
			t.Fatalf("%s read_uncommitted: %d messages, want both transactions' 20", name, n)
		}
	}
	// A transaction that wrote nothing commits without a call; one past its timeout does not.
	empty, _ := c.BeginTxn(ctx, TxnOptions{})
	if err := empty.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	late, _ := c.BeginTxn(ctx, TxnOptions{Timeout: 300 * time.Millisecond})
	f, _ := producer.Send(ctx, a, Record{Value: []byte("late")}, InTxn(late))
	if _, err := f.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(15 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		state, err := late.State(ctx) // the coordinator aborts it at its timeout
		if err != nil {
			t.Fatal(err)
		}
		if state == "ABORTED" || state == "ABORTING" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("a transaction past its 300 ms timeout is still %s", state)
		}
	}
	if err := late.Commit(ctx); !errors.Is(err, ErrTransactionTimedOut) || !IsAbortable(err) {
		t.Fatalf("a transaction past its timeout: %v", err)
	}
	if n := len(readAll(t, ctx, c, a, ReadCommitted, 10)); n != 10 {
		t.Fatalf("%d committed messages after the timed-out transaction", n)
	}
}

func TestClusterSubscription(t *testing.T) {
	c, ctx := cluster(t)
	in := topic(t, ctx, c, "sub-in", 2)
	out := topic(t, ctx, c, "sub-out", 1)
	producer, _ := c.NewProducer(ctx, ProducerOptions{})
	defer producer.Close(ctx)
	for i := 0; i < 20; i++ {
		producer.Send(ctx, in, Record{Value: []byte(fmt.Sprintf("m%02d", i))}, ToPartition(int32(i%2)))
	}
	if err := producer.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	sub, err := c.Subscribe(ctx, []string{in}, "billing", SubscribeOptions{AckTimeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	receiveAll := func(n int) []Message {
		var got []Message
		deadline := time.Now().Add(20 * time.Second)
		for len(got) < n && time.Now().Before(deadline) {
			messages, err := sub.Receive(ctx, 500*time.Millisecond, n-len(got))
			if err != nil {
				t.Fatal(err)
			}
			got = append(got, messages...)
		}
		if len(got) != n {
			t.Fatalf("received %d messages, want %d", len(got), n)
		}
		return got
	}
	first := receiveAll(20)
	// Nack five: they come back; ack the rest.
	if err := sub.Nack(ctx, first[:5], 0); err != nil {
		t.Fatal(err)
	}
	if err := sub.Ack(ctx, first[5:], nil); err != nil {
		t.Fatal(err)
	}
	again := receiveAll(5)
	if fmt.Sprint(values(again)) != fmt.Sprint(values(first[:5])) {
		t.Fatalf("redelivered %v, nacked %v", values(again), values(first[:5]))
	}
	// A transactional ack with a write: abort releases the messages, commit applies them.
	txn, _ := c.BeginTxn(ctx, TxnOptions{})
	if err := sub.Ack(ctx, again, txn); err != nil {
		t.Fatal(err)
	}
	if err := sub.Ack(ctx, again[:1], nil); !errors.Is(err, ErrTransactionConflict) {
		t.Fatalf("a plain ack of a message pending in a transaction: %v", err)
	}
	producer.Send(ctx, out, Record{Value: []byte("aborted output")}, InTxn(txn))
	if err := txn.Abort(ctx); err != nil {
		t.Fatal(err)
	}
	redelivered := receiveAll(5)
	txn, _ = c.BeginTxn(ctx, TxnOptions{})
	producer.Send(ctx, out, Record{Value: []byte("committed output")}, InTxn(txn))
	if err := sub.Ack(ctx, redelivered, txn); err != nil {
		t.Fatal(err)
	}
	if err := txn.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	// Commit answered once the decision was durable; the markers (which apply the acks)
	// follow within moments.
	var cursors []Cursor
	settled := func() bool {
		cursors, err = sub.Describe(ctx)
		if err != nil {
			t.Fatal(err)
		}
		for _, cursor := range cursors {
			if cursor.CumulativeEndOffset != 10 || len(cursor.PendingTransactions) > 0 || len(cursor.IndividualAcks) > 0 {
				return false
			}
		}
		return len(cursors) == 2
	}
	for deadline := time.Now().Add(10 * time.Second); !settled(); time.Sleep(50 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("cursors %s", describeCursors(cursors))
		}
	}
	if got := values(readAll(t, ctx, c, out, ReadCommitted, 1)); fmt.Sprint(got) != "[committed output]" {
		t.Fatalf("output %v", got)
	}
	if messages, _ := sub.Receive(ctx, 300*time.Millisecond, 10); len(messages) != 0 {
		t.Fatalf("after everything was acked: %v", values(messages))
	}
	if err := sub.Close(ctx); err != nil {
		t.Fatal(err)
	}
}

func TestClusterOneCallTransactions(t *testing.T) {
	c, ctx := cluster(t)
	in := topic(t, ctx, c, "onecall-in", 1)
	out := topic(t, ctx, c, "onecall-out", 2)
	producer, _ := c.NewProducer(ctx, ProducerOptions{})
	defer producer.Close(ctx)
	for i := 0; i < 4; i++ {
		producer.Send(ctx, in, Record{Value: []byte(fmt.Sprint(i))})
	}
	producer.Flush(ctx)
	sub, _ := c.Subscribe(ctx, []string{in}, "onecall", SubscribeOptions{})
	messages, err := sub.Receive(ctx, 2*time.Second, 4)
	if err != nil || len(messages) != 4 {
		t.Fatalf("%d messages, %v", len(messages), err)
	}
	// Aborted (nothing sent), then committed with the acks.
	txn, _ := c.NewOneCallTxn(ctx, OneCallOptions{})
	txn.Send(ctx, out, Record{Value: []byte("never")}, ToPartition(0))
	if err := txn.Abort(ctx); err != nil {
		t.Fatal(err)
	}
	txn, _ = c.NewOneCallTxn(ctx, OneCallOptions{Compression: CompressionZstd, WaitForMarkers: true})
	for _, m := range messages {
		if err := txn.Send(ctx, out, Record{Key: m.Value, Value: append([]byte("out-"), m.Value...)}); err != nil {
			t.Fatal(err)
		}
	}
	if err := txn.AckCumulative(sub, messages[3]); err != nil {
		t.Fatal(err)
	}
	result, err := txn.Commit(ctx)
	if err != nil || result.ID.IsZero() || len(result.BaseOffsets) == 0 {
		t.Fatalf("%+v %v", result, err)
	}
	// The same key again (a retry after a lost answer): already ended, nothing twice.
	again, err := c.coordinatorStub(c.tcRoutes[txn.tc])
	if err != nil {
		t.Fatal(err)
	}
	reply, err := again.CommitTxn(ctx, &pb.CommitTxnRequest{TcPartition: txn.tc, IdempotencyKey: txn.Key(),
		Batches: []*pb.ProduceItem{{TopicPartition: TopicPartition{Topic: out, Partition: 0}.proto(),
			RecordBatch: mustBatch(t, "duplicate")}}})
	if err != nil || !reply.GetAlreadyEnded() || txnIDOf(reply.GetTxnId()) != result.ID {
		t.Fatalf("retried CommitTxn: %v %v", reply, err)
	}
	got := values(readAll(t, ctx, c, out, ReadCommitted, 4))
	sort.Strings(got)
	if fmt.Sprint(got) != "[out-0 out-1 out-2 out-3]" {
		t.Fatalf("output %v", got)
	}
	// WaitForMarkers: the ack is applied when Commit returns.
	if cursors, err := sub.Describe(ctx); err != nil || len(cursors) != 1 || cursors[0].CumulativeEndOffset != 4 {
		t.Fatalf("cursors %s %v", describeCursors(cursors), err)
	}
}

func describeCursors(cursors []Cursor) string {
	out := ""
	for _, c := range cursors {
		out += fmt.Sprintf("[%s: cumulative %d, individual %v, pending %v] ", c.TopicPartition,
			c.CumulativeEndOffset, c.IndividualAcks, c.PendingTransactions)
	}
	return out
}

func mustBatch(t *testing.T, value string) []byte {
	batch, err := EncodeColumnBatch([]Record{{Value: []byte(value)}}, BatchFields{BaseSequence: NoSequence})
	if err != nil {
		t.Fatal(err)
	}
	return batch
}

func TestClusterSessionFencing(t *testing.T) {
	c, ctx := cluster(t)
	name := topic(t, ctx, c, "fence", 2)
	id := "go-fence-" + randomKey()[3:11]
	old, err := c.NewProducer(ctx, ProducerOptions{TransactionalID: id})
	if err != nil {
		t.Fatal(err)
	}
	defer old.Close(ctx)
	txn, err := old.BeginTxn(ctx, TxnOptions{})
	if err != nil {
		t.Fatal(err)
	}
	f, _ := old.Send(ctx, name, Record{Value: []byte("fenced")}, ToPartition(0), InTxn(txn))
	if _, err := f.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	newer, err := c.NewProducer(ctx, ProducerOptions{TransactionalID: id})
	if err != nil {
		t.Fatal(err)
	}
	defer newer.Close(ctx)
	oldID, oldEpoch := old.ProducerID()
	newID, newEpoch := newer.ProducerID()
	if oldID != newID || newEpoch != oldEpoch+1 {
		t.Fatalf("session ids %d/%d then %d/%d", oldID, oldEpoch, newID, newEpoch)
	}
	if err := txn.Commit(ctx); !errors.Is(err, ErrProducerFenced) || IsRetriable(err) {
		t.Fatalf("the fenced producer's commit: %v", err)
	}
	if _, err := old.BeginTxn(ctx, TxnOptions{}); !errors.Is(err, ErrProducerFenced) {
		t.Fatalf("the fenced producer began again: %v", err)
	}
	ok, _ := newer.BeginTxn(ctx, TxnOptions{})
	f, _ = newer.Send(ctx, name, Record{Value: []byte("newer")}, ToPartition(1), InTxn(ok))
	if err := ok.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if got := values(readAll(t, ctx, c, name, ReadCommitted, 1)); fmt.Sprint(got) != "[newer]" {
		t.Fatalf("read %v", got)
	}
	// One-call transactions of the session are fenced the same way.
	oc, _ := newer.BeginOneCallTxn(ctx, OneCallOptions{})
	oc.Send(ctx, name, Record{Value: []byte("one-call newer")}, ToPartition(0))
	if _, err := oc.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	newest, err := c.NewProducer(ctx, ProducerOptions{TransactionalID: id})
	if err != nil {
		t.Fatal(err)
	}
	defer newest.Close(ctx)
	oc, _ = newer.BeginOneCallTxn(ctx, OneCallOptions{})
	oc.Send(ctx, name, Record{Value: []byte("one-call fenced")}, ToPartition(0))
	if _, err := oc.Commit(ctx); !errors.Is(err, ErrProducerFenced) {
		t.Fatalf("a fenced one-call commit: %v", err)
	}
	got := values(readAll(t, ctx, c, name, ReadCommitted, 2))
	sort.Strings(got)
	if fmt.Sprint(got) != "[newer one-call newer]" {
		t.Fatalf("read %v", got)
	}
}

func TestClusterCommitsOnTheCoordinatorsLinks(t *testing.T) {
	c, ctx := cluster(t)
	out := topic(t, ctx, c, "link", 2)
	plain := withoutLinks(t)
	for i, client := range []*Client{c, plain} {
		before := client.linkCalls.Load()
		// One-call transactions: CommitTxn.
		for j := 0; j < 3; j++ {
			txn, err := client.NewOneCallTxn(ctx, OneCallOptions{})
			if err != nil {
				t.Fatal(err)
			}
			txn.Send(ctx, out, Record{Value: []byte(fmt.Sprintf("one-call-%d-%d", i, j))}, ToPartition(int32(j%2)))
			if _, err := txn.Commit(ctx); err != nil {
				t.Fatal(err)
			}
		}
		// The streaming path: NewTxn ... EndTxn.
		producer, err := client.NewProducer(ctx, ProducerOptions{})
		if err != nil {
			t.Fatal(err)
		}
		txn, err := client.BeginTxn(ctx, TxnOptions{Timeout: 20 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		f, err := producer.Send(ctx, out, Record{Value: []byte(fmt.Sprintf("streaming-%d", i))}, ToPartition(0), InTxn(txn))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := f.Wait(ctx); err != nil {
			t.Fatal(err)
		}
		if err := txn.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		producer.Close(ctx)
		// 3 CommitTxn, NewTxn, EndTxn at least.
		checkLinkCalls(t, client, client == c, before, 5, "the coordinators' links")
	}
	got := values(readAll(t, ctx, c, out, ReadCommitted, 8))
	sort.Strings(got)
	if fmt.Sprint(got) != "[one-call-0-0 one-call-0-1 one-call-0-2 one-call-1-0 one-call-1-1 one-call-1-2 "+
		"streaming-0 streaming-1]" {
		t.Fatalf("read %v", got)
	}
}

// A subscription's Receive, Ack and Nack go on the partition servers' links (none with
// WithoutLinks), and deliver as over gRPC: every value acked once, the nacked ones back.
func TestClusterSubscriptionOnThePartitionServersLinks(t *testing.T) {
	c, ctx := cluster(t)
	in := topic(t, ctx, c, "sub-link", 3)
	preload(t, ctx, c, in, "s", 30, 3)
	plain := withoutLinks(t)
	for i, client := range []*Client{c, plain} {
		sub, err := client.Subscribe(ctx, []string{in}, fmt.Sprintf("links-%d", i), SubscribeOptions{AckTimeout: 10 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		before := client.linkCalls.Load()
		var acked []string
		nacked := map[string]bool{}
		deadline := time.Now().Add(30 * time.Second)
		for len(acked) < 30 && time.Now().Before(deadline) {
			messages, err := sub.Receive(ctx, 500*time.Millisecond, 10)
			if err != nil {
				t.Fatal(err)
			}
			var again, done []Message
			for _, m := range messages {
				if !nacked[string(m.Value)] && len(nacked) < 5 {
					nacked[string(m.Value)] = true
					again = append(again, m)
				} else {
					done = append(done, m)
				}
			}
			if len(again) > 0 {
				if err := sub.Nack(ctx, again, 0); err != nil {
					t.Fatal(err)
				}
			}
			if len(done) > 0 {
				if err := sub.Ack(ctx, done, nil); err != nil {
					t.Fatal(err)
				}
				acked = append(acked, values(done)...)
			}
		}
		sort.Strings(acked)
		if len(acked) != 30 || acked[0] != "s00" || acked[29] != "s29" || len(nacked) != 5 {
			t.Fatalf("client %d acked %v (nacked %d)", i, acked, len(nacked))
		}
		for j := 1; j < len(acked); j++ {
			if acked[j] == acked[j-1] {
				t.Fatalf("client %d acked %s twice", i, acked[j])
			}
		}
		// Receive, Nack, Ack at least once each.
		checkLinkCalls(t, client, client == c, before, 3, "the partition servers' links")
		sub.Close(ctx)
	}
}

// A consumer's Fetch calls go on the partition servers' links (none with WithoutLinks),
// and read the same records.
func TestClusterConsumerFetchesOnThePartitionServersLinks(t *testing.T) {
	c, ctx := cluster(t)
	in := topic(t, ctx, c, "fetch-link", 3)
	preload(t, ctx, c, in, "f", 12, 3)
	plain := withoutLinks(t)
	for i, client := range []*Client{c, plain} {
		before := client.linkCalls.Load()
		got := values(readAll(t, ctx, client, in, ReadCommitted, 12))
		sort.Strings(got)
		if len(got) != 12 || got[0] != "f00" || got[11] != "f11" {
			t.Fatalf("client %d read %v", i, got)
		}
		// A Fetch to each of the partitions' servers at least.
		checkLinkCalls(t, client, client == c, before, 3, "the partition servers' links (Fetch)")
	}
}

// A producer's Produce calls go on one pipelined connection to each partition server's
// link (pipeline.go), several unanswered at once, and every record is written once, in
// send order; WithoutLinks, over gRPC.
func TestClusterProducerProducesOnThePartitionServersLinks(t *testing.T) {
	c, ctx := cluster(t)
	plain := withoutLinks(t)
	for i, client := range []*Client{c, plain} {
		in := topic(t, ctx, client, "produce-link", 3)
		before := client.linkCalls.Load()
		producer, err := client.NewProducer(ctx, ProducerOptions{Linger: -1, BatchMaxBytes: 1024})
		if err != nil {
			t.Fatal(err)
		}
		sent := map[int32][]string{}
		var futures []*Future
		for n := 0; n < 200; n++ {
			for p := int32(0); p < 3; p++ {
				value := fmt.Sprintf("%d-%04d", p, n)
				sent[p] = append(sent[p], value)
				future, err := producer.Send(ctx, in, Record{Value: []byte(value)}, ToPartition(p))
				if err != nil {
					t.Fatal(err)
				}
				futures = append(futures, future)
			}
		}
		for _, future := range futures {
			if _, err := future.Wait(ctx); err != nil {
				t.Fatal(err)
			}
		}
		producer.Close(ctx)
		checkLinkCalls(t, client, client == c, before, 10, "the partition servers' links (Produce)")
		read := map[int32][]string{}
		for _, m := range readAll(t, ctx, client, in, ReadUncommitted, 600) {
			read[m.Partition] = append(read[m.Partition], string(m.Value))
		}
		for p := int32(0); p < 3; p++ {
			if fmt.Sprint(read[p]) != fmt.Sprint(sent[p]) {
				t.Fatalf("client %d: partition %d holds %d values, not the %d sent in order",
					i, p, len(read[p]), len(sent[p]))
			}
		}
		if client != c {
			continue
		}
		client.connMu.Lock()
		most, connects := 0, 0
		for _, link := range client.links {
			if link.pipe != nil {
				link.pipe.mu.Lock()
				most, connects = max(most, link.pipe.most), connects+link.pipe.connects
				link.pipe.mu.Unlock()
			}
		}
		client.connMu.Unlock()
		if most < 2 || connects == 0 {
			t.Fatalf("the pipelines had at most %d calls unanswered at once, over %d connections",
				most, connects)
		}
	}
}

func TestClusterDescribePartitionAndResetSubscription(t *testing.T) {
	c, ctx := cluster(t)
	name := topic(t, ctx, c, "describe", 1)
	tp := TopicPartition{Topic: name}
	producer, err := c.NewProducer(ctx, ProducerOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer producer.Close(ctx)
	for i := 0; i < 3; i++ {
		producer.Send(ctx, name, Record{Value: []byte(fmt.Sprintf("r%d", i))}, ToPartition(0))
	}
	if err := producer.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	// An open transaction holds the max read position at its first offset.
	txn, _ := c.BeginTxn(ctx, TxnOptions{Timeout: 30 * time.Second})
	for i := 3; i < 5; i++ {
		f, err := producer.Send(ctx, name, Record{Value: []byte(fmt.Sprintf("r%d", i))}, ToPartition(0), InTxn(txn))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := f.Wait(ctx); err != nil {
			t.Fatal(err)
		}
	}
	id, _ := txn.ID(ctx)
	d, err := c.DescribePartition(ctx, tp)
	if err != nil {
		t.Fatal(err)
	}
	if d.State != "ONLINE" || !d.TransactionBufferReady || d.HighWatermark != 5 || d.MaxReadPosition != 3 ||
		len(d.OpenTransactions) != 1 || d.OpenTransactions[0].ID != id || d.OpenTransactions[0].FirstOffset != 3 ||
		d.OpenTransactions[0].LastOffset != 4 || d.OpenTransactions[0].Age < 0 || d.ProducerCount != 1 || d.Raw == nil {
		t.Fatalf("with %v open: %+v", id, d)
	}
	if err := txn.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if d, err = c.DescribePartition(ctx, tp); err != nil {
			t.Fatal(err)
		}
		if len(d.OpenTransactions) == 0 && d.MaxReadPosition == d.HighWatermark && d.HighWatermark == 6 {
			break // the commit marker at offset 5
		}
		if time.Now().After(deadline) {
			t.Fatalf("after the commit: %+v", d)
		}
	}
	// Refused at once (callOwners checks a partition routing calls unknown after a
	// refresh), not retried until the context ends.
	for _, missing := range []TopicPartition{{Topic: name, Partition: 7}, {Topic: name + "-none"}} {
		began := time.Now()
		if _, err := c.DescribePartition(ctx, missing); Reason(err) != ReasonUnknownTopicOrPartition ||
			time.Since(began) > 5*time.Second {
			t.Fatalf("%v, which does not exist: %v after %v", missing, err, time.Since(began))
		}
	}

	sub, err := c.Subscribe(ctx, []string{name}, "rewind", SubscribeOptions{AckTimeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	receive := func(n int) []Message {
		var got []Message
		for deadline := time.Now().Add(20 * time.Second); len(got) < n && time.Now().Before(deadline); {
			messages, err := sub.Receive(ctx, 300*time.Millisecond, n-len(got))
			if err != nil {
				t.Fatal(err)
			}
			got = append(got, messages...)
		}
		if extra, _ := sub.Receive(ctx, 300*time.Millisecond, 10); len(got) != n || len(extra) != 0 {
			t.Fatalf("received %v and then %v, want %d", values(got), values(extra), n)
		}
		return got
	}
	all := receive(5)
	if err := sub.Ack(ctx, all, nil); err != nil {
		t.Fatal(err)
	}
	rewind := func(to Start, offset int64, want int64) {
		t.Helper()
		positions, err := sub.Reset(ctx, to, offset, time.Time{})
		if err != nil {
			t.Fatal(err)
		}
		if len(positions) != 1 || positions[tp] != want {
			t.Fatalf("reset to %d (offset %d): %v, want %d", to, offset, positions, want)
		}
	}
	rewind(StartEarliest, 0, 0)
	if got := values(receive(5)); fmt.Sprint(got) != fmt.Sprint(values(all)) {
		t.Fatalf("after a reset to the earliest: %v", got)
	}
	rewind(StartOffset, 2, 2)
	again := receive(3)
	if fmt.Sprint(values(again)) != "[r2 r3 r4]" {
		t.Fatalf("after a reset to offset 2: %v", values(again))
	}
	// A cursor holding a transaction's pending acks is not moved under it.
	pending, _ := c.BeginTxn(ctx, TxnOptions{Timeout: 30 * time.Second})
	if err := sub.Ack(ctx, again, pending); err != nil {
		t.Fatal(err)
	}
	if _, err := sub.Reset(ctx, StartLatest, 0, time.Time{}); !errors.Is(err, ErrTransactionConflict) {
		t.Fatalf("a reset under pending acks: %v", err)
	}
	if err := pending.Abort(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := sub.Reset(ctx, Start(99), 0, time.Time{}); Reason(err) != ReasonInvalidArgument {
		t.Fatalf("an unknown position: %v", err)
	}
	// Abort of a transaction that acked returned once its marker released the acks.
	_, err = sub.Reset(ctx, StartLatest, 0, time.Time{})
	if err != nil {
		t.Fatal(err)
	}
	receive(0)
}

func TestClusterDeleteRecords(t *testing.T) {
	c, ctx := cluster(t)
	name := fmt.Sprintf("go-trim-%s", randomKey()[3:11])
	if _, err := c.CreateTopic(ctx, name, 1, map[string]string{"segment.bytes": "65536"}); err != nil {
		t.Fatal(err)
	}
	tp := TopicPartition{Topic: name}
	producer, err := c.NewProducer(ctx, ProducerOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer producer.Close(ctx)
	value := make([]byte, 2000)
	for i := 0; i < 120; i++ { // one at a time: small batches, so the 64 KiB segments roll
		rand.Read(value)
		f, err := producer.Send(ctx, name, Record{Value: value}, ToPartition(0))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := f.Wait(ctx); err != nil {
			t.Fatal(err)
		}
	}
	starts, err := c.DeleteRecords(ctx, map[TopicPartition]int64{tp: 70})
	if err != nil {
		t.Fatal(err)
	}
	if start := starts[tp]; len(starts) != 1 || start <= 0 || start > 70 {
		t.Fatalf("log start after deleting below 70: %v", starts)
	}
	d, err := c.DescribePartition(ctx, tp)
	if err != nil || d.LogStartOffset != starts[tp] || d.HighWatermark != 120 {
		t.Fatalf("described after the delete: %+v, %v (starts %v)", d, err, starts)
	}
	// Past the high watermark, or negative: refused at once, nothing deleted.
	if _, err := c.DeleteRecords(ctx, map[TopicPartition]int64{tp: 121}); Reason(err) != ReasonOffsetOutOfRange {
		t.Fatalf("past the high watermark: %v", err)
	}
	if _, err := c.DeleteRecords(ctx, map[TopicPartition]int64{tp: -1}); Reason(err) != ReasonInvalidArgument {
		t.Fatalf("negative: %v", err)
	}
	if d, _ = c.DescribePartition(ctx, tp); d.LogStartOffset != starts[tp] {
		t.Fatalf("moved by a refused delete: %+v", d)
	}
}
