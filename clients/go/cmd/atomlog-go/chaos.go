package main

// chaos-ctp: the Go client as a worker of the chaos harness's ctp workload (tests/chaos,
// docs/verification.md). It runs the loop the Python workers run, on the Go client's
// streaming transaction path, and writes its half of the history the way their EventLog
// does (tests/chaos/history.py): one JSON line when an operation is invoked and one when
// it completes, to <run-dir>/events-<name>.jsonl, flushed at once, so a kill -9 leaves
// its in-flight operation behind as an invocation.
//
// Each round: receive 3-50 inputs from the subscription ("poll"), then one transaction
// ("txn") that sends "out:<value>" of each input to partition input-partition % outputs
// of the output topic, acks the inputs in it, and commits. A round that ends aborted is
// tried again with the same inputs after a pause of 0.3-0.6 s, up to twice (the same
// records to the same partitions right behind the aborted attempt's), then its inputs
// are nacked. It stops
// at SIGTERM (after the operation in hand) or at the workload's deadline.

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"math/rand"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/atomlog/atomlog/clients/go/atomlog"
)

const (
	chaosMinBatch    = 3 // one per partition server, as the Python workers
	chaosMaxBatch    = 50
	chaosRetries     = 2
	chaosTxnTimeout  = 2 * time.Second
	chaosSendTimeout = 15 * time.Second
	chaosTransform   = "out:"
	chaosRetryPause  = 300 * time.Millisecond // to twice that, before an aborted round's retry
)

// chaosSpec is what the worker reads of the run's workload.json.
type chaosSpec struct {
	Bootstrap    []string          `json:"bootstrap"`
	Topics       map[string]int    `json:"topics"`
	AckTimeoutS  float64           `json:"ack_timeout_s"`
	Deadline     float64           `json:"deadline"`
	Incarnations map[string]int    `json:"incarnations"`
	InputTopic   string            `json:"input_topic"`
	OutputTopic  string            `json:"output_topic"`
	Subscription string            `json:"subscription"`
	TLS          map[string]string `json:"tls"` // a --tls run's client files (ca, cert, key)
}

// eventLog writes the worker's events (tests/chaos/history.py's EventLog format).
type eventLog struct {
	file    *os.File
	process string
	pid     int
	next    int
}

func (l *eventLog) write(line map[string]any) {
	text, _ := json.Marshal(line)
	l.file.Write(append(text, '\n')) //nolint:errcheck // nothing to do about a full disk here
}

func now() float64 { return float64(time.Now().UnixNano()) / 1e9 }

func (l *eventLog) invoke(f string, fields map[string]any) string {
	id := fmt.Sprintf("%s/%d/%d", l.process, l.pid, l.next)
	l.next++
	line := map[string]any{"event": "invoke", "id": id, "process": l.process, "f": f, "time": now()}
	for k, v := range fields {
		line[k] = v
	}
	l.write(line)
	return id
}

func (l *eventLog) complete(id, outcome string, fields map[string]any) {
	line := map[string]any{"event": "complete", "id": id, "time": now(), "outcome": outcome}
	for k, v := range fields {
		line[k] = v
	}
	l.write(line)
}

type chaosWorker struct {
	client  *atomlog.Client
	spec    chaosSpec
	log     *eventLog
	rng     *rand.Rand
	stop    atomic.Bool
	session string
	outputs int
}

func chaosCtp(args []string) error {
	flags := flag.NewFlagSet("chaos-ctp", flag.ExitOnError)
	runDir := flags.String("run-dir", "", "the chaos run's directory (its workload.json)")
	name := flags.String("name", "", "this worker's process name in the history")
	seed := flags.Int64("seed", 0, "seed of its batch sizes")
	flags.Parse(args)
	if *runDir == "" || *name == "" {
		return errors.New("chaos-ctp needs -run-dir and -name")
	}
	raw, err := os.ReadFile(filepath.Join(*runDir, "workload.json"))
	if err != nil {
		return err
	}
	var spec chaosSpec
	if err := json.Unmarshal(raw, &spec); err != nil {
		return fmt.Errorf("workload.json: %w", err)
	}
	options := []func(*atomlog.Options){atomlog.WithRequestTimeout(10 * time.Second)}
	if len(spec.TLS) > 0 { // a --tls run: mTLS with the admin certificate, as its Python workers
		options = append(options, atomlog.WithTLS(atomlog.TLSConfig{CAFile: spec.TLS["ca_file"],
			CertFile: spec.TLS["cert_file"], KeyFile: spec.TLS["key_file"]}))
	}
	client, err := atomlog.Dial(strings.Join(spec.Bootstrap, ","), options...)
	if err != nil {
		return err
	}
	defer client.Close()
	file, err := os.OpenFile(filepath.Join(*runDir, "events-"+*name+".jsonl"),
		os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		return err
	}
	defer file.Close()
	w := &chaosWorker{client: client, spec: spec, rng: rand.New(rand.NewSource(*seed)),
		log:     &eventLog{file: file, process: *name, pid: os.Getpid()},
		session: fmt.Sprintf("%s/%d", *name, spec.Incarnations[*name]),
		outputs: spec.Topics[spec.OutputTopic]}
	if w.outputs <= 0 {
		return fmt.Errorf("workload.json has no partition count for %q", spec.OutputTopic)
	}
	signals := make(chan os.Signal, 1)
	signal.Notify(signals, syscall.SIGTERM, syscall.SIGINT)
	go func() {
		<-signals
		w.stop.Store(true)
	}()
	return w.run()
}

