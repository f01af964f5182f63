// Command atomlog-go drives the Go client from the shell: transactions, reads, a
// consume-transform-produce loop, and the record format. Every command prints JSON
// (one object, or one line per progress report for ctp). tests/test_go_client.py runs
// it against a real cluster; it is also a small example of the client's API.
//
//	atomlog-go [-bootstrap HOST:PORT] COMMAND [flags]   (default bootstrap: $ATOMLOG_BOOTSTRAP)
//
//	produce -topic T -count N [-rate R]       (idempotent, keyed; prints where each record went)
//	txn     -topic T -count N [-partitions P] [-prefix X] [-abort] [-one-call]
//	read    -topic T -expect N [-isolation read_committed|read_uncommitted]
//	fenced  -topic T -id TRANSACTIONAL_ID     (interactive: commits after a line on stdin)
//	ctp     -in I -out O -subscription S [-batch B] [-deadline 80s]
//	chaos-ctp -run-dir D -name N [-seed S]    (a worker of the chaos harness's ctp workload)
//	bench   -topic T [-seconds 10] [-clients 8] [-records 10] [-size 1024] [-no-links]
//	        (small one-call transactions: transactions/s, commit p50/p99, CPU per transaction)
//	decode  FILE          (concatenated batches -> their records)
//	encode  [-rows] [-compression none|zstd|lz4]   (JSON records on stdin -> one batch on stdout)
package main

import (
	"bufio"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"time"

	"github.com/atomlog/atomlog/clients/go/atomlog"
)

func main() {
	bootstrap := flag.String("bootstrap", os.Getenv("ATOMLOG_BOOTSTRAP"), "any server's address")
	flag.Usage = func() {
		fmt.Fprintln(os.Stderr, "usage: atomlog-go [-bootstrap HOST:PORT] produce|txn|read|fenced|ctp|chaos-ctp|bench|decode|encode [flags]")
	}
	flag.Parse()
	if flag.NArg() < 1 {
		flag.Usage()
		os.Exit(2)
	}
	command, args := flag.Arg(0), flag.Args()[1:]
	var err error
	switch command {
	case "decode":
		err = decode(args)
	case "encode":
		err = encode(args)
	case "chaos-ctp":
		err = chaosCtp(args)
	case "bench":
		err = bench(*bootstrap, args)
	case "produce", "txn", "read", "fenced", "ctp":
		var client *atomlog.Client
		client, err = atomlog.Dial(*bootstrap, atomlog.WithRequestTimeout(10*time.Second))
		if err == nil {
			defer client.Close()
			switch command {
			case "produce":
				err = produce(client, args)
			case "txn":
				err = txn(client, args)
			case "read":
				err = read(client, args)
			case "fenced":
				err = fenced(client, args)
			case "ctp":
				err = ctp(client, args)
			}
		}
	default:
		flag.Usage()
		os.Exit(2)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "atomlog-go:", err)
		os.Exit(1)
	}
}

func emit(v any) {
	line, _ := json.Marshal(v)
	fmt.Println(string(line))
}

// ------------------------------------------------------------------- produce

// produce sends values p-000000 ... keyed by value, at about `rate` records per second,
// with small batches, then waits for every future: each record's partition and offset,
// or its error.
func produce(client *atomlog.Client, args []string) error {
	flags := flag.NewFlagSet("produce", flag.ExitOnError)
	topic := flags.String("topic", "", "topic to write")
	count := flags.Int("count", 1000, "records")
	rate := flags.Int("rate", 0, "records per second (0: as fast as possible)")
	flags.Parse(args)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	producer, err := client.NewProducer(ctx, atomlog.ProducerOptions{Linger: time.Millisecond,
		BatchMaxBytes: 16 << 10})
	if err != nil {
		return err
	}
	defer producer.Close(ctx)
	began := time.Now()
	futures := make([]*atomlog.Future, *count)
	for i := range futures {
		if *rate > 0 {
			if wait := time.Until(began.Add(time.Duration(i) * time.Second / time.Duration(*rate))); wait > 0 {
				time.Sleep(wait)
			}
		}
		value := fmt.Sprintf("p-%06d", i)
		futures[i], err = producer.Send(ctx, *topic, atomlog.Record{Key: []byte(value), Value: []byte(value)})
		if err != nil {
			return err
		}
	}
	acked := [][3]any{}
	failed := map[string]int{}
	for i, f := range futures {
		meta, err := f.Wait(ctx)
		if err != nil {
			failed[reasonOf(err)]++
			continue
		}
		acked = append(acked, [3]any{fmt.Sprintf("p-%06d", i), meta.Partition, meta.Offset})
	}
	emit(map[string]any{"acked": acked, "failed": failed, "seconds": time.Since(began).Seconds(),
		"retries": producer.Stats().Retries})
	return nil
}

// ------------------------------------------------------------------- txn

