"""Micro-benchmark (issue 19): what waking another thread or process costs the waker here.

A sequential transaction is a chain of hand-offs: the client's request wakes the server's
event loop, the loop's io_uring submission wakes a kernel worker for each round's
fsyncs, the completion wakes the loop, and the answer wakes the client. Each hand-off
is a system call made by the waker, and on a virtual machine whose other vCPU has gone
idle the call can take far longer than its own work. This measures, from the waker's
side, the time of the call that wakes (median and 90th percentile), after the woken side
has been idle for each of a few gaps:

- a pipe write that wakes a thread blocked in read() (the thread pinned to the other
  CPU when the machine has two or more, so the wake crosses CPUs);
- a TCP loopback send of 60 bytes that wakes a process blocked in recv() (as the
  links' answers do);
- an io_uring submission of one fsync (partition_server/uring.py, as the durability
  barrier's LoopRing submits a round), the file freshly written.

Prints only.

    .venv/bin/python bench/wakeups.py [--samples 300] [--gaps-ms 0.1,1,5] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import select
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from partition_server.uring import Ring  # noqa: E402


def quantiles(samples: list[float]) -> tuple[float, float]:
    """(median, 90th percentile) in microseconds."""
    ordered = sorted(samples)
    return statistics.median(ordered) * 1e6, ordered[int(len(ordered) * 0.9)] * 1e6


def pipe_wakes(samples: int, gap_s: float) -> list[float]:
    read_end, write_end = os.pipe()
    cpus = sorted(os.sched_getaffinity(0))

    def sleeper() -> None:
        if len(cpus) > 1:
            os.sched_setaffinity(0, {cpus[-1]})
        while os.read(read_end, 1) != b"q":
            pass

    mine = os.sched_getaffinity(0)
    if len(cpus) > 1:
        os.sched_setaffinity(0, {cpus[0]})
    thread = threading.Thread(target=sleeper)
    thread.start()
    times = []
    try:
        time.sleep(0.05)
        for _ in range(samples):
            began = time.perf_counter()
            os.write(write_end, b"x")
            times.append(time.perf_counter() - began)
            time.sleep(gap_s)
    finally:
        os.write(write_end, b"q")
        thread.join()
        os.sched_setaffinity(0, mine)
        os.close(read_end)
        os.close(write_end)
    return times


def tcp_wakes(samples: int, gap_s: float) -> list[float]:
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    listener.close()
    for s in (client, server):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    pid = os.fork()
    if pid == 0:  # the woken process: answer each message, end on b"q"
        client.close()
        while True:
            data = server.recv(100)
            if not data or data.endswith(b"q"):
                os._exit(0)
            server.sendall(b"r")
    server.close()
    times = []
    try:
        for _ in range(samples):
            began = time.perf_counter()
            client.send(b"x" * 60)
            times.append(time.perf_counter() - began)
            client.recv(10)
            time.sleep(gap_s)
    finally:
        client.send(b"q")
        os.waitpid(pid, 0)
        client.close()
    return times


def uring_wakes(samples: int, gap_s: float, directory: str) -> list[float] | None:
    ring = Ring.open()
    if ring is None:
        return None
    efd = os.eventfd(0, os.EFD_NONBLOCK)
    fd = os.open(os.path.join(directory, "wakeups"), os.O_RDWR | os.O_CREAT, 0o600)
    times = []
    try:
        ring.register_eventfd(efd)
        for _ in range(samples):
            os.write(fd, b"z" * 4096)
            ring.queue_fsync(fd, 1)
            began = time.perf_counter()
            done = len(ring.submit())
            times.append(time.perf_counter() - began)
            while not done:
                select.select([efd], [], [], 5)
                try:
                    os.eventfd_read(efd)
                except BlockingIOError:
                    pass
                done = len(ring.completions())
            time.sleep(gap_s)
    finally:
        ring.close()
        os.close(fd)
        os.close(efd)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--gaps-ms", default="0.1,1,5",
                        help="comma-separated: how long the woken side is idle before each wake")
    parser.add_argument("--dir", default=None, help="where the io_uring cell's file goes")
    args = parser.parse_args()
    gaps = [float(g) / 1000 for g in args.gaps_ms.split(",")]
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        print(f"{os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.1f}; "
              f"{args.samples} wakes per cell; µs of the waking call, median / p90")
        print("| idle before the wake | pipe write, thread on another CPU "
              "| TCP loopback send to a process | io_uring submit of one fsync |")
        print("| --- | --- | --- | --- |")
        for gap in gaps:
            cells = [pipe_wakes(args.samples, gap), tcp_wakes(args.samples, gap),
                     uring_wakes(args.samples, gap, directory)]
            text = ["n/a (no io_uring here)" if c is None else "%.0f / %.0f" % quantiles(c)
                    for c in cells]
            print(f"| {gap * 1000:g} ms | " + " | ".join(text) + " |", flush=True)


if __name__ == "__main__":
    main()
