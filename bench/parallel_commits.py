"""Benchmark (issue 19): coordinator.parallel_commits, two modes side by side in one run.

Two local clusters run at once (1 id allocator, 2 coordinators, 3 partition servers each,
one copy of every partition, as bench/transactions.py's cluster), the same but for
`coordinator.parallel_commits` (by default `off` and `auto`). One client process drives
them in turn, in blocks, the order of the two rotating from block to block, so that both
modes meet the same minutes of this shared, noisy machine; the figures are taken over
all blocks of a mode. Two sequential workloads, where a commit waits for its durability
rounds one after the other, and one of overlapping commits:

- **small**: one-call transactions of ten 1 KiB records over four partitions (as
  bench/transactions.py's small transactions), committed one after another by one
  client: commit latency, and the transactions per second of the blocks;
- **ctp**: consume-transform-produce as bench/transactions.py's sequential cell (poll
  100 inputs of one partition, send their 100 outputs with one send_batch(), ack the 100
  inputs in the transaction, commit), one transaction after another: inputs per second
  and commit latency;
- **open loop**: 8 client threads sharing a fixed rate of small transactions (each on
  its own schedule, latency counted from it): commits that overlap without saturating
  the machine, where the extra append of a parallel commit competes for the CPU.

Beside them: the TC-log appends per transaction and the share of commits that were
parallel commits (`atomlog_coordinator_parallel_commits_total`), from the coordinators'
metrics over the blocks; and plain Python's small os.write + os.fsync in the same run.

    .venv/bin/python bench/parallel_commits.py [--modes off,auto] [--blocks 12]
        [--small 40] [--ctp 8] [--open-rate 160] [--open-seconds 3] [--replication 1]
        [--combined] [--no-docs]
    .venv/bin/python bench/parallel_commits.py --setting NAME --modes A,B --combined --no-docs

With `--setting` the two sides differ in any other server setting instead: the same
blocks, an interleaved A/B of that setting (prints only).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.append(str(Path(__file__).resolve().parent))

import common  # noqa: E402

SMALL_TOPIC, PARTITIONS, RECORD = "pc-small", 16, b"x" * 1024
CTP_IN, CTP_OUT, CTP_BATCH, SUBSCRIPTION = "pc-in", "pc-out", 100, "pc"
OPEN_THREADS = 8
PARALLEL_COMMITS = "coordinator.parallel_commits"
BEGIN = "<!-- bench/parallel_commits.py: begin -->"
END = "<!-- bench/parallel_commits.py: end -->"


class Side:
    """One cluster of the comparison and the client's things on it."""

    def __init__(self, mode: str, address: str, report, ctp_inputs: int):
        from spark_client import Client

        self.mode = mode
        self.metrics = [p.metrics_address for p in report.cluster.processes
                        if p.role in ("coordinator", "combined")]
        self.client = Client(address)
        self.client.create_topic(SMALL_TOPIC, partitions=PARTITIONS)
        self.client.create_topic(CTP_IN, partitions=1)
        self.client.create_topic(CTP_OUT, partitions=1)
        time.sleep(1)  # the new partitions come online
        self.producer = self.client.producer(linger_ms=0)
        payload = os.urandom(1024)
        with self.client.producer(linger_ms=5) as loader:
            for _ in range(ctp_inputs):
                loader.send(CTP_IN, payload, partition=0)
        self.consumer = self.client.consumer(CTP_IN, subscription=SUBSCRIPTION,
                                             ack_timeout_s=120, prefetch=1_000)
        self.small_commits: list[float] = []
        self.small_seconds = self.small_count = 0.0
        self.ctp_commits: list[float] = []
        self.ctp_seconds = self.ctp_inputs = 0.0
        self.counted: list[tuple[float, float, int]] = []  # (appends, parallel, txns)
        self.open_commits: list[float] = []
        self.open_producers = [self.client.producer(linger_ms=0) for _ in range(OPEN_THREADS)]

    def counters(self) -> tuple[float, ...]:
        """(TC-log appends, parallel commits) so far, over the coordinators."""
        return common.counter_totals(
            self.metrics, ("atomlog_coordinator_log_append_duration_seconds_count",
                           "atomlog_coordinator_parallel_commits_total"))

    def reset(self) -> None:
        """Forget what was measured (the warm-up)."""
        self.small_commits.clear()
        self.ctp_commits.clear()
        self.open_commits.clear()
        self.small_seconds = self.small_count = self.ctp_seconds = self.ctp_inputs = 0.0
        self.counted.clear()

    def one_small(self, producer, first: int) -> float:
        """Begin, ten 1 KiB records over four partitions from `first` on, commit; the
        commit's seconds."""
        txn = self.client.begin_transaction(timeout_s=30)
        for record in range(10):
            producer.send(SMALL_TOPIC, RECORD, partition=(first + record % 4) % PARTITIONS,
                          txn=txn)
        committing = time.perf_counter()
        txn.commit()
        return time.perf_counter() - committing

    def small(self, transactions: int) -> None:
        before = self.counters()
        began = time.perf_counter()
        for i in range(transactions):
            self.small_commits.append(self.one_small(self.producer, i * 4))
        self.small_seconds += time.perf_counter() - began
        self.small_count += transactions
        self._count(before, transactions)

    def open_loop(self, rate: float, seconds: float, threads: int) -> None:
        """An open loop: `threads` client threads share `rate` small transactions a
        second, each on its own schedule (latency counted from the scheduled start, so a
        commit that falls behind is charged for its wait)."""
        import threading

        before = self.counters()
        interval = threads / rate
        began = time.perf_counter()
        counts = [0] * threads

        def run(index: int) -> None:
            producer = self.open_producers[index]
            scheduled = began + interval * index / threads
            while scheduled < began + seconds:
                pause = scheduled - time.perf_counter()
                if pause > 0:
                    time.sleep(pause)
                self.one_small(producer, index * 4)
                self.open_commits.append(time.perf_counter() - scheduled)
                counts[index] += 1
                scheduled += interval

        workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        self._count(before, sum(counts))

    def ctp(self, transactions: int) -> int:
        before = self.counters()
        began = time.perf_counter()
        done = 0
        for _ in range(transactions):
            messages = self.consumer.poll(timeout_s=5, max_records=CTP_BATCH)
            if not messages:
                break
            txn = self.client.begin_transaction(
                timeout_s=60, partitions=[(CTP_OUT, 0)],
                subscriptions=[(CTP_IN, 0, SUBSCRIPTION)])
            self.producer.send_batch(CTP_OUT, [m.value[::-1] for m in messages], partition=0,
                                     txn=txn)
            self.consumer.ack(messages, txn=txn)
            committing = time.perf_counter()
            txn.commit()
            self.ctp_commits.append(time.perf_counter() - committing)
            self.ctp_inputs += len(messages)
            done += 1
        self.ctp_seconds += time.perf_counter() - began
        self._count(before, done)
        return done

    def _count(self, before: tuple[float, float], transactions: int) -> None:
        after = self.counters()
        self.counted.append((after[0] - before[0], after[1] - before[1], transactions))

    def close(self) -> None:
        for producer in self.open_producers:
            producer.close()
        self.consumer.close()
        self.producer.close()
        self.client.close()


