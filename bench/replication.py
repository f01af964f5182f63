"""Benchmark (issue 21): what replication costs, factor 3 against factor 1 on the same
machine in the same run (docs/replication.md).

For each factor F in (1, 3) it starts a local cluster of three partition servers, one
coordinator and one id allocator whose every topic (the coordinators' __txn_log too) gets
factor F (`topics.default_replication_factor=F`), then measures:

- produce: wire producers (bench/produce.py's: separate processes sending pre-encoded
  idempotent batches of 256 KiB of 1 KiB records, 5 in flight per partition) to a topic of
  3 partitions, one led by each server, for --seconds. Acks are durable: fsync on the
  leader and, with F = 3, on min.insync.replicas = 2 of the 3 replicas (the ISR: all 3).
- small transactions: one SDK client, one-call transactions of one 100-byte record each
  to a rotating partition, back to back, for --seconds: transactions/s and commit p50/p99.

A third cell runs factor 3 with `replication.link=false`: followers copy over gRPC instead of
their leaders' replication links (the default; docs/replication.md), so the run shows what
the link is worth beside its own factor 1.

The same run measures the disk floor: os.write of 256 KiB and os.fsync, in a loop, for 3 s
(MB/s). Client and all servers share this machine's CPUs, so with F = 3 every byte is
written and fsynced three times on the same two cores: the ratio is what one box does,
not what three machines would.

Prints a table and writes its section of docs/benchmarks.md.

    .venv/bin/python bench/replication.py [--seconds 8] [--rounds 3] [--no-docs]
    .venv/bin/python bench/replication.py --partitions 12 --batch-kib 32  # many partitions

It also counts the Replicate/ReplicateMany calls the servers answered (their /metrics),
per acknowledged MB and per transaction.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.append(str(REPO / "bench"))

import common  # noqa: E402
import produce  # noqa: E402

DOCS = REPO / "docs" / "benchmarks.md"
BEGIN, END = "<!-- bench/replication.py: begin -->", "<!-- bench/replication.py: end -->"
PARTITIONS = DEFAULT_PARTITIONS = 3
PRODUCERS = 2
BATCH_KIB = DEFAULT_BATCH_KIB = 256
TARGET_RF3_OF_RF1 = 0.50
GRPC = "3g"  # the cell of factor 3 whose followers copy over gRPC, not the replication link
# The cells of a round: (key, replication factor, extra `atomlog up` flags).
CELLS = [(1, 1, ()), (3, 3, ()), (GRPC, 3, ("--set", "replication.link=false"))]


def start_cluster(data_dir: Path, *flags: str) -> dict:
    """`atomlog up` of three partition servers, one coordinator and one id allocator, with
    `flags` added (settings, --tls); returns its cluster.json."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    command = [sys.executable, "-m", "services", "up", "--data-dir", str(data_dir),
               "--partition-servers", "3", "--coordinators", "1", "--id-allocators", "1",
               "--output", "json", *flags]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=180)
    if done.returncode != 0:
        raise RuntimeError(f"`atomlog up` failed:\n{done.stdout}\n{done.stderr}")
    return json.loads((data_dir / "cluster.json").read_text())


def stop_cluster(data_dir: Path) -> None:
    from services import launcher

    if (data_dir / "cluster.json").exists():
        launcher.down(data_dir, timeout_s=30)


def wait_in_sync(client, topic: str, timeout_s: float = 30.0) -> None:
    from atomlog.v1 import metadata_pb2
    from spark_client import errors

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            reply = client.metadata.call("GetMetadata", metadata_pb2.GetMetadataRequest(
                topics=[topic]))
        except errors.UnknownTopicOrPartition:  # __txn_log: the coordinators make it
            time.sleep(0.1)
            continue
        if all(p.server_name and sorted(p.isr) == sorted(p.replicas)
               for p in reply.topics[0].partitions):
            return
        time.sleep(0.1)
    raise RuntimeError(f"{topic} not in sync after {timeout_s} s")


