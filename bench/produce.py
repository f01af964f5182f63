"""Benchmark (issue 3): durable produce and fetch throughput of one partition server,
against plain Python appending and fsyncing the same bytes, measured in the same run.

Starts its own local cluster in a temporary directory (`python -m services up` with one
partition server, one coordinator, one id allocator; `down` at the end, also on failure),
then measures 1 KiB records with durable acks (the server default, flush_policy=fsync):

- "wire" producers: separate processes that pre-encode idempotent batches (256 KiB of
  1 KiB records by default, in the columnar format the SDK writes, magic 2; real
  producer id/epoch from InitProducerId, consecutive sequences) and send them with
  grpc.aio, up to 5 in flight per partition (one until its first ack: the server knows
  a producer only after its first batch). This measures the server. Ack latency is per
  Produce request (send to reply).
- "sdk" producers: separate processes running `Client(...).producer()` and `send()` of
  1 KiB values (defaults: 256 KiB batches, linger 5 ms, 5 in flight). This measures the
  end-to-end client path. Ack latency is per record (send() to its future resolving),
  sampled: one record in 64 gets a callback, so the harness adds little client CPU.
- "batch" producers: the same producer, fed by `send_batch(topic, values)` with values
  a pyarrow binary array of 5,000 1 KiB values per call (half a Spark Arrow batch at
  its default 10,000 rows; each call is cut into 256 KiB batches of one partition, the
  next call goes to the next partition), at most 8 calls unacknowledged per process
  (the oldest call's future is awaited before the next call). Ack latency is per call
  (send_batch() to its future resolving). Compared with the wire and sdk cells of the
  same shape (target: >= 80% of wire), and client CPU per MB with sdk's.

Producers 1 and 4 x partitions 1 and 8 for each kind. After each wire cell, the same
wire producers against a do-nothing grpc.aio server (the gRPC floor: protobuf in, a reply
out, nothing stored). Then, with the cluster idle, the
raw baseline: os.write of the same batch bytes plus os.fsync every G batches, where G is
the batches per fsync the server achieved. Then reads of everything from offset 0, one
process each: raw Fetch (no record decoding), the SDK consumer's poll() (a Python
message per record) and its poll_arrow() (Arrow tables; sums the value column's lengths
with pyarrow.compute, no Python per record; target: >= 80% of raw Fetch).

Client and server share this machine's CPUs (2 on the reference machine): the figures
are what one box does with both sides on it, not the server alone.

Prints a table and writes its section of docs/benchmarks.md (replacing an earlier run's
section, leaving the rest alone).

    .venv/bin/python bench/produce.py [--seconds 8] [--quick] [--no-docs]
        [--cells wire:1x1,sdk:4x8,batch:4x8] [--batch-kib 256] [--profile /tmp/ps.txt]
"""

from __future__ import annotations

import argparse
import array
import asyncio
import collections
import functools
import json
import math
import multiprocessing as mp
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.append(str(REPO / "bench"))  # after the packages: bench/coordinator.py is a script

import common  # noqa: E402

import crc32c  # noqa: E402
import grpc  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.compute as pc  # noqa: E402

from atomlog.v1 import common_pb2, partition_pb2, partition_pb2_grpc  # noqa: E402
from partition_server.owner import OwnerSettings  # noqa: E402
from partition_server.record_batch import (CRC_COVERED_FROM, CRC_OFFSET, HEADER,  # noqa: E402
                                           HEADER_SIZE, MAGIC_COLUMNAR, MIN_BATCH_LENGTH,
                                           NO_TIMESTAMP, Record, parse_header)
from partition_server.record_columns import encode_records  # noqa: E402

DOCS = REPO / "docs" / "benchmarks.md"
BEGIN, END = "<!-- bench/produce.py: begin -->", "<!-- bench/produce.py: end -->"
# Markers of the same section under another spelling, replaced too if found.
ALT_MARKERS = [("<!-- bench:produce:start -->", "<!-- bench:produce:end -->")]
RECORD_BYTES = 1024
MAX_IN_FLIGHT = 5
# "batch" producers: records per send_batch() call (about 5 MiB: half a Spark Arrow batch
# at spark.sql.execution.arrow.maxRecordsPerBatch's default 10,000 rows) and calls
# unacknowledged per process (about 40 MiB, under the producer's 64 MiB buffer, so
# send_batch() never blocks on it; one per partition of the widest cell, since each call
# goes to one partition, the next call to the next).
BATCH_CALL_RECORDS = 5_000
BATCH_CALLS_IN_FLIGHT = 8
OWNER_FSYNCS_IN_FLIGHT = OwnerSettings.max_fsyncs_in_flight  # the server defaults
OWNER_WRITE_AHEAD_BYTES = OwnerSettings.write_ahead_bytes
FETCH_MAX_BYTES = 8 << 20
CHANNEL_OPTIONS = [("grpc.max_send_message_length", 64 << 20),
                   ("grpc.max_receive_message_length", 64 << 20)]
# Reference figures from the issue / /work/shared/peers-bench (W2: transactions of
# 1000 x 1 KiB, one client, fsync before commit, same machine).
PEERS = "PostgreSQL 15 COPY 137 MB/s, Redis 7 MULTI/XADD/EXEC 99 MB/s"
TARGET_PRODUCE_MB_S, TARGET_RAW_FRACTION, TARGET_FETCH_MB_S = 140.0, 0.40, 300.0
# The columnar APIs: send_batch() against the wire cell of the same shape, poll_arrow()
# against raw Fetch of the same topic.
TARGET_BATCH_OF_WIRE, TARGET_ARROW_OF_FETCH = 0.80, 0.80
READERS = ("raw Fetch", "sdk consumer", "sdk poll_arrow")


# ------------------------------------------------------------------ helpers

percentile = common.percentile


def cpu_seconds_of(pid: int, thread: int | None = None) -> float:
    """utime + stime of a process (all its threads), or of one of its threads, in seconds."""
    path = f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat"
    with open(path, "rb") as handle:
        fields = handle.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def client_cpu_ms_per_mb(cores: float, records_per_s: float) -> float:
    """Client CPU milliseconds per MB of 1 KiB records (cores used over records/s)."""
    return 1e3 * cores / max(records_per_s * RECORD_BYTES / 1e6, 1e-9)


def minor_faults() -> int:
    """This process's minor page faults so far (a buffer mapped afresh faults once per
    page it touches)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def machine_busy() -> tuple[int, int]:
    with open("/proc/stat") as handle:
        values = [int(v) for v in handle.readline().split()[1:]]
    idle = values[3] + values[4]
    return idle, sum(values)


class ServerSampler:
    """Samples the partition server's VmRSS while a measurement runs, and its CPU time
    and the machine's busy fraction over the whole window."""

    def __init__(self, pid: int, interval_s: float = 0.2):
        self.pid, self.interval_s = pid, interval_s
        self.peak_rss = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self.cpu0, self.t0, self.busy0 = cpu_seconds_of(self.pid), time.monotonic(), machine_busy()
        self.main0 = cpu_seconds_of(self.pid, self.pid)  # the event-loop thread
        self.peak_rss = rss_mib(self.pid)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.peak_rss = max(self.peak_rss, rss_mib(self.pid))
            except OSError:
                return

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        elapsed = time.monotonic() - self.t0
        self.cpu_s = cpu_seconds_of(self.pid) - self.cpu0
        self.main_s = cpu_seconds_of(self.pid, self.pid) - self.main0
        self.cpu_cores, self.main_cores = self.cpu_s / elapsed, self.main_s / elapsed
        idle1, total1 = machine_busy()
        idle0, total0 = self.busy0
        self.machine_busy_pct = 100 * (1 - (idle1 - idle0) / max(1, total1 - total0))
        self.busy_cores = self.machine_busy_pct / 100 * (os.cpu_count() or 1)
        self.peak_rss = max(self.peak_rss, rss_mib(self.pid))
        return False


def scrape(address: str) -> dict[str, float]:
    """Prometheus text → {metric name: value summed over label sets}."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    out: dict[str, float] = collections.defaultdict(float)
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        try:
            out[name] += float(value)
        except ValueError:
            continue
    return out


# ------------------------------------------------------------------ cluster

class Cluster:
    """`python -m services up/down` in a temporary directory."""

    def __init__(self, data_dir: Path):
        self.data_dir = data_dir
        self.env = dict(os.environ, PYTHONPATH=str(REPO) + (
            os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""))

    def up(self) -> None:
        command = [sys.executable, "-m", "services", "up", "--data-dir", str(self.data_dir),
                   "--partition-servers", "1", "--coordinators", "1", "--id-allocators", "1",
                   "--output", "json"]
        done = subprocess.run(command, cwd=REPO, env=self.env, capture_output=True, text=True,
                              timeout=180)
        if done.returncode != 0:
            raise RuntimeError(f"`atomlog up` failed ({done.returncode}):\n{done.stdout}\n"
                               f"{done.stderr}")
        info = json.loads((self.data_dir / "cluster.json").read_text())
        self.bootstrap = info["bootstrap"]
        server = next(p for p in info["processes"] if p["role"] == "partition_server")
        self.server_pid, self.metrics = server["pid"], server["metrics_address"]
        self.server_data = Path(server["data_dir"])

    def down(self) -> None:
        if not (self.data_dir / "cluster.json").exists():
            return
        command = [sys.executable, "-m", "services", "down", "--data-dir", str(self.data_dir)]
        done = subprocess.run(command, cwd=REPO, env=self.env, capture_output=True, text=True,
                              timeout=120)
        if done.returncode != 0:  # last resort: the launcher's own stop (SIGTERM, SIGKILL)
            print(f"`atomlog down` failed: {done.stderr.strip()}; stopping directly",
                  file=sys.stderr)
            from services import launcher
            launcher.down(self.data_dir, timeout_s=10)


def wait_ready(address: str, topic: str, partitions: int, timeout_s: float = 30.0) -> None:
    """Until every partition of the topic answers ListOffsets without error."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = partition_pb2_grpc.PartitionServiceStub(channel)
        while True:
            reply = stub.ListOffsets(partition_pb2.ListOffsetsRequest(items=[
                partition_pb2.ListOffsetsItem(
                    topic_partition=common_pb2.TopicPartition(topic=topic, partition=p),
                    spec=partition_pb2.OFFSET_SPEC_LATEST) for p in range(partitions)]), timeout=5)
            errors = [r.error.reason for r in reply.results if r.error.reason]
            if not errors:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{topic} not ready after {timeout_s} s: {errors[:3]}")
            time.sleep(0.05)


