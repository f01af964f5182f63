"""Apache Kafka 4.x as a benchmark peer: a throwaway single-node broker and atomlog's
transaction workloads written against it with confluent-kafka (librdkafka).

The broker
----------
`KafkaBroker` is a context manager that runs one KRaft server in combined mode (broker
and controller in one JVM, `-Xmx512m`) in a temporary directory, on two free loopback
ports (clients, controller), and removes everything when it leaves. The jars come from
`scripts/kafka_peer.sh`, which fetches them once from Maven Central into
`${ATOMLOG_CACHE:-$HOME/.cache/atomlog}/kafka-<version>`. Start-up is the usual one:
`kafka.tools.StorageTool format --standalone` with a random cluster id (a single-voter
dynamic quorum, `controller.quorum.bootstrap.servers`), then `kafka.Kafka
server.properties`, then a wait until the broker answers metadata requests.

Durability is made comparable with atomlog, which fsyncs before it acknowledges:
`log.flush.interval.messages=1` makes the broker flush a partition's log after every
append (every produce batch, transaction marker, `__transaction_state` and
`__consumer_offsets` write). The internal topics have replication factor 1 and
min.insync.replicas 1, as one node requires.

Whatever keeps the peer from running (no java or too old a one, no confluent-kafka, the
fetch failing, the broker not coming up in time) raises `PeerUnavailable(reason)`, so a
benchmark can skip the peer and say why.

The workloads (the same as bench/transactions.py)
-------------------------------------------------
`small_transactions(bootstrap, clients=8, seconds=10)`: `clients` processes, each with
its own transactional.id (init_transactions() and 5 warm-up transactions before the timed
window, which starts for all of them at once): begin_transaction(), 10 records of 1 KiB
over 4 partitions of a 16-partition topic (client i writes partitions 4i..4i+3 mod 16, as
atomlog's bench), commit_transaction() (which flushes the sends and waits for the
decision). Returns transactions/s, commit p50/p99 and whole-transaction p50/p99 (ms), and
the records read back with read_committed.

`consume_transform_produce(bootstrap, inputs=20000, batch=100)`: `inputs` 1 KiB records
preloaded into an input topic (untimed, idempotent producer); then one worker process with
a read_committed consumer (subscribe(), enable.auto.commit=false) and a transactional
producer repeats: consume up to `batch` inputs, begin_transaction(), produce one output
per input (its bytes reversed, same partition), send_offsets_to_transaction() with the
consumer's group metadata, commit_transaction() — one transaction per batch until every
input is consumed. The clock starts once the consumer has its assignment (group join is
set-up, not work). Returns inputs/s, batch, send_offsets_to_transaction() and commit
p50/p99 (ms), the outputs read back with read_committed and the inputs whose offsets were
not committed (0 when exactly once).

Both take `server_pid=` (the broker's pid, `KafkaBroker.pid`) to add the broker's CPU
seconds over the timed window. Percentiles interpolate between closest ranks
(bench/common.py, as every atomlog benchmark).

Two things decide Kafka's figures here besides Kafka itself:

- The producers' retry.backoff.ms. commit_transaction() returns before the transaction
  markers are written, so the next transaction's first request to the coordinator is
  often refused with CONCURRENT_TRANSACTIONS and retried after retry.backoff.ms.
  librdkafka's default (100 ms) then dominates every transaction (measured here:
  consume-transform-produce batches ~110 ms with it, ~30 ms with 20 ms). The workloads
  use 20 ms, the backoff Kafka's Java producer applies to that case
  (`retry_backoff_ms=100` restores librdkafka's default).
- JIT warm-up. On two cores the JVM keeps compiling for about a minute of this load
  (measured: small transactions at 57, 127, 163, 183, 168, 178/s in successive 10 s
  windows from a fresh broker); `main()` first runs the workloads untimed (`--warm-up`,
  60 s by default). atomlog, pure Python, has no such phase.

Run alone (fresh broker, warm-up, both workloads, a table):

    .venv/bin/python bench/kafka_peer.py [--seconds 10] [--clients 8] [--inputs 20000]
                                         [--warm-up 60] [--retry-backoff-ms 20]

From another benchmark (bench/ is on sys.path there):

    import kafka_peer
    try:
        with kafka_peer.KafkaBroker() as broker:
            small = kafka_peer.small_transactions(broker.bootstrap, 8, 10)
    except kafka_peer.PeerUnavailable as why:
        print(f"Kafka skipped: {why.reason}")
"""

from __future__ import annotations

