"""Partition server process: what `atomlog serve partition-server` installs — the
partition manager (ownership from ZooKeeper, one owner task per partition), the
PartitionService, the coordinator epochs that fence markers
(partition_server/coordinator_epochs.py), the verifier that asks coordinators about
transactional writes (partition_server/verifier.py) and the presumed-abort checker of
old open transactions (partition_server/txn_checker.py)."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2

from atomlog.v1 import partition_pb2, partition_pb2_grpc
from partition_server import durability, read_wire
from partition_server.wal import WriteAheadLog, replay_leftover
from partition_server.coordinator_epochs import CoordinatorEpochs
from partition_server.copy_link import serve_on_link
from partition_server.cursor_store import CursorStoreLimits
from partition_server.lease import LeaseWatch
from partition_server.log import LogConfig
from partition_server.manager import PartitionManager, ReplicationSettings
from partition_server.replica import RESPONSE_SERIALIZERS
from partition_server.owner import OwnerSettings
from partition_server.scrubber import Scrubber
from partition_server.service import PartitionServicer, SubscriptionSettings
from partition_server.subscription_cursor import CursorLimits
from partition_server.txn_buffer import TxnBufferLimits
from partition_server.txn_checker import TxnChecker
from partition_server.verifier import TxnVerifier
from services.grpcutil import CAUGHT_UP_SERVICE, service_name
from services.logs import event
from services.zk import aio

log = logging.getLogger("atomlog.partition_server")
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def owner_settings(config) -> OwnerSettings:
    return OwnerSettings(
        log=LogConfig(segment_bytes=config["storage.segment_bytes"],
                      segment_ms=config["storage.segment_ms"],
                      retention_bytes=config["storage.retention_bytes"],
                      retention_ms=config["storage.retention_ms"],
                      index_interval_bytes=config["storage.index_interval_bytes"],
                      max_batch_bytes=config["partition.max_batch_bytes"]),
        fsync=config["partition.flush_policy"] == "fsync",
        durability=config["partition.durability"],
        max_group_bytes=config["partition.max_group_bytes"],
        max_queued_requests=config["partition.max_queued_requests"],
        max_producers=config["partition.max_producers"],
        producer_idle_expiry_ms=config["partition.producer_idle_expiry_ms"],
        snapshot_interval_batches=config["partition.snapshot_interval_batches"],
        snapshot_interval_ms=config["partition.snapshot_interval_ms"],
        txn_limits=TxnBufferLimits(
            max_open_transactions=config["partition.max_open_transactions"],
            max_aborted_transactions=config["partition.max_aborted_transactions"],
            max_remembered_commits=config["partition.max_remembered_commits"]),
        late_transaction_ms=config["partition.late_transaction_ms"],
        late_write_guard_size=config["partition.late_write_guard_size"],
        cursor_limits=CursorStoreLimits(
            max_subscriptions=config["partition.max_subscriptions"],
            snapshot_interval_entries=config["subscription.snapshot_interval_entries"],
            max_journal_bytes=config["subscription.max_journal_bytes"],
            cursor=CursorLimits(
                max_ranges=config["subscription.max_ranges"],
                max_pending_transactions=config["subscription.max_pending_transactions"],
                max_unacked_offsets=config["subscription.max_unacked_offsets"],
                max_remembered_transactions=config["subscription.max_remembered_transactions"])),
    )


def subscription_settings(config) -> SubscriptionSettings:
    return SubscriptionSettings(
        default_ack_timeout_ms=config["subscription.default_ack_timeout_ms"],
        max_ack_timeout_ms=config["subscription.max_ack_timeout_ms"],
        max_offsets_per_receive=config["subscription.max_offsets_per_receive"],
        max_verified_acks=config["subscription.max_verified_acks"])


class _Handlers:
    """Stands in for a server to collect the method handlers a generated
    add_*Servicer_to_server registers."""

    def __init__(self):
        self.handlers: dict[str, dict] = {}

    def add_generic_rpc_handlers(self, _handlers) -> None:
        pass  # the same handlers come again, by name, below

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        self.handlers[service] = handlers


CAUGHT_UP_CHECK_S = 1.0


class CaughtUpWatch:
    """The health service `atomlog.caught_up` (a name the standard gRPC health service
    answers beside ""): SERVING once this server holds every partition it should as it
    should (PartitionManager.catching_up: its replicas back in their ISRs, its own
    partitions open), checked every second; NOT_SERVING before and while it catches up,
    and from SIGTERM on. Kubernetes' readiness probe of the partition servers asks it, so
    a rolling restart replaces the next server only once the last one has caught up (not
    merely started): else the next restart took a second replica of each partition out of
    its ISR while the first was still copying, and partitions with min.insync.replicas=2
    refused writes (docs/operations.md, "Rolling restarts and upgrades")."""

    def __init__(self, manager, health, interval_s: float = CAUGHT_UP_CHECK_S):
        self.manager = manager
        self.health = health
        self.interval_s = interval_s
        self._task: asyncio.Task | None = None

    async def install(self) -> None:
        """Answer NOT_SERVING (not NOT_FOUND) from the first probe on."""
        await self.health.set(CAUGHT_UP_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="caught-up watch")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        serving = None
        began = time.monotonic()
        while True:
            try:
                behind = self.manager.catching_up()
            except Exception:  # noqa: BLE001 — a bug: not ready, and said so
                log.exception("checking whether the replicas here caught up")
                behind = None
            now = behind == []
            if now != serving:
                await self.health.set(CAUGHT_UP_SERVICE, SERVING if now else NOT_SERVING)
                if now:
                    event(log, "caught up", seconds=round(time.monotonic() - began, 1))
                elif behind:
                    event(log, "catching up", partitions=len(behind),
                          first=[f"{topic}-{partition}" for topic, partition in behind[:10]])
                    began = time.monotonic()
                serving = now
            await asyncio.sleep(self.interval_s)


def add_partition_service(servicer, server) -> None:
    """PartitionService's handlers as generated, except that Replicate and ReplicateMany
    answer through replicate_wire's serializers (records spliced into the wire bytes,
    docs/replication.md "The answer's bytes"), and Fetch and Receive through read_wire's
    (their record batches spliced likewise); the messages on the wire are the same."""
    collected = _Handlers()
    partition_pb2_grpc.add_PartitionServiceServicer_to_server(servicer, collected)
    name = service_name(partition_pb2, "PartitionService")
    handlers = dict(collected.handlers[name])
    serializers = {**RESPONSE_SERIALIZERS, "Fetch": read_wire.serialize,
                   "Receive": read_wire.serialize}
    for method, serializer in serializers.items():
        handlers[method] = handlers[method]._replace(response_serializer=serializer)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
    server.add_registered_method_handlers(name, handlers)


async def install(runtime) -> list[str]:
    config = runtime.config
    durability.barrier().use_ring(config["partition.fsync_ring"])
    epochs = CoordinatorEpochs(runtime.zk, runtime.tc_partitions)
    await asyncio.to_thread(epochs.start)
    settings = owner_settings(config)
    wal = None
    wal_dir = Path(config["server.data_dir"]) / "wal"
    partitions_dir = Path(config["server.data_dir"]) / "partitions"
    if config["partition.durability"] == durability.WAL:
        wal = WriteAheadLog(wal_dir, segment_bytes=config["partition.wal_segment_bytes"],
                            checkpoint_ms=config["partition.wal_checkpoint_ms"],
                            checkpoint_bytes=config["partition.wal_checkpoint_bytes"],
                            max_bytes=config["partition.wal_max_bytes"])
    else:  # a file an earlier start in wal mode left: its frames are not to be lost
        await asyncio.to_thread(replay_leftover, wal_dir, partitions_dir, settings.log)
    manager = PartitionManager(partitions_dir, runtime.name,
                               runtime.zk, settings, coordinator_epochs=epochs,
                               replication=ReplicationSettings(
                                   max_lag_ms=config["replication.max_lag_ms"],
                                   fetch_wait_ms=config["replication.fetch_wait_ms"],
                                   follower_direct_io=config["replication.follower_direct_io"],
                                   link=config["replication.link"],
                                   fetch_sessions=config["replication.fetch_sessions"]),
                               wal=wal,
                               chore_interval_s=config["storage.retention_check_interval_ms"]
                               / 1000)
    await manager.start()
    runtime.stop_hooks.append(manager.close)
    caught_up = CaughtUpWatch(manager, runtime.health)
    await caught_up.install()
    runtime.start_hooks.append(caught_up.start)  # once the server is SERVING
    runtime.stop_hooks.append(caught_up.close)
    verifier = TxnVerifier(runtime.metadata, epochs,
                           timeout_s=config["partition.txn_verify_timeout_ms"] / 1000,
                           use_links=config["replication.link"])
    runtime.stop_hooks.append(verifier.close)
    checker = TxnChecker(manager, verifier,
                         check_after_ms=config["partition.txn_check_after_ms"],
                         interval_ms=config["partition.txn_check_interval_ms"])
    checker.start()
    runtime.stop_hooks.append(checker.close)
    scrubber = Scrubber(manager, Path(config["server.data_dir"]),
                        bytes_per_s=config["partition.scrub_bytes_per_s"],
                        interval_ms=config["partition.scrub_interval_ms"])
    scrubber.start()  # (the passes only with a rate; ScrubPartition either way)
    runtime.stop_hooks.append(scrubber.close)
    zk = runtime.zk
    async def confirm() -> None:
        """A round trip sent after the stall, then every leadership checked against
        ZooKeeper's state (the session may have been replaced meanwhile)."""
        await aio(zk.client.sync_async("/"))
        if not await asyncio.to_thread(manager.leaderships_current):
            raise RuntimeError("a leadership here is stale; waiting for steering")

    lease = LeaseWatch(lambda: zk.connected, confirm,
                       stall_s=min(1.0, zk.session_timeout_ms / 3000))
    lease.start()
    runtime.stop_hooks.append(lease.close)
    servicer = PartitionServicer(manager, runtime.metadata, config["partition.max_batch_bytes"],
                                 config["partition.fetch_max_wait_ms"],
                                 config["partition.fetch_default_max_bytes"],
                                 config["grpc.max_message_bytes"], coordinator_epochs=epochs,
                                 verifier=verifier, subscriptions=subscription_settings(config),
                                 lease=lease,
                                 skip_quiet_partitions=config["replication.skip_quiet_partitions"],
                                 scrubber=scrubber)
    servicer.authorizer = runtime.interceptor.authorizer
    add_partition_service(servicer, runtime.server)
    if config["replication.link"]:
        # For followers and coordinators (and, in a combined server, clients' commits).
        address = await serve_on_link(runtime, "PartitionService", servicer,
                                      "replication.link_listen",
                                      "replication.link_advertised_port")
        runtime.registration_extra["partition_server"] = {"replication_link": address}
    name = service_name(partition_pb2, "PartitionService")
    runtime.local_services[name] = servicer  # services/local.py: same-process calls
    return [name]