def high_watermarks(address: str, topic: str, partitions: int) -> list[int]:
    with grpc.insecure_channel(address) as channel:
        reply = partition_pb2_grpc.PartitionServiceStub(channel).ListOffsets(
            partition_pb2.ListOffsetsRequest(items=[partition_pb2.ListOffsetsItem(
                topic_partition=common_pb2.TopicPartition(topic=topic, partition=p),
                spec=partition_pb2.OFFSET_SPEC_LATEST) for p in range(partitions)]), timeout=10)
    return [r.offset for r in reply.results]


# ------------------------------------------------------------------ batches

def record_body(value: bytes, records: int) -> bytes:
    """The records block (columnar, magic 2: what SDK producers send) of a batch of
    `records` copies of `value`, all with the batch timestamp (so the block depends
    neither on the timestamp nor on the sequence)."""
    return encode_records([Record(None, value)] * records, timestamp_ms=0)[HEADER_SIZE:]


def make_batch(body: bytes, records: int, producer_id: int, epoch: int, sequence: int,
               timestamp_ms: int) -> bytes:
    """encode_records' output for these records, without re-encoding the records."""
    header = bytearray(HEADER.pack(0, MIN_BATCH_LENGTH + len(body), MAGIC_COLUMNAR,
                                   NO_TIMESTAMP, 0, 0, records - 1, records, timestamp_ms,
                                   timestamp_ms, producer_id, epoch, sequence, 0, 0))
    crc = crc32c.crc32c(body, crc32c.crc32c(memoryview(header)[CRC_COVERED_FROM:]))
    header[CRC_OFFSET:CRC_OFFSET + 4] = crc.to_bytes(4, "big")
    return bytes(header) + body


def records_per_batch(batch_kib: int) -> int:
    return max(1, batch_kib * 1024 // RECORD_BYTES)


# ------------------------------------------------------------------ producer processes

def stop_children(children, finished: bool) -> None:
    """After a measurement: let them exit. After a failure or a signal: kill them now (they
    may be waiting for a start that will never come)."""
    for child in children:
        if not finished and child.is_alive():
            child.kill()
        child.join(timeout=30 if finished else 5)
        if child.is_alive():
            child.kill()


def _child_setup() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and cleans up


def wire_producer(bootstrap: str, topic: str, partitions: int, seconds: float, batch_kib: int,
                  ready, go, start_at, results) -> None:
    _child_setup()
    try:
        from spark_client import Client

        with Client(bootstrap) as client:
            producer_id, epoch = client.allocate_producer_id()
            addresses = [client.metadata.route(topic, p).address for p in range(partitions)]
        count = records_per_batch(batch_kib)
        value = os.urandom(RECORD_BYTES)  # one random buffer per client, as peers-bench
        body = record_body(value, count)
        check = make_batch(body, count, producer_id, epoch, 7, 1234)
        parse_header(check)
        assert check == encode_records([Record(None, value)] * count, producer_id=producer_id,
                                       producer_epoch=epoch, base_sequence=7,
                                       timestamp_ms=1234), "make_batch drifted"
        _wire_child(addresses, topic, body, count, producer_id, epoch, seconds, ready, go,
                    start_at, results)
    except BaseException as error:  # noqa: BLE001 — reported by the parent
        ready.put(os.getpid())
        results.put({"error": f"{type(error).__name__}: {error}"})


def floor_producer(address: str, topic: str, partitions: int, seconds: float, batch_kib: int,
                   ready, go, start_at, results) -> None:
    """The wire producer against the do-nothing server at `address` (floor_server)."""
    _child_setup()
    try:
        count = records_per_batch(batch_kib)
        _wire_child([address] * partitions, topic, record_body(os.urandom(RECORD_BYTES), count),
                    count, 1, 0, seconds, ready, go, start_at, results)
    except BaseException as error:  # noqa: BLE001 — reported by the parent
        ready.put(os.getpid())
        results.put({"error": f"{type(error).__name__}: {error}"})


def _wire_child(addresses, topic, body, count, producer_id, epoch, seconds, ready, go,
                start_at, results) -> None:
    ready.put(os.getpid())
    go.wait()
    cpu0 = sum(os.times()[:2])
    outcome = asyncio.run(_wire_run(addresses, topic, body, count, producer_id, epoch,
                                    start_at.value, start_at.value + seconds))
    outcome["cpu_s"] = sum(os.times()[:2]) - cpu0
    results.put(outcome)


def floor_server(port: int, ready) -> None:
    """The gRPC floor: a grpc.aio server whose Produce parses the request (protobuf, as
    ours) and answers every item with the next offsets, storing nothing. Same message
    limits and malloc tuning as a partition server; no interceptor, metrics, owner, log
    or fsync."""
    from services.runtime import tune_allocator

    tune_allocator()

    async def serve() -> None:
        ends: collections.Counter = collections.Counter()

        async def produce(request, _context):
            results = []
            for item in request.items:
                key = (item.topic_partition.topic, item.topic_partition.partition)
                header = parse_header(item.record_batch)  # as any server must, to answer
                results.append(partition_pb2.ProduceResult(
                    topic_partition=item.topic_partition, base_offset=ends[key]))
                ends[key] += header.record_count
            return partition_pb2.ProduceResponse(results=results)

        server = grpc.aio.server(options=[("grpc.max_send_message_length", 16 << 20),
                                          ("grpc.max_receive_message_length", 16 << 20),
                                          ("grpc.so_reuseport", 0)])
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            "atomlog.v1.PartitionService", {"Produce": grpc.unary_unary_rpc_method_handler(
                produce, request_deserializer=partition_pb2.ProduceRequest.FromString,
                response_serializer=partition_pb2.ProduceResponse.SerializeToString)})])
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        ready.put(os.getpid())
        await server.wait_for_termination()

    asyncio.run(serve())