import argparse
import base64
import importlib.util
import multiprocessing
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO / "bench") not in sys.path:  # importers normally put it there already
    sys.path.append(str(REPO / "bench"))

import common  # noqa: E402

FETCH_SCRIPT = REPO / "scripts" / "kafka_peer.sh"
DEFAULT_VERSION = "4.4.0"
MIN_JAVA = 17  # Kafka 4.x brokers need Java 17

RECORD = b"x" * 1024
SMALL_PARTITIONS = 16  # as bench/transactions.py: each client writes 4 of them
SMALL_WARM_UP = 5
SMALL_RECORDS = 10

# Limits on every wait (seconds).
FETCH_TIMEOUT_S = 900.0  # Maven fetch, first run only
FORMAT_TIMEOUT_S = 120.0
STARTUP_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0
ADMIN_TIMEOUT_S = 60.0
INIT_TIMEOUT_S = 120.0  # init_transactions(): the first creates __transaction_state
TXN_TIMEOUT_S = 60.0  # begin/send_offsets/commit of one transaction
READY_TIMEOUT_S = 240.0  # client processes started, initialised and warmed up
COUNT_TIMEOUT_S = 300.0  # reading a topic back
PRELOAD_TIMEOUT_S = 300.0
ASSIGN_TIMEOUT_S = 60.0  # the CTP consumer joining its group
POLL_TIMEOUT_S = 10.0  # one CTP consume() that finds nothing ends the run
CTP_TIMEOUT_S = 1800.0  # the whole CTP worker

# The JVM flags Kafka's start scripts use (bin/kafka-run-class.sh).
KAFKA_JVM_OPTIONS = ["-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20",
                     "-XX:InitiatingHeapOccupancyPercent=35", "-XX:+ExplicitGCInvokesConcurrent",
                     "-Djava.awt.headless=true"]

QUIET = {"log_level": 3}  # librdkafka: errors only (not every refused connection)

# commit_transaction() returns once the coordinator has logged PrepareCommit; the markers
# and CompleteCommit follow. A request of the producer's next transaction arriving before
# they are done (AddPartitionsToTxn, AddOffsetsToTxn) is refused with
# CONCURRENT_TRANSACTIONS and retried after retry.backoff.ms: 100 ms in librdkafka by
# default, which then dominates every transaction. Kafka's Java producer retries the
# first AddPartitionsToTxn of a transaction after 20 ms for this reason; the workloads do
# the same (pass retry_backoff_ms=100 for librdkafka's default).
RETRY_BACKOFF_MS = 20


class PeerUnavailable(RuntimeError):
    """The Kafka peer cannot run here; `reason` says why (for a benchmark's skip line)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


# ------------------------------------------------------------------ the broker
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _cluster_id() -> str:
    """A Kafka Uuid as the storage tool wants it: 16 random bytes, URL-safe base64
    without padding, not starting with '-' (Kafka's own generator avoids that too)."""
    while True:
        text = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not text.startswith("-"):
            return text


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _run(command: list[str], timeout_s: float, env: dict[str, str] | None = None,
         ) -> subprocess.CompletedProcess[str]:
    """Run a command in a session of its own; on timeout kill the whole group (the fetch
    script's Maven, say) and raise subprocess.TimeoutExpired."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=env, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate(timeout=10)
        raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def java_major() -> int:
    """The major version of `java` on PATH; PeerUnavailable when there is none."""
    if shutil.which("java") is None:
        raise PeerUnavailable("no java on PATH (Kafka needs a JRE 17+)")
    try:
        banner = _run(["java", "-version"], 30).stderr
    except (OSError, subprocess.TimeoutExpired) as error:
        raise PeerUnavailable(f"java -version failed: {error}") from error
    match = re.search(r'version "(\d+)(?:\.(\d+))?', banner)
    if not match:
        raise PeerUnavailable(f"cannot read the Java version from: {banner.strip()[:200]}")
    major = int(match.group(1))
    return int(match.group(2) or 0) if major == 1 else major  # "1.8" is Java 8


def fetch_classpath(version: str = DEFAULT_VERSION, timeout_s: float = FETCH_TIMEOUT_S) -> Path:
    """The directory of the broker's jars (scripts/kafka_peer.sh: cached after the first
    fetch); PeerUnavailable when it cannot be had."""
    if not FETCH_SCRIPT.exists():
        raise PeerUnavailable(f"{FETCH_SCRIPT} is missing")
    env = dict(os.environ, KAFKA_VERSION=version)
    try:
        result = _run(["bash", str(FETCH_SCRIPT)], timeout_s, env)
    except subprocess.TimeoutExpired as error:
        raise PeerUnavailable(f"fetching the Kafka {version} jars took over {timeout_s:.0f} s"
                              ) from error
    except OSError as error:
        raise PeerUnavailable(f"cannot run {FETCH_SCRIPT.name}: {error}") from error
    if result.returncode != 0:
        lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip()
                 for line in result.stderr.splitlines()]
        errors = [line for line in lines if line.startswith("[ERROR]") and len(line) > 8]
        why = (errors or [line for line in lines if line] or ["no output"])[0]
        raise PeerUnavailable(f"{FETCH_SCRIPT.name} failed ({result.returncode}): {why[:400]}")
    directory = Path(result.stdout.strip().splitlines()[-1])
    if not (directory / f"kafka_2.13-{version}.jar").exists():
        raise PeerUnavailable(f"no kafka_2.13-{version}.jar in {directory}")
    return directory


def directory_size(path: Path) -> int:
    """Bytes of the files under `path` (the jar cache, say)."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


