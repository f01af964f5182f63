"""Configuration: defaults < TOML file < environment (ATOMLOG_<NAME>) < flags.

Every setting is declared once, here, with its type, default, bounds and meaning;
`atomlog serve ROLE --help-config` prints them. Loading validates each value and then
the cross-setting rules (inconsistent limits refuse to start), and reports every
problem at once. The result is an immutable `Config`.
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

ROLES = ("partition_server", "coordinator", "id_allocator")
# One process hosting every role (`atomlog serve combined`): the single-node server.
COMBINED = "combined"
SERVE_ROLES = (*ROLES, COMBINED)
# The TC partitions a new cluster gets when cluster.tc_partitions is unset (0): Pulsar's
# 16, or 1 when a single-node combined server creates it (one that expects no other
# partition servers: coordinator.expected_partition_servers at most 1). On one event
# loop, 16 buy no parallelism, and the commit lane's decisions share a TC-log append only
# within a TC partition (docs/benchmarks.md, "The thirty-fifth session": 18% less
# event-loop time a small transaction with 1). A cluster of several combined servers gets
# 16, so that its coordinators share the TC partitions (the count is fixed at creation).
DEFAULT_TC_PARTITIONS = 16
COMBINED_TC_PARTITIONS = 1


def tc_partitions_created_by(role: str, expected_partition_servers: int = 0) -> int:
    """The TC partitions of a cluster a server of `role` creates with cluster.tc_partitions
    unset, given its coordinator.expected_partition_servers."""
    if role == COMBINED and expected_partition_servers <= 1:
        return COMBINED_TC_PARTITIONS
    return DEFAULT_TC_PARTITIONS


def hosted_roles(role: str) -> tuple[str, ...]:
    """The roles a server of `role` runs: itself, or every role for the combined server
    (in start order: the coordinator last, once the partitions it logs to are open)."""
    return ("id_allocator", "partition_server", "coordinator") if role == COMBINED else (role,)

KIB = 1024
MIB = 1024 * KIB

_ADDRESS = re.compile(r"^(?P<host>[A-Za-z0-9_.\-]+|\[[0-9a-fA-F:]+\]):(?P<port>\d{1,5})$")
_NAME = re.compile(r"^[a-z0-9]([a-z0-9\-]{0,61}[a-z0-9])?$")


class ConfigError(Exception):
    """The configuration cannot be used; `problems` lists every reason."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid configuration:\n  - " + "\n  - ".join(problems))


@dataclass(frozen=True)
class Setting:
    name: str
    kind: type
    default: Any
    meaning: str
    minimum: int | None = None
    maximum: int | None = None
    choices: tuple[str, ...] | None = None
    check: Callable[[Any], str | None] | None = None  # returns a problem or None
    aliases: dict[str, str] | None = None  # other spellings of choices (lowercase)

    @property
    def env_name(self) -> str:
        return "ATOMLOG_" + self.name.upper().replace(".", "_")

    def parse(self, raw: Any, source: str) -> Any:
        """Convert and check one value; raise ValueError with a full sentence."""
        value = self._convert(raw, source)
        if self.aliases is not None and isinstance(value, str):
            value = self.aliases.get(value.strip().lower(), value)
        if self.minimum is not None and value < self.minimum:
            raise ValueError(f"{self.name}={value} from {source} is below the minimum {self.minimum}")
        if self.maximum is not None and value > self.maximum:
            raise ValueError(f"{self.name}={value} from {source} is above the maximum {self.maximum}")
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"{self.name}={value!r} from {source} is not one of {list(self.choices)}")
        problem = self.check(value) if self.check else None
        if problem:
            raise ValueError(f"{self.name}={value!r} from {source}: {problem}")
        return value

    def _convert(self, raw: Any, source: str) -> Any:
        if self.kind is bool:
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError(f"{self.name}={raw!r} from {source} is not a boolean")
        if self.kind is int:
            if isinstance(raw, bool):
                raise ValueError(f"{self.name}={raw!r} from {source} is not an integer")
            try:
                return int(str(raw).replace("_", ""))
            except ValueError:
                raise ValueError(f"{self.name}={raw!r} from {source} is not an integer") from None
        if not isinstance(raw, (str, int, float)):
            raise ValueError(f"{self.name}={raw!r} from {source} is not a string")
        return str(raw)


def check_address(value: str) -> str | None:
    match = _ADDRESS.match(value)
    if not match:
        return "expected host:port"
    if int(match.group("port")) > 65535:
        return "port above 65535"
    return None


def check_hosts(value: str) -> str | None:
    hosts = [h for h in value.split(",") if h]
    if not hosts:
        return "expected host:port[,host:port...]"
    for host in hosts:
        problem = check_address(host)
        if problem:
            return f"{host!r}: {problem}"
    return None


def check_chroot(value: str) -> str | None:
    if not re.match(r"^(/[A-Za-z0-9_.\-]+)+$", value):
        return "expected an absolute znode path such as /atomlog"
    return None


def check_name(value: str) -> str | None:
    if value and not _NAME.match(value):
        return "expected 1-63 characters of [a-z0-9-], starting and ending with a letter or digit"
    return None


