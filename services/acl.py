"""Authorization (issue 24, item 3): access control lists, checked in one place per call.

An ACL entry allows or denies one principal (or `*`, everyone) one operation on the
resources of one type whose name equals (pattern `literal`; the literal name `*` matches
every name) or starts with (pattern `prefix`) the entry's name:

    resource types  topic, subscription, transactional_id, cluster, transaction_admin
    operations      read, write, create, describe, alter, abort

Deny wins over allow; nothing allowed is denied (default deny). An allow of read, write,
create, alter or abort on a resource also allows describe on it (as in Kafka).

The pure core (no I/O, no grpc, no clock):
- `Acl`, `AclSet`: the entries and the rule evaluation (`AclSet.allows`);
- `requirement(method, request)`: the per-RPC table — which permissions a request needs
  (one per topic, subscription and transactional id it names), whether only a service
  principal may call it, and which transaction's owner matters. Every RPC of every
  service is in `TABLE`; a method that is not is refused (fail closed);
- `decide(...)`: the verdict for one call, a `Denial` naming the missing permission or
  None;
- `TxnOwners`: the principal that opened each transaction (bounded), and the idempotency
  key it opened it by, recorded by the coordinator's shell when NewTxn answers, so a call
  on another principal's transaction (by its id, or by its key) can be told from one on
  the caller's own. The partition servers learn it (`Authorizer.opener`, answered by
  VerifyTxnPartitions) when they verify a transactional write or ack.

Rules that are not ACL entries:
- principals of auth.super_users may do everything ACLs govern, but not the internal RPCs;
- service principals (auth.service_principals) hold every operation on the `cluster`
  resource; the internal RPCs (markers, staging, verification, producer-id blocks) need
  a service principal *and* that permission, so no client can call them whatever the ACLs;
- internal topics (names starting with `__`, e.g. the TC log `__txn_log`) are the
  cluster's: touching one needs the same operation on the `cluster` resource.

The shell (bottom of this file): `AclStore` reads and writes the ACL znode (CLI), and
`Authorizer` keeps a ZooKeeper-watched `AclSet` per server and is called by the server
interceptor (services/interceptors.py) before the servicer runs; a denial is
PERMISSION_DENIED with ErrorInfo metadata operation, resource_type, resource_name,
logged and counted in atomlog_authorization_denied_total{operation,resource_type}.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import logging
import threading
import weakref
from dataclasses import dataclass
from typing import Callable, Iterable

RESOURCE_TYPES = ("topic", "subscription", "transactional_id", "cluster", "transaction_admin")
OPERATIONS = ("read", "write", "create", "describe", "alter", "abort")
PATTERNS = ("literal", "prefix")
PERMISSIONS = ("allow", "deny")
WILDCARD = "*"
# The name of the one cluster resource (and of the transaction-admin resource).
CLUSTER = "atomlog"
INTERNAL_TOPIC_PREFIX = "__"
# Operations whose allow also allows describe.
_IMPLY_DESCRIBE = frozenset({"read", "write", "create", "alter", "abort"})
# Bounds: the ACL znode is one JSON document (ZooKeeper's jute.maxbuffer is 1 MiB); a
# 10,000-entry set is about 1 MiB, Kafka clusters rarely hold more than a few thousand.
MAX_ACLS = 10_000
MAX_NAME_BYTES = 512
# Transactions whose opener is remembered per coordinator process: forgotten once the
# transaction completes (`transaction_completed`), so the table holds open ones only; the
# bound is transaction.max_open (10,000 by default) times the 16 TC partitions a process
# may own, with room to spare, so that no principal can push another's open
# transaction out of it by opening (and abandoning) transactions of its own: its
# opener would become unknown, which lets anyone end it. Past it, the oldest goes.
MAX_REMEMBERED_OWNERS = 200_000
# Answers cached per ACL set (principal, permission): emptied when full.
MAX_CACHED_ANSWERS = 100_000
ACLS_PATH = "/acls"
ZNODE_VERSION = 1


class AclError(ValueError):
    """A malformed ACL entry or ACL document (a full sentence)."""


@dataclass(frozen=True)
class Acl:
    principal: str
    resource_type: str
    name: str
    operation: str
    permission: str = "allow"
    pattern: str = "literal"

    def __post_init__(self):
        checks = ((self.resource_type, RESOURCE_TYPES, "resource type"),
                  (self.operation, OPERATIONS, "operation"),
                  (self.permission, PERMISSIONS, "permission"),
                  (self.pattern, PATTERNS, "pattern"))
        for value, allowed, what in checks:
            if value not in allowed:
                raise AclError(f"{what} {value!r} is not one of {list(allowed)}")
        for value, what in ((self.principal, "principal"), (self.name, "resource name")):
            if not isinstance(value, str) or not value or len(value.encode()) > MAX_NAME_BYTES \
                    or any(c.isspace() for c in value):
                raise AclError(f"{what} {value!r} must be 1-{MAX_NAME_BYTES} bytes without spaces")
        if self.pattern == "prefix" and self.name == WILDCARD:
            raise AclError("a prefix pattern of '*' is meaningless: use the literal name '*'")

    def matches_name(self, name: str) -> bool:
        if self.pattern == "prefix":
            return name.startswith(self.name)
        return self.name == WILDCARD or self.name == name

    def to_json(self) -> dict:
        return {"principal": self.principal, "resource_type": self.resource_type,
                "name": self.name, "pattern": self.pattern, "operation": self.operation,
                "permission": self.permission}

    @classmethod
    def from_json(cls, data: dict) -> "Acl":
        try:
            return cls(data["principal"], data["resource_type"], data["name"],
                       data["operation"], data.get("permission", "allow"),
                       data.get("pattern", "literal"))
        except (KeyError, TypeError) as error:
            raise AclError(f"an ACL entry lacks {error}") from None

    def describe(self) -> str:
        name = f"{self.name}*" if self.pattern == "prefix" else self.name
        return (f"{self.permission} {self.principal} {self.operation} on "
                f"{self.resource_type} {name}")


@dataclass(frozen=True)
class Permission:
    """One thing a call needs: `operation` on the resource (`resource_type`, `name`)."""

    operation: str
    resource_type: str
    name: str

    def __post_init__(self):
        assert self.operation in OPERATIONS and self.resource_type in RESOURCE_TYPES, self


class AclSet:
    """An immutable set of ACL entries, indexed by (resource type, operation, permission):
    literal names in a dict, prefixes in a list; answers are cached (bounded)."""

    def __init__(self, acls: Iterable[Acl] = ()):
        self.acls: tuple[Acl, ...] = tuple(dict.fromkeys(acls))  # unique, in order
        if len(self.acls) > MAX_ACLS:
            raise AclError(f"{len(self.acls)} ACL entries; at most {MAX_ACLS}")
        # (resource type, operation, permission) -> (literal name -> principals,
        # [(prefix, principal)])
        self._index: dict[tuple[str, str, str], tuple[dict[str, set[str]], list]] = {}
        for acl in self.acls:
            literal, prefixes = self._index.setdefault(
                (acl.resource_type, acl.operation, acl.permission), ({}, []))
            if acl.pattern == "prefix":
                prefixes.append((acl.name, acl.principal))
            else:
                literal.setdefault(acl.name, set()).add(acl.principal)
        self._answers: dict[tuple[str, Permission], bool] = {}

    def __len__(self) -> int:
        return len(self.acls)

    def matches(self, principal: str, resource_type: str, operation: str, name: str,
                permission: str) -> bool:
        """Does an entry of `permission` (allow or deny) cover this?"""
        found = self._index.get((resource_type, operation, permission))
        if found is None:
            return False
        literal, prefixes = found
        for key in (name, WILDCARD):
            principals = literal.get(key)
            if principals and (principal in principals or WILDCARD in principals):
                return True
        return any(name.startswith(prefix) and who in (principal, WILDCARD)
                   for prefix, who in prefixes)

    def allows(self, principal: str, permission: Permission) -> bool:
        """Deny wins; then an allow (of the operation, or of one implying describe)."""
        key = (principal, permission)
        answer = self._answers.get(key)
        if answer is None:
            answer = self._allows(principal, permission)
            if len(self._answers) >= MAX_CACHED_ANSWERS:
                self._answers.clear()
            self._answers[key] = answer
        return answer

    def denies(self, principal: str, permission: Permission) -> bool:
        return self.matches(principal, permission.resource_type, permission.operation,
                            permission.name, "deny")

    def _allows(self, principal: str, permission: Permission) -> bool:
        kind, name = permission.resource_type, permission.name
        if self.matches(principal, kind, permission.operation, name, "deny"):
            return False
        if self.matches(principal, kind, permission.operation, name, "allow"):
            return True
        return permission.operation == "describe" and any(
            self.matches(principal, kind, operation, name, "allow")
            for operation in _IMPLY_DESCRIBE)

    def added(self, acls: Iterable[Acl]) -> "AclSet":
        return AclSet([*self.acls, *acls])

    def removed(self, acls: Iterable[Acl]) -> "AclSet":
        gone = set(acls)
        return AclSet([acl for acl in self.acls if acl not in gone])

    def encode(self) -> bytes:
        return json.dumps({"version": ZNODE_VERSION, "acls": [a.to_json() for a in self.acls]},
                          separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes | None) -> "AclSet":
        """The ACL znode's contents (empty or missing: no entries)."""
        if not data:
            return cls()
        try:
            document = json.loads(data)
        except ValueError as error:
            raise AclError(f"the ACL znode is not JSON: {error}") from None
        if not isinstance(document, dict) or document.get("version") != ZNODE_VERSION:
            raise AclError(f"the ACL znode is not a version {ZNODE_VERSION} ACL document")
        return cls(Acl.from_json(entry) for entry in document.get("acls", []))


