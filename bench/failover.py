"""Benchmark (issue 21, item 4): coordinator failover as a client sees it.

Starts its own local cluster in a temporary directory (1 id allocator, 2 coordinators,
3 partition servers, ZooKeeper; `--set name=value` passes settings to every process),
then runs client threads in a loop of small transactions (10 x 1 KiB over 4 partitions,
one-call commits, the SDK's defaults: each transaction on a random TC partition), and
kill -9s a coordinator, `--kills` times, the two in turn; after each kill it waits for the
transactions to flow on every TC partition again, restarts the killed coordinator with
`atomlog up`, and waits for the leases to spread over both again.

Per kill: **failover** is the time from the kill to the first transaction committed on
one of the TC partitions the killed coordinator held (of those still blocked at the
kill, or begun after it), as a new user's loop would see it: SDK retries and backoff
included. **all back** is the same for the last of those TC partitions. **lease taken**
is when the surviving coordinator acquired them (the owner znodes' acquired time), so
failover = lease taken (the killed process's ZooKeeper session has to expire first) +
loading the TC partition + the client's next retry.

Baseline in the same run: first, on a cluster of its own, `--baseline-kills` (2) kills
with coordinators on the other servers' 10 s ZooKeeper sessions
(coordinator.zookeeper_session_timeout_ms=0), as every server had before.

Prints a table and writes its section of docs/benchmarks.md.

    .venv/bin/python bench/failover.py [--kills 6] [--baseline-kills 2] [--clients 4]
        [--set name=value ...] [--no-docs]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.append(str(REPO / "bench"))  # after the packages: bench/coordinator.py is a script

import common  # noqa: E402

BEGIN, END = "<!-- bench/failover.py: begin -->", "<!-- bench/failover.py: end -->"
ROLES = {"id_allocator": 1, "coordinator": 2, "partition_server": 3}
TOPIC, PARTITIONS = "failover", 4


class Loop:
    """Client threads committing small transactions; every commit is logged as
    (TC partition, began, ended, ok)."""

    def __init__(self, address: str, clients: int):
        from spark_client import Client

        self.client = Client(address)
        self.done: list[tuple[int, float, float, bool]] = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self.run, daemon=True) for _ in range(clients)]
        self.producer = self.client.producer(linger_ms=1)
        for thread in self.threads:
            thread.start()

    def run(self) -> None:
        value = b"v" * 1024
        while not self.stopping.is_set():
            txn = self.client.begin_transaction(timeout_s=60)
            began = time.time()
            try:
                for i in range(10):
                    self.producer.send(TOPIC, value, partition=i % PARTITIONS, txn=txn)
                txn.commit()
                ok = True
            except Exception:  # noqa: BLE001 — a failed commit is logged as one
                ok = False
                try:
                    txn.abort()
                except Exception:  # noqa: BLE001
                    pass
            with self.lock:
                self.done.append((txn.tc_partition, began, time.time(), ok))

    def commits(self) -> list[tuple[int, float, float, bool]]:
        with self.lock:
            return list(self.done)

    def stop(self) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(timeout=90)
        self.producer.close(timeout=10)
        self.client.close()


def owners(zk) -> dict[int, tuple[str, int]]:
    """TC partition -> (coordinator name, acquired unix ms)."""
    found = {}
    for name in zk.get_children("/tc"):
        try:
            data, _ = zk.get(f"/tc/{name}/owner")
        except Exception:  # noqa: BLE001 — no owner now
            continue
        owner = json.loads(data)
        found[int(name)] = (owner["coordinator_name"], owner["acquired_unix_ms"])
    return found


def wait_balanced(zk, names: list[str], count: int, timeout_s: float = 120) -> None:
    """Until every TC partition has an owner and each coordinator holds its share."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        held = owners(zk)
        per = [sum(1 for owner, _ in held.values() if owner == n) for n in names]
        if len(held) == count and min(per) >= count // len(names):
            return
        time.sleep(0.2)
    raise SystemExit(f"leases did not spread over {names} within {timeout_s} s")


def one_kill(loop: Loop, zk, process, count: int) -> dict:
    held = {k for k, (owner, _) in owners(zk).items() if owner == process.name}
    time.sleep(2)  # the loop runs on every TC partition
    killed_at = time.time()
    os.kill(process.pid, signal.SIGKILL)
    first_back: dict[int, float] = {}
    deadline = time.monotonic() + 120
    while len(first_back) < len(held) and time.monotonic() < deadline:
        time.sleep(0.1)
        for tc, _began, ended, ok in loop.commits():
            if ok and tc in held and ended > killed_at + 0.05 and tc not in first_back:
                first_back[tc] = ended
    taken = [acquired / 1000 for k, (owner, acquired) in owners(zk).items() if k in held]
    failed = sum(1 for tc, began, ended, ok in loop.commits()
                 if not ok and ended > killed_at and began < killed_at + 60)
    return {"coordinator": process.name, "tc_partitions": len(held),
            "failover_s": min(first_back.values()) - killed_at if first_back else None,
            "all_back_s": max(first_back.values()) - killed_at
            if len(first_back) == len(held) else None,
            "lease_taken_s": min(taken) - killed_at if taken else None,
            "lease_all_s": max(taken) - killed_at if taken else None,
            "failed_commits": failed}