func txn(client *atomlog.Client, args []string) error {
	flags := flag.NewFlagSet("txn", flag.ExitOnError)
	topic := flags.String("topic", "", "topic to write")
	count := flags.Int("count", 10, "records")
	partitions := flags.Int("partitions", 0, "spread over this many partitions (0: all)")
	prefix := flags.String("prefix", "go", "value prefix")
	abort := flags.Bool("abort", false, "abort instead of committing")
	oneCall := flags.Bool("one-call", false, "a one-call transaction (CommitTxn)")
	flags.Parse(args)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	n, err := client.Partitions(ctx, *topic)
	if err != nil {
		return err
	}
	if *partitions > 0 {
		n = min(n, *partitions)
	}
	var values []string
	result := map[string]any{}
	if *oneCall {
		t, err := client.NewOneCallTxn(ctx, atomlog.OneCallOptions{})
		if err != nil {
			return err
		}
		for i := 0; i < *count; i++ {
			value := fmt.Sprintf("%s-%06d", *prefix, i)
			values = append(values, value)
			if err := t.Send(ctx, *topic, atomlog.Record{Value: []byte(value)}, atomlog.ToPartition(int32(i%n))); err != nil {
				return err
			}
		}
		if *abort {
			err = t.Abort(ctx)
			result["outcome"] = "aborted"
		} else {
			var committed atomlog.OneCallResult
			committed, err = t.Commit(ctx)
			result["outcome"], result["txn"] = "committed", committed.ID.String()
		}
		if err != nil {
			return err
		}
		result["values"] = values
		emit(result)
		return nil
	}
	producer, err := client.NewProducer(ctx, atomlog.ProducerOptions{})
	if err != nil {
		return err
	}
	defer producer.Close(ctx)
	t, err := client.BeginTxn(ctx, atomlog.TxnOptions{Timeout: 30 * time.Second})
	if err != nil {
		return err
	}
	var futures []*atomlog.Future
	for i := 0; i < *count; i++ {
		value := fmt.Sprintf("%s-%06d", *prefix, i)
		values = append(values, value)
		f, err := producer.Send(ctx, *topic, atomlog.Record{Key: []byte(fmt.Sprint(i)), Value: []byte(value)},
			atomlog.ToPartition(int32(i%n)), atomlog.InTxn(t))
		if err != nil {
			return err
		}
		futures = append(futures, f)
	}
	if *abort {
		for _, f := range futures { // written (open) before the abort
			if _, err := f.Wait(ctx); err != nil {
				return err
			}
		}
		result["outcome"] = "aborted"
		err = t.Abort(ctx)
	} else {
		result["outcome"] = "committed"
		err = t.Commit(ctx)
	}
	if err != nil {
		return err
	}
	id, _ := t.ID(ctx)
	result["txn"], result["values"] = id.String(), values
	emit(result)
	return nil
}

// ------------------------------------------------------------------- read

func read(client *atomlog.Client, args []string) error {
	flags := flag.NewFlagSet("read", flag.ExitOnError)
	topic := flags.String("topic", "", "topic to read from the start")
	expect := flags.Int("expect", 0, "read until this many came, then a quiet second more")
	isolation := flags.String("isolation", "read_committed", "read_committed or read_uncommitted")
	timeout := flags.Duration("timeout", 30*time.Second, "give up after")
	flags.Parse(args)
	ctx, cancel := context.WithTimeout(context.Background(), *timeout+10*time.Second)
	defer cancel()
	level := atomlog.ReadCommitted
	if *isolation == "read_uncommitted" {
		level = atomlog.ReadUncommitted
	}
	consumer, err := client.NewConsumer(ctx, []string{*topic}, atomlog.ConsumerOptions{Isolation: level})
	if err != nil {
		return err
	}
	type message struct {
		Partition int32  `json:"partition"`
		Offset    int64  `json:"offset"`
		Key       []byte `json:"key"`
		Value     string `json:"value"`
	}
	messages := []message{}
	deadline := time.Now().Add(*timeout)
	quietSince := time.Now()
	for time.Now().Before(deadline) {
		batch, err := consumer.Poll(ctx, 200*time.Millisecond)
		if err != nil && !atomlog.IsRetriable(err) {
			return err
		}
		for _, m := range batch {
			messages = append(messages, message{Partition: m.Partition, Offset: m.Offset, Key: m.Key, Value: string(m.Value)})
		}
		if len(batch) > 0 {
			quietSince = time.Now()
		} else if len(messages) >= *expect && time.Since(quietSince) > time.Second {
			break
		}
	}
	emit(map[string]any{"messages": messages})
	return nil
}

// ------------------------------------------------------------------- fenced