COMMON: tuple[Setting, ...] = (
    Setting("server.name", str, "", "Stable server name (assignments refer to it; a "
            "partition server's data directory records it at the first start and refuses "
            "another); default: <role>-<hostname>.", check=check_name),
    Setting("server.listen", str, "127.0.0.1:0", "gRPC listen address (port 0 picks one).",
            check=check_address),
    Setting("server.advertised_host", str, "", "Host other processes use to reach this one; "
            "default: the listen host."),
    Setting("server.advertised_port", int, 0, "Port other processes use to reach this one "
            "(a proxy or a NAT in front of it); 0: the bound port.", minimum=0, maximum=65_535),
    Setting("server.metrics_listen", str, "127.0.0.1:0", "Prometheus /metrics listen address.",
            check=check_address),
    Setting("server.health_listen", str, "", "A second listen address serving only the gRPC "
            "health service, always in plaintext, for probes that speak no TLS (Kubernetes' "
            "native gRPC probes) when tls.enabled; empty: none (health is on server.listen).",
            check=lambda value: check_address(value) if value else None),
    Setting("server.data_dir", str, "", "Directory for this server's files (required for "
            "servers that store data)."),
    Setting("server.shutdown_grace_ms", int, 10_000, "On SIGTERM, how long in-flight calls may "
            "drain before they are cancelled.", minimum=0, maximum=600_000),
    Setting("grpc.max_message_bytes", int, 16 * MIB, "Largest gRPC message sent or received. "
            "Default: room for a 1 MiB batch limit with many partitions per request.",
            minimum=64 * KIB, maximum=512 * MIB),
    Setting("grpc.max_concurrent_rpcs", int, 1_000, "Calls served at once; more are refused "
            "with RESOURCE_EXHAUSTED.", minimum=1, maximum=100_000),
    Setting("zookeeper.hosts", str, "127.0.0.1:2181", "ZooKeeper ensemble, host:port,...",
            check=check_hosts),
    Setting("zookeeper.chroot", str, "/atomlog", "Root znode of this cluster.",
            check=check_chroot),
    Setting("zookeeper.session_timeout_ms", int, 10_000, "ZooKeeper session timeout: how long "
            "a dead server stays registered. The server may grant less (2-20 ticks).",
            minimum=1_000, maximum=120_000),
    Setting("zookeeper.connect_timeout_ms", int, 30_000, "How long start-up waits for "
            "ZooKeeper before giving up: for the first connection, and for each start-up "
            "step (the cluster znode, the registration) through a lost connection or an "
            "expired session.", minimum=1_000, maximum=600_000),
    Setting("cluster.tc_partitions", int, 0, "Number of TC partitions; fixed when the cluster "
            "is created. 0 (the default): the count the cluster was created with, and for the "
            "server that creates it 16 (Pulsar's default), or 1 if it is a combined server "
            "that expects no other partition servers (coordinator.expected_partition_servers "
            "at most 1: every role in one process, where more TC partitions buy no "
            "parallelism and cost a TC-log append each). A server configured with another "
            "count than the cluster's refuses to start.",
            minimum=0, maximum=1_024),
    Setting("topics.max_partitions", int, 1_024, "Largest partition count a topic may have.",
            minimum=1, maximum=100_000),
    Setting("topics.max_topics", int, 10_000, "Most topics the cluster holds (internal ones "
            "not counted): CreateTopic beyond it is refused RESOURCE_EXHAUSTED. Each topic "
            "costs ZooKeeper a znode per partition and every server hosting it about "
            "twenty metric series, which are never removed while the process runs.",
            minimum=1, maximum=1_000_000),
    Setting("topics.default_replication_factor", int, 0, "Copies of each partition a topic "
            "gets when its creator names no factor (docs/replication.md); 0 (the default): 3 "
            "when the cluster has at least 3 partition servers, else their number. Also the "
            "factor of the internal __txn_log topic (0: counted when the first coordinator "
            "creates it, often before every partition server has registered).",
            minimum=0, maximum=7),
    Setting("tls.enabled", bool, False, "Serve TLS on the gRPC port and use TLS for calls to "
            "other servers (services/tls.py). Needs tls.cert_file, tls.key_file and "
            "tls.ca_file."),
    Setting("tls.cert_file", str, "", "PEM certificate of this server (its SANs: every host "
            "name and IP address it is reached by); also its client certificate towards the "
            "other servers. Re-read when it changes on disk."),
    Setting("tls.key_file", str, "", "PEM private key (unencrypted) of tls.cert_file. "
            "Re-read when it changes on disk."),
    Setting("tls.ca_file", str, "", "PEM CA certificate(s) that sign the other servers' "
            "certificates and, with tls.client_auth=require, the clients' ones. Re-read when "
            "it changes on disk."),
    Setting("tls.client_auth", str, "none", "require: mutual TLS, every client must present "
            "a certificate signed by tls.ca_file; none: clients are not asked for one.",
            choices=("none", "require")),
    Setting("tls.server_name", str, "", "The name this server checks the other servers' "
            "certificates against, instead of the host it dials (servers that advertise pod "
            "IPs and share one certificate, e.g. on Kubernetes); empty: the dialed host."),
    Setting("tls.metrics", bool, False, "Serve /metrics over HTTPS with the same certificate "
            "(and, with tls.client_auth=require, the same client certificate check)."),
    Setting("auth.mode", str, "none", "Who may call (services/auth.py): none: anyone "
            "(principal 'anonymous'); mtls: the client certificate's principal (needs "
            "tls.client_auth=require); token: a bearer token (a JWT or a static token); "
            "mtls_or_token: a bearer token when the call has one, else the certificate. "
            "Health and reflection calls are always allowed.",
            choices=("none", "mtls", "token", "mtls_or_token")),
    Setting("auth.mtls_principal", str, "cn", "Where a client certificate's principal "
            "comes from: cn: the subject common name; san_dns / san_uri: its first DNS / "
            "URI subject alternative name.", choices=("cn", "san_dns", "san_uri")),
    Setting("auth.jwt_issuer", str, "", "The `iss` every JWT must carry (needed with a JWT "
            "key or secret)."),
    Setting("auth.jwt_audience", str, "", "The audience (`aud`) every JWT must include "
            "(needed with a JWT key or secret)."),
    Setting("auth.jwt_key_file", str, "", "PEM public key (or certificate) that verifies "
            "JWTs: RSA (RS256/384/512), EC P-256/P-384 (ES256/ES384) or Ed25519 (EdDSA). "
            "Re-read when it changes on disk."),
    Setting("auth.jwt_secret_file", str, "", "File holding an HS256/384/512 secret (at "
            "least 32 bytes) that verifies JWTs. Re-read when it changes on disk."),
    Setting("auth.jwt_leeway_ms", int, 30_000, "Clock skew allowed on a JWT's exp and nbf.",
            minimum=0, maximum=600_000),
    Setting("auth.static_tokens_file", str, "", "Static bearer tokens: lines `principal "
            "token` (# comments); re-read when it changes on disk, so removing a line "
            "revokes its token within a second or so."),
    Setting("auth.service_principals", str, "", "Comma-separated principals that are "
            "servers (exact names, or prefixes ending in *)."),
    Setting("auth.service_token_file", str, "", "File holding the bearer token this server "
            "sends to other servers (auth.mode=token needs it; its principal should be in "
            "auth.service_principals). Re-read when it changes on disk."),
    Setting("auth.authorizer", str, "none", "Who may do what (services/acl.py, "
            "docs/security.md): none: every authenticated principal may call everything; "
            "acl: the ACLs stored in ZooKeeper (`atomlog acl add`) decide, deny wins, nothing "
            "allowed is denied (PERMISSION_DENIED). Needs auth.mode other than none.",
            choices=("none", "acl")),
    Setting("auth.super_users", str, "", "Comma-separated principals that ACLs do not "
            "restrict (operators; auth.authorizer=acl). They still cannot call the servers' "
            "internal RPCs (markers, staging), which need a service principal."),
    Setting("zookeeper.digest_file", str, "", "File holding `user:password`, the ZooKeeper "
            "digest credential of this cluster's servers: with it every znode under "
            "zookeeper.chroot is created (and at start-up re-set) with an ACL that lets only "
            "that credential change it; everyone may read (docs/security.md). Empty: znodes "
            "are open to everyone (ZooKeeper's default)."),
    Setting("log.level", str, "INFO", "Log level.",
            choices=("DEBUG", "INFO", "WARNING", "ERROR")),
    Setting("log.format", str, "json", "json: one JSON object per line; text: for people.",
            choices=("json", "text")),
)

