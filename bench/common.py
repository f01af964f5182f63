"""What every benchmark prints about the machine it ran on."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc


def machine(load: float, *, with_java: bool = False) -> str:
    """CPUs and model, Python and grpcio versions (and Java's), atomlog's record batch
    core (partition_server/native.py: native, or python and why; the servers a benchmark
    starts inherit its ATOMLOG_NATIVE), and the load average."""
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    java = ""
    if with_java:
        lines = subprocess.run(["java", "-version"], capture_output=True,
                               text=True).stderr.splitlines()
        java = f", {lines[0] if lines else 'java ?'}"
    from partition_server import native
    return (f"{os.cpu_count()} CPUs ({cpu}), Python {platform.python_version()}, "
            f"grpcio {grpc.__version__}{java}, atomlog core {native.status()}; "
            f"load average {load:.1f} when it started")


def raw_append_seconds(directory: Path, batch: bytes, batches: int,
                       per_fsync: float) -> float:
    """The baseline every storage figure is compared with: plain Python writing the same
    batch bytes to a new file (as a fresh log segment is), os.write per batch and
    os.fsync per `per_fsync` batches. Returns the elapsed seconds.

    `per_fsync` may be fractional (a server's measured mean, say 1.6): then the fsyncs are
    spread evenly, one after batch i whenever floor((i + 1) / per_fsync) grows, so the
    file gets exactly batches / per_fsync fsyncs, as the server did for those bytes."""
    assert per_fsync >= 1, per_fsync
    path = directory / f"raw-{per_fsync:g}.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_TRUNC, 0o644)
    started = time.perf_counter()
    try:
        synced = 0
        for i in range(batches):
            os.write(fd, batch)
            due = int((i + 1) / per_fsync)
            if due > synced:
                synced = due
                os.fsync(fd)
        os.fsync(fd)
        return time.perf_counter() - started
    finally:
        os.close(fd)
        path.unlink()


DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
# py-spy of this virtualenv (the bench extra), for the benchmarks' --profile options.
PY_SPY = str(Path(sys.executable).parent / "py-spy")


def py_spy_format(output) -> str:
    """py-spy's output format for a profile file: collapsed stacks ("raw", one line per
    stack and its sample count, for scripts) when the name ends in .txt, else speedscope."""
    return "raw" if str(output).endswith(".txt") else "speedscope"


def py_spy(pid: int, output, duration_s: float | None = None) -> subprocess.Popen:
    """py-spy recording process `pid` at 200 Hz into `output` (in py_spy_format's format)
    for `duration_s`, or until it gets SIGINT; --nonblocking: the process is not paused
    at each sample."""
    return subprocess.Popen(
        [PY_SPY, "record", "--pid", str(pid), "--rate", "200", "--nonblocking",
         *(["--duration", str(int(duration_s))] if duration_s is not None else []),
         "--format", py_spy_format(output), "--output", str(output)],
        stdout=subprocess.DEVNULL)


def cluster_settings(parser, items: list[str]) -> dict[str, str]:
    """A benchmark's `--set NAME=VALUE` items as settings, checked before any cluster
    starts (`launcher.up` would refuse a bad one there, with a traceback): a usage error
    through `parser` for an item without `=` or a setting no role knows or accepts."""
    from services.config import ConfigError, check_cluster_settings

    if any("=" not in item for item in items):
        parser.error("--set takes NAME=VALUE")
    settings = dict(item.split("=", 1) for item in items)
    try:
        check_cluster_settings(settings)
    except ConfigError as error:
        parser.error(str(error))
    return settings


def percentile(values, fraction: float) -> float:
    """Linear interpolation between closest ranks (as peers-bench)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * fraction
    low = int(k)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (k - low)


def counter_totals(addresses: list[str], names: tuple[str, ...]) -> tuple[float, ...]:
    """The sum of each counter (every label set) over the servers' /metrics (host:port
    each), one read of each server."""
    import urllib.request

    totals = [0.0] * len(names)
    for address in addresses:
        text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
        for line in text.splitlines():
            for index, name in enumerate(names):
                if line.startswith(name) and line[len(name)] in " {":
                    totals[index] += float(line.rsplit(" ", 1)[1])
    return tuple(totals)


def median_range(values: list[float], spec: str) -> str:
    """The median, and the range when there are several values (`spec`: a format spec)."""
    text = format(statistics.median(values), spec)
    if len(values) > 1:
        text += f" ({format(min(values), spec)}-{format(max(values), spec)})"
    return text


def rotated(cells: list, round_: int) -> list:
    """The cells in the order round `round_` runs them: each round starts one later, so
    no cell always runs first (or last) on a machine whose speed drifts."""
    start = round_ % len(cells)
    return cells[start:] + cells[:start]


def write_docs_section(text: str, begin: str, end: str,
                       alternatives: tuple[tuple[str, str], ...] = ()) -> None:
    """Replace the section between `begin` and `end` (or an older pair of markers) in
    docs/benchmarks.md with `text`, leaving the rest alone; append it when absent."""
    current = DOCS.read_text() if DOCS.exists() else "# Benchmarks\n"
    for b, e in ((begin, end), *alternatives):
        if b in current and e in current:
            head, rest = current.split(b, 1)
            tail = rest.split(e, 1)[1].lstrip("\n")
            DOCS.write_text(head + text + ("\n" + tail if tail else ""))
            return
    DOCS.write_text(current.rstrip("\n") + "\n\n" + text)


def drop_page_cache() -> bool:
    """Write back and drop the kernel's clean page cache (root only; False, and nothing
    done, otherwise). Before each cell of a benchmark that writes gigabytes: on this
    machine (a VM) the partition servers' kernel time per record more than doubled once
    the page cache grew past about 4.5 GB in one run (sys 2.2 -> 5-6 us per 1 KiB
    record, measured 2026-11-29: pages the VM had not used before cost more to fill),
    so later cells ran slower than earlier ones whatever they measured. Dropped before
    each cell, the cost stayed flat (docs/benchmarks.md)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as control:
            control.write("1")
    except OSError:
        return False
    return True


PROBE_LOOPS = 4_000  # one probe chunk: about 0.25 ms of plain Python on this machine


def _probe_chunk() -> None:
    x = 0
    for i in range(PROBE_LOOPS):
        x += i * i


def _cpu_probe(seconds: float, period_s: float, out) -> None:
    """In its own process: the same chunk of plain Python every `period_s` for `seconds`;
    puts the chunks' times (s)."""
    times = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        began = time.perf_counter()
        _probe_chunk()
        times.append(time.perf_counter() - began)
        time.sleep(period_s)
    out.put(times)


class CpuProbe:
    """The machine's own jitter, measured beside a cell: a process runs the same small
    chunk of plain Python every 20 ms (about 1% of a core) and times it. On a quiet,
    steady machine every chunk takes about the same time; on this shared virtual machine
    the p99 chunk took 4-11× the median with nothing else running. The chunks' p99 shows
    how unsteady the machine was during the cell: its slow stretches lengthen every
    process's work, ours and the peers' alike. Start it, run the cell, then `result()`:
    the chunks' p50, p99 and max in ms, and p99 ÷ p50."""

    def __init__(self, seconds: float, period_s: float = 0.02):
        context = multiprocessing.get_context("spawn")
        self._out = context.Queue()
        self._process = context.Process(target=_cpu_probe, args=(seconds, period_s, self._out),
                                         daemon=True)
        self._process.start()
        self._seconds = seconds

    def result(self) -> dict:
        times = self._out.get(timeout=self._seconds + 60)
        self._process.join(10)
        p50, p99 = percentile(times, 0.5) * 1e3, percentile(times, 0.99) * 1e3
        return {"chunks": len(times), "p50_ms": p50, "p99_ms": p99,
                "max_ms": max(times, default=float("nan")) * 1e3,
                "p99_over_p50": p99 / p50 if p50 else float("nan")}


def fsync_baseline(directory: Path, samples: int = 300) -> dict:
    fd = os.open(directory / "fsync.bin", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    latencies = []
    try:
        for _ in range(samples):
            started = time.perf_counter()
            os.write(fd, b"x" * 200)
            os.fsync(fd)
            latencies.append(time.perf_counter() - started)
    finally:
        os.close(fd)
    return {"p50": percentile(latencies, 0.5) * 1e3,
            "p99": percentile(latencies, 0.99) * 1e3}


# The replication factor of the transaction benchmarks' clusters: one copy, like the
# peers they are compared with (one PostgreSQL, one Kafka broker). The product default
# (`topics.default_replication_factor` 0: three copies with three partition servers) is
# measured against it by bench/replication.py.
BENCH_REPLICATION_FACTOR = 1


# The two server shapes the transaction benchmarks compare: the multi-process cluster
# (`atomlog up`'s default) and the combined server (every role in one process).
SHAPES = {"cluster": {"id_allocator": 1, "coordinator": 2, "partition_server": 3},
          "combined": {"combined": 1}}


@contextlib.contextmanager
def local_cluster(prefix: str, roles: dict[str, int] | None = None, *, timeout_s: float = 90,
                  down_timeout_s: float = 10, replication_factor: int | None = None,
                  settings: dict[str, str] | None = None):
    """A local cluster in a temporary directory for one benchmark run, stopped afterwards:
    yields (data directory, launcher report, a server's gRPC address to bootstrap from).
    By default 1 id allocator, 2 coordinators and 3 partition servers; every topic
    (__txn_log included) at `replication_factor` copies (None: the product default);
    `settings`: more config settings (name -> value) for every server (they win)."""
    from services import launcher

    roles = roles or SHAPES["cluster"]
    settings = ({} if replication_factor is None
                else {"topics.default_replication_factor": str(replication_factor)}
                ) | dict(settings or {})
    with tempfile.TemporaryDirectory(prefix=prefix) as directory, \
            _sigterm_as_exit() as tearing_down:
        data_dir = Path(directory)
        try:
            report = launcher.up(data_dir, roles, settings, timeout_s=timeout_s)
            address = next(p.grpc_address for p in report.cluster.processes
                           if p.role != "zookeeper")
            yield data_dir, report, address
        finally:
            tearing_down()
            if (data_dir / launcher.CLUSTER_FILE).exists():
                launcher.down(data_dir, timeout_s=down_timeout_s)


@contextlib.contextmanager
def _sigterm_as_exit():
    """While a benchmark's cluster runs, SIGTERM (`timeout`, `kill`) ends the benchmark
    as Ctrl-C does, through the `finally` that stops the cluster and removes its
    directory: Python's default SIGTERM ends the process at once, and a benchmark so
    ended left its cluster running (found 2026-11-29). Yields the call that makes
    SIGTERM ignored for the teardown itself (bounded by its timeout), so a signal then
    cannot cut it short either. Only in the main thread, where signal handlers live."""
    import signal

    if threading.current_thread() is not threading.main_thread():
        yield lambda: None
        return

    def stop(signum, _frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield lambda: signal.signal(signal.SIGTERM, signal.SIG_IGN)
    finally:
        signal.signal(signal.SIGTERM, previous)


def command_line(script: str, argv: list[str]) -> str:
    """How a benchmark was run, as docs show it (print-only flags left out)."""
    return f"python {script}" + "".join(f" {a}" for a in argv if a != "--no-docs")


# ------------------------------------------------------------------ gRPC call floor
def _echo_server(port_out, service: str, method: str, echo: bool) -> None:
    """A grpc.aio server whose one method does nothing but answer: the request's bytes
    back, or (`echo` False) an empty message (child process)."""
    import asyncio

    async def answer(request, context):
        return request if echo else b""

    async def serve() -> None:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            service, {method: grpc.unary_unary_rpc_method_handler(answer)})])
        port_out.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve())


