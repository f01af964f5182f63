"""A real speculative task attempt against the atomlog data source.

Local mode never runs a speculative copy (Spark does not launch one on a host that
already runs an attempt of the task), so this test starts a Spark standalone master and
two workers, one core each, on different loopback addresses (127.0.0.2 and 127.0.0.3),
from the pip-installed pyspark, and runs the driver (tests/spark_speculation_job.py) in a
subprocess with aggressive speculation. One task's first attempt hands all of its rows to
the atomlog writer, which sends most of them in its child transaction, and then stalls;
Spark starts a speculative copy on the other worker, the copy (which waits until the
original's rows are in the partition) wins, and the driver commits the parent naming the
copy's child. The test shows, from Spark's REST API, the data and the coordinator, that
both attempts wrote, that the loser's child was aborted by the parent's commit with its
rows, that nothing is left open, and that every row is visible exactly once.

About 35-60 s for the test itself on 2 busy cores (five JVMs start); every process it
starts is ended, on failure too.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections import Counter
from pathlib import Path

import pytest

from services import launcher
from spark_client import Client
from tests import spark_speculation_job as job
from tests.conftest import REPO_ROOT, create_online

pyspark = pytest.importorskip("pyspark")

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

SPARK_HOME = Path(pyspark.__file__).resolve().parent
MASTER_HOST = "127.0.0.1"
WORKER_HOSTS = ("127.0.0.2", "127.0.0.3")
# Set in the environment of every process this test starts (Spark passes it on to the
# executors and their Python workers), so that whatever is left can be found and ended.
MARK = "ATOMLOG_SPECULATION_TEST"
# Five JVMs start on what may be a small machine: quick-starting ones.
JVM_OPTIONS = job.JVM_OPTIONS


def free_port() -> int:
    """Below the ephemeral range, as the local cluster's (services/launcher.py): a bind(0)
    port could be taken by an outgoing connection before the JVM binds it."""
    return launcher.free_port()


def can_bind(host: str) -> bool:
    try:
        with socket.socket() as s:
            s.bind((host, 0))
        return True
    except OSError:
        return False


def tail(path: Path, chars: int = 3000) -> str:
    """The end of a log, from its last Python traceback if it has one."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"--- {path}: (none)"
    start = text.rfind("Traceback (most recent call last)")
    return f"--- {path}:\n" + (text[start:][:chars] if start >= 0 else text[-chars:])


def json_at(url: str):
    with urllib.request.urlopen(url, timeout=5) as reply:
        return json.loads(reply.read())


