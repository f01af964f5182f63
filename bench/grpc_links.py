"""Benchmark: unary calls vs long-lived bidirectional streams for server-to-server links.

atomlog's server-to-server links (coordinator -> partition server EndTxnOnPartition
markers, staging of transaction data, TC-log appends; partition server -> coordinator
verifications) are unary calls batched per destination: one call in flight per
destination, and what queues meanwhile leaves in the next call. This measures whether a
long-lived bidi stream per destination would carry the same items for less CPU.

Two Python processes on loopback: a grpc.aio server in a child process (as every atomlog
server is; same message-size and so_reuseport options, no interceptor) and a grpc.aio
client in this process (as the coordinator and partition server call each other). No
.proto: generic method handlers with raw-bytes messages (no serializer at all); a
message is N items of S bytes concatenated, the answer is an 8-byte sequence number.
The server does nothing with the items: this measures per-call / per-message transport
overhead only (decoding N items costs the same either way). Items are always queued
(the link is under load), so every message carries exactly N items.

Cells (each on one destination, one channel):
  floor   do-nothing unary call, empty request, one in flight
  unary   unary call of N items, W calls in flight (W=1 is today's design; W>1 loses
          ordering, shown for comparison only)
  stream  one bidi stream opened before the cell, each request N items, up to W
          requests unanswered; the server answers each request in order

For each: items/s, messages/s, CPU µs per item on the client (this process,
time.process_time: every thread, grpc's included) and the server (the child's
time.process_time, asked over the same channel at the window's edges), and the
median time from send to answer per message. Each cell runs `--repeats` times
(interleaved) and the repeat with the median total CPU per item is reported.

Prints a table and writes its section of docs/grpc-links.md (between markers; the
rest of that file is kept).

    .venv/bin/python bench/grpc_links.py [--seconds 1.0] [--repeats 3] [--no-docs]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime
import multiprocessing
import os
import platform
import re
import statistics
import struct
import sys
import time
from pathlib import Path

import grpc

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "grpc-links.md"
BEGIN, END = "<!-- bench/grpc_links.py: begin -->", "<!-- bench/grpc_links.py: end -->"
SERVICE = "bench.Links"
SIZES = (200, 1024)
BATCHES = (1, 8, 64)
STREAM_WINDOWS = (1, 4, 16)
UNARY_WINDOWS = (4, 16)  # extra, 200-byte items only: pipelined unary calls (unordered)
WARMUP_S = 0.3


# ------------------------------------------------------------------ server (child)
def _server_main(port_out) -> None:
    async def call(request: bytes, context) -> bytes:
        return b"\0" * 8

    async def stream(request_iterator, context):
        sequence = 0
        async for _request in request_iterator:
            sequence += 1
            yield struct.pack("<Q", sequence)

    async def cpu(request: bytes, context) -> bytes:
        return struct.pack("<d", time.process_time())

    async def serve() -> None:
        server = grpc.aio.server(options=[("grpc.max_send_message_length", 16 << 20),
                                          ("grpc.max_receive_message_length", 16 << 20),
                                          ("grpc.so_reuseport", 0)])
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, {
            "Call": grpc.unary_unary_rpc_method_handler(call),
            "Stream": grpc.stream_stream_rpc_method_handler(stream),
            "Cpu": grpc.unary_unary_rpc_method_handler(cpu)})])
        port_out.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve())


# ------------------------------------------------------------------ client cells
class Window:
    """Counters of one cell, snapshotted at the start and end of its measured window."""

    def __init__(self):
        self.messages = 0
        self.latencies: list[float] = []
        self.measuring = False
        self.stop = False

    def acked(self, sent_at: float) -> None:
        self.messages += 1
        if self.measuring:
            self.latencies.append(time.perf_counter() - sent_at)


async def _measure(channel, window: Window, seconds: float) -> dict:
    cpu_call = channel.unary_unary(f"/{SERVICE}/Cpu")

    async def server_cpu() -> float:
        return struct.unpack("<d", await cpu_call(b"", timeout=10))[0]

    await asyncio.sleep(WARMUP_S)
    server0 = await server_cpu()
    window.measuring = True
    messages0, client0, began = window.messages, time.process_time(), time.perf_counter()
    await asyncio.sleep(seconds)
    messages1, client1, ended = window.messages, time.process_time(), time.perf_counter()
    window.measuring = False
    server1 = await server_cpu()
    window.stop = True
    return {"messages": messages1 - messages0, "elapsed": ended - began,
            "client_cpu": client1 - client0, "server_cpu": server1 - server0,
            "p50_ms": statistics.median(window.latencies) * 1e3 if window.latencies else 0.0}


async def unary_cell(channel, payload: bytes, in_flight: int, seconds: float) -> dict:
    call = channel.unary_unary(f"/{SERVICE}/Call")
    window = Window()

    async def link() -> None:
        while not window.stop:
            sent_at = time.perf_counter()
            await call(payload, timeout=10)
            window.acked(sent_at)

    links = [asyncio.ensure_future(link()) for _ in range(in_flight)]
    result = await _measure(channel, window, seconds)
    await asyncio.gather(*links)
    return result


async def stream_cell(channel, payload: bytes, unanswered: int, seconds: float) -> dict:
    call = channel.stream_stream(f"/{SERVICE}/Stream")()
    window = Window()
    credits = asyncio.Semaphore(unanswered)
    sent: collections.deque[float] = collections.deque()

    async def writer() -> None:
        while not window.stop:
            await credits.acquire()
            if window.stop:
                break
            sent.append(time.perf_counter())
            await call.write(payload)
        await call.done_writing()

    async def reader() -> None:
        expected = 0
        while True:
            answer = await call.read()
            if answer is grpc.aio.EOF:
                break
            expected += 1
            assert struct.unpack("<Q", answer)[0] == expected, "answers out of order"
            window.acked(sent.popleft())
            credits.release()

    tasks = [asyncio.ensure_future(writer()), asyncio.ensure_future(reader())]
    # The stream is long-lived: opened and warmed up before the measured window.
    result = await _measure(channel, window, seconds)
    await asyncio.gather(*tasks)
    return result


def cells() -> list[tuple[str, int, int, int]]:
    """(pattern, item bytes, items per message, window) in table order."""
    rows = [("floor", 0, 0, 1)]
    for size in SIZES:
        for batch in BATCHES:
            rows.append(("unary", size, batch, 1))
            rows += [("stream", size, batch, w) for w in STREAM_WINDOWS]
            if size == SIZES[0]:
                rows += [("unary", size, batch, w) for w in UNARY_WINDOWS]
    return rows


async def run_all(address: str, seconds: float, repeats: int) -> dict:
    options = [("grpc.max_send_message_length", 16 << 20),
               ("grpc.max_receive_message_length", 16 << 20)]
    results: dict[tuple, list[dict]] = collections.defaultdict(list)
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        await channel.channel_ready()
        order = cells()
        for repeat in range(repeats):
            # Alternate the order so slow drifts of the machine's load spread over cells.
            for cell in (order if repeat % 2 == 0 else order[::-1]):
                pattern, size, batch, width = cell
                payload = b"x" * (size * batch)
                runner = unary_cell if pattern in ("floor", "unary") else stream_cell
                results[cell].append(await runner(channel, payload, width, seconds))
    return {cell: summarize(cell, runs) for cell, runs in results.items()}


def summarize(cell: tuple, runs: list[dict]) -> dict:
    _pattern, _size, batch, _width = cell
    items_per_message = max(batch, 1)  # the floor: one "item" per call
    rows = []
    for run in runs:
        items = run["messages"] * items_per_message
        rows.append({
            "items_s": items / run["elapsed"], "msgs_s": run["messages"] / run["elapsed"],
            "client_us": run["client_cpu"] / max(items, 1) * 1e6,
            "server_us": run["server_cpu"] / max(items, 1) * 1e6,
            "p50_ms": run["p50_ms"]})
    for row in rows:
        row["total_us"] = row["client_us"] + row["server_us"]
    rows.sort(key=lambda r: r["total_us"])
    chosen = dict(rows[len(rows) // 2])
    chosen["spread"] = (rows[-1]["total_us"] - rows[0]["total_us"]) / max(chosen["total_us"], 1e-9)
    return chosen


# ------------------------------------------------------------------ report
def label(cell: tuple) -> str:
    pattern, _size, _batch, width = cell
    if pattern == "floor":
        return "floor: do-nothing unary"
    if pattern == "unary":
        return "unary, 1 in flight" if width == 1 else f"unary, {width} in flight (unordered)"
    return f"stream, window {width}"


def table(results: dict) -> list[str]:
    lines = ["| pattern | item B | items/msg | items/s | msgs/s | client CPU µs/item | "
             "server CPU µs/item | total µs/item | p50 ms/msg | spread |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for cell in cells():
        r = results[cell]
        _pattern, size, batch, _width = cell
        lines.append(
            f"| {label(cell)} | {size or '-'} | {batch or '-'} | {r['items_s']:,.0f} | "
            f"{r['msgs_s']:,.0f} | {r['client_us']:.1f} | {r['server_us']:.1f} | "
            f"**{r['total_us']:.1f}** | {r['p50_ms']:.2f} | {r['spread'] * 100:.0f}% |")
    return lines


def savings(results: dict) -> list[str]:
    """Per (size, N): total CPU µs/item of today's unary link vs the stream windows."""
    lines = ["| item B | items/msg | unary µs/item | stream w1 | stream w4 | stream w16 | "
             "best saving µs/item | best saving % | best stream items/s vs unary |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for size in SIZES:
        for batch in BATCHES:
            unary = results[("unary", size, batch, 1)]
            streams = [results[("stream", size, batch, w)] for w in STREAM_WINDOWS]
            best = min(streams, key=lambda r: r["total_us"])
            fastest = max(streams, key=lambda r: r["items_s"])
            saved = unary["total_us"] - best["total_us"]
            lines.append(
                f"| {size} | {batch} | {unary['total_us']:.1f} | "
                + " | ".join(f"{s['total_us']:.1f}" for s in streams)
                + f" | {saved:.1f} | {saved / unary['total_us'] * 100:.0f}% | "
                f"x{fastest['items_s'] / unary['items_s']:.1f} |")
    return lines


def machine() -> str:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{os.cpu_count()} CPUs ({model or platform.machine()}), Python "
            f"{platform.python_version()}, grpcio {grpc.__version__}")


