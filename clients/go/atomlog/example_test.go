package atomlog_test

import (
	"context"
	"fmt"
	"time"

	"github.com/atomlog/atomlog/clients/go/atomlog"
)

// A consume-transform-produce step: the outputs and the acks of the inputs commit
// together (compiled by go test; clients/go/cmd/atomlog-go's ctp runs it for real).
func Example() {
	ctx := context.Background()
	client, err := atomlog.Dial("127.0.0.1:7000") // any server
	if err != nil {
		return
	}
	defer client.Close()
	producer, err := client.NewProducer(ctx, atomlog.ProducerOptions{})
	if err != nil {
		return
	}
	defer producer.Close(ctx)
	sub, err := client.Subscribe(ctx, []string{"requests"}, "billing", atomlog.SubscribeOptions{})
	if err != nil {
		return
	}
	messages, _ := sub.Receive(ctx, time.Second, 100)
	txn, _ := client.BeginTxn(ctx, atomlog.TxnOptions{})
	for _, m := range messages {
		producer.Send(ctx, "invoices", atomlog.Record{Key: m.Key, Value: m.Value}, atomlog.InTxn(txn))
	}
	sub.Ack(ctx, messages, txn) // pending until the transaction ends
	if err := txn.Commit(ctx); err != nil {
		txn.Abort(ctx)
		sub.Nack(ctx, messages, 0) // delivered again
		fmt.Println(atomlog.Reason(err), atomlog.IsRetriable(err))
	}
	consumer, _ := client.NewConsumer(ctx, []string{"invoices"}, atomlog.ConsumerOptions{}) // read_committed
	batch, _ := consumer.Poll(ctx, time.Second)
	fmt.Println(len(batch))
}