# ------------------------------------------------------------------ the per-RPC table
@dataclass(frozen=True)
class Requirement:
    """What one request needs. `owner_txn`: (tc_partition, sequence) of the transaction the
    call acts on; `owner_rule` then says what a caller who did not open it needs:
    `owner_or_admin` (AbortTransaction, DescribeTransaction: the opener, or `admin` on
    transaction_admin; an unknown opener counts as someone else) or `not_other_owner`
    (calls continuing a transaction: when another principal is known to have opened it,
    `admin` on transaction_admin)."""

    permissions: tuple[Permission, ...] = ()
    service_only: bool = False
    owner_txn: tuple[int, int] | None = None
    owner_rule: str = ""
    admin: Permission | None = None
    # (tc_partition, idempotency key) of each transaction the call names by its key
    # (NewTxn, CommitTxn): when another principal is known to have opened one, `admin`
    # on transaction_admin (TXN_ADMIN), as for `not_other_owner`.
    owner_keys: tuple[tuple[int, str], ...] = ()


@functools.lru_cache(maxsize=10_000)
def _topic(operation: str, topic: str) -> Permission:
    if topic.startswith(INTERNAL_TOPIC_PREFIX):
        return Permission(operation, "cluster", CLUSTER)
    return Permission(operation, "topic", topic)