def section(results: dict, command: str, started: str, load_before: str, load_after: str,
            seconds: float, repeats: int) -> str:
    floor = results[("floor", 0, 0, 1)]
    lines = [
        BEGIN,
        "## Unary calls vs bidi streams between two processes",
        "",
        f"`{command}` — {started}, {machine()}; load average (1, 5, 15 min) "
        f"{load_before} when it started, {load_after} when it ended.",
        "",
        "A grpc.aio server in a child process and a grpc.aio client (this process) on "
        "loopback, one channel. Messages are raw bytes (no protobuf): N items of S bytes "
        "concatenated; the server answers each message with 8 bytes and does nothing with "
        "the items, so the figures are transport overhead per call / per message only. "
        "Items are always queued (a loaded link), so every message carries N items. "
        "*unary, 1 in flight* is today's link; *stream, window W*: one long-lived bidi "
        "stream opened before the cell, up to W requests unanswered, answers in order. "
        "*unary, W in flight* (200 B items only) is the cheap alternative for pipelining, "
        "but loses ordering. CPU is process CPU time (all threads) of each process over "
        f"the window, per item. Each cell: {WARMUP_S} s warm-up, {seconds} s measured, "
        f"{repeats} repeats interleaved; the repeat with the median total CPU/item is "
        "shown, *spread* is (max - min) / median of that total over the repeats. Both "
        "processes share 2 CPUs with whatever else runs on this machine.",
        "",
        *table(results),
        "",
        "Total CPU per item (client + server), today's unary link vs the stream:",
        "",
        *savings(results),
        "",
        f"Floor: {floor['msgs_s']:,.0f} do-nothing calls/s with one in flight, "
        f"{floor['total_us']:.0f} µs of CPU per call over both processes "
        f"({floor['client_us']:.0f} client, {floor['server_us']:.0f} server).",
        END,
    ]
    return "\n".join(lines) + "\n"