def fmt(value) -> str:
    return "-" if value is None else f"{value:.1f}"


BASELINE = {"coordinator.zookeeper_session_timeout_ms": "0"}  # coordinators on 10 s sessions


def table(rows: list[dict]) -> list[str]:
    lines = ["| kill | coordinator | its TC partitions | lease taken (first / last) | "
             "failover: first commit on one of them | all back | failed commits |",
             "| ---: | --- | ---: | --- | ---: | ---: | ---: |"]
    for i, row in enumerate(rows, 1):
        lines.append(f"| {i} | {row['coordinator']} | {row['tc_partitions']} | "
                     f"{fmt(row['lease_taken_s'])} / {fmt(row['lease_all_s'])} | "
                     f"{fmt(row['failover_s'])} | {fmt(row['all_back_s'])} | "
                     f"{row['failed_commits']} |")
    return lines


def summary(rows: list[dict]) -> str:
    failovers = [r["failover_s"] for r in rows if r["failover_s"] is not None]
    backs = [r["all_back_s"] for r in rows if r["all_back_s"] is not None]
    if not failovers or not backs:
        return "Some TC partitions never came back within 120 s."
    return (f"Failover: median {statistics.median(failovers):.1f} s, worst "
            f"{max(failovers):.1f} s; all of its TC partitions back: median "
            f"{statistics.median(backs):.1f} s, worst {max(backs):.1f} s.")


def section(rows: list[dict], baseline: list[dict], args, settings: dict,
            load: float) -> str:
    lines = [BEGIN, "## Coordinator failover as a client sees it (issue 21, item 4)", "",
             f"`{common.command_line('bench/failover.py', sys.argv[1:])}` — "
             f"{time.strftime('%Y-%m-%d %H:%M')}, {common.machine(load)}", "",
             f"A local cluster (1 id allocator, 2 coordinators, 3 partition servers), "
             f"settings {settings or 'the defaults'}; {args.clients} client threads in a "
             "loop of small transactions (10 x 1 KiB over 4 partitions, one-call commits, "
             "a random TC partition each); kill -9 of a coordinator, the two in turn, "
             "restarted and rebalanced between kills. Seconds after the kill:", "",
             *table(rows), "", summary(rows) + " Target of issue 21: at most 5 s."]
    if baseline:
        lines += ["", "Baseline in the same run, on a cluster of its own: the same, with "
                  f"{BASELINE} (coordinators on the 10 s sessions of the other servers):", "",
                  *table(baseline), "", summary(baseline)]
    lines.append(END)
    return "\n".join(lines)


def measure(settings: dict, kills: int, clients: int) -> list[dict]:
    """`kills` kill -9s of a coordinator on a fresh cluster with `settings`."""
    from kazoo.client import KazooClient

    from services import launcher
    from spark_client import Client

    rows = []
    with tempfile.TemporaryDirectory(prefix="atomlog-bench-failover-") as directory:
        data_dir = Path(directory)
        try:
            report = launcher.up(data_dir, ROLES, settings, timeout_s=120)
            address = next(p.grpc_address for p in report.cluster.processes
                           if p.role != "zookeeper")
            info = json.loads((data_dir / launcher.CLUSTER_FILE).read_text())
            zk = KazooClient(hosts=info["zookeeper"] + info["chroot"])
            zk.start(timeout=10)
            with Client(address) as client:
                client.create_topic(TOPIC, partitions=PARTITIONS)
                client.metadata.refresh()
                count = client.metadata.tc_partition_count
            names = [p.name for p in report.cluster.processes if p.role == "coordinator"]
            wait_balanced(zk, names, count)
            loop = Loop(address, clients)
            try:
                for i in range(kills):
                    cluster = launcher.ClusterFile.load(data_dir)
                    victim = next(p for p in cluster.processes if p.name == names[i % 2])
                    row = one_kill(loop, zk, victim, count)
                    rows.append(row)
                    print(f"kill {i + 1}: {row}", flush=True)
                    launcher.up(data_dir, ROLES, settings, timeout_s=120)
                    wait_balanced(zk, names, count)
            finally:
                loop.stop()
                zk.stop()
        finally:
            if (data_dir / launcher.CLUSTER_FILE).exists():
                launcher.down(data_dir, timeout_s=10)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=6)
    parser.add_argument("--baseline-kills", type=int, default=2,
                        help=f"kills on a baseline cluster with {BASELINE} (0: none)")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help="a setting for every process (atomlog up --set)")
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args()
    settings = common.cluster_settings(parser, args.set)
    load = os.getloadavg()[0]
    baseline = (measure({**settings, **BASELINE}, args.baseline_kills, args.clients)
                if args.baseline_kills else [])
    rows = measure(settings, args.kills, args.clients)
    text = section(rows, baseline, args, settings, load)
    print(text)
    if not args.no_docs:
        common.write_docs_section(text, BEGIN, END)


if __name__ == "__main__":
    main()
