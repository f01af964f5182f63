"""Benchmark (issue 19): the storage path of a small transaction, without gRPC, under each
`partition.durability` mode (partition_server/durability.py), in turns.

In one process, 16 partition owners (PartitionOwner: the real write path, group commit
and its durability) on one event loop; `--clients` tasks each run a loop shaped like a
small one-call transaction on the combined server: stage a 3 KiB batch on each of 4
partitions (its own 4 of the 16, as bench/transactions.py's clients do) at once, then one
small batch on a TC-log partition (one of 4 more), then a 1-record "marker" batch on each
of the 4 at once. Per mode it reports transactions/s, the p50/p99 of one transaction, the
group commits and sync calls per transaction, and the CPU of this process per
transaction (utime + stime of all its threads, so the syncing threads' kernel time is
in; the kernel's flusher threads that syncfs hands writeback to are not: the machine's
busy CPU per transaction from /proc/stat is shown beside it, other tenants included).

    .venv/bin/python bench/durability.py [--clients 8] [--seconds 10] [--turns 2]
        [--modes executor,syncfs,fsync] [--dir DIR]

DIR (default: a new directory under the system's temporary directory) decides the
filesystem: syncfs writes back every dirty file of it, other processes' included.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from partition_server import durability  # noqa: E402
from partition_server import metrics as m  # noqa: E402
from partition_server.log import LogConfig  # noqa: E402
from partition_server.owner import OwnerSettings, PartitionOwner  # noqa: E402
from partition_server.record_batch import Record, encode_batch, parse_header  # noqa: E402

DATA_PARTITIONS = 16
TC_PARTITIONS = 4


def _busy_jiffies() -> tuple[int, int]:
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


def _counter(metric) -> float:
    return sum(sample.value for family in metric.collect() for sample in family.samples
               if sample.name.endswith("_total"))


async def run_mode(mode: str, directory: Path, clients: int, seconds: float) -> dict:
    settings = OwnerSettings(log=LogConfig(), durability=mode)
    owners = [PartitionOwner("data", p, directory / f"data-{p}", settings)
              for p in range(DATA_PARTITIONS)]
    tc = [PartitionOwner("tc", p, directory / f"tc-{p}", settings) for p in range(TC_PARTITIONS)]
    for owner in owners + tc:
        await owner.start()
    value = b"v" * 1024
    latencies: list[float] = []
    stop = time.monotonic() + seconds + 2  # 2 s of warm-up first
    measuring = asyncio.Event()

    async def client(index: int) -> None:
        mine = [owners[(index * 4 + k) % DATA_PARTITIONS] for k in range(4)]
        pid = 1000 + index
        sequence = tc_sequence = 0  # the same on each of its 4 partitions
        while time.monotonic() < stop:
            began = time.perf_counter()
            staged = encode_batch([Record(b"k", value)] * 3, producer_id=pid, producer_epoch=0,
                                  base_sequence=sequence, timestamp_ms=1)
            await asyncio.gather(*[o.produce([(staged, parse_header(staged))]) for o in mine])
            decision = encode_batch([Record(b"txn", b"d" * 64)], producer_id=pid,
                                    producer_epoch=0, base_sequence=tc_sequence, timestamp_ms=1)
            await tc[index % TC_PARTITIONS].produce([(decision, parse_header(decision))])
            marker = encode_batch([Record(b"m", b"")], producer_id=pid, producer_epoch=0,
                                  base_sequence=sequence + 3, timestamp_ms=1)
            await asyncio.gather(*[o.produce([(marker, parse_header(marker))]) for o in mine])
            sequence += 4
            tc_sequence += 1
            if measuring.is_set():
                latencies.append(time.perf_counter() - began)

    tasks = [asyncio.create_task(client(i)) for i in range(clients)]
    await asyncio.sleep(2)
    commits_before, syncs_before = _counter(m.FSYNCS), _counter(durability.SYNCS)
    cpu_before, busy_before = os.times(), _busy_jiffies()
    measuring.set()
    began = time.perf_counter()
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - began
    cpu_after, busy_after = os.times(), _busy_jiffies()
    commits = _counter(m.FSYNCS) - commits_before
    syncs = _counter(durability.SYNCS) - syncs_before
    for owner in owners + tc:
        await owner.close()
    count = len(latencies)
    latencies.sort()
    cpu = (cpu_after.user + cpu_after.system) - (cpu_before.user + cpu_before.system)
    jiffies = busy_after[0] - busy_before[0]
    machine_cpu_s = jiffies / os.sysconf("SC_CLK_TCK")
    return {"mode": mode, "transactions": count, "per_s": count / elapsed,
            "p50_ms": latencies[count // 2] * 1e3 if count else 0.0,
            "p99_ms": latencies[int(count * 0.99)] * 1e3 if count else 0.0,
            "group_commits_per_txn": commits / max(count, 1),
            "sync_calls_per_txn": (syncs or commits) / max(count, 1),
            "cpu_ms_per_txn": cpu / max(count, 1) * 1e3,
            "machine_busy_ms_per_txn": machine_cpu_s / max(count, 1) * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--modes", default="executor,syncfs,fsync")
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    modes = args.modes.split(",")
    print(f"load average {os.getloadavg()[0]:.1f}; {os.cpu_count()} CPUs; "
          f"{args.clients} clients, {args.seconds:.0f} s per cell", flush=True)
    for turn in range(1, args.turns + 1):
        for mode in modes:
            with tempfile.TemporaryDirectory(prefix="atomlog-bench-durability-",
                                             dir=args.dir) as directory:
                load = os.getloadavg()[0]
                r = asyncio.run(run_mode(mode, Path(directory), args.clients, args.seconds))
            print(f"turn {turn} {mode:8} (load {load:4.1f}): {r['per_s']:6.0f} txn/s, "
                  f"p50/p99 {r['p50_ms']:6.1f}/{r['p99_ms']:6.1f} ms; "
                  f"{r['group_commits_per_txn']:.2f} group commits, "
                  f"{r['sync_calls_per_txn']:.2f} sync calls per txn; "
                  f"process CPU {r['cpu_ms_per_txn']:.2f} ms/txn; machine busy "
                  f"{r['machine_busy_ms_per_txn']:.2f} ms/txn", flush=True)


if __name__ == "__main__":
    main()
