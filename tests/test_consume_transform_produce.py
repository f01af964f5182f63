"""Consume-transform-produce, exactly once, while servers die (issue 6).

10,000 inputs wait on a topic of several partitions. tests/ctp_loop.py — a loop written
as a user would write it (subscription consumer; per batch one transaction holding the
transformed outputs and the transactional acks of the inputs; abort and Nack on a
retriable or transaction-ending error) — runs as its own OS process, while this test
kills -9 the partition server owning the most input and output partitions, and later a
coordinator owning TC partitions, each in the middle of the run, and restarts them with
`atomlog up`. Afterwards a read_committed reader of the output must find every
transformed input exactly once, and the subscription must have acknowledged every input.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from spark_client import Client, errors
from spark_client.transactions import Transaction
from tests.conftest import REPO_ROOT, wait_until
from tests.ctp_loop import input_ends, transform

INPUT, OUTPUT, SUBSCRIPTION = "ctp-in", "ctp-out", "ctp"
PARTITIONS = 6
COUNT = 10_000
# 500 transactions (about 10 s undisturbed here): the kills land among many of them.
BATCH = 20
LOOP_DEADLINE_S = 80.0


class LoopProcess:
    """tests/ctp_loop.py as a child process; `progress` is its last JSON line."""

    def __init__(self, bootstrap: str):
        self.process = subprocess.Popen(
            [sys.executable, str(REPO_ROOT / "tests" / "ctp_loop.py"), bootstrap, INPUT, OUTPUT,
             SUBSCRIPTION, "--batch", str(BATCH), "--deadline-s", str(LOOP_DEADLINE_S)],
            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.progress: dict = {}
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line.rstrip())
            self.progress = json.loads(line)

    def committed(self) -> int:
        if self.process.poll() is not None:
            raise AssertionError(f"the loop exited early: {self.report()}")
        return self.progress.get("committed", 0)

    def wait_for(self, committed: int, timeout_s: float, what: str) -> int:
        """Wait until the loop has committed at least `committed` inputs; return how many."""
        try:
            wait_until(lambda: self.committed() >= committed, timeout_s, what)
        except AssertionError as error:
            raise AssertionError(f"{error}; the loop: {self.report()}") from None
        return self.committed()

    def wait(self, timeout_s: float) -> int:
        try:
            code = self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise AssertionError(f"the loop did not finish: {self.report()}") from None
        self._reader.join(timeout=5)
        return code

    def report(self) -> str:
        if self.process.poll() is None:  # stuck: where? (faulthandler, then stop it)
            self.process.send_signal(signal.SIGUSR1)
            time.sleep(1)
            self.process.kill()
            self.process.wait()
        stderr = self.process.stderr.read()
        return "\n".join(self.lines[-3:]) + ("\nstderr:\n" + stderr[-3000:] if stderr else "")


def preload(client: Client) -> list[bytes]:
    for topic in (INPUT, OUTPUT):
        client.create_topic(topic, partitions=PARTITIONS)
    inputs = [f"input-{i:05d}".encode() for i in range(COUNT)]
    with client.producer() as producer:
        futures = [producer.send(INPUT, value, key=value, partition=i % PARTITIONS)
                   for i, value in enumerate(inputs)]
        producer.flush()
    for future in futures:
        future.result(0)
    return inputs


def busiest_partition_server(client: Client) -> str:
    """The partition server owning the most input plus output partitions (at least one of
    each with three servers and six partitions per topic)."""
    owned: Counter = Counter()
    for topic in (INPUT, OUTPUT):
        for route in client.metadata.partitions(topic):
            owned[route.server_name] += 1
    return owned.most_common(1)[0][0]


def busiest_coordinator(cluster, client: Client) -> str:
    client.metadata.refresh()
    by_address = Counter(address for address in client.metadata.tc_routes.values() if address)
    address = by_address.most_common(1)[0][0]
    return next(p["name"] for p in cluster.services() if p["grpc_address"] == address)


def kill(cluster, name: str) -> None:
    os.kill(cluster.process(name)["pid"], signal.SIGKILL)


def read_committed(client: Client, topic: str, expected: int, timeout_s: float = 30) -> list:
    """Every message of `topic` from the start under read_committed: read until `expected`
    are in and then for one quiet second more (so a duplicate would be seen)."""
    messages: list = []
    with client.consumer(topic, isolation="read_committed") as consumer:
        deadline = time.monotonic() + timeout_s
        quiet_since = time.monotonic()
        while time.monotonic() < deadline:
            batch = consumer.poll(timeout_s=0.2, max_records=100_000)
            if batch:
                messages.extend(batch)
                quiet_since = time.monotonic()
            elif len(messages) >= expected and time.monotonic() - quiet_since > 1.0:
                break
    return messages


def log_warnings(cluster, last: int = 4) -> str:
    """The last warnings and errors of every service's log, for a failure message."""
    lines = []
    for service in cluster.services():
        path = Path(service["log_file"])
        found = [line[:400] for line in (path.read_text().splitlines() if path.exists() else [])
                 if '"level":"INFO"' not in line.replace(" ", "")]
        lines += [f"{service['name']}: {line}" for line in found[-last:]]
    return "\n".join(lines)