def _cluster(operation: str) -> Permission:
    return Permission(operation, "cluster", CLUSTER)


@functools.lru_cache(maxsize=10_000)
def _subscription(operation: str, subscription: str) -> Permission:
    return Permission(operation, "subscription", subscription)


def _unique(permissions: Iterable[Permission]) -> tuple[Permission, ...]:
    return tuple(dict.fromkeys(permissions))


def _txn(txn_id) -> tuple[int, int]:
    return (txn_id.tc_partition, txn_id.sequence)


def _session(session) -> list[Permission]:
    """A transactional-id session's calls need write on its transactional id."""
    if session is not None and session.transactional_id:
        return [Permission("write", "transactional_id", session.transactional_id)]
    return []


def _stream(request) -> list[Permission]:
    """A transaction of a stream (TxnStream) moves the stream's committed high-water,
    which holds back every later step of that stream named at or below it: write on the
    stream's name as a transactional id (a Spark query: `spark-stream:<query id>`), so
    that nobody else can mark another's steps done."""
    if "stream" in request.DESCRIPTOR.fields_by_name and request.HasField("stream") \
            and request.stream.name:
        return [Permission("write", "transactional_id", request.stream.name)]
    return []


def _has(request, name: str) -> bool:
    return request.HasField(name)


TXN_ADMIN = Permission("alter", "transaction_admin", CLUSTER)


def _continuing(txn_id, permissions: Iterable[Permission]) -> Requirement:
    return Requirement(_unique(permissions), owner_txn=_txn(txn_id), owner_rule="not_other_owner",
                       admin=TXN_ADMIN)


