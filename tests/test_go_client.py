"""The Go client (clients/go), a second client written from the protos and docs/, against
the suite's real cluster.

Set-up, done by the module's fixtures exactly as on a fresh machine: scripts/go_tools.sh
finds Go (or fetches the pinned toolchain from the Go module proxy) and builds the pinned
protoc-gen-go, protoc-gen-go-grpc and grpcurl into ~/.cache/atomlog; `go build` of
clients/go/cmd/atomlog-go downloads the client's modules (go.sum is checked in).

What is checked: the checked-in generated code equals what `buf generate` makes from
protos/ now; `go vet`, gofmt and the Go tests (unit tests, and cluster tests run with
ATOMLOG_BOOTSTRAP: ordering and de-duplication of the idempotent producer, routing
refresh on NOT_PARTITION_OWNER, typed errors, transactions, subscriptions, one-call
transactions, session fencing); both record formats read across languages; a Go
transaction read exactly by the Python consumer and the reverse; aborted Go
transactions never visible; a fenced Go producer unable to commit; and a Go
consume-transform-produce loop that ends exactly once across a kill -9 of a partition
server. The examples of docs/clients.md run in tests/test_go_client_docs.py.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import crc32c
import pytest

from partition_server.record_batch import Compression, Record, decode_records, encode_batch
from partition_server.record_columns import encode_records
from spark_client import Client, errors
from tests.conftest import REPO_ROOT, wait_until
from tests.go_tools import GO_DIR, build_cli, go_tools

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(1200)]  # a cold Go build takes minutes

SETUP_TIMEOUT_S = 1200


class GoTools:
    """What scripts/go_tools.sh found or installed, and the atomlog-go binary."""

    def __init__(self, tmp: Path):
        found = go_tools(SETUP_TIMEOUT_S)
        self.go = found["GO"]
        self.tools_bin = Path(found["GO_TOOLS_BIN"])
        self.env = {**os.environ, "PATH": f"{Path(self.go).parent}:{self.tools_bin}:{os.environ['PATH']}"}
        self.cli = build_cli(self.go, tmp / "atomlog-go", SETUP_TIMEOUT_S, self.env)

    def run_go(self, *args: str, timeout: float = 600, env: dict | None = None) -> str:
        result = subprocess.run([self.go, *args], cwd=GO_DIR, capture_output=True, text=True,
                                timeout=timeout, env=env or self.env)
        assert result.returncode == 0, f"go {' '.join(args)}:\n{result.stdout}\n{result.stderr}"
        return result.stdout

    def cli_json(self, bootstrap: str, *args: str, timeout: float = 120) -> dict:
        result = subprocess.run([str(self.cli), "-bootstrap", bootstrap, *args], capture_output=True,
                                text=True, timeout=timeout)
        assert result.returncode == 0, f"atomlog-go {' '.join(args)}:\n{result.stdout}\n{result.stderr}"
        return json.loads(result.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def go(tmp_path_factory) -> GoTools:
    return GoTools(tmp_path_factory.mktemp("go"))


def new_topic(client: Client, prefix: str, partitions: int) -> str:
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    client.create_topic(name, partitions=partitions)
    with client.consumer(name) as consumer:
        wait_until(lambda: _serves(consumer), 30, f"{name} to serve")
    return name


def _serves(consumer) -> bool:
    try:
        consumer.end_offsets()
        return True
    except errors.AtomlogClientError:
        return False


def python_read(client: Client, topic: str, expected: int, isolation: str = "read_committed",
                timeout_s: float = 30) -> list:
    """Every message of `topic` from the start: until `expected` came, then a quiet second
    more (so a duplicate would show)."""
    messages: list = []
    with client.consumer(topic, isolation=isolation) as consumer:
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


# ------------------------------------------------------------------- code and unit tests

def test_generated_go_code_is_in_sync_with_protos_and_docs(go, tmp_path):
    result = subprocess.run(["bash", str(REPO_ROOT / "scripts" / "go_tools.sh"), "generate",
                             str(tmp_path)], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=300, env=go.env)
    assert result.returncode == 0, result.stdout + result.stderr
    expected = {p.relative_to(tmp_path): p.read_bytes()
                for p in sorted((tmp_path / "gen").rglob("*")) if p.is_file()}
    checked_in = {p.relative_to(GO_DIR): p.read_bytes()
                  for p in sorted((GO_DIR / "gen").rglob("*")) if p.is_file()}
    protos = sorted((REPO_ROOT / "protos" / "atomlog" / "v1").glob("*.proto"))
    assert protos and all(Path("gen/atomlog/v1", f"{p.stem}.pb.go") in expected for p in protos)
    stale = sorted(str(path) for path in expected.keys() | checked_in.keys()
                   if expected.get(path) != checked_in.get(path))
    assert not stale, (f"clients/go/gen is not what buf generate makes from protos/ now: {stale}; "
                       "run `bash scripts/go_tools.sh generate`")
    reasons = "atomlog/reasons_gen.go"
    assert (tmp_path / reasons).read_bytes() == (GO_DIR / reasons).read_bytes(), (
        "clients/go/atomlog/reasons_gen.go differs from docs/errors.md; run "
        "`bash scripts/go_tools.sh generate`")


def test_go_vet_gofmt_and_go_tests_against_the_cluster(go, cluster):
    go.run_go("vet", "./...")
    unformatted = subprocess.run([str(Path(go.go).parent / "gofmt"), "-l", "."], cwd=GO_DIR,
                                 capture_output=True, text=True, timeout=60)
    assert unformatted.returncode == 0 and not unformatted.stdout.strip(), unformatted.stdout
    output = go.run_go("test", "-count=1", "-v", "./...",
                       env={**go.env, "ATOMLOG_BOOTSTRAP": cluster.info["bootstrap"]})
    assert "--- SKIP" not in output, output
    passed = {line.split()[2] for line in output.splitlines() if line.startswith("--- PASS")}
    assert {"TestClusterIdempotentProducerKeepsOrder", "TestClusterRoutingRefreshOnNotPartitionOwner",
            "TestClusterTransactions", "TestClusterSubscription", "TestClusterOneCallTransactions",
            "TestClusterSessionFencing", "TestReasonsMatchDocs", "TestBatchesRoundTrip",
            "TestProducerRetriesLostAnswersWithoutDuplicates", "TestProducerResequencesAfterARefusedBatch",
            "TestProducerTakesAFreshIDWhenLaterBatchesWereSent", "TestClusterCommitsOnTheCoordinatorsLinks",
            "TestLinkCallFramesAndAnswers", "TestLinkUnreachableFallsBackToGRPCForAWhile",
            "TestLinkDropsAKeptConnectionTheServerClosed", "TestClusterDeleteRecords"} <= passed, output


# ------------------------------------------------------------------- record formats

RECORDS = [
    Record(b"k1", b"hello", (("trace", b"\x00\x01"), ("\u00e9", b"")), 1_700_000_000_000),
    Record(None, None, (), 1_700_000_000_007),
    Record(b"", b"v" * 5000, (), 1_699_999_999_990),
]


def _as_json(records) -> list[dict]:
    def b64(b):
        return None if b is None else base64.b64encode(b).decode()
    return [{"key": b64(r.key), "value": b64(r.value), "timestamp_ms": r.timestamp_ms,
             "headers": [[k, b64(v)] for k, v in r.headers]} for r in records]


def test_python_and_go_read_each_others_batches_in_both_formats(go, tmp_path):
    # Python writes: rows (magic 1, as old data and markers are) and columns (magic 2),
    # each uncompressed, zstd and LZ4; Go reads them all.
    batches = []
    for compression in Compression:
        batches.append(encode_batch(RECORDS, compression=compression, producer_id=7,
                                    base_sequence=3, producer_epoch=1))
        batches.append(encode_records(RECORDS, compression=compression, producer_id=7,
                                      base_sequence=3, producer_epoch=1))
    path = tmp_path / "python.bin"
    path.write_bytes(b"".join(batches))
    result = subprocess.run([str(go.cli), "decode", str(path)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    decoded = json.loads(result.stdout)["batches"]
    assert [(b["magic"], b["compression"]) for b in decoded] == [
        (magic, int(c)) for c in Compression for magic in (1, 2)]
    for batch in decoded:
        assert batch["records"] == _as_json(RECORDS) and batch["producer_id"] == 7
    # Go writes columns (what its producers send) and rows; Python reads them, with
    # pyarrow's full validation for the columnar block.
    for rows in (False, True):
        for compression in Compression:
            args = [str(go.cli), "encode", "-compression", compression.name.lower()]
            result = subprocess.run(args + (["-rows"] if rows else []),
                                    input=json.dumps(_as_json(RECORDS)).encode(),
                                    capture_output=True, timeout=60)
            assert result.returncode == 0, result.stderr
            batch = result.stdout
            assert batch[12] == (1 if rows else 2) and batch[25:27] == bytes([0, int(compression)])
            got = [r._replace(offset=None) for r in decode_records(batch)]
            assert got == RECORDS, (rows, compression)
    # Damage is refused by Go's reader, not misread.
    damaged = bytearray(batches[1])
    damaged[200] ^= 1
    path.write_bytes(bytes(damaged))
    result = subprocess.run([str(go.cli), "decode", str(path)], capture_output=True, text=True,
                            timeout=60)
    assert json.loads(result.stdout)["error"] == "CRC_MISMATCH", result.stdout


# ------------------------------------------------------------------- across languages

def test_a_go_transaction_is_read_exactly_by_the_python_consumer(go, cluster):
    client = Client(cluster.info["bootstrap"])
    try:
        topic = new_topic(client, "go-to-py", 3)
        streaming = go.cli_json(cluster.info["bootstrap"], "txn", "-topic", topic, "-count", "300",
                                "-prefix", "streaming")
        one_call = go.cli_json(cluster.info["bootstrap"], "txn", "-topic", topic, "-count", "30",
                               "-prefix", "one-call", "-one-call")
        assert streaming["outcome"] == one_call["outcome"] == "committed"
        expected = streaming["values"] + one_call["values"]
        messages = python_read(client, topic, len(expected))
        assert Counter(m.value.decode() for m in messages) == Counter(expected)
        # Send order kept per partition (values count up within each).
        for partition in range(3):
            mine = [m.value.decode() for m in sorted(messages, key=lambda m: m.offset)
                    if m.partition == partition and m.value.startswith(b"streaming")]
            assert mine == sorted(mine) and len(mine) == 100
    finally:
        client.close()


def test_a_python_transaction_is_read_exactly_by_the_go_consumer(go, cluster):
    bootstrap = cluster.info["bootstrap"]
    streaming_client = Client(bootstrap, one_call_max_bytes=0)  # NewTxn, Produce, EndTxn
    one_call_client = Client(bootstrap)  # small transactions: one CommitTxn
    try:
        topic = new_topic(streaming_client, "py-to-go", 3)
        expected = []
        for client, name in ((streaming_client, "streaming"), (one_call_client, "one-call")):
            with client.producer() as producer, client.transaction() as txn:
                for i in range(200):
                    value = f"py-{name}-{i:04d}"
                    producer.send(topic, value.encode(), key=str(i).encode(),
                                  headers={"n": str(i)}, txn=txn)
                    expected.append(value)
        with streaming_client.producer() as producer:  # an aborted one as well
            txn = streaming_client.begin_transaction()
            for i in range(50):
                producer.send(topic, f"py-aborted-{i}".encode(), txn=txn)
            producer.flush()
            txn.abort()
        read = go.cli_json(bootstrap, "read", "-topic", topic, "-expect", str(len(expected)))
        assert Counter(m["value"] for m in read["messages"]) == Counter(expected)
        # Keys went to CRC32C(key) % partitions in both languages' partitioners.
        for m in read["messages"]:
            assert m["partition"] == crc32c.crc32c(base64.b64decode(m["key"])) % 3
    finally:
        streaming_client.close()
        one_call_client.close()


def test_an_aborted_go_transaction_is_never_visible(go, cluster):
    bootstrap = cluster.info["bootstrap"]
    client = Client(bootstrap)
    try:
        topic = new_topic(client, "go-abort", 2)
        aborted = go.cli_json(bootstrap, "txn", "-topic", topic, "-count", "100", "-prefix",
                              "aborted", "-abort")
        go.cli_json(bootstrap, "txn", "-topic", topic, "-count", "10", "-prefix", "aborted-one-call",
                    "-abort", "-one-call")
        committed = go.cli_json(bootstrap, "txn", "-topic", topic, "-count", "40", "-prefix",
                                "committed")
        assert aborted["outcome"] == "aborted"
        # The aborted records were written (a read_uncommitted reader sees them) ...
        everything = python_read(client, topic, 140, isolation="read_uncommitted")
        assert sum(m.value.startswith(b"aborted-") for m in everything) == 100
        # ... and no read_committed reader, Python or Go, ever does.
        visible = [m.value.decode() for m in python_read(client, topic, 40)]
        assert Counter(visible) == Counter(committed["values"])
        read = go.cli_json(bootstrap, "read", "-topic", topic, "-expect", "40")
        assert Counter(m["value"] for m in read["messages"]) == Counter(committed["values"])
        uncommitted = go.cli_json(bootstrap, "read", "-topic", topic, "-expect", "140",
                                  "-isolation", "read_uncommitted")
        assert len(uncommitted["messages"]) == 140
    finally:
        client.close()


def test_a_fenced_go_producer_cannot_commit(go, cluster):
    bootstrap = cluster.info["bootstrap"]
    client = Client(bootstrap)
    transactional_id = f"go-fenced-{uuid.uuid4().hex[:8]}"
    process = None
    try:
        topic = new_topic(client, "go-fenced", 1)
        process = subprocess.Popen([str(go.cli), "-bootstrap", bootstrap, "fenced", "-topic", topic,
                                    "-id", transactional_id], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        written = json.loads(process.stdout.readline())
        assert written["step"] == "written", process.stderr.read()
        # A Python producer with the same transactional id fences the Go one (and aborts
        # its open transaction), then commits its own.
        with client.producer(transactional_id=transactional_id) as producer:
            assert producer.producer_id == written["producer_id"]
            assert producer.epoch == written["epoch"] + 1
            process.stdin.write("commit\n")
            process.stdin.flush()
            report = json.loads(process.stdout.readline())
            txn = producer.begin_transaction()
            producer.send(topic, b"from-the-new-session", partition=0, txn=txn)
            txn.commit()
        assert process.wait(timeout=30) == 0
        assert report["commit"] == {"reason": "PRODUCER_FENCED", "retriable": False,
                                    "abortable": False, "fenced": True}, report
        assert report["begin"]["reason"] == "PRODUCER_FENCED", report
        visible = python_read(client, topic, 1)
        assert [m.value for m in visible] == [b"from-the-new-session"]
        assert len(python_read(client, topic, 2, isolation="read_uncommitted")) == 2
    finally:
        if process is not None and process.poll() is None:
            process.kill()
        client.close()


# ------------------------------------------------------------------- kill -9

def test_a_go_producer_loses_and_duplicates_nothing_across_kill_9(go, cluster):
    """Retries that keep order: a Go producer sends keyed records while the owner of a
    partition is killed and restarted; every acknowledged record is there exactly once,
    at its offset, in send order per partition."""
    bootstrap = cluster.info["bootstrap"]
    client = Client(bootstrap)
    producer = None
    try:
        topic = new_topic(client, "go-crash", 3)
        victim = client.metadata.route(topic, 0).server_name
        producer = subprocess.Popen([str(go.cli), "-bootstrap", bootstrap, "produce", "-topic", topic,
                                     "-count", "4000", "-rate", "1000"],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(1.5)
        os.kill(cluster.process(victim)["pid"], signal.SIGKILL)
        time.sleep(0.3)
        assert victim in cluster.up()["started"]
        out, err = producer.communicate(timeout=180)
        assert producer.returncode == 0, err[-3000:]
        report = json.loads(out)
        assert not report["failed"] and len(report["acked"]) == 4000, report["failed"]
        # The kill was felt: batches to the dead owner failed and were sent again.
        assert set(report["retries"]) - {"OUT_OF_ORDER_SEQUENCE", "UNKNOWN_PRODUCER_ID"}, report["retries"]
        messages = python_read(client, topic, 4000)
        at = {(m.partition, m.offset): m.value.decode() for m in messages}
        assert len(messages) == len(at) == 4000, "a record was read twice or is missing"
        assert len(set(at.values())) == 4000, "a record was written twice"
        for value, partition, offset in report["acked"]:
            assert at[(partition, offset)] == value
        for partition in range(3):
            in_offset_order = [v for (p, _), v in sorted(at.items()) if p == partition]
            assert in_offset_order == sorted(in_offset_order), f"send order lost in {partition}"
        print(f"Go producer across kill -9 of {victim}: {report['seconds']:.1f} s, "
              f"retries {report['retries']}")
    finally:
        if producer is not None and producer.poll() is None:
            producer.kill()
        cluster.up()
        client.close()


# ------------------------------------------------------------------- exactly once across kill -9

CTP_INPUTS = 3000
CTP_PARTITIONS = 6


def _transform(value: bytes) -> bytes:
    return b"out:" + value[::-1]


def test_a_go_consume_transform_produce_loop_is_exactly_once_across_kill_9(go, cluster):
    bootstrap = cluster.info["bootstrap"]
    client = Client(bootstrap)
    loop = None
    lines: list[dict] = []
    try:
        source = new_topic(client, "go-ctp-in", CTP_PARTITIONS)
        sink = new_topic(client, "go-ctp-out", CTP_PARTITIONS)
        inputs = [f"input-{i:05d}".encode() for i in range(CTP_INPUTS)]
        with client.producer() as producer:
            futures = [producer.send(source, value, key=value, partition=i % CTP_PARTITIONS)
                       for i, value in enumerate(inputs)]
            producer.flush()
        for future in futures:
            future.result(0)
        owned = Counter(route.server_name for topic in (source, sink)
                        for route in client.metadata.partitions(topic))
        victim = owned.most_common(1)[0][0]

        loop = subprocess.Popen([str(go.cli), "-bootstrap", bootstrap, "ctp", "-in", source,
                                 "-out", sink, "-subscription", "go-ctp", "-batch", "20",
                                 "-deadline", "90s"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        reader = threading.Thread(target=lambda: lines.extend(json.loads(line) for line in loop.stdout),
                                  daemon=True)
        reader.start()

        def committed() -> int:
            assert loop.poll() is None or (lines and lines[-1].get("done")), (
                f"the loop exited early: {lines[-2:]} {loop.stderr.read()[-2000:]}")
            return lines[-1].get("committed", 0) if lines else 0

        wait_until(lambda: committed() >= CTP_INPUTS // 5, 60, "a fifth of the inputs")
        at_kill = committed()
        os.kill(cluster.process(victim)["pid"], signal.SIGKILL)
        time.sleep(0.5)
        assert victim in cluster.up()["started"]
        assert loop.wait(timeout=120) == 0, f"{lines[-3:]}\n{loop.stderr.read()[-3000:]}"
        reader.join(timeout=10)
        final = lines[-1]
        assert final["done"] and 0 < at_kill < CTP_INPUTS, (at_kill, final)

        outputs = python_read(client, sink, CTP_INPUTS)
        produced = Counter(m.value for m in outputs)
        expected = Counter(_transform(value) for value in inputs)
        missing = expected - produced
        duplicated = {value: n for value, n in produced.items() if n > 1}
        unexpected = set(produced) - set(expected)
        assert not missing and not duplicated and not unexpected, (
            f"{len(missing)} missing (e.g. {list(missing)[:3]}), {len(duplicated)} duplicated "
            f"(e.g. {list(duplicated.items())[:3]}), {len(unexpected)} unexpected; loop: {final}")
        with client.consumer(source, subscription="go-ctp") as observer:
            cursors = observer.describe()
        assert sorted(c.cumulative_end_offset for c in cursors) == [CTP_INPUTS // CTP_PARTITIONS] * 6
        assert not [c for c in cursors if c.pending_acks or c.individual_ranges]
        print(f"Go loop exactly once; kill -9 of {victim} at {at_kill} committed inputs; {final}")
    finally:
        if loop is not None and loop.poll() is None:
            loop.kill()
        cluster.up()
        client.close()
