"""Benchmark (replication): a leader's damaged copy, as clients see it
(docs/replication.md, "Corruption found on a leader").

Starts its own local cluster (1 id allocator, 2 coordinators, 3 partition servers,
ZooKeeper) and runs two cells on it:

1. **Hand-over.** A topic of three copies (`min.insync.replicas` 2); one producer thread
   sends 200-byte records to its partition one at a time, each acknowledged before the
   next. `--rounds` times, with every copy in sync: a byte near the end of the middle
   batch of the current leader's oldest segment is flipped and that batch fetched from
   the leader, whose read finds the damage. Per round: **write gap**, the longest pause
   between two acknowledged writes around the fault; **new leader**, from the read to a
   new leader in the partition's metadata; **copy back**, from the read until the damaged
   server is in the ISR again with its copy mended; failed sends. Baseline in the
   same run: `--kill-rounds` kill -9s of the leader (its ZooKeeper session has to expire
   before another replica leads; restarted once the partition serves again). At the end
   every acknowledged record is read back.
2. **Neighbours of a damaged partition.** A topic of two copies (`min.insync.replicas`
   1) beside `--idle` idle partitions of two copies. One partition is left in DATA_LOSS
   with no replica to take it over (its follower's copy deleted while the follower was
   down, then the leader's copy damaged): its follower asks for it again and again, at
   most a second apart. Acknowledged writes to a neighbour with the same leader and
   follower for `--seconds`: writes/s, the follower's and the leader's CPU a write, and
   the follower's event-loop rounds a write (atomlog_replica_fetch_loop_rounds_total).
   Baseline in the same run: the same after `RecoverPartition` mended the partition.

Prints a table and writes its section of docs/benchmarks.md.

    .venv/bin/python bench/damaged_copy.py [--rounds 3] [--kill-rounds 1] [--idle 600]
        [--seconds 10] [--no-docs]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.append(str(REPO / "bench"))  # after the packages: bench/coordinator.py is a script

import common  # noqa: E402

BEGIN, END = "<!-- bench/damaged_copy.py: begin -->", "<!-- bench/damaged_copy.py: end -->"
RECORD = b"d" * 200


def metadata(client, topic: str):
    from atomlog.v1 import metadata_pb2

    reply = client.metadata.call("GetMetadata", metadata_pb2.GetMetadataRequest(topics=[topic]))
    return reply.topics[0]


def wait_for(condition, timeout_s: float, what: str, period_s: float = 0.02) -> float:
    """Poll `condition` until true; returns time.monotonic() then."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if condition():
                return time.monotonic()
        except Exception:  # noqa: BLE001 — a server away meanwhile: ask again
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(period_s)


def in_sync(client, topic: str, partition: int) -> bool:
    part = metadata(client, topic).partitions[partition]
    return bool(part.server_name) and sorted(part.isr) == sorted(part.replicas)