def _keyed(request) -> tuple[tuple[int, str], ...]:
    """The (tc_partition, key) a NewTxn or CommitTxn names its transaction by, if any."""
    return ((request.tc_partition, request.idempotency_key),) if request.idempotency_key else ()


def _any() -> Callable:
    return lambda request: Requirement()


def _topics(operation: str, items) -> tuple[Permission, ...]:
    """One permission per distinct topic of the items (requests name few topics, many
    partitions: the names are deduplicated before anything is built)."""
    return tuple(_topic(operation, topic)
                 for topic in dict.fromkeys(i.topic_partition.topic for i in items))


def _produce(request) -> Requirement:
    return Requirement(_topics("write", request.items))


def _fetch(request) -> Requirement:
    return Requirement(_topics("read", request.items))


def _list_offsets(request) -> Requirement:
    return Requirement(_topics("describe", request.items))


def _delete_records(request) -> Requirement:
    """`alter` on every topic. An internal topic's records (`__txn_log`: its coordinator
    trims it below its snapshots) only a server may delete: cut below a TC partition's
    last snapshot, its next coordinator could not load it."""
    internal = [i.topic for i in request.items if i.topic.startswith(INTERNAL_TOPIC_PREFIX)]
    permissions = _unique(_topic("alter", topic) for topic in
                          [*internal, *(i.topic for i in request.items)])
    return Requirement(permissions, service_only=bool(internal))


def _subscriptions(operation: str, with_topic: str = ""):
    def requirement(request) -> Requirement:
        parts = list(request.subscription_partitions)
        permissions = [_subscription(operation, p.subscription) for p in parts]
        if with_topic:
            permissions += [_topic(with_topic, p.topic) for p in parts]
        return Requirement(_unique(permissions))
    return requirement


def _ack(request) -> Requirement:
    return Requirement(_unique(_subscription("read", i.subscription_partition.subscription)
                               for i in request.items))


def _new_txn(request) -> Requirement:
    permissions = [*_session(request.session if _has(request, "session") else None),
                   *_stream(request),
                   *(_topic("write", p.topic) for p in request.topic_partitions),
                   *(_subscription("read", p.subscription) for p in request.subscription_partitions)]
    if _has(request, "parent_txn_id"):
        return dataclasses.replace(_continuing(request.parent_txn_id, permissions),
                                   owner_keys=_keyed(request))
    return Requirement(_unique(permissions), owner_keys=_keyed(request))


def _add_partitions(request) -> Requirement:
    return _continuing(request.txn_id, [*_session(request.session if _has(request, "session")
                                                  else None),
                                        *(_topic("write", p.topic) for p in request.topic_partitions)])


def _add_subscriptions(request) -> Requirement:
    return _continuing(request.txn_id, [
        *_session(request.session if _has(request, "session") else None),
        *(_subscription("read", p.subscription) for p in request.subscription_partitions)])


def _session_call(request) -> Requirement:
    """PrepareTxn, EndTxn: the session's transactional id, on one's own transaction (and
    EndTxn's stream's: `_stream`)."""
    return _continuing(request.txn_id, [
        *_session(request.session if _has(request, "session") else None), *_stream(request)])


def _commit_txn(request) -> Requirement:
    return Requirement(_unique([
        *_session(request.session if _has(request, "session") else None),
        *(_topic("write", b.topic_partition.topic) for b in request.batches),
        *(_subscription("read", a.subscription_partition.subscription) for a in request.acks)]),
        owner_keys=_keyed(request))


def _commit_txns(request) -> Requirement:
    """CommitTxns needs what each of its commits would need."""
    return Requirement(_unique([permission for commit in request.commits
                                for permission in _commit_txn(commit).permissions]),
                       owner_keys=tuple(dict.fromkeys(key for commit in request.commits
                                                      for key in _keyed(commit))))


def _init_producer_id(request) -> Requirement:
    if request.transactional_id:
        return Requirement((Permission("write", "transactional_id", request.transactional_id),))
    return Requirement()


def _owner_or_admin(operation: str):
    def requirement(request) -> Requirement:
        return Requirement(owner_txn=_txn(request.txn_id), owner_rule="owner_or_admin",
                           admin=Permission(operation, "transaction_admin", CLUSTER))
    return requirement


