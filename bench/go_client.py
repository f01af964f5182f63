"""Benchmark: the Go client's small one-call transactions, on the coordinators' links
against over gRPC, on the multi-process cluster and on the combined server.

Each shape gets a fresh local cluster (every topic 1 copy). Then `atomlog-go bench` runs
(clients/go/cmd/atomlog-go/bench.go): 8 goroutines of one Go process, each a loop of one
one-call transaction of 10 × 1 KiB over 4 partitions, for `--seconds`. It runs with the
links and with `-no-links` (gRPC only), in turns, `--rounds` times. Each run reports
transactions/s, commit p50/p99, the Go process's CPU per transaction and the servers'
(from /proc). The baseline is the do-nothing gRPC call rate between two Python processes,
measured in the same run.

scripts/go_tools.sh finds Go, or fetches the pinned toolchain, and the module cache
fills from the Go module proxy on the first build.

    .venv/bin/python bench/go_client.py [--seconds 10] [--rounds 2] [--no-docs]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.append(str(REPO / "bench"))

import common  # noqa: E402

BEGIN = "<!-- bench/go_client.py: begin -->"
END = "<!-- bench/go_client.py: end -->"
SHAPES = common.SHAPES
TOPIC = "bench-go-small-txn"


def build_cli(out: Path) -> Path:
    from tests.go_tools import build_cli as build, go_tools

    found = go_tools(1200)
    env = {**os.environ, "PATH": f"{Path(found['GO']).parent}:{os.environ['PATH']}"}
    return build(found["GO"], out, 1200, env)


def run_shape(cli: Path, shape: str, seconds: float, rounds: int) -> dict:
    from spark_client import Client

    runs: dict[str, list[dict]] = {"links": [], "grpc": []}
    with common.local_cluster(f"atomlog-bench-go-{shape}-", SHAPES[shape],
                              replication_factor=common.BENCH_REPLICATION_FACTOR) as (
            _, report, address):
        with Client(address) as client:
            client.create_topic(TOPIC, partitions=16)
        time.sleep(3)  # leases settle
        services = [p for p in report.cluster.processes if p.role != "zookeeper"]
        for _ in range(rounds):
            for way in ("links", "grpc"):
                before = sum(common.cpu_seconds(p.pid) for p in services)
                result = subprocess.run(
                    [str(cli), "-bootstrap", address, "bench", "-topic", TOPIC,
                     "-seconds", str(seconds), *(["-no-links"] if way == "grpc" else [])],
                    capture_output=True, text=True, timeout=seconds + 120)
                if result.returncode != 0:
                    raise RuntimeError(f"atomlog-go bench: {result.stderr}")
                cell = json.loads(result.stdout.strip().splitlines()[-1])
                cell["server_cpu_ms_per_txn"] = ((sum(common.cpu_seconds(p.pid) for p in services)
                                                  - before) / cell["transactions"] * 1e3)
                print(f"{shape} {way}: {cell}", flush=True)
                runs[way].append(cell)
    return runs


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def table(results: dict, floor: dict, seconds: float, rounds: int, load: float) -> str:
    rows = []
    for shape, runs in results.items():
        for way, label in (("links", "on the coordinators' links"), ("grpc", "over gRPC")):
            cells = runs[way]
            each = ", ".join(format(c["per_s"], ",.0f") for c in cells)
            rows.append(
                f"| {shape} | {label} | **{_median(cells, 'per_s'):,.0f}** ({each}) | "
                f"{_median(cells, 'per_s') / floor['calls_per_s'] * 100:.0f}% | "
                f"{_median(cells, 'commit_p50_ms'):.1f} / {_median(cells, 'commit_p99_ms'):.1f} | "
                f"{_median(cells, 'server_cpu_ms_per_txn'):.2f} | "
                f"{_median(cells, 'client_cpu_ms_per_txn'):.3f} |")
        def change(key: str) -> float:
            return (_median(runs["links"], key) / _median(runs["grpc"], key) - 1) * 100

        rows.append(f"| {shape} | links against gRPC | {change('per_s'):+.0f}% | | | "
                    f"{change('server_cpu_ms_per_txn'):+.0f}% | "
                    f"{change('client_cpu_ms_per_txn'):+.0f}% |")
    return "\n".join([
        BEGIN,
        "## The Go client's small transactions: coordinators' links against gRPC (issue 19)",
        "",
        f"`python bench/go_client.py`, {time.strftime('%Y-%m-%d %H:%M')}, {common.machine(load)}",
        "",
        f"One Go process (`atomlog-go bench`), 8 goroutines, each a loop of one one-call "
        f"transaction of 10 × 1 KiB over 4 partitions, {seconds:g} s a run, the two ways in "
        f"turns, {rounds} runs each (medians; every run's rate in brackets). Every topic has "
        f"1 copy. Baseline in the same run: a do-nothing gRPC call between two Python "
        f"processes, **{floor['calls_per_s']:,.0f} calls/s**.",
        "",
        "| shape | the client's calls to coordinators | small transactions/s | of the call rate "
        "| commit p50 / p99 ms | server CPU ms per txn | Go client CPU ms per txn |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        *rows,
        END,
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--no-docs", action="store_true", help="print only")
    args = parser.parse_args()
    if not 1 <= args.seconds <= 600 or not 1 <= args.rounds <= 10:
        parser.error("--seconds takes 1..600, --rounds 1..10")
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="atomlog-bench-go-") as tmp:
        cli = build_cli(Path(tmp) / "atomlog-go")
        floor = common.grpc_call_floor()
        print(f"gRPC call floor: {floor}", flush=True)
        results = {shape: run_shape(cli, shape, args.seconds, args.rounds) for shape in SHAPES}
    text = table(results, floor, args.seconds, args.rounds, load)
    print(text)
    if not args.no_docs:
        common.write_docs_section(text, BEGIN, END)
        print("wrote its section of docs/benchmarks.md")


if __name__ == "__main__":
    main()