def damage(directory: Path, which: int | None = None) -> int:
    """Flip a byte near the end of a batch of the oldest segment in `directory` (the
    middle one, or the `which`th); returns that batch's offset. (The leaders' files here
    are written through the page cache: whole batches to their end.)"""
    from partition_server.record_batch import iter_batches

    segment = sorted(directory.glob("*.log"))[0]
    data = segment.read_bytes()
    batches = list(iter_batches(data))
    position, header = batches[len(batches) // 2 if which is None else which]
    flipped = position + header.size - 5
    fd = os.open(segment, os.O_RDWR)
    try:
        os.pwrite(fd, bytes([data[flipped] ^ 0xFF]), flipped)
    finally:
        os.close(fd)
    return header.base_offset


def fetch_reason(client, address: str, topic: str, partition: int, offset: int) -> str:
    from atomlog.v1 import common_pb2, partition_pb2, partition_pb2_grpc

    stub = partition_pb2_grpc.PartitionServiceStub(client.channels.get(address))
    reply = stub.Fetch(partition_pb2.FetchRequest(items=[partition_pb2.FetchItem(
        topic_partition=common_pb2.TopicPartition(topic=topic, partition=partition),
        fetch_offset=offset)]), timeout=10)
    return reply.results[0].error.reason


class Writer(threading.Thread):
    """Acknowledged writes one at a time to one partition: (acknowledged at, value) of
    each, and the failed sends."""

    def __init__(self, client, topic: str, partition: int):
        super().__init__(daemon=True)
        self.client, self.topic, self.partition = client, topic, partition
        self.acked: list[tuple[float, bytes]] = []
        self.failed = 0
        self.stopping = threading.Event()

    def run(self) -> None:
        with self.client.producer(linger_ms=0) as producer:
            n = 0
            while not self.stopping.is_set():
                value = RECORD + str(n).encode()
                n += 1
                try:
                    producer.send(self.topic, value, partition=self.partition).result(60)
                    self.acked.append((time.monotonic(), value))
                except Exception:  # noqa: BLE001 — counted: a client saw a failure
                    self.failed += 1

    def gap_s(self, since: float) -> float:
        """The longest pause between two acknowledged writes from just before `since`."""
        times = [at for at, _value in self.acked]
        before = [at for at in times if at <= since]
        after = [at for at in times if at > since]
        points = ([before[-1]] if before else [since]) + after
        return max((b - a for a, b in zip(points, points[1:])), default=0.0)


def process(data_dir: Path, name: str):
    """The cluster file's entry of a process now (a restart gives it a new pid)."""
    from services import launcher

    return next(p for p in launcher.ClusterFile.load(data_dir).processes if p.name == name)


def restart(data_dir: Path) -> None:
    from services import launcher

    launcher.up(data_dir, common.SHAPES["cluster"], {}, timeout_s=90)


def handover_cell(client, data_dir: Path, rounds: int, kill_rounds: int) -> list[dict]:
    topic = "handover"
    client.create_topic(topic, partitions=1, replication_factor=3,
                        config={"min.insync.replicas": "2"})
    wait_for(lambda: in_sync(client, topic, 0), 30, f"{topic} in sync")
    writer = Writer(client, topic, 0)
    writer.start()
    rows = []
    try:
        for kind in ["corrupt"] * rounds + ["kill -9"] * kill_rounds:
            wait_for(lambda: in_sync(client, topic, 0), 120, f"{topic} in sync")
            wait_for(lambda: len(writer.acked) > 200, 60, "writes flowing")
            time.sleep(1.0)
            part = metadata(client, topic).partitions[0]
            leader, failed_before = part.server_name, writer.failed
            entry = process(data_dir, leader)
            began = time.monotonic()
            if kind == "corrupt":
                offset = damage(Path(entry.data_dir) / "partitions" / f"{topic}-0")
                began = time.monotonic()
                reason = fetch_reason(client, part.server_address, topic, 0, offset)
                assert reason == "DATA_LOSS", reason
            else:
                os.kill(entry.pid, signal.SIGKILL)
            led = wait_for(lambda: metadata(client, topic).partitions[0].server_name
                           not in ("", leader), 120, "a new leader")
            if kind != "corrupt":
                wait_for(lambda: len(writer.acked) and writer.acked[-1][0] > led, 120,
                         "a write through the new leader")
                restart(data_dir)
            back = wait_for(lambda: leader in metadata(client, topic).partitions[0].isr,
                            120, f"{leader} back in the ISR")
            wait_for(lambda: writer.acked[-1][0] > back + 1.0, 60, "writes after")
            rows.append({"kind": kind, "gap_ms": writer.gap_s(began) * 1000,
                         "leader_ms": (led - began) * 1000, "back_s": back - began,
                         "failed": writer.failed - failed_before})
            print(f"  {kind}: {rows[-1]}", flush=True)
    finally:
        writer.stopping.set()
        writer.join(120)
    with client.consumer(topic) as consumer:
        read = {m.value for batch in consumer.read_until(idle_timeout_s=30) for m in batch}
    missing = sum(1 for _at, value in writer.acked if value not in read)
    for row in rows:
        row["acked"], row["missing"] = len(writer.acked), missing
    return rows


def neighbours_cell(client, data_dir: Path, idle: int, seconds: float) -> list[dict]:
    from atomlog.v1 import common_pb2, partition_pb2, partition_pb2_grpc

    for first in range(0, idle, 1000):
        client.create_topic(f"idle{first}", partitions=min(1000, idle - first),
                            replication_factor=2, config={"min.insync.replicas": "1"})
    topic = "neighbours"
    client.create_topic(topic, partitions=12, replication_factor=2,
                        config={"min.insync.replicas": "1"})
    wait_for(lambda: all(in_sync(client, topic, p) for p in range(12)), 60, f"{topic} in sync")
    pairs: dict[tuple[str, str], list[int]] = {}
    for number, part in enumerate(metadata(client, topic).partitions):
        follower = next(r for r in part.replicas if r != part.server_name)
        pairs.setdefault((part.server_name, follower), []).append(number)
    (leader, follower), (damaged, neighbour, *_) = next(
        (pair, numbers) for pair, numbers in pairs.items() if len(numbers) >= 2)
    with client.producer(linger_ms=0) as producer:
        for i in range(20):
            for partition in (damaged, neighbour):
                producer.send(topic, RECORD, partition=partition).result(30)
    os.kill(process(data_dir, follower).pid, signal.SIGKILL)
    time.sleep(0.5)
    shutil.rmtree(Path(process(data_dir, follower).data_dir) / "partitions"
                  / f"{topic}-{damaged}")
    damage(Path(process(data_dir, leader).data_dir) / "partitions" / f"{topic}-{damaged}", 10)
    restart(data_dir)
    pids = {s: process(data_dir, s).pid for s in (leader, follower)}
    metrics = {s: process(data_dir, s).metrics_address for s in (leader, follower)}

    def measure(label: str) -> dict:
        wait_for(lambda: in_sync(client, topic, neighbour), 120, "the neighbour in sync")
        time.sleep(3.0)
        rounds0, = common.counter_totals([metrics[follower]],
                                         ("atomlog_replica_fetch_loop_rounds_total",))
        cpu0 = {s: common.cpu_seconds(pids[s]) for s in (leader, follower)}
        writes, began = 0, time.perf_counter()
        with client.producer(linger_ms=0) as producer:
            while time.perf_counter() - began < seconds:
                producer.send(topic, RECORD, partition=neighbour).result(30)
                writes += 1
        elapsed = time.perf_counter() - began
        cpu = {s: common.cpu_seconds(pids[s]) - cpu0[s] for s in (leader, follower)}
        rounds, = common.counter_totals([metrics[follower]],
                                        ("atomlog_replica_fetch_loop_rounds_total",))
        row = {"cell": label, "writes_per_s": writes / elapsed,
               "follower_cpu_ms": cpu[follower] / writes * 1000,
               "leader_cpu_ms": cpu[leader] / writes * 1000,
               "loop_rounds": (rounds - rounds0) / writes}
        print(f"  {label}: {row}", flush=True)
        return row

    # The damaged partition: DATA_LOSS on its leader, nobody to take it over.
    def in_data_loss() -> bool:
        return fetch_reason(client, metadata(client, topic).partitions[damaged].server_address,
                            topic, damaged, 0) == "DATA_LOSS"

    wait_for(in_data_loss, 60, f"{topic}-{damaged} in DATA_LOSS")
    rows = [measure("a neighbour in DATA_LOSS")]
    route = client.metadata.route(topic, damaged)
    stub = partition_pb2_grpc.PartitionServiceStub(client.channels.get(route.address))
    tp = common_pb2.TopicPartition(topic=topic, partition=damaged)
    info = stub.DescribePartition(partition_pb2.DescribePartitionRequest(topic_partition=tp),
                                  timeout=10)
    stub.RecoverPartition(partition_pb2.RecoverPartitionRequest(
        topic_partition=tp, expected_file=info.data_loss.file,
        expected_offset=info.data_loss.offset, accept_data_loss=True), timeout=60)
    wait_for(lambda: in_sync(client, topic, damaged), 120, f"{topic}-{damaged} mended")
    rows.append(measure("none (after RecoverPartition)"))
    return rows


def section(handover: list[dict], neighbours: list[dict], args, when: str,
            load: float) -> str:
    def median(kind: str, key: str) -> str:
        values = [r[key] for r in handover if r["kind"] == kind]
        return "-" if not values else common.median_range(values, ".0f" if key != "back_s"
                                                          else ".1f")

    kinds = [k for k in ("corrupt", "kill -9") if any(r["kind"] == k for r in handover)]
    rows = ["| fault | rounds | write gap ms | new leader after ms | copy back in the ISR "
            "after s | failed sends |", "| --- | --- | --- | --- | --- | --- |"]
    for kind in kinds:
        mine = [r for r in handover if r["kind"] == kind]
        name = ("a byte of the leader's copy flipped, found by a read" if kind == "corrupt"
                else "kill -9 of the leader (baseline)")
        rows.append(f"| {name} | {len(mine)} | {median(kind, 'gap_ms')} | "
                    f"{median(kind, 'leader_ms')} | {median(kind, 'back_s')} | "
                    f"{sum(r['failed'] for r in mine)} |")
    acked = handover[-1]["acked"] if handover else 0
    missing = handover[-1]["missing"] if handover else 0
    table2 = ["| damaged partition beside | writes/s | follower CPU ms a write | leader CPU "
              "ms a write | follower event-loop rounds a write |",
              "| --- | --- | --- | --- | --- |"]
    for r in neighbours:
        table2.append(f"| {r['cell']} | {r['writes_per_s']:,.0f} | {r['follower_cpu_ms']:.2f} "
                      f"| {r['leader_cpu_ms']:.2f} | {r['loop_rounds']:.2f} |")
    return "\n".join([
        BEGIN,
        "## A leader's damaged copy: the hand-over, and its neighbours' copies (replication)",
        "",
        f"`{common.command_line('bench/damaged_copy.py', sys.argv[1:])}` — {when}, "
        f"{common.machine(load)}.",
        "",
        "Hand-over: a topic of three copies, one producer writing 200-byte records one at a "
        "time, each acknowledged (by two copies) before the next; medians (ranges) of the "
        "rounds. Write gap: the longest pause between two acknowledged writes around the "
        "fault; new leader: from the damaging read (or the kill) to a new leader in the "
        "metadata; copy back: until the damaged (or killed and restarted) server is in the "
        f"ISR again. {acked:,} writes acknowledged, {missing} of them missing from the "
        "final read.",
        "",
        *rows,
        "",
        f"Neighbours: a topic of two copies beside {args.idle} idle partitions of two "
        "copies; acknowledged writes to one partition, one at a time, for "
        f"{args.seconds:g} s, while another partition with the same leader and follower is "
        "in DATA_LOSS with no replica to take it over (its follower asks for it at most a "
        "second apart), and after RecoverPartition mended it.",
        "",
        *table2,
        END, ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3,
                        help="hand-overs after a damaged copy is read (default 3)")
    parser.add_argument("--kill-rounds", type=int, default=1,
                        help="kill -9s of the leader, the baseline (default 1)")
    parser.add_argument("--idle", type=int, default=600,
                        help="idle partitions beside the neighbours (default 600)")
    parser.add_argument("--seconds", type=float, default=10.0,
                        help="seconds of writes a neighbours cell (default 10)")
    parser.add_argument("--no-docs", action="store_true", help="print only")
    args = parser.parse_args()
    from spark_client import Client

    load = os.getloadavg()[0]
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    with common.local_cluster("atomlog-bench-damaged-") as (data_dir, _report, address):
        client = Client(address)
        try:
            print("hand-over:", flush=True)
            handover = handover_cell(client, data_dir, args.rounds, args.kill_rounds)
            print("neighbours:", flush=True)
            neighbours = neighbours_cell(client, data_dir, args.idle, args.seconds)
        finally:
            client.close()
    text = section(handover, neighbours, args, when, load)
    print(text)
    if not args.no_docs:
        common.write_docs_section(text, BEGIN, END)


if __name__ == "__main__":
    main()