def _fixed(*permissions: Permission, service_only: bool = False):
    requirement = Requirement(permissions, service_only=service_only)
    return lambda request: requirement


def _create_topic(request) -> Requirement:
    return Requirement((_topic("create", request.name),))


_METADATA = "/atomlog.v1.MetadataService/"
_PARTITION = "/atomlog.v1.PartitionService/"
_COORDINATOR = "/atomlog.v1.CoordinatorService/"
_ALLOCATOR = "/atomlog.v1.IdAllocatorService/"

# Every RPC: full method name -> request -> Requirement. `_any()`: any authenticated
# principal (cluster layout, topic names, the state of a transaction one names).
TABLE: dict[str, Callable] = {
    _METADATA + "GetMetadata": _any(),
    _METADATA + "ListTopics": _any(),
    _METADATA + "CreateTopic": _create_topic,
    # Moving replicas is an operator's act on the cluster's layout.
    _METADATA + "ReassignPartition": _fixed(_cluster("alter")),
    _METADATA + "ElectLeader": _fixed(_cluster("alter")),
    # A topic's settings are its owner's (as DeleteRecords: alter on the topic).
    _METADATA + "AlterTopicConfig": lambda request: Requirement((_topic("alter",
                                                                        request.topic),)),
    _PARTITION + "Produce": _produce,
    _PARTITION + "Fetch": _fetch,
    _PARTITION + "ListOffsets": _list_offsets,
    _PARTITION + "DeleteRecords": _delete_records,
    # A subscription's position is over its topic's messages: creating or moving one
    # needs the topic's read too (internal topics: the cluster's), as Receive does.
    _PARTITION + "CreateSubscription": _subscriptions("create", with_topic="read"),
    _PARTITION + "DeleteSubscription": _subscriptions("alter"),
    _PARTITION + "ResetSubscription": _subscriptions("read", with_topic="read"),
    _PARTITION + "Receive": _subscriptions("read", with_topic="read"),
    _PARTITION + "Ack": _ack,
    _PARTITION + "Nack": lambda request: _ack(request),
    _PARTITION + "DescribeSubscription": _subscriptions("describe", with_topic="describe"),
    _PARTITION + "EndTxnOnPartition": _fixed(_cluster("write"), service_only=True),
    _PARTITION + "StageTxn": _fixed(_cluster("write"), service_only=True),
    # Parallel commits' recovery: it fences a TC partition's coordinator epoch.
    _PARTITION + "ResolveStaged": _fixed(_cluster("write"), service_only=True),
    # Followers fetching from their leader (docs/replication.md).
    _PARTITION + "Replicate": _fixed(_cluster("read"), service_only=True),
    _PARTITION + "ReplicateMany": _fixed(_cluster("read"), service_only=True),
    _PARTITION + "DescribePartition": lambda request: Requirement(
        (_topic("describe", request.topic_partition.topic),)),
    _PARTITION + "DescribeCopy": lambda request: Requirement(
        (_topic("describe", request.topic_partition.topic),)),
    _PARTITION + "ListPartitions": _fixed(_cluster("describe")),
    _PARTITION + "RecoverPartition": _fixed(_cluster("alter")),
    # An operator's scrub: it may take a damaged copy to DATA_LOSS (and hand it over).
    _PARTITION + "ScrubPartition": _fixed(_cluster("alter")),
    _COORDINATOR + "NewTxn": _new_txn,
    _COORDINATOR + "AddPartitionToTxn": _add_partitions,
    _COORDINATOR + "AddSubscriptionToTxn": _add_subscriptions,
    _COORDINATOR + "PrepareTxn": _session_call,
    _COORDINATOR + "EndTxn": _session_call,
    _COORDINATOR + "CommitTxn": _commit_txn,
    _COORDINATOR + "CommitTxns": _commit_txns,
    _COORDINATOR + "GetTxnStatus": _any(),
    _COORDINATOR + "InitProducerId": _init_producer_id,
    _COORDINATOR + "VerifyTxnPartitions": _fixed(_cluster("write"), service_only=True),
    _COORDINATOR + "ListTransactions": _fixed(Permission("describe", "transaction_admin", CLUSTER)),
    _COORDINATOR + "DescribeTransaction": _owner_or_admin("describe"),
    _COORDINATOR + "AbortTransaction": _owner_or_admin("abort"),
    _ALLOCATOR + "AllocateProducerIds": _fixed(_cluster("write"), service_only=True),
    _ALLOCATOR + "DescribeAllocator": _fixed(_cluster("describe")),
}