ROLE_SETTINGS: dict[str, tuple[Setting, ...]] = {
    "partition_server": (
        Setting("partition.max_batch_bytes", int, 1 * MIB, "Largest record batch accepted "
                "(Kafka's default message.max.bytes is about 1 MiB).",
                minimum=1 * KIB, maximum=256 * MIB),
        Setting("partition.flush_policy", str, "fsync", "fsync: acknowledge a produce only "
                "after its batches are fsynced (group commit); none: acknowledge after the "
                "write, leaving durability to the OS (faster, loses data on power failure).",
                choices=("fsync", "none")),
        Setting("partition.durability", str, "wal", "How group commits are made "
                "durable (partition_server/durability.py). fsync: one barrier per process "
                "fsyncs every partition that asked while its previous round ran, at once, "
                "and answers them together; syncfs: the barrier's round is one syncfs of "
                "the filesystem (Linux 5.8+, else fsync; it writes back every dirty file "
                "there, other processes' too: for a data disk of its own); auto: syncfs "
                "for a partition on a filesystem other than the root's (a data volume), "
                "fsync on the root filesystem (docs/benchmarks.md: it paid for many "
                "small transactions, not for consume-transform-produce); executor: each "
                "partition fsyncs its own file on a worker thread; wal: every write of an "
                "unreplicated partition is also a frame of one write-ahead file per server "
                "(server.data_dir/wal), a group commit waits for that file's next write and "
                "fsync, shared by every partition, and the partitions' files are fsynced by "
                "a checkpointer (partition.wal_checkpoint_ms); at start the file is replayed "
                "into them (partition_server/wal.py). Replicated partitions keep fsync, so "
                "on a cluster whose topics have several copies wal changes nothing "
                "(docs/operations.md, \"Durability modes and the write-ahead file\").",
                choices=("auto", "fsync", "syncfs", "executor", "wal")),
        Setting("partition.wal_checkpoint_ms", int, 500, "partition.durability=wal: how often "
                "the partitions' files written since the last checkpoint are fsynced (their "
                "recovery points move, and write-ahead segments below every checkpoint are "
                "deleted). Bounds what a start replays.", minimum=10, maximum=60_000),
        Setting("partition.wal_checkpoint_bytes", int, 4 * MIB, "partition.durability=wal: "
                "a checkpoint also begins once this many bytes were written to the "
                "write-ahead file since the last one began, so that a checkpoint's fsyncs "
                "write back a bounded amount at once (the file's rounds share the disk with "
                "them).", minimum=64 * KIB, maximum=1024 * MIB),
        Setting("partition.wal_segment_bytes", int, 16 * MIB, "partition.durability=wal: the "
                "write-ahead file rolls to a new segment past this size (segments go whole, "
                "once every partition's checkpoint is past them; an owner's reload reads "
                "the segments kept). Each segment is preallocated (this many bytes of "
                "zeros, made ahead of need: the active segment and the next one take this "
                "much disk each from the start).",
                minimum=1 * MIB, maximum=1024 * MIB),
        Setting("partition.wal_max_bytes", int, 2048 * MIB, "partition.durability=wal: most "
                "bytes of write-ahead segments kept; past it group commits fail "
                "(RESOURCE_EXHAUSTED) until checkpoints catch up.",
                minimum=16 * MIB, maximum=1024 * 1024 * MIB),
        Setting("partition.fsync_ring", bool, True, "The fsyncs of "
                "partition.durability=fsync (and auto on the root filesystem) go through an "
                "io_uring of the event loop's own: the fsyncs asked for in one loop turn are "
                "one non-blocking io_uring_enter, run at once on the kernel's workers, and "
                "answered on the loop through an eventfd, instead of the barrier's syncer "
                "thread and its pool: no thread takes the GIL for them (docs/benchmarks.md). "
                "Where io_uring is refused (kernel.io_uring_disabled, a seccomp profile such "
                "as Docker's default) the threads are used; "
                "atomlog_durability_ring_calls_total counts the system calls made. false: "
                "always the threads."),
        Setting("partition.max_group_bytes", int, 8 * MIB, "Most bytes one partition appends "
                "per group commit (one write, one fsync).", minimum=64 * KIB, maximum=1024 * MIB),
        Setting("partition.max_queued_requests", int, 1_000, "Produce requests waiting per "
                "partition; more are refused with RESOURCE_EXHAUSTED.", minimum=1, maximum=1_000_000),
        Setting("partition.max_producers", int, 10_000, "Idempotent producers tracked per "
                "partition; past it a new one makes room by forgetting those idle for more "
                "than an hour, else it is refused with RESOURCE_EXHAUSTED.",
                minimum=1, maximum=10_000_000),
        Setting("partition.producer_idle_expiry_ms", int, 86_400_000, "A producer silent this "
                "long is forgotten (Kafka's default: 1 day); must outlast client retries.",
                minimum=60_000, maximum=365 * 86_400_000),
        Setting("partition.snapshot_interval_batches", int, 1_000, "Producer-state and "
                "transaction-buffer snapshots every N appended batches and markers (Pulsar "
                "snapshots its transaction buffer every 1000 changes).",
                minimum=1, maximum=10_000_000),
        Setting("partition.snapshot_interval_ms", int, 5_000, "... or every T ms if anything "
                "changed (Pulsar: 5 s).", minimum=100, maximum=3_600_000),
        Setting("partition.max_open_transactions", int, 10_000, "Open transactions per "
                "partition; a new one past it is refused with RESOURCE_EXHAUSTED.",
                minimum=1, maximum=10_000_000),
        Setting("partition.max_aborted_transactions", int, 100_000, "Aborted transactions kept "
                "per partition for read_committed filtering; past it the oldest is dropped and "
                "read_committed reads below it fail with OFFSET_OUT_OF_RANGE.",
                minimum=1, maximum=100_000_000),
        Setting("partition.max_remembered_commits", int, 10_000, "Committed transactions "
                "remembered per partition (late writes and repeated markers recognised).",
                minimum=0, maximum=100_000_000),
        Setting("partition.late_write_guard_size", int, 20_000, "Transactions whose markers "
                "each partition remembers for its late-write guard (partition_server/"
                "txn_guard.py; about 200 bytes each, held while the partition is open): a "
                "write verified before the oldest forgotten marker is refused, retriably, "
                "and verified again. Keep it above the markers a partition takes in a "
                "verification's time (partition.txn_verify_timeout_ms).",
                minimum=1_000, maximum=10_000_000),
        Setting("partition.late_transaction_ms", int, 900_000, "An open transaction older "
                "than this counts as late in metrics (set it to the coordinators' "
                "transaction.max_timeout_ms).", minimum=1_000, maximum=604_800_000),
        Setting("partition.txn_check_after_ms", int, 10_000, "Presumed abort: a transaction "
                "open on a partition (data or pending acks) for this long is looked up at its "
                "coordinator; one the coordinator does not know (a one-call transaction that "
                "never committed) is aborted here. Keep it above a one-call transaction's "
                "staging time. One whose TC partition changed coordinators since it was "
                "first seen is looked up at the next round.", minimum=100,
                maximum=3_600_000),
        Setting("replication.max_lag_ms", int, 10_000, "A follower that has not caught up "
                "with its leader for this long leaves the in-sync replicas (a follower whose "
                "server is gone from ZooKeeper leaves at once).", minimum=100, maximum=600_000),
        Setting("replication.fetch_wait_ms", int, 2_000, "How long a follower's Replicate "
                "call waits at the leader for new data (new data answers at once; this "
                "bounds the calls of idle partitions). At most a third of "
                "replication.max_lag_ms is used, so an idle follower still shows it is "
                "caught up.", minimum=10, maximum=30_000),
        Setting("replication.skip_quiet_partitions", bool, True, "A leader skips, in a "
                "follower's ReplicateMany, the partitions its earlier calls found nothing for "
                "and that nothing touched since (an append, a flush, cursors, the log start, "
                "the replicas), recording only their repeat fetch and looking at each in "
                "full again every 5 s (or half of replication.max_lag_ms): a call costs the "
                "written partitions, not all of them (docs/replication.md, \"Quiet "
                "partitions\"). false looks at every partition in every call, as before "
                "2026-12-04."),
        Setting("replication.fetch_sessions", bool, True, "A follower's ReplicateMany "
                "calls to a leader run in a fetch session (Kafka's KIP-227): the leader keeps "
                "every partition the follower asks for, and a call names only the partitions "
                "that changed since the last one, so a call costs both sides the partitions "
                "being written, not all they share (docs/replication.md, \"Fetch sessions\"). "
                "The leader holds sessions only with replication.skip_quiet_partitions. "
                "false names every partition in every call, as before 2026-12-04."),
        Setting("replication.follower_direct_io", bool, True, "Followers write the records "
                "they copy around the page cache (O_DIRECT): a follower's copy is read only "
                "if it is promoted, so it leaves the page cache to the data consumers read "
                "(docs/replication.md). false writes them buffered, as a leader does; file "
                "systems without O_DIRECT write buffered either way."),
        Setting("replication.link", bool, True, "Followers copy from their leaders over "
                "the leaders' replication links (a length-prefixed TCP protocol beside the "
                "gRPC port carrying the same ReplicateMany calls, authenticated and "
                "authorized as gRPC calls are; docs/replication.md), which costs half "
                "of gRPC's CPU per byte; coordinators send their staging, TC-log appends "
                "and markers there too (coordinator.partition_link). With tls.enabled the "
                "link speaks TLS with the gRPC port's certificate, CA and client-certificate "
                "rule; false: no link is opened or used."),
        Setting("replication.link_listen", str, "", "The replication link's listen address; "
                "empty: the host of server.listen, a port picked at start. Advertised to "
                "followers as server.advertised_host (or this host) and the bound port.",
                check=lambda v: check_address(v) if v else None),
        Setting("replication.link_advertised_port", int, 0, "Port followers use to reach "
                "the replication link (a proxy or a NAT in front of it); 0: the bound port.",
                minimum=0, maximum=65_535),
        Setting("server.rack", str, "", "Rack or zone of this partition server: a topic's "
                "replicas go to distinct racks while there are racks."),
        Setting("partition.scrub_bytes_per_s", int, 4 * MIB, "The scrubber reads every "
                "copy this server holds back from disk (around the page cache) and checks "
                "each batch's CRC32C, at most this many bytes a second: a damaged leader copy "
                "enters DATA_LOSS and is handed over, a damaged follower copy is cut at the "
                "damage and fetched again, before the day the copy is needed "
                "(docs/operations.md, \"Scrubbing\"). 0: no scrubbing.",
                minimum=0, maximum=1024 * MIB),
        Setting("partition.scrub_interval_ms", int, 86_400_000, "A scrub pass (every copy "
                "read back once) begins this long after the last one began, or at once if "
                "that one took longer; a restart carries on with the pass under way.",
                minimum=1_000, maximum=30 * 86_400_000),
        Setting("partition.txn_check_interval_ms", int, 1_000, "How often open transactions "
                "are looked over for partition.txn_check_after_ms.",
                minimum=10, maximum=600_000),
        Setting("partition.txn_verify_timeout_ms", int, 10_000, "How long the first write of a "
                "transaction to a partition may wait for its coordinator's answer (retries "
                "included) before it is refused with a retriable reason.",
                minimum=100, maximum=600_000),
        Setting("partition.fetch_max_wait_ms", int, 30_000, "Longest long-poll a Fetch may ask "
                "for.", minimum=0, maximum=600_000),
        Setting("partition.fetch_default_max_bytes", int, 4 * MIB, "Bytes per partition a Fetch "
                "returns when it names no limit.", minimum=1 * KIB, maximum=256 * MIB),
        Setting("partition.max_subscriptions", int, 1_000, "Subscriptions per partition; "
                "CreateSubscription past it is refused with RESOURCE_EXHAUSTED. Keeps a "
                "partition's cursor snapshot bounded (Pulsar and Kafka set no bound).",
                minimum=1, maximum=100_000),
        Setting("subscription.max_ranges", int, 10_000, "Individual acknowledgement ranges "
                "per subscription partition, pending transactional ones included (Pulsar's "
                "managedLedgerMaxUnackedRangesToPersist); an ack growing the table past it is "
                "refused with RESOURCE_EXHAUSTED and new deliveries stop. At most 60,000: one "
                "journal frame (1 MiB) holds an ack of that many ranges.",
                minimum=1, maximum=60_000),
        Setting("subscription.max_pending_transactions", int, 1_000, "Open transactions with "
                "pending acks per subscription partition; a transactional ack of one more is "
                "refused with RESOURCE_EXHAUSTED.", minimum=1, maximum=1_000_000),
        Setting("subscription.max_unacked_offsets", int, 50_000, "Offsets out to consumers or "
                "waiting for redelivery per subscription partition; past it new deliveries "
                "stop (Pulsar's maxUnackedMessagesPerConsumer; bounds volatile memory).",
                minimum=1, maximum=100_000_000),
        Setting("subscription.max_remembered_transactions", int, 1_000, "Ended transactions "
                "remembered per subscription partition (a late transactional ack of one is "
                "refused); the oldest is forgotten.", minimum=0, maximum=1_000_000),
        Setting("subscription.snapshot_interval_entries", int, 1_000, "Snapshot a partition's "
                "subscription cursors after this many journal entries (Pulsar snapshots its "
                "transaction buffer every 1000 changes).", minimum=1, maximum=10_000_000),
        Setting("subscription.max_journal_bytes", int, 64 * MIB, "Snapshot a partition's "
                "subscription cursors once their journal is this long, however few entries; at "
                "twice it changes are refused with RESOURCE_EXHAUSTED.",
                minimum=1 * MIB, maximum=4096 * MIB),
        Setting("subscription.default_ack_timeout_ms", int, 30_000, "Ack timeout of a Receive "
                "that names none: a delivered message not acknowledged within it is "
                "redelivered.", minimum=100, maximum=604_800_000),
        Setting("subscription.max_ack_timeout_ms", int, 3_600_000, "Longest ack timeout a "
                "Receive may ask for; a longer one is cut to it.",
                minimum=100, maximum=604_800_000),
        Setting("subscription.max_offsets_per_receive", int, 10_000, "Most offsets one Receive "
                "delivers per subscription partition.", minimum=1, maximum=1_000_000),
        Setting("subscription.max_verified_acks", int, 100_000, "Transactional-ack "
                "verifications (transaction, subscription) cached per partition; past it the "
                "oldest is forgotten and asked again on its next ack.",
                minimum=1, maximum=10_000_000),
        Setting("storage.segment_bytes", int, 256 * MIB, "Roll to a new segment past this size.",
                minimum=64 * KIB, maximum=1024 * MIB),
        Setting("storage.segment_ms", int, 7 * 86_400_000, "Roll to a new segment after this age.",
                minimum=1_000, maximum=365 * 86_400_000),
        Setting("storage.retention_bytes", int, -1, "Delete the oldest segments past this size per "
                "partition; -1: no limit.", minimum=-1, maximum=1 << 50),
        Setting("storage.retention_ms", int, 7 * 86_400_000, "Delete segments older than this; "
                "-1: keep for ever.", minimum=-1, maximum=3650 * 86_400_000),
        Setting("storage.retention_check_interval_ms", int, 30_000, "How often every partition "
                "here applies its retention (and forgets idle producers past their expiry); "
                "Kafka's log.retention.check.interval.ms.", minimum=100,
                maximum=3_600_000),
        Setting("storage.index_interval_bytes", int, 4 * KIB, "One sparse index entry per this "
                "many bytes of log.", minimum=64, maximum=16 * MIB),
    ),
    "coordinator": (
        Setting("transaction.default_timeout_ms", int, 60_000, "OPEN timeout of a transaction "
                "that asks for none (Kafka: 60 s).", minimum=100, maximum=86_400_000),
        Setting("transaction.max_timeout_ms", int, 900_000, "Largest OPEN timeout a transaction "
                "may ask for (Kafka: 15 min); more fails with INVALID_TRANSACTION_TIMEOUT.",
                minimum=100, maximum=86_400_000),
        Setting("transaction.default_prepared_timeout_ms", int, 900_000, "How long a PREPARED "
                "(two-phase) transaction waits for its decision when it asks for no timeout; "
                "at least the OPEN default, so a driver has time to decide.",
                minimum=100, maximum=604_800_000),
        Setting("transaction.max_prepared_timeout_ms", int, 3_600_000, "Largest prepared timeout "
                "a transaction may ask for.", minimum=100, maximum=604_800_000),
        Setting("transaction.max_open", int, 10_000, "Unfinished transactions (children "
                "included) per TC partition; more fail with RESOURCE_EXHAUSTED.",
                minimum=1, maximum=10_000_000),
        Setting("transaction.max_partitions", int, 1_000, "Partitions plus subscription "
                "partitions per transaction.", minimum=1, maximum=65_535),
        Setting("transaction.max_children", int, 5_000, "Child transactions per parent (Spark "
                "task attempts of one write, speculative ones included).",
                minimum=1, maximum=1_000_000),
        Setting("transaction.max_finished", int, 100_000, "Finished transactions remembered per "
                "TC partition (re-commit answers, idempotency keys); older ones are forgotten "
                "once their callers' retries are over (transaction.finished_grace_ms).",
                minimum=1, maximum=10_000_000),
        Setting("transaction.finished_grace_ms", int, 60_000, "A finished transaction is "
                "remembered at least this long past its deadline, however many finished after "
                "it: its caller may still retry its commit, or settle it with an abort, by "
                "its idempotency key.", minimum=1, maximum=86_400_000),
        Setting("transaction.max_finished_held", int, 400_000, "Finished transactions a TC "
                "partition may remember in all, those held for their callers' retries "
                "included; at it, new transactions fail with RESOURCE_EXHAUSTED until some "
                "are forgotten (at least transaction.max_finished).",
                minimum=1, maximum=40_000_000),
        Setting("transaction.max_sessions", int, 10_000, "Transactional-id sessions per TC "
                "partition.", minimum=1, maximum=10_000_000),
        Setting("transaction.session_expiry_ms", int, 604_800_000, "A session with no "
                "unfinished transaction is forgotten after this much inactivity (Kafka: 7 days).",
                minimum=1_000, maximum=365 * 86_400_000),
        Setting("transaction.max_streams", int, 10_000, "Streams (TxnStream: Spark streaming "
                "queries) whose highest committed step a TC partition keeps; full of live "
                "ones, a commit that would add one fails with RESOURCE_EXHAUSTED.",
                minimum=1, maximum=10_000_000),
        Setting("transaction.stream_expiry_ms", int, 604_800_000, "A stream's highest committed "
                "step is kept this long after its last commit: a step replayed within it "
                "is refused (STREAM_ORDINAL_COMMITTED) however long ago its transaction was "
                "forgotten (as a session: 7 days).", minimum=1_000,
                maximum=365 * 86_400_000),
        Setting("transaction.marker_retry_ms", int, 1_000, "Unconfirmed markers are re-sent this "
                "often.", minimum=10, maximum=600_000),
        Setting("transaction.max_decisions_per_tick", int, 1_000, "Timeout aborts logged per "
                "tick (one batch).", minimum=1, maximum=1_000_000),
        Setting("transaction.max_markers_per_tick", int, 10_000, "Markers (re-)sent per tick.",
                minimum=1, maximum=1_000_000),
        Setting("transaction.default_list_limit", int, 1_000, "Transactions answered by "
                "ListTransactions when the call sets no limit.", minimum=1, maximum=1_000_000),
        Setting("transaction.max_list_limit", int, 10_000, "Most transactions ListTransactions "
                "answers.", minimum=1, maximum=1_000_000),
        Setting("coordinator.tick_interval_ms", int, 100, "How often each TC partition checks "
                "timeouts, due completions and marker re-sends while it has unfinished "
                "transactions (with none, about once a second, and at once when one "
                "begins).", minimum=5, maximum=10_000),
        Setting("coordinator.zookeeper_session_timeout_ms", int, 3_000, "ZooKeeper session "
                "timeout of a coordinator process (instead of zookeeper.session_timeout_ms): "
                "how long after it dies its TC partitions move to the other coordinators, "
                "and how long a paused one keeps them (its coordinator epoch fences it after "
                "that). 0: zookeeper.session_timeout_ms. A combined server uses "
                "zookeeper.session_timeout_ms.", minimum=0, maximum=120_000),
        Setting("coordinator.rebalance_interval_ms", int, 1_000, "How often a coordinator "
                "re-checks the TC partition leases (besides ZooKeeper watches).",
                minimum=50, maximum=60_000),
        Setting("coordinator.snapshot_every_records", int, 20_000, "Snapshot a TC partition into "
                "its log after this many records, then delete the segments below it.",
                minimum=10, maximum=10_000_000),
        Setting("coordinator.snapshot_interval_ms", int, 300_000, "Also snapshot a changed TC "
                "partition at least this often.", minimum=1_000, maximum=86_400_000),
        Setting("coordinator.log_segment_bytes", int, 8 * MIB, "Segment size of the internal "
                "topic __txn_log (set when the coordinator creates it): the log is trimmed a "
                "whole segment at a time.", minimum=64 * KIB, maximum=1024 * MIB),
        Setting("coordinator.expected_partition_servers", int, 0, "Partition servers the "
                "first coordinator waits for (at most coordinator.expected_servers_wait_ms) "
                "before it creates __txn_log, so that the TC log's partitions and replicas "
                "spread over all of them instead of the first to register; 0: create it as "
                "soon as one is registered. `atomlog up` sets it to the servers it starts.",
                minimum=0, maximum=10_000),
        Setting("coordinator.expected_servers_wait_ms", int, 60_000, "Longest wait for "
                "coordinator.expected_partition_servers; then __txn_log is created on the "
                "servers registered (a warning says so).", minimum=0, maximum=3_600_000),
        Setting("coordinator.log_request_timeout_ms", int, 5_000, "Deadline of one append or "
                "read of a TC log; an append whose outcome is unknown is retried (idempotently) "
                "while the lease lasts.", minimum=100, maximum=120_000),
        Setting("coordinator.one_call_max_bytes", int, 1 << 20, "Largest one-call "
                "transaction (CommitTxn: its batches and acks together); the SDK switches a "
                "transaction that outgrows its own bound to NewTxn/Produce/EndTxn.",
                minimum=1_024, maximum=64 << 20),
        Setting("coordinator.parallel_commits", str, "auto", "Commit one-call "
                "transactions in one durability round: a Staging record appended while the "
                "batches and acks are staged, the transaction committed once all are "
                "durable; a coordinator taking over resolves such a record by asking the "
                "partitions (docs/coordinator.md, \"Parallel commits\"). It costs one more "
                "TC-log append per transaction. auto: once 16 one-call commits in a row "
                "began on the coordinator with no other in flight, and not for a commit the "
                "commit lane takes (a combined server): commits that come one at a time "
                "(a sequential client) save a round; commits that overlap share the "
                "servers' CPU, which the extra append would cost them (measured: "
                "docs/benchmarks.md), and keep two rounds. on: every one-call commit (the "
                "commit lane's too). off: none.",
                choices=("auto", "on", "off"),
                aliases={"true": "on", "yes": "on", "1": "on", "false": "off", "no": "off",
                         "0": "off"}),
        Setting("coordinator.commit_lane", bool, True, "Carry out one-call commits whose "
                "partitions this process hosts (the combined server) in the commit lane: "
                "begun, staged on the owners and decided in event-loop callbacks, with no "
                "staging call, instead of through the staging channel "
                "(coordinator/lane.py). Off: every one-call commit takes the staging "
                "channel, as on a cluster."),
        Setting("coordinator.lane_one_round", bool, True, "In the commit lane, a group's "
                "staged batches are written in its own step and every commit whose "
                "batches were all written there (no acks; partitions and TC log unreplicated "
                "on the write-ahead file) is decided and its decision written in that step "
                "too, after its stages, so both share one write-ahead round instead of "
                "waiting for two; the next group waits for that round. While such writes "
                "are on their way, a failed write or fsync of the write-ahead file stops "
                "the server (exit status 74; run it under a supervisor), and the next "
                "start repairs it from the file; a partition of theirs failing on its own "
                "(a full disk's snapshot or recovery-point write) reloads keeping them "
                "(docs/coordinator.md, \"One round a commit\"; docs/operations.md). Off: "
                "the stages' round, then the decision's, and a failed round reloads the "
                "partitions concerned."),
        Setting("coordinator.partition_link", bool, True, "Send StageTxn, the TC-log "
                "appends (Produce) and markers (EndTxnOnPartition) to a partition server "
                "over its link (the length-prefixed TCP protocol of replication.link, beside "
                "its gRPC port; authenticated and authorized as gRPC calls are), which costs "
                "a fraction of a gRPC call's CPU on both sides (docs/coordinator.md, \"The "
                "partition servers' links\"); over TLS when tls.enabled). With false those "
                "calls go over gRPC."),
        Setting("coordinator.client_link", bool, True, "Take clients' transaction calls "
                "(CommitTxn, CommitTxns, NewTxn, EndTxn, ...) on a link too (the "
                "length-prefixed TCP protocol of replication.link, authenticated and "
                "authorized as gRPC calls are; over TLS when tls.enabled), advertised in "
                "the metadata: the SDK sends them there, which costs it and this server "
                "less CPU than gRPC calls (docs/clients.md, \"The link\"). A combined "
                "server serves them on its partition server's link (replication.link_listen) "
                "when it has one. With false clients use gRPC."),
        Setting("coordinator.link_listen", str, "", "The coordinator's link's listen "
                "address (coordinator.client_link); empty: the host of server.listen, a port "
                "picked at start. Advertised as server.advertised_host (or this host) and "
                "the bound port.", check=lambda v: check_address(v) if v else None),
        Setting("coordinator.link_advertised_port", int, 0, "Port clients use to reach the "
                "coordinator's link (a proxy or a NAT in front of it); 0: the bound port.",
                minimum=0, maximum=65_535),
        Setting("coordinator.stage_batch_max", int, 1_000, "Most transactions in one StageTxn "
                "call to a partition server (what queues while one call is in flight leaves "
                "in the next).", minimum=1, maximum=10_000),
        Setting("coordinator.stage_settle_turns", int, 6, "Event-loop turns the staging "
                "queue to a partition server lets pass after a StageTxn call's answers, while "
                "more is queued, before its next call leaves: the decisions and markers those "
                "answers lead to reach the queue and ride in that call (coordinator/staging.py; "
                "docs/benchmarks.md, the fifty-third session). 0 sends at once.",
                minimum=0, maximum=64),
        Setting("coordinator.marker_batch_max", int, 10_000, "Most markers in one "
                "EndTxnOnPartition call.", minimum=1, maximum=10_000),
        Setting("coordinator.marker_linger_ms", int, 50, "A marker of a one-call "
                "transaction waits up to this long for the next StageTxn call to its partition "
                "server and rides inside it, while such calls come at least this often "
                "(coordinator/markers.py). 0 sends every marker in a call of its own.",
                minimum=0, maximum=1_000),
        Setting("coordinator.completion_linger_ms", int, 200, "A TC log append holding only "
                "Completed records (every marker of a transaction confirmed) waits up to this "
                "long to ride along with the next append of the TC partition, unless a caller "
                "waits for a completion (EndTxn wait_for_markers). 0 appends them at once.",
                minimum=0, maximum=10_000),
        Setting("coordinator.max_pending_calls", int, 10_000, "Calls waiting for a TC log append "
                "per TC partition; more fail with RESOURCE_EXHAUSTED.",
                minimum=1, maximum=1_000_000),
    ),
    "id_allocator": (
        Setting("id_allocator.default_block_size", int, 1_000, "Producer ids per block when a "
                "request asks for 0 (Kafka's block size, 1000).", minimum=1, maximum=1_000_000),
        Setting("id_allocator.max_block_size", int, 1_000_000, "Largest block a request may ask "
                "for; larger counts fail with INVALID_ARGUMENT.", minimum=1, maximum=1_000_000_000),
        Setting("id_allocator.cas_max_attempts", int, 16, "Compare-and-set attempts per "
                "allocation before it fails with ID_ALLOCATION_CONFLICT (retriable). Two busy "
                "allocators rarely lose more than 3 in a row.", minimum=1, maximum=1_000),
        Setting("id_allocator.cas_backoff_initial_ms", int, 1, "Backoff bound before the first "
                "retry after a lost compare-and-set; doubles per retry, full jitter.",
                minimum=0, maximum=10_000),
        Setting("id_allocator.cas_backoff_max_ms", int, 10, "Largest backoff bound between "
                "compare-and-set retries (a round is about 1.5 ms, so 10 ms spreads several "
                "contending allocators without starving the loser).", minimum=0, maximum=60_000),
        Setting("id_allocator.zookeeper_op_timeout_ms", int, 5_000, "Longest wait for one "
                "ZooKeeper read or write; a write that times out is an uncertain outcome whose "
                "block is issued only if a re-read proves it ours.", minimum=100, maximum=120_000),
        Setting("id_allocator.max_pending_requests", int, 1_000, "Allocation requests queued in "
                "one process; more are refused with RESOURCE_EXHAUSTED (grpc.max_concurrent_rpcs "
                "is 1000 by default).", minimum=1, maximum=100_000),
        Setting("id_allocator.max_requests_per_write", int, 64, "Queued requests served by one "
                "compare-and-set (one ZooKeeper write issues a block to each).",
                minimum=1, maximum=10_000),
    ),
}


