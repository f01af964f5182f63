"""Benchmark: producer-id blocks per second and allocation latency, with 1 and 2
allocator processes, against a baseline of raw ZooKeeper round trips measured in the
same run on the same ZooKeeper.

Starts its own local cluster (a real ZooKeeper and two allocator processes) in a
temporary directory, drives it from this process with grpc.aio clients (each client
calls AllocateProducerIds one after another), prints a table, and writes its section
of docs/benchmarks.md (replacing an earlier run's section, leaving the rest alone).

    .venv/bin/python bench/id_allocator.py [--seconds 4] [--clients 1,8,32] [--no-docs]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import common  # noqa: E402

import grpc  # noqa: E402
from kazoo.client import KazooClient  # noqa: E402

from atomlog.v1 import id_allocator_pb2 as pb  # noqa: E402
from atomlog.v1 import id_allocator_pb2_grpc as pb_grpc  # noqa: E402
from services import launcher  # noqa: E402

DOCS = REPO / "docs" / "benchmarks.md"
BEGIN, END = "<!-- bench/id_allocator.py: begin -->", "<!-- bench/id_allocator.py: end -->"


percentile = common.percentile


def raw_zookeeper(hosts: str, seconds: float) -> dict[str, float]:
    """What one unbatched allocation costs on ZooKeeper: a get, then a set with the
    version it read (sequential, one kazoo client), and the set alone."""
    client = KazooClient(hosts=hosts)
    client.start(timeout=10)
    try:
        client.ensure_path("/bench/raw")
        results = {}
        for name, with_read in (("get + set(version)", True), ("set(version)", False)):
            latencies: list[float] = []
            _, stat = client.get("/bench/raw")
            version = stat.version
            deadline = time.perf_counter() + seconds
            while time.perf_counter() < deadline:
                began = time.perf_counter()
                if with_read:
                    _, stat = client.get("/bench/raw")
                    version = stat.version
                version = client.set("/bench/raw", b"x" * 120, version=version).version
                latencies.append(time.perf_counter() - began)
            results[name] = {"per_s": len(latencies) / seconds,
                             "p50_ms": percentile(latencies, 0.5) * 1e3,
                             "p99_ms": percentile(latencies, 0.99) * 1e3}
        return results
    finally:
        client.stop()
        client.close()


async def drive(addresses: list[str], clients: int, seconds: float, count: int) -> dict:
    channels = [grpc.aio.insecure_channel(a) for a in addresses]
    stubs = [pb_grpc.IdAllocatorServiceStub(c) for c in channels]
    latencies: list[float] = []
    errors: dict[str, int] = {}
    blocks: list[tuple[int, int]] = []

    async def client(index: int) -> None:
        request = pb.AllocateProducerIdsRequest(count=count, requester=f"bench-{index}")
        calls = 0
        while time.perf_counter() < deadline:
            stub = stubs[(index + calls) % len(stubs)]  # each client alternates allocators
            calls += 1
            began = time.perf_counter()
            try:
                reply = await stub.AllocateProducerIds(request, timeout=10)
            except grpc.aio.AioRpcError as error:
                errors[error.code().name] = errors.get(error.code().name, 0) + 1
                continue
            latencies.append(time.perf_counter() - began)
            blocks.append((reply.first_producer_id, reply.last_producer_id))

    for stub in stubs:  # connect and warm up outside the measurement
        await stub.AllocateProducerIds(pb.AllocateProducerIdsRequest(count=count), timeout=10)
    deadline = time.perf_counter() + seconds
    began = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(clients)))
    elapsed = time.perf_counter() - began
    for channel in channels:
        await channel.close()
    ordered = sorted(blocks)
    assert all(a[1] < b[0] for a, b in zip(ordered, ordered[1:])), "overlapping blocks!"
    return {"blocks_per_s": len(latencies) / elapsed, "p50_ms": percentile(latencies, 0.5) * 1e3,
            "p99_ms": percentile(latencies, 0.99) * 1e3, "max_ms": max(latencies) * 1e3,
            "mean_ms": statistics.fmean(latencies) * 1e3, "errors": errors}


def conflicts(addresses: list[str]) -> int:
    total = 0
    for address in addresses:
        with grpc.insecure_channel(address) as channel:
            total += pb_grpc.IdAllocatorServiceStub(channel).DescribeAllocator(
                pb.DescribeAllocatorRequest(), timeout=5).compare_and_set_conflicts
    return total


def machine(load: float) -> str:
    return common.machine(load, with_java=True)


def section(raw: dict, rows: list[dict], seconds: float, count: int, command: str,
            load: float) -> str:
    lines = [
        BEGIN,
        "## Producer-id allocator (issue 4)",
        "",
        f"`{command}` — {time.strftime('%Y-%m-%d')}, {machine(load)}.",
        "One real ZooKeeper (local, fsync on) and the allocator processes on loopback, all on",
        "this machine with the load generator (one Python process, grpc.aio, each client",
        f"calling AllocateProducerIds(count={count}) back to back for {seconds:g} s, on the",
        "allocators in turn). Every allocation is a read and a compare-and-set write of one",
        "znode; concurrent requests queued in one allocator share one write. Latency is what",
        "the client saw.",
        "",
        "Baseline, same ZooKeeper, one kazoo client, sequential:",
        "",
        "| ZooKeeper operation | per s | p50 ms | p99 ms |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, r in raw.items():
        lines.append(f"| {name} | {r['per_s']:.0f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} |")
    lines += ["", "| allocators | clients | blocks/s | p50 ms | p99 ms | max ms | CAS conflicts | errors |",
              "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        lines.append(f"| {r['allocators']} | {r['clients']} | {r['blocks_per_s']:.0f} | "
                     f"{r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['max_ms']:.1f} | "
                     f"{r['conflicts']} | {r['errors'] or '-'} |")
    lines += [
        "",
        "Reading: one allocation costs about one raw get + set round trip plus a gRPC call;",
        "concurrent callers of one allocator share a write, so blocks/s grows with clients",
        "while ZooKeeper's write rate stays the limit. A second allocator adds availability,",
        "not throughput: both compare-and-set the same znode, so the loser of each race",
        "re-reads and retries after a jittered backoff, which shows in the p99. None of this",
        "is on a request's critical path: a coordinator holds a 1000-id block and fetches",
        "the next at 90% use, so even 400 blocks/s serve 400,000 new producers per second.",
        "The figures move by about 30% between runs on this shared 2-CPU machine.",
        END,
    ]
    return "\n".join(lines) + "\n"


def write_docs(text: str) -> None:
    common.write_docs_section(text, BEGIN, END)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=4.0, help="per measurement")
    parser.add_argument("--clients", default="1,8,32", help="comma-separated client counts")
    parser.add_argument("--count", type=int, default=1000, help="ids per block")
    parser.add_argument("--no-docs", action="store_true", help="print only")
    args = parser.parse_args()
    client_counts = [int(c) for c in args.clients.split(",")]
    command = common.command_line("bench/id_allocator.py", sys.argv[1:])

    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="atomlog-bench-ida-") as directory:
        data_dir = Path(directory)
        try:
            report = launcher.up(data_dir, {"id_allocator": 2}, {}, timeout_s=60)
            cluster = report.cluster
            addresses = [p.grpc_address for p in cluster.processes if p.role == "id_allocator"]
            raw = raw_zookeeper(cluster.zookeeper, args.seconds)
            rows = []
            for allocators in (1, 2):
                for clients in client_counts:
                    before = conflicts(addresses)
                    result = asyncio.run(drive(addresses[:allocators], clients, args.seconds,
                                               args.count))
                    rows.append({"allocators": allocators, "clients": clients, **result,
                                 "conflicts": conflicts(addresses) - before})
                    print(f"allocators={allocators} clients={clients}: "
                          f"{result['blocks_per_s']:.0f} blocks/s, p50 {result['p50_ms']:.2f} ms, "
                          f"p99 {result['p99_ms']:.2f} ms", flush=True)
        finally:
            if (data_dir / launcher.CLUSTER_FILE).exists():
                launcher.down(data_dir, timeout_s=10)
    text = section(raw, rows, args.seconds, args.count, command, load)
    print()
    print(text)
    if not args.no_docs:
        write_docs(text)
        print(f"wrote its section of {DOCS.relative_to(REPO)}")


if __name__ == "__main__":
    main()