class KafkaBroker:
    """One KRaft combined broker+controller on loopback, in a temporary directory.

    Use as a context manager: entering fetches the jars if needed, formats the storage,
    starts the JVM and waits until the broker serves metadata; leaving stops it (SIGTERM,
    then SIGKILL after `stop_timeout_s`) and deletes the directory. Raises
    PeerUnavailable when any of that fails. Attributes once entered: `bootstrap`
    ("127.0.0.1:<port>"), `pid`, `classpath`, `directory`, and the timings `fetch_s`,
    `format_s`, `startup_s` (JVM start until ready), and after leaving `stop_s`.
    `config` adds or overrides server.properties entries, `jvm_options` adds JVM flags."""

    def __init__(self, *, version: str = DEFAULT_VERSION, heap: str = "512m",
                 config: dict[str, str] | None = None, jvm_options: list[str] | None = None,
                 startup_timeout_s: float = STARTUP_TIMEOUT_S,
                 stop_timeout_s: float = STOP_TIMEOUT_S) -> None:
        self.version = version
        self.heap = heap
        self.extra_config = dict(config or {})
        self.jvm_options = list(jvm_options or [])
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.bootstrap = ""
        self.classpath: Path | None = None
        self.directory: Path | None = None
        self.fetch_s = self.format_s = self.startup_s = self.stop_s = 0.0
        self._process: subprocess.Popen[bytes] | None = None
        self._temp: tempfile.TemporaryDirectory[str] | None = None

    @property
    def pid(self) -> int:
        if self._process is None:
            raise RuntimeError("the broker is not running")
        return self._process.pid

    def __enter__(self) -> KafkaBroker:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- start
    def start(self) -> None:
        if importlib.util.find_spec("confluent_kafka") is None:
            raise PeerUnavailable("the Python package confluent-kafka is not installed "
                                  "(.venv/bin/pip install confluent-kafka)")
        major = java_major()
        if major < MIN_JAVA:
            raise PeerUnavailable(f"Java {major} found; Kafka {self.version} needs {MIN_JAVA}+")
        began = time.perf_counter()
        self.classpath = fetch_classpath(self.version)
        self.fetch_s = time.perf_counter() - began

        self._temp = tempfile.TemporaryDirectory(prefix="atomlog-kafka-peer-")
        self.directory = Path(self._temp.name)
        port, controller_port = _free_port(), _free_port()
        while controller_port == port:
            controller_port = _free_port()
        self.bootstrap = f"127.0.0.1:{port}"
        properties = self.directory / "server.properties"
        properties.write_text(self._server_properties(port, controller_port))
        log4j = self.directory / "log4j2.properties"
        log4j.write_text(self._log4j_properties())
        java = ["java", f"-Xms{self.heap}", f"-Xmx{self.heap}", *KAFKA_JVM_OPTIONS,
                f"-Dlog4j2.configurationFile={log4j}",
                *self.jvm_options, "-cp", f"{self.classpath}/*"]

        began = time.perf_counter()
        try:
            formatted = _run([*java, "kafka.tools.StorageTool", "format", "--config",
                              str(properties), "--cluster-id", _cluster_id(), "--standalone"],
                             FORMAT_TIMEOUT_S)
        except subprocess.TimeoutExpired as error:
            raise PeerUnavailable(f"formatting the storage took over {FORMAT_TIMEOUT_S:.0f} s"
                                  ) from error
        if formatted.returncode != 0:
            raise PeerUnavailable("kafka.tools.StorageTool format failed: "
                                  f"{(formatted.stderr or formatted.stdout).strip()[-500:]}")
        self.format_s = time.perf_counter() - began

        output = self.directory / "broker.out"
        began = time.perf_counter()
        with output.open("wb") as sink:
            self._process = subprocess.Popen(
                [*java, "kafka.Kafka", str(properties)], stdout=sink, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, cwd=self.directory, start_new_session=True)
        self._wait_ready(output)
        self.startup_s = time.perf_counter() - began

    def _server_properties(self, port: int, controller_port: int) -> str:
        assert self.directory is not None
        config = {
            "process.roles": "broker,controller",
            "node.id": "1",
            "controller.quorum.bootstrap.servers": f"127.0.0.1:{controller_port}",
            "listeners": f"PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}",
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{port}",
            "inter.broker.listener.name": "PLAINTEXT",
            "controller.listener.names": "CONTROLLER",
            "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
            "log.dirs": str(self.directory / "data"),
            "num.partitions": "1",
            "auto.create.topics.enable": "false",
            # fsync every append, as atomlog does before it acknowledges
            "log.flush.interval.messages": "1",
            # one node: internal topics with one replica
            "offsets.topic.replication.factor": "1",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "share.coordinator.state.topic.replication.factor": "1",
            "share.coordinator.state.topic.min.isr": "1",
            "min.insync.replicas": "1",
            "group.initial.rebalance.delay.ms": "0",
            **self.extra_config,
        }
        return "".join(f"{key}={value}\n" for key, value in config.items())

    def _log4j_properties(self) -> str:
        assert self.directory is not None
        return "\n".join([
            "status = warn",
            "appender.file.type = File",
            "appender.file.name = FILE",
            f"appender.file.fileName = {self.directory / 'server.log'}",
            "appender.file.layout.type = PatternLayout",
            "appender.file.layout.pattern = [%d] %p %m (%c)%n",
            "rootLogger.level = INFO",
            "rootLogger.appenderRef.file.ref = FILE",
            "",
        ])

    def _wait_ready(self, output: Path) -> None:
        """Until the broker answers a metadata request listing itself (it is registered
        and unfenced), the JVM exits, or startup_timeout_s passes."""
        from confluent_kafka.admin import AdminClient

        assert self._process is not None and self.directory is not None
        deadline = time.monotonic() + self.startup_timeout_s
        host, port = self.bootstrap.split(":")
        admin: AdminClient | None = None
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise PeerUnavailable(
                    f"the Kafka broker exited with {self._process.returncode} while starting:\n"
                    f"{_tail(output)}\n{_tail(self.directory / 'server.log')}")
            if admin is None:
                try:
                    socket.create_connection((host, int(port)), timeout=1).close()
                except OSError:
                    time.sleep(0.1)
                    continue
                admin = AdminClient({"bootstrap.servers": self.bootstrap, **QUIET})
            try:
                metadata = admin.list_topics(timeout=2)
                if 1 in metadata.brokers:
                    return
            except Exception:  # noqa: BLE001 - not ready yet; the deadline bounds it
                pass
            time.sleep(0.1)
        raise PeerUnavailable(f"the Kafka broker was not ready within "
                              f"{self.startup_timeout_s:.0f} s:\n"
                              f"{_tail(self.directory / 'server.log')}")

    # -- stop
    def stop(self) -> None:
        began = time.perf_counter()
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGTERM)
                process.wait(timeout=self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=30)
            except ProcessLookupError:
                pass
        if self._temp is not None:
            self._temp.cleanup()
            self._temp = None
        self.stop_s = time.perf_counter() - began


