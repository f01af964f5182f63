"""Connections and metadata for the SDK: one gRPC channel per server address, and a
cache of topic → partition → owner that is refreshed when a server says it is stale
(NOT_PARTITION_OWNER, UNKNOWN_TOPIC_OR_PARTITION, an unreachable owner)."""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass

import grpc

from atomlog.v1 import (
    common_pb2,
    coordinator_pb2_grpc,
    metadata_pb2,
    metadata_pb2_grpc,
    partition_pb2_grpc,
)
from services.auth import TokenSource, bearer_channel
from services.grpcutil import RECONNECT_OPTIONS
from services.tls import ChannelTls
from spark_client import errors

# Channel options: messages up to 64 MiB (fetches of many partitions), keepalive so a
# dead server is noticed, and no transparent retry of non-idempotent calls beyond gRPC's.
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    # A restarted server is reached again within 0.5 s, well inside the retries of a
    # subscription call (8 attempts, about 1.1 to 2.3 s).
    *RECONNECT_OPTIONS,
]
METADATA_TIMEOUT_S = 10.0
METADATA_MIN_REFRESH_INTERVAL_S = 0.05  # bound refresh storms after many routing errors


@dataclass(frozen=True)
class PartitionRoute:
    topic: str
    partition: int
    server_name: str
    address: str  # empty when the owner is down


class Channels:
    """One channel per address, shared by every producer and consumer of a Client, and
    one stub per (address, service): building a stub registers each of its methods with
    the channel, which cost about a sixth of a small call's client CPU when done per call."""

    def __init__(self, tls: ChannelTls | None = None, token: TokenSource | None = None):
        """`tls`: channel credentials for a cluster serving TLS (None: plaintext). When
        its files change on disk, channels opened from then on use the new ones.
        `token`: a bearer token sent on every call (`authorization` metadata)."""
        self.token = token
        self._channels: dict[str, grpc.Channel] = {}
        self._stubs: dict[tuple[str, type], object] = {}
        self._lock = threading.Lock()
        self.tls = tls
        self._tls_generation = tls.current()[0] if tls is not None else 0
        self._retired: list[grpc.Channel] = []  # from before a reload; closed by close()

    def partition(self, address: str) -> partition_pb2_grpc.PartitionServiceStub:
        return self._stub(address, partition_pb2_grpc.PartitionServiceStub)

    def coordinator(self, address: str) -> coordinator_pb2_grpc.CoordinatorServiceStub:
        return self._stub(address, coordinator_pb2_grpc.CoordinatorServiceStub)

    def metadata(self, address: str) -> metadata_pb2_grpc.MetadataServiceStub:
        return self._stub(address, metadata_pb2_grpc.MetadataServiceStub)

    def stub(self, address: str, kind: type):
        """A `kind(channel)` for the address, made once and kept like the service stubs
        (for callables of a caller's own, such as the producer's pre-serialized Produce)."""
        return self._stub(address, kind)

    def _stub(self, address: str, kind: type):
        if self.tls is not None and self.tls.current()[0] != self._tls_generation:
            self._renew()
        stub = self._stubs.get((address, kind))
        if stub is None:
            stub = self._stubs[(address, kind)] = kind(self.get(address))
        return stub

    def _renew(self) -> None:
        """The TLS files were reloaded: new channels (and stubs) from now on; calls on the
        old channels finish, and close() closes them."""
        with self._lock:
            generation = self.tls.current()[0]
            if generation == self._tls_generation:
                return
            self._tls_generation = generation
            self._retired += self._channels.values()
            self._channels, self._stubs = {}, {}

    def get(self, address: str) -> grpc.Channel:
        with self._lock:
            channel = self._channels.get(address)
            if channel is None:
                channel = bearer_channel(
                    grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
                    if self.tls is None else self.tls.channel(address, CHANNEL_OPTIONS),
                    self.token)
                self._channels[address] = channel
            return channel

    def close(self) -> None:
        with self._lock:
            for channel in [*self._channels.values(), *self._retired]:
                channel.close()
            self._channels.clear()
            self._stubs.clear()
            self._retired.clear()


