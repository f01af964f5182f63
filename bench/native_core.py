"""Benchmark: would a native core reach issue 19's small-transaction targets? The same
Python clients send the same one-call transactions (CoordinatorService/CommitTxn, ten
1 KiB records over four partitions, as bench/transactions.py's small transactions) to
several servers, one after another, in one run, over gRPC and (the rows "on the link")
as call frames on a link connection, the way the SDK's commits reach a coordinator
(services/link_wire.py):

- **floor**: a grpc.aio server whose CommitTxn answers an empty response and does
  nothing else: what the call itself costs with this message and these clients;
- **native**: bench/native_core/ (Go), a measuring prototype with the durable work of a
  one-call transaction on a combined server (checks, staging fsync, decision fsync,
  markers) and none of the rest (its doc says what it leaves out); and the same with
  `--wal`: a group's data and decisions in one write-ahead file with one fsync, copied
  to the partition files every 100 ms;
- **lean**: bench/lean_core.py, the native prototype's hot path in lean Python, one
  asyncio task and one io_uring submission a phase: the same work in another language,
  and the combined server's language without its structure; the same with `--wal`; and
  with `--cores`, atomlog's own cores and logs (the TC partition's core, the partition
  log, the transaction buffer) in the same one-task loop: what a lean structure of the
  real server could cost;
- **atomlog**: the combined server (`atomlog up --combined`), every role in one Python
  process;
- on the link: a do-nothing link server (`lean_core.py --nothing`: an empty answer, the
  request unread), the native prototype (bench/native_core/link.go), the lean servers
  and the combined server (its coordinator's link).

Beside them, `common.grpc_call_floor`, the do-nothing call rate the targets are ratios
of (small transactions >= 50% of it on the combined server, commit p99 < 25 ms). Each
row: transactions/s, their share of that call rate, commit p50 / p99, and CPU per
transaction on the server and on the clients.

    .venv/bin/python bench/native_core.py [--clients 8] [--seconds 10] [--rounds 3]
        [--transports grpc,link] [--no-docs]

Builds the prototype with the Go that scripts/go_tools.sh finds (or installs) into
~/.cache/atomlog/native-core; skips its rows, saying so, when it cannot. A row whose
clients could not go on (a refusal while warming up past the ones a server just started
gives, a connection refused) says "failed" and why; one whose clients never reported
says "stalled", with the server's stacks on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import queue
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.append(str(Path(__file__).resolve().parent))  # after the project: bench/coordinator.py

import common  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
METHOD = "/atomlog.v1.CoordinatorService/CommitTxn"
TOPIC, PARTITIONS = "bench-small-txn", 16
TC_PARTITIONS = 16  # the prototypes'; atomlog's server says its own (GetMetadata)
RECORDS, RECORD = 10, b"x" * 1024
BEGIN = "<!-- BEGIN bench/native_core.py -->"
END = "<!-- END bench/native_core.py -->"


# Refusals a client waits out while it warms up (retry_after_ms apart, as the SDK does):
# a server just started may still be loading its TC partitions or taking their leases.
WARMING_UP = frozenset({"COORDINATOR_LOADING", "NOT_COORDINATOR", "UNAVAILABLE"})


class Refusal(Exception):
    """A link's error answer (an ItemError), as an RpcError is gRPC's."""


def client(address: str, transport: str, index: int, seconds: float, start_at: float,
           out, tc_partitions: int = TC_PARTITIONS) -> None:
    """One client process: CommitTxn calls back to back, each a new transaction (a new
    idempotency key, on its TC partition of `tc_partitions`) of RECORDS records over four
    partitions, encoded per call as the SDK does, over gRPC or (`transport` "link") as
    call frames on one link connection, as the SDK's commits go to a coordinator's link.
    Puts (count, latencies, CPU seconds, refusals) on `out`; or, if it cannot go on (a
    warm-up call refused, a call past its timeout), a Failed."""
    try:
        result = _client(address, transport, index, seconds, start_at, tc_partitions)
    except BaseException as error:  # reported, not left for drive() to wait out
        out.put(Failed(f"client {index}: {type(error).__name__}: {error}"[:400]))
        raise
    out.put(result)


class Failed(str):
    """What a client that could not go on puts on the queue instead of its figures."""


def _client(address: str, transport: str, index: int, seconds: float, start_at: float,
            tc_partitions: int) -> tuple:
    import grpc

    from atomlog.v1 import common_pb2, coordinator_pb2, partition_pb2
    from coordinator.records import tc_partition_for
    from partition_server.record_batch import Record, encode_batch
    from services import link_wire

    partitions = [(index * 4 + i) % PARTITIONS for i in range(4)]
    if transport == "link":
        host, port = address.rsplit(":", 1)
        sock = link_wire.connect_blocking((host, int(port)), 30)
        sock.settimeout(30)  # each call's, as the gRPC clients' timeout=30
        number = link_wire.CALL_NUMBERS[("CoordinatorService", "CommitTxn")]

        def call(request, timeout):
            sock.sendall(link_wire.call_frame(number, timeout, b"", request))
            kind, payload = link_wire.read_answer(sock, link_wire.MAX_CALL_BYTES)
            if kind == link_wire.KIND_ERROR:
                raise Refusal(bytes(payload))
            return coordinator_pb2.CommitTxnResponse.FromString(bytes(payload))

        close = sock.close
    else:
        channel = grpc.insecure_channel(address)
        call = channel.unary_unary(
            METHOD, request_serializer=coordinator_pb2.CommitTxnRequest.SerializeToString,
            response_deserializer=coordinator_pb2.CommitTxnResponse.FromString)
        close = channel.close

    def one() -> None:
        key = uuid.uuid4().hex
        counts = [RECORDS // 4 + (i < RECORDS % 4) for i in range(4)]
        call(coordinator_pb2.CommitTxnRequest(
            tc_partition=tc_partition_for(key, tc_partitions), idempotency_key=key,
            timeout_ms=30_000,
            batches=[partition_pb2.ProduceItem(
                topic_partition=common_pb2.TopicPartition(topic=TOPIC, partition=p),
                record_batch=encode_batch([Record(None, RECORD)] * n))
                for p, n in zip(partitions, counts)]), timeout=30)

    warmed, warm_until = 0, time.monotonic() + 60
    while warmed < 20:  # warm up: the connection, the partitions' files
        try:
            one()
            warmed += 1
        except Refusal as refusal:  # a server just up: its TC partitions may still load
            error = partition_pb2.ItemError.FromString(refusal.args[0])
            if error.reason not in WARMING_UP or time.monotonic() > warm_until:
                raise
            time.sleep(int(error.metadata.get("retry_after_ms") or 100) / 1000)
        except grpc.RpcError as refusal:
            if refusal.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > warm_until:
                raise
            time.sleep(0.1)
    while time.time() < start_at:
        time.sleep(0.001)
    latencies, refusals = [], 0
    deadline = start_at + seconds
    cpu_before = time.process_time()
    while time.time() < deadline:
        began = time.perf_counter()
        try:
            one()
        except (grpc.RpcError, Refusal):
            refusals += 1
            continue
        latencies.append(time.perf_counter() - began)
    cpu = time.process_time() - cpu_before
    close()
    return len(latencies), latencies, cpu, refusals


def drive(address: str, server_pid: int, clients: int, seconds: float,
          transport: str = "grpc", tc_partitions: int = TC_PARTITIONS) -> dict | Failed | None:
    """`clients` client processes against `address` (a gRPC or, `transport` "link", a
    link address) for `seconds`; the server's CPU from /proc over the same window. A
    Failed when a client could not go on (the first one's reason), None when one never
    reports: the server's stacks then go to stderr (py-spy dump), to tell a stalled
    server from the rest."""
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    start_at = time.time() + 4 + clients * 0.3
    processes = [context.Process(target=client,
                                 args=(address, transport, i, seconds, start_at, out,
                                       tc_partitions))
                 for i in range(clients)]
    for process in processes:
        process.start()
    while time.time() < start_at:
        time.sleep(0.005)
    cpu_before = common.cpu_seconds(server_pid)
    threads_before = common.thread_cpu_seconds(server_pid)
    time.sleep(seconds)
    server_cpu = common.cpu_seconds(server_pid) - cpu_before
    threads_after = common.thread_cpu_seconds(server_pid)
    # The kernel's io_uring workers (their fsyncs' CPU), of those alive at both ends
    # (an idle worker exits; under this load they stay).
    uring_cpu = max(0.0, threads_after.get("io_uring workers", 0.0)
                    - threads_before.get("io_uring workers", 0.0))
    try:
        results = [out.get(timeout=120) for _ in processes]
    except queue.Empty:
        print(f"a client of the server {server_pid} never reported; its stacks:",
              file=sys.stderr, flush=True)
        subprocess.run([common.PY_SPY, "dump", "--pid", str(server_pid)], timeout=60,
                       stdout=sys.stderr, check=False)
        for process in processes:
            process.kill()
        return None
    for process in processes:
        process.join(30)
    failed = [r for r in results if isinstance(r, Failed)]
    if failed:
        print(f"clients of the server {server_pid} failed: {failed}", file=sys.stderr,
              flush=True)
        return failed[0]
    count = sum(r[0] for r in results)
    latencies = sorted(x for r in results for x in r[1])
    return {"txn_per_s": count / seconds, "count": count,
            "refusals": sum(r[3] for r in results),
            "p50_ms": common.percentile(latencies, 0.50) * 1e3 if latencies else float("nan"),
            "p99_ms": common.percentile(latencies, 0.99) * 1e3 if latencies else float("nan"),
            "server_cpu_ms": server_cpu / max(count, 1) * 1e3,
            "uring_cpu_ms": uring_cpu / max(count, 1) * 1e3,
            "client_cpu_ms": sum(r[2] for r in results) / max(count, 1) * 1e3}


def build_native() -> tuple[Path | None, str]:
    """The prototype's binary (built once per source), or None and why not."""
    source = ROOT / "bench" / "native_core"
    try:
        found = subprocess.run(["bash", str(ROOT / "scripts" / "go_tools.sh")], check=True,
                               capture_output=True, text=True, timeout=900).stdout
        go = next(line[3:] for line in found.splitlines() if line.startswith("GO="))
    except (subprocess.SubprocessError, StopIteration, OSError) as error:
        return None, f"no Go: {error}"
    cache = Path(os.environ.get("ATOMLOG_CACHE", Path.home() / ".cache" / "atomlog"))
    binary = cache / "native-core" / "native-core"
    binary.parent.mkdir(parents=True, exist_ok=True)
    result = subprocess.run([go, "build", "-o", str(binary), "."], cwd=source,
                            capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        return None, f"go build failed: {result.stderr.strip()[-500:]}"
    return binary, ""


@contextlib.contextmanager
def native_server(binary: Path, directory: Path, wal: bool = False):
    """The prototype on free ports (with `wal`, one write-ahead file): yields (gRPC
    address, link address, pid, its TC partitions)."""
    server = subprocess.Popen([str(binary), "--dir", str(directory)] + (["--wal"] if wal else []),
                              stdout=subprocess.PIPE, text=True)
    try:
        grpc_address, link_address = server.stdout.readline().split()
        yield grpc_address, link_address, server.pid, TC_PARTITIONS
    finally:
        server.terminate()
        server.wait(10)


@contextlib.contextmanager
def lean_server(directory: Path, *flags: str):
    """bench/lean_core.py (the prototype's hot path in lean Python) in its own process,
    with `flags` (--wal, --cores, --nothing): yields (gRPC address, link address, pid,
    its TC partitions)."""
    server = subprocess.Popen([sys.executable, str(ROOT / "bench" / "lean_core.py"), "--dir",
                               str(directory), *flags],
                              stdout=subprocess.PIPE, text=True)
    try:
        grpc_address, link_address = server.stdout.readline().split()
        yield grpc_address, link_address, server.pid, TC_PARTITIONS
    finally:
        server.terminate()
        server.wait(10)


@contextlib.contextmanager
def atomlog_server():
    """The combined server with the benchmark's topic: yields (gRPC address, the link
    address its coordinator advertises, pid, its cluster's TC partitions)."""
    import grpc

    from atomlog.v1 import common_pb2, metadata_pb2, metadata_pb2_grpc
    from spark_client import Client

    with common.local_cluster("atomlog-bench-native-", common.SHAPES["combined"]) as (
            _data_dir, report, address):
        with Client(address) as admin:
            admin.create_topic(TOPIC, partitions=PARTITIONS)
        with grpc.insecure_channel(address) as channel:
            metadata = metadata_pb2_grpc.MetadataServiceStub(channel).GetMetadata(
                metadata_pb2.GetMetadataRequest(), timeout=30)
        link = next(s.link_address for s in metadata.servers
                    if s.role == common_pb2.SERVER_ROLE_COORDINATOR)
        yield address, link, next(p.pid for p in report.cluster.processes
                                  if p.role == "combined"), metadata.tc_partition_count


# (row, server, transport, label): each row is one server driven over one transport.
ROWS = (
    ("floor", "floor", "grpc", "a do-nothing CommitTxn (grpc.aio, Python)"),
    ("native", "native", "grpc", "the native prototype (Go): checks, staging and decision "
                                 "fsyncs, markers"),
    ("native-wal", "native-wal", "grpc", "the same with one write-ahead file (`--wal`): one "
                                         "fsync a group, the partition files every 100 ms"),
    ("lean", "lean", "grpc", "the same hot path in lean Python (bench/lean_core.py): one "
                             "task, one io_uring submission a phase"),
    ("lean-wal", "lean-wal", "grpc", "the same in lean Python with one write-ahead file "
                                     "(`--wal`)"),
    ("lean-cores", "lean-cores", "grpc", "lean Python with atomlog's cores and logs "
                                         "(`--cores`): TcPartitionCore, PartitionLog, "
                                         "TxnBuffer, without the server's tasks and queues"),
    ("lean-cores-wal", "lean-cores-wal", "grpc", "lean Python with atomlog's cores and logs "
                                                 "and one write-ahead file (`--cores "
                                                 "--wal`)"),
    ("atomlog", "atomlog", "grpc", "the combined server (Python), the same calls"),
    ("link-floor", "link-floor", "link", "**on the link**: a do-nothing CommitTxn (asyncio, "
                                         "Python; `lean_core.py --nothing`)"),
    ("native-link", "native", "link", "the native prototype (Go), on the link"),
    ("native-wal-link", "native-wal", "link", "the native prototype (Go) with one write-ahead "
                                              "file, on the link"),
    ("lean-link", "lean", "link", "lean Python, on the link"),
    ("lean-wal-link", "lean-wal", "link", "lean Python with one write-ahead file, on the "
                                          "link"),
    ("lean-cores-link", "lean-cores", "link", "lean Python with atomlog's cores and logs, "
                                              "on the link"),
    ("lean-cores-wal-link", "lean-cores-wal", "link", "lean Python with atomlog's cores "
                                                      "and logs and one write-ahead file, "
                                                      "on the link"),
    ("atomlog-link", "atomlog", "link", "the combined server, on its coordinator's link (as "
                                        "the SDK commits)"),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8, help="client processes")
    parser.add_argument("--seconds", type=float, default=10.0, help="each server's window")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the servers")
    parser.add_argument("--transports", default="grpc,link",
                        help="the rows to run, by transport: grpc, link or both")
    parser.add_argument("--no-docs", action="store_true", help="do not write docs/benchmarks.md")
    parser.add_argument("--rows", default="",
                        help="only these rows (comma-separated names: " +
                             ", ".join(row[0] for row in ROWS) + "); with --no-docs")
    args = parser.parse_args()
    transports = set(args.transports.split(","))
    rows_run = [row for row in ROWS if row[2] in transports]
    if args.rows:
        wanted = set(args.rows.split(","))
        unknown = wanted - {row[0] for row in ROWS}
        if unknown:
            parser.error(f"unknown rows: {', '.join(sorted(unknown))}")
        if not args.no_docs:
            parser.error("--rows measures a part of the table: add --no-docs")
        rows_run = [row for row in rows_run if row[0] in wanted]
    needed = {row[1] for row in rows_run}
    binary, why_not = build_native() if needed & {"native", "native-wal"} else (None, "")
    runs: dict[str, list[dict]] = {row[0]: [] for row in rows_run}
    stalled: dict[str, int] = {}  # rows whose clients did not all report, how many times
    failed: dict[str, str] = {}  # rows whose clients could not go on: the first reason
    call_rates: list[float] = []
    with contextlib.ExitStack() as stack:
        scratch = Path(stack.enter_context(
            tempfile.TemporaryDirectory(prefix="atomlog-bench-native-", dir=".")))
        starts = {"floor": lambda: _with_no_link(stack.enter_context(common.do_nothing_server(
                      "atomlog.v1.CoordinatorService", "CommitTxn", echo=False))),
                  "native": lambda: (stack.enter_context(native_server(
                      binary, scratch / "native")) if binary else None),
                  "native-wal": lambda: (stack.enter_context(native_server(
                      binary, scratch / "native-wal", wal=True)) if binary else None),
                  "lean": lambda: stack.enter_context(lean_server(scratch / "lean")),
                  "lean-wal": lambda: stack.enter_context(lean_server(scratch / "lean-wal",
                                                                      "--wal")),
                  "lean-cores": lambda: stack.enter_context(lean_server(scratch / "lean-cores",
                                                                        "--cores")),
                  "lean-cores-wal": lambda: stack.enter_context(lean_server(
                      scratch / "lean-cores-wal", "--cores", "--wal")),
                  "link-floor": lambda: stack.enter_context(lean_server(scratch / "link-floor",
                                                                        "--nothing")),
                  "atomlog": lambda: stack.enter_context(atomlog_server())}
        servers = {name: start() for name, start in starts.items() if name in needed}
        for _ in range(args.rounds):  # in turns: the machine drifts between minutes
            call_rates.append(common.grpc_call_floor()["calls_per_s"])
            for row, name, transport, _ in rows_run:
                server = servers[name]
                if server is not None:
                    print(f"round {len(call_rates)}: {row}", file=sys.stderr, flush=True)
                    result = drive(server[0] if transport == "grpc" else server[1], server[2],
                                   args.clients, args.seconds, transport, server[3])
                    if result is None:
                        stalled[row] = stalled.get(row, 0) + 1
                        continue
                    if isinstance(result, Failed):
                        failed.setdefault(row, str(result))
                        continue
                    result["share"] = result["txn_per_s"] / call_rates[-1]
                    runs[row].append(result)
    lines = ["| server | transactions/s | share of the same round's call rate (target 50%) "
             "| commit p50 / p99 ms (target p99 < 25) | server CPU ms per transaction | "
             "of it, the kernel's io_uring workers (fsyncs) | client CPU ms per transaction |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for row, _, _, label in rows_run:
        results = runs[row]
        stalls = (f" (stalled in {stalled[row]} round{'s' if stalled[row] > 1 else ''}: a "
                  "call past 30 s)" if row in stalled else "")
        if results and row in failed:  # a round's clients could not go on
            stalls += f" (a round failed: {failed[row].replace('|', '/')})"
        if not results:
            why = ('stalled' + stalls if stalls else f'failed: {failed[row]}'
                   if row in failed else 'skipped: ' + why_not)
            lines.append(f"| {label} | {why.replace('|', '/')} | | | | | |")
            continue
        refused = sum(r["refusals"] for r in results)
        lines.append(
            f"| {label} | {common.median_range([r['txn_per_s'] for r in results], ',.0f')}"
            f"{f' ({refused} refused)' if refused else ''}{stalls} | "
            f"{common.median_range([r['share'] * 100 for r in results], '.0f')} % | "
            f"{common.median_range([r['p50_ms'] for r in results], '.1f')} / "
            f"{common.median_range([r['p99_ms'] for r in results], '.1f')} | "
            f"{common.median_range([r['server_cpu_ms'] for r in results], '.3f')} | "
            f"{common.median_range([r['uring_cpu_ms'] for r in results], '.3f')} | "
            f"{common.median_range([r['client_cpu_ms'] for r in results], '.3f')} |")
    text = (f"{args.rounds} rounds, each the call rate (`common.grpc_call_floor`: "
            f"{', '.join(f'{rate:,.0f}' for rate in call_rates)} calls/s) and then each "
            f"server for {args.seconds:g} s with {args.clients} client processes; medians "
            "(ranges):\n\n" + "\n".join(lines))
    print(text)
    if not args.no_docs:
        common.write_docs_section(
            f"{BEGIN}\n`{common.command_line('bench/native_core.py', sys.argv[1:])}` "
            f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}). {text}\n{END}",
            BEGIN, END)


def _with_no_link(server: tuple[str, int]) -> tuple[str, str, int, int]:
    """A (gRPC address, pid) server as (gRPC address, no link address, pid, TC
    partitions)."""
    return server[0], "", server[1], TC_PARTITIONS


if __name__ == "__main__":
    main()