# ------------------------------------------------------------------ helpers
def create_topics(bootstrap: str, topics: dict[str, int],
                  timeout_s: float = ADMIN_TIMEOUT_S) -> None:
    """Create topics (name -> partitions, one replica) and wait until every partition
    has a leader."""
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap, **QUIET})
    futures = admin.create_topics(
        [NewTopic(name, num_partitions=n, replication_factor=1) for name, n in topics.items()],
        operation_timeout=timeout_s, request_timeout=timeout_s)
    for future in futures.values():
        future.result(timeout=timeout_s)
    deadline = time.monotonic() + timeout_s
    while True:
        metadata = admin.list_topics(timeout=timeout_s)
        led = {name: sum(1 for p in t.partitions.values() if p.leader >= 0 and not p.error)
               for name, t in metadata.topics.items() if name in topics}
        if all(led.get(name) == n for name, n in topics.items()):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"topics {sorted(topics)} have no leaders after {timeout_s} s")
        time.sleep(0.1)


def count_committed(bootstrap: str, topic: str, partitions: int,
                    timeout_s: float = COUNT_TIMEOUT_S) -> int:
    """Records of `topic` a read_committed consumer reads from the start (no group)."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, \
        TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"count-{uuid.uuid4()}",
                         "isolation.level": "read_committed", "enable.auto.commit": False,
                         "enable.partition.eof": True, **QUIET})
    try:
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(partitions)])
        at_end: set[int] = set()
        count = 0
        deadline = time.monotonic() + timeout_s
        while len(at_end) < partitions:
            if time.monotonic() > deadline:
                raise TimeoutError(f"reading {topic} back took over {timeout_s} s")
            for message in consumer.consume(num_messages=10_000, timeout=1.0):
                error, partition = message.error(), message.partition()
                if error is None:
                    count += 1
                    at_end.discard(partition if partition is not None else -1)
                elif error.code() == KafkaError._PARTITION_EOF and partition is not None:
                    at_end.add(partition)
                else:
                    raise KafkaException(error)
        return count
    finally:
        consumer.close()


def _producer_config(retry_backoff_ms: int, extra: dict[str, Any] | None) -> dict[str, Any]:
    return {"retry.backoff.ms": retry_backoff_ms, **(extra or {})}


def _percentiles(prefix: str, seconds: list[float]) -> dict[str, float]:
    return {f"{prefix}_p50_ms": common.percentile(seconds, 0.5) * 1e3,
            f"{prefix}_p99_ms": common.percentile(seconds, 0.99) * 1e3}


def _collect(out: Any, workers: list[Any], tag: str, count: int,
             timeout_s: float) -> list[tuple[Any, ...]]:
    """`count` messages tagged `tag` from worker processes; a worker's ("error", ...)
    or the deadline stops every worker and raises."""
    deadline = time.monotonic() + timeout_s
    got: list[tuple[Any, ...]] = []
    try:
        while len(got) < count:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"waited {timeout_s:.0f} s for the client processes "
                                   f"({len(got)} of {count} {tag})")
            try:
                message = out.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [w for w in workers if w.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"a client process died (exit {dead[0].exitcode})"
                                       ) from None
                continue
            if message[0] == "error":
                raise RuntimeError(f"client process {message[1]}: {message[2]}")
            got.append(message)
    except BaseException:
        for worker in workers:
            if worker.is_alive():
                worker.terminate()
        for worker in workers:
            worker.join(timeout=10)
        raise
    return got


# ------------------------------------------------------------------ small transactions
def _small_client(bootstrap: str, topic: str, transactional_id: str, index: int,
                  seconds: float, producer_config: dict[str, Any], out: Any, start: Any,
                  ) -> None:
    """One client process: init, warm up, report ready, wait for the common start time,
    then transactions until the window closes; puts ("result", index, count, commits,
    totals) or ("error", index, text)."""
    try:
        from confluent_kafka import Producer

        partitions = [(index * 4 + i) % SMALL_PARTITIONS for i in range(4)]
        producer = Producer({"bootstrap.servers": bootstrap, "transactional.id": transactional_id,
                             "linger.ms": 0, "transaction.timeout.ms": 60_000, **QUIET,
                             **producer_config})
        producer.init_transactions(INIT_TIMEOUT_S)

        def transaction() -> tuple[float, float]:
            began = time.perf_counter()
            producer.begin_transaction()
            for i in range(SMALL_RECORDS):
                producer.produce(topic, RECORD, partition=partitions[i % 4])
            committing = time.perf_counter()
            producer.commit_transaction(TXN_TIMEOUT_S)
            ended = time.perf_counter()
            return ended - committing, ended - began

        for _ in range(SMALL_WARM_UP):
            transaction()
        out.put(("ready", index))
        start_at = start.get(timeout=READY_TIMEOUT_S + 60)
        while time.time() < start_at:
            time.sleep(0.001)
        deadline = start_at + seconds
        commits: list[float] = []
        totals: list[float] = []
        while time.time() < deadline:
            commit, total = transaction()
            commits.append(commit)
            totals.append(total)
        out.put(("result", index, len(commits), commits, totals))
    except BaseException as error:  # noqa: BLE001 - reported to the parent
        out.put(("error", index, f"{type(error).__name__}: {error}"))


def small_transactions(bootstrap: str, clients: int = 8, seconds: float = 10.0, *,
                       server_pid: int | None = None, verify: bool = True,
                       retry_backoff_ms: int = RETRY_BACKOFF_MS,
                       producer_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Small transactions against the Kafka at `bootstrap` (see the module docstring).

    Returns {"clients", "seconds", "transactions" (committed in the window), "per_s",
    "commit_p50_ms", "commit_p99_ms", "txn_p50_ms", "txn_p99_ms"}, plus "records_read"
    (read_committed, from the start, warm-ups included; expected
    10 × (transactions + 5 × clients)) when `verify`, and "server_cpu_s" (the broker's
    CPU over the window) when `server_pid` is given."""
    run = uuid.uuid4().hex[:8]
    topic = f"bench-small-txn-{run}"
    create_topics(bootstrap, {topic: SMALL_PARTITIONS})
    context = multiprocessing.get_context("spawn")
    out, start = context.Queue(), context.Queue()
    workers = [context.Process(target=_small_client, daemon=True,
                               args=(bootstrap, topic, f"bench-small-{run}-{i}", i, seconds,
                                     _producer_config(retry_backoff_ms, producer_config),
                                     out, start))
               for i in range(clients)]
    for worker in workers:
        worker.start()
    _collect(out, workers, "ready", clients, READY_TIMEOUT_S)
    start_at = time.time() + 0.5
    for _ in workers:
        start.put(start_at)
    time.sleep(max(0.0, start_at - time.time()))
    cpu_before = common.cpu_seconds(server_pid) if server_pid else 0.0
    results = _collect(out, workers, "result", clients, seconds + TXN_TIMEOUT_S + 60)
    cpu = common.cpu_seconds(server_pid) - cpu_before if server_pid else None
    for worker in workers:
        worker.join(timeout=30)
    count = sum(r[2] for r in results)
    commits = [c for r in results for c in r[3]]
    totals = [t for r in results for t in r[4]]
    result: dict[str, Any] = {"clients": clients, "seconds": seconds, "transactions": count,
                              "per_s": count / seconds, **_percentiles("commit", commits),
                              **_percentiles("txn", totals)}
    if cpu is not None:
        result["server_cpu_s"] = cpu
    if verify:
        result["records_read"] = count_committed(bootstrap, topic, SMALL_PARTITIONS)
    return result


