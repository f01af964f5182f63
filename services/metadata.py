"""Cluster metadata in ZooKeeper, and the MetadataService every server answers.

ZooKeeper layout under the chroot (default /atomlog):
  /cluster            {"tc_partitions": 16, ...}        fixed at creation
  /servers/<name>     ephemeral, {"role", "grpc_address", "metrics_address", "pid", ...}
  /incarnations/<name> {"pid", "started_unix_ms"}: written first by each start of a
                      partition server; its zxid names that process in replica fetches
  /partitions/<t>/<p> the partition's leader, epoch and ISR (docs/replication.md)
  /topics/<name>      {"version": 1, "assignment": [server names], "config": {...}}
  /tc/<k>             {"epoch": E, "log_producer_id": P}: the last coordinator epoch
                      issued for TC partition k, and the producer id of its log
  /tc/<k>/owner       ephemeral, {"coordinator_name", "epoch", "acquired_unix_ms"}:
                      the current lease of k (coordinator/leases.py)
A topic is created with a single znode create, so it appears whole or not at all.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Iterable

from kazoo.exceptions import BadVersionError, NodeExistsError, NoNodeError

from atomlog.v1 import common_pb2, metadata_pb2, metadata_pb2_grpc
from partition_server import partition_states
from partition_server.replication import (PartitionState, assign_replicas,
                                          default_replication_factor, initial_state,
                                          validate_reassignment, validate_replication)
from services.errors import AtomlogError
from services.logs import event
from services.topics import (INTERNAL_PREFIX, TopicRecord, altered_config, assign_partitions,
                             validate_partition_count, validate_topic_config,
                             validate_topic_name)
from services.zk import SERVERS_PATH, TC_PATH, TOPICS_PATH, ZkSession, aio

log = logging.getLogger("atomlog.metadata")

# The largest reassignment throttle accepted (bytes/s: 10 GB/s, more than any disk here).
MAX_REASSIGNMENT_THROTTLE = 10**10

ROLE_ENUM = {
    "partition_server": common_pb2.SERVER_ROLE_PARTITION_SERVER,
    "coordinator": common_pb2.SERVER_ROLE_COORDINATOR,
    "id_allocator": common_pb2.SERVER_ROLE_ID_ALLOCATOR,
}


@dataclass(frozen=True)
class ServerEntry:
    name: str
    role: str
    grpc_address: str
    metrics_address: str
    version: str
    registered_unix_ms: int
    rack: str = ""
    # Its link (partition_server/copy_link.py), if any: a partition server's replication
    # link, a coordinator's for clients' commits (the same one in a combined server).
    link: str = ""

    @classmethod
    def from_json(cls, name: str, data: dict[str, Any]) -> "ServerEntry":
        return cls(name, data.get("role", ""), data.get("grpc_address", ""),
                   data.get("metrics_address", ""), data.get("version", ""),
                   int(data.get("registered_unix_ms", 0)), str(data.get("rack", "")),
                   str(data.get("replication_link", "") or data.get("link", "")))

    def to_proto(self) -> metadata_pb2.ServerInfo:
        return metadata_pb2.ServerInfo(
            name=self.name, role=ROLE_ENUM.get(self.role, common_pb2.SERVER_ROLE_UNSPECIFIED),
            grpc_address=self.grpc_address, metrics_address=self.metrics_address,
            version=self.version, registered_unix_ms=self.registered_unix_ms,
            link_address=self.link)


class MetadataStore:
    """Reads and writes cluster metadata in ZooKeeper (async, via kazoo's async calls)."""

    def __init__(self, zk: ZkSession, tc_partitions: int, max_partitions: int,
                 default_replication_factor: int = 1, max_topics: int = 10_000):
        self.zk = zk
        self.tc_partitions = tc_partitions
        self.max_partitions = max_partitions
        self.max_topics = max_topics  # topics.max_topics (internal ones not counted)
        self.default_replication_factor = default_replication_factor  # 0: by server count

    async def _children_with_data(self, path: str) -> dict[str, bytes]:
        client = self.zk.client
        names = await aio(client.get_children_async(path))
        results = await asyncio.gather(*(aio(client.get_async(f"{path}/{n}")) for n in names),
                                       return_exceptions=True)
        found: dict[str, bytes] = {}
        for name, result in zip(names, results):
            if isinstance(result, NoNodeError):
                continue  # removed between the two reads
            if isinstance(result, BaseException):
                raise result
            found[name] = result[0]
        return found

    async def servers(self) -> list[ServerEntry]:
        raw = await self._children_with_data(SERVERS_PATH)
        return [ServerEntry.from_json(n, json.loads(d or b"{}")) for n, d in sorted(raw.items())]

    async def topics(self, names: Iterable[str] | None = None) -> list[TopicRecord]:
        client = self.zk.client
        if names is None:
            raw = await self._children_with_data(TOPICS_PATH)
        else:
            wanted = sorted(set(names))
            results = await asyncio.gather(
                *(aio(client.get_async(f"{TOPICS_PATH}/{n}")) for n in wanted),
                return_exceptions=True)
            missing = [n for n, r in zip(wanted, results) if isinstance(r, NoNodeError)]
            if missing:
                raise AtomlogError("UNKNOWN_TOPIC_OR_PARTITION",
                                   f"unknown topic(s): {', '.join(missing)}",
                                   {"topics": ",".join(missing)})
            for result in results:
                if isinstance(result, BaseException):
                    raise result
            raw = {n: r[0] for n, r in zip(wanted, results)}
        records = [TopicRecord.from_json(n, json.loads(d)) for n, d in sorted(raw.items())]
        await self.read_leaders([r for r in records if r.replicated])
        return records

    async def read_leaders(self, records: list[TopicRecord]) -> None:
        """Fill `leaders` (and `states`) of replicated topics from their partition states
        (docs/replication.md), read concurrently; a partition without a readable state
        counts as offline ("")."""
        client = self.zk.client
        paths = [(r, p, partition_states.path_of(r.name, p))
                 for r in records for p in range(r.partitions)]
        results = await asyncio.gather(*(aio(client.get_async(path)) for _, _, path in paths),
                                       return_exceptions=True)
        for record in records:
            record.leaders = [""] * record.partitions
            record.states = [None] * record.partitions
        for (record, p, path), result in zip(paths, results):
            if isinstance(result, NoNodeError):
                continue
            if isinstance(result, BaseException):
                raise result
            try:
                state = PartitionState.from_json(result[0])
            except ValueError as error:
                log.error("unreadable partition state %s: %s", path, error)
                continue
            record.states[p] = state
            record.leaders[p] = state.leader or ""

    async def tc_leases(self) -> dict[int, dict[str, Any]]:
        """{k: {"coordinator_name", "epoch"}} for every TC partition whose /tc/<k>/owner
        exists (the owner nodes are read concurrently); a partition without one is omitted."""
        client = self.zk.client
        paths = [f"{TC_PATH}/{k}/owner" for k in range(self.tc_partitions)]
        results = await asyncio.gather(*(aio(client.get_async(p)) for p in paths),
                                       return_exceptions=True)
        leases: dict[int, dict[str, Any]] = {}
        for k, (path, result) in enumerate(zip(paths, results)):
            if isinstance(result, NoNodeError):
                continue
            if isinstance(result, BaseException):
                raise result
            try:
                owner = json.loads(result[0])
                leases[k] = {"coordinator_name": str(owner["coordinator_name"]),
                             "epoch": int(owner["epoch"])}
            except (ValueError, KeyError, TypeError) as error:
                raise AtomlogError("INTERNAL", f"unreadable TC lease {path}: {error}") from None
        return leases

    async def create_topic(self, name: str, partitions: int, config: dict[str, str],
                           *, internal: bool = False, replication_factor: int = 0) -> TopicRecord:
        """Validate everything, then write the topic in one create (a replicated topic: its
        record and every partition's first state in one ZooKeeper transaction); nothing on
        failure. `replication_factor` 0: the cluster default."""
        validate_topic_name(name, internal_allowed=internal)
        validate_partition_count(partitions, self.max_partitions)
        normalized = validate_topic_config(config)
        entries = [s for s in await self.servers() if s.role == "partition_server"]
        servers = [s.name for s in entries]
        if not servers:
            raise AtomlogError("NO_PARTITION_SERVERS",
                               "no partition server is registered; cannot assign partitions")
        factor = replication_factor or self.default_replication_factor or \
            default_replication_factor(len(servers))
        min_insync = int(normalized.get("min.insync.replicas", min(2, factor)))
        validate_replication(factor, min_insync, len(servers))
        load: dict[str, int] = {}
        existing = await self.topics()
        counted = sum(1 for t in existing if not t.name.startswith(INTERNAL_PREFIX))
        if not internal and counted >= self.max_topics:
            # (Checked against what this server read: creations racing on several servers
            # may pass it by their number, a bound all the same.)
            raise AtomlogError("RESOURCE_EXHAUSTED", f"the cluster holds {counted} topics, "
                               f"the limit (topics.max_topics) is {self.max_topics}",
                               {"limit": "topics.max_topics"})
        for topic in existing:
            for owner in topic.assignment:  # preferred leaders
                load[owner] = load.get(owner, 0) + 1
        now = int(time.time() * 1000)
        if factor == 1 and "min.insync.replicas" not in normalized:
            record = TopicRecord(name, assign_partitions(partitions, servers, load), normalized,
                                 now)
        else:
            replicas = assign_replicas(partitions, servers, factor,
                                       {s.name: s.rack for s in entries}, load)
            record = TopicRecord(name, [r[0] for r in replicas], normalized, now, 2, replicas)
        payload = json.dumps(record.to_json()).encode()
        if record.replicated:
            await asyncio.to_thread(self._create_replicated, record, payload, set(servers))
        else:
            try:
                await aio(self.zk.client.create_async(f"{TOPICS_PATH}/{name}", payload))
            except NodeExistsError:
                raise _topic_exists(name) from None
        event(log, "topic created", topic=name, partitions=partitions,
              assignment=record.assignment, replication_factor=factor)
        return record

    async def reassign_partition(self, topic: str, partition: int, replicas: list[str],
                                 throttle: int = 0) -> tuple[TopicRecord, bool]:
        """Record a reassignment of `topic`'s `partition` to `replicas` (docs/replication.md,
        "Reassignment"), by compare-and-set on the topic record; returns (the record now,
        whether it changed). The partition's leader completes it once the new replicas are
        in sync. Nothing is written when the request is refused."""
        validate_topic_name(topic, internal_allowed=True)
        if not 0 <= throttle <= MAX_REASSIGNMENT_THROTTLE:
            raise AtomlogError("INVALID_ARGUMENT",
                               f"throttle_bytes_per_s {throttle}: 0 (none) .. "
                               f"{MAX_REASSIGNMENT_THROTTLE}")
        for _ in range(20):
            path = f"{TOPICS_PATH}/{topic}"
            record, version = await self._record_of(topic, partition)
            if not record.replicated:
                raise AtomlogError(
                    "INVALID_REPLICA_ASSIGNMENT",
                    f"topic {topic!r} keeps one copy per partition without replication state "
                    "(created with replication factor 1): its partitions cannot move; create "
                    "a topic with -r 2 or more, or min.insync.replicas=1 for one movable copy")
            servers = [s.name for s in await self.servers() if s.role == "partition_server"]
            target = validate_reassignment(list(replicas), servers, record.min_insync_replicas)
            changed = record.reassigned(partition, target, throttle)
            if changed is None:
                return record, False
            try:
                await aio(self.zk.client.set_async(path, json.dumps(changed.to_json()).encode(),
                                                   version=version))
            except BadVersionError:
                continue  # another partition's reassignment began or ended meanwhile
            event(log, "partition reassignment recorded", partition=f"{topic}-{partition}",
                  replicas=record.replicas_of(partition), target=target)
            return changed, True
        raise AtomlogError("SERVER_UNAVAILABLE", f"topic {topic!r} kept changing; try again",
                           {"retry_after_ms": "500"})

    async def alter_topic_config(self, topic: str, to_set: dict[str, str],
                                 to_delete: list[str], validate_only: bool = False
                                 ) -> tuple[TopicRecord, bool]:
        """Change `topic`'s settings (topics.altered_config) by compare-and-set on its
        record; returns (the record now, or as it would be with `validate_only`; whether
        its settings changed). Nothing is written when the request is refused."""
        validate_topic_name(topic, internal_allowed=True)
        for _ in range(20):
            record, version = await self._record_of(topic, 0)
            config = altered_config(record, to_set, to_delete)
            if config == record.config:
                return record, False
            changed = dataclasses.replace(record, config=config)
            if validate_only:
                return changed, True
            try:
                await aio(self.zk.client.set_async(f"{TOPICS_PATH}/{topic}",
                                                   json.dumps(changed.to_json()).encode(),
                                                   version=version))
            except BadVersionError:
                continue  # a reassignment began or ended meanwhile, or another change
            event(log, "topic settings changed", topic=topic, before=record.config,
                  after=config)
            return changed, True
        raise AtomlogError("SERVER_UNAVAILABLE", f"topic {topic!r} kept changing; try again",
                           {"retry_after_ms": "500"})

    async def elect_leader(self, topic: str, partition: int, replica: str,
                           accept_data_loss: bool) -> TopicRecord:
        """An operator's election of `replica` to lead an offline partition
        (replication.elect_chosen, by compare-and-set); returns the topic record. Nothing
        is written when the request is refused."""
        validate_topic_name(topic, internal_allowed=True)
        record, _version = await self._record_of(topic, partition)
        if not record.replicated:
            raise AtomlogError("INVALID_ARGUMENT", f"topic {topic!r} keeps one copy per "
                               "partition without replication state: it has no election")
        live = {s.name for s in await self.servers() if s.role in ("partition_server", "combined")}
        election, _state = await asyncio.to_thread(
            partition_states.elect_chosen, self.zk.client, topic, partition,
            record.replicas_of(partition), live, replica, accept_data_loss)
        event(log, "leader elected by an operator", logging.WARNING if election.unclean
              else logging.INFO, partition=f"{topic}-{partition}", leader=replica,
              epoch=election.state.leader_epoch, unclean=election.unclean)
        return record

    async def _record_of(self, topic: str, partition: int) -> tuple[TopicRecord, int]:
        """`topic`'s record and its znode's version; UNKNOWN_TOPIC_OR_PARTITION when the
        topic or its `partition` does not exist."""
        try:
            data, stat = await aio(self.zk.client.get_async(f"{TOPICS_PATH}/{topic}"))
        except NoNodeError:
            raise AtomlogError("UNKNOWN_TOPIC_OR_PARTITION", f"unknown topic {topic!r}",
                               {"topics": topic}) from None
        record = TopicRecord.from_json(topic, json.loads(data))
        if not 0 <= partition < record.partitions:
            raise AtomlogError("UNKNOWN_TOPIC_OR_PARTITION",
                               f"no partition {topic}-{partition}: topic {topic!r} has "
                               f"{record.partitions} partitions",
                               {"topic": topic, "partition": str(partition)})
        return record, stat.version

    def _create_replicated(self, record: TopicRecord, payload: bytes, live: set[str]) -> None:
        """The topic record, /partitions/<name> and every partition's first state, in one
        ZooKeeper transaction (kazoo, synchronous: on a thread)."""
        client = self.zk.client
        client.ensure_path(partition_states.PARTITIONS_PATH)
        transaction = client.transaction()
        transaction.create(f"{TOPICS_PATH}/{record.name}", payload)
        transaction.create(f"{partition_states.PARTITIONS_PATH}/{record.name}", b"")
        for p, replicas in enumerate(record.replicas):
            transaction.create(partition_states.path_of(record.name, p),
                               initial_state(replicas, live).to_json())
        results = transaction.commit()
        failures = [r for r in results if isinstance(r, Exception)]
        if any(isinstance(r, NodeExistsError) for r in failures):
            raise _topic_exists(record.name)
        if failures:
            raise failures[0]


def _topic_exists(name: str) -> AtomlogError:
    return AtomlogError("TOPIC_ALREADY_EXISTS", f"topic {name!r} already exists", {"topic": name})


def topic_to_proto(topic: TopicRecord, servers: dict[str, ServerEntry]) -> metadata_pb2.TopicMetadata:
    partitions = []
    states = topic.states
    for index, owner in enumerate(topic.owners):
        entry = servers.get(owner) if owner else None
        state = states[index] if states else None
        replicas = topic.replicas_of(index)
        partitions.append(metadata_pb2.PartitionMetadata(
            partition=index, server_name=owner,
            server_address=entry.grpc_address if entry else "", available=entry is not None,
            replicas=replicas, isr=list(state.isr) if state else ([] if topic.replicated
                                                                    else replicas),
            leader_epoch=state.leader_epoch if state else 0,
            reassigning_to=topic.reassigning.get(index, []),
            reassignment_throttle_bytes_per_s=topic.throttle_of(index)))
    return metadata_pb2.TopicMetadata(name=topic.name, partitions=partitions, config=topic.config,
                                      internal=topic.internal,
                                      created_unix_ms=topic.created_unix_ms)


class MetadataServicer(metadata_pb2_grpc.MetadataServiceServicer):
    def __init__(self, store: MetadataStore, server_name: str):
        self.store = store
        self.server_name = server_name

    async def GetMetadata(self, request, context):
        for name in request.topics:
            validate_topic_name(name, internal_allowed=True)
        servers = {s.name: s for s in await self.store.servers()}
        topics = await self.store.topics(list(request.topics) or None)
        leases = await self.store.tc_leases()
        tc = []
        for k in range(self.store.tc_partitions):
            lease = leases.get(k, {})
            holder = servers.get(lease.get("coordinator_name", ""))
            tc.append(metadata_pb2.TcPartitionMetadata(
                tc_partition=k, coordinator_name=holder.name if holder else "",
                coordinator_address=holder.grpc_address if holder else "",
                coordinator_epoch=int(lease.get("epoch", 0))))
        return metadata_pb2.GetMetadataResponse(
            servers=[s.to_proto() for s in servers.values()],
            topics=[topic_to_proto(t, servers) for t in topics],
            tc_partitions=tc, tc_partition_count=self.store.tc_partitions,
            answered_by=self.server_name)

    async def CreateTopic(self, request, context):
        record = await self.store.create_topic(request.name, request.partitions,
                                               dict(request.config),
                                               replication_factor=request.replication_factor)
        if record.replicated:
            await self.store.read_leaders([record])
        servers = {s.name: s for s in await self.store.servers()}
        return metadata_pb2.CreateTopicResponse(topic=topic_to_proto(record, servers))

    async def ReassignPartition(self, request, context):
        record, started = await self.store.reassign_partition(
            request.topic, request.partition, list(request.replicas),
            request.throttle_bytes_per_s)
        await self.store.read_leaders([record])
        servers = {s.name: s for s in await self.store.servers()}
        metadata = topic_to_proto(record, servers).partitions[request.partition]
        return metadata_pb2.ReassignPartitionResponse(partition=metadata, started=started)

    async def ElectLeader(self, request, context):
        if not request.replica:
            raise AtomlogError("INVALID_ARGUMENT", "replica: the partition server to lead")
        record = await self.store.elect_leader(request.topic, request.partition,
                                               request.replica, request.accept_data_loss)
        await self.store.read_leaders([record])
        servers = {s.name: s for s in await self.store.servers()}
        metadata = topic_to_proto(record, servers).partitions[request.partition]
        return metadata_pb2.ElectLeaderResponse(partition=metadata)

    async def AlterTopicConfig(self, request, context):
        record, changed = await self.store.alter_topic_config(
            request.topic, dict(request.set), list(request.delete), request.validate_only)
        if record.replicated:
            await self.store.read_leaders([record])
        servers = {s.name: s for s in await self.store.servers()}
        return metadata_pb2.AlterTopicConfigResponse(topic=topic_to_proto(record, servers),
                                                     changed=changed)

    async def ListTopics(self, request, context):
        names = await aio(self.store.zk.client.get_children_async(TOPICS_PATH))
        if not request.include_internal:
            names = [n for n in names if not n.startswith("__")]
        return metadata_pb2.ListTopicsResponse(names=sorted(names))