class Standalone:
    """A Spark standalone master and one worker per WORKER_HOSTS address, each its own
    process group, every one of their descendants marked with MARK=<token>."""

    def __init__(self, root: Path):
        self.root = root
        self.token = uuid.uuid4().hex
        self.port, self.ui_port = free_port(), free_port()
        self.url = f"spark://{MASTER_HOST}:{self.port}"
        self.processes: list[subprocess.Popen] = []
        self.logs: list[Path] = []

    def env(self, host: str, name: str) -> dict[str, str]:
        env = dict(os.environ, SPARK_HOME=str(SPARK_HOME), SPARK_LOCAL_IP=host,
                   SPARK_LOCAL_DIRS=str(self.root / name / "local"),
                   SPARK_WORKER_DIR=str(self.root / name / "work"),
                   SPARK_DAEMON_MEMORY="256m", SPARK_DAEMON_JAVA_OPTS=JVM_OPTIONS,
                   PYSPARK_PYTHON=sys.executable,
                   PYSPARK_DRIVER_PYTHON=sys.executable, **{MARK: self.token})
        env.pop("SPARK_CONF_DIR", None)
        return env

    def spawn(self, name: str, host: str, *args: str) -> None:
        (self.root / name).mkdir(parents=True, exist_ok=True)
        log = self.root / f"{name}.log"
        self.logs.append(log)
        with open(log, "wb") as out:
            self.processes.append(subprocess.Popen(
                [str(SPARK_HOME / "bin" / "spark-class"), *args], env=self.env(host, name),
                cwd=self.root, stdout=out, stderr=subprocess.STDOUT, start_new_session=True))

    def master_state(self) -> dict | None:
        """The master's state, or None while it is not serving it yet: a master still
        starting has answered /json/ with its HTML page once (in CI, 2026-12-04),
        likely before its JSON handler was attached; that is "not up yet" too."""
        try:
            return json_at(f"http://{MASTER_HOST}:{self.ui_port}/json/")
        except (OSError, ValueError):
            return None

    def start(self) -> None:
        began = time.monotonic()
        self.spawn("master", MASTER_HOST, "org.apache.spark.deploy.master.Master",
                   "--host", MASTER_HOST, "--port", str(self.port),
                   "--webui-port", str(self.ui_port))
        self.wait(lambda s: s.get("status") == "ALIVE", "the master")
        # Workers started after the master is up register at once (instead of retrying
        # after 5-15 s).
        for n, host in enumerate(WORKER_HOSTS):
            self.spawn(f"worker-{n}", host, "org.apache.spark.deploy.worker.Worker",
                       "--host", host, "--cores", "1", "--memory", "1g",
                       "--webui-port", str(free_port()), self.url)
        self.wait(lambda s: sorted(w["host"] for w in s["workers"] if w["state"] == "ALIVE")
                  == sorted(WORKER_HOSTS), "both workers")
        self.start_seconds = time.monotonic() - began

    def wait(self, ready, what: str, timeout_s: float = 90) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            state = self.master_state()
            if state is not None and ready(state):
                return
            if any(p.poll() is not None for p in self.processes):
                break
            time.sleep(0.2)
        raise AssertionError(f"Spark standalone: {what} did not come up\n"
                             + "\n".join(tail(log) for log in self.logs))

    def marked(self) -> list[int]:
        """Pids of live processes carrying this cluster's mark (ours: only processes that
        descend from what this test started inherit it)."""
        found = []
        needle = f"{MARK}={self.token}".encode()
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != os.getpid():
                try:
                    environ = Path("/proc", entry, "environ").read_bytes()
                except OSError:
                    continue
                if needle in environ.split(b"\0"):
                    found.append(int(entry))
        return found

    def stop(self) -> None:
        for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            for process in self.processes:
                if process.poll() is None:
                    try:
                        os.killpg(process.pid, sig)
                    except ProcessLookupError:
                        pass
            deadline = time.monotonic() + grace
            while any(p.poll() is None for p in self.processes) and time.monotonic() < deadline:
                time.sleep(0.1)
        # Executors share their worker's process group, but PySpark's daemon makes its own
        # (and may outlive a killed executor briefly): end whatever carries the mark.
        if sys.platform.startswith("linux"):
            deadline = time.monotonic() + 10
            while (left := self.marked()) and time.monotonic() < deadline:
                for pid in left:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                time.sleep(0.2)
        for process in self.processes:
            process.wait(timeout=10)


@pytest.fixture
def standalone(tmp_path):
    missing = [h for h in WORKER_HOSTS if not can_bind(h)]
    if missing:
        pytest.skip(f"cannot bind the loopback address(es) {missing} (two Spark workers on "
                    "different hosts are needed for a speculative copy)")
    cluster = Standalone(tmp_path / "spark")
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        if sys.platform.startswith("linux"):
            assert cluster.marked() == [], "processes of the Spark cluster survived"


def values(client, topic: str, isolation: str) -> Counter:
    """Values readable now under `isolation`, with how often each occurs."""
    with client.consumer(topic, isolation=isolation) as consumer:
        return Counter(m.value.decode() for messages in consumer.read_until() for m in messages)


def txn_json(cluster, *args: str) -> dict:
    return json.loads(cluster.run("txn", *args, "-o", "json").stdout)


def run_driver(standalone: Standalone, client, bootstrap: str, topic: str,
               timeout_s: float = 180) -> tuple[dict, dict]:
    """Run the driver; meanwhile note every transaction seen open on the topic's
    partitions: {txn id "k:seq": (partition, first offset, last offset)}."""
    env = dict(os.environ, SPARK_HOME=str(SPARK_HOME), SPARK_LOCAL_IP=MASTER_HOST,
               SPARK_LOCAL_DIRS=str(standalone.root / "driver"),
               PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable,
               **{MARK: standalone.token})
    env.pop("SPARK_CONF_DIR", None)
    stdout_path, stderr_path = standalone.root / "driver.out", standalone.root / "driver.err"
    seen: dict[str, tuple[int, int, int]] = {}
    began = time.monotonic()
    with open(stdout_path, "wb") as out, open(stderr_path, "wb") as err:
        driver = subprocess.Popen(
            [sys.executable, str(Path(job.__file__)), standalone.url, bootstrap, topic,
             str(free_port())], cwd=REPO_ROOT, env=env, stdout=out, stderr=err,
            start_new_session=True)
    try:
        while driver.poll() is None and time.monotonic() - began < timeout_s:
            for p in range(job.TASKS):
                for t in client.describe_partition(topic, p).open_transactions:
                    first = seen.get(f"{t.txn_id.tc_partition}:{t.txn_id.sequence}",
                                     (p, t.first_offset, t.last_offset))
                    seen[f"{t.txn_id.tc_partition}:{t.txn_id.sequence}"] = (
                        p, t.first_offset, max(first[2], t.last_offset))
            time.sleep(0.2)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
        driver.wait()
    stdout = stdout_path.read_text(errors="replace")
    result = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert driver.returncode == 0 and result, (
        f"driver exited {driver.returncode}\nstdout:\n{stdout[-3000:]}\n"
        + "\n".join(tail(log, 6000) for log in [stderr_path, *standalone.logs]))
    return dict(json.loads(result[-1].removeprefix("RESULT ")),
                driver_seconds=time.monotonic() - began), seen