def measure_produce(bootstrap: list[str], topic: str, seconds: float,
                    producer=produce.wire_producer) -> dict:
    """PRODUCERS processes running `producer` (bench/produce.py's wire_producer, or one
    wrapping it) against `topic` for `seconds`."""
    ctx = mp.get_context("spawn")
    ready, results = ctx.Queue(), ctx.Queue()
    go, start_at = ctx.Event(), ctx.Value("d", 0.0)
    children = [ctx.Process(target=producer,
                            args=(bootstrap, topic, PARTITIONS, seconds, BATCH_KIB, ready, go,
                                  start_at, results)) for _ in range(PRODUCERS)]
    finished = False
    try:
        for child in children:
            child.start()
        for _ in children:
            ready.get(timeout=120)
        start_at.value = time.monotonic() + 0.5
        go.set()
        outcomes = [results.get(timeout=seconds + 120) for _ in children]
        finished = True
    finally:
        produce.stop_children(children, finished)
    errors = [o["error"] for o in outcomes if "error" in o]
    if errors:
        raise RuntimeError(f"producer failed: {errors[0]}")
    records = sum(o["records"] for o in outcomes)
    latencies = sorted(x for o in outcomes for x in _floats(o["latencies"]))
    return {"mb_s": records * produce.RECORD_BYTES / seconds / 1e6,
            "ack_p50_ms": common.percentile(latencies, 0.5) * 1000,
            "ack_p99_ms": common.percentile(latencies, 0.99) * 1000,
            "client_cpu_s": sum(o["cpu_s"] for o in outcomes),
            "errors": {k: v for o in outcomes for k, v in o["errors"].items()}}


def _floats(raw: bytes) -> list[float]:
    import array

    values = array.array("d")
    values.frombytes(raw)
    return list(values)


def measure_transactions(client, topic: str, seconds: float) -> dict:
    latencies = []
    with client.producer(linger_ms=0) as producer:
        for i in range(20):  # warm up: producer ids, routes, TC partitions
            with client.transaction(timeout_s=30) as txn:
                producer.send(topic, b"w" * 100, partition=i % PARTITIONS, txn=txn)
        deadline = time.monotonic() + seconds
        count = 0
        while time.monotonic() < deadline:
            began = time.perf_counter()
            with client.transaction(timeout_s=30) as txn:
                producer.send(topic, b"t" * 100, partition=count % PARTITIONS, txn=txn)
            latencies.append(time.perf_counter() - began)
            count += 1
    latencies.sort()
    return {"txn_s": count / seconds, "p50_ms": common.percentile(latencies, 0.5) * 1000,
            "p99_ms": common.percentile(latencies, 0.99) * 1000}


def measure_cell(client, info: dict, seconds: float, producer=produce.wire_producer) -> dict:
    """Produce to "bench-produce" (measure_produce) and small transactions on "bench-txn"
    (measure_transactions), each with the CPU all partition servers spent on it: per MB
    acknowledged, per transaction, and the cores busy while producing; and per transaction
    the CPU of every server process (coordinators and id allocators too)."""
    servers = [p["pid"] for p in info["processes"] if p["role"] == "partition_server"]
    everyone = [p["pid"] for p in info["processes"]]

    def server_cpu(pids=servers) -> float:
        return sum(common.cpu_seconds(pid) for pid in pids)

    cpu0, calls0 = server_cpu(), replicate_calls(info)
    cell = measure_produce(info["bootstrap"], "bench-produce", seconds, producer)
    cpu = server_cpu() - cpu0
    megabytes = max(cell["mb_s"] * seconds, 1e-9)
    cell["server_cpu_ms_per_mb"] = cpu * 1000 / megabytes
    cell["client_cpu_ms_per_mb"] = cell["client_cpu_s"] * 1000 / megabytes
    cell["server_cores"] = cpu / seconds
    cell["replicate_calls_per_mb"] = (replicate_calls(info) - calls0) / megabytes
    cpu0, calls0, all0 = server_cpu(), replicate_calls(info), server_cpu(everyone)
    cell.update(measure_transactions(client, "bench-txn", seconds))
    count = max(cell["txn_s"] * seconds, 1e-9)
    cell["server_cpu_ms_per_txn"] = (server_cpu() - cpu0) * 1000 / count
    cell["all_servers_cpu_ms_per_txn"] = (server_cpu(everyone) - all0) * 1000 / count
    cell["replicate_calls_per_txn"] = (replicate_calls(info) - calls0) / count
    return cell


def replicate_calls(info: dict) -> float:
    """Replicate and ReplicateMany calls the partition servers answered so far, on gRPC or
    on their replication links (their /metrics)."""
    import urllib.request

    total = 0.0
    for process in info["processes"]:
        if process["role"] != "partition_server" or not process.get("metrics_address"):
            continue
        with urllib.request.urlopen(f"http://{process['metrics_address']}/metrics",
                                    timeout=10) as reply:
            for line in reply.read().decode().splitlines():
                if (line.startswith("atomlog_rpc_handled_total{") and
                        "PartitionService/Replicate" in line) or \
                        line.startswith("atomlog_replication_link_requests_total{"):
                    total += float(line.rsplit(" ", 1)[1])
    return total


