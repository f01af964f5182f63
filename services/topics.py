"""Topic rules — pure functions, no I/O: name and config validation, and the even
assignment of a topic's partitions to partition servers."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from partition_server.replication import reassigning_replicas
from services.errors import AtomlogError

MAX_TOPIC_NAME_LENGTH = 249  # Kafka's limit: leaves room for "-<partition>" in file names
_TOPIC_NAME = re.compile(r"^[A-Za-z0-9._\-]+$")
INTERNAL_PREFIX = "__"
# The TC logs: partition k is TC partition k's durable log (coordinator/txn_log.py).
TXN_LOG_TOPIC = "__txn_log"


@dataclass(frozen=True)
class TopicSetting:
    minimum: int | None = None
    maximum: int | None = None
    choices: tuple[str, ...] | None = None
    allow_minus_one: bool = False  # -1 means "no limit"
    # Values a Kafka user may expect and atomlog refuses, with why (no silent no-op).
    unsupported: Mapping[str, str] = field(default_factory=dict)


DAY_MS = 86_400_000
# Per-topic settings a creator may give; everything else is refused.
TOPIC_SETTINGS: dict[str, TopicSetting] = {
    "retention.ms": TopicSetting(minimum=1_000, maximum=3650 * DAY_MS, allow_minus_one=True),
    "retention.bytes": TopicSetting(minimum=1 << 20, maximum=1 << 50, allow_minus_one=True),
    "segment.bytes": TopicSetting(minimum=1 << 16, maximum=1 << 30),
    "segment.ms": TopicSetting(minimum=1_000, maximum=365 * DAY_MS),
    # Keyed compaction is not implemented (docs/record-format.md, "Compaction"). It used
    # to be accepted and ignored: a topic created to keep the last record of each key
    # forever then lost its records to retention, without a word.
    "cleanup.policy": TopicSetting(choices=("delete",), unsupported={
        "compact": "keyed compaction is not implemented: a compacted topic's records would "
                   "be deleted by retention like any other's. For the last record per key "
                   "kept forever, use retention.ms=-1 and retention.bytes=-1 (nothing is "
                   "deleted) and keep the latest value per key on the reader's side; "
                   "docs/record-format.md, \"Compaction\""}),
    # Replicated topics (docs/replication.md); checked against the factor at creation.
    "min.insync.replicas": TopicSetting(minimum=1, maximum=7),
    "unclean.leader.election.enable": TopicSetting(choices=("false", "true")),
}


def validate_topic_name(name: str, *, internal_allowed: bool = False) -> None:
    if not name:
        raise AtomlogError("INVALID_TOPIC_NAME", "topic name is empty")
    if len(name) > MAX_TOPIC_NAME_LENGTH:
        raise AtomlogError("INVALID_TOPIC_NAME",
                           f"topic name has {len(name)} characters; at most {MAX_TOPIC_NAME_LENGTH}")
    if name in (".", ".."):
        raise AtomlogError("INVALID_TOPIC_NAME", f"topic name {name!r} is not allowed")
    if not _TOPIC_NAME.match(name):
        raise AtomlogError("INVALID_TOPIC_NAME",
                           f"topic name {name!r} has characters outside [a-zA-Z0-9._-]")
    if name.startswith(INTERNAL_PREFIX) and not internal_allowed:
        raise AtomlogError("INVALID_TOPIC_NAME",
                           f"topic name {name!r}: names starting with '__' are reserved for "
                           "internal topics")


def validate_partition_count(partitions: int, max_partitions: int) -> None:
    if not 1 <= partitions <= max_partitions:
        raise AtomlogError("INVALID_PARTITION_COUNT",
                           f"partitions={partitions}; a topic needs between 1 and "
                           f"{max_partitions} (topics.max_partitions)",
                           {"max_partitions": str(max_partitions)})


def validate_topic_config(config: Mapping[str, str]) -> dict[str, str]:
    """Check every key and value; return the normalized config."""
    normalized: dict[str, str] = {}
    for key, raw in sorted(config.items()):
        setting = TOPIC_SETTINGS.get(key)
        if setting is None:
            raise AtomlogError("INVALID_TOPIC_CONFIG",
                               f"unknown topic setting {key!r}; known: {sorted(TOPIC_SETTINGS)}")
        if raw in setting.unsupported:
            raise AtomlogError("INVALID_TOPIC_CONFIG",
                               f"{key}={raw!r} is not supported: {setting.unsupported[raw]}")
        if setting.choices is not None:
            if raw not in setting.choices:
                raise AtomlogError("INVALID_TOPIC_CONFIG",
                                   f"{key}={raw!r} is not one of {list(setting.choices)}")
            normalized[key] = raw
            continue
        try:
            value = int(raw)
        except ValueError:
            raise AtomlogError("INVALID_TOPIC_CONFIG", f"{key}={raw!r} is not an integer") from None
        if not (setting.allow_minus_one and value == -1):
            if (setting.minimum is not None and value < setting.minimum) or (
                    setting.maximum is not None and value > setting.maximum):
                raise AtomlogError("INVALID_TOPIC_CONFIG",
                                   f"{key}={value} is outside [{setting.minimum}, {setting.maximum}]"
                                   + (" (or -1 for no limit)" if setting.allow_minus_one else ""))
        normalized[key] = str(value)
    return normalized


# Settings that only a topic with replication state has (a record of version 2).
REPLICATION_SETTINGS = ("min.insync.replicas", "unclean.leader.election.enable")


def altered_config(record: "TopicRecord", to_set: Mapping[str, str],
                   to_delete: Iterable[str]) -> dict[str, str]:
    """The normalized config `record` gets when `to_set` is added or replaces and
    `to_delete` is removed (AlterTopicConfig), checked as a whole: every key known, every
    value valid, no key both set and deleted, no replication setting on a topic without
    replication state, and min.insync.replicas within every partition's copies (a running
    reassignment's target too), and on an internal topic only replication settings.
    Raises INVALID_TOPIC_CONFIG."""
    to_delete = list(to_delete)
    unknown = sorted(k for k in to_delete if k not in TOPIC_SETTINGS)
    if unknown:
        raise AtomlogError("INVALID_TOPIC_CONFIG",
                           f"unknown topic setting(s) to delete {unknown}; known: "
                           f"{sorted(TOPIC_SETTINGS)}")
    both = sorted(set(to_set) & set(to_delete))
    if both:
        raise AtomlogError("INVALID_TOPIC_CONFIG", f"{both} both set and deleted")
    storage = sorted(k for k in [*to_set, *to_delete] if k not in REPLICATION_SETTINGS)
    if record.internal and storage:
        raise AtomlogError("INVALID_TOPIC_CONFIG",
                           f"{storage} of internal topic {record.name!r} are the cluster's "
                           "(a shorter retention of __txn_log would delete decisions still "
                           "needed); only its replication settings may change")
    merged = {k: v for k, v in record.config.items() if k not in to_delete}
    merged.update(to_set)
    normalized = validate_topic_config(merged)
    if not record.replicated:
        given = sorted(k for k in REPLICATION_SETTINGS if k in to_set)
        if given:
            raise AtomlogError(
                "INVALID_TOPIC_CONFIG",
                f"topic {record.name!r} keeps one copy per partition without replication "
                f"state (created with replication factor 1): {given} would mean nothing; "
                "create a topic with -r 2 or more, or min.insync.replicas=1 for one movable "
                "copy")
        return normalized
    # The effective value, set or defaulted (a deleted setting falls back to the
    # default, which may be more than a partition reassigned to fewer copies has).
    wanted = int(normalized.get("min.insync.replicas", min(2, record.replication_factor)))
    fewest = min(len(record.reassigning.get(p) or record.replicas_of(p))
                 for p in range(record.partitions))
    if wanted > fewest:
        raise AtomlogError("INVALID_TOPIC_CONFIG",
                           f"min.insync.replicas={wanted}"
                           f"{'' if 'min.insync.replicas' in normalized else ' (the default)'}"
                           f" must be 1..{fewest} (the fewest copies any partition of "
                           f"{record.name!r} has or is moving to)")
    return normalized


def assign_partitions(partitions: int, servers: list[str],
                      load: Mapping[str, int] | None = None) -> list[str]:
    """Owner of each partition: every server gets partitions//len(servers) or one
    more; the extra ones go to the least loaded servers (by partitions already owned),
    and consecutive partitions land on different servers."""
    if not servers:
        raise AtomlogError("NO_PARTITION_SERVERS",
                           "no partition server is registered; cannot assign partitions")
    load = load or {}
    ordered = sorted(set(servers), key=lambda s: (load.get(s, 0), s))
    base, extra = divmod(partitions, len(ordered))
    quota = {s: base + (1 if i < extra else 0) for i, s in enumerate(ordered)}
    assignment: list[str] = []
    while len(assignment) < partitions:
        for server in ordered:
            if quota[server] > 0:
                quota[server] -= 1
                assignment.append(server)
    return assignment


@dataclass
class TopicRecord:
    """What ZooKeeper stores at /topics/<name>.

    Version 1: `assignment`, one owner per partition (one copy). Version 2 (replicated,
    docs/replication.md): `replicas`, the servers holding each partition, the preferred
    leader first; `assignment` is then the preferred leaders, and the current leader of a
    partition is in its state at /partitions/<name>/<p> (`leaders`, filled by readers that
    looked there: None when not read, "" for an offline partition)."""

    name: str
    assignment: list[str]
    config: dict[str, str] = field(default_factory=dict)
    created_unix_ms: int = 0
    version: int = 1
    replicas: list[list[str]] | None = None
    # Running reassignments (docs/replication.md): partition -> its target replica list;
    # meanwhile `replicas` holds the target and then the replicas that will leave.
    reassigning: dict[int, list[str]] = field(default_factory=dict)
    # A running reassignment's throttle: partition -> bytes/s its new replicas may copy
    # (absent: unthrottled).
    throttles: dict[int, int] = field(default_factory=dict)
    leaders: list[str] | None = field(default=None, compare=False)
    states: list | None = field(default=None, compare=False)  # PartitionState per partition

    @property
    def partitions(self) -> int:
        return len(self.assignment)

    @property
    def internal(self) -> bool:
        return self.name.startswith(INTERNAL_PREFIX)

    @property
    def replicated(self) -> bool:
        return self.replicas is not None

    @property
    def replication_factor(self) -> int:
        return len(self.reassigning.get(0) or self.replicas[0]) if self.replicas else 1

    @property
    def min_insync_replicas(self) -> int:
        return int(self.config.get("min.insync.replicas", min(2, self.replication_factor)))

    @property
    def unclean_election(self) -> bool:
        return self.config.get("unclean.leader.election.enable") == "true"

    def replicas_of(self, partition: int) -> list[str]:
        return list(self.replicas[partition]) if self.replicas else [self.assignment[partition]]

    @property
    def owners(self) -> list[str]:
        """Who serves each partition now: the leaders when they were read, else the
        assignment ("" for an offline partition)."""
        return self.leaders if self.leaders is not None else self.assignment

    def to_json(self) -> dict:
        data = {"version": self.version, "assignment": self.assignment, "config": self.config,
                "created_unix_ms": self.created_unix_ms}
        if self.replicas is not None:
            data["replicas"] = self.replicas
        if self.reassigning:
            data["reassigning"] = {str(p): t for p, t in sorted(self.reassigning.items())}
        if self.throttles:
            data["reassign_throttle"] = {str(p): b for p, b in sorted(self.throttles.items())}
        return data

    def reassigned(self, partition: int, target: list[str],
                   throttle: int = 0) -> "TopicRecord | None":
        """The record with a reassignment of `partition` to `target` begun (replacing one
        that runs, throttle included: `throttle` bytes/s for its new replicas' copies, 0
        for none), or None when the partition has exactly those replicas already."""
        current = self.replicas_of(partition)
        if target == current and partition not in self.reassigning:
            return None
        replicas = [list(r) for r in self.replicas]
        replicas[partition] = reassigning_replicas(current, target)
        throttles = {p: b for p, b in self.throttles.items() if p != partition}
        if throttle:
            throttles[partition] = throttle
        return self._with(partition, replicas, {**self.reassigning, partition: list(target)},
                          throttles)

    def reassignment_done(self, partition: int) -> "TopicRecord":
        """The record once `partition`'s reassignment completed: its replicas are the target."""
        target = self.reassigning[partition]
        replicas = [list(r) for r in self.replicas]
        replicas[partition] = list(target)
        rest = {p: t for p, t in self.reassigning.items() if p != partition}
        return self._with(partition, replicas, rest,
                          {p: b for p, b in self.throttles.items() if p != partition})

    def throttle_of(self, partition: int) -> int:
        """Bytes/s the new replicas of `partition`'s running reassignment may copy (0: no
        throttle)."""
        return self.throttles.get(partition, 0) if partition in self.reassigning else 0

    def _with(self, partition: int, replicas: list[list[str]],
              reassigning: dict[int, list[str]], throttles: dict[int, int]) -> "TopicRecord":
        assignment = list(self.assignment)
        assignment[partition] = replicas[partition][0]  # the preferred leader
        return TopicRecord(self.name, assignment, dict(self.config), self.created_unix_ms,
                           self.version, replicas, reassigning, throttles)

    @classmethod
    def from_json(cls, name: str, data: dict) -> "TopicRecord":
        version = data.get("version")
        if version not in (1, 2) or not isinstance(data.get("assignment"), list):
            raise ValueError(f"topic {name!r}: unreadable record {data!r}")
        replicas = None
        if version == 2:
            replicas = data.get("replicas")
            if (not isinstance(replicas, list) or len(replicas) != len(data["assignment"])
                    or not all(isinstance(r, list) and r and all(isinstance(n, str) for n in r)
                               for r in replicas)):
                raise ValueError(f"topic {name!r}: unreadable replicas {replicas!r}")
            replicas = [list(r) for r in replicas]
        reassigning: dict[int, list[str]] = {}
        for key, target in (data.get("reassigning") or {}).items():
            if (replicas is None or not str(key).isdigit() or int(key) >= len(replicas)
                    or not isinstance(target, list) or not target
                    or not all(isinstance(n, str) and n in replicas[int(key)] for n in target)):
                raise ValueError(f"topic {name!r}: unreadable reassignment {key!r}: {target!r}")
            reassigning[int(key)] = list(target)
        throttles: dict[int, int] = {}
        for key, rate in (data.get("reassign_throttle") or {}).items():
            if not str(key).isdigit() or not isinstance(rate, int) or rate <= 0:
                raise ValueError(f"topic {name!r}: unreadable reassignment throttle {key!r}: "
                                 f"{rate!r}")
            throttles[int(key)] = rate
        return cls(name, list(data["assignment"]), dict(data.get("config", {})),
                   int(data.get("created_unix_ms", 0)), version, replicas, reassigning,
                   throttles)
