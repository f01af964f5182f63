"""In-process dispatch (services/local.py): a LocalStub answers as a gRPC stub would,
errors included, so callers cannot tell the paths apart; and the combined server makes
its server-to-server calls that way (checked on the real combined server)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
import urllib.request
import uuid
from collections import Counter

import grpc
import pytest
from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError

from atomlog.v1 import common_pb2, partition_pb2, partition_pb2_grpc
from services import launcher, local
from services.config import (COMBINED_TC_PARTITIONS, DEFAULT_TC_PARTITIONS,
                             tc_partitions_created_by)
from services.errors import AtomlogError, from_rpc_error
from spark_client import Client
from tests.conftest import wait_until


class Servicer:
    """A servicer in the shape grpc.aio calls them: async (request, context)."""

    async def Answer(self, request, context):
        return partition_pb2.ListPartitionsResponse()

    async def Refuse(self, request, context):
        raise AtomlogError("NOT_PARTITION_OWNER", "owned elsewhere", {"owner_address": "x:1"})

    async def Slow(self, request, context):
        await asyncio.sleep(5)

    async def Broken(self, request, context):
        raise KeyError("a bug")


SERVICE = "atomlog.v1.PartitionService"


def call(method: str, timeout: float | None = 2.0):
    stub = local.LocalStub(Servicer(), SERVICE)
    return asyncio.run(getattr(stub, method)(partition_pb2.ListPartitionsRequest(),
                                             timeout=timeout))


def test_a_local_call_returns_the_reply():
    assert isinstance(call("Answer"), partition_pb2.ListPartitionsResponse)


def test_an_error_crosses_as_the_same_status_and_error_info():
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        call("Refuse")
    decoded = from_rpc_error(raised.value)
    assert (decoded.reason, decoded.message, decoded.metadata) == \
        ("NOT_PARTITION_OWNER", "owned elsewhere", {"owner_address": "x:1"})
    assert raised.value.code() == AtomlogError("NOT_PARTITION_OWNER", "").code


def test_a_timeout_cancels_the_work_and_is_deadline_exceeded():
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        call("Slow", timeout=0.05)
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert from_rpc_error(raised.value).reason == "REQUEST_TIMED_OUT"


def test_a_bug_is_internal_with_a_reason():
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        call("Broken")
    assert from_rpc_error(raised.value).reason == "INTERNAL"


def test_only_the_registered_address_is_local():
    channels = []
    local.register("127.0.0.1:1", SERVICE, Servicer())
    try:
        here = local.stub("127.0.0.1:1", SERVICE, partition_pb2_grpc.PartitionServiceStub,
                          channels.append)
        elsewhere = local.stub("127.0.0.1:2", SERVICE,
                               lambda channel: ("grpc stub", channel), lambda a: f"channel {a}")
    finally:
        local.unregister("127.0.0.1:1")
    assert isinstance(here, local.LocalStub) and not channels
    assert elsewhere == ("grpc stub", "channel 127.0.0.1:2")
    assert local.servicer("127.0.0.1:1", SERVICE) is None


def metric_samples(address: str, name: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    samples = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line.rsplit(" ", 1)
            samples[labels[len(name):]] = float(value)
    return samples


@pytest.mark.cluster
def test_the_combined_server_is_every_role_and_calls_itself_in_process(combined):
    node = next(p for p in combined.info["processes"] if p["role"] == "combined")
    zookeeper = combined.zookeeper()
    try:
        registered = {name: json.loads(zookeeper.get(f"/servers/{name}")[0])
                      for name in zookeeper.get_children("/servers")}
    finally:
        zookeeper.stop()
    assert {name: entry["role"] for name, entry in registered.items()} == {
        "node-0": "partition_server", "node-0-coordinator": "coordinator",
        "node-0-id-allocator": "id_allocator"}
    assert {entry["grpc_address"] for entry in registered.values()} == {node["grpc_address"]}
    # `up` returns once the server serves; its lease manager takes the TC partitions'
    # leases from then on (a CI run found 15 of 16 at the first look). A combined server
    # creates its cluster with COMBINED_TC_PARTITIONS of them (cluster.tc_partitions unset).
    assert "cluster.tc_partitions" not in json.loads(
        (combined.data_dir / "cluster.json").read_text())["settings"]
    deadline = time.monotonic() + 30
    while True:
        status = next(p for p in combined.status()["processes"] if p["role"] == "combined")
        if len(status["tc_partitions"]) == COMBINED_TC_PARTITIONS \
                or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert status["tc_partitions"] == list(range(COMBINED_TC_PARTITIONS))
    # One-call transactions (StageTxn), then streaming ones (VerifyTxnPartitions).
    for one_call_max_bytes in (1 << 20, 0):
        with Client(combined.info["bootstrap"], one_call_max_bytes=one_call_max_bytes) as client:
            try:
                client.create_topic("combined-local", partitions=2)
            except Exception:  # noqa: BLE001 — made already
                pass
            with client.producer() as producer:
                for round_ in range(3 if one_call_max_bytes == 0 else 40):
                    with client.transaction(timeout_s=30) as txn:
                        for partition in range(2):
                            producer.send("combined-local", b"%d" % round_, partition=partition,
                                          txn=txn)
    local_calls = metric_samples(node["metrics_address"], "atomlog_local_calls_total")
    over_grpc = metric_samples(node["metrics_address"], "atomlog_rpc_handled_total")
    for method in ("StageTxn", "VerifyTxnPartitions", "EndTxnOnPartition"):
        assert any(method in labels and value > 0 for labels, value in local_calls.items()), \
            (method, local_calls)
        assert not any(method in labels for labels in over_grpc), (method, over_grpc)
    # Once a TC partition's sequence reservation is logged, its one-call commits go
    # through the commit lane (coordinator/lane.py): no StageTxn, decided there.
    lane = metric_samples(node["metrics_address"], "atomlog_coordinator_lane_commits_total")
    assert lane.get('{result="decided"}', 0) >= 1, lane
    # The TC logs' appends are queued on their partitions' owners, not sent as calls.
    log_produces = metric_samples(node["metrics_address"],
                                  "atomlog_coordinator_log_produces_total")
    assert log_produces.get('{path="owner"}', 0) >= 6, log_produces
    assert log_produces.get('{path="call"}', 0) == 0, log_produces


class _OneOwner:
    """A PartitionManager holding one owner (what PartitionServicer asks it)."""
    server_name = "in-process"

    def __init__(self, owner) -> None:
        self._owner = owner

    def owner(self, topic: str, partition: int):
        assert (topic, partition) == (self._owner.topic, self._owner.partition)
        return self._owner


def test_an_in_process_append_answers_as_produce_and_one_held_past_its_timeout_lands(tmp_path):
    """PartitionServicer.produce_here (a combined server's TC-log appends): a real owner
    behind the real servicer. It answers what Produce answers, refuses a corrupt batch
    with nothing written, and a write whose fsync is held past the timeout is
    REQUEST_TIMED_OUT while the write goes on: the TC log's retry of the same batch is
    then a duplicate with the first one's offsets. A batch whose producer has an
    earlier request waiting for its turn waits behind it (through Produce)."""
    from partition_server.durability import DurabilityBarrier
    from partition_server.owner import PartitionOwner
    from partition_server.service import PartitionServicer
    from tests.test_durability import SETTINGS, GatedSync, batch, until

    gate = GatedSync()
    barrier = DurabilityBarrier(syncfs=gate)

    async def scenario():
        owner = PartitionOwner("t", 0, tmp_path / "t-0", SETTINGS, barrier=barrier)
        await owner.start()
        servicer = PartitionServicer(_OneOwner(owner), None, max_batch_bytes=1 << 20,
                                     fetch_max_wait_ms=0, fetch_default_max_bytes=1 << 20,
                                     max_message_bytes=8 << 20)
        tp = common_pb2.TopicPartition(topic="t", partition=0)

        def item(data: bytes) -> partition_pb2.ProduceItem:
            return partition_pb2.ProduceItem(topic_partition=tp, record_batch=data)

        first = await servicer.produce_here(item(batch(7, 0)), 5)
        [second] = (await servicer.Produce(
            partition_pb2.ProduceRequest(items=[item(batch(7, 2))]), None)).results
        assert (first.error.reason, first.base_offset, first.last_offset, first.duplicate,
                first.log_start_offset) == ("", 0, 1, False, 0)
        assert (second.error.reason, second.base_offset, second.log_start_offset) == ("", 2, 0)

        corrupt = bytearray(batch(7, 4))
        corrupt[-1] ^= 1
        refused = await servicer.produce_here(item(bytes(corrupt)), 5)
        assert refused.error.reason == "CRC_MISMATCH" and refused.base_offset == -1
        assert owner.log.log_end_offset == 4

        gate.hold = True
        held = await servicer.produce_here(item(batch(7, 4)), 0.2)
        assert held.error.reason == "REQUEST_TIMED_OUT", held
        assert owner.log.log_end_offset == 6 and owner.log.high_watermark == 4
        gate.hold = False
        gate.release()
        await until(lambda: owner.log.high_watermark == 6)
        retried = await servicer.produce_here(item(batch(7, 4)), 5)
        assert (retried.error.reason, retried.base_offset, retried.duplicate) == ("", 4, True)

        # An earlier request of the same producer still waits for its turn (a gate, as
        # Produce leaves while it verifies): this one waits behind it, not queued ahead.
        earlier = asyncio.get_running_loop().create_future()
        owner.produce_gates[7] = earlier
        behind = asyncio.ensure_future(servicer.produce_here(item(batch(7, 6)), 5))
        await asyncio.sleep(0.1)
        assert not behind.done() and owner.log.log_end_offset == 6
        del owner.produce_gates[7]
        earlier.set_result(None)
        assert (await behind).base_offset == 6
        await owner.close()

    asyncio.run(scenario())


def test_a_cluster_of_two_combined_servers_is_created_with_16_tc_partitions_they_share(
        combined, tmp_path):
    """A combined server that expects other partition servers
    (coordinator.expected_partition_servers=2: the first of a cluster of two) creates the
    cluster with DEFAULT_TC_PARTITIONS, not one: with one, a single node would coordinate
    every transaction of the cluster. The two coordinators then hold their fair shares.
    (ZooKeeper is the `combined` fixture's, under a chroot of this test's own.)"""
    chroot = f"/two-combined-{uuid.uuid4().hex[:8]}"
    pids = []
    try:
        for i in range(2):
            port, metrics_port = launcher.free_port(), launcher.free_port()
            pids.append(launcher.spawn(
                [sys.executable, "-m", "services", "serve", "combined", "--name", f"node-{i}",
                 "--listen", f"127.0.0.1:{port}",
                 "--metrics-listen", f"127.0.0.1:{metrics_port}",
                 "--data-dir", str(tmp_path / f"node-{i}"),
                 "--zookeeper", combined.info["zookeeper"],
                 "--set", f"zookeeper.chroot={chroot}",
                 "--set", "coordinator.expected_partition_servers=2"],
                str(tmp_path / f"node-{i}.log")))
        zookeeper = KazooClient(hosts=combined.info["zookeeper"] + chroot)
        zookeeper.start(timeout=10)
        try:
            def owners() -> Counter:
                held = Counter()
                for k in range(DEFAULT_TC_PARTITIONS):
                    with contextlib.suppress(NoNodeError):
                        held[json.loads(zookeeper.get(f"/tc/{k}/owner")[0])
                             ["coordinator_name"]] += 1
                return held

            def shared() -> bool:
                for i, pid in enumerate(pids):
                    assert launcher.process_alive(pid, "node-"), \
                        (tmp_path / f"node-{i}.log").read_text()[-3000:]
                return sorted(owners().values()) == [8, 8]

            wait_until(shared, 90, "both coordinators to hold 8 TC partitions each")
            assert json.loads(zookeeper.get("/cluster")[0])["tc_partitions"] == \
                DEFAULT_TC_PARTITIONS
            assert set(owners()) == {"node-0-coordinator", "node-1-coordinator"}
        finally:
            zookeeper.stop()
            zookeeper.close()
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)


def test_tc_partitions_created_by_a_role():
    assert tc_partitions_created_by("combined") == COMBINED_TC_PARTITIONS == 1
    assert tc_partitions_created_by("combined", 1) == COMBINED_TC_PARTITIONS
    assert tc_partitions_created_by("combined", 2) == DEFAULT_TC_PARTITIONS == 16
    for role in ("coordinator", "partition_server", "id_allocator"):
        assert tc_partitions_created_by(role) == tc_partitions_created_by(role, 5) == 16


def test_channels_and_links_to_servers_that_are_gone_are_closed_at_a_refresh():
    """A partition server's verifier (and a coordinator's routes) keep a channel and a
    link per server address. A coordinator pod restarted under another address left the
    old ones open for good (the link's kept connections in CLOSE_WAIT). A refresh of the
    routes now closes those of addresses no registered server has."""
    from types import SimpleNamespace

    from partition_server.coordinator_epochs import CoordinatorEpochs
    from partition_server.verifier import TxnVerifier

    def coordinator(address: str):
        return SimpleNamespace(name="coord-0", role="coordinator", grpc_address=f"{address}:1",
                               link=f"{address}:2")

    entries = [coordinator("10.0.0.1")]

    class Store:  # the registry as ZooKeeper would answer it
        async def tc_leases(self):
            return {0: {"coordinator_name": "coord-0"}}

        async def servers(self):
            return list(entries)

    async def scenario():
        verifier = TxnVerifier(Store(), CoordinatorEpochs(None, tc_partitions=16))
        try:
            assert await verifier._route(0, refresh=True) == "10.0.0.1:1"
            verifier._stub("10.0.0.1:1")  # a channel, a stub and a link to it
            assert "10.0.0.1:1" in verifier._stubs._channels
            assert "10.0.0.1:1" in verifier._links._links
            entries[0] = coordinator("10.0.0.9")  # the pod restarted elsewhere
            assert await verifier._route(0, refresh=True) == "10.0.0.9:1"
            assert "10.0.0.1:1" not in verifier._stubs._channels
            assert "10.0.0.1:1" not in verifier._stubs._stubs
            assert "10.0.0.1:1" not in verifier._links._links
        finally:
            await verifier.close()

    asyncio.run(scenario())
