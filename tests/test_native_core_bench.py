"""bench/native_core/ (Go) and bench/lean_core.py (the same hot path in lean Python), the
measuring prototypes bench/native_core.py drives: they do the durable work they claim, so
their figures mean what docs/benchmarks.md says. The Go one is built with the Go
scripts/go_tools.sh finds or installs (as bench/native_core.py does); each runs on a
free port; one CommitTxn is answered with the batches' offsets once its batches and its
decision are in the files, a retry with the same key is already_ended, and bad input
is refused with nothing written."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from pathlib import Path

import grpc
import pytest

from atomlog.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc, partition_pb2
from coordinator.records import tc_partition_for
from partition_server.record_batch import (ATTR_CONTROL, ATTR_TRANSACTIONAL, Record,
                                           encode_batch, iter_batches)
from tests import go_tools

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def binary(tmp_path_factory) -> Path:
    go = go_tools.go_tools(900)["GO"]
    binary = tmp_path_factory.mktemp("native-core-bin") / "native-core"
    subprocess.run([go, "build", "-o", str(binary), "."], cwd=ROOT / "bench" / "native_core",
                   check=True, timeout=900)
    return binary


@pytest.fixture(scope="module", params=["files", "wal", "lean", "lean-wal", "lean-cores",
                                                "lean-cores-wal"])
def native_core(request, tmp_path_factory):
    """The Go prototype writing each partition's file in the group commit, or (--wal) one
    write-ahead file per group and the partition files later; or the lean Python one,
    either way, or with atomlog's cores and logs (with or without its write-ahead file)."""
    directory = tmp_path_factory.mktemp("native-core-data")
    server = subprocess.Popen(prototype_command(request, request.param, directory),
                              stdout=subprocess.PIPE, text=True)
    try:
        address = server.stdout.readline().split()[0]  # (the lean one's link follows)
        with grpc.insecure_channel(address) as channel:
            yield coordinator_pb2_grpc.CoordinatorServiceStub(channel), directory
    finally:
        server.terminate()
        server.wait(10)


def prototype_command(request, prototype: str, directory: Path) -> list[str]:
    """The command of a prototype by its name: the Go one ("files", or "wal": one
    write-ahead file), built by the `binary` fixture; or the lean Python one ("lean",
    "lean-wal", "lean-cores", "lean-cores-wal"; skipped without io_uring)."""
    if not prototype.startswith("lean"):
        return [str(request.getfixturevalue("binary")), "--dir", str(directory)] + (
            ["--wal"] if prototype == "wal" else [])
    if not io_uring_usable():
        pytest.skip("io_uring is not usable here, and the lean prototype needs it")
    return [sys.executable, str(ROOT / "bench" / "lean_core.py"), "--dir", str(directory)] + {
        "lean-wal": ["--wal"], "lean-cores": ["--cores"],
        "lean-cores-wal": ["--cores", "--wal"]}.get(prototype, [])


def io_uring_usable() -> bool:
    """Whether this machine lets a process use io_uring (bench/lean_core.py needs it)."""
    from partition_server import uring

    ring = uring.Ring.open()
    if ring is None:
        return False
    ring.close()
    return True