def disk_floor(directory: Path, seconds: float = 3.0) -> float:
    block = os.urandom(BATCH_KIB * 1024)
    path = directory / "floor.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    written, deadline = 0, time.monotonic() + seconds
    began = time.monotonic()
    try:
        while time.monotonic() < deadline:
            written += os.write(fd, block)
            os.fsync(fd)
    finally:
        os.close(fd)
        path.unlink()
    return written / (time.monotonic() - began) / 1e6


def run(seconds: float, rounds: int = 1) -> list[dict]:
    """`rounds` rounds of the CELLS, in order in odd rounds and reversed in even ones,
    each on a fresh cluster: one result dict per round (the machine is noisy; cells are
    compared within their round)."""
    from spark_client import Client

    every = []
    with tempfile.TemporaryDirectory(prefix="atomlog-bench-replication-") as tmp:
        for index in range(rounds):
            results: dict = {"machine": common.machine(os.getloadavg()[0])}
            results["disk_mb_s"] = disk_floor(Path(tmp))
            for key, factor, flags in (CELLS if index % 2 == 0 else CELLS[::-1]):
                data_dir = Path(tmp) / f"r{index}-{key}"
                try:
                    info = start_cluster(data_dir, "--set",
                                         f"topics.default_replication_factor={factor}", *flags)
                    with Client(info["bootstrap"]) as client:
                        client.create_topic("bench-produce", partitions=PARTITIONS)
                        client.create_topic("bench-txn", partitions=PARTITIONS)
                        wait_in_sync(client, "bench-produce")
                        wait_in_sync(client, "bench-txn")
                        wait_in_sync(client, "__txn_log")
                        produce.wait_ready(client.metadata.route("bench-produce", 0).address,
                                           "bench-produce", 1)
                        cell = measure_cell(client, info, seconds)
                        results[key] = cell
                    print(f"round {index + 1}, cell {key}: {cell}", flush=True)
                finally:
                    stop_cluster(data_dir)
                    shutil.rmtree(data_dir, ignore_errors=True)
            every.append(results)
    return every


def ratio(results: dict) -> float:
    return results[3]["mb_s"] / results[1]["mb_s"]