class MetadataCache:
    def __init__(self, bootstrap: list[str], channels: Channels):
        if not bootstrap:
            raise ValueError("at least one bootstrap address is needed")
        self.bootstrap = list(bootstrap)
        self.channels = channels
        self._lock = threading.Lock()
        self._topics: dict[str, list[PartitionRoute]] = {}
        self._servers: list[str] = []
        self._refreshed_at = 0.0
        self.tc_partition_count = 0
        self.tc_routes: dict[int, str] = {}
        self.coordinators: list[str] = []  # gRPC addresses, as of the last refresh
        # A coordinator's link (spark_client/link.py), by its gRPC address: those that
        # advertise one.
        self.coordinator_links: dict[str, str] = {}
        # A partition server's link, by its gRPC address (those that advertise one): the
        # consumers' calls go there (Fetch; a subscription's Receive, Ack, Nack), and
        # the producers' Produce (on a pipelined connection).
        self.partition_links: dict[str, str] = {}

    def _stub(self, address: str) -> metadata_pb2_grpc.MetadataServiceStub:
        return self.channels.metadata(address)

    def call(self, method: str, request, timeout: float = METADATA_TIMEOUT_S):
        """Call a MetadataService method on any reachable server (bootstrap first)."""
        others = [a for a in self._servers if a not in self.bootstrap]
        random.shuffle(others)  # spread metadata load over the cluster after the bootstrap
        candidates = list(dict.fromkeys(self.bootstrap)) + others
        last: Exception | None = None
        for address in candidates:
            try:
                return getattr(self._stub(address), method)(request, timeout=timeout)
            except grpc.RpcError as rpc_error:
                error = errors.from_grpc(rpc_error)
                if error.reason not in ("SERVER_UNAVAILABLE", "SHUTTING_DOWN", "REQUEST_TIMED_OUT",
                                        "ZOOKEEPER_UNAVAILABLE"):
                    raise error from None
                last = error
        raise last or errors.error_for("SERVER_UNAVAILABLE", "no server reachable")

    def refresh(self, topics: list[str] | None = None) -> None:
        with self._lock:
            wait = self._refreshed_at + METADATA_MIN_REFRESH_INTERVAL_S - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        reply = self.call("GetMetadata", metadata_pb2.GetMetadataRequest(topics=topics or []))
        with self._lock:
            for topic in reply.topics:
                self._topics[topic.name] = [
                    PartitionRoute(topic.name, p.partition, p.server_name, p.server_address)
                    for p in sorted(topic.partitions, key=lambda p: p.partition)]
            self._servers = [s.grpc_address for s in reply.servers]
            self.coordinators = [s.grpc_address for s in reply.servers
                                 if s.role == common_pb2.SERVER_ROLE_COORDINATOR]
            self.coordinator_links = {s.grpc_address: s.link_address for s in reply.servers
                                      if s.role == common_pb2.SERVER_ROLE_COORDINATOR
                                      and s.link_address}
            self.partition_links = {s.grpc_address: s.link_address for s in reply.servers
                                    if s.role == common_pb2.SERVER_ROLE_PARTITION_SERVER
                                    and s.link_address}
            self.tc_partition_count = reply.tc_partition_count
            self.tc_routes = {t.tc_partition: t.coordinator_address for t in reply.tc_partitions}
            self._refreshed_at = time.monotonic()

    def partitions(self, topic: str) -> list[PartitionRoute]:
        # No lock to read: a dict lookup is atomic, and writers replace whole lists
        # (send() asks once per record).
        routes = self._topics.get(topic)
        if routes is None:
            self.refresh([topic])
            with self._lock:
                routes = self._topics[topic]
        return routes

    def route(self, topic: str, partition: int) -> PartitionRoute:
        routes = self.partitions(topic)
        if not 0 <= partition < len(routes):
            raise errors.UnknownTopicOrPartition(
                f"topic {topic!r} has {len(routes)} partitions; no partition {partition}")
        found = routes[partition]
        if not found.address:
            # The owner is down, or (replicated) the partition has no leader right now:
            # retriable, and the next lookup asks the cluster again.
            self.invalidate(topic)
            raise errors.error_for("SERVER_UNAVAILABLE",
                                   f"partition {topic}-{partition} has no live leader "
                                   f"(last known: {found.server_name or 'none'})",
                                   {"retry_after_ms": "200"})
        return found

    def invalidate(self, topic: str) -> None:
        with self._lock:
            self._topics.pop(topic, None)
