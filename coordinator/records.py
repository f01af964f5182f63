"""Value objects and log records of a TC partition (`__txn_log-<k>`), with their encoding.

Everything here is a small frozen value object that validates itself when built
(ValueError on a bad field). The core (coordinator/core.py) builds records; the shell
appends `encode_record(record)` as a record value of a `__txn_log-<k>` batch and hands
`decode_record(value)` back to the core when it loads the partition.

Records (each one the durable form of one state change of one transaction or session):

    Opened          a transaction starts OPEN (with its deadline as an absolute time,
                    parent, session, idempotency key and first partitions)
    Registered      partitions / subscription partitions added to an OPEN transaction
    DeadlineReset   an OPEN transaction's deadline moved (NewTxn with its idempotency key)
    Prepared        OPEN -> PREPARED, with the prepared timeout
    Decided         the durable decision: -> COMMITTING | ABORTING, with its cause; for a
                    parent, ONE record names the children kept (-> COMMITTING) and the
                    children aborted (-> ABORTING) with it
    Completed       COMMITTING -> COMMITTED | ABORTING -> ABORTED, once every marker is
                    confirmed (and every child of a parent is finished)
    SessionStarted  InitProducerId for a transactional id: its producer id and epoch now
    SequencesReserved  one-call transactions (CommitTxn) may use sequences up to `up_to`
                    before anything else of them is logged (presumed abort); a coordinator
                    loading the partition starts above it, so no sequence is ever reused
    Staging         a one-call transaction being committed in parallel (docs/coordinator.md,
                    "Parallel commits"): as Opened, written while its batches and acks are
                    staged; the transaction is committed once this record and every stage
                    are durable, so a coordinator that finds it with no decision resolves
                    it by asking the partitions and subscription partitions (ResolveStaged)
    StreamCommitted  a transaction committed as ordinal N of a stream (TxnStream: a
                    Spark streaming query's micro-batch N): logged in the same append as
                    its Decided(COMMIT), it moves the stream's committed high-water to N,
                    which outlives the transaction's own retention (docs/coordinator.md,
                    "Streams")

Encoding, version 1, little-endian; every record value starts with
`format_version u8 = 1, record_type u8`, then the fields in the order below:

    txn_id      tc_partition u32, sequence u64      ((0, 0) = none, for optional ids)
    string      length u16, UTF-8 bytes
    topic_partition         topic string, partition u32
    subscription_partition  topic string, partition u32, subscription string
    session     transactional_id string (empty = no session), producer_id i64,
                producer_epoch u16
    lists       count u16 (targets) or u32 (transaction ids), then the items

    1 Opened         txn_id, created_ms i64, timeout_ms u32, deadline_ms i64,
                     parent txn_id, session, idempotency_key string,
                     topic_partitions, subscription_partitions
    2 Registered     txn_id, topic_partitions, subscription_partitions
    3 DeadlineReset  txn_id, deadline_ms i64
    4 Prepared       txn_id, prepared_ms i64, prepared_timeout_ms u32
    5 Decided        txn_id, decision u8, end_cause u8, decided_ms i64,
                     kept_children txn_ids, aborted_children txn_ids
    6 Completed      txn_id, decision u8, completed_ms i64
    7 SessionStarted transactional_id string, producer_id i64, producer_epoch u16,
                     timeout_ms u32, started_ms i64
    8 SequencesReserved  up_to u64
    9 Staging        as Opened (its parent is always none)
   10 SessionStarted, an epoch bump its holder asked for: as 7, then bumped_from
                     producer_id i64, producer_epoch u16 (the session it replaced;
                     InitProducerId carrying that one again is a retry, answered with
                     this session: KIP-360). Type 7 is written when nobody asked.
   11 StreamCommitted  stream string, ordinal u64, txn_id, committed_ms i64

A record value carries no checksum of its own: the batch that holds it has a CRC32C
(docs/record-format.md). `decode_record` still refuses anything malformed with
RecordCorrupt (fail closed): unknown version or type, short or trailing bytes, values
out of range.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import NamedTuple

import crc32c

# Transaction sequences start at 1: (0, 0) means "no transaction" in batch headers.
TXN_SEQUENCE_MAX = (1 << 64) - 1
TC_PARTITION_MAX = (1 << 32) - 1
PARTITION_MAX = (1 << 31) - 1
PRODUCER_ID_MAX = (1 << 63) - 1
# Producer epochs are uint16 in record batch headers (docs/record-format.md). The
# coordinator issues 0 .. 65534 and rotates to a new producer id instead of issuing 65535,
# so "epoch + 1" of an issued epoch always fits.
PRODUCER_EPOCH_MAX = (1 << 16) - 1
PRODUCER_EPOCH_LAST_ISSUED = PRODUCER_EPOCH_MAX - 1
TIMEOUT_MS_MAX = (1 << 32) - 1  # uint32 in the API and in the records
TIME_MS_MIN, TIME_MS_MAX = -(1 << 63), (1 << 63) - 1
# Lengths (UTF-8 bytes) accepted in names; topics follow services/topics.py (Kafka: 249).
MAX_TOPIC_BYTES = 249
MAX_SUBSCRIPTION_BYTES = 255
MAX_TRANSACTIONAL_ID_BYTES = 256  # coordinator.proto
MAX_IDEMPOTENCY_KEY_BYTES = 256  # coordinator.proto
MAX_STREAM_BYTES = 256  # coordinator.proto (TxnStream.name)
ORDINAL_MAX = (1 << 64) - 1
# Bounds of the encoding: a record lists at most this many partitions of each kind.
MAX_TARGETS_ENCODED = (1 << 16) - 1

RECORD_FORMAT_VERSION = 1


def tc_partition_for(key: str, count: int) -> int:
    """The TC partition of a transactional id or idempotency key (coordinator.proto):
    CRC32C (Castagnoli) of its UTF-8 bytes, unsigned, modulo the TC partition count."""
    return crc32c.crc32c(key.encode()) % count


class RecordCorrupt(Exception):
    """A TC log record cannot be decoded; the TC partition refuses to load (fail closed)."""


class Decision(enum.Enum):
    """Values as TxnDecision in partition.proto."""

    __hash__ = object.__hash__  # members are singletons: no Python-level hash of the name

    COMMIT = 1
    ABORT = 2


class EndCause(enum.Enum):
    """Why a transaction ended; values as TxnEndCause in coordinator.proto."""

    __hash__ = object.__hash__  # members are singletons: no Python-level hash of the name

    UNSPECIFIED = 0
    CLIENT = 1
    TIMEOUT = 2
    PREPARED_TIMEOUT = 3
    PARENT = 4
    SESSION_FENCED = 5
    OPERATOR = 6


# ---------------------------------------------------------------------------------------
# Value objects
# ---------------------------------------------------------------------------------------

def _check_int(name: str, value: object, minimum: int, maximum: int) -> None:
    if type(value) is not int or not minimum <= value <= maximum:
        raise ValueError(f"{name}={value!r} is not an integer in [{minimum}, {maximum}]")


def _check_name(name: str, value: object, max_bytes: int, *, empty_ok: bool = False) -> None:
    if not isinstance(value, str):
        raise ValueError(f"{name}={value!r} is not a string")
    size = len(value.encode("utf-8"))
    if size > max_bytes or (size == 0 and not empty_ok):
        raise ValueError(f"{name} must have 1..{max_bytes} bytes of UTF-8, has {size}")


# Ids and targets are tuples underneath (NamedTuple): hashing and comparing them is C
# code, which matters for tables of 100,000 transactions. They validate when built.

class _TxnIdFields(NamedTuple):
    tc_partition: int
    sequence: int


class TxnId(_TxnIdFields):
    """TxnID(tc, seq): the TC partition that owns the transaction and its sequence there."""

    __slots__ = ()

    def __new__(cls, tc_partition: int, sequence: int) -> TxnId:
        _check_int("tc_partition", tc_partition, 0, TC_PARTITION_MAX)
        _check_int("sequence", sequence, 1, TXN_SEQUENCE_MAX)
        return tuple.__new__(cls, (tc_partition, sequence))

    def __str__(self) -> str:
        return f"{self.tc_partition}:{self.sequence}"


class _TopicPartitionFields(NamedTuple):
    topic: str
    partition: int


class TopicPartition(_TopicPartitionFields):
    __slots__ = ()

    def __new__(cls, topic: str, partition: int) -> TopicPartition:
        _check_name("topic", topic, MAX_TOPIC_BYTES)
        _check_int("partition", partition, 0, PARTITION_MAX)
        return tuple.__new__(cls, (topic, partition))

    def __str__(self) -> str:
        return f"{self.topic}/{self.partition}"


class _SubscriptionPartitionFields(NamedTuple):
    topic: str
    partition: int
    subscription: str


class SubscriptionPartition(_SubscriptionPartitionFields):
    __slots__ = ()

    def __new__(cls, topic: str, partition: int, subscription: str) -> SubscriptionPartition:
        _check_name("topic", topic, MAX_TOPIC_BYTES)
        _check_int("partition", partition, 0, PARTITION_MAX)
        _check_name("subscription", subscription, MAX_SUBSCRIPTION_BYTES)
        return tuple.__new__(cls, (topic, partition, subscription))

    def __str__(self) -> str:
        return f"{self.topic}/{self.partition}@{self.subscription}"


Target = TopicPartition | SubscriptionPartition


@dataclass(frozen=True, slots=True)
class Session:
    """A Kafka-style session: transactional id plus the producer id and epoch issued to it."""

    transactional_id: str
    producer_id: int
    producer_epoch: int

    def __post_init__(self) -> None:
        _check_name("transactional_id", self.transactional_id, MAX_TRANSACTIONAL_ID_BYTES)
        _check_int("producer_id", self.producer_id, 1, PRODUCER_ID_MAX)
        _check_int("producer_epoch", self.producer_epoch, 0, PRODUCER_EPOCH_LAST_ISSUED)

    def __str__(self) -> str:
        return f"{self.transactional_id}#{self.producer_id}.{self.producer_epoch}"


@dataclass(frozen=True, slots=True)
class TxnStream:
    """A transaction's place in an ordered stream (coordinator.proto, TxnStream): the
    stream's name and the transaction's ordinal in it (a Spark streaming query's id and
    micro-batch id)."""

    name: str
    ordinal: int

    def __post_init__(self) -> None:
        _check_name("stream name", self.name, MAX_STREAM_BYTES)
        _check_int("stream ordinal", self.ordinal, 0, ORDINAL_MAX)


# ---------------------------------------------------------------------------------------
# Records
# ---------------------------------------------------------------------------------------

def _check_time(name: str, value: object) -> None:
    _check_int(name, value, TIME_MS_MIN, TIME_MS_MAX)


def _check_targets(topic_partitions: tuple, subscription_partitions: tuple) -> None:
    for kind, items, cls in (("topic_partitions", topic_partitions, TopicPartition),
                             ("subscription_partitions", subscription_partitions,
                              SubscriptionPartition)):
        if type(items) is not tuple:
            raise ValueError(f"{kind} must be a tuple of {cls.__name__}")
        for item in items:
            if type(item) is not cls:
                raise ValueError(f"{kind} must be a tuple of {cls.__name__}")
        if len(items) > 1 and (len(items) > MAX_TARGETS_ENCODED
                               or len(set(items)) != len(items)):
            raise ValueError(f"{kind} must be distinct and at most {MAX_TARGETS_ENCODED}")


def _check_txn_ids(name: str, items: tuple) -> None:
    if type(items) is not tuple:
        raise ValueError(f"{name} must be a tuple of TxnId")
    for item in items:
        if type(item) is not TxnId:
            raise ValueError(f"{name} must be a tuple of TxnId")
    if len(items) > 1 and len(set(items)) != len(items):
        raise ValueError(f"{name} must be distinct")


@dataclass(frozen=True, slots=True)
class Opened:
    txn_id: TxnId
    created_ms: int
    timeout_ms: int
    deadline_ms: int
    parent: TxnId | None = None
    session: Session | None = None
    idempotency_key: str = ""
    topic_partitions: tuple[TopicPartition, ...] = ()
    subscription_partitions: tuple[SubscriptionPartition, ...] = ()

    def __post_init__(self) -> None:
        _check_time("created_ms", self.created_ms)
        _check_int("timeout_ms", self.timeout_ms, 1, TIMEOUT_MS_MAX)
        _check_time("deadline_ms", self.deadline_ms)
        if self.parent is not None and self.parent.tc_partition != self.txn_id.tc_partition:
            raise ValueError("a parent lives on its child's TC partition")
        if self.parent is not None and self.session is not None:
            raise ValueError("a child transaction has no session of its own")
        _check_name("idempotency_key", self.idempotency_key, MAX_IDEMPOTENCY_KEY_BYTES,
                    empty_ok=True)
        _check_targets(self.topic_partitions, self.subscription_partitions)


@dataclass(frozen=True, slots=True)
class Staging(Opened):
    """Opened for a one-call transaction committed in parallel: encoded as Opened, with
    its own record type."""

    def __post_init__(self) -> None:
        Opened.__post_init__(self)
        if self.parent is not None:
            raise ValueError("a staged transaction has no parent")


@dataclass(frozen=True, slots=True)
class Registered:
    txn_id: TxnId
    topic_partitions: tuple[TopicPartition, ...] = ()
    subscription_partitions: tuple[SubscriptionPartition, ...] = ()

    def __post_init__(self) -> None:
        _check_targets(self.topic_partitions, self.subscription_partitions)
        if not self.topic_partitions and not self.subscription_partitions:
            raise ValueError("a Registered record names at least one partition")


@dataclass(frozen=True, slots=True)
class DeadlineReset:
    txn_id: TxnId
    deadline_ms: int

    def __post_init__(self) -> None:
        _check_time("deadline_ms", self.deadline_ms)


@dataclass(frozen=True, slots=True)
class Prepared:
    txn_id: TxnId
    prepared_ms: int
    prepared_timeout_ms: int

    def __post_init__(self) -> None:
        _check_time("prepared_ms", self.prepared_ms)
        _check_int("prepared_timeout_ms", self.prepared_timeout_ms, 1, TIMEOUT_MS_MAX)

    @property
    def prepared_deadline_ms(self) -> int:
        return self.prepared_ms + self.prepared_timeout_ms


# Which causes each decision may have in a Decided record (children decided by their
# parent are listed in the parent's record, with cause PARENT implied).
DECISION_CAUSES: dict[Decision, frozenset[EndCause]] = {
    Decision.COMMIT: frozenset({EndCause.CLIENT}),
    Decision.ABORT: frozenset({EndCause.CLIENT, EndCause.TIMEOUT, EndCause.PREPARED_TIMEOUT,
                               EndCause.SESSION_FENCED, EndCause.OPERATOR}),
}


@dataclass(frozen=True, slots=True)
class Decided:
    txn_id: TxnId
    decision: Decision
    cause: EndCause
    decided_ms: int
    kept_children: tuple[TxnId, ...] = ()
    aborted_children: tuple[TxnId, ...] = ()

    def __post_init__(self) -> None:
        if type(self.decision) is not Decision or type(self.cause) is not EndCause:
            raise ValueError("decision and cause must be Decision and EndCause")
        if self.cause not in DECISION_CAUSES[self.decision]:
            raise ValueError(f"a {self.decision.name} cannot have cause {self.cause.name}")
        _check_time("decided_ms", self.decided_ms)
        _check_txn_ids("kept_children", self.kept_children)
        _check_txn_ids("aborted_children", self.aborted_children)
        if self.kept_children and self.decision is not Decision.COMMIT:
            raise ValueError("only a COMMIT keeps children")
        if set(self.kept_children) & set(self.aborted_children):
            raise ValueError("a child is either kept or aborted")
        if self.txn_id in self.kept_children or self.txn_id in self.aborted_children:
            raise ValueError("a transaction is not its own child")


@dataclass(frozen=True, slots=True)
class Completed:
    txn_id: TxnId
    decision: Decision
    completed_ms: int

    def __post_init__(self) -> None:
        if type(self.decision) is not Decision:
            raise ValueError("decision must be a Decision")
        _check_time("completed_ms", self.completed_ms)


@dataclass(frozen=True, slots=True)
class SessionStarted:
    transactional_id: str
    producer_id: int
    producer_epoch: int
    timeout_ms: int
    started_ms: int
    # The session this one replaced, when its holder asked for the bump (InitProducerId
    # carrying it): that call retried, its answer lost, gets this session again instead
    # of PRODUCER_FENCED. 0, 0: nobody asked (a new producer took the id over).
    bumped_from_producer_id: int = 0
    bumped_from_epoch: int = 0

    def __post_init__(self) -> None:
        Session(self.transactional_id, self.producer_id, self.producer_epoch)
        _check_int("timeout_ms", self.timeout_ms, 1, TIMEOUT_MS_MAX)
        _check_time("started_ms", self.started_ms)
        if self.bumped_from_producer_id or self.bumped_from_epoch:
            previous = Session(self.transactional_id, self.bumped_from_producer_id,
                               self.bumped_from_epoch)
            if (previous.producer_id, previous.producer_epoch) == (
                    self.producer_id, self.producer_epoch):
                raise ValueError("a session cannot be bumped from itself")

    @property
    def bumped_from(self) -> tuple[int, int] | None:
        """(producer id, epoch) of the session whose holder asked for this one, or None."""
        if not self.bumped_from_producer_id:
            return None
        return self.bumped_from_producer_id, self.bumped_from_epoch

    @property
    def session(self) -> Session:
        return Session(self.transactional_id, self.producer_id, self.producer_epoch)


@dataclass(frozen=True, slots=True)
class SequencesReserved:
    up_to: int

    def __post_init__(self) -> None:
        _check_int("up_to", self.up_to, 1, TXN_SEQUENCE_MAX)


@dataclass(frozen=True, slots=True)
class StreamCommitted:
    """`txn_id` committed as ordinal `ordinal` of stream `stream` (appended with its
    Decided(COMMIT), so both are durable or neither)."""

    stream: str
    ordinal: int
    txn_id: TxnId
    committed_ms: int

    def __post_init__(self) -> None:
        _check_name("stream", self.stream, MAX_STREAM_BYTES)
        _check_int("ordinal", self.ordinal, 0, ORDINAL_MAX)
        if type(self.txn_id) is not TxnId:
            raise ValueError("txn_id must be a TxnId")
        _check_time("committed_ms", self.committed_ms)


Record = (Opened | Registered | DeadlineReset | Prepared | Decided | Completed | SessionStarted
          | SequencesReserved | Staging | StreamCommitted)
RECORD_TYPES: dict[type, int] = {Opened: 1, Registered: 2, DeadlineReset: 3, Prepared: 4,
                                 Decided: 5, Completed: 6, SessionStarted: 7,
                                 SequencesReserved: 8, Staging: 9, StreamCommitted: 11}
SESSION_BUMPED_TYPE = 10  # a SessionStarted with bumped_from (type 7 without)


def txn_of(record: Record) -> TxnId | None:
    """The transaction a record is about (None for SessionStarted, SequencesReserved)."""
    return getattr(record, "txn_id", None)


# ---------------------------------------------------------------------------------------
# Encoding
# ---------------------------------------------------------------------------------------

_U8 = struct.Struct("<B")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_I64 = struct.Struct("<q")
_U64 = struct.Struct("<Q")
_TXN_ID = struct.Struct("<IQ")
_HEAD = struct.Struct("<BB")
_OPENED_TIMES = struct.Struct("<qIq")
_SESSION_TAIL = struct.Struct("<qH")
_PREPARED = struct.Struct("<qI")
_DECIDED = struct.Struct("<BBq")
_COMPLETED = struct.Struct("<Bq")
_SESSION_STARTED = struct.Struct("<qHIq")


class Writer:
    """Accumulates little-endian fields (shared with the snapshot encoder)."""

    __slots__ = ("parts",)

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def pack(self, fmt: struct.Struct, *values) -> None:
        self.parts.append(fmt.pack(*values))

    def string(self, value: str) -> None:
        data = value.encode("utf-8")
        assert len(data) <= 0xFFFF, len(data)
        self.parts.append(_U16.pack(len(data)) + data)

    def txn_id(self, value: TxnId | None) -> None:
        self.parts.append(_TXN_ID.pack(*((value.tc_partition, value.sequence)
                                         if value is not None else (0, 0))))

    def txn_ids(self, values: tuple[TxnId, ...] | list[TxnId]) -> None:
        self.parts.append(_U32.pack(len(values)))
        for value in values:
            self.txn_id(value)

    def targets(self, topic_partitions, subscription_partitions) -> None:
        self.parts.append(_U16.pack(len(topic_partitions)))
        for item in topic_partitions:
            self.string(item.topic)
            self.parts.append(_U32.pack(item.partition))
        self.parts.append(_U16.pack(len(subscription_partitions)))
        for item in subscription_partitions:
            self.string(item.topic)
            self.parts.append(_U32.pack(item.partition))
            self.string(item.subscription)

    def session(self, value: Session | None) -> None:
        if value is None:
            self.string("")
            self.pack(_SESSION_TAIL, 0, 0)
        else:
            self.string(value.transactional_id)
            self.pack(_SESSION_TAIL, value.producer_id, value.producer_epoch)

    def getvalue(self) -> bytes:
        return b"".join(self.parts)


class Reader:
    """Reads what Writer wrote; raises RecordCorrupt on short data (shared with snapshots)."""

    __slots__ = ("data", "position")

    def __init__(self, data: bytes | memoryview, position: int = 0) -> None:
        self.data = data
        self.position = position

    def unpack(self, fmt: struct.Struct) -> tuple:
        try:
            values = fmt.unpack_from(self.data, self.position)
        except struct.error:
            raise RecordCorrupt(f"data ends at byte {len(self.data)}, inside a field at "
                                f"byte {self.position}") from None
        self.position += fmt.size
        return values

    def string(self) -> str:
        (length,) = self.unpack(_U16)
        end = self.position + length
        if end > len(self.data):
            raise RecordCorrupt(f"a string of {length} bytes at byte {self.position} "
                                f"runs past the end ({len(self.data)} bytes)")
        try:
            value = bytes(self.data[self.position:end]).decode("utf-8")
        except UnicodeDecodeError as error:
            raise RecordCorrupt(f"a string at byte {self.position} is not UTF-8: {error}") \
                from None
        self.position = end
        return value

    def txn_id(self) -> TxnId | None:
        tc_partition, sequence = self.unpack(_TXN_ID)
        if sequence == 0:
            if tc_partition != 0:
                raise RecordCorrupt(f"transaction id ({tc_partition}, 0) is not valid")
            return None
        return TxnId(tc_partition, sequence)

    def required_txn_id(self) -> TxnId:
        value = self.txn_id()
        if value is None:
            raise RecordCorrupt(f"a transaction id is missing at byte {self.position - 12}")
        return value

    def txn_ids(self) -> tuple[TxnId, ...]:
        (count,) = self.unpack(_U32)
        if count * _TXN_ID.size > len(self.data) - self.position:
            raise RecordCorrupt(f"{count} transaction ids do not fit in the data")
        return tuple(self.required_txn_id() for _ in range(count))

    def targets(self) -> tuple[tuple[TopicPartition, ...], tuple[SubscriptionPartition, ...]]:
        (count,) = self.unpack(_U16)
        topic_partitions = []
        for _ in range(count):
            topic = self.string()
            topic_partitions.append(TopicPartition(topic, *self.unpack(_U32)))
        (count,) = self.unpack(_U16)
        subscription_partitions = []
        for _ in range(count):
            topic = self.string()
            (partition,) = self.unpack(_U32)
            subscription_partitions.append(SubscriptionPartition(topic, partition,
                                                                 self.string()))
        return tuple(topic_partitions), tuple(subscription_partitions)

    def session(self) -> Session | None:
        transactional_id = self.string()
        producer_id, producer_epoch = self.unpack(_SESSION_TAIL)
        if not transactional_id:
            if producer_id or producer_epoch:
                raise RecordCorrupt("a producer id without a transactional id")
            return None
        return Session(transactional_id, producer_id, producer_epoch)

    def at_end(self) -> bool:
        return self.position == len(self.data)


def encode_record(record: Record) -> bytes:
    """The record value to append to `__txn_log-<k>`."""
    out = Writer()
    if isinstance(record, SessionStarted):
        bumped = record.bumped_from
        out.pack(_HEAD, RECORD_FORMAT_VERSION,
                 RECORD_TYPES[SessionStarted] if bumped is None else SESSION_BUMPED_TYPE)
        out.string(record.transactional_id)
        out.pack(_SESSION_STARTED, record.producer_id, record.producer_epoch,
                 record.timeout_ms, record.started_ms)
        if bumped is not None:
            out.pack(_SESSION_TAIL, *bumped)
        return out.getvalue()
    out.pack(_HEAD, RECORD_FORMAT_VERSION, RECORD_TYPES[type(record)])
    if isinstance(record, SequencesReserved):
        out.pack(_U64, record.up_to)
        return out.getvalue()
    if isinstance(record, StreamCommitted):
        out.string(record.stream)
        out.pack(_U64, record.ordinal)
        out.txn_id(record.txn_id)
        out.pack(_I64, record.committed_ms)
        return out.getvalue()
    out.txn_id(record.txn_id)
    if isinstance(record, Opened):
        out.pack(_OPENED_TIMES, record.created_ms, record.timeout_ms, record.deadline_ms)
        out.txn_id(record.parent)
        out.session(record.session)
        out.string(record.idempotency_key)
        out.targets(record.topic_partitions, record.subscription_partitions)
    elif isinstance(record, Registered):
        out.targets(record.topic_partitions, record.subscription_partitions)
    elif isinstance(record, DeadlineReset):
        out.pack(_I64, record.deadline_ms)
    elif isinstance(record, Prepared):
        out.pack(_PREPARED, record.prepared_ms, record.prepared_timeout_ms)
    elif isinstance(record, Decided):  # (._value_: Enum's .value is a Python property)
        out.pack(_DECIDED, record.decision._value_, record.cause._value_, record.decided_ms)
        out.txn_ids(record.kept_children)
        out.txn_ids(record.aborted_children)
    else:
        assert isinstance(record, Completed), record
        out.pack(_COMPLETED, record.decision._value_, record.completed_ms)
    return out.getvalue()


def decode_record(data: bytes | memoryview) -> Record:
    """The record encoded in `data`; RecordCorrupt if it is not one, exactly."""
    reader = Reader(data)
    version, record_type = reader.unpack(_HEAD)
    if version != RECORD_FORMAT_VERSION:
        raise RecordCorrupt(f"TC log record format version {version} is not supported "
                            f"(this build reads {RECORD_FORMAT_VERSION})")
    try:
        record = _DECODERS[record_type](reader)
    except KeyError:
        raise RecordCorrupt(f"unknown TC log record type {record_type}") from None
    except (ValueError, TypeError) as error:
        raise RecordCorrupt(f"invalid TC log record (type {record_type}): {error}") from None
    if not reader.at_end():
        raise RecordCorrupt(f"{len(data) - reader.position} unexpected bytes after a TC log "
                            f"record of type {record_type}")
    return record


def _decode_opened(reader: Reader) -> Opened:
    txn_id = reader.required_txn_id()
    created_ms, timeout_ms, deadline_ms = reader.unpack(_OPENED_TIMES)
    parent = reader.txn_id()
    session = reader.session()
    key = reader.string()
    topic_partitions, subscription_partitions = reader.targets()
    return Opened(txn_id, created_ms, timeout_ms, deadline_ms, parent, session, key,
                  topic_partitions, subscription_partitions)


def _decode_staging(reader: Reader) -> Staging:
    opened = _decode_opened(reader)
    return Staging(opened.txn_id, opened.created_ms, opened.timeout_ms, opened.deadline_ms,
                   opened.parent, opened.session, opened.idempotency_key,
                   opened.topic_partitions, opened.subscription_partitions)


def _decode_registered(reader: Reader) -> Registered:
    txn_id = reader.required_txn_id()
    return Registered(txn_id, *reader.targets())


def _decode_deadline_reset(reader: Reader) -> DeadlineReset:
    txn_id = reader.required_txn_id()
    return DeadlineReset(txn_id, *reader.unpack(_I64))


def _decode_prepared(reader: Reader) -> Prepared:
    txn_id = reader.required_txn_id()
    return Prepared(txn_id, *reader.unpack(_PREPARED))


def _decode_decided(reader: Reader) -> Decided:
    txn_id = reader.required_txn_id()
    decision, cause, decided_ms = reader.unpack(_DECIDED)
    return Decided(txn_id, Decision(decision), EndCause(cause), decided_ms, reader.txn_ids(),
                   reader.txn_ids())


def _decode_completed(reader: Reader) -> Completed:
    txn_id = reader.required_txn_id()
    decision, completed_ms = reader.unpack(_COMPLETED)
    return Completed(txn_id, Decision(decision), completed_ms)


def _decode_session_started(reader: Reader) -> SessionStarted:
    transactional_id = reader.string()
    return SessionStarted(transactional_id, *reader.unpack(_SESSION_STARTED))


def _decode_session_bumped(reader: Reader) -> SessionStarted:
    transactional_id = reader.string()
    fields = reader.unpack(_SESSION_STARTED)
    bumped_from = reader.unpack(_SESSION_TAIL)
    if not bumped_from[0]:
        raise ValueError("a bumped session's bumped_from producer id is 0")
    return SessionStarted(transactional_id, *fields, *bumped_from)


def _decode_sequences_reserved(reader: Reader) -> SequencesReserved:
    return SequencesReserved(*reader.unpack(_U64))


def _decode_stream_committed(reader: Reader) -> StreamCommitted:
    stream = reader.string()
    (ordinal,) = reader.unpack(_U64)
    txn_id = reader.required_txn_id()
    return StreamCommitted(stream, ordinal, txn_id, *reader.unpack(_I64))


_DECODERS = {1: _decode_opened, 2: _decode_registered, 3: _decode_deadline_reset,
             4: _decode_prepared, 5: _decode_decided, 6: _decode_completed,
             7: _decode_session_started, 8: _decode_sequences_reserved, 9: _decode_staging,
             SESSION_BUMPED_TYPE: _decode_session_bumped, 11: _decode_stream_committed}
assert set(_DECODERS) == {*RECORD_TYPES.values(), SESSION_BUMPED_TYPE}


# --- The native core ----------------------------------------------------------------------
# partition_server/rust (src/records.rs) has encode_record in Rust, byte for byte this one;
# it takes the records the core builds and hands anything else to this one, which stays
# the reference and serves when the native core is off or not built
# (tests/test_native_records.py holds the two together; docs/native-core.md).
python_encode_record = encode_record


def _use_native() -> None:
    global encode_record
    from partition_server import native
    if native.core is None:
        return
    native.core.init_records(RECORD_TYPES, SESSION_BUMPED_TYPE, RECORD_FORMAT_VERSION, TxnId,
                             TopicPartition, SubscriptionPartition, python_encode_record)
    encode_record = native.core.encode_record


_use_native()