async def _wire_run(addresses, topic, body, count, producer_id, epoch, start, deadline) -> dict:
    stats = {"records": 0, "batches": 0, "duplicates": 0, "errors": collections.Counter(),
             "last_ack": start}
    latencies = array.array("d")
    channels = {a: grpc.aio.insecure_channel(a, options=CHANNEL_OPTIONS) for a in set(addresses)}
    stubs = {a: partition_pb2_grpc.PartitionServiceStub(c) for a, c in channels.items()}
    while time.monotonic() < start:
        await asyncio.sleep(min(0.01, max(0.0, start - time.monotonic())))

    async def partition_sender(partition: int) -> None:
        stub = stubs[addresses[partition]]
        tp = common_pb2.TopicPartition(topic=topic, partition=partition)
        sequence, retries = 0, 0
        in_flight: collections.deque = collections.deque()
        # One request until the first ack: the server knows the producer only after its
        # first batch, and gRPC may deliver pipelined requests out of order (a later one
        # arriving first is refused UNKNOWN_PRODUCER_ID / OUT_OF_ORDER_SEQUENCE).
        window = 1
        while True:
            while len(in_flight) < window and time.monotonic() < deadline:
                payload = make_batch(body, count, producer_id, epoch, sequence,
                                     time.time_ns() // 1_000_000)
                request = partition_pb2.ProduceRequest(items=[partition_pb2.ProduceItem(
                    topic_partition=tp, record_batch=payload)])
                sent = time.perf_counter()
                call = stub.Produce(request, timeout=60)
                call.add_done_callback(lambda _c, sent=sent: latencies.append(
                    time.perf_counter() - sent))
                in_flight.append((sequence, call))
                sequence += count
            if not in_flight:
                return
            batch_sequence, call = in_flight.popleft()
            try:
                reply = await call
                reason = reply.results[0].error.reason
                duplicate = reply.results[0].duplicate
            except grpc.RpcError as error:
                reason, duplicate = f"rpc {error.code().name}", False
            if not reason:
                window = MAX_IN_FLIGHT
                if duplicate:
                    stats["duplicates"] += 1
                else:
                    stats["records"] += count
                    stats["batches"] += 1
                stats["last_ack"] = time.monotonic()
                continue
            # Go back N: let the rest land (refused as out of order, or duplicates on
            # resend), then resend from the failed sequence, as an idempotent producer does.
            stats["errors"][reason] += 1
            retries += 1
            if retries > 50:
                raise RuntimeError(f"partition {partition}: too many errors "
                                   f"{dict(stats['errors'])}")
            for _later_sequence, later in in_flight:
                try:
                    await later  # out of order (not written) or, after a timeout, unknown
                except grpc.RpcError:
                    pass
            in_flight.clear()
            sequence = batch_sequence  # anything written already comes back as a duplicate
            window = 1  # resend one, then pipeline again
            await asyncio.sleep(0.01)

    try:
        await asyncio.gather(*(partition_sender(p) for p in range(len(addresses))))
    finally:
        for channel in channels.values():
            await channel.close()
    return {"records": stats["records"], "batches": stats["batches"],
            "duplicates": stats["duplicates"], "errors": dict(stats["errors"]),
            "last_ack": stats["last_ack"], "latencies": latencies.tobytes()}


def sdk_producer(kind: str, bootstrap: str, topic: str, partitions: int, seconds: float,
                 batch_kib: int, ready, go, start_at, results) -> None:
    """An SDK producer process: `Client(...).producer()` fed by send() ("sdk") or
    send_batch() ("batch") until the deadline, then flush() (every record acknowledged
    or failed); records count once acknowledged, up to the last ack."""
    _child_setup()
    try:
        from spark_client import Client

        value = os.urandom(RECORD_BYTES)
        if kind == "batch":
            payload, loop = pa.array([value] * BATCH_CALL_RECORDS, pa.binary()), _send_batches
            per_future = BATCH_CALL_RECORDS
        else:
            payload, loop, per_future = value, _send_records, 1
        latencies = array.array("d")
        with Client(bootstrap) as client:
            client.metadata.partitions(topic)
            producer = client.producer(batch_max_bytes=batch_kib << 10)
            ready.put(os.getpid())
            go.wait()
            start, deadline = start_at.value, start_at.value + seconds
            while time.monotonic() < start:
                time.sleep(0.001)
            cpu0 = sum(os.times()[:2])
            futures = loop(producer, topic, payload, deadline, latencies)
            producer.flush()
            last_ack = time.monotonic()
            cpu = sum(os.times()[:2]) - cpu0
            producer.close()
        failures: collections.Counter = collections.Counter()
        for future in futures:
            if future.exception() is not None:  # a failed call counts all its records
                failures[type(future.exception()).__name__] += per_future
        results.put({"records": len(futures) * per_future - sum(failures.values()),
                     "errors": dict(failures), "last_ack": last_ack,
                     "latencies": latencies.tobytes(), "cpu_s": cpu, "batches": 0,
                     "duplicates": 0})
    except BaseException as error:  # noqa: BLE001
        ready.put(os.getpid())
        results.put({"error": f"{type(error).__name__}: {error}"})


def _send_records(producer, topic: str, value: bytes, deadline: float, latencies) -> list:
    """send() of one value at a time until the deadline; every future kept (for errors)."""
    perf = time.perf_counter

    def sampled(sent: float):
        return lambda _future: latencies.append(perf() - sent)

    futures = []
    keep = futures.append
    send = producer.send
    while time.monotonic() < deadline:
        # The latency of one record in 64 (a callback per record would add its own cost
        # to the client being measured).
        first = send(topic, value)
        first.add_done_callback(sampled(perf()))
        keep(first)
        for _ in range(63):
            keep(send(topic, value))
    return futures


def _send_batches(producer, topic: str, values: pa.Array, deadline: float,
                  latencies) -> list:
    """send_batch() of `values` until the deadline, at most BATCH_CALLS_IN_FLIGHT calls
    unacknowledged (the oldest one's future awaited before the next call); the latency
    of every call. Every future kept (for errors)."""
    perf = time.perf_counter
    futures: list = []
    while True:
        if len(futures) >= BATCH_CALLS_IN_FLIGHT:
            futures[-BATCH_CALLS_IN_FLIGHT].exception()  # waits; the earlier ones are done
        if time.monotonic() >= deadline:
            return futures
        sent = perf()
        future = producer.send_batch(topic, values)
        future.add_done_callback(lambda _f, sent=sent: latencies.append(perf() - sent))
        futures.append(future)


def run_producers(ctx, cluster: Cluster, kind: str, producers: int, partitions: int,
                  seconds: float, batch_kib: int, profile: str | None) -> dict:
    from spark_client import Client
    from spark_client.errors import TopicAlreadyExists

    with Client(cluster.bootstrap) as client:
        for attempt in range(100):
            topic = f"bench-{kind}-{producers}x{partitions}" + (f"-{attempt}" if attempt else "")
            try:
                client.create_topic(topic, partitions)
                break
            except TopicAlreadyExists:
                continue
    wait_ready(cluster.bootstrap, topic, partitions)
    target = wire_producer if kind == "wire" else functools.partial(sdk_producer, kind)
    ready, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    start_at = ctx.Value("d", 0.0)
    children = [ctx.Process(target=target, args=(cluster.bootstrap, topic, partitions, seconds,
                                                 batch_kib, ready, go, start_at, results),
                               daemon=True)
                for _ in range(producers)]
    for child in children:
        child.start()
    finished = False
    try:
        for _ in children:
            ready.get(timeout=60)
        before = scrape(cluster.metrics)
        spy = None
        with ServerSampler(cluster.server_pid) as sampler:
            start_at.value = time.monotonic() + 0.2
            go.set()
            if profile:
                # BENCH_PYSPY="--native --idle" for more detail (--native pauses the server
                # at each sample, so it slows it down; the default does not).
                extra = os.environ.get("BENCH_PYSPY", "--nonblocking").split()
                spy = subprocess.Popen([common.PY_SPY, "record",
                                        "--pid", str(cluster.server_pid), "--duration",
                                        str(max(1, int(seconds - 1))), "--rate", "200",
                                        "--threads", "--format", "raw", *extra,
                                        "--output", profile], stdout=subprocess.DEVNULL,
                                       stderr=subprocess.PIPE, text=True)
            outcomes = [results.get(timeout=seconds + 120) for _ in children]
        after = scrape(cluster.metrics)
        if spy is not None:
            _, spy_err = spy.communicate(timeout=60)
            if spy.returncode:
                print(f"py-spy failed: {spy_err.strip()}", file=sys.stderr)
        finished = True
    finally:
        stop_children(children, finished)
    failed = [o["error"] for o in outcomes if "error" in o]
    if failed:
        raise RuntimeError(f"{kind} {producers}x{partitions}: {failed[0]}")
    start = start_at.value
    elapsed = max(o["last_ack"] for o in outcomes) - start
    records = sum(o["records"] for o in outcomes)
    latencies = array.array("d")
    for o in outcomes:
        latencies.frombytes(o["latencies"])
    errors: collections.Counter = collections.Counter()
    for o in outcomes:
        errors.update(o["errors"])

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    fsyncs = delta("atomlog_partition_fsyncs_total")
    appended = delta("atomlog_partition_bytes_in_total")
    server_batches = sum(o["batches"] for o in outcomes)
    bpf_count = delta("atomlog_partition_batches_per_fsync_count")
    if bpf_count:
        batches_per_fsync = delta("atomlog_partition_batches_per_fsync_sum") / bpf_count
        bpf_source = "metric"
    elif server_batches and fsyncs:
        batches_per_fsync, bpf_source = server_batches / fsyncs, "sent/fsyncs"
    else:
        batches_per_fsync, bpf_source = float("nan"), "-"
    fsync_s = delta("atomlog_partition_fsync_duration_seconds_sum")
    append_s = delta("atomlog_partition_append_duration_seconds_sum")
    client_cpu = sum(o["cpu_s"] for o in outcomes) / elapsed
    return {
        "kind": kind, "producers": producers, "partitions": partitions, "topic": topic,
        "records": records, "seconds": elapsed, "records_per_s": records / elapsed,
        "mb_per_s": records * RECORD_BYTES / elapsed / 1e6,
        "log_mb_per_s": appended / elapsed / 1e6,
        "p50_ms": percentile(latencies, 0.50) * 1000, "p99_ms": percentile(latencies, 0.99) * 1000,
        "latency_samples": len(latencies),
        "rss_mib": sampler.peak_rss, "server_cpu": sampler.cpu_cores,
        "server_main_cpu": sampler.main_cores, "client_cpu": client_cpu,
        "client_cpu_ms_per_mb": client_cpu_ms_per_mb(client_cpu, records / elapsed),
        "machine_busy_pct": sampler.machine_busy_pct,
        "other_cpu": max(0.0, sampler.busy_cores - sampler.cpu_cores - client_cpu),
        "fsyncs_per_s": fsyncs / elapsed, "batches_per_fsync": batches_per_fsync,
        "bpf_source": bpf_source, "fsync_busy": fsync_s / elapsed,
        "append_busy": append_s / elapsed, "errors": dict(errors),
        # Server CPU seconds per MB appended: less disturbed by other jobs than MB/s.
        "server_cpu_ms_per_mb": 1e3 * sampler.cpu_s / max(appended / 1e6, 1e-9),
        "server_loop_ms_per_mb": 1e3 * sampler.main_s / max(appended / 1e6, 1e-9),
        # Mean handling time of a call on the server (all methods; Produce in these cells).
        "server_call_ms": 1e3 * delta("atomlog_rpc_duration_seconds_sum")
        / max(delta("atomlog_rpc_duration_seconds_count"), 1),
    }


def run_floor(ctx, producers: int, partitions: int, seconds: float, batch_kib: int) -> dict:
    """The cell's wire producers against floor_server: what a Python gRPC server that
    stores nothing reaches with the same requests on the same CPUs."""
    from services.launcher import free_port

    port = free_port()
    ready, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    server = ctx.Process(target=floor_server, args=(port, ready), daemon=True)
    server.start()
    start_at = ctx.Value("d", 0.0)
    children = [ctx.Process(target=floor_producer, args=(
        f"127.0.0.1:{port}", "floor", partitions, seconds, batch_kib, ready, go, start_at,
        results), daemon=True) for _ in range(producers)]
    try:
        ready.get(timeout=60)  # the server
        for child in children:
            child.start()
        for _ in children:
            ready.get(timeout=60)
        with ServerSampler(server.pid) as sampler:
            start_at.value = time.monotonic() + 0.2
            go.set()
            outcomes = [results.get(timeout=seconds + 120) for _ in children]
    finally:
        stop_children(children + [server], finished=False)  # the server never ends by itself
    failed = [o["error"] for o in outcomes if "error" in o]
    if failed:
        raise RuntimeError(f"gRPC floor {producers}x{partitions}: {failed[0]}")
    elapsed = max(o["last_ack"] for o in outcomes) - start_at.value
    records = sum(o["records"] for o in outcomes)
    mb = records * RECORD_BYTES / 1e6
    return {"mb_per_s": mb / elapsed, "server_cpu": sampler.cpu_cores,
            "server_cpu_ms_per_mb": 1e3 * sampler.cpu_s / max(mb, 1e-9),
            "client_cpu": sum(o["cpu_s"] for o in outcomes) / elapsed}


# ------------------------------------------------------------------ reads

def raw_fetcher(address: str, topic: str, ends: list[int], seconds: float, ready, go,
                results) -> None:
    _child_setup()
    try:
        channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        stub = partition_pb2_grpc.PartitionServiceStub(channel)
        grpc.channel_ready_future(channel).result(timeout=30)
        ready.put(os.getpid())
        go.wait()
        positions = [0] * len(ends)
        total_bytes = fetches = 0
        faults0 = minor_faults()
        cpu0 = sum(os.times()[:2])
        started = time.monotonic()
        deadline = started + seconds
        while time.monotonic() < deadline:
            items = [partition_pb2.FetchItem(
                topic_partition=common_pb2.TopicPartition(topic=topic, partition=p),
                fetch_offset=positions[p], max_bytes=FETCH_MAX_BYTES)
                for p in range(len(ends)) if positions[p] < ends[p]]
            if not items:
                break
            reply = stub.Fetch(partition_pb2.FetchRequest(
                items=items, max_wait_ms=0, max_bytes=FETCH_MAX_BYTES), timeout=30)
            fetches += 1
            for result in reply.results:
                if result.error.reason:
                    raise RuntimeError(f"Fetch: {result.error.reason} {result.error.message}")
                total_bytes += len(result.record_batches)
                positions[result.topic_partition.partition] = result.next_fetch_offset
        elapsed = time.monotonic() - started
        channel.close()
        results.put({"records": sum(positions), "bytes": total_bytes, "seconds": elapsed,
                     "fetches": fetches, "cpu_s": sum(os.times()[:2]) - cpu0,
                     "faults": minor_faults() - faults0, "complete": positions == ends})
    except BaseException as error:  # noqa: BLE001 — reported by the parent
        ready.put(os.getpid())
        results.put({"error": f"{type(error).__name__}: {error}"})


def sdk_fetcher(arrow: bool, address: str, topic: str, ends: list[int], seconds: float,
                ready, go, results) -> None:
    """The SDK consumer: poll() and the length of every message's value in Python, or
    (arrow) poll_arrow() and the value column's lengths summed by an Arrow kernel."""
    _child_setup()
    try:
        from spark_client import Client

        with Client(address) as client:
            consumer = client.consumer(topic, max_bytes_per_request=FETCH_MAX_BYTES)
            ready.put(os.getpid())
            go.wait()
            expected = sum(ends)
            records = value_bytes = 0
            faults0 = minor_faults()
            cpu0 = sum(os.times()[:2])
            started = time.monotonic()
            deadline = started + seconds
            while records < expected and time.monotonic() < deadline:
                if arrow:
                    table = consumer.poll_arrow(timeout_s=1.0, max_records=100_000)
                    records += table.num_rows
                    value_bytes += pc.sum(pc.binary_length(table.column("value"))).as_py() or 0
                    continue
                for message in consumer.poll(timeout_s=1.0, max_records=100_000):
                    records += 1
                    value_bytes += len(message.value)
            elapsed = time.monotonic() - started
            consumer.close()
        results.put({"records": records, "bytes": value_bytes, "seconds": elapsed,
                     "cpu_s": sum(os.times()[:2]) - cpu0, "faults": minor_faults() - faults0,
                     "complete": records >= expected})
    except BaseException as error:  # noqa: BLE001
        ready.put(os.getpid())
        results.put({"error": f"{type(error).__name__}: {error}"})


def run_reader(ctx, cluster: Cluster, kind: str, topic: str, partitions: int,
               seconds: float) -> dict:
    ends = high_watermarks(cluster.bootstrap, topic, partitions)
    ready, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    target = (raw_fetcher if kind == "raw Fetch"
              else functools.partial(sdk_fetcher, kind == "sdk poll_arrow"))
    child = ctx.Process(target=target, args=(cluster.bootstrap, topic, ends, seconds, ready, go,
                                             results), daemon=True)
    child.start()
    finished = False
    try:
        ready.get(timeout=60)
        with ServerSampler(cluster.server_pid) as sampler:
            go.set()
            outcome = results.get(timeout=seconds + 120)
        finished = True
    finally:
        stop_children([child], finished)
    if "error" in outcome:
        raise RuntimeError(f"{kind} of {topic}: {outcome['error']}")
    if kind != "raw Fetch" and outcome["bytes"] != outcome["records"] * RECORD_BYTES:
        raise RuntimeError(f"{kind} of {topic}: {outcome['bytes']} value bytes in "
                           f"{outcome['records']} records")
    elapsed = outcome["seconds"]
    client_cpu = outcome["cpu_s"] / elapsed
    return {"kind": kind, "topic": topic, "partitions": partitions, "records": outcome["records"],
            "of_records": sum(ends), "complete": outcome["complete"], "seconds": elapsed,
            "records_per_s": outcome["records"] / elapsed,
            "mb_per_s": outcome["records"] * RECORD_BYTES / elapsed / 1e6,
            "client_cpu": client_cpu,
            "client_cpu_ms_per_mb": client_cpu_ms_per_mb(client_cpu, outcome["records"] / elapsed),
            "faults_per_mb": outcome["faults"] / max(outcome["records"] * RECORD_BYTES / 1e6, 1e-9),
            "server_cpu": sampler.cpu_cores, "server_main_cpu": sampler.main_cores,
            "other_cpu": max(0.0, sampler.busy_cores - sampler.cpu_cores - client_cpu),
            "rss_mib": sampler.peak_rss}


# ------------------------------------------------------------------ raw baseline

# Most bytes the per-cell raw baseline writes (a cell writes 1-4 GB).
RAW_AFTER_CAP = 4 << 30


def raw_group(row: dict, batch_bytes: int) -> float:
    """G for a cell's raw baseline: the batches per fsync the server achieved, to one
    decimal, not rounded to a whole number: the raw file gets the same fsyncs per byte
    as the server (bench/common.py spreads fractional G evenly)."""
    if row["kind"] != "wire":
        # SDK batches are smaller than the wire ones: scale G to the same bytes.
        return max(1.0, round(row["log_mb_per_s"] / max(row["fsyncs_per_s"], 1e-9)
                              * 1e6 / batch_bytes, 1))
    bpf = row["batches_per_fsync"]
    return max(1.0, round(bpf, 1)) if bpf == bpf else 1.0


def raw_baseline(directory: Path, batch: bytes, per_fsync: float, total_bytes: int,
                 rounds: int = 3) -> float:
    """Median over rounds of raw_append (the first round after a short warm-up)."""
    raw_append(directory, batch, per_fsync, 16 << 20)
    return statistics.median(raw_append(directory, batch, per_fsync, total_bytes // rounds)
                             for _ in range(rounds))


def raw_append(directory: Path, batch: bytes, per_fsync: float, total_bytes: int) -> float:
    """MB/s (payload, 1 KiB per record) of the raw baseline (bench/common.py)."""
    batches = max(math.ceil(per_fsync), total_bytes // len(batch))
    elapsed = common.raw_append_seconds(directory, batch, batches, per_fsync)
    records = batches * parse_header(batch).record_count
    return records * RECORD_BYTES / elapsed / 1e6


# ------------------------------------------------------------------ output

def fmt_errors(errors: dict) -> str:
    return ", ".join(f"{k} x{v}" for k, v in sorted(errors.items())) or "-"


def produce_table(rows: list[dict]) -> list[str]:
    lines = ["| producer | procs | parts | records/s | MB/s | % of raw | % of raw after | ack p50 ms | ack p99 ms "
             "| server RSS MiB | server CPU (loop) | server CPU ms/MB (loop) | client CPU "
             "| other CPU | fsyncs/s | batches/fsync | errors |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
             "| ---: | ---: | ---: | --- |"]
    for r in rows:
        raw = f"{r['pct_of_raw']:.0f}% (G={r['raw_group']:g})" if r.get("pct_of_raw") else "-"
        after = (f"{r['pct_of_raw_after']:.0f}% ({r['raw_after_mb_s']:.0f})"
                 if r.get("pct_of_raw_after") else "-")
        bpf = f"{r['batches_per_fsync']:.1f}" if r["kind"] == "wire" else "-"
        lines.append(
            f"| {r['kind']} | {r['producers']} | {r['partitions']} | {r['records_per_s']:,.0f} "
            f"| {r['mb_per_s']:.1f} | {raw} | {after} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} "
            f"| {r['rss_mib']:.0f} | {r['server_cpu']:.2f} ({r['server_main_cpu']:.2f}) "
            f"| {r['server_cpu_ms_per_mb']:.2f} ({r['server_loop_ms_per_mb']:.2f}) "
            f"| {r['client_cpu']:.2f} | {r['other_cpu']:.2f} | {r['fsyncs_per_s']:.0f} | {bpf} "
            f"| {fmt_errors(r['errors'])} |")
    return lines


def floor_table(rows: list[dict]) -> list[str]:
    """The gRPC floor of each wire cell, measured right after it (run_floor)."""
    wire = [r for r in rows if r.get("floor")]
    if not wire:
        return []
    lines = ["", "**gRPC floor** (same run, right after each wire cell): the same wire producer",
             "processes against a do-nothing grpc.aio server in its own process (protobuf",
             "parsing, batch header read, a reply; no storage, no fsync, no interceptor or",
             "metrics): what any Python gRPC server reaches with these requests while it",
             "shares the 2 CPUs with its clients.", "",
             "| cell | floor MB/s | floor % of raw | floor server CPU ms/MB | floor client CPU "
             "| atomlog MB/s | % of floor | atomlog server CPU ms/MB |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in wire:
        f = r["floor"]
        of_raw = f"{f['pct_of_raw']:.0f}%" if f.get("pct_of_raw") else "-"
        lines.append(f"| wire {r['producers']}x{r['partitions']} | {f['mb_per_s']:.0f} "
                     f"| {of_raw} | {f['server_cpu_ms_per_mb']:.2f} | {f['client_cpu']:.2f} "
                     f"| {r['mb_per_s']:.0f} | {r['pct_of_floor']:.0f}% "
                     f"| {r['server_cpu_ms_per_mb']:.2f} |")
    return lines


def shape(row: dict) -> str:
    """A producer cell's PRODUCERSxPARTITIONS, a reader's partitions."""
    if "producers" in row:
        return f"{row['producers']}x{row['partitions']}"
    return f"{row['partitions']} partition" + ("s" if row["partitions"] != 1 else "")


def same_shape(rows: list[dict], kind: str, like: dict) -> dict | None:
    """This run's row of `kind` with the shape of `like`: producers x partitions (readers:
    partitions, hence the same topic)."""
    return next((r for r in rows if r["kind"] == kind and r["partitions"] == like["partitions"]
                 and r.get("producers") == like.get("producers")), None)


def share_of(row: dict, baseline: dict | None) -> float | None:
    """row's MB/s in % of baseline's (None without a baseline)."""
    return 100 * row["mb_per_s"] / baseline["mb_per_s"] if baseline else None


def pct(value: float | None) -> str:
    return f"{value:.0f}%" if value is not None else "-"


def batch_table(rows: list[dict]) -> list[str]:
    """send_batch() cells next to the wire and sdk send() cells of the same shape."""
    batch = [r for r in rows if r["kind"] == "batch"]
    if not batch:
        return []
    lines = ["", "**send_batch() against its baselines** (same run, same shapes): MB/s and "
             "client CPU (all", "producer processes) per MB sent.", "",
             "| cell | records/s | MB/s | wire MB/s | % of wire | sdk send() MB/s "
             "| x send() | client CPU ms/MB send() | client CPU ms/MB send_batch |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in batch:
        wire, sdk = same_shape(rows, "wire", r), same_shape(rows, "sdk", r)
        wire_mb = f"{wire['mb_per_s']:.1f}" if wire else "-"
        sdk_mb, times, sdk_cpu = (
            (f"{sdk['mb_per_s']:.1f}", f"{r['mb_per_s'] / sdk['mb_per_s']:.1f}x",
             f"{sdk['client_cpu_ms_per_mb']:.1f}") if sdk else ("-", "-", "-"))
        lines.append(f"| batch {shape(r)} | {r['records_per_s']:,.0f} "
                     f"| {r['mb_per_s']:.1f} | {wire_mb} | {pct(share_of(r, wire))} | {sdk_mb} "
                     f"| {times} | {sdk_cpu} | {r['client_cpu_ms_per_mb']:.1f} |")
    return lines


def read_table(rows: list[dict]) -> list[str]:
    lines = ["| reader | parts | records read | records/s | MB/s | % of raw Fetch "
             "| server CPU (loop) | client CPU | client CPU ms/MB | client page faults/MB "
             "| other CPU | server RSS MiB |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        done = "" if r["complete"] else f" of {r['of_records']:,} (time cap)"
        raw = same_shape(rows, "raw Fetch", r) if r["kind"] != "raw Fetch" else None
        of_raw = share_of(r, raw)
        lines.append(f"| {r['kind']} | {r['partitions']} | {r['records']:,}{done} "
                     f"| {r['records_per_s']:,.0f} | {r['mb_per_s']:.1f} | {pct(of_raw)} "
                     f"| {r['server_cpu']:.2f} ({r['server_main_cpu']:.2f}) "
                     f"| {r['client_cpu']:.2f} | {r['client_cpu_ms_per_mb']:.1f} "
                     f"| {r.get('faults_per_mb', float('nan')):.0f} "
                     f"| {r['other_cpu']:.2f} | {r['rss_mib']:.0f} |")
    return lines


def median_reads(reads: list[dict]) -> list[dict]:
    """One row per reader and partition count: its round of median MB/s (the lower of the
    middle two for an even count), in the order they first ran."""
    by_cell: dict[tuple, list[dict]] = {}
    for read in reads:
        by_cell.setdefault((read["kind"], read["partitions"]), []).append(read)
    out = []
    for runs in by_cell.values():
        chosen = dict(sorted(runs, key=lambda r: r["mb_per_s"])[(len(runs) - 1) // 2])
        chosen["rounds"] = len(runs)
        out.append(chosen)
    return out


def read_round_shares(reads: list[dict]) -> list[str]:
    """poll_arrow()'s and poll()'s share of raw Fetch of the same topic in each read round
    (the cells of a round ran one after the other), and the median, against the target."""
    rounds = sorted({r.get("round", 0) for r in reads})
    if len(rounds) < 2:
        return []
    out = []
    for kind, label in (("sdk poll_arrow", "poll_arrow()"), ("sdk consumer", "poll()")):
        for partitions in sorted({r["partitions"] for r in reads}):
            shares = []
            for round_ in rounds:
                pool = [r for r in reads if r.get("round", 0) == round_
                        and r["partitions"] == partitions]
                mine = next((r for r in pool if r["kind"] == kind), None)
                raw = next((r for r in pool if r["kind"] == "raw Fetch"), None)
                if mine and raw:
                    shares.append(100 * mine["mb_per_s"] / raw["mb_per_s"])
            if not shares:
                continue
            median = statistics.median(shares)
            line = (f"- {label} on {partitions} partition{'s' if partitions > 1 else ''}, "
                    "share of raw Fetch round by round: "
                    + ", ".join(f"{x:.0f}%" for x in shares) + f"; median {median:.0f}%")
            if kind == "sdk poll_arrow":
                line += (f" (target {TARGET_ARROW_OF_FETCH:.0%}: "
                         + ("met" if median >= TARGET_ARROW_OF_FETCH * 100 else "NOT met")
                         + f"; {sum(x >= TARGET_ARROW_OF_FETCH * 100 for x in shares)} of "
                         f"{len(shares)} rounds)")
            out.append(line + ".")
    return out


def median_rounds(rows: list[dict]) -> list[dict]:
    """One row per cell: its round of median MB/s (the lower of the middle two for an even
    count), in the order cells first ran."""
    by_cell: dict[tuple, list[dict]] = {}
    for row in rows:
        by_cell.setdefault((row["kind"], row["producers"], row["partitions"]), []).append(row)
    out = []
    for runs in by_cell.values():
        ranked = sorted(runs, key=lambda r: r["mb_per_s"])
        chosen = dict(ranked[(len(ranked) - 1) // 2])
        chosen["rounds"] = len(runs)
        out.append(chosen)
    return out


def round_shares(rows: list[dict]) -> list[str]:
    """send_batch()'s share of the wire cell of the same shape in each round (the two ran
    one after the other), and its median over the rounds, against the target."""
    rounds = sorted({r.get("round", 0) for r in rows})
    if len(rounds) < 2:
        return []
    out = []
    for batch in [r for r in rows if r["kind"] == "batch" and r.get("round", 0) == rounds[0]]:
        shares = []
        for round_ in rounds:
            pool = [r for r in rows if r.get("round", 0) == round_]
            mine = same_shape(pool, "batch", batch)
            share = share_of(mine, same_shape(pool, "wire", batch)) if mine else None
            if share is not None:
                shares.append(share)
        if shares:
            median = statistics.median(shares)
            out.append(f"- send_batch() {shape(batch)}, share of the wire cell round by round: "
                       + ", ".join(f"{s:.0f}%" for s in shares)
                       + f"; median {median:.0f}% (target {TARGET_BATCH_OF_WIRE:.0%}: "
                       + ("met" if median >= TARGET_BATCH_OF_WIRE * 100 else "NOT met")
                       + f"; {sum(s >= TARGET_BATCH_OF_WIRE * 100 for s in shares)} of "
                       + f"{len(shares)} rounds).")
    return out


def machine(load: float) -> str:
    return common.machine(load)


def verdicts(rows: list[dict], reads: list[dict], baselines: dict) -> list[str]:
    def met(ok: bool) -> str:
        return "met" if ok else "NOT met"

    def share_verdict(label: str, pool: list[dict], kind: str, baseline: str, of: str,
                      target: float) -> list[str]:
        """`kind`'s share of the same-shape `baseline` row per cell, against the target."""
        found = [(r, share_of(r, same_shape(pool, baseline, r)))
                 for r in pool if r["kind"] == kind]
        found = [(r, share) for r, share in found if share is not None]
        if not found:
            return []
        low, high = min(s for _, s in found), max(s for _, s in found)
        cells = ", ".join(f"{shape(r)} {share:.0f}%" for r, share in found)
        return [f"- {label}: {low:.0f}-{high:.0f}% of {of} ({cells}); target {target:.0%}: "
                f"{met(high >= target * 100)} by the best cell, {met(low >= target * 100)} "
                "by every cell."]

    def cpu_per_mb(pool: list[dict], kind: str) -> str:
        values = [r["client_cpu_ms_per_mb"] for r in pool if r["kind"] == kind]
        return f"{min(values):.1f}-{max(values):.1f}" if values else "-"

    out = []
    wire = [r for r in rows if r["kind"] == "wire"]
    if wire:
        best = max(wire, key=lambda r: r["mb_per_s"])
        low = min(r["mb_per_s"] for r in wire)
        out.append(f"- Produce (wire): {low:.0f}-{best['mb_per_s']:.0f} MB/s over the cells, best "
                   f"{best['producers']}x{best['partitions']}; target {TARGET_PRODUCE_MB_S:.0f} "
                   f"MB/s: {met(best['mb_per_s'] >= TARGET_PRODUCE_MB_S)} by the best cell, "
                   f"{met(low >= TARGET_PRODUCE_MB_S)} by every cell.")
        for label, key in (("raw append", "pct_of_raw"),
                           ("raw append of the same bytes right after the cell",
                            "pct_of_raw_after")):
            fractions = [r[key] for r in wire if r.get(key)]
            if fractions:
                out.append(f"- Share of {label} (wire): {min(fractions):.0f}-"
                           f"{max(fractions):.0f}%; target {TARGET_RAW_FRACTION:.0%}: "
                           f"{met(max(fractions) >= TARGET_RAW_FRACTION * 100)} by the best "
                           f"cell, {met(min(fractions) >= TARGET_RAW_FRACTION * 100)} by every "
                           "cell.")
    out += share_verdict(f"Produce with send_batch() ({BATCH_CALL_RECORDS:,} x 1 KiB per "
                         "call)", rows, "batch", "wire", "the wire cell of the same shape",
                         TARGET_BATCH_OF_WIRE)
    against_sdk = [(r, same_shape(rows, "sdk", r)) for r in rows if r["kind"] == "batch"]
    times = [r["mb_per_s"] / sdk["mb_per_s"] for r, sdk in against_sdk if sdk]
    if times:
        out.append(f"- send_batch() against send() (sdk cells of the same shape): "
                   f"{min(times):.1f}-{max(times):.1f}x the MB/s; client CPU per MB "
                   f"{cpu_per_mb(rows, 'sdk')} ms (send()) vs {cpu_per_mb(rows, 'batch')} ms "
                   "(send_batch()).")
    floors = [r for r in wire if r.get("floor")]
    if floors:
        share = [r["pct_of_floor"] for r in floors]
        mb = [r["floor"]["mb_per_s"] for r in floors]
        of_raw = [r["floor"]["pct_of_raw"] for r in floors if r["floor"].get("pct_of_raw")]
        out.append(f"- Share of the gRPC floor (wire): {min(share):.0f}-{max(share):.0f}%. "
                   f"The floor itself reached {min(mb):.0f}-{max(mb):.0f} MB/s"
                   + (f", {min(of_raw):.0f}-{max(of_raw):.0f}% of each cell's warm raw append: "
                      "with these requests on this machine, a Python gRPC server that stores "
                      "nothing gets no further than that" if of_raw else "") + ".")
    raw_reads = [r for r in reads if r["kind"] == "raw Fetch"]
    other = statistics.median(r["other_cpu"] for r in rows + reads) if rows or reads else 0.0
    if other > 0.25:
        out.append(f"- **Disturbed run**: other processes used {other:.2f} cores (median over the "
                   "cells) of the machine's, so these figures understate what it can do.")
    if raw_reads:
        best = max(r["mb_per_s"] for r in raw_reads)
        low = min(r["mb_per_s"] for r in raw_reads)
        out.append(f"- Fetch (raw): {low:.0f}-{best:.0f} MB/s; target {TARGET_FETCH_MB_S:.0f} "
                   f"MB/s: {met(best >= TARGET_FETCH_MB_S)} by the best, "
                   f"{met(low >= TARGET_FETCH_MB_S)} by every reader.")
    out += share_verdict("Reads with poll_arrow()", reads, "sdk poll_arrow", "raw Fetch",
                         "raw Fetch of the same topic", TARGET_ARROW_OF_FETCH)
    if any(r["kind"] == "sdk poll_arrow" for r in reads):
        out.append(f"- Client CPU per MB read: {cpu_per_mb(reads, 'raw Fetch')} ms (raw Fetch), "
                   f"{cpu_per_mb(reads, 'sdk consumer')} ms (poll()), "
                   f"{cpu_per_mb(reads, 'sdk poll_arrow')} ms (poll_arrow()).")
    return out


def reading(rows: list[dict], batch_bytes: int) -> list[str]:
    """Where the server's CPU goes and what limits the produce figures: this run's
    figures, and what profiling found (measured separately, see the text)."""
    wire = [r for r in rows if r["kind"] == "wire"]
    if not wire:
        return []
    per_batch = ", ".join(
        f"{r['producers']}x{r['partitions']} {r['server_cpu_ms_per_mb'] * batch_bytes / 1e3:.0f} us"
        for r in wire)
    calls = ", ".join(f"{r['producers']}x{r['partitions']} {r['server_call_ms']:.1f} of "
                      f"{r['p50_ms']:.1f} ms" for r in wire)
    floors = [r for r in wire if r.get("floor")]
    beyond = ", ".join(f"{r['producers']}x{r['partitions']} {r['server_cpu_ms_per_mb']:.2f} vs "
                       f"{r['floor']['server_cpu_ms_per_mb']:.2f}" for r in floors)
    floor_text = [
        f"Against the gRPC floor (server CPU ms/MB, atomlog vs floor): {beyond}. What atomlog",
        "adds is the storage itself (the kernel's copy into the page cache and the fsyncs:",
        "the raw writer's whole cost, about 1-1.5 ms/MB at its 700-1,000 MB/s here) and its",
        "own Python per request (interceptor and metrics, the hand-off to the partition",
        "owner and back, the fsync worker round trip). The floor's clients, sending the",
        "same requests, used about a core themselves: on 2 CPUs with client and server",
        "together, gRPC alone stops near the floor's MB/s whatever the server does.",
    ] if floors else []
    return [
        "",
        f"**Where the server's CPU goes.** Per {batch_bytes / 1024:.0f} KiB batch in this run: "
        f"{per_batch}.",
        *floor_text,
        "Profiling the server during the wire cells (py-spy, perf) and timing each step alone",
        "(2026-11-21): per batch the",
        "CRC32C and header checks take 13 us, producer state 5 us, the owner's and the log's",
        "Python about 20 us, the writev into the page cache about 66 us (a kernel copy, more",
        "on memory new to the VM), and",
        "each fsync about 80 us of kernel CPU plus a worker-thread round trip. The rest is",
        "gRPC: HTTP/2 framing and flow control, each call's asyncio task and interceptor,",
        "protobuf parsing, and the copies of the payload between socket, gRPC buffers and",
        "Python bytes. Most of it is a fixed cost per request: with `--batch-kib 1000`",
        "(batches just under the 1 MiB limit) the server's CPU per MB halved (3.5-4.0 ->",
        "1.9-2.1 ms/MB; a fit gives about 0.7 ms per request + 1.4 ms per MB) and the wire",
        "cells reached 290-380 MB/s in the same conditions.",
        "",
        "**What limits the cells.** Server time per Produce call (mean) against the client's "
        f"ack p50: {calls}.",
        "The rest of the round trip is the client (encoding and sending 258 KiB batches:",
        "about half a core at 250 MB/s, on the same 2 CPUs) and the transport. With 5",
        "requests in flight per partition, 1 producer x 1 partition is bound by that round",
        "trip; the other cells by CPU.",
        "",
        "**The pipelined flush, measured.** Old (serial: fsync, then answer, then write the",
        "next group) and new servers side by side, alternating 5 s cells, on this machine",
        "while other jobs kept its load average at 5-14 (2026-11-21, medians of 4-19 cells",
        "each). Writing every request on arrival during the fsync cut the server time per",
        "call by 20-30% (4x1 15.4 -> 10.8 ms, 1x8 10.6 -> 7.0 ms, 1x1 5.9 -> 4.6 ms) but",
        "not the client's ack latency, and cost up to ~15% more server CPU per MB in the",
        "CPU-bound cells (one owner wake-up, writev and bookkeeping per request instead of",
        "per group); two overlapping fsyncs per partition were no better than one. With the",
        "1 MiB write-ahead threshold (the default), new vs old: MB/s -11% to +12% and CPU",
        "per MB -8% to +16% over 1x1, 4x1 and 4x8, all inside the spread of the runs",
        "themselves. So the flush pipeline does not move these figures: the server is bound",
        "by per-request gRPC CPU, and 1x1 by the client's round trip.",
        *sdk_reading(rows),
    ]


def sdk_reading(rows: list[dict]) -> list[str]:
    """The SDK cells: the client's CPU per MB in this run, and what changed it."""
    sdk = [r for r in rows if r["kind"] == "sdk" and r["mb_per_s"] > 0]
    if not sdk:
        return []
    per_mb = ", ".join(f"{r['producers']}x{r['partitions']} "
                       f"{r['client_cpu'] / r['mb_per_s'] * 1e3:.1f} ms" for r in sdk)
    return [
        "",
        "**The SDK path.** Client CPU (all producer processes) per MB sent in this run:",
        f"{per_mb}. In each process send() appends records and a sender thread encodes",
        "256 KiB batches and calls Produce, under one GIL, so one producer process tops out",
        "near one core. What it cost per 1 KiB record",
        "(2026-11-21, same machine, same harness, before -> after): a frozen-dataclass",
        "Record per send and per record read (1.5 us to build; now a NamedTuple), record",
        "encoding through a bytearray per record (now one join per batch), and glibc",
        "unmapping every freed 256 KiB buffer so the next batch faulted its pages in again",
        "(Client() now keeps buffers under 4 MiB on the heap: services/allocator.py):",
        "client CPU per MB in 1x1 16.6 -> 8.4 ms, sdk cells 54/113/72/106 -> 90/146/78/129",
        "MB/s (1x1/4x1/1x8/4x8), the sdk consumer 82/80 -> 170/159 MB/s. The multi-partition",
        "sdk cells are now bound by the server's fsyncs (one per partition per group commit).",
    ]


def columnar_reading(rows: list[dict], reads: list[dict]) -> list[str]:
    """The columnar APIs against the per-record ones: client CPU per MB in this run."""
    def per_mb(pool: list[dict], kind: str) -> str:
        return ", ".join(f"{shape(r)} {r['client_cpu_ms_per_mb']:.1f}" for r in pool
                         if r["kind"] == kind and r["mb_per_s"] > 0) or "-"

    out = []
    if any(r["kind"] == "batch" for r in rows):
        out += ["", "**send_batch().** Each call hands the producer one Arrow array of "
                f"{BATCH_CALL_RECORDS:,} values; it is",
                "split by partition and cut into batches with Arrow kernels, and each batch "
                "is encoded",
                "as one Arrow IPC message (no Python per record), where send() builds a "
                "Record and a",
                "future per record. Client CPU (all producer processes) per MB sent, ms: "
                f"send() {per_mb(rows, 'sdk')};", f"send_batch() {per_mb(rows, 'batch')}."]
    if any(r["kind"] == "sdk poll_arrow" for r in reads):
        out += ["", "**poll_arrow().** It returns the fetched Arrow buffers as a table (no "
                "copy of keys and",
                "values, no Python object per record); poll() makes a Message tuple per "
                "record. Client CPU",
                f"per MB read, ms: raw Fetch {per_mb(reads, 'raw Fetch')}; poll() "
                f"{per_mb(reads, 'sdk consumer')}; poll_arrow() "
                f"{per_mb(reads, 'sdk poll_arrow')}."]
    return out


def section(rows, reads, baselines, args, command: str, load: float, batch_bytes: int,
            every_round: list[dict] | None = None) -> str:
    cpus = os.cpu_count()
    every_read, reads = reads, median_reads(reads)
    lines = [
        BEGIN,
        "## Produce and fetch (issue 3)",
        "",
        f"`{command}` — {time.strftime('%Y-%m-%d')}, {machine(load)}.",
        "One partition server, one coordinator, one id allocator and ZooKeeper, started by the",
        "benchmark in a temporary directory. Every producer and reader is a separate OS process",
        f"on the same machine: **client and server share the {cpus} CPUs**. CPU columns are cores",
        "used over the cell: the server process (its event-loop thread in brackets), the client",
        "processes, and everything else on the machine (`other`: ZooKeeper, kernel threads, other",
        "jobs; high values mean the run was disturbed). Records are 1 KiB values; MB/s = records",
        "x 1024 / 1e6, as peers-bench. Durable acks: the server default",
        "`partition.flush_policy=fsync` (one fsync per group commit, before any ack). The",
        "partition owner pipelines its group commits (partition_server/owner.py): while an",
        f"fsync runs ({OWNER_FSYNCS_IN_FLIGHT} at most), it writes queued requests ahead once "
        f"{OWNER_WRITE_AHEAD_BYTES >> 20} MiB wait,",
        "and acknowledges in log order, each batch only after an fsync begun after its write",
        "ended. Each cell",
        f"runs {args.seconds:g} s on a new topic; throughput counts acknowledged records from the",
        "common start to the last ack." + (
            f" The cells ran {args.rounds} times in turn (in order, then in reverse, ...): "
            "the tables show each cell's round of median MB/s, and send_batch()'s share of the "
            "wire cell is also given round by round." if args.rounds > 1 else ""),
        "**server CPU ms/MB** is the server process's CPU seconds",
        "(its event-loop thread in brackets) per MB appended: less disturbed by other jobs on",
        "the machine than MB/s.",
        "",
        f"- **wire**: pre-encoded idempotent batches of {batch_bytes / 1024:.0f} KiB "
        f"({records_per_batch(args.batch_kib)} records, columnar: magic 2,",
        "  as the SDK writes them; real producer id/epoch; consecutive sequences) sent with",
        f"  grpc.aio, up to {MAX_IN_FLIGHT} in flight per partition (one until the first ack): "
        "measures",
        "  the server. Ack latency per Produce request. Errors are refusals the producer",
        "  recovered from by resending (gRPC may deliver pipelined requests out of order).",
        "- **sdk**: `Client(...).producer()` with its defaults (256 KiB batches, linger 5 ms, 5 in",
        "  flight) and `send()` of 1 KiB values in a loop: the end-to-end client path. Ack latency",
        "  per record, send() to its future (one record in 64 sampled, by a done callback: a",
        "  callback per record would cost the client as much as a send): the loop sends as",
        "  fast as it can, so this includes the wait in the producer's 64 MiB buffer.",
        "- **batch**: the same producer fed by `send_batch(topic, values)`, values a pyarrow",
        f"  binary array of {BATCH_CALL_RECORDS:,} 1 KiB values per call (half a Spark Arrow "
        "batch at its default",
        f"  10,000 rows; a call is cut into {args.batch_kib} KiB batches of one partition, the "
        "next call goes",
        f"  to the next partition), at most {BATCH_CALLS_IN_FLIGHT} calls unacknowledged per "
        "process (the oldest call's",
        "  future awaited before the next call; about "
        f"{BATCH_CALLS_IN_FLIGHT * BATCH_CALL_RECORDS * RECORD_BYTES / 2**20:.0f} MiB, under "
        "the producer's buffer).",
        "  Records count once acknowledged, as for sdk. Ack latency per call, send_batch() to",
        "  its future (all of its batches acknowledged).",
        "- **% of raw**: our MB/s over plain Python writing the same batch bytes to a new file on",
        "  the same disk (`os.write` per batch, `os.fsync` every G batches; median of 3, cluster",
        "  idle, no client running), with G = the batches per fsync the server achieved in that",
        "  cell, to one decimal (fractional G: fsyncs spread evenly, so the file gets the same",
        "  fsyncs per byte as the server; sdk, batch: the same bytes per fsync). The baseline is",
        "  sequential (write, fsync, write, ...); the server may write ahead during an fsync",
        "  (and, configured so, overlap fsyncs), which lowers its G at a given load, and a",
        "  lower G makes the baseline slower: compare cells by MB/s and CPU ms/MB as well. The",
        "  raw figures vary by tens of percent between runs on this shared virtual disk (see",
        "  the table below: neighbouring G, measured a minute apart).",
        "- **% of raw after** (raw MB/s in brackets): the same, but the raw file gets as many",
        f"  bytes as the cell appended (at most {RAW_AFTER_CAP >> 30} GiB), written right after the cell and",
        "  deleted only at its end, so it meets the machine as the cell left it. On this",
        "  machine that matters: it is a Firecracker VM whose free memory is reported back to",
        "  the host (virtio-balloon free page reporting), so page-cache memory new to the VM",
        "  costs a host fault on first touch. Plain Python writing 3 GB files one after",
        "  another here (2026-11-21) got 314-425 MB/s with 5-8 s of kernel CPU per file, and",
        "  680-1,164 MB/s with 1.1-2.6 s right after deleting earlier files (memory just",
        "  freed is still backed). The raw baseline above recycles 170 MiB files, so it always",
        "  runs warm; a cell writes gigabytes, and only the first cell of a run finds that",
        "  much warm memory. With `--batch-kib 1000` (the smallest cost per request) the",
        "  server's CPU per MB doubled from the second cell on (2.2-2.5 -> 4.1-4.9 ms/MB),",
        "  whatever the cells' shape or order, in the kernel's copy into the page cache",
        "  (perf: copy_folio_from_iter_atomic 15% -> 54% of the server's samples); sync(2)",
        "  between cells changed nothing. The two raw columns bracket the fair figure: the",
        "  first is always warm, the second may be colder than the cell was (it runs after",
        "  the cell used the warm memory up), hence values over 100%.",
        "",
    ]
    lines += produce_table(rows)
    lines += ["", "Raw baseline (same batch bytes, same disk):", "",
              "| batches per fsync (G) | MB/s |", "| ---: | ---: |"]
    lines += [f"| {g:g} | {mb:.0f} |" for g, mb in sorted(baselines.items())]
    lines += floor_table(rows)
    lines += batch_table(rows)
    if reads:
        lines += ["", "Reads of everything from offset 0 of the largest topic of each partition "
                  "count (just",
                  "written, so from the page cache), one reader process: **raw Fetch** (sync gRPC, "
                  f"{FETCH_MAX_BYTES >> 20} MiB",
                  "per request, counts bytes and offsets without decoding records), **sdk "
                  "consumer**",
                  "(`Client(...).consumer()` and `poll()`: a Python message per record, the "
                  "values'",
                  "lengths summed in Python) and **sdk poll_arrow** (the same consumer's "
                  "`poll_arrow()`:",
                  "Arrow tables, the value column's lengths summed with `pyarrow.compute`, no "
                  "Python",
                  "per record). Servers tune glibc's",
                  "malloc at start (services/runtime.py `tune_allocator`): before that, a fresh "
                  "server",
                  "served 8 MiB fetches at 180-210 MB/s, re-faulting about a million pages per "
                  "GB. The SDK consumer raises the client's thresholds likewise to cover its",
                  "Fetch replies (spark_client/consumer.py `tune_for_fetches`); the raw Fetch "
                  "reader keeps glibc's",
                  "defaults (its page faults per MB are in the table)."
                  + (f" Reader cells run {args.read_rounds} times in turn (in order, then in "
                     "reverse): the table shows each reader's median round."
                     if args.read_rounds > 1 else ""), ""]
        lines += read_table(reads)
    lines += ["", "Peers on this machine with the same durability (peers-bench W2: transactions "
              "of 1000 x", f"1 KiB, one client): {PEERS}.",
              f"Targets (issue 3): produce >= {TARGET_PRODUCE_MB_S:.0f} MB/s from one partition "
              f"server, >= {TARGET_RAW_FRACTION:.0%} of raw", f"append, fetch >= "
              f"{TARGET_FETCH_MB_S:.0f} MB/s; columnar APIs: send_batch() >= "
              f"{TARGET_BATCH_OF_WIRE:.0%} of the wire cell of", "the same shape, poll_arrow() >= "
              f"{TARGET_ARROW_OF_FETCH:.0%} of raw Fetch of the same topic.", ""]
    lines += verdicts(rows, reads, baselines)
    lines += round_shares(every_round or rows)
    lines += read_round_shares(every_read)
    lines += reading(rows, batch_bytes)
    lines += columnar_reading(rows, reads)
    lines += [END]
    return "\n".join(lines) + "\n"


def write_docs(text: str) -> None:
    common.write_docs_section(text, BEGIN, END, tuple(ALT_MARKERS))


# ------------------------------------------------------------------ main

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="per produce cell")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 s per cell, no docs")
    parser.add_argument("--batch-kib", type=int, default=256,
                        help="batch size: of the wire producers' pre-encoded batches, and "
                             "the sdk and batch producers' batch_max_bytes")
    parser.add_argument("--cells", default="wire:1x1,wire:1x8,wire:4x1,wire:4x8,"
                        "sdk:1x1,sdk:1x8,sdk:4x1,sdk:4x8,batch:1x1,batch:1x8,batch:4x1,batch:4x8",
                        help="KIND:PRODUCERSxPARTITIONS, comma-separated; KIND is wire "
                             "(pre-encoded batches over gRPC), sdk (producer.send() per "
                             f"record) or batch (producer.send_batch() of {BATCH_CALL_RECORDS:,} "
                             "records per call); default: each kind at 1x1, 1x8, 4x1, 4x8")
    parser.add_argument("--no-reads", action="store_true")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the cells this many times, in turn (forward, then backward, "
                             "...): tables show each cell's median round, and the shares of "
                             "the wire cell are given per round (on a shared machine one round "
                             "moves by tens of percent)")
    parser.add_argument("--read-rounds", type=int, default=1,
                        help="run the reader cells this many times, in turn (forward, then "
                             "backward, ...): the read table shows each reader's median "
                             "round, and poll_arrow()'s share of raw Fetch is given per round")
    parser.add_argument("--no-docs", action="store_true", help="print only")
    parser.add_argument("--profile", metavar="PATH",
                        help="py-spy (collapsed stacks) of the server during the first cell; "
                             "implies --no-docs")
    args = parser.parse_args()
    if args.quick:
        args.seconds = min(args.seconds, 2.0)
    write = not (args.no_docs or args.quick or args.profile)
    command = common.command_line("bench/produce.py", sys.argv[1:])
    cells = []
    for spec in args.cells.split(","):
        kind, shape = spec.strip().split(":")
        producers, partitions = (int(x) for x in shape.split("x"))
        if kind not in ("wire", "sdk", "batch"):
            parser.error(f"unknown producer kind {kind!r}")
        cells.append((kind, producers, partitions))

    def terminate(signum, _frame):
        print(f"signal {signum}: stopping the cluster", file=sys.stderr, flush=True)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminate)
    load = os.getloadavg()[0]
    ctx = mp.get_context("spawn")
    data_dir = Path(tempfile.mkdtemp(prefix="atomlog-bench-produce-"))
    cluster = Cluster(data_dir)
    rows, reads, baselines = [], [], {}
    per_batch = records_per_batch(args.batch_kib)
    batch = make_batch(record_body(os.urandom(RECORD_BYTES), per_batch), per_batch, 1, 0, 0, 0)
    try:
        began = time.monotonic()
        cluster.up()
        print(f"cluster up in {time.monotonic() - began:.1f} s in {data_dir} "
              f"(partition server pid {cluster.server_pid})", flush=True)
        schedule = [(r, cell) for r in range(max(1, args.rounds))
                    for cell in (cells if r % 2 == 0 else cells[::-1])]
        for index, (round_, (kind, producers, partitions)) in enumerate(schedule):
            row = run_producers(ctx, cluster, kind, producers, partitions, args.seconds,
                                args.batch_kib, args.profile if index == 0 else None)
            row["round"] = round_
            # The same bytes, written raw right after the cell: the machine as the cell left
            # it ("% of raw after" in the section text).
            row["raw_group"] = raw_group(row, len(batch))
            cell_bytes = min(int(row["log_mb_per_s"] * row["seconds"] * 1e6), RAW_AFTER_CAP)
            row["raw_after_mb_s"] = raw_append(cluster.server_data, batch, row["raw_group"],
                                               max(cell_bytes, 64 << 20))
            row["pct_of_raw_after"] = 100 * row["mb_per_s"] / row["raw_after_mb_s"]
            if kind == "wire":
                row["floor"] = run_floor(ctx, producers, partitions, args.seconds,
                                         args.batch_kib)
                row["pct_of_floor"] = 100 * row["mb_per_s"] / row["floor"]["mb_per_s"]
                print(f"     gRPC floor {producers}x{partitions}: "
                      f"{row['floor']['mb_per_s']:.0f} MB/s, server CPU "
                      f"{row['floor']['server_cpu_ms_per_mb']:.2f} ms/MB", flush=True)
            rows.append(row)
            print(f"{kind:5s} {producers}x{partitions}{f' r{round_}' if args.rounds > 1 else ''}"
                  f": {row['records_per_s']:9,.0f} rec/s "
                  f"{row['mb_per_s']:6.1f} MB/s  p50 {row['p50_ms']:6.1f} ms  p99 "
                  f"{row['p99_ms']:6.1f} ms  RSS {row['rss_mib']:4.0f} MiB  CPU server "
                  f"{row['server_cpu']:.2f} (loop {row['server_main_cpu']:.2f}) client "
                  f"{row['client_cpu']:.2f} other {row['other_cpu']:.2f}  fsync/s "
                  f"{row['fsyncs_per_s']:4.0f} batches/fsync {row['batches_per_fsync']:.1f} "
                  f"({row['bpf_source']}) fsync busy {row['fsync_busy']:.0%}  server "
                  f"CPU/MB {row['server_cpu_ms_per_mb']:.2f} ms (loop "
                  f"{row['server_loop_ms_per_mb']:.2f})  server call {row['server_call_ms']:.2f} ms"
                  f"  raw after {row['raw_after_mb_s']:.0f} MB/s (G={row['raw_group']:g})"
                  f"  errors "
                  f"{fmt_errors(row['errors'])}", flush=True)
        every_round = rows
        rows = median_rounds(rows)
        # Raw baseline at the group sizes the server achieved (idle cluster, same disk).
        total = (64 if args.quick else 512) << 20
        for row in rows:
            group = row["raw_group"]
            if group not in baselines:
                baselines[group] = raw_baseline(cluster.server_data, batch, group, total)
                print(f"raw os.write+fsync, {group:g} batches of {len(batch)} B per fsync: "
                      f"{baselines[group]:.0f} MB/s", flush=True)
            row["pct_of_raw"] = 100 * row["mb_per_s"] / baselines[group]
            if row.get("floor"):
                row["floor"]["pct_of_raw"] = 100 * row["floor"]["mb_per_s"] / baselines[group]
        if not args.no_reads:
            read_seconds = max(args.seconds, 4.0)
            sources = {}
            for partitions in sorted({r["partitions"] for r in rows}):
                candidates = [r for r in rows if r["partitions"] == partitions]
                sources[partitions] = max(candidates, key=lambda r: r["records"])["topic"]
            cells = [(p, kind) for p in sources for kind in READERS]
            for round_ in range(max(1, args.read_rounds)):
                # In order, then in reverse, ...; poll() is slower: a shorter time cap.
                for partitions, kind in (cells if round_ % 2 == 0 else cells[::-1]):
                    result = run_reader(ctx, cluster, kind, sources[partitions], partitions,
                                        read_seconds * (1 if kind == "sdk consumer" else 3))
                    result["round"] = round_
                    reads.append(result)
                    print(f"{kind:14s} {partitions} partitions"
                          f"{f' r{round_}' if args.read_rounds > 1 else ''}: "
                          f"{result['records_per_s']:9,.0f} "
                          f"rec/s {result['mb_per_s']:6.1f} MB/s  CPU server "
                          f"{result['server_cpu']:.2f} (loop {result['server_main_cpu']:.2f}) "
                          f"client {result['client_cpu']:.2f} ({result['client_cpu_ms_per_mb']:.2f} "
                          f"ms/MB, {result['faults_per_mb']:.0f} faults/MB) other "
                          f"{result['other_cpu']:.2f}  "
                          f"{result['records']:,} of {result['of_records']:,}", flush=True)
    finally:
        cluster.down()
        shutil.rmtree(data_dir, ignore_errors=True)
    text = section(rows, reads, baselines, args, command, load, len(batch), every_round)
    print()
    print(text)
    if write:
        write_docs(text)
        print(f"wrote its section of {DOCS.relative_to(REPO)}")


if __name__ == "__main__":
    main()