def settings_for(role: str) -> tuple[Setting, ...]:
    if role == COMBINED:
        return COMMON + tuple(s for hosted in hosted_roles(role) for s in ROLE_SETTINGS[hosted])
    if role not in ROLE_SETTINGS:
        raise ValueError(f"unknown role {role!r}; expected one of {list(SERVE_ROLES)}")
    return COMMON + ROLE_SETTINGS[role]


# Cross-setting rules: (roles, rule). A rule returns a problem or None.
Rule = Callable[["Config"], str | None]


def _batch_fits_message(config: "Config") -> str | None:
    batch, message = config["partition.max_batch_bytes"], config["grpc.max_message_bytes"]
    if batch + 64 * KIB > message:
        return (f"partition.max_batch_bytes ({batch}) plus 64 KiB of request overhead must fit "
                f"in grpc.max_message_bytes ({message})")
    return None


def _timeouts_ordered(config: "Config") -> str | None:
    for default, maximum in (("default_timeout_ms", "max_timeout_ms"),
                             ("default_prepared_timeout_ms", "max_prepared_timeout_ms"),
                             ("default_list_limit", "max_list_limit"),
                             ("max_finished", "max_finished_held")):
        low, high = config[f"transaction.{default}"], config[f"transaction.{maximum}"]
        if low > high:
            return f"transaction.{default} ({low}) exceeds transaction.{maximum} ({high})"
    prepared, default = (config["transaction.default_prepared_timeout_ms"],
                         config["transaction.default_timeout_ms"])
    if prepared < default:
        return (f"transaction.default_prepared_timeout_ms ({prepared}) must be at least "
                f"transaction.default_timeout_ms ({default}), so a PREPARED participant "
                "outlives OPEN ones")
    return None