func (w *chaosWorker) stopped() bool {
	return w.stop.Load() || now() >= w.spec.Deadline
}

func (w *chaosWorker) run() error {
	ctx := context.Background()
	var sub *atomlog.Subscription
	for sub == nil {
		if w.stopped() {
			return nil
		}
		var err error
		sub, err = w.client.Subscribe(ctx, []string{w.spec.InputTopic}, w.spec.Subscription,
			atomlog.SubscribeOptions{AckTimeout: time.Duration(w.spec.AckTimeoutS * float64(time.Second))})
		if err != nil {
			time.Sleep(500 * time.Millisecond) // the servers it needs are down
		}
	}
	producer, err := w.client.NewProducer(ctx, atomlog.ProducerOptions{Linger: time.Millisecond,
		DeliveryTimeout: chaosSendTimeout})
	if err != nil {
		return err
	}
	defer func() {
		closeCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		producer.Close(closeCtx) //nolint:errcheck // unacknowledged records are the history's business
		sub.Close(closeCtx)      //nolint:errcheck
	}()
	var again []atomlog.Message
	retries := 0
	for !w.stopped() {
		messages := again
		again = nil
		if messages != nil {
			// A moment first: until the abort's marker reaches the subscription, the
			// inputs are still held by the aborted transaction's acks.
			time.Sleep(chaosRetryPause + time.Duration(w.rng.Int63n(int64(chaosRetryPause))))
		} else {
			retries = 0
			messages = w.poll(ctx, sub)
			if len(messages) == 0 {
				continue
			}
		}
		switch result := w.transaction(ctx, sub, producer, messages); {
		case result == "aborted" && retries < chaosRetries:
			retries++
			again = messages
		case result == "aborted":
			nackCtx, cancel := context.WithTimeout(ctx, 5*time.Second)
			sub.Nack(nackCtx, messages, 0) //nolint:errcheck // else the ack timeout redelivers them
			cancel()
		}
	}
	return nil
}

func (w *chaosWorker) poll(ctx context.Context, sub *atomlog.Subscription) []atomlog.Message {
	op := w.log.invoke("poll", map[string]any{"session": w.session, "isolation": "read_committed",
		"subscription": w.spec.Subscription})
	count := chaosMinBatch + w.rng.Intn(chaosMaxBatch-chaosMinBatch+1)
	messages, err := sub.Receive(ctx, 300*time.Millisecond, count)
	records := make([][]any, 0, len(messages))
	for _, m := range messages {
		records = append(records, []any{m.Topic, m.Partition, m.Offset, string(m.Value)})
	}
	if err != nil && len(messages) == 0 {
		w.log.complete(op, "fail", map[string]any{"records": records, "error": reasonOf(err)})
		time.Sleep(200 * time.Millisecond)
		return nil
	}
	w.log.complete(op, "ok", map[string]any{"records": records})
	return messages
}

// transaction runs one round's transaction and logs it; its result is "committed",
// "aborted" or "unknown".
func (w *chaosWorker) transaction(ctx context.Context, sub *atomlog.Subscription,
	producer *atomlog.Producer, messages []atomlog.Message) string {
	outputs := make([]atomlog.Record, len(messages))
	partitions := make([]int32, len(messages))
	writes := make([][]any, 0, len(messages))
	acks := make([][]any, 0, len(messages))
	for i, m := range messages {
		outputs[i] = atomlog.Record{Key: m.Key, Value: []byte(chaosTransform + string(m.Value))}
		partitions[i] = m.Partition % int32(w.outputs)
		writes = append(writes, []any{w.spec.OutputTopic, partitions[i], string(outputs[i].Value)})
		acks = append(acks, []any{w.spec.Subscription, m.Topic, m.Partition, m.Offset})
	}
	txn, err := w.client.BeginTxn(ctx, atomlog.TxnOptions{Timeout: chaosTxnTimeout})
	if err != nil {
		return "aborted" // nothing began
	}
	op := w.log.invoke("txn", map[string]any{"writes": writes, "acks": acks, "decision": "commit",
		"producer": w.session})
	var txnID any // null until the transaction is opened at the coordinator
	roundCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	err = func() error {
		for i, record := range outputs {
			_, err := producer.Send(roundCtx, w.spec.OutputTopic, record,
				atomlog.ToPartition(partitions[i]), atomlog.InTxn(txn))
			if err != nil {
				return err
			}
		}
		if err := sub.Ack(roundCtx, messages, txn); err != nil {
			return err
		}
		if id, err := txn.ID(roundCtx); err == nil {
			txnID = id.String()
		}
		return txn.Commit(roundCtx)
	}()
	if err == nil {
		w.log.complete(op, "ok", map[string]any{"result": "committed", "txn_id": txnID})
		return "committed"
	}
	result := w.settle(ctx, txn)
	outcome := "unknown"
	if result == "aborted" {
		outcome = "fail"
	}
	w.log.complete(op, outcome, map[string]any{"result": result, "error": reasonOf(err),
		"txn_id": txnID})
	return result
}

// settle aborts a transaction whose round failed, and learns from that what became of
// it (a commit whose answer was lost may have gone through).
func (w *chaosWorker) settle(ctx context.Context, txn *atomlog.Txn) string {
	for range 3 {
		abortCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
		err := txn.Abort(abortCtx)
		cancel()
		switch {
		case err == nil:
			return "aborted"
		case errors.Is(err, atomlog.ErrTransactionAlreadyCommitted):
			return "committed"
		case w.stopped():
			return "unknown"
		}
		time.Sleep(500 * time.Millisecond)
	}
	return "unknown"
}