def test_consume_transform_produce_is_exactly_once_across_kill_9(cluster):
    client = Client(cluster.info["bootstrap"])
    loop = None
    try:
        inputs = preload(client)
        server = busiest_partition_server(client)
        loop = LoopProcess(cluster.info["bootstrap"])
        began = time.monotonic()

        at_server_kill = loop.wait_for(COUNT // 7, 30, "a seventh of the inputs")
        kill(cluster, server)
        cluster.up()
        loop.wait_for(at_server_kill + COUNT // 7, 40, "progress after the partition server "
                      "came back")
        coordinator = busiest_coordinator(cluster, client)
        at_coordinator_kill = loop.committed()
        kill(cluster, coordinator)
        cluster.up()

        code = loop.wait(LOOP_DEADLINE_S + 10)
        elapsed = time.monotonic() - began
        final = loop.progress
        assert code == 0 and final.get("done"), loop.report()
        # Both kills landed in the middle of the run.
        assert 0 < at_server_kill < at_coordinator_kill < COUNT, (at_server_kill,
                                                                  at_coordinator_kill)

        outputs = read_committed(client, OUTPUT, COUNT)
        produced = Counter(m.value for m in outputs)
        expected = Counter(transform(value) for value in inputs)
        missing = expected - produced
        duplicated = {value: n for value, n in produced.items() if n > 1}
        unexpected = set(produced) - set(expected)
        assert not missing and not duplicated and not unexpected, (
            f"{len(missing)} missing (e.g. {list(missing)[:3]}), {len(duplicated)} "
            f"duplicated (e.g. {list(duplicated.items())[:3]}), {len(unexpected)} unexpected; "
            f"loop: {final}")
        ends = input_ends(client, INPUT)
        assert sum(ends.values()) == COUNT
        with client.consumer(INPUT, subscription=SUBSCRIPTION) as observer:
            cursors = observer.describe()
        assert {c.subscription_partition.partition: c.cumulative_end_offset
                for c in cursors} == ends
        assert not [c for c in cursors if c.pending_acks or c.individual_ranges]
        print(f"exactly once in {elapsed:.1f} s; kills at {at_server_kill} and "
              f"{at_coordinator_kill} committed inputs; loop: {final}")
    except AssertionError as error:
        raise AssertionError(f"{error}\nservice log warnings:\n{log_warnings(cluster)}") from None
    finally:
        if loop is not None and loop.process.poll() is None:
            loop.process.kill()
        cluster.up()
        client.close()


def test_a_transaction_waits_out_the_death_of_its_tc_log_partition_server(cluster):
    """Found by the loop above: while the partition server holding `__txn_log-<k>` is
    down, the appends of TC partition k fail and must be retried until it is back. The
    retry used to die of a TypeError in its own log line, killing the TC partition's
    writer without a word, so every later call on TC partition k hung until its lease
    moved. A transaction on TC partition k begun while that server is down must begin and
    commit once the server is back."""
    client = Client(cluster.info["bootstrap"])
    try:
        k = 0
        Transaction(client, 30.0, tc_partition=k).commit()  # TC partition k is loaded
        server = client.metadata.route("__txn_log", k).server_name
        kill(cluster, server)
        outcome: dict = {}

        def run() -> None:
            try:
                txn = Transaction(client, 30.0, tc_partition=k)
                txn.commit()
                outcome["state"] = txn.state()
            except Exception as error:  # noqa: BLE001 — reported below
                outcome["error"] = error

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        time.sleep(1.0)  # NewTxn's append fails against the dead server meanwhile
        cluster.up()
        thread.join(60)
        assert not thread.is_alive(), "the transaction hung"
        assert outcome.get("state") in ("COMMITTING", "COMMITTED"), (
            f"{outcome}\nservice log warnings:\n{log_warnings(cluster)}")
    finally:
        cluster.up()
        client.close()