# ------------------------------------------------------------------ consume-transform-produce
def _ctp_worker(bootstrap: str, topic_in: str, topic_out: str, group: str,
                transactional_id: str, inputs: int, batch: int, partitions: int,
                server_pid: int | None, producer_config: dict[str, Any], out: Any) -> None:
    """Preload (untimed), then the loop; puts ("result", dict) or ("error", 0, text)."""
    try:
        out.put(("result", _ctp_loop(bootstrap, topic_in, topic_out, group, transactional_id,
                                     inputs, batch, partitions, server_pid, producer_config)))
    except BaseException as error:  # noqa: BLE001 - reported to the parent
        out.put(("error", 0, f"{type(error).__name__}: {error}"))


def _ctp_loop(bootstrap: str, topic_in: str, topic_out: str, group: str,
              transactional_id: str, inputs: int, batch: int, partitions: int,
              server_pid: int | None, producer_config: dict[str, Any]) -> dict[str, Any]:
    from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition

    payload = os.urandom(1024)  # as atomlog's bench: one random 1 KiB buffer
    loader = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True,
                       "linger.ms": 5, **QUIET})
    for i in range(inputs):
        loader.produce(topic_in, payload, partition=i % partitions)
        loader.poll(0)
    if loader.flush(PRELOAD_TIMEOUT_S) != 0:
        raise TimeoutError(f"preloading {inputs} inputs took over {PRELOAD_TIMEOUT_S} s")

    producer = Producer({"bootstrap.servers": bootstrap, "transactional.id": transactional_id,
                         "linger.ms": 5, "transaction.timeout.ms": 60_000, **QUIET,
                         **producer_config})
    producer.init_transactions(INIT_TIMEOUT_S)
    producer.begin_transaction()  # warm-up: coordinator, connections, AddPartitionsToTxn
    producer.produce(topic_out, b"warm-up", partition=0)
    producer.commit_transaction(TXN_TIMEOUT_S)

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group,
                         "isolation.level": "read_committed", "enable.auto.commit": False,
                         "auto.offset.reset": "earliest", **QUIET})
    assigned: list[bool] = []
    consumer.subscribe([topic_in], on_assign=lambda c, ps: assigned.append(bool(ps)))
    pending: list[Any] = []
    deadline = time.monotonic() + ASSIGN_TIMEOUT_S
    while not (assigned and assigned[-1]) and not pending:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no partition assigned within {ASSIGN_TIMEOUT_S} s")
        pending = consumer.consume(num_messages=batch, timeout=0.1)

    batches: list[float] = []
    offsets: list[float] = []
    commits: list[float] = []
    done = 0
    cpu_before = common.cpu_seconds(server_pid) if server_pid else 0.0
    client_before = time.process_time()
    began = time.perf_counter()
    while done < inputs:
        started = time.perf_counter()
        messages = pending or consumer.consume(num_messages=batch, timeout=POLL_TIMEOUT_S)
        pending = []
        if not messages:
            break  # nothing for POLL_TIMEOUT_S: the input is exhausted (or lost)
        producer.begin_transaction()
        next_offsets: dict[int, int] = {}
        for message in messages:
            value, partition, offset = message.value(), message.partition(), message.offset()
            if message.error() is not None or value is None or partition is None \
                    or offset is None:
                raise KafkaException(message.error())
            producer.produce(topic_out, value[::-1], partition=partition)
            next_offsets[partition] = offset + 1
        sending_offsets = time.perf_counter()
        producer.send_offsets_to_transaction(
            [TopicPartition(topic_in, p, o) for p, o in next_offsets.items()],
            consumer.consumer_group_metadata(), TXN_TIMEOUT_S)
        committing = time.perf_counter()
        producer.commit_transaction(TXN_TIMEOUT_S)
        ended = time.perf_counter()
        batches.append(ended - started)
        offsets.append(committing - sending_offsets)
        commits.append(ended - committing)
        done += len(messages)
    seconds = time.perf_counter() - began
    client_cpu = time.process_time() - client_before
    server_cpu = common.cpu_seconds(server_pid) - cpu_before if server_pid else None
    committed = consumer.committed([TopicPartition(topic_in, p) for p in range(partitions)],
                                   timeout=ADMIN_TIMEOUT_S)
    consumer.close()
    producer.flush(TXN_TIMEOUT_S)
    result: dict[str, Any] = {
        "inputs": done, "seconds": seconds, "per_s": done / seconds if seconds else 0.0,
        "batches": len(batches), "batch": batch, "partitions": partitions,
        **_percentiles("batch", batches), **_percentiles("offsets", offsets),
        **_percentiles("commit", commits), "client_cpu_s": client_cpu,
        "input_left": inputs - sum(max(tp.offset, 0) for tp in committed)}
    if server_cpu is not None:
        result["server_cpu_s"] = server_cpu
    return result