def _id_allocator_limits_ordered(config: "Config") -> str | None:
    default, maximum = config["id_allocator.default_block_size"], config["id_allocator.max_block_size"]
    if default > maximum:
        return (f"id_allocator.default_block_size ({default}) exceeds "
                f"id_allocator.max_block_size ({maximum})")
    initial, most = config["id_allocator.cas_backoff_initial_ms"], config["id_allocator.cas_backoff_max_ms"]
    if initial > most:
        return (f"id_allocator.cas_backoff_initial_ms ({initial}) exceeds "
                f"id_allocator.cas_backoff_max_ms ({most})")
    return None


def _fetch_fits_message(config: "Config") -> str | None:
    fetch, message = config["partition.fetch_default_max_bytes"], config["grpc.max_message_bytes"]
    if fetch + MIB > message:
        return (f"partition.fetch_default_max_bytes ({fetch}) plus 1 MiB of response overhead "
                f"must fit in grpc.max_message_bytes ({message})")
    return None


def _group_fits_batches(config: "Config") -> str | None:
    batch, group = config["partition.max_batch_bytes"], config["partition.max_group_bytes"]
    if group < batch:
        return (f"partition.max_group_bytes ({group}) must be at least "
                f"partition.max_batch_bytes ({batch}), or a full batch could never be written")
    if config["storage.segment_bytes"] < batch:
        return (f"storage.segment_bytes ({config['storage.segment_bytes']}) must be at least "
                f"partition.max_batch_bytes ({batch})")
    return None