def wait_for(predicate, what: str, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def log_file(directory: Path, name: str) -> Path:
    """A partition's file: DIR/NAME.log, or (`--cores`: atomlog's PartitionLog) the first
    segment in DIR/NAME/."""
    segment = directory / name / ("0" * 20 + ".log")
    return segment if (directory / name).is_dir() else directory / f"{name}.log"


def tc_log_file(directory: Path, tc_partition: int) -> Path:
    """A TC partition's file (`--cores`: its __txn_log partition's first segment)."""
    name = f"__txn_log-{tc_partition}"
    return (log_file(directory, name) if (directory / name).is_dir()
            else directory / f"__tc-{tc_partition}.log")


def written(path: Path, count: int) -> list:
    """The headers of the first `count` batches of a partition file, once it has them."""
    def batches() -> list:
        data = path.read_bytes() if path.exists() else b""
        return [h for _, h in iter_batches(memoryview(data), verify=True)]
    wait_for(lambda: len(batches()) >= count, f"{count} batches in {path.name}")
    return batches()[:count]


def commit_request(key: str, *batches: tuple[int, bytes]) -> coordinator_pb2.CommitTxnRequest:
    return coordinator_pb2.CommitTxnRequest(
        tc_partition=tc_partition_for(key, 16), idempotency_key=key,
        batches=[partition_pb2.ProduceItem(
            topic_partition=common_pb2.TopicPartition(topic="t", partition=p), record_batch=b)
            for p, b in batches])


def test_a_commit_is_answered_once_its_batches_and_decision_are_written(native_core):
    stub, directory = native_core
    key = uuid.uuid4().hex
    first = encode_batch([Record(None, b"a"), Record(None, b"b")])
    second = encode_batch([Record(None, b"c")])
    reply = stub.CommitTxn(commit_request(key, (0, first), (1, second)), timeout=30)
    assert [(r.topic_partition.partition, r.base_offset, r.last_offset)
            for r in reply.batch_results] == [(0, 0, 1), (1, 0, 0)]
    assert reply.txn_id.tc_partition == tc_partition_for(key, 16) and not reply.already_ended
    if (directory / "wal.log").exists():  # durable there; the partition files follow
        assert key.encode() in (directory / "wal.log").read_bytes()
    stored = written(log_file(directory, "t-0"), 1)
    # Staged as a partition server stages it: the transaction's id and bit, a new CRC.
    assert [(h.base_offset, h.record_count, h.txn_tc_partition, h.txn_sequence)
            for h in stored][:1] == [(0, 2, reply.txn_id.tc_partition, reply.txn_id.sequence)]
    assert stored[0].attributes & ATTR_TRANSACTIONAL
    tc_log = tc_log_file(directory, reply.txn_id.tc_partition)
    wait_for(lambda: key.encode() in tc_log.read_bytes(), "the decision in its TC log")
    again = stub.CommitTxn(commit_request(key, (0, first), (1, second)), timeout=30)
    assert again.already_ended and again.txn_id == reply.txn_id and not again.batch_results
    # The next transaction's batch follows this one's and its commit marker, a control
    # batch of the transaction (written with the next group, or once the server is idle).
    later = stub.CommitTxn(commit_request(uuid.uuid4().hex, (0, second)), timeout=30)
    assert later.batch_results[0].base_offset == 3
    stored = written(log_file(directory, "t-0"), 3)
    marker = stored[1]
    assert marker.base_offset == 2 and marker.attributes & ATTR_CONTROL
    assert (marker.txn_tc_partition, marker.txn_sequence) == (reply.txn_id.tc_partition,
                                                              reply.txn_id.sequence)


@pytest.mark.parametrize("case", ["wrong-tc-partition", "no-key", "two-for-one-partition",
                                  "corrupt-batch", "transactional"])
def test_bad_commits_are_refused_and_write_nothing(native_core, case):
    stub, directory = native_core
    key = uuid.uuid4().hex
    good = encode_batch([Record(None, b"x")])
    bad = {"wrong-tc-partition": commit_request(key, (5, good)),
           "no-key": commit_request("", (5, good)),
           "two-for-one-partition": commit_request(key, (5, good), (5, good)),
           "corrupt-batch": commit_request(key, (5, good[:-1] + bytes([good[-1] ^ 1]))),
           "transactional": commit_request(key, (5, encode_batch([Record(None, b"x")],
                                                          txn=(1, 2))))}[case]
    if case == "wrong-tc-partition":
        bad.tc_partition = (bad.tc_partition + 1) % 16
    with pytest.raises(grpc.RpcError) as refused:
        stub.CommitTxn(bad, timeout=30)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # Nothing of it anywhere: a commit's key is in its decision (in the write-ahead file
    # at once with --wal, else in its TC partition's file), its batch in t-5's file.
    assert not any(key.encode() in path.read_bytes() for path in directory.rglob("*")
                   if path.is_file())
    t5 = log_file(directory, "t-5")
    assert not t5.exists() or t5.stat().st_size == 0


@pytest.mark.parametrize("prototype", ["lean", "files", "wal"])
def test_a_prototype_takes_the_same_calls_on_its_link(prototype, tmp_path, request):
    """bench/native_core.py's rows "on the link": a CommitTxn as a call frame on the lean
    server's link, or the Go prototype's (link.go), is committed as over gRPC (the same
    offsets, already_ended again), and a bad one is answered with an ItemError frame and
    writes nothing."""
    from services import link_wire

    server = subprocess.Popen(prototype_command(request, prototype, tmp_path),
                              stdout=subprocess.PIPE, text=True)
    try:
        _, link = server.stdout.readline().split()
        host, port = link.rsplit(":", 1)
        sock = link_wire.connect_blocking((host, int(port)), 30)
        number = link_wire.CALL_NUMBERS[("CoordinatorService", "CommitTxn")]

        def call(commit):
            sock.sendall(link_wire.call_frame(number, 30, b"", commit))
            kind, payload = link_wire.read_answer(sock, link_wire.MAX_CALL_BYTES)
            if kind == link_wire.KIND_ERROR:
                return partition_pb2.ItemError.FromString(bytes(payload))
            return coordinator_pb2.CommitTxnResponse.FromString(bytes(payload))

        key = uuid.uuid4().hex
        commit = commit_request(key, (0, encode_batch([Record(None, b"a"), Record(None, b"b")])))
        reply = call(commit)
        assert [(r.base_offset, r.last_offset) for r in reply.batch_results] == [(0, 1)]
        assert call(commit).already_ended
        bad_key = uuid.uuid4().hex
        bad = commit_request(bad_key, (7, encode_batch([Record(None, b"x")])))
        bad.tc_partition = (bad.tc_partition + 1) % 16
        refused = call(bad)
        assert isinstance(refused, partition_pb2.ItemError)
        assert refused.reason == "INVALID_ARGUMENT"
        assert not log_file(tmp_path, "t-7").exists()
        assert not any(bad_key.encode() in path.read_bytes() for path in tmp_path.rglob("*")
                       if path.is_file())
        sock.close()
    finally:
        server.terminate()
        server.wait(10)


def test_the_cores_driven_in_process_commit_durably(tmp_path):
    """`lean_core.py --cores --wal --in-process N` (the cores' CPU a transaction without
    sockets): its groups go through the same commit() as over a connection, so its
    partitions and TC partitions hold the staged batches and the decisions, and the
    write-ahead file every group's frames."""
    if not io_uring_usable():
        pytest.skip("io_uring is not usable here, and the lean prototype needs it")
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "lean_core.py"), "--dir",
                          str(tmp_path), "--cores", "--wal", "--in-process", "5"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert "5 groups of 8" in out and "ms of CPU a transaction" in out
    # 55 groups (50 to warm up): each of 16 partitions gets 2 batches of a group's 8 ...
    stored = [h for name in (f"bench-small-txn-{p}" for p in range(16))
              for _, h in iter_batches(memoryview(log_file(tmp_path, name).read_bytes()),
                                       verify=True)]
    data = [h for h in stored if not h.attributes & ATTR_CONTROL]
    assert len(data) == 55 * 8 * 4 and all(h.attributes & ATTR_TRANSACTIONAL for h in data)
    # ... and the markers of every group but the last (written with the next group).
    assert len(stored) - len(data) == 54 * 8 * 4
    assert (tmp_path / "wal.log").stat().st_size > sum(
        log_file(tmp_path, f"bench-small-txn-{p}").stat().st_size for p in range(16))


def test_the_benchmark_drives_the_combined_server_on_its_link_and_over_grpc():
    """bench/native_core.py's atomlog rows: its clients commit on the combined server's
    own TC partitions (the count its GetMetadata says, 1 since the combined server picks
    it) on the coordinator's link and over gRPC, with nothing refused; a client that
    cannot go on is reported as failed with its reason, not waited out as a stall."""
    sys.path.insert(0, str(ROOT / "bench"))
    import native_core as bench

    with bench.atomlog_server() as (address, link, pid, tc_partitions):
        assert tc_partitions == 1
        for transport, target in (("link", link), ("grpc", address)):
            result = bench.drive(target, pid, 1, 1.0, transport, tc_partitions)
            assert isinstance(result, dict), result
            assert result["count"] > 0 and result["refusals"] == 0, result
        # Clients that pick TC partitions the server does not have fail at their first
        # call, and drive() says why at once.
        began = time.monotonic()
        failed = bench.drive(link, pid, 1, 1.0, "link", 16)
        assert isinstance(failed, bench.Failed), failed
        assert "outside 0..0" in failed and time.monotonic() - began < 60, failed