def median_round(every: list[dict]) -> dict:
    """The round whose produce ratio is the median (the lower middle one for an even
    count): what the table shows."""
    return sorted(every, key=ratio)[(len(every) - 1) // 2]


def rounds_line(every: list[dict]) -> str:
    ratios = [ratio(r) for r in every]
    over_grpc = [r[GRPC]["mb_s"] / r[1]["mb_s"] for r in every]
    small = [r[3]["txn_s"] / r[1]["txn_s"] for r in every]
    cpu = [r[3]["server_cpu_ms_per_mb"] / r[1]["server_cpu_ms_per_mb"] for r in every]
    met = sum(x >= TARGET_RF3_OF_RF1 for x in ratios)
    return (f"Round by round, factor 3 produce as a share of factor 1: "
            f"{', '.join(f'{x:.0%}' for x in ratios)} (target met in {met} of "
            f"{len(ratios)}); small transactions: {', '.join(f'{x:.0%}' for x in small)}; "
            f"servers' CPU per MB, factor 3 / factor 1: "
            f"{', '.join(f'{x:.1f}x' for x in cpu)}; factor 3 with followers copying "
            f"over gRPC, produce as a share of factor 1: "
            f"{', '.join(f'{x:.0%}' for x in over_grpc)}.")


def table(results: dict, seconds: float) -> str:
    """Factor 1, factor 3 and factor 3 with followers on gRPC, each factor-3 cell beside
    its ratio to factor 1 ("x" rows: a multiple, the others a share)."""
    one, three, over_grpc = results[1], results[3], results[GRPC]

    def row(label: str, key: str, form: str, compare: str = "") -> str:
        cells = [label, form.format(one[key])]
        for cell in (three, over_grpc):
            cells.append(form.format(cell[key]))
            ratio_of = cell[key] / one[key] if one[key] else 0.0
            cells.append({"share": f"{ratio_of:.0%}", "times": f"{ratio_of:.1f}x",
                          "": ""}[compare])
        return "| " + " | ".join(cells) + " |"

    def pair(label: str, a: str, b: str) -> str:
        cells = [label]
        for cell in (one, three, over_grpc):
            cells.append(f"{cell[a]:.1f} / {cell[b]:.1f}")
            if cell is not one:
                cells.append("")
        return "| " + " | ".join(cells) + " |"

    lines = ["| measure | factor 1 | factor 3 | 3 / 1 | factor 3, followers on gRPC | "
             "3 gRPC / 1 |", "| --- | --- | --- | --- | --- | --- |",
             row(f"produce MB/s (2 wire producers, {PARTITIONS} partitions, {BATCH_KIB} KiB "
                 "batches)", "mb_s", "{:.1f}", "share"),
             pair("produce ack p50 / p99 ms", "ack_p50_ms", "ack_p99_ms"),
             row("partition servers' CPU per MB acknowledged (ms), all three servers",
                 "server_cpu_ms_per_mb", "{:.1f}", "times"),
             row("partition servers' cores busy while producing", "server_cores", "{:.2f}"),
             row("Replicate/ReplicateMany calls per MB acknowledged",
                 "replicate_calls_per_mb", "{:.1f}"),
             row("small transactions/s (one client, one-call, back to back)", "txn_s",
                 "{:.0f}", "share"),
             pair("commit p50 / p99 ms", "p50_ms", "p99_ms"),
             row("partition servers' CPU per transaction (ms)", "server_cpu_ms_per_txn",
                 "{:.1f}", "times"),
             row("Replicate/ReplicateMany calls per transaction", "replicate_calls_per_txn",
                 "{:.1f}"),
             f"| disk floor: os.write 256 KiB + fsync, same run | "
             f"{results['disk_mb_s']:.0f} MB/s | | | | |"]
    return "\n".join(lines)


def shape_flags() -> str:
    """The command-line flags of a produce shape other than the default ("" for it)."""
    flags = []
    if PARTITIONS != DEFAULT_PARTITIONS:
        flags.append(f"--partitions {PARTITIONS}")
    if BATCH_KIB != DEFAULT_BATCH_KIB:
        flags.append(f"--batch-kib {BATCH_KIB}")
    return " ".join(flags)


def write_docs(text: str, every: list[dict], seconds: float) -> None:
    results = median_round(every)
    cpu_ratio = results[3]["server_cpu_ms_per_mb"] / results[1]["server_cpu_ms_per_mb"]
    grpc_cpu = results[GRPC]["server_cpu_ms_per_mb"]
    grpc_share = results[GRPC]["mb_s"] / results[1]["mb_s"]
    ratios = sorted(ratio(r) for r in every)
    flags = shape_flags()
    if flags:  # another shape: a section of its own, with what it is for
        begin, end = (f"<!-- bench/replication.py {flags}: begin -->",
                      f"<!-- bench/replication.py {flags}: end -->")
        section = "\n".join([
            begin,
            f"### Replication, many partitions written at once: factor 3 against factor 1, "
            f"{time.strftime('%Y-%m-%d')}",
            "",
            f"`.venv/bin/python bench/replication.py {flags} --seconds {seconds:g} "
            f"--rounds {len(every)}`: as in \"Replication: factor 3 against factor 1\", with "
            f"{PARTITIONS} partitions "
            f"({PARTITIONS // 3} led by each server, so each follower shares about that many "
            f"with each leader) and {BATCH_KIB} KiB batches: the shape where one "
            "`ReplicateMany` per follower and leader carries several partitions' records. "
            "Machine: " + results["machine"] + ".",
            "",
            text,
            "",
            rounds_line(every),
            end])
        common.write_docs_section(section, begin, end)
        return
    section = "\n".join([
        BEGIN,
        f"### Replication: factor 3 against factor 1 (issue 21), {time.strftime('%Y-%m-%d')}",
        "",
        f"`.venv/bin/python bench/replication.py --seconds {seconds:g} --rounds "
        f"{len(every)}`: one cluster per cell and round (fresh each time), three "
        "partition servers, one coordinator, one id allocator, every topic "
        "(and __txn_log) at that factor, all on this 2-core machine; the cells factor 1, "
        "factor 3 and factor 3 with followers copying over gRPC instead of the replication "
        "link (`replication.link=false`), in that "
        "order in odd rounds and the reverse in even ones. The table is the round with "
        "the median produce ratio (factor 3 against factor 1). Errors seen by the "
        f"wire producers: factor 1 {results[1]['errors'] or 'none'}, factor 3 "
        f"{results[3]['errors'] or 'none'}, factor 3 over gRPC "
        f"{results[GRPC]['errors'] or 'none'}. Machine: {results['machine']}.",
        "",
        text,
        "",
        rounds_line(every),
        "",
        f"Target: factor 3 produce at >= {TARGET_RF3_OF_RF1:.0%} of factor 1: "
        f"{'met' if ratios[(len(ratios) - 1) // 2] >= TARGET_RF3_OF_RF1 else 'not met'} "
        f"by the median round ({ratios[(len(ratios) - 1) // 2]:.0%}; range "
        f"{ratios[0]:.0%}-{ratios[-1]:.0%}).",
        "",
        "What limits it, measured: CPU per acknowledged MB and the acknowledgement's "
        "serial path. All three replicas and the producers share this machine's two "
        f"cores, and with factor 3 the partition servers spend {cpu_ratio:.1f}x the CPU per "
        "acknowledged MB, so where they are CPU-bound factor 3 cannot pass about "
        f"1/{cpu_ratio:.1f} of factor 1 on one box; three machines would each carry one "
        "replica. The wire producers keep five batches in flight per partition, as the "
        "SDK does, so their throughput follows the acknowledgement latency, which with "
        "factor 3 adds a follower's round (the leader's answer, the follower's append and "
        "fsync, and its next call, which tells the leader it holds it) and waits for the "
        "slower of the two followers. "
        "The third cell is factor 3 with followers copying over gRPC "
        "(`replication.link=false`), as they did before 2026-11-28: there the servers "
        f"spend {grpc_cpu:.1f} ms of CPU per MB against {results[3]['server_cpu_ms_per_mb']:.1f} "
        f"over the replication link, and produce reaches {grpc_share:.0%} of factor 1 in "
        "this round (round by round above). The link (docs/replication.md, \"The "
        "replication link\") carries the same ReplicateMany requests and answers over a "
        "length-prefixed TCP connection, the follower's side on a blocking socket of its "
        "own thread: moving 0.8 MB answers between two Python processes costs 0.5-0.6 ms "
        "of CPU per MB over both sides that way against 1.1-1.2 ms through grpc.aio "
        "(`bench/copy_link.py`). A follower's plain rounds run whole on that thread (the "
        "call, the CRC check, the direct write and its fsync, the next call: "
        "docs/replication.md, \"Rounds on the link's thread\"), where each used to cross "
        "from the event loop to the link's thread, to a worker thread and back: the "
        "servers' context switches per acknowledged MB fell from about 173 to 140-146 (86 "
        "at factor 1). What remains per MB beyond factor 1 is the followers' work itself "
        "and the leader's (answering each round, recording each follower's position, "
        "moving the high watermark and answering the producers it holds back). "
        "Before the link, with followers writing around the page cache (perf, same cell, "
        "2026-11-28, 13.4 ms per MB under perf): the Python interpreter 32%, context "
        "switches and wake-ups 19%, libc 12% (memmove 8.7%), gRPC's core 8.8%, socket and "
        "log-read copies in the kernel 6.7%, crc32c 2%, the page-cache copy 1.5% (a third "
        "before direct follower writes, docs/replication.md \"Followers write around the "
        "page cache\"). Tried and not kept: a follower fetching its next records while its "
        "fsync runs (more, smaller calls per MB); HTTP/2 frames of 4 MiB instead of 16 KiB; "
        "a leader lingering 3 or 8 ms before answering a follower; one gRPC stream per "
        "follower and leader; the leader sending the records from its files with sendfile "
        "(docs/benchmarks.md, the sections below).",
        END])
    common.write_docs_section(section, BEGIN, END)


def main() -> None:
    global PARTITIONS, BATCH_KIB
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of cells (factor 1, 3, 3 with followers on gRPC), alternating "
                             "their order; "
                             "the table shows the median round (default 3)")
    parser.add_argument("--partitions", type=int, default=PARTITIONS,
                        help="partitions of the produce topic, spread over the three "
                             f"servers (default {PARTITIONS}: one led by each)")
    parser.add_argument("--batch-kib", type=int, default=BATCH_KIB,
                        help=f"KiB per produced batch (default {BATCH_KIB})")
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.partitions < 1 or not 1 <= args.batch_kib <= 4096:
        parser.error("--partitions must be at least 1 and --batch-kib 1..4096")
    PARTITIONS, BATCH_KIB = args.partitions, args.batch_kib
    every = run(args.seconds, args.rounds)
    text = table(median_round(every), args.seconds)
    print(text)
    print(rounds_line(every))
    if not args.no_docs:
        write_docs(text, every, args.seconds)


if __name__ == "__main__":
    main()