def _ack_timeouts_ordered(config: "Config") -> str | None:
    default, maximum = (config["subscription.default_ack_timeout_ms"],
                        config["subscription.max_ack_timeout_ms"])
    if default > maximum:
        return (f"subscription.default_ack_timeout_ms ({default}) exceeds "
                f"subscription.max_ack_timeout_ms ({maximum})")
    return None


def _wal_bound_above_segments(config: "Config") -> str | None:
    segment, bound = config["partition.wal_segment_bytes"], config["partition.wal_max_bytes"]
    if bound < 2 * segment:
        # The active segment counts toward the bound and never goes: at or below one
        # segment, the file refused every write once it filled, for good (nothing
        # written, nothing rolled, nothing trimmed).
        return (f"partition.wal_max_bytes ({bound}) must be at least twice "
                f"partition.wal_segment_bytes ({segment})")
    return None


def _data_dir_required(config: "Config") -> str | None:
    if "partition_server" in hosted_roles(config.role) and not config["server.data_dir"]:
        return "server.data_dir is required for a partition server"
    return None


COMBINED_SUFFIX_MAX = len("-id-allocator")


def role_name(name: str, server_role: str, role: str) -> str:
    """The name `role` registers and acts under in server `name` of `server_role`: the
    server's own name, or in a combined server `<name>` for the partition server (its
    partition assignments follow it) and `<name>-coordinator`, `<name>-id-allocator` for
    the others."""
    if server_role != COMBINED or role == "partition_server":
        return name
    return f"{name}-{role.replace('_', '-')}"