def test_a_losing_speculative_attempt_is_aborted_with_its_rows(cluster, standalone):
    began = time.monotonic()
    bootstrap = cluster.info["bootstrap"]
    slow = job.SLOW_TASK
    with Client(bootstrap) as client:
        topic = create_online(client, f"spark-speculation-{uuid.uuid4().hex[:8]}", job.TASKS)
        result, seen_open = run_driver(standalone, client, bootstrap, topic)

        # Spark: two attempts of the slow task, on different hosts; the speculative copy
        # succeeded and the original was killed. Every task succeeded exactly once.
        tasks = result["tasks"]
        attempts = sorted((t for t in tasks if t["index"] == slow), key=lambda t: t["attempt"])
        assert [(t["attempt"], t["speculative"]) for t in attempts] == [(0, False), (1, True)], tasks
        original, copy = attempts
        assert copy["status"] == "SUCCESS" and original["status"] == "KILLED", tasks
        assert {original["host"], copy["host"]} == set(WORKER_HOSTS), tasks
        for index in range(job.TASKS):
            assert [t["status"] for t in tasks if t["index"] == index].count("SUCCESS") == 1

        # The original wrote first (the copy waits for its rows): its child is the open
        # transaction seen at offset 0 of the slow task's partition.
        first_writers = [(txn, last) for txn, (p, first, last) in seen_open.items()
                         if p == slow and first == 0]
        assert len(first_writers) == 1, seen_open
        [(loser, loser_last_offset)] = first_writers

        # The data: every row exactly once under read_committed; read_uncommitted shows
        # the rows the killed original sent too, all of them the slow task's.
        expected = Counter(job.value_of(i) for i in range(job.TASKS * job.ROWS_PER_TASK))
        assert values(client, topic, "read_committed") == expected
        uncommitted = values(client, topic, "read_uncommitted")
        assert set(uncommitted) == set(expected) and max(uncommitted.values()) == 2
        twice = [v for v, n in uncommitted.items() if n == 2]
        assert twice and all(v.startswith(f"t{slow}-") for v in twice), Counter(
            v.split("-")[0] for v in twice)
        assert len(twice) >= loser_last_offset > 0  # at least what was seen open

        # The partitions: nothing left open; the one aborted transaction is the loser's.
        for p in range(job.TASKS):
            described = client.describe_partition(topic, p)
            assert list(described.open_transactions) == [], (p, described)
            assert described.aborted_transaction_count == (1 if p == slow else 0), (p, described)

    # The coordinator: the loser's child was aborted by its parent's commit, which kept
    # the copy's child and each other task's: one child per attempt that wrote.
    child = txn_json(cluster, "describe", loser)
    assert (child["summary"]["state"], child["summary"]["end_cause"]) == ("ABORTED", "PARENT")
    parent_id = child["summary"]["parent_txn_id"]
    parent = txn_json(cluster, "describe", parent_id)
    assert parent["summary"]["state"] == "COMMITTED"
    assert parent["idempotency_key"].startswith("spark-write:")
    kids = {c["txn_id"]: (c["state"], c["end_cause"]) for c in parent["children"]}
    assert kids.pop(loser) == ("ABORTED", "PARENT")
    assert sorted(kids.values()) == [("COMMITTED", "PARENT")] * job.TASKS, parent["children"]
    # Every transaction seen open on the topic was a child of this parent.
    assert set(seen_open) <= set(kids) | {loser}, (seen_open, parent["children"])

    print(f"\nspeculation: task {slow} attempt 0 on {original['host']} "
          f"({original['status']}: {original['errorMessage']}), speculative attempt 1 on "
          f"{copy['host']} (SUCCESS); the original's child {loser} wrote {len(twice)} rows, "
          f"aborted by parent {parent_id}'s commit, which kept {sorted(kids)}; Spark "
          f"cluster up in {standalone.start_seconds:.1f} s, driver {result['driver_seconds']:.1f}"
          f" s (write {result['write_seconds']:.1f} s), test {time.monotonic() - began:.1f} s")
