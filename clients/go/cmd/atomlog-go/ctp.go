package main

// A consume-transform-produce loop, written the way a user of the Go client would:
// receive a batch from a subscription of the input topic, open a transaction, send the
// transformed messages to the output topic in it, acknowledge the inputs in it, commit.
// On an error that is retriable or ends the transaction (abortable), the round aborts
// the transaction (or learns it committed after all) and negatively acknowledges its
// inputs so they come back. Nothing is de-duplicated on the output side: exactly-once is
// the transaction's job. A fatal error stops the loop.
//
// It stops once the subscription has acknowledged every input (every cursor at the end
// of the input topic, nothing pending), or at -deadline, and prints a JSON line of
// progress every 0.1 s and a last one with "done".

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"slices"
	"time"

	"github.com/atomlog/atomlog/clients/go/atomlog"
)

// transform is what the loop writes for an input (the Python tests' transform too).
func transform(value []byte) []byte {
	out := append([]byte("out:"), value...)
	slices.Reverse(out[4:])
	return out
}

type loop struct {
	client  *atomlog.Client
	sub     *atomlog.Subscription
	prod    *atomlog.Producer
	out     string
	outN    int
	batch   int
	stats   map[string]int
	timeout time.Duration
}

func ctp(client *atomlog.Client, args []string) error {
	flags := flag.NewFlagSet("ctp", flag.ExitOnError)
	in := flags.String("in", "", "input topic")
	out := flags.String("out", "", "output topic")
	subscription := flags.String("subscription", "", "subscription of the input")
	batch := flags.Int("batch", 20, "inputs per transaction")
	deadline := flags.Duration("deadline", 80*time.Second, "give up after")
	flags.Parse(args)
	began := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), *deadline+30*time.Second)
	defer cancel()

	// The end of the input (written before the loop starts).
	reader, err := client.NewConsumer(ctx, []string{*in}, atomlog.ConsumerOptions{Isolation: atomlog.ReadUncommitted})
	if err != nil {
		return err
	}
	ends, err := reader.EndOffsets(ctx)
	if err != nil {
		return err
	}
	sub, err := client.Subscribe(ctx, []string{*in}, *subscription, atomlog.SubscribeOptions{AckTimeout: 5 * time.Second})
	if err != nil {
		return err
	}
	// Short delivery timeout and transaction timeout, so that a dead server ends rounds
	// (they abort and their inputs come back) instead of stalling them.
	producer, err := client.NewProducer(ctx, atomlog.ProducerOptions{Linger: time.Millisecond,
		DeliveryTimeout: 10 * time.Second})
	if err != nil {
		return err
	}
	outN, err := client.Partitions(ctx, *out)
	if err != nil {
		return err
	}
	l := &loop{client: client, sub: sub, prod: producer, out: *out, outN: outN, batch: *batch,
		stats: map[string]int{}, timeout: 2 * time.Second}
	done := false
	reported := time.Now()
	var idleSince time.Time
	for time.Since(began) < *deadline {
		committed, err := l.step(ctx)
		if err != nil {
			return err
		}
		switch {
		case committed > 0:
			idleSince = time.Time{}
		case idleSince.IsZero():
			idleSince = time.Now()
		case time.Since(idleSince) > 500*time.Millisecond:
			idleSince = time.Now()
			if l.acknowledgedEverything(ctx, ends) {
				done = true
			}
		}
		if time.Since(reported) >= 100*time.Millisecond {
			reported = time.Now()
			l.report(began, nil)
		}
		if done {
			break
		}
	}
	closeCtx, closeCancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer closeCancel()
	producer.Close(closeCtx)
	sub.Close(closeCtx)
	l.report(began, &done)
	if !done {
		os.Exit(1)
	}
	return nil
}

func (l *loop) report(began time.Time, done *bool) {
	line := map[string]any{"t": time.Since(began).Round(100 * time.Millisecond).Seconds()}
	for k, v := range l.stats {
		line[k] = v
	}
	if done != nil {
		line["done"] = *done
	}
	emit(line)
}

// step is one round; it returns how many inputs it committed.
func (l *loop) step(ctx context.Context) (int, error) {
	messages, err := l.sub.Receive(ctx, 200*time.Millisecond, l.batch)
	if err != nil {
		if err := l.expected(err, "receive"); err != nil {
			return 0, err
		}
		time.Sleep(100 * time.Millisecond)
		if len(messages) == 0 {
			return 0, nil
		}
	}
	if len(messages) == 0 {
		return 0, nil
	}
	l.stats["delivered"] += len(messages)
	txn, err := l.client.BeginTxn(ctx, atomlog.TxnOptions{Timeout: l.timeout})
	if err != nil {
		if err := l.expected(err, "begin"); err != nil {
			return 0, err
		}
		l.giveBack(ctx, messages)
		return 0, nil
	}
	roundCtx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	err = func() error {
		for _, m := range messages {
			_, err := l.prod.Send(roundCtx, l.out, atomlog.Record{Key: m.Key, Value: transform(m.Value)},
				atomlog.ToPartition(m.Partition%int32(l.outN)), atomlog.InTxn(txn))
			if err != nil {
				return err
			}
		}
		if err := l.sub.Ack(roundCtx, messages, txn); err != nil {
			return err
		}
		return txn.Commit(roundCtx)
	}()
	if err != nil {
		if err := l.expected(err, "round"); err != nil {
			return 0, err
		}
		abortCtx, abortCancel := context.WithTimeout(ctx, 15*time.Second)
		defer abortCancel()
		switch abortErr := txn.Abort(abortCtx); {
		case errors.Is(abortErr, atomlog.ErrTransactionAlreadyCommitted):
			l.stats["committed_after_error"]++ // the commit went through after all
		case abortErr != nil:
			// The coordinator aborts it at its timeout; its acks are released then.
			if err := l.expected(abortErr, "abort"); err != nil {
				return 0, err
			}
			l.giveBack(ctx, messages)
			return 0, nil
		default:
			l.stats["aborted"]++
			l.giveBack(ctx, messages)
			return 0, nil
		}
	}
	l.stats["committed"] += len(messages)
	l.stats["transactions"]++
	return len(messages), nil
}

func (l *loop) giveBack(ctx context.Context, messages []atomlog.Message) {
	nackCtx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if err := l.sub.Nack(nackCtx, messages, 0); err != nil {
		l.stats["nack:"+reasonOf(err)]++ // the ack timeout redelivers them
	}
}

func reasonOf(err error) string {
	if reason := atomlog.Reason(err); reason != "" {
		return reason
	}
	if errors.Is(err, context.DeadlineExceeded) {
		return "DEADLINE"
	}
	return "OTHER"
}

// expected counts a retriable or abortable error (or a round running out of time);
// anything else is a bug and stops the loop.
func (l *loop) expected(err error, where string) error {
	if atomlog.IsRetriable(err) || atomlog.IsAbortable(err) || errors.Is(err, context.DeadlineExceeded) {
		l.stats[where+":"+reasonOf(err)]++
		return nil
	}
	return fmt.Errorf("%s: %w", where, err)
}

func (l *loop) acknowledgedEverything(ctx context.Context, ends map[atomlog.TopicPartition]int64) bool {
	describeCtx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	cursors, err := l.sub.Describe(describeCtx)
	if err != nil {
		l.stats["describe:"+reasonOf(err)]++
		return false
	}
	if len(cursors) != len(ends) {
		return false
	}
	for _, c := range cursors {
		if c.CumulativeEndOffset < ends[c.TopicPartition] || len(c.PendingTransactions) > 0 || len(c.IndividualAcks) > 0 {
			return false
		}
	}
	return true
}
