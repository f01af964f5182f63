"""Benchmark (issue 21): what moving a follower's answers costs, grpc.aio unary calls against
the replication link (partition_server/copy_link.py), in CPU per MB on both sides.

Two Python processes on loopback. The child serves one answer of --answer-kb of random
bytes to every request, on a grpc.aio server (generic handler, raw bytes: no protobuf, the
same message-size options as atomlog's servers) and on a `copy_link.LinkServer` whose
servicer returns a pre-built ReplicateManyAnswer of that size (so the link's own framing,
parsing and serializing run). This process asks one call at a time, as a follower's
fetcher does: through a grpc.aio channel, and through a `copy_link.LinkClient` (its
blocking socket on its own thread). Nothing is written to disk; this is the transport alone.

For each: MB/s and CPU ms per MB in the client (this process, every thread) and the
server (the child's process time, asked before and after over the same transport). The
transports run in turns, --rounds times; the table shows every round.

    .venv/bin/python bench/copy_link.py [--answer-kb 800] [--seconds 3] [--rounds 3] [--no-docs]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import struct
import sys
import time
from pathlib import Path

import grpc

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.append(str(REPO / "bench"))

import common  # noqa: E402
from atomlog.v1 import common_pb2, partition_pb2  # noqa: E402
from partition_server.copy_link import LinkClient, LinkServer  # noqa: E402
from partition_server.replicate_wire import (ReplicateAnswer, ReplicateItem,  # noqa: E402
                                             ReplicateManyAnswer)
from services.interceptors import ErrorsAndMetricsInterceptor  # noqa: E402

BEGIN, END = "<!-- bench/copy_link.py: begin -->", "<!-- bench/copy_link.py: end -->"
OPTIONS = [("grpc.max_receive_message_length", 64 << 20),
           ("grpc.max_send_message_length", 64 << 20)]


def _answer(size: int) -> ReplicateManyAnswer:
    result = partition_pb2.ReplicateResult(
        topic_partition=common_pb2.TopicPartition(topic="bench", partition=0))
    response = partition_pb2.ReplicateResponse(high_watermark=1, log_start_offset=0)
    return ReplicateManyAnswer([ReplicateItem(result, ReplicateAnswer(response,
                                                                      os.urandom(size)))])


class _Servicer:
    """Stands in for PartitionServicer.ReplicateMany: a pre-built answer (this measures the
    transport, not the leader's reads), or the child's CPU time in a topic name."""

    def __init__(self, answer: ReplicateManyAnswer):
        self.answer = answer

    async def ReplicateMany(self, request, _context) -> ReplicateManyAnswer:
        if request.replica == "cpu":
            return ReplicateManyAnswer([ReplicateItem(partition_pb2.ReplicateResult(
                topic_partition=common_pb2.TopicPartition(
                    topic=repr(time.process_time()), partition=0)))])
        return self.answer


def _server_main(size: int, ports) -> None:
    payload = os.urandom(size)

    async def call(request: bytes, context) -> bytes:
        return payload if request != b"cpu" else struct.pack("d", time.process_time())

    async def serve() -> None:
        server = grpc.aio.server(options=OPTIONS)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "bench.Copy", {"Call": grpc.unary_unary_rpc_method_handler(call)}),))
        grpc_port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        # The servers' own interceptor, as a runtime without auth.mode has it.
        link = LinkServer(ErrorsAndMetricsInterceptor(), "127.0.0.1", 0)
        link.serve("PartitionService", _Servicer(_answer(size)))
        ports.put((grpc_port, await link.start()))
        await asyncio.Event().wait()

    asyncio.run(serve())


async def _grpc_cell(port: int, seconds: float) -> tuple[int, float, float, float]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=OPTIONS) as channel:
        call = channel.unary_unary("/bench.Copy/Call")
        for _ in range(5):
            await call(b"warm")
        server0 = struct.unpack("d", await call(b"cpu"))[0]
        client0, began, moved = time.process_time(), time.perf_counter(), 0
        while time.perf_counter() - began < seconds:
            moved += len(await call(b"records please"))
        elapsed, client = time.perf_counter() - began, time.process_time() - client0
        server = struct.unpack("d", await call(b"cpu"))[0] - server0
    return moved, elapsed, client, server


async def _link_cell(port: int, seconds: float) -> tuple[int, float, float, float]:
    link = LinkClient(f"127.0.0.1:{port}")
    ask = partition_pb2.ReplicateManyRequest(replica="bench")
    cpu = partition_pb2.ReplicateManyRequest(replica="cpu")

    async def server_cpu() -> float:
        answer = await link.replicate_many(cpu, 10)
        return float(answer.results[0].topic_partition.topic)

    try:
        for _ in range(5):
            await link.replicate_many(ask, 10)
        server0 = await server_cpu()
        client0, began, moved = time.process_time(), time.perf_counter(), 0
        while time.perf_counter() - began < seconds:
            answer = await link.replicate_many(ask, 10)
            moved += len(answer.results[0].response.records)
        elapsed, client = time.perf_counter() - began, time.process_time() - client0
        server = await server_cpu() - server0
    finally:
        link.close()
    return moved, elapsed, client, server


def run(size: int, seconds: float, rounds: int) -> list[dict]:
    ports = multiprocessing.Queue()
    child = multiprocessing.Process(target=_server_main, args=(size, ports), daemon=True)
    child.start()
    try:
        grpc_port, link_port = ports.get(timeout=60)
        rows = []
        for index in range(rounds):
            cells = [("grpc.aio unary", _grpc_cell, grpc_port),
                     ("replication link", _link_cell, link_port)]
            for name, cell, port in (cells if index % 2 == 0 else cells[::-1]):
                moved, elapsed, client, server = asyncio.run(cell(port, seconds))
                mb = moved / 1e6
                row = {"round": index + 1, "transport": name, "mb_s": mb / elapsed,
                       "client_ms_per_mb": client / mb * 1e3,
                       "server_ms_per_mb": server / mb * 1e3}
                rows.append(row)
                print(row, flush=True)
        return rows
    finally:
        child.terminate()


def section(rows: list[dict], size: int, seconds: float, load: float) -> str:
    lines = [BEGIN,
             f"### Moving a follower's answers: gRPC against the replication link (issue 21), "
             f"{time.strftime('%Y-%m-%d')}",
             "",
             f"`.venv/bin/python bench/copy_link.py --answer-kb {size // 1000} --seconds "
             f"{seconds:g} --rounds {max(r['round'] for r in rows)}`: one answer of "
             f"{size // 1000} KB (about what a follower's round carries in the produce cell "
             "of bench/replication.py) per request, one request at a time, between two Python "
             "processes on loopback, nothing written; in turns. Machine: "
             f"{common.machine(load)}.",
             "",
             "| round | transport | MB/s | client CPU ms per MB | server CPU ms per MB | "
             "both |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['round']} | {r['transport']} | {r['mb_s']:,.0f} | "
                     f"{r['client_ms_per_mb']:.3f} | {r['server_ms_per_mb']:.3f} | "
                     f"{r['client_ms_per_mb'] + r['server_ms_per_mb']:.3f} |")
    lines.append(END)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--answer-kb", type=int, default=800)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    size = args.answer_kb * 1000
    rows = run(size, args.seconds, args.rounds)
    text = section(rows, size, args.seconds, load)
    print(text)
    if not args.no_docs:
        common.write_docs_section(text, BEGIN, END)


if __name__ == "__main__":
    main()