def requirement(method: str, request) -> Requirement | None:
    """What `request` to `method` needs; None for a method not in the table."""
    rule = TABLE.get(method)
    return None if rule is None else rule(request)


@dataclass(frozen=True)
class Denial:
    """The permission a call lacks (what PERMISSION_DENIED names) and why."""

    permission: Permission
    why: str

    def metadata(self) -> dict[str, str]:
        return {"operation": self.permission.operation,
                "resource_type": self.permission.resource_type,
                "resource_name": self.permission.name}


@dataclass(frozen=True)
class Caller:
    name: str
    service: bool = False


def decide(method: str, request, caller: Caller, acls: AclSet, super_users: frozenset[str],
           owners: "TxnOwners") -> Denial | None:
    """The verdict for one call: None (allowed) or the first missing permission."""
    needed = requirement(method, request)
    if needed is None:
        return Denial(_cluster("alter"), f"{method} is not in the authorization table "
                                         "(services/acl.py TABLE): refused until it is")
    if needed.service_only and not caller.service:
        return Denial(needed.permissions[0], "only atomlog servers (auth.service_principals) "
                                             "may call it")
    if caller.name in super_users:
        return None
    for permission in needed.permissions:
        if not _allowed(caller, permission, acls):
            return Denial(permission, "no ACL allows it" if not _denied_by_entry(
                caller, permission, acls) else "an ACL denies it")
    if needed.owner_txn is not None:
        owner = owners.owner(needed.owner_txn)
        other = owner != caller.name if needed.owner_rule == "owner_or_admin" else (
            owner is not None and owner != caller.name)
        if other and not _allowed(caller, needed.admin, acls):
            whose = "a transaction whose opener is not known here" if owner is None else \
                "another principal's transaction"
            return Denial(needed.admin, f"{whose} needs {needed.admin.operation} on "
                                        "transaction_admin")
    for key in needed.owner_keys:
        owner = owners.key_owner(key)
        if owner is not None and owner != caller.name and not _allowed(caller, TXN_ADMIN, acls):
            return Denial(TXN_ADMIN, "the idempotency key names another principal's "
                                     "transaction: that needs alter on transaction_admin")
    return None


def _allowed(caller: Caller, permission: Permission, acls: AclSet) -> bool:
    if caller.service and permission.resource_type == "cluster":
        return not acls.denies(caller.name, permission)
    return acls.allows(caller.name, permission)


def _denied_by_entry(caller: Caller, permission: Permission, acls: AclSet) -> bool:
    return acls.denies(caller.name, permission)


_AUTHORIZERS: "weakref.WeakSet[Authorizer]" = weakref.WeakSet()


def transaction_completed(tc_partition: int, sequence: int) -> None:
    """A transaction of this process's coordinator completed (decided, every marker
    confirmed): its opener is forgotten by every authorizer of the process."""
    if not _AUTHORIZERS:
        return  # (no ACLs: nothing more on the hot path)
    for authorizer in list(_AUTHORIZERS):
        authorizer.owners.forget((tc_partition, sequence))


class TxnOwners:
    """Who opened each transaction, (tc_partition, sequence) -> principal, and by which
    idempotency key, (tc_partition, key) -> principal; the oldest transaction (and its
    key) is forgotten past `limit`. Not durable: a coordinator taking over a TC partition
    does not know the openers of the transactions it inherits."""

    def __init__(self, limit: int = MAX_REMEMBERED_OWNERS):
        self.limit = limit
        self._owners: collections.OrderedDict[tuple[int, int], str] = collections.OrderedDict()
        self._keys: dict[tuple[int, str], tuple[int, int]] = {}  # key -> its transaction
        self._key_of: dict[tuple[int, int], tuple[int, str]] = {}
        self._lock = threading.Lock()

    def record(self, txn: tuple[int, int], principal: str,
               key: tuple[int, str] | None = None) -> None:
        with self._lock:
            if txn in self._owners:
                return  # the first opener stays (a retried NewTxn by key answers the same)
            self._owners[txn] = principal
            if key is not None and key[1] and key not in self._keys:
                self._keys[key] = txn
                self._key_of[txn] = key
            while len(self._owners) > self.limit:
                self._drop(self._owners.popitem(last=False)[0])

    def _drop(self, txn: tuple[int, int]) -> None:
        key = self._key_of.pop(txn, None)
        if key is not None:
            self._keys.pop(key, None)

    def owner(self, txn: tuple[int, int]) -> str | None:
        return self._owners.get(txn)

    def key_owner(self, key: tuple[int, str]) -> str | None:
        txn = self._keys.get(key)
        return None if txn is None else self._owners.get(txn)

    def forget(self, txn: tuple[int, int]) -> None:
        with self._lock:
            self._owners.pop(txn, None)
            self._drop(txn)

    def __len__(self) -> int:
        return len(self._owners)