def _combined_name_fits(config: "Config") -> str | None:
    name = config["server.name"]
    if config.role == COMBINED and len(name) > 63 - COMBINED_SUFFIX_MAX:
        return (f"server.name {name!r} is too long for a combined server: its coordinator "
                f"and id allocator register as <name>-coordinator and <name>-id-allocator, "
                f"so at most {63 - COMBINED_SUFFIX_MAX} characters")
    return None


def _tls_usable(config: "Config") -> str | None:
    """With tls.enabled, the three files must be given, readable and parse (the key the
    certificate's); without it, no TLS-only setting may ask for TLS."""
    from services import tls

    if not config["tls.enabled"]:
        asked = [f"{name}={config[name]!r}" for name, off in
                 (("tls.client_auth", "none"), ("tls.metrics", False), ("tls.server_name", ""))
                 if config[name] != off]
        if asked:
            return f"{', '.join(asked)} needs tls.enabled=true"
        return None
    missing = [n for n in ("tls.cert_file", "tls.key_file", "tls.ca_file") if not config[n]]
    if missing:
        return f"tls.enabled=true needs {', '.join(missing)}"
    for name, check in (("tls.ca_file", lambda: tls.check_files(ca_file=config["tls.ca_file"])),
                        ("tls.cert_file", lambda: tls.check_files(
                            cert_file=config["tls.cert_file"], key_file=config["tls.key_file"]))):
        try:
            check()
        except tls.TlsFileError as error:
            which = name if "key file" not in str(error) else "tls.key_file"
            return f"{which}: {error}"
    return None


_AUTH_FILES = (("auth.jwt_key_file", "parse_public_key"), ("auth.jwt_secret_file", "parse_secret"),
               ("auth.static_tokens_file", "parse_static_tokens"),
               ("auth.service_token_file", "parse_token"))
_TOKEN_SETTINGS = ("auth.jwt_issuer", "auth.jwt_audience", "auth.jwt_key_file",
                   "auth.jwt_secret_file", "auth.static_tokens_file", "auth.service_token_file")


def _auth_usable(config: "Config") -> str | None:
    """auth.mode's needs: mTLS needs client certificates; tokens need a way to check them
    (and a server's own token); token settings are refused where no token is read; every
    file is read and parsed."""
    from services import auth

    mode = config["auth.mode"]
    problems = []
    if mode in ("mtls", "mtls_or_token") and not (
            config["tls.enabled"] and config["tls.client_auth"] == "require"):
        problems.append(f"auth.mode={mode} needs tls.enabled=true and tls.client_auth=require "
                        "(client certificates)")
    if mode in ("none", "mtls"):
        given = [name for name in _TOKEN_SETTINGS if config[name]]
        if given:
            problems.append(f"{', '.join(given)} set, but auth.mode={mode} reads no tokens "
                            "(auth.mode=token or mtls_or_token)")
    if mode == "none" and config["auth.service_principals"]:
        problems.append("auth.service_principals set, but auth.mode=none")
    if mode in ("token", "mtls_or_token"):
        if not (config["auth.jwt_key_file"] or config["auth.jwt_secret_file"]
                or config["auth.static_tokens_file"]):
            problems.append(f"auth.mode={mode} needs auth.jwt_key_file, auth.jwt_secret_file "
                            "or auth.static_tokens_file (how tokens are checked)")
        jwt_keys = config["auth.jwt_key_file"] or config["auth.jwt_secret_file"]
        for name in ("auth.jwt_issuer", "auth.jwt_audience"):
            if jwt_keys and not config[name]:
                problems.append(f"{name} is needed with a JWT key or secret (every JWT's "
                                f"{'iss' if name.endswith('issuer') else 'aud'} is checked)")
            if config[name] and not jwt_keys:
                problems.append(f"{name} set, but no auth.jwt_key_file or auth.jwt_secret_file")
        if mode == "token" and not config["auth.service_token_file"]:
            problems.append("auth.mode=token needs auth.service_token_file (the token this "
                            "server sends to the other servers)")
    for name, parser in _AUTH_FILES:
        if config[name] and not problems:
            try:
                data = Path(config[name]).read_bytes()
                getattr(auth, parser)(data, config[name])
            except OSError as error:
                problems.append(f"{name}: cannot read {config[name]}: {error.strerror or error}")
            except auth.AuthFileError as error:
                problems.append(f"{name}: {error}")
    return "; ".join(problems) or None


