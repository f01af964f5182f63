"""Benchmark (issue 6): transactions on the partition servers, through the Python SDK.

Starts its own local cluster in a temporary directory (1 id allocator, 2 coordinators,
3 partition servers, ZooKeeper), then measures:

1. Small transactions: C concurrent client processes (default 8), each in a loop:
   begin_transaction, 10 records of 1 KiB over 4 partitions, commit() (which waits for
   the sends, then for the durable decision). Transactions/s and commit() p50/p99, plus
   the whole transaction's p50/p99.
2. Produce throughput of one producer writing 1 KiB records as fast as it can for D
   seconds: idempotent without transactions, with a transaction committed every 100 ms
   by commit() (waiting), and the same by commit_async() (the next transaction produces
   while the last commits). The overhead is the relative loss of records/s. Each cell
   starts with the kernel's page cache dropped when run as root (common.drop_page_cache:
   on this VM a run's later cells otherwise paid twice the kernel time per record).
3. Fetch throughput of everything written in (2) from the start: read_committed vs
   read_uncommitted (one consumer, same data, MB/s).
4. Consume-transform-produce (peers-bench W3): 20,000 preloaded 1 KiB inputs (untimed);
   one worker process repeats poll 100 inputs from a subscription (its consumer
   prefetches 900 more per Receive, as a RabbitMQ consumer's prefetch count, and sends
   the next Receive in the background once it holds 500: one Receive per five polls),
   send 100 outputs (the input's bytes reversed; in one send_batch(), as
   PostgreSQL's W3 inserts them with one executemany(), or with --ctp-send each in one
   send() apiece) and ack the 100 inputs, all in one transaction, commit; it stops at
   the first empty poll. Twice, on
   topics of their own: sequentially (ack(), commit(), as the peers) and pipelined
   (ack_async() before the sends, commit_async(), up to 8 transactions committing while
   the worker polls on). Inputs/s (timed from the first poll to the empty one, and to the
   last commit), batch and commit p50/p99, the RPCs per batch over every process (from
   their /metrics) and the CPU of each process over the window.

Baselines in the same run: one small os.write + os.fsync (latency), plain Python
appending the same bytes to a file with an fsync per 256 KiB (MB/s), and the rate of
do-nothing gRPC calls between two Python processes (the ceiling per call any design
pays here; small transactions report their calls per transaction next to it).

Prints a table and writes its section of docs/benchmarks.md (with --only-ctp, only the
consume-transform-produce part of it).

    .venv/bin/python bench/transactions.py [--clients 8] [--seconds 10] [--combined] [--no-docs]
    .venv/bin/python bench/transactions.py --only-ctp [--ctp-partitions 1] [--ctp-inputs 20000] [--profile F]
    .venv/bin/python bench/transactions.py --combined --only-small [--seconds 30] [--profile F]
    .venv/bin/python bench/transactions.py --combined --only-small --clients 1 --loop-steps
    .venv/bin/python bench/transactions.py --combined --only-small --count-calls
    .venv/bin/python bench/transactions.py --combined --only-small --rate 200  # open loop
    .venv/bin/python bench/transactions.py --only-small --streaming [--no-client-links]  # A/B
    .venv/bin/python bench/transactions.py --only-stream 6 [--seconds 10]  # the cells of (2), in turns
    .venv/bin/python bench/transactions.py ... --set coordinator.parallel_commits=false  # A/B
    .venv/bin/python bench/transactions.py ... --fsync-delay-ms 5  # as on a slow disk

--only-small runs the small-transactions cell alone (one-call, after the gRPC call floor)
and prints transactions/s, the server's CPU per transaction (utime + stime of every
server process over the timed window, from /proc: the figure that holds on a noisy
machine), its fsyncs per transaction and commit p50/p90/p99/max; --profile records the
server with py-spy (--profile-worker: the first client instead);
ATOMLOG_BENCH_LATENCIES_OUT=FILE appends each commit's client index, end
(time.perf_counter, one clock for every process) and latency in ms to FILE, to tell
bursts that stall every client at once from queueing spread over the run;
--rate R makes it an open loop of R transactions a second in all (latencies from each
transaction's scheduled start: the latency at a load below the maximum);
--streaming runs the streaming path's small transactions instead, --no-client-links has
the clients call their coordinators over gRPC instead of on the coordinators' links.
--only-stream TURNS runs the three cells of (2) once each to warm the cluster (not
counted), then TURNS times, rotating their order, and prints each turn's overheads
against its own idempotent cell and their medians.
--loop-steps (with --only-small) has every server count and time its event-loop
callbacks over the window, by the task or callback that ran, and prints the steps and
ms per transaction of each: a change that removes steps shows in the counts, which a
noisy machine does not move, where its time may hide in the noise. --count-calls counts
the servers' Python-level calls per transaction instead, by module (cProfile).
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing
import os
import re
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.append(str(REPO / "bench"))  # after the packages: bench/coordinator.py is a script

import common  # noqa: E402


BEGIN, END = "<!-- bench/transactions.py: begin -->", "<!-- bench/transactions.py: end -->"
CTP_BEGIN = "<!-- bench/transactions.py consume-transform-produce: begin -->"
CTP_END = "<!-- bench/transactions.py consume-transform-produce: end -->"
TITLE = "## Transactions on the partition servers (issue 6)"
SHAPE = "A local cluster (1 id allocator, 2 coordinators, 3 partition servers, ZooKeeper)"
ROLES = {"id_allocator": 1, "coordinator": 2, "partition_server": 3}


def use_combined_server() -> None:
    """--combined: the same cells on the combined server (every role in one process, its
    server-to-server calls in-process), in a section of their own."""
    global BEGIN, END, CTP_BEGIN, CTP_END, TITLE, SHAPE, ROLES
    BEGIN, END, CTP_BEGIN, CTP_END = (marker.replace("bench/transactions.py",
                                                     "bench/transactions.py --combined")
                                      for marker in (BEGIN, END, CTP_BEGIN, CTP_END))
    TITLE = "## Transactions on the combined server (issue 19)"
    SHAPE = ("The combined server (one process hosting the partition server, coordinator and "
             "id allocator; calls between them are function calls) and ZooKeeper")
    ROLES = {"combined": 1}
SMALL_TOPIC, STREAM_TOPIC = "bench-small-txn", "bench-txn-stream"
ON_LINK = "on the link: "  # rpc_counts' prefix of the calls taken on a server's link
CTP_IN, CTP_OUT, CTP_SUBSCRIPTION = "bench-ctp-in", "bench-ctp-out", "bench-ctp"
CTP_BATCH = 100
CTP_DEPTH = 8  # pipelined: transactions committing at once (the SDK's commit threads: 16)
# The worker's consumer asks each Receive for this many inputs beyond the poll's 100 and
# keeps them for its next polls (as RabbitMQ's prefetch count); once it holds half of
# that, the next Receive tops it up in the background: one Receive per five polls.
CTP_PREFETCH = 9 * CTP_BATCH
CTP_PER_RECEIVE = CTP_BATCH + CTP_PREFETCH  # inputs the first Receive delivers
_PREFETCH_NOTE = (f"the consumer prefetches {CTP_PREFETCH} more per Receive, as a RabbitMQ "
                  f"consumer's prefetch count, and sends the next Receive in the background "
                  f"when it holds {CTP_PER_RECEIVE // 2}: one Receive per "
                  f"{CTP_PER_RECEIVE // 2 // CTP_BATCH} polls")
PARTITIONS = 16
RECORD = b"x" * 1024



# ------------------------------------------------------------------ small transactions
def small_client(address: str, index: int, seconds: float, start_at: float, out,
                 one_call_max_bytes: int = 1 << 20, links: bool = True,
                 rate_per_s: float = 0.0, phase: float = 0.0, gather: bool = True) -> None:
    """One client process's loop of small transactions: back to back (closed loop), or
    with `rate_per_s` one beginning every 1/rate_per_s seconds (open loop), the first
    `phase` of an interval after the start (so that the clients do not begin together).
    Open-loop latencies count from the transaction's scheduled start, so a client that
    fell behind its schedule is charged for the wait (no coordinated omission)."""
    from spark_client import Client

    client = Client(address, one_call_max_bytes=one_call_max_bytes, links=links,
                    gather_one_calls=gather)
    partitions = [(index * 4 + i) % PARTITIONS for i in range(4)]
    commits, totals, count = [], [], 0
    # A diagnostic: with ATOMLOG_BENCH_LATENCIES_OUT=FILE, each commit's end
    # (time.perf_counter) and latency (the module doc).
    timeline = [] if os.environ.get("ATOMLOG_BENCH_LATENCIES_OUT") else None
    with client.producer(linger_ms=0) as producer:
        for _ in range(5):  # warm up: connections, producer registration, verification path
            txn = client.begin_transaction(timeout_s=30)
            for i in range(10):
                producer.send(SMALL_TOPIC, RECORD, partition=partitions[i % 4], txn=txn)
            txn.commit()
        while time.time() < start_at:
            time.sleep(0.001)
        deadline = start_at + seconds
        profiler = None  # --count-calls: the first client's calls too
        if index == 0 and os.environ.get(COUNT_CALLS_ENV):
            import cProfile
            profiler = cProfile.Profile()
            profiler.enable()
        cpu_before = time.process_time()
        interval = 1 / rate_per_s if rate_per_s else 0.0
        scheduled = time.perf_counter() + interval * phase  # open loop: perf_counter's clock
        while time.time() < deadline:
            if interval:
                pause = scheduled - time.perf_counter()
                if pause > 0:
                    time.sleep(pause)
                    if time.time() >= deadline:
                        break
                began = scheduled
                scheduled += interval
            else:
                began = time.perf_counter()
            txn = client.begin_transaction(timeout_s=30)
            for i in range(10):
                producer.send(SMALL_TOPIC, RECORD, partition=partitions[i % 4], txn=txn)
            committing = time.perf_counter()
            txn.commit()
            ended = time.perf_counter()
            commits.append(ended - committing)  # open loop: `totals` count the lag too
            totals.append(ended - began)
            if timeline is not None:
                timeline.append((ended, ended - committing))
            count += 1
        cpu = time.process_time() - cpu_before
        calls = 0
        if profiler is not None:
            profiler.disable()
            profiler.create_stats()
            calls = sum(entry[1] for entry in profiler.stats.values())
    client.close()
    if timeline is not None:
        with open(os.environ["ATOMLOG_BENCH_LATENCIES_OUT"], "a") as f:
            f.writelines(f"{index} {at:.6f} {latency * 1e3:.3f}\n" for at, latency in timeline)
    out.put((count, commits, totals, cpu, calls))


def dump_metrics(addresses: list[str], suffix: str = "") -> None:
    """A diagnostic: with ATOMLOG_BENCH_METRICS_OUT=FILE, the servers' /metrics after a
    cell into FILE (FILE plus `suffix` for the CTP cells)."""
    if os.environ.get("ATOMLOG_BENCH_METRICS_OUT"):
        Path(os.environ["ATOMLOG_BENCH_METRICS_OUT"] + suffix).write_text("".join(
            urllib.request.urlopen(f"http://{a}/metrics", timeout=10).read().decode()
            for a in addresses))


LOOP_STEPS_ENV = "ATOMLOG_BENCH_LOOP_STEPS"  # bench/loop_steps/sitecustomize.py's folder
COUNT_CALLS_ENV = "ATOMLOG_BENCH_COUNT_CALLS"  # with it: calls by module, not steps


def loop_steps_on(folder: str, calls: bool = False) -> None:
    """Servers started from now on count their event-loop callbacks
    (bench/loop_steps/sitecustomize.py), or with `calls` their Python-level calls by
    module, writing into `folder`."""
    os.environ[LOOP_STEPS_ENV] = folder
    if calls:
        os.environ[COUNT_CALLS_ENV] = "1"
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parent / "loop_steps"),
         *filter(None, [os.environ.get("PYTHONPATH")])])


def loop_steps_signal(pids: list[int], signum: int) -> list[int]:
    """Signal the servers that carry the counter (its ready file): SIGUSR1 clears the
    counts, SIGUSR2 writes them. Returns the pids signalled."""
    folder = os.environ.get(LOOP_STEPS_ENV)
    if not folder:
        return []
    carrying = [pid for pid in pids if (Path(folder) / f"ready-{pid}").exists()]
    for pid in carrying:
        os.kill(pid, signum)
    return carrying


def loop_steps_read(pids: list[int], transactions: int, timeout_s: float = 10) -> dict:
    """The counts the servers `pids` wrote, summed, per transaction: {what ran: [steps,
    ms]}, largest time first, with "all" last."""
    folder = Path(os.environ[LOOP_STEPS_ENV])
    totals: dict[str, list] = {}
    deadline = time.monotonic() + timeout_s
    for pid in pids:
        path = folder / f"loop-{pid}.json"
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        for key, (steps, seconds) in json.loads(path.read_text()).items():
            entry = totals.setdefault(key, [0, 0.0])
            entry[0] += steps
            entry[1] += seconds
        path.unlink()
    per = max(transactions, 1)
    ranked = sorted(totals.items(), key=lambda item: -item[1][1])
    out = {key: [steps / per, seconds * 1e3 / per] for key, (steps, seconds) in ranked}
    out["all"] = [sum(v[0] for v in totals.values()) / per,
                  sum(v[1] for v in totals.values()) * 1e3 / per]
    return out


def loop_steps_text(steps: dict, rows: int = 15) -> str:
    lines = (["Python-level calls per transaction on the servers' event loops, by module "
              "(calls, ms of their own under cProfile):"] if os.environ.get(COUNT_CALLS_ENV)
             else ["event-loop steps per transaction, by what ran (steps, ms):"])
    for key, (count, ms) in list(steps.items())[:rows]:
        if key != "all":
            lines.append(f"  {count:7.2f} {ms:7.3f}  {key}")
    count, ms = steps["all"]
    lines.append(f"  {count:7.2f} {ms:7.3f}  all ({len(steps) - 1} kinds)")
    return "\n".join(lines)


def small_transactions(report, address: str, clients: int, seconds: float,
                       one_call: bool = True, profile: Path | None = None,
                       links: bool = True, profile_worker: bool = False,
                       rate_per_s: float = 0.0, profile_role: str | None = None,
                       gather: bool = True) -> dict:
    """`clients` processes in a loop of small transactions (one-call ones, or with
    one_call False the streaming path: NewTxn, Produce, EndTxn) for `seconds`: back to
    back, or with `rate_per_s` an open loop of that many transactions a second in all
    (small_client). `profile`: py-spy records the first server over the window into that
    file (with `profile_worker` the first client process instead; with `profile_role`
    the first server of that role). Servers started
    after loop_steps_on() also count their event-loop steps over the window
    ("loop_steps"). `gather`: Client(gather_one_calls=...)."""
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    start_at = time.time() + 8 + clients * 0.5
    workers = [context.Process(target=small_client, args=(
        address, i, seconds, start_at, out, (1 << 20) if one_call else 0, links,
        rate_per_s / clients, i / clients, gather)) for i in range(clients)]
    for worker in workers:
        worker.start()
    services = [p for p in report.cluster.processes if p.role != "zookeeper"]
    metrics = [p.metrics_address for p in services]
    time.sleep(max(0.0, start_at - time.time()))
    print(f"timed window starts: server pids {[p.pid for p in services]}", flush=True)
    counting = loop_steps_signal([p.pid for p in services], signal.SIGUSR1)
    probe = common.CpuProbe(seconds)  # the machine's own jitter over the same window
    before = rpc_counts(metrics)  # the timed window: warm-up calls are behind us
    cpu_before = {p.name: common.cpu_seconds(p.pid) for p in services}
    threads_before = {p.name: common.thread_cpu_seconds(p.pid) for p in services}
    spy = None
    if profile is not None:
        profiled = [p for p in services if profile_role in (None, p.role)]
        if not profiled:
            raise SystemExit(f"--profile-role {profile_role}: no such server here")
        spy = common.py_spy(workers[0].pid if profile_worker else profiled[0].pid,
                            profile, seconds)
    results = [out.get(timeout=seconds + 300) for _ in workers]
    loop_steps_signal(counting, signal.SIGUSR2)
    jitter = probe.result()
    by_role: Counter = Counter()  # CPU seconds of the window, by the servers' roles
    for p in services:
        by_role[p.role] += common.cpu_seconds(p.pid) - cpu_before[p.name]
    server_cpu = sum(by_role.values())
    # By kind of thread, summed over the servers: what holds the GIL (the event loops,
    # the other Python threads) and what does not (io_uring's kernel workers, gRPC's).
    threads: Counter = Counter()
    busiest_loop = 0.0  # seconds of the busiest server's event-loop thread
    for p in services:
        for kind, value in common.thread_cpu_seconds(p.pid).items():
            threads[kind] += value - threads_before[p.name].get(kind, 0.0)
            if kind == "event loop":
                busiest_loop = max(busiest_loop,
                                   value - threads_before[p.name].get(kind, 0.0))
    after = rpc_counts(metrics)
    for worker in workers:
        worker.join()
    if spy is not None:
        spy.wait(60)
    dump_metrics(metrics)
    count = sum(r[0] for r in results)
    calls = sum(after[m] - before[m] for m in after
                if not m.startswith(("TC log", "in-process", "fsyncs", ON_LINK, "gc ")))
    full_gcs = after["gc full count"] - before["gc full count"]
    local = sum(after[m] - before[m] for m in after if m.startswith("in-process"))
    commits = [c for r in results for c in r[1]]
    totals = [t for r in results for t in r[2]]
    client_cpu = sum(r[3] for r in results)
    steps = loop_steps_read(counting, count) if counting else None
    profiled_client = [r for r in results if r[4]]  # --count-calls: the first client's
    return {"clients": clients, "transactions": count, "per_s": count / seconds,
            "one_call": one_call, "scheduled_per_s": rate_per_s,
            "calls_per_txn": calls / max(count, 1),
            "local_calls_per_txn": local / max(count, 1),
            "link_calls_per_txn": sum(after[m] - before[m] for m in after
                                      if m.startswith(ON_LINK)) / max(count, 1),
            "calls_by_method": {m: (after[m] - before[m]) / max(count, 1) for m in after
                                if after[m] - before[m] > 0
                                and not m.startswith(("fsyncs", "gc "))},
            # The servers' full garbage collections in the window: each holds its process.
            "full_gcs": full_gcs,
            "full_gc_ms": (after["gc full sum"] - before["gc full sum"]) * 1e3,
            "full_gcs_over_10ms": full_gcs - (after["gc full short"]
                                              - before["gc full short"]),
            # Group commits of the partitions' owners per transaction, and the sync calls
            # that made them durable (fewer with the durability barrier: one syncfs
            # answers many; without it, one fsync each).
            "fsyncs_per_txn": (after["fsyncs"] - before["fsyncs"]) / max(count, 1),
            "sync_calls_per_txn": ((after["fsyncs barrier"] - before["fsyncs barrier"])
                                   or (after["fsyncs"] - before["fsyncs"])) / max(count, 1),
            "server_cpu_ms_per_txn": server_cpu / max(count, 1) * 1e3,
            "server_cpu_ms_per_txn_by_role": {role: value / max(count, 1) * 1e3
                                              for role, value in by_role.most_common()},
            "server_thread_cpu_ms_per_txn": {kind: value / max(count, 1) * 1e3
                                             for kind, value in threads.most_common()},
            # The share of the window the busiest server's event-loop thread was on a CPU.
            "busiest_event_loop_busy": busiest_loop / seconds,
            "client_cpu_ms_per_txn": client_cpu / max(count, 1) * 1e3,
            "commit_p50_ms": common.percentile(commits, 0.5) * 1e3,
            "commit_p90_ms": common.percentile(commits, 0.9) * 1e3,
            "commit_p99_ms": common.percentile(commits, 0.99) * 1e3,
            "commit_max_ms": max(commits, default=float("nan")) * 1e3,
            "txn_p50_ms": common.percentile(totals, 0.5) * 1e3,
            "txn_p99_ms": common.percentile(totals, 0.99) * 1e3,
            "machine_jitter": jitter,
            **({"loop_steps": steps} if steps is not None else {}),
            **({"client_calls_per_txn": profiled_client[0][4] / max(profiled_client[0][0], 1)}
               if profiled_client else {})}


def bounds_text(small: dict, floor: dict, combined: bool) -> str:
    """The rates this CPU per transaction allows (common.cpu_bounds) beside the measured
    one: how far the cell is from the machine, and what a target must cost."""
    bounds = common.cpu_bounds(small)
    text = (f"client CPU {small['client_cpu_ms_per_txn']:.2f} ms per transaction (floor: "
            f"{floor['client_cpu_ms_per_call']:.2f} ms per call); CPU bound "
            f"{bounds['machine']:,.0f} transactions/s ({bounds['cores']} cores ÷ servers' "
            "+ clients' CPU per transaction)")
    if combined:
        text += f", event-loop bound {bounds['event_loop']:,.0f}/s (1 s ÷ its CPU per transaction)"
    return text


# ------------------------------------------------------------------ throughput
STREAM_MODES = ("plain", "commit", "commit_async")
WARM_UP_S = 3.0  # each stream cell once before --only-stream's turns


def stream(address: str, seconds: float, mode: str, partition: int) -> dict:
    """One producer, 1 KiB records to one partition for `seconds`. mode "plain": no
    transactions; "commit": a transaction committed every 100 ms with commit(), which
    waits; "commit_async": the same with commit_async(), the next transaction producing
    while the last one commits (at most one commit outstanding)."""
    from spark_client import Client

    if mode not in STREAM_MODES:
        raise ValueError(f"stream mode must be one of {STREAM_MODES}, not {mode!r}")
    common.drop_page_cache()  # each cell starts alike (common.drop_page_cache)
    transactional = mode != "plain"
    client = Client(address)
    sent = 0
    with client.producer(linger_ms=5) as producer:
        began = time.perf_counter()
        deadline = began + seconds
        txn, txn_began, committing = None, began, None
        while True:
            now = time.perf_counter()
            if transactional and (txn is None or now - txn_began >= 0.1):
                if txn is not None and mode == "commit":
                    txn.commit()
                elif txn is not None:
                    if committing is not None:
                        committing.result()
                    committing = txn.commit_async()
                if now >= deadline:
                    if committing is not None:
                        committing.result()
                    break
                txn, txn_began = client.begin_transaction(timeout_s=60), time.perf_counter()
            elif not transactional and now >= deadline:
                break
            for _ in range(256):
                producer.send(STREAM_TOPIC, RECORD, partition=partition, txn=txn)
            sent += 256
        producer.flush()
        elapsed = time.perf_counter() - began
    client.close()
    return {"records": sent, "seconds": elapsed, "per_s": sent / elapsed,
            "mb_s": sent * len(RECORD) / elapsed / 1e6}


def stream_turns(address: str, seconds: float, turns: int) -> None:
    """The three stream cells `turns` times, the order rotated each turn (each cell on a
    partition of its own, as in the full run): the transactional cells' overhead against
    the idempotent cell of the same turn, and the medians."""
    overheads: dict[str, list[float]] = {"commit": [], "commit_async": []}
    # A turn of warm-up, not counted: on a cluster just started, the first cell ran up to
    # half as fast as the same cell later (2026-12-05: idempotent 80,721 records/s first,
    # 120-139k after), and the first turn always began with the idempotent cell.
    for mode in STREAM_MODES:
        stream(address, min(seconds, WARM_UP_S), mode, STREAM_MODES.index(mode))
    for turn in range(turns):
        order = STREAM_MODES[turn % 3:] + STREAM_MODES[:turn % 3]
        got = {mode: stream(address, seconds, mode, STREAM_MODES.index(mode)) for mode in order}
        line = [f"turn {turn + 1} ({', '.join(order)}): idempotent {got['plain']['per_s']:,.0f}"]
        for mode in ("commit", "commit_async"):
            overhead = 1 - got[mode]["per_s"] / got["plain"]["per_s"]
            overheads[mode].append(overhead)
            line.append(f"{mode}() {got[mode]['per_s']:,.0f} ({overhead:+.1%})")
        print(" records/s; ".join(line), flush=True)
    print("median overhead: " + "; ".join(
        f"{mode}() {statistics.median(values):+.1%}" for mode, values in overheads.items()),
        flush=True)


def fetch_all(address: str, partition: int, isolation: str) -> dict:
    from spark_client import Client

    client = Client(address)
    with client.consumer(STREAM_TOPIC, isolation=isolation) as consumer:
        ends = consumer.end_offsets()
        for (topic, p), offset in ends.items():
            if p != partition:
                consumer.seek(topic, p, offset)  # read only `partition`
        end = ends[(STREAM_TOPIC, partition)]
        records = size = 0
        began = time.perf_counter()
        for messages in consumer.read_until({(STREAM_TOPIC, partition): end},
                                            max_records=100_000):
            records += len(messages)
            size += sum(len(message.value or b"") for message in messages)
        elapsed = time.perf_counter() - began
    client.close()
    return {"isolation": isolation, "records": records, "mb_s": size / elapsed / 1e6}


# ------------------------------------------------------------------ consume-transform-produce
def rpc_counts(metrics_addresses: list[str]) -> Counter:
    """atomlog_rpc_started_total by method, summed over every process, plus the
    coordinators' TC log appends of transaction records ("TC log appends") and the
    records in them ("TC log records")."""
    counts: Counter = Counter()
    rpc = re.compile(r'^atomlog_rpc_started_total\{method="/atomlog\.v1\.([^"]+)"\} (\S+)$',
                     re.M)
    appends = re.compile(r"^atomlog_coordinator_log_append_duration_seconds_count(?:\{\})? (\S+)$",
                         re.M)
    records = re.compile(r"^atomlog_coordinator_log_records_per_append_sum(?:\{\})? (\S+)$", re.M)
    local = re.compile(r'^atomlog_local_calls_total\{method="/atomlog\.v1\.([^"]+)"\} (\S+)$',
                       re.M)
    # Of the calls above, those a partition server took on its link (coordinators' calls;
    # partition_server/copy_link.py), not through gRPC.
    linked = re.compile(r'^atomlog_link_calls_total\{method="/atomlog\.v1\.([^"]+)"\} (\S+)$',
                        re.M)
    fsyncs = re.compile(r"^atomlog_partition_fsyncs_total(?:\{\})? (\S+)$", re.M)
    # The durability barrier's syncfs/fsync calls (partition_server/durability.py); the
    # owners' group commits above are what asked for them.
    syncs = re.compile(r'^atomlog_durability_syncs_total\{kind="[a-z]+"\} (\S+)$', re.M)
    # Full garbage collections (services/runtime.py, watch_gc_pauses): how many, their
    # time in all, and how many took longer than 10 ms.
    full_gc = re.compile(r'^atomlog_gc_pause_seconds_(count|sum)\{generation="2"\} (\S+)$',
                         re.M)
    long_gc = re.compile(r'^atomlog_gc_pause_seconds_bucket\{generation="2",le="0\.01"\} '
                         r'(\S+)$', re.M)
    for address in metrics_addresses:
        text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
        for method, value in rpc.findall(text):
            counts[method] += float(value)
        counts["TC log appends"] += sum(float(v) for v in appends.findall(text))
        counts["TC log records"] += sum(float(v) for v in records.findall(text))
        counts["fsyncs"] += sum(float(v) for v in fsyncs.findall(text))
        counts["fsyncs barrier"] += sum(float(v) for v in syncs.findall(text))
        for kind, value in full_gc.findall(text):
            counts[f"gc full {kind}"] += float(value)
        counts["gc full short"] += sum(float(v) for v in long_gc.findall(text))
        for method, value in local.findall(text):  # the combined server's function calls
            counts[f"in-process {method}"] += float(value)
        for method, value in linked.findall(text):
            counts[f"{ON_LINK}{method}"] += float(value)
    return counts


def ctp_worker(address: str, inputs: int, partitions: int, processes: dict[str, int],
               metrics_addresses: list[str], out, pipelined: bool, suffix: str,
               one_call_max_bytes: int = 1 << 20, profile: str | None = None,
               profile_worker: bool = False, depth: int = CTP_DEPTH,
               commit_threads: int | None = None, send_batch: bool = True,
               profile_names: list[str] | None = None) -> None:
    """One worker: preload (untimed), then the loop of peers-bench W3 (with `profile`,
    py-spy records the first server process over the loop into that file, or with
    `profile_worker` this worker, the client side, or with `profile_names` each of those
    servers into that file's name with -NAME before its extension). Sequential (as the
    peers): each transaction commits before the next poll. Pipelined: the ack goes out
    with ack_async() (it opens the transaction on the consumer's ack thread while the
    worker sends), the commit with commit_async(), and the worker polls the next batch
    while up to `depth` transactions commit (on `commit_threads` commit threads: the
    SDK's default when None)."""
    from spark_client import Client

    topic_in, topic_out, subscription = CTP_IN + suffix, CTP_OUT + suffix, CTP_SUBSCRIPTION
    client = Client(address, one_call_max_bytes=one_call_max_bytes,
                    **({} if commit_threads is None else {"commit_threads": commit_threads}))
    payload = os.urandom(1024)  # as peers-bench: one random 1 KiB buffer per client
    with client.producer(linger_ms=5) as producer:
        futures = [producer.send(topic_in, payload, partition=i % partitions)
                   for i in range(inputs)]
        producer.flush()
    for future in futures:
        future.result(0)
    consumer = client.consumer(topic_in, subscription=subscription, ack_timeout_s=120,
                               prefetch=CTP_PREFETCH)
    producer = client.producer(linger_ms=5)
    producer.send(topic_out, b"warm-up", partition=0).result(30)  # connection, producer id
    batches, commits, done, transactions, polling_s = [], [], 0, 0, 0.0
    in_flight: collections.deque = collections.deque()
    servers_before = {name: common.cpu_seconds(pid) for name, pid in processes.items()}
    rpcs_before = rpc_counts(metrics_addresses)
    spies = []
    if profile is not None:
        if profile_worker or not profile_names:
            spies.append(common.py_spy(
                os.getpid() if profile_worker else next(iter(processes.values())), profile))
        else:
            spies += [common.py_spy(processes[name], Path(profile).with_name(
                f"{Path(profile).stem}-{name}{Path(profile).suffix}")) for name in profile_names]
        time.sleep(1)  # py-spy attaches
    # Servers started after loop_steps_on() count their event-loop steps over the loop.
    counting = loop_steps_signal(list(processes.values()), signal.SIGUSR1)
    client_before = time.process_time()
    began = time.perf_counter()
    while True:
        started = time.perf_counter()
        messages = consumer.poll(timeout_s=0, max_records=CTP_BATCH)
        polling_s += time.perf_counter() - started
        if not messages:
            break
        # Output partitions and input cursors named up front: one NewTxn registers them all.
        inputs_at = {message.partition for message in messages}
        txn = client.begin_transaction(
            timeout_s=60, partitions=[(topic_out, p) for p in inputs_at],
            subscriptions=[(topic_in, p, subscription) for p in inputs_at])
        if pipelined:
            consumer.ack_async(messages, txn=txn)
        if send_batch:  # the outputs in one call, as PostgreSQL's executemany() in W3
            producer.send_batch(topic_out, [message.value[::-1] for message in messages],
                                partition=(next(iter(inputs_at)) if len(inputs_at) == 1
                                           else [message.partition for message in messages]),
                                txn=txn)
        else:
            for message in messages:
                producer.send(topic_out, message.value[::-1], partition=message.partition,
                              txn=txn)
        if not pipelined:
            consumer.ack(messages, txn=txn)
        committing = time.perf_counter()
        if pipelined:
            future = txn.commit_async()
            future.add_done_callback(lambda _, s=started, c=committing: (
                batches.append(time.perf_counter() - s), commits.append(time.perf_counter() - c)))
            in_flight.append(future)
            while len(in_flight) >= depth:
                in_flight.popleft().result()
        else:
            txn.commit()
            ended = time.perf_counter()
            batches.append(ended - started)
            commits.append(ended - committing)
        done += len(messages)
        transactions += 1
    for future in in_flight:
        future.result()
    seconds = time.perf_counter() - began
    loop_steps_signal(counting, signal.SIGUSR2)
    for spy in spies:
        spy.send_signal(signal.SIGINT)  # py-spy writes what it recorded and exits
    for spy in spies:
        spy.wait(60)
    settle = time.monotonic() + 5  # done callbacks may run just after result() returns
    while len(batches) < transactions and time.monotonic() < settle:
        time.sleep(0.001)
    client_cpu = time.process_time() - client_before
    servers = {name: common.cpu_seconds(pid) - servers_before[name]
               for name, pid in processes.items()}
    rpcs = rpc_counts(metrics_addresses) - rpcs_before
    left = sum(c.backlog_records + len(c.pending_acks) for c in consumer.describe())
    producer.close()
    consumer.close()
    client.close()
    out.put({"inputs": done, "seconds": seconds, "per_s": done / seconds,
             "batches": transactions, "partitions": partitions, "pipelined": pipelined,
             "depth": depth, "commit_threads": client.commit_threads,
             "send_batch": send_batch,
             "batch_p50_ms": common.percentile(batches, 0.5) * 1e3,
             "batch_p99_ms": common.percentile(batches, 0.99) * 1e3,
             "commit_p50_ms": common.percentile(commits, 0.5) * 1e3,
             "commit_p99_ms": common.percentile(commits, 0.99) * 1e3,
             "poll_share": polling_s / seconds,
             **({"loop_steps": loop_steps_read(counting, transactions)} if counting else {}),
             "client_cpu_s": client_cpu, "server_cpu_s": servers, "input_left": left,
             "rpcs_per_batch": {m: n / max(1, transactions) for m, n in rpcs.items() if n}})


def consume_transform_produce(report, address: str, inputs: int, partitions: int,
                              pipelined: bool = False, one_call: bool = True,
                              profile: Path | None = None, profile_worker: bool = False,
                              run: int = 0, depth: int = CTP_DEPTH,
                              commit_threads: int | None = None,
                              send_batch: bool = True, profile_role: str | None = None) -> dict:
    """One cell on topics of its own (`run` > 0: the run-th repeat of the cell, on topics
    named for it)."""
    from spark_client import Client

    suffix = (("-pipelined" if pipelined else "") + ("" if one_call else "-streaming")
              + (f"-run{run}" if run else ""))
    with Client(address) as client:
        client.create_topic(CTP_IN + suffix, partitions=partitions)
        client.create_topic(CTP_OUT + suffix, partitions=partitions)
    time.sleep(1)  # the new partitions come online
    services = [p for p in report.cluster.processes if p.role != "zookeeper"]
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    worker = context.Process(target=ctp_worker, args=(
        address, inputs, partitions, {p.name: p.pid for p in services},
        [p.metrics_address for p in services], out, pipelined, suffix,
        (1 << 20) if one_call else 0,
        None if profile is None else str(profile.with_name(profile.stem + suffix + profile.suffix)),
        profile_worker, depth, commit_threads, send_batch,
        None if profile_role is None else [p.name for p in services if p.role == profile_role]))
    worker.start()
    result = out.get(timeout=600)
    worker.join()
    dump_metrics([p.metrics_address for p in services], suffix)
    with Client(address) as client, \
            client.consumer(CTP_OUT + suffix, isolation="read_committed") as c:
        result["outputs"] = _count_messages(c)
    result["one_call"] = one_call
    return result


def _count_messages(consumer) -> int:
    """Committed messages readable from the start (the warm-up record included)."""
    return sum(len(messages) for messages in consumer.read_until(max_records=100_000))


# ------------------------------------------------------------------ report
def section(command: str, load: float, baseline: dict, raw_mb_s: float, floor: dict,
            small: dict, plain: dict, txn: dict, txn_async: dict, reads: list[dict],
            ctp_text: str) -> str:
    overhead = (1 - txn["per_s"] / plain["per_s"]) * 100
    overhead_async = (1 - txn_async["per_s"] / plain["per_s"]) * 100
    ceiling = floor["calls_per_s"] / small["calls_per_txn"]
    lines = [
        BEGIN,
        TITLE,
        "",
        f"`{command}` — {time.strftime('%Y-%m-%d')}, {common.machine(load)}.",
        SHAPE,
        "on this machine with the clients, all through the Python SDK.",
        "",
        f"Baselines in the same run: one small os.write + os.fsync {baseline['p50']:.2f} ms "
        f"(p50), {baseline['p99']:.2f} ms (p99); plain Python appending 1 KiB records with an "
        f"fsync per 256 KiB: {raw_mb_s:.0f} MB/s; a do-nothing gRPC call (grpc.aio server "
        f"process answering {floor['clients']} threads of one client process, no atomlog "
        f"code): {floor['calls_per_s']:,.0f} calls/s, "
        f"{floor['server_cpu_ms_per_call']:.2f} ms of server CPU per call.",
        "",
        "| workload | figure | target / peers |",
        "| --- | --- | --- |",
        f"| small transactions: {small['clients']} client processes, 10 × 1 KiB over 4 "
        f"partitions, commit | **{small['per_s']:.0f} transactions/s**; commit() p50 "
        f"{small['commit_p50_ms']:.1f} ms, p99 {small['commit_p99_ms']:.1f} ms; whole "
        f"transaction p50 {small['txn_p50_ms']:.1f} ms, p99 {small['txn_p99_ms']:.1f} ms | "
        "target ≥ 2,600/s, p99 < 10 ms; PostgreSQL 2,576/s (p99 6.9 ms), Redis MULTI/EXEC "
        "5,503/s (p99 4.9 ms) |",
        f"| gRPC calls per small transaction, all processes (timed window) | "
        f"{small['calls_per_txn']:.1f}"
        + (f" ({small['link_calls_per_txn']:.1f} of them on the servers' links, "
           "not gRPC)" if small["link_calls_per_txn"] else "")
        + f", so at most {ceiling:,.0f} transactions/s at the "
        "do-nothing call rate above | |",
        f"| one producer, 1 KiB records, idempotent | {plain['per_s']:,.0f} records/s "
        f"({plain['mb_s']:.0f} MB/s) | |",
        f"| the same, a transaction committed every 100 ms with commit() (waits) | "
        f"{txn['per_s']:,.0f} records/s ({txn['mb_s']:.0f} MB/s): overhead {overhead:.1f}% | "
        "target ≤ 3% (Kafka ~3%) |",
        f"| the same with commit_async() (the next transaction produces meanwhile) | "
        f"{txn_async['per_s']:,.0f} records/s ({txn_async['mb_s']:.0f} MB/s): **overhead "
        f"{overhead_async:.1f}%** | target ≤ 3% |",
    ]
    by = {r["isolation"]: r for r in reads}
    ratio = by["read_committed"]["mb_s"] / by["read_uncommitted"]["mb_s"]
    lines += [
        f"| fetch of that data, read_uncommitted | {by['read_uncommitted']['mb_s']:.0f} MB/s | |",
        f"| fetch of that data, read_committed | {by['read_committed']['mb_s']:.0f} MB/s "
        f"(**{ratio * 100:.0f}%** of read_uncommitted) | target: within 10% |",
        "",
    ]
    if ROLES.get("combined"):
        lines += [*combined_reading(floor, small), "", ctp_text.rstrip("\n"), END]
        return "\n".join(lines) + "\n"
    lines += [
        "Reading: the small-transaction target is far out of reach, and CPU is why: this",
        f"machine makes about {floor['calls_per_s']:,.0f} do-nothing gRPC calls/s between two "
        f"Python processes, so {small['calls_per_txn']:.1f} calls per transaction cap it near "
        f"{ceiling:,.0f}/s before",
        "atomlog does any work, and 2,600/s would need about "
        f"{floor['calls_per_s'] / 2600:.1f} calls per transaction in all. One",
        "transaction here is these gRPC calls between Python processes: from the",
        "client NewTxn (begin_transaction() is lazy: the first partitions ride in it), one",
        "Produce per partition server (3) and EndTxn; between servers one",
        "VerifyTxnPartitions and one EndTxnOnPartition per partition server (about 3 + 3)",
        "and 2-3 appends to the TC log (OPEN with the partitions, COMMITTING; COMMITTED",
        "lingers to share the next append), each a Produce to the partition server holding",
        "`__txn_log-<k>`. The machine is saturated (vmstat: 1-3% idle) at about 20 ms of",
        "CPU per transaction over all processes; profiles put most of each server's event",
        "loop in grpc's own code (a do-nothing grpc.aio handler costs 0.3-0.5 ms of server",
        "CPU per call here), so the figure follows the number of calls. 2,600/s needs under",
        "0.8 ms of CPU per transaction: many transactions per call, the TC log written",
        "in-process next to the coordinator rather than by RPC, verification without a",
        "call per partition server — not done.",
        "An experiment bounds the last of these: partition servers that skipped the",
        "verification call altogether (unsafe, never committed; 2026-11-21, same machine,",
        "same benchmark) cut the calls per transaction from 12.6 to 9.8, but small",
        "transactions went only from 85/s to 87/s and commit() p50 from 89 to 89 ms. So the",
        "signed registration that would remove those calls safely is not worth its",
        "complexity here. The CPU figures say why: about 20 ms of CPU per transaction over",
        "all processes is about 1.6 ms per call, five times the do-nothing call; the three",
        "verification calls (batched, small) were under 1 ms of it. The cost is the work",
        "each call carries in Python (SDK, handlers, TC log, fsync hand-offs), so only",
        "removing that work, not calls alone, would move this figure.",
        f"The stream overhead is {overhead:.1f}% with a waiting commit() and "
        f"{overhead_async:.1f}% with commit_async() in this run. The three 10 s cells run",
        "one after another on separate partitions, each after the page cache is dropped",
        "(as root), and each swings by about 10% between runs here (the idempotent cell",
        "gave 112k, 115k and 94k records/s in three runs on 2026-11-21, before the drop),",
        "so a difference of a few points is noise. Every 100 ms a transaction",
        "adds NewTxn (with its partition), a verification and EndTxn, and commit() first",
        "waits for the transaction's in-flight batches (the pipeline drains 10 times a",
        "second); commit_async() leaves that wait and EndTxn to a commit thread while the",
        "next transaction's records flow. Over those three runs it was not consistently",
        "better (commit() vs commit_async(): 1.7% vs 3.0%, 10.5% vs 17.5%, -6.1% vs",
        "-12.3%): the producer is CPU-bound, the commit thread competes with its two threads",
        "for the one GIL, and each transaction still makes the sender thread call NewTxn and",
        "its first write wait for a verification.",
        f"read_committed reads at {ratio * 100:.0f}% of read_uncommitted: "
        + ("within" if ratio >= 0.9 else "outside") + " the 10% target.",
        "",
        ctp_text.rstrip("\n"),
        END,
    ]
    return "\n".join(lines) + "\n"


def combined_reading(floor: dict, small: dict) -> list[str]:
    """What the combined server's figures say (its section only)."""
    share = small["per_s"] / floor["calls_per_s"] * 100
    return [
        f"Reading: {small['per_s']:.0f} small transactions/s is {share:.0f}% of the "
        f"do-nothing call rate (targets of issue 19: ≥ 50% here, with commit p99 < 25 ms).",
        f"A transaction costs {small['calls_per_txn']:.1f} gRPC calls, all from the client "
        "(NewTxn with its partitions, Produce, EndTxn), and "
        f"{small['local_calls_per_txn']:.1f} in-process calls that were gRPC calls between "
        "processes in the cluster (verification, TC-log appends, markers).",
        "What is left is one process doing on one core the work six processes share over",
        "two cores in the cluster: the one-call transaction of issue 19 (staging, decision",
        "and markers in one client call) is what removes the next two calls.",
    ]


def _ctp_figures(ctp: dict) -> dict:
    """Derived figures of one consume-transform-produce run."""
    servers = ctp["server_cpu_s"]
    per_batch = dict(ctp["rpcs_per_batch"])
    tc_appends = per_batch.pop("TC log appends", 0.0)
    tc_records = per_batch.pop("TC log records", 0.0)
    fsyncs = per_batch.pop("fsyncs", 0.0)
    per_batch.pop("fsyncs barrier", None)
    for kind in [m for m in per_batch if m.startswith("gc ")]:
        per_batch.pop(kind)
    local = sorted(((m.removeprefix("in-process "), n) for m, n in per_batch.items()
                    if m.startswith("in-process ")), key=lambda item: -item[1])
    linked = sum(n for m, n in per_batch.items() if m.startswith(ON_LINK))
    rpcs = sorted(((m, n) for m, n in per_batch.items()
                   if not m.startswith(("in-process ", ON_LINK))), key=lambda item: -item[1])
    cpu_s = ctp["client_cpu_s"] + sum(servers.values())
    return {"rpcs": rpcs, "total_rpcs": sum(n for _, n in rpcs), "local": local,
            "linked": linked,
            "tc_appends": tc_appends,
            "tc_records": tc_records, "fsyncs": fsyncs, "cpu_s": cpu_s,
            "cpu_ms": cpu_s / max(1, ctp["batches"]) * 1e3,
            "cores": {name: cpu / ctp["seconds"] for name, cpu in sorted(servers.items())}}


def ctp_section(command: str, load: float, baseline: dict, raw_mb_s: float, floor: dict,
                runs: list[dict], peers: list[dict]) -> str:
    """The consume-transform-produce part, between its own markers inside the section (so
    `--only-ctp` rewrites just this part). `runs`: the sequential run, then the pipelined
    one."""
    seq, piped = runs
    fs, fp = _ctp_figures(seq), _ctp_figures(piped)

    def row(name: str, cell, peer: str = "") -> str:
        return f"| {name} | {cell(seq, fs)} | {cell(piped, fp)} | {peer} |"

    def calls(ctp: dict, f: dict) -> str:
        return (f"{f['total_rpcs']:.1f}: " + ", ".join(f"{m} {n:.1f}" for m, n in f["rpcs"])
                + (f" ({f['linked']:.1f} of them on the servers' links)"
                   if f["linked"] else "")
                + (("; in-process (function calls, not counted above): "
                    + ", ".join(f"{m} {n:.1f}" for m, n in f["local"])) if f["local"] else "")
                + f"; {f['tc_appends']:.1f} TC log appends "
                f"({f['tc_records']:.1f} records): at the do-nothing call rate, at most "
                f"{floor['calls_per_s'] / f['total_rpcs'] * CTP_BATCH:,.0f} inputs/s")

    def cores(ctp: dict, f: dict) -> str:
        return (f"client {ctp['client_cpu_s'] / ctp['seconds']:.2f}; "
                + ", ".join(f"{name} {c:.2f}" for name, c in f["cores"].items())
                + f"; total {f['cpu_s'] / ctp['seconds']:.2f}")

    best = max(seq["per_s"], piped["per_s"])
    names = {"pg": "PostgreSQL", "redis": "Redis", "rabbit": "RabbitMQ"}

    def peer_cell(show, readme: str) -> str:
        """The peers of this run (`--peers-w3`: peers-bench W3 runs made beside it), else
        the peers-bench README's figures, said so."""
        if not peers:
            return f"(peers-bench README) {readme}"
        return ", ".join(f"{names.get(p['peer'], p['peer'])} {show(p)} (this run)"
                         for p in peers)

    lines = [
        CTP_BEGIN,
        "### Consume-transform-produce (peers-bench W3)",
        "",
        f"`{command}` — {time.strftime('%Y-%m-%d')}, {common.machine(load)}.",
        f"Baselines in the same run: small os.write + os.fsync {baseline['p50']:.2f} ms (p50), "
        f"{baseline['p99']:.2f} ms (p99); plain Python appending 1 KiB records with an fsync "
        f"per 256 KiB: {raw_mb_s:.0f} MB/s; do-nothing gRPC calls between two Python "
        f"processes: {floor['calls_per_s']:,.0f}/s.",
        "",
        f"{seq['inputs']:,} preloaded 1 KiB inputs on {seq['partitions']} partition(s) (the "
        f"outputs too), one worker process: poll 100 from a subscription ({_PREFETCH_NOTE}), "
        "send 100 outputs (bytes reversed; "
        + ("in one `producer.send_batch()`, as PostgreSQL's W3 inserts them with one "
           "`executemany()`" if seq.get("send_batch", True) else "one `producer.send()` each")
        + ") and ack the 100 inputs in one transaction, commit; timed from the "
        "first poll to the empty one (and, pipelined, to the last commit). **Sequential** "
        "is the peers' loop: `consumer.ack(...)`, `txn.commit()`, then the next poll. "
        "**Pipelined** is the same work with `consumer.ack_async(messages, txn=txn)` "
        "(before the sends: the ack, and the NewTxn it opens, run on the consumer's ack "
        f"thread while the worker sends) and `txn.commit_async()`, up to "
        f"{piped['depth']} transactions committing (on "
        f"{piped['commit_threads']} commit threads) while the worker polls the next "
        "batch; each transaction is still one batch's outputs and acks. Each mode has its "
        "own topics. Peers: "
        + ("peers-bench W3 runs made beside this one (`--peers-w3`)" if peers else
           "the peers-bench README's figures on this machine (no `--peers-w3` given)")
        + ".",
        "",
        "| figure | sequential | pipelined | target / peers |",
        "| --- | --- | --- | --- |",
        row("inputs/s", lambda c, f: f"**{c['per_s']:,.0f}** ({c['batches']} transactions "
            f"in {c['seconds']:.1f} s)", "target ≥ 52,000 (issue 6); " + peer_cell(
                lambda p: f"{p['inputs_per_s']:,.0f}", "PostgreSQL 33,431, Redis 51,901")),
        row("batch (poll to committed) p50 / p99", lambda c, f: f"{c['batch_p50_ms']:.1f} / "
            f"{c['batch_p99_ms']:.1f} ms", peer_cell(
                lambda p: f"{p['batch_p50_ms']:.2f} / {p['batch_p99_ms']:.2f} ms",
                "PostgreSQL 2.92 / 5.00 ms, Redis 1.90 / 2.24 ms")),
        row("commit p50 / p99 (commit() returns; commit_async() to its future done)",
            lambda c, f: f"{c['commit_p50_ms']:.1f} / {c['commit_p99_ms']:.1f} ms"),
        row("time in poll() (a Receive it waits for, handing messages out)",
            lambda c, f: f"{c['poll_share']:.0%} of the run"),
        row("inputs left, outputs committed",
            lambda c, f: f"{c['input_left']}, {c['outputs'] - 1:,}", "0, 20,000"),
        row("gRPC calls per transaction, all processes", calls),
        row("CPU over the window (cores)", cores, peer_cell(
            lambda p: f"server {p['server_cpu_cores']:.2f} + client "
                      f"{p['client_cpu_cores']:.2f}",
            "PostgreSQL server 0.75 + client 0.60; Redis 0.46 + 0.56")),
        row("CPU per transaction, all processes", lambda c, f: f"{f['cpu_ms']:.1f} ms"),
    ]
    for peer in peers:
        lines.append(
            f"| peers-bench W3 in this run: {names.get(peer['peer'], peer['peer'])} | "
            f"{peer['inputs_per_s']:,.0f} inputs/s; batch p50 {peer['batch_p50_ms']:.2f} / p99 "
            f"{peer['batch_p99_ms']:.2f} ms; CPU server {peer['server_cpu_cores']:.2f} + client "
            f"{peer['client_cpu_cores']:.2f} cores (machine {peer['machine_busy_pct']}% busy) | | |")
    one_server = seq["partitions"] == 1
    lines += [
        "",
        (f"Reading: the target is missed by far (the better mode is at {best / 52_000 * 100:.0f}% "
         "of it). The CPU price alone rules it out: one transaction" if best < 52_000 else
         "Reading: the target is met. The CPU price: one transaction"),
        f"of 100 inputs costs {fs['total_rpcs']:.0f} gRPC calls between Python processes and "
        f"{fs['cpu_ms']:.0f} ms of CPU over all of them ({fp['cpu_ms']:.0f} ms pipelined), so two "
        f"idle cores would top out near {2000 / fp['cpu_ms']:.0f} transactions/s "
        f"({2000 / fp['cpu_ms'] * 100:,.0f} inputs/s) however the work overlapped. The",
    ] + ([
        f"sequential run got {fs['cpu_s'] / seq['seconds']:.2f} cores: the rest of each batch "
        "is waiting along a serial chain: the worker's CommitTxn, which the coordinator "
        "answers only once the transaction's outputs and acks are staged and durable on "
        "their partition servers (StageTxn) and its decision is in the TC log.",
        f"Pipelined, the chain overlaps with the next batches: {fp['cpu_s'] / piped['seconds']:.2f} "
        f"cores, {piped['per_s'] / seq['per_s'] * 100 - 100:+.0f}% inputs/s, and each batch waits "
        "longer for its commit (it queues behind the others).",
        "The calls, from the worker: Receive, amortized (with the prefetch the first",
        f"delivers {CTP_PER_RECEIVE:,} inputs and each later one {CTP_PER_RECEIVE // 2:,},",
        "which the SDK keeps for the next polls), and one CommitTxn per transaction carrying",
        "its outputs and its acks (one-call transactions: the SDK keeps them on the client",
        "while they stay under its bound, 1 MiB; pipelined, CommitTxns carries several",
        "transactions at once). Between servers: StageTxn to each partition server holding",
        "an output partition or an acked input partition, and the TC log: either one append",
        "of the transaction's Opened and Decided records once every part is staged (two",
        "rounds; nothing logged before the decision: presumed abort), or, for a parallel",
        "commit, a Staging record appended while the parts are staged and the decision",
        "after (one round; coordinator.parallel_commits=auto makes a lone worker's commits",
        "parallel: docs/coordinator.md). Each append is a Produce to the server holding",
        "`__txn_log-<k>`; the Completed record rides on a later one; EndTxnOnPartition",
        "carries the markers, which ride on the next StageTxn to a server when one goes",
        "there first. No verification calls.",
        "PostgreSQL and Redis do the whole step in one round trip and one fsync; here each",
        "of those calls costs Python gRPC work on both sides.",
    ] if seq.get("one_call", True) else [
        f"sequential run got {fs['cpu_s'] / seq['seconds']:.2f} cores: the rest of each batch "
        "is waiting along a serial chain:",
        "NewTxn registering the output partition and the input's",
        "subscription (a TC log append), then Ack (an fsync, and a verification call",
        "from the partition server to the coordinator), Produce (the same; it overlaps the",
        "Ack only as far as the producer's 5 ms linger lets it), then EndTxn (an append).",
        f"Pipelined, the chain overlaps with the next batches: {fp['cpu_s'] / piped['seconds']:.2f} "
        f"cores, {piped['per_s'] / seq['per_s'] * 100 - 100:+.0f}% inputs/s, and each batch waits "
        "longer for its commit (it queues behind the others).",
        "The calls, from the worker (which names its targets up front:",
        "`begin_transaction(partitions=..., subscriptions=...)`):",
        "NewTxn, Produce (the outputs of a partition",
        "are one batch), Ack (the 100 offsets of a partition are one item) and EndTxn; Receive",
        f"is amortized (with the prefetch the first delivers {CTP_PER_RECEIVE:,} inputs and "
        f"each later one {CTP_PER_RECEIVE // 2:,}, which the SDK keeps for the next",
        "polls). Between servers: VerifyTxnPartitions for each new output partition and",
        "subscription partition, EndTxnOnPartition to each server holding a marker target,",
        "and the TC log appends (OPEN with the registrations, COMMITTING, COMMITTED, which",
        "waits up to 200 ms to share the next append), each a Produce to the partition",
        "server holding `__txn_log-<k>`, with an fsync. PostgreSQL and Redis do the whole",
        "step in one round trip and one fsync. Fewer calls alone would not close the gap:",
        "partition servers that skipped verification altogether (unsafe, measured once,",
        "never committed) moved small transactions from 85 to 87/s. Closing it takes a call",
        "that costs a tenth of a Python gRPC call, or a single-process design in which",
        "data, coordinator and TC log share one fsync.",
    ]) + [
        "Client side, two fixes in the SDK's subscription consumer: poll() keeps what a",
        "Receive delivered beyond max_records for the next polls (it used to drop it until the",
        "ack timeout brought it back: about 100 inputs per 30 s in this workload), and",
        "Receive, Ack and Nack call the servers of a request at once instead of in turn"
        + (" (one partition, as here: one server per call, so no gain in this run)." if one_server
           else "."),
        "",
    ]
    return "\n".join(lines + [CTP_END]) + "\n"


def durability_default() -> str:
    """`partition.durability`'s default (every role that hosts partitions has the same),
    as services/config.py declares it."""
    from services.config import settings_for

    return next(s for s in settings_for("partition_server")
                if s.name == "partition.durability").default


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--only-ctp", action="store_true",
                        help="run only the consume-transform-produce cells, sequential and "
                             "pipelined (and the baselines)")
    parser.add_argument("--ctp-inputs", type=int, default=20_000)
    parser.add_argument("--ctp-depth", type=int, default=CTP_DEPTH,
                        help="pipelined consume-transform-produce: transactions committing "
                             "at once")
    parser.add_argument("--commit-threads", type=int, default=None,
                        help="the CTP worker's Client(commit_threads=...) (default: the "
                             "SDK's)")
    parser.add_argument("--ctp-send", choices=("batch", "each"), default="batch",
                        help="how the CTP worker hands a transaction its 100 outputs: one "
                             "producer.send_batch() (default; PostgreSQL's W3 inserts them "
                             "with one executemany()) or one producer.send() each")
    parser.add_argument("--ctp-partitions", type=int, default=1,
                        help="partitions of the input and of the output topic")
    parser.add_argument("--peers-w3", type=Path, default=None, metavar="FILE",
                        help="JSON lines of peers-bench `bench.py --workload w3` runs made "
                             "beside this one, shown next to the consume-transform-produce "
                             "figures")
    parser.add_argument("--combined", action="store_true",
                        help="run on the combined server (every role in one process) and "
                             "write its own section")
    parser.add_argument("--only-small", action="store_true",
                        help="run only the small one-call transactions cell (and the gRPC "
                             "call floor) and print it: server CPU per transaction is its "
                             "steady figure on a noisy machine, shown also by kind of "
                             "thread (the event loop, other Python threads, io_uring's "
                             "kernel workers, gRPC's) with how busy the busiest event loop "
                             "was; writes no docs")
    parser.add_argument("--rate", type=float, default=0.0, metavar="TXN_PER_S",
                        help="with --only-small: an open loop of this many small "
                             "transactions a second in all (each client 1/clients of "
                             "them, latencies from each one's scheduled start) instead of "
                             "clients committing back to back")
    parser.add_argument("--streaming", action="store_true",
                        help="with --only-small: the streaming path's small transactions "
                             "(Client(one_call_max_bytes=0): NewTxn, Produce, EndTxn) "
                             "instead of one-call ones")
    parser.add_argument("--no-client-links", action="store_true",
                        help="with --only-small: the clients send their calls to "
                             "coordinators over gRPC (Client(links=False)), not on the "
                             "coordinators' links")
    parser.add_argument("--spread-one-calls", action="store_true",
                        help="with --only-small: the clients' one-call transactions go to "
                             "the TC partitions their random keys hash to "
                             "(Client(gather_one_calls=False)), not each coordinator's "
                             "lowest")
    parser.add_argument("--only-stream", type=int, default=0, metavar="TURNS",
                        help="run only the three stream cells (idempotent, commit(), "
                             "commit_async()) TURNS times in rotating order and print each "
                             "turn's overheads and their medians; writes no docs")
    parser.add_argument("--profile", type=Path, default=None, metavar="FILE",
                        help="with --only-small or --only-ctp: py-spy records the first "
                             "server process over the timed window into FILE (speedscope "
                             "format, or collapsed stacks when FILE ends in .txt; the "
                             "pipelined CTP cell into FILE's name with -pipelined before "
                             "its extension)")
    parser.add_argument("--profile-worker", action="store_true",
                        help="with --profile: record the SDK client instead of the "
                             "server (the CTP worker; with --only-small the first client "
                             "process)")
    parser.add_argument("--profile-role", default=None, metavar="ROLE",
                        choices=["coordinator", "partition_server", "id_allocator",
                                 "combined"],
                        help="with --only-small --profile: record the first server of this "
                             "role (on the cluster: coordinator, partition_server) instead "
                             "of the first server; with --only-ctp --profile: every server "
                             "of this role, each into FILE's name with -NAME before its "
                             "extension")
    parser.add_argument("--loop-steps", action="store_true",
                        help="with --only-small or --only-ctp: every server counts and "
                             "times its event-loop callbacks over the timed window (each "
                             "CTP cell's loop), keyed by the task (and what it had "
                             "awaited) or callback that ran "
                             "(bench/loop_steps/sitecustomize.py), and the steps and ms per "
                             "transaction are printed: the counts stay put on a noisy "
                             "machine where times move. The counting slows the servers: "
                             "writes no docs")
    parser.add_argument("--count-calls", action="store_true",
                        help="as --loop-steps, but every server counts its event loop's "
                             "Python-level calls (cProfile) over the timed window, and the "
                             "calls per transaction by module are printed: a change to the "
                             "hot path shows there exactly, where the machine's noise "
                             "hides its time. cProfile halves the servers' rate: writes no "
                             "docs")
    parser.add_argument("--no-docs", action="store_true", help="print only")
    parser.add_argument("--combined-nodes", type=int, default=0, metavar="N",
                        help="with --only-small or --only-ctp: a cluster of N (2-5) combined "
                             "servers, every role in each process (as Kafka's brokers host "
                             "their coordinators), instead of separate roles; writes no docs")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help="a config setting for every server (repeatable), e.g. "
                             "coordinator.parallel_commits=false to measure against it")
    parser.add_argument("--fsync-delay-ms", type=float, default=0, metavar="MS",
                        help="every server's fsync sleeps MS first (the fsync_slow failpoint, "
                             "services/failpoints.py), as on a slow or network-attached disk")
    args = parser.parse_args()
    if args.combined:
        use_combined_server()
    if args.combined_nodes:
        if args.combined or not 2 <= args.combined_nodes <= 5:
            parser.error("--combined-nodes takes 2..5, without --combined")
        if not (args.only_small or args.only_ctp):
            parser.error("--combined-nodes goes with --only-small or --only-ctp")
        global ROLES
        ROLES = {"combined": args.combined_nodes}
        args.no_docs = True  # not a shape the docs' sections are about
    peers = ([json.loads(line) for line in args.peers_w3.read_text().splitlines() if line.strip()]
             if args.peers_w3 else [])
    command = common.command_line("bench/transactions.py", sys.argv[1:])
    command = re.sub(r" --peers-w3 \S+", " --peers-w3 FILE", command)
    load = os.getloadavg()[0]
    settings = common.cluster_settings(parser, args.set)
    if not 0 <= args.fsync_delay_ms <= 1_000:
        parser.error("--fsync-delay-ms takes 0..1000")
    if not 0 <= args.only_stream <= 20:
        parser.error("--only-stream takes 0..20 turns")
    if not 1 <= args.ctp_depth <= 64:
        parser.error("--ctp-depth takes 1..64")
    if args.commit_threads is not None and not 1 <= args.commit_threads <= 256:
        parser.error("--commit-threads takes 1..256")
    if args.rate < 0 or (args.rate and not args.only_small):
        parser.error("--rate takes a positive rate, with --only-small")
    if (args.loop_steps or args.count_calls) and not (args.only_small or args.only_ctp):
        parser.error("--loop-steps and --count-calls go with --only-small or --only-ctp")
    if args.loop_steps and args.count_calls:
        parser.error("--loop-steps or --count-calls, not both")
    args.loop_steps = args.loop_steps or args.count_calls
    if args.loop_steps:
        args.no_docs = True  # the counter's own cost is in these figures
    loop_steps_dir = None
    if args.loop_steps:  # before the servers start: they inherit it
        loop_steps_dir = tempfile.TemporaryDirectory(prefix="atomlog-bench-loop-steps-")
        loop_steps_on(loop_steps_dir.name, calls=args.count_calls)
    # Removed when the run ends (the object lives as long as main).
    failpoint_dir = tempfile.TemporaryDirectory(prefix="atomlog-bench-failpoints-")
    if args.fsync_delay_ms:
        from services import failpoints
        (Path(failpoint_dir.name) / failpoints.FSYNC_SLOW).write_text(f"{args.fsync_delay_ms:g}")
        os.environ[failpoints.ENVIRONMENT_VARIABLE] = failpoint_dir.name  # the servers'
    with common.local_cluster("atomlog-bench-txn-", ROLES,
                              replication_factor=common.BENCH_REPLICATION_FACTOR,
                              settings=settings) as (
            data_dir, report, address):
        from spark_client import Client

        with Client(address) as client:
            client.create_topic(SMALL_TOPIC, partitions=PARTITIONS)
            client.create_topic(STREAM_TOPIC, partitions=PARTITIONS)
        time.sleep(3)  # leases settle
        baseline = common.fsync_baseline(data_dir)
        floor = common.grpc_call_floor()
        print(f"gRPC call floor: {floor}", flush=True)
        if args.only_stream:
            stream_turns(address, args.seconds, args.only_stream)
            return
        if args.only_small:
            small = small_transactions(report, address, args.clients, args.seconds,
                                       not args.streaming, args.profile,
                                       not args.no_client_links, args.profile_worker,
                                       args.rate, args.profile_role,
                                       not args.spread_one_calls)
            steps = small.pop("loop_steps", None)
            print(f"small transactions: {json.dumps(small, indent=1)}", flush=True)
            if steps is not None:
                print(loop_steps_text(steps), flush=True)
            if "client_calls_per_txn" in small:
                print(f"Python-level calls per transaction in the first client (the SDK and "
                      f"the bench's loop): {small['client_calls_per_txn']:.1f}", flush=True)
            print(f"small transactions/s {small['per_s']:.0f} "
                  f"({small['per_s'] / floor['calls_per_s'] * 100:.1f}% of the call floor "
                  f"{floor['calls_per_s']:,.0f}/s); server CPU "
                  f"{small['server_cpu_ms_per_txn']:.2f} ms per transaction (floor: "
                  f"{floor['server_cpu_ms_per_call']:.2f} ms per call"
                  + ("; by role: " + ", ".join(
                      f"{role} {value:.2f}" for role, value in
                      small["server_cpu_ms_per_txn_by_role"].items())
                     if len(small["server_cpu_ms_per_txn_by_role"]) > 1 else "") + "); "
                  f"{small['calls_per_txn']:.2f} calls per transaction "
                  f"({small['link_calls_per_txn']:.2f} on the servers' links); "
                  f"{small['fsyncs_per_txn']:.2f} group commits and "
                  f"{small['sync_calls_per_txn']:.2f} sync calls per transaction; "
                  "durability " + settings.get("partition.durability", os.environ.get(
                      "ATOMLOG_PARTITION_DURABILITY",
                      f"default ({durability_default()})")) + "; "
                  "commit p50/p99 "
                  f"{small['commit_p50_ms']:.1f}/{small['commit_p99_ms']:.1f} ms; "
                  + "the machine's jitter meanwhile (common.CpuProbe): a "
                  f"{small['machine_jitter']['p50_ms']:.2f} ms chunk of Python took "
                  f"{small['machine_jitter']['p99_ms']:.2f} ms at p99; "
                  f"servers' full garbage collections {small['full_gcs']:.0f} "
                  f"({small['full_gc_ms']:.0f} ms in all, {small['full_gcs_over_10ms']:.0f} "
                  "over 10 ms); "
                  + (f"open loop of {args.rate:g}/s: transaction p50/p99 from its "
                     f"scheduled start {small['txn_p50_ms']:.1f}/{small['txn_p99_ms']:.1f} "
                     "ms; " if args.rate else "") +
                  "server threads, ms per transaction: " + ", ".join(
                      f"{kind} {value:.2f}" for kind, value in
                      small["server_thread_cpu_ms_per_txn"].items()) +
                  f" (busiest event loop on a CPU {small['busiest_event_loop_busy']:.0%} "
                  "of the time); " + bounds_text(small, floor, args.combined), flush=True)
            return
        raw_s = common.raw_append_seconds(data_dir, RECORD * 256, 4_000, 1)
        raw_mb_s = 4_000 * 256 * len(RECORD) / raw_s / 1e6
        if not args.only_ctp:
            small = small_transactions(report, address, args.clients, args.seconds)
            print(f"small transactions: {small}", flush=True)
            plain = stream(address, args.seconds, "plain", 0)
            print(f"idempotent: {plain}", flush=True)
            txn = stream(address, args.seconds, "commit", 1)
            print(f"transactional: {txn}", flush=True)
            txn_async = stream(address, args.seconds, "commit_async", 2)
            print(f"transactional, commit_async: {txn_async}", flush=True)
            reads = [fetch_all(address, 1, isolation)
                     for isolation in ("read_uncommitted", "read_committed")]
            print(f"reads: {reads}", flush=True)
        ctp_runs = []
        for pipelined in (False, True):
            ctp_runs.append(consume_transform_produce(
                report, address, args.ctp_inputs, args.ctp_partitions, pipelined,
                profile=args.profile if args.only_ctp else None,
                profile_worker=args.profile_worker, depth=args.ctp_depth,
                commit_threads=args.commit_threads, send_batch=args.ctp_send == "batch",
                profile_role=args.profile_role))
            steps = ctp_runs[-1].pop("loop_steps", None)
            print(f"consume-transform-produce: {ctp_runs[-1]}", flush=True)
            if steps is not None:
                print(loop_steps_text(steps), flush=True)
    ctp_text = ctp_section(command, load, baseline, raw_mb_s, floor, ctp_runs, peers)
    if args.only_ctp:
        text, begin, end = ctp_text, CTP_BEGIN, CTP_END
    else:
        text = section(command, load, baseline, raw_mb_s, floor, small, plain, txn, txn_async,
                       reads, ctp_text)
        begin, end = BEGIN, END
    print()
    print(text)
    if not args.no_docs:
        common.write_docs_section(text, begin, end)
        print(f"wrote its section of {common.DOCS.relative_to(REPO)}")


if __name__ == "__main__":
    main()