def write_doc(text: str) -> None:
    if DOC.exists():
        current = DOC.read_text()
        pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END) + r"\n?", re.S)
        if pattern.search(current):
            DOC.write_text(pattern.sub(lambda _m: text, current, count=1))
            return
        DOC.write_text(current.rstrip("\n") + "\n\n" + text)
        return
    DOC.write_text("# gRPC links between servers: unary calls or streams?\n\n" + text)


def loadavg() -> str:
    return ", ".join(Path("/proc/loadavg").read_text().split()[:3])


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--seconds", type=float, default=1.0, help="measured seconds per cell")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-docs", action="store_true", help="print only")
    args = parser.parse_args(argv)

    started = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    load_before = loadavg()
    context = multiprocessing.get_context("spawn")
    port_out = context.Queue()
    server = context.Process(target=_server_main, args=(port_out,), daemon=True)
    server.start()
    try:
        port = port_out.get(timeout=60)
        results = asyncio.run(run_all(f"127.0.0.1:{port}", args.seconds, args.repeats))
    finally:
        server.terminate()
        server.join(10)
    load_after = loadavg()
    command = "python bench/grpc_links.py" + "".join(
        f" {a}" for a in argv if a != "--no-docs")
    text = section(results, command, started, load_before, load_after, args.seconds,
                   args.repeats)
    print(text)
    if not args.no_docs:
        write_doc(text)
        print(f"wrote {DOC.relative_to(REPO)}")


if __name__ == "__main__":
    main(sys.argv[1:])