def consume_transform_produce(bootstrap: str, inputs: int = 20_000, batch: int = 100, *,
                              partitions: int = 1, server_pid: int | None = None,
                              verify: bool = True, retry_backoff_ms: int = RETRY_BACKOFF_MS,
                              producer_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Consume-transform-produce against the Kafka at `bootstrap` (see the module
    docstring), on new input and output topics of `partitions` partitions each.

    Returns {"inputs" (processed), "seconds" (first batch to last commit), "per_s"
    (inputs/s), "batches", "batch", "partitions", "batch_p50_ms", "batch_p99_ms",
    "offsets_p50_ms", "offsets_p99_ms" (send_offsets_to_transaction()), "commit_p50_ms",
    "commit_p99_ms" (commit_transaction()), "client_cpu_s" (the worker's CPU), "input_left"
    (inputs whose offsets the group has not committed)}, plus "outputs" (records of the
    output topic read with read_committed, less the warm-up record) when `verify`, and
    "server_cpu_s" when `server_pid` is given."""
    run = uuid.uuid4().hex[:8]
    topic_in, topic_out = f"bench-ctp-in-{run}", f"bench-ctp-out-{run}"
    create_topics(bootstrap, {topic_in: partitions, topic_out: partitions})
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    worker = context.Process(target=_ctp_worker, daemon=True, args=(
        bootstrap, topic_in, topic_out, f"bench-ctp-{run}", f"bench-ctp-{run}", inputs, batch,
        partitions, server_pid, _producer_config(retry_backoff_ms, producer_config), out))
    worker.start()
    result: dict[str, Any] = _collect(out, [worker], "result", 1, CTP_TIMEOUT_S)[0][1]
    worker.join(timeout=30)
    if verify:
        result["outputs"] = count_committed(bootstrap, topic_out, partitions) - 1
    return result


# ------------------------------------------------------------------ run alone
def main() -> None:
    parser = argparse.ArgumentParser(description="Kafka as a peer: small transactions and "
                                                 "consume-transform-produce on a fresh broker")
    parser.add_argument("--version", default=DEFAULT_VERSION, help="Kafka version")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--inputs", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--partitions", type=int, default=1,
                        help="partitions of the CTP input and output topics")
    parser.add_argument("--warm-up", type=float, default=60.0, metavar="SECONDS",
                        help="untimed small transactions (and a short CTP run) first, so the "
                             "JVM has compiled the hot paths (0: measure a cold broker)")
    parser.add_argument("--retry-backoff-ms", type=int, default=RETRY_BACKOFF_MS,
                        help="the producers' retry.backoff.ms (librdkafka's default: 100)")
    args = parser.parse_args()

    import confluent_kafka

    load = os.getloadavg()[0]
    tuning = {"retry_backoff_ms": args.retry_backoff_ms}
    try:
        with KafkaBroker(version=args.version) as broker:
            assert broker.classpath is not None
            jars = len(list(broker.classpath.glob("*.jar")))
            size = directory_size(broker.classpath)
            print(f"broker up at {broker.bootstrap}: jars {broker.fetch_s:.1f} s, format "
                  f"{broker.format_s:.1f} s, JVM start to ready {broker.startup_s:.1f} s",
                  flush=True)
            if args.warm_up > 0:
                warm = small_transactions(broker.bootstrap, args.clients, args.warm_up,
                                          verify=False, **tuning)
                print(f"warm-up, small transactions: {warm['per_s']:.0f}/s", flush=True)
                warm = consume_transform_produce(broker.bootstrap, min(args.inputs, 5_000),
                                                 args.batch, partitions=args.partitions,
                                                 verify=False, **tuning)
                print(f"warm-up, consume-transform-produce: {warm['per_s']:.0f} inputs/s",
                      flush=True)
            small = small_transactions(broker.bootstrap, args.clients, args.seconds,
                                       server_pid=broker.pid, **tuning)
            print(f"small transactions: {small}", flush=True)
            ctp = consume_transform_produce(broker.bootstrap, args.inputs, args.batch,
                                            partitions=args.partitions, server_pid=broker.pid,
                                            **tuning)
            print(f"consume-transform-produce: {ctp}", flush=True)
    except PeerUnavailable as why:
        print(f"Kafka peer unavailable: {why.reason}", file=sys.stderr)
        sys.exit(2)

    expected = SMALL_RECORDS * (small["transactions"] + SMALL_WARM_UP * small["clients"])
    print()
    print(f"Kafka {args.version} (KRaft, one combined broker+controller, -Xmx{broker.heap}, "
          f"log.flush.interval.messages=1), confluent-kafka {confluent_kafka.__version__} "
          f"(librdkafka {confluent_kafka.libversion()[0]}, retry.backoff.ms "
          f"{args.retry_backoff_ms}), {args.warm_up:g} s warm-up; "
          f"{common.machine(load, with_java=True)}")
    print(f"Jar cache {broker.classpath}: {jars} jars, {size / 1e6:.0f} MB. Broker: storage "
          f"format {broker.format_s:.1f} s, JVM start to ready {broker.startup_s:.1f} s, stop "
          f"and clean-up {broker.stop_s:.1f} s. Load average at the end: "
          f"{os.getloadavg()[0]:.1f}.")
    print()
    print("| workload | figure |")
    print("| --- | --- |")
    print(f"| small transactions: {small['clients']} client processes, 10 × 1 KiB over 4 "
          f"partitions, commit, {small['seconds']:g} s | **{small['per_s']:,.0f} "
          f"transactions/s** ({small['transactions']:,} committed; {small['records_read']:,} "
          f"records read back of {expected:,}); commit p50 {small['commit_p50_ms']:.1f} ms, "
          f"p99 {small['commit_p99_ms']:.1f} ms; whole transaction p50 "
          f"{small['txn_p50_ms']:.1f} ms, p99 {small['txn_p99_ms']:.1f} ms; broker "
          f"{small['server_cpu_s'] / small['seconds']:.2f} cores |")
    print(f"| consume-transform-produce: {ctp['inputs']:,} × 1 KiB, {ctp['batch']} per "
          f"transaction, {ctp['partitions']} partition(s) | **{ctp['per_s']:,.0f} inputs/s** "
          f"({ctp['batches']} transactions in {ctp['seconds']:.1f} s; {ctp['outputs']:,} outputs, "
          f"{ctp['input_left']} inputs left); batch p50 {ctp['batch_p50_ms']:.1f} ms, p99 "
          f"{ctp['batch_p99_ms']:.1f} ms; send_offsets p50 {ctp['offsets_p50_ms']:.1f} ms; "
          f"commit p50 {ctp['commit_p50_ms']:.1f} ms, p99 {ctp['commit_p99_ms']:.1f} ms; CPU: "
          f"worker {ctp['client_cpu_s']:.1f} s, broker {ctp['server_cpu_s']:.1f} s |")


if __name__ == "__main__":
    main()