def _authorizer_usable(config: "Config") -> str | None:
    """auth.authorizer=acl needs authenticated principals; auth.super_users needs it; the
    ZooKeeper digest file must hold `user:password`."""
    problems = []
    if config["auth.authorizer"] == "acl" and config["auth.mode"] == "none":
        problems.append("auth.authorizer=acl needs auth.mode mtls, token or mtls_or_token "
                        "(ACLs name authenticated principals)")
    if config["auth.super_users"] and config["auth.authorizer"] != "acl":
        problems.append("auth.super_users set, but auth.authorizer is not acl")
    if config["zookeeper.digest_file"]:
        from services.zk import DigestFileError, read_digest

        try:
            read_digest(config["zookeeper.digest_file"])
        except DigestFileError as error:
            problems.append(f"zookeeper.digest_file: {error}")
    return "; ".join(problems) or None


RULES: tuple[tuple[tuple[str, ...], Rule], ...] = (
    ((*ROLES, COMBINED), _tls_usable),
    ((*ROLES, COMBINED), _authorizer_usable),
    ((*ROLES, COMBINED), _auth_usable),
    ((COMBINED,), _combined_name_fits),
    (("partition_server",), _batch_fits_message),
    (("coordinator",), _timeouts_ordered),
    (("partition_server",), _data_dir_required),
    (("partition_server",), _group_fits_batches),
    (("partition_server",), _fetch_fits_message),
    (("partition_server",), _ack_timeouts_ordered),
    (("partition_server",), _wal_bound_above_segments),
    (("id_allocator",), _id_allocator_limits_ordered),
)


class Config(Mapping[str, Any]):
    """Validated, immutable settings of one server, with where each value came from."""

    def __init__(self, role: str, values: dict[str, Any], sources: dict[str, str]):
        self.role = role
        self._values = dict(values)
        self.sources = dict(sources)

    def __getitem__(self, name: str) -> Any:
        return self._values[name]

    def __iter__(self):
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def as_dict(self) -> dict[str, Any]:
        return dict(self._values)


def _flatten(table: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in table.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def load_config(role: str, file: str | Path | None = None,
                env: Mapping[str, str] | None = None,
                overrides: Mapping[str, Any] | None = None) -> Config:
    """Merge defaults, file, environment and overrides; validate; raise ConfigError."""
    settings = {s.name: s for s in settings_for(role)}
    env = os.environ if env is None else env
    problems: list[str] = []
    layers: list[tuple[str, Mapping[str, Any]]] = []
    if file is not None:
        try:
            with open(file, "rb") as handle:
                layers.append((f"file {file}", _flatten(tomllib.load(handle))))
        except (OSError, tomllib.TOMLDecodeError) as error:
            problems.append(f"cannot read config file {file}: {error}")
    layers.append(("environment", {s.name: env[s.env_name] for s in settings.values()
                                   if s.env_name in env}))
    layers.append(("flags", dict(overrides or {})))

    values = {name: s.default for name, s in settings.items()}
    sources = {name: "default" for name in settings}
    for source, layer in layers:
        for name, raw in layer.items():
            setting = settings.get(name)
            if setting is None:
                problems.append(f"unknown setting {name!r} from {source}"
                                f"{_did_you_mean(name, settings)}")
                continue
            try:
                values[name] = setting.parse(raw, source)
                sources[name] = source if source != "environment" else setting.env_name
            except ValueError as error:
                problems.append(str(error))
    if problems:
        raise ConfigError(problems)
    config = Config(role, values, sources)
    hosted = {role, *hosted_roles(role)}
    problems = [p for roles, rule in RULES if hosted & set(roles) for p in [rule(config)] if p]
    if problems:
        raise ConfigError(problems)
    return config


def role_settings(settings: Mapping[str, Any], role: str) -> dict[str, Any]:
    """The subset of cluster-wide settings a role knows (`atomlog up --set` passes each
    process only those)."""
    known = {s.name for s in settings_for(role)}
    return {k: v for k, v in settings.items() if k in known}


def check_cluster_settings(settings: Mapping[str, Any], tls: bool = False) -> None:
    """Every setting must be known to some role, and valid for every role that knows it.
    `tls`: the cluster's processes also get tls.* settings of their own (`up --tls`):
    checked as if with a certificate of a throwaway CA."""
    every = {s.name for role in ROLES for s in settings_for(role)}
    unknown = [f"unknown setting {k!r} from flags{_did_you_mean(k, every)}"
               for k in settings if k not in every]
    if unknown:
        raise ConfigError(unknown)
    if tls:
        import tempfile

        from services.tls import LocalCa

        with tempfile.TemporaryDirectory(prefix="atomlog-tls-check") as scratch:
            ca = LocalCa(Path(scratch))
            ca.issue(Path(scratch) / "s.crt", Path(scratch) / "s.key", "check", ["127.0.0.1"])
            base = {"tls.enabled": "true", "tls.ca_file": str(ca.ca_file),
                    "tls.cert_file": f"{scratch}/s.crt", "tls.key_file": f"{scratch}/s.key",
                    "tls.client_auth": "require", "auth.mode": "mtls", "auth.authorizer": "acl"}
            return check_cluster_settings({**base, **settings})
    for role in ROLES:
        load_config(role, env={}, overrides={**role_settings(settings, role),
                                             "server.data_dir": "/tmp"})


def _did_you_mean(name: str, settings: Iterable[str]) -> str:
    import difflib

    close = difflib.get_close_matches(name, list(settings), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def parse_assignments(pairs: Iterable[str]) -> dict[str, str]:
    """Parse repeated `--set name=value` flags."""
    result: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name.strip():
            raise ConfigError([f"--set expects name=value, got {pair!r}"])
        result[name.strip()] = value
    return result


def describe(role: str) -> str:
    """A table of every setting of a role, for --help-config and docs."""
    rows = []
    for s in settings_for(role):
        bounds = ""
        if s.minimum is not None or s.maximum is not None:
            bounds = f" [{s.minimum if s.minimum is not None else ''}..{s.maximum if s.maximum is not None else ''}]"
        if s.choices:
            bounds = f" {{{'|'.join(s.choices)}}}"
        rows.append(f"{s.name} = {s.default!r}{bounds}\n    env {s.env_name}. {s.meaning}")
    return "\n".join(rows)