def split_principals(value: str) -> frozenset[str]:
    return frozenset(item.strip() for item in value.split(",") if item.strip())


# ------------------------------------------------------------------ the shell
log = logging.getLogger("atomlog.acl")
AUTHORIZERS = ("none", "acl")


def _metrics():
    from prometheus_client import Counter, Gauge

    denied = Counter("atomlog_authorization_denied", "Calls refused PERMISSION_DENIED "
                     "(services/acl.py), by the missing permission's operation and resource "
                     "type.", ["operation", "resource_type"])
    entries = Gauge("atomlog_acl_entries", "ACL entries in force on this server (the "
                    "watched ACL znode).")
    return denied, entries


DENIED, ACL_ENTRIES = _metrics()


def _caller(principal) -> Caller:
    """The Caller of an authenticated principal (services.auth.Principal, or None)."""
    return Caller(principal.name, principal.service) if principal else Caller("anonymous")


class Authorizer:
    """A server's authorization: the ACL znode, watched (every change applies as soon as
    ZooKeeper delivers it), the super users, and the openers of the transactions this
    process's coordinator opened. Thread-safe reads; the watch runs on kazoo's thread."""

    def __init__(self, zk_client, super_users: frozenset[str], load_timeout_s: float = 30.0):
        """Reads the ACL znode before it returns (nothing is served before the ACLs are
        known), or raises ZOOKEEPER_UNAVAILABLE after `load_timeout_s`: kazoo's DataWatch
        retries its first read without a limit, and a start-up step that waited for ever
        on a ZooKeeper that is gone broke the rule every other step keeps (give up after
        zookeeper.connect_timeout_ms; a supervisor starts the process again)."""
        self.super_users = super_users
        self.owners = TxnOwners()
        _AUTHORIZERS.add(self)
        self.acls = AclSet()
        self._loaded = threading.Event()
        self._closed = False
        self._watch = None
        self._watch_error: BaseException | None = None
        # The watch is made on a thread of its own, which its first read may hold.
        threading.Thread(target=self._watch_acls, args=(zk_client,), daemon=True,
                         name="atomlog-acl-watch").start()
        if not self._loaded.wait(load_timeout_s):
            self._closed = True  # the watch stops at its first call, if one ever comes
            from services.errors import AtomlogError

            raise AtomlogError("ZOOKEEPER_UNAVAILABLE", f"the ACLs ({ACLS_PATH}) could not "
                               f"be read from ZooKeeper within {load_timeout_s:.0f} s")
        if self._watch_error is not None:
            raise self._watch_error

    def _watch_acls(self, zk_client) -> None:
        from kazoo.recipe.watchers import DataWatch

        try:
            self._watch = DataWatch(zk_client, ACLS_PATH, self._changed)
        except Exception as error:  # noqa: BLE001 — the start's answer (NoAuth, a closed client)
            self._watch_error = error
            self._loaded.set()

    @classmethod
    def from_config(cls, config, zk_client) -> "Authorizer | None":
        if config["auth.authorizer"] != "acl":
            return None
        if not config["zookeeper.digest_file"]:
            from services.logs import event

            event(log, "ACLs are on but ZooKeeper is open (no zookeeper.digest_file): anyone "
                  "who reaches ZooKeeper can change them", logging.WARNING)
        return cls(zk_client, split_principals(config["auth.super_users"]),
                   config["zookeeper.connect_timeout_ms"] / 1000)

    def _changed(self, data, stat):
        from services.logs import event

        if self._closed:
            return False  # stops kazoo's DataWatch
        try:
            acls = AclSet.decode(data)
        except AclError as error:  # keep the previous set: never open up on a bad write
            event(log, "unusable ACL znode; keeping the previous ACLs", logging.ERROR,
                  error=str(error))
        else:
            self.acls = acls
            ACL_ENTRIES.set(len(acls))
            event(log, "ACLs loaded", entries=len(acls),
                  znode_version=stat.version if stat is not None else -1)
        self._loaded.set()

    def check(self, method: str, request, principal) -> None:
        """Raise AtomlogError PERMISSION_DENIED (logged and counted) unless allowed."""
        caller = _caller(principal)
        denial = decide(method, request, caller, self.acls, self.super_users, self.owners)
        if denial is not None:
            self._refuse(method, caller, denial)

    def may(self, principal, permission: Permission) -> bool:
        """Whether the caller holds `permission` (a super user or a service principal:
        always), for answers that show a caller only part of what they hold."""
        caller = _caller(principal)
        return caller.service or caller.name in self.super_users or _allowed(
            caller, permission, self.acls)

    def opener(self, tc_partition: int, sequence: int) -> str:
        """The principal that opened a transaction here ("" when not known)."""
        return self.owners.owner((tc_partition, sequence)) or ""

    def check_joining(self, what: str, principal, opener: str) -> None:
        """A transactional write or ack (`what`) into a transaction that `opener` opened, as
        its coordinator answered ("": not known there, e.g. opened before a failover):
        PERMISSION_DENIED unless the caller is the opener, a super user, a service
        principal, or holds alter on transaction_admin. Kafka checks TransactionalId WRITE
        on a transactional produce; a batch here names its transaction, so its opener."""
        caller = _caller(principal)
        if (not opener or opener == caller.name or caller.service
                or caller.name in self.super_users or _allowed(caller, TXN_ADMIN, self.acls)):
            return
        self._refuse(what, caller, Denial(TXN_ADMIN, f"the transaction is {opener}'s: another "
                                                     "principal's needs alter on "
                                                     "transaction_admin"))

    def _refuse(self, method: str, caller: Caller, denial: Denial) -> None:
        from services.errors import AtomlogError
        from services.logs import event

        permission = denial.permission
        DENIED.labels(permission.operation, permission.resource_type).inc()
        event(log, "permission denied", logging.WARNING, method=method, principal=caller.name,
              operation=permission.operation, resource_type=permission.resource_type,
              resource_name=permission.name, why=denial.why)
        raise AtomlogError("PERMISSION_DENIED",
                           f"{method}: {caller.name} may not {permission.operation} "
                           f"{permission.resource_type} {permission.name!r}: {denial.why}",
                           {**denial.metadata(), "principal": caller.name})

    def answered(self, method: str, request, reply, principal) -> None:
        """After a successful call: remember who opened a transaction, and by which key."""
        if method == _COORDINATOR + "NewTxn" and principal is not None and reply.HasField("txn_id"):
            self.owners.record(_txn(reply.txn_id), principal.name,
                               (request.tc_partition, request.idempotency_key))

    def close(self) -> None:
        self._closed = True


class AclStore:
    """Read and change the ACL znode with compare-and-set (the CLI; any kazoo client under
    the cluster's chroot; writes need the ZooKeeper credential when znode ACLs are on)."""

    def __init__(self, zk_client):
        self.client = zk_client

    def read(self) -> tuple[AclSet, int]:
        from kazoo.exceptions import NoNodeError

        try:
            data, stat = self.client.get(ACLS_PATH)
        except NoNodeError:
            return AclSet(), -1
        return AclSet.decode(data), stat.version

    def change(self, update: Callable[[AclSet], AclSet], attempts: int = 20) -> AclSet:
        from kazoo.exceptions import BadVersionError, NodeExistsError

        for _ in range(attempts):
            current, version = self.read()
            wanted = update(current)
            try:
                if version < 0:
                    self.client.create(ACLS_PATH, wanted.encode())
                else:
                    self.client.set(ACLS_PATH, wanted.encode(), version=version)
                return wanted
            except (BadVersionError, NodeExistsError):
                continue  # someone else changed it meanwhile: read again
        raise AclError(f"the ACL znode changed under {attempts} attempts in a row; try again")