@contextlib.contextmanager
def do_nothing_server(service: str = "floor.Echo", method: str = "Call", echo: bool = True):
    """`_echo_server` in its own process, as every atomlog server is: yields (address,
    pid). The call floor's (`grpc_call_floor`), and any method's that a benchmark needs
    a do-nothing baseline of (its real clients, with `echo` False, get an empty answer)."""
    context = multiprocessing.get_context("spawn")
    port_out = context.Queue()
    server = context.Process(target=_echo_server, args=(port_out, service, method, echo),
                             daemon=True)
    server.start()
    try:
        yield f"127.0.0.1:{port_out.get(timeout=30)}", server.pid
    finally:
        server.terminate()
        server.join(10)


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (every thread), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """utime + stime of a process's threads by kind, from /proc/PID/task: "event loop"
    (the main thread, where every atomlog server runs its asyncio loop), "io_uring
    workers" (the kernel's iou-wrk threads running its fsyncs), gRPC's own threads
    (named by gRPC), and "other Python threads" (the durability syncer, pools, ZooKeeper's,
    ...). Threads that ended meanwhile are not counted."""
    kinds: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue  # ended meanwhile
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat.rsplit(")", 1)[1].split()
        if task.name == str(pid):
            kind = "event loop"
        elif name.startswith("iou-wrk"):
            kind = "io_uring workers"
        elif name.startswith("python"):
            kind = "other Python threads"
        else:
            kind = "gRPC and native threads"
        kinds[kind] = kinds.get(kind, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return kinds


def grpc_call_floor(clients: int = 8, seconds: float = 3.0, payload: int = 200) -> dict:
    """The price of one gRPC call on this machine, measured now: a do-nothing grpc.aio
    server in its own process (as every atomlog server is) and `clients` threads of one
    client process making blocking unary calls of `payload` bytes. Returns calls/s and
    the server process's and the client process's CPU per call (ms). No atomlog code
    runs: this is the ceiling any design pays per call, the baseline for figures that
    follow the number of calls."""
    with do_nothing_server() as (address, pid):
        channel = grpc.insecure_channel(address)
        call = channel.unary_unary("/floor.Echo/Call")
        body = b"x" * payload
        for _ in range(100):  # warm up
            call(body, timeout=10)
        counts = [0] * clients
        stop = time.monotonic() + seconds

        def run(index: int) -> None:
            while time.monotonic() < stop:
                call(body, timeout=10)
                counts[index] += 1

        threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
        cpu_before, began = cpu_seconds(pid), time.monotonic()
        client_before = time.process_time()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        elapsed, cpu = time.monotonic() - began, cpu_seconds(pid) - cpu_before
        client_cpu = time.process_time() - client_before
        channel.close()
    calls = sum(counts)
    return {"clients": clients, "calls_per_s": calls / elapsed,
            "server_cpu_ms_per_call": cpu / max(calls, 1) * 1e3,
            "client_cpu_ms_per_call": client_cpu / max(calls, 1) * 1e3}


def cores() -> int:
    """CPUs this process may run on (what the servers and clients share)."""
    return len(os.sched_getaffinity(0))


def cpu_bounds(small: dict) -> dict:
    """What a small-transaction cell's CPU per transaction allows: `machine`, every core
    busy with servers and clients (cores ÷ their CPU per transaction); `event_loop`, the
    busiest server's event loop busy all the time (1 s ÷ the event loops' CPU per
    transaction, when one server runs them all: the combined server)."""
    total_ms = small["server_cpu_ms_per_txn"] + small["client_cpu_ms_per_txn"]
    loop_ms = small["server_thread_cpu_ms_per_txn"].get("event loop", 0.0)
    return {"cores": cores(), "machine": cores() * 1e3 / total_ms if total_ms else 0.0,
            "event_loop": 1e3 / loop_ms if loop_ms else 0.0}