// fenced: open a session, write in a transaction, then wait for a line on stdin (the
// test fences the session from another producer meanwhile) and try to commit.
func fenced(client *atomlog.Client, args []string) error {
	flags := flag.NewFlagSet("fenced", flag.ExitOnError)
	topic := flags.String("topic", "", "topic to write")
	id := flags.String("id", "", "transactional id")
	flags.Parse(args)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	producer, err := client.NewProducer(ctx, atomlog.ProducerOptions{TransactionalID: *id})
	if err != nil {
		return err
	}
	defer producer.Close(ctx)
	t, err := producer.BeginTxn(ctx, atomlog.TxnOptions{Timeout: 30 * time.Second})
	if err != nil {
		return err
	}
	f, err := producer.Send(ctx, *topic, atomlog.Record{Value: []byte("from-the-fenced-producer")},
		atomlog.ToPartition(0), atomlog.InTxn(t))
	if err != nil {
		return err
	}
	if _, err := f.Wait(ctx); err != nil {
		return err
	}
	pid, epoch := producer.ProducerID()
	txnID, _ := t.ID(ctx)
	emit(map[string]any{"step": "written", "producer_id": pid, "epoch": epoch, "txn": txnID.String()})
	bufio.NewReader(os.Stdin).ReadString('\n')
	report := map[string]any{"step": "done"}
	describe := func(name string, err error) {
		var e *atomlog.Error
		report[name] = nil
		if errors.As(err, &e) {
			report[name] = map[string]any{"reason": e.Reason, "retriable": e.Retriable(),
				"abortable": e.Abortable(), "fenced": errors.Is(err, atomlog.ErrProducerFenced)}
		} else if err != nil {
			report[name] = map[string]any{"reason": err.Error()}
		}
	}
	describe("commit", t.Commit(ctx))
	_, err = producer.BeginTxn(ctx, atomlog.TxnOptions{})
	describe("begin", err)
	emit(report)
	return nil
}

// ------------------------------------------------------------------- records

type jsonRecord struct {
	Key         *string     `json:"key"`   // base64, null: none
	Value       *string     `json:"value"` // base64, null: a null value
	Headers     [][2]string `json:"headers"`
	TimestampMs int64       `json:"timestamp_ms"`
}

func b64(b []byte) *string {
	if b == nil {
		return nil
	}
	s := base64.StdEncoding.EncodeToString(b)
	return &s
}

func unb64(s *string) ([]byte, error) {
	if s == nil {
		return nil, nil
	}
	return base64.StdEncoding.DecodeString(*s)
}

func decode(args []string) error {
	if len(args) != 1 {
		return fmt.Errorf("decode FILE")
	}
	data, err := os.ReadFile(args[0])
	if err != nil {
		return err
	}
	var out []map[string]any
	err = atomlog.SplitBatches(data, func(batch []byte, _ atomlog.Header) error {
		h, records, err := atomlog.DecodeBatch(batch)
		if err != nil {
			return err
		}
		list := []jsonRecord{}
		for _, r := range records {
			j := jsonRecord{Key: b64(r.Key), Value: b64(r.Value), TimestampMs: r.Timestamp.UnixMilli(),
				Headers: [][2]string{}}
			for _, header := range r.Headers {
				j.Headers = append(j.Headers, [2]string{header.Key, *b64(append([]byte{}, header.Value...))})
			}
			list = append(list, j)
		}
		out = append(out, map[string]any{"magic": h.Magic, "compression": h.Compression(),
			"producer_id": h.ProducerID, "base_sequence": h.BaseSequence, "records": list})
		return nil
	})
	if err != nil {
		emit(map[string]any{"error": atomlog.Reason(err), "message": err.Error()})
		return nil
	}
	emit(map[string]any{"batches": out})
	return nil
}

func encode(args []string) error {
	flags := flag.NewFlagSet("encode", flag.ExitOnError)
	rows := flags.Bool("rows", false, "the row format (magic 1) instead of columns (magic 2)")
	compression := flags.String("compression", "none", "none, zstd or lz4")
	flags.Parse(args)
	var input []jsonRecord
	if err := json.NewDecoder(os.Stdin).Decode(&input); err != nil {
		return err
	}
	records := make([]atomlog.Record, len(input))
	for i, j := range input {
		key, err := unb64(j.Key)
		if err != nil {
			return err
		}
		value, err := unb64(j.Value)
		if err != nil {
			return err
		}
		records[i] = atomlog.Record{Key: key, Value: value, Timestamp: time.UnixMilli(j.TimestampMs)}
		for _, h := range j.Headers {
			v, err := base64.StdEncoding.DecodeString(h[1])
			if err != nil {
				return err
			}
			records[i].Headers = append(records[i].Headers, atomlog.RecordHeader{Key: h[0], Value: v})
		}
	}
	fields := atomlog.BatchFields{BaseSequence: atomlog.NoSequence,
		Compression: map[string]atomlog.Compression{"none": atomlog.CompressionNone,
			"zstd": atomlog.CompressionZstd, "lz4": atomlog.CompressionLZ4}[*compression]}
	encoder := atomlog.EncodeColumnBatch
	if *rows {
		encoder = atomlog.EncodeRowBatch
	}
	batch, err := encoder(records, fields)
	if err != nil {
		return err
	}
	_, err = os.Stdout.Write(batch)
	return err
}
