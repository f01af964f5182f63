"""A TC partition's snapshot on a server whose batches are small (`partition.max_batch_bytes`
below the snapshot's 512 KiB chunks): the chunk refused as too large, the snapshot is
written again in chunks under the limit the refusal names, and a new owner loads from it.

(Before, every snapshot of a TC partition larger than the limit was refused, again at
each interval, and its log was never trimmed: the chaos harness, which runs with 256 KiB
batches, logged 1,500-2,900 refusals a run. docs/verification.md, 2026-12-07.)"""

from __future__ import annotations

import json
import os
import signal
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from atomlog.v1 import coordinator_pb2 as S
from atomlog.v1 import coordinator_pb2_grpc, partition_pb2

from coordinator.txn_log import SNAPSHOT_BATCH_OVERHEAD
from tests.conftest import CLUSTER_SETTINGS, metric_sum, wait_until
from tests.test_one_call import failpoint_cluster

MAX_BATCH_BYTES = 8 << 10
SNAPSHOT_EVERY = 100
K = 0  # the combined server's one TC partition here
COMMIT = partition_pb2.TXN_DECISION_COMMIT


SETTINGS = ("--set", f"partition.max_batch_bytes={MAX_BATCH_BYTES}",
            "--set", f"coordinator.snapshot_every_records={SNAPSHOT_EVERY}")


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    yield from failpoint_cluster(tmp_path_factory.mktemp("atomlog-snapshot-chunks"),
                                 tmp_path_factory.mktemp("failpoints"), *SETTINGS,
                                 combined=True)


def _stub(node) -> coordinator_pb2_grpc.CoordinatorServiceStub:
    address = node.process("node-0")["grpc_address"]
    return coordinator_pb2_grpc.CoordinatorServiceStub(grpc.insecure_channel(address))


def _log_events(node, message: str) -> list[dict]:
    with open(node.process("node-0")["log_file"]) as handle:
        return [json.loads(line) for line in handle if f'"{message}"' in line]


def test_a_snapshot_over_the_batch_limit_goes_in_smaller_chunks_and_loads(node):
    stub = _stub(node)
    # Long keys (kept for each finished transaction): the table's snapshot passes the
    # batch limit several times over.
    keys = [f"chunks-{j:06d}-" + "k" * 180 for j in range(3 * SNAPSHOT_EVERY)]

    def one(key: str):
        txn = stub.NewTxn(S.NewTxnRequest(tc_partition=K, idempotency_key=key),
                          timeout=10).txn_id
        stub.EndTxn(S.EndTxnRequest(txn_id=txn, decision=COMMIT), timeout=10)
        return txn

    txns = [wait_until_answered(lambda: one(keys[0]))]  # (the TC partition loaded)
    with ThreadPoolExecutor(8) as pool:
        txns += list(pool.map(one, keys[1:]))
    metrics = node.process("node-0")["metrics_address"]
    wait_until(lambda: metric_sum(metrics, "atomlog_coordinator_snapshots_total") > 0, 20,
               "a TC snapshot")
    [smaller, *_] = [e for e in _log_events(node, "snapshot chunks made smaller")
                     if e.get("tc_partition") == K]
    assert smaller["chunk_bytes"] == MAX_BATCH_BYTES - SNAPSHOT_BATCH_OVERHEAD
    assert not [e for e in _log_events(node, "snapshot append refused")
                if e.get("tc_partition") == K]
    # Every transaction completed (its Completed record durable: it may linger for
    # company a moment after its markers), so that the load finds each one finished.
    wait_until(lambda: all(stub.GetTxnStatus(S.GetTxnStatusRequest(txn_id=txn), timeout=5)
                           .state == S.TXN_STATE_COMMITTED for txn in reversed(txns)), 20,
               "the last transactions to complete")
    # A restart loads the TC partition from the snapshot, every transaction as decided.
    os.kill(node.process("node-0")["pid"], signal.SIGKILL)
    node.run("up", "--output", "json", "--combined", *CLUSTER_SETTINGS, *SETTINGS)

    def loaded() -> list[dict]:
        return [e for e in _log_events(node, "TC partition loaded")
                if e.get("tc_partition") == K and e.get("snapshot")]
    wait_until(lambda: loaded(), 30, "the TC partition loaded from its snapshot")
    assert loaded()[-1]["finished"] >= len(txns)
    stub = _stub(node)
    for txn in txns[:3] + txns[-3:]:
        status = wait_until_answered(lambda: stub.GetTxnStatus(
            S.GetTxnStatusRequest(txn_id=txn), timeout=5))
        assert status.state == S.TXN_STATE_COMMITTED


def wait_until_answered(call):
    answer = []

    def answered() -> bool:
        try:
            answer.append(call())
            return True
        except grpc.RpcError:
            return False
    wait_until(answered, 30, "an answer")
    return answer[-1]
