package main

import (
	"context"
	"flag"
	"fmt"
	"slices"
	"sync"
	"syscall"
	"time"

	"github.com/atomlog/atomlog/clients/go/atomlog"
)

// bench runs `clients` goroutines, each a loop of small one-call transactions (`records`
// values of `size` bytes over 4 partitions of `topic`, as bench/transactions.py's Python
// clients do) for `seconds`, on the coordinators' links or (-no-links) over gRPC. It prints
// transactions/s, commit latency percentiles and this process's CPU per transaction.
func bench(bootstrap string, args []string) error {
	flags := flag.NewFlagSet("bench", flag.ExitOnError)
	topic := flags.String("topic", "", "topic to write (at least 4 partitions)")
	seconds := flags.Float64("seconds", 10, "timed window")
	clients := flags.Int("clients", 8, "goroutines committing at once")
	records := flags.Int("records", 10, "records per transaction")
	size := flags.Int("size", 1024, "bytes per record")
	noLinks := flags.Bool("no-links", false, "every call over gRPC (atomlog.WithoutLinks)")
	flags.Parse(args)
	if *seconds <= 0 || *seconds > 600 || *clients < 1 || *clients > 256 || *records < 1 ||
		*records > 10_000 || *size < 0 || *size > 1<<20 {
		return fmt.Errorf("bench takes -seconds 0-600, -clients 1-256, -records 1-10000, -size 0-1048576")
	}
	options := []func(*atomlog.Options){atomlog.WithRequestTimeout(10 * time.Second)}
	if *noLinks {
		options = append(options, atomlog.WithoutLinks())
	}
	client, err := atomlog.Dial(bootstrap, options...)
	if err != nil {
		return err
	}
	defer client.Close()
	ctx := context.Background()
	partitions, err := client.Partitions(ctx, *topic)
	if err != nil {
		return err
	}
	if partitions < 4 {
		return fmt.Errorf("topic %s has %d partitions; bench needs 4", *topic, partitions)
	}
	value := make([]byte, *size)
	one := func(index int) (time.Duration, error) {
		txn, err := client.NewOneCallTxn(ctx, atomlog.OneCallOptions{})
		if err != nil {
			return 0, err
		}
		for i := 0; i < *records; i++ {
			partition := int32((index*4 + i%4) % partitions)
			if err := txn.Send(ctx, *topic, atomlog.Record{Value: value}, atomlog.ToPartition(partition)); err != nil {
				return 0, err
			}
		}
		began := time.Now()
		_, err = txn.Commit(ctx)
		return time.Since(began), err
	}
	for i := 0; i < 20; i++ { // warm up: connections, metadata
		if _, err := one(0); err != nil {
			return err
		}
	}
	var before syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &before)
	start := time.Now()
	deadline := start.Add(time.Duration(*seconds * float64(time.Second)))
	var mu sync.Mutex
	var commits []time.Duration
	var failure error
	var wg sync.WaitGroup
	for w := 0; w < *clients; w++ {
		wg.Add(1)
		go func(index int) {
			defer wg.Done()
			var mine []time.Duration
			for time.Now().Before(deadline) {
				took, err := one(index)
				if err != nil {
					mu.Lock()
					failure = err
					mu.Unlock()
					return
				}
				mine = append(mine, took)
			}
			mu.Lock()
			commits = append(commits, mine...)
			mu.Unlock()
		}(w)
	}
	wg.Wait()
	elapsed := time.Since(start).Seconds()
	if failure != nil {
		return failure
	}
	var after syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &after)
	cpu := time.Duration(after.Utime.Nano() + after.Stime.Nano() - before.Utime.Nano() - before.Stime.Nano())
	count := len(commits)
	if count == 0 {
		return fmt.Errorf("no transaction committed in %.1f s", elapsed)
	}
	slices.Sort(commits)
	emit(map[string]any{"transactions": count, "per_s": float64(count) / elapsed,
		"links": !*noLinks, "commit_p50_ms": ms(commits[count/2]),
		"commit_p99_ms":         ms(commits[min(count-1, count*99/100)]),
		"client_cpu_ms_per_txn": ms(cpu) / float64(count)})
	return nil
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