def ms(values: list[float], fraction: float) -> str:
    return f"{common.percentile(values, fraction) * 1e3:.1f}"


def ratios(side: Side, part: slice) -> tuple[float, float]:
    counted = side.counted[part]
    txns = sum(c[2] for c in counted) or 1
    return sum(c[0] for c in counted) / txns, sum(c[1] for c in counted) / txns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default="off,auto",
                        help="two values of coordinator.parallel_commits (of --setting), "
                             "comma-separated")
    parser.add_argument("--setting", default=PARALLEL_COMMITS,
                        help="the setting whose two values (--modes) the two sides take "
                             "instead of coordinator.parallel_commits (any server setting: "
                             "this tool as an interleaved A/B); other than the default: "
                             "prints only")
    parser.add_argument("--blocks", type=int, default=12,
                        help="blocks per workload and mode, in rotating order")
    parser.add_argument("--small", type=int, default=40, help="small transactions a block")
    parser.add_argument("--ctp", type=int, default=8,
                        help="consume-transform-produce transactions (100 inputs) a block")
    parser.add_argument("--open-rate", type=float, default=160.0,
                        help="small transactions a second of the open loop (8 client "
                             "threads; 0: no open-loop blocks)")
    parser.add_argument("--open-seconds", type=float, default=3.0,
                        help="seconds of open loop a block")
    parser.add_argument("--replication", type=int, default=common.BENCH_REPLICATION_FACTOR,
                        help="copies of every partition, __txn_log's included (0: the "
                             "product default, three with three partition servers); other "
                             "than 1: prints only")
    parser.add_argument("--combined", action="store_true",
                        help="two combined servers (every role in one process) instead of "
                             "two clusters; prints only")
    parser.add_argument("--no-docs", action="store_true", help="print only")
    args = parser.parse_args()
    modes = args.modes.split(",")
    if len(modes) != 2:
        parser.error("--modes takes two values, comma-separated")
    if args.setting == PARALLEL_COMMITS and any(m not in ("auto", "on", "off") for m in modes):
        parser.error("--modes takes two of auto, on, off")
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as scratch:
        fsync = common.fsync_baseline(Path(scratch))
    inputs = args.blocks * args.ctp * CTP_BATCH + 2 * CTP_BATCH
    shape = common.SHAPES["combined" if args.combined else "cluster"]
    with common.local_cluster("atomlog-pc-a-", shape, replication_factor=args.replication,
                              settings={args.setting: modes[0]}) as (_, a, a_at), \
            common.local_cluster("atomlog-pc-b-", shape,
                                 replication_factor=args.replication,
                                 settings={args.setting: modes[1]}) as (_, b, b_at):
        sides = [Side(modes[0], a_at, a, inputs), Side(modes[1], b_at, b, inputs)]
        try:
            for side in sides:  # warm: connections, producer ids, each TC partition's block
                side.small(64)
                side.ctp(1)
                side.reset()
            for block in range(args.blocks):
                for side in (sides if block % 2 == 0 else sides[::-1]):
                    side.small(args.small)
            for block in range(args.blocks):
                for side in (sides if block % 2 == 0 else sides[::-1]):
                    side.ctp(args.ctp)
            for block in range(args.blocks if args.open_rate else 0):
                for side in (sides if block % 2 == 0 else sides[::-1]):
                    side.open_loop(args.open_rate, args.open_seconds, OPEN_THREADS)
        finally:
            for side in sides:
                side.close()
    small_part, ctp_part = slice(0, args.blocks), slice(args.blocks, 2 * args.blocks)
    open_part = slice(2 * args.blocks, None)
    rows = []
    for side in sides:
        small_appends, small_parallel = ratios(side, small_part)
        ctp_appends, ctp_parallel = ratios(side, ctp_part)
        open_appends, open_parallel = ratios(side, open_part)
        open_cells = (f" {ms(side.open_commits, 0.5)} / {ms(side.open_commits, 0.9)} / "
                      f"{ms(side.open_commits, 0.99)} | {open_appends:.2f} "
                      f"({open_parallel:.0%}) |" if args.open_rate else " - | - |")
        rows.append(
            f"| `{side.mode}` | {side.small_count / side.small_seconds:,.0f} | "
            f"{ms(side.small_commits, 0.5)} / {ms(side.small_commits, 0.9)} / "
            f"{ms(side.small_commits, 0.99)} | {small_appends:.2f} ({small_parallel:.0%}) | "
            f"{side.ctp_inputs / side.ctp_seconds:,.0f} | {ms(side.ctp_commits, 0.5)} / "
            f"{ms(side.ctp_commits, 0.99)} | {ctp_appends:.2f} ({ctp_parallel:.0%}) |"
            + open_cells)
    first, second = sides
    gain_small = statistics.median(first.small_commits) / statistics.median(second.small_commits)
    gain_ctp = (second.ctp_inputs / second.ctp_seconds) / (first.ctp_inputs / first.ctp_seconds)
    command = common.command_line("bench/parallel_commits.py", sys.argv[1:])
    text = "\n".join([
        BEGIN,
        "## Parallel commits: two modes side by side (issue 19)",
        "",
        f"`{command}` — {time.strftime('%Y-%m-%d %H:%M')}, {common.machine(load)}.",
        "Two clusters at once (2 coordinators, 3 partition servers, one copy), differing only "
        "in `coordinator.parallel_commits`; one client drives them in turn, "
        f"{args.blocks} blocks per workload and mode, the order rotating (bench/"
        "parallel_commits.py's doc). **small**: one-call transactions of ten 1 KiB records "
        f"over four partitions, one after another ({args.small} a block). **ctp**: "
        "sequential consume-transform-produce, 100 inputs a transaction (poll, one "
        "send_batch() of the outputs, the acks in the transaction, commit; "
        f"{args.ctp} a block). **open loop**: 8 client threads share "
        f"{args.open_rate:g} small transactions a second, each on its schedule, "
        f"{args.open_seconds:g} s a block (latency from the scheduled start). Baseline in "
        "the same run: a small os.write + os.fsync takes "
        f"{fsync['p50']:.2f} ms (p50), {fsync['p99']:.2f} ms (p99).",
        "",
        "| parallel_commits | small txn/s | small commit p50 / p90 / p99 ms | TC-log appends "
        "a txn (parallel) | ctp inputs/s | ctp commit p50 / p99 ms | TC-log appends a txn "
        "(parallel) | open loop: transaction p50 / p90 / p99 ms | TC-log appends a txn "
        "(parallel) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        *rows,
        "",
        f"`{second.mode}` against `{first.mode}`: small commits' median latency "
        f"{1 / gain_small:.2f}x, consume-transform-produce {gain_ctp:.2f}x the inputs/s.",
        END,
    ])
    if args.combined:
        text = text.replace("Two clusters at once (2 coordinators, 3 partition servers, one "
                            "copy)", "Two combined servers at once (one copy)")
    if args.setting != PARALLEL_COMMITS:
        text = text.replace("`coordinator.parallel_commits`", f"`{args.setting}`").replace(
            "| parallel_commits |", f"| {args.setting} |")
    print(text)
    if args.replication != 1:
        text = text.replace("one copy)", f"{args.replication or 'the default number of'} "
                            "copies)")
    if not args.no_docs and not args.combined and args.replication == 1 and \
            args.setting == PARALLEL_COMMITS:
        common.write_docs_section(text + "\n", BEGIN, END)


if __name__ == "__main__":
    main()
