"""The error model: every failure leaves a service as a gRPC status carrying a
`google.rpc.Status` with one `google.rpc.ErrorInfo` (domain `atomlog.v1`).

The table `REASONS` is the single source of truth: reason → gRPC code → what the
caller should do. `docs/errors.md` is generated from it (`python -m services.errors`)
and a test keeps the two in sync. Servicers raise `AtomlogError`; the server's
interceptor (services/interceptors.py) turns it into the status, in one place.

Classes of outcome, from the caller's point of view:
- retriable: the same request may succeed later (after a backoff, a metadata refresh
  or a new coordinator lookup); retrying it is safe.
- abortable: the current transaction (or producer session) cannot go on; abort it
  and start a new one.
- fatal: the request, or the caller's state, is wrong; retrying it unchanged fails.
"""

from __future__ import annotations

import argparse
import enum
from dataclasses import dataclass, field

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2

DOMAIN = "atomlog.v1"
STATUS_DETAILS_KEY = "grpc-status-details-bin"


class Outcome(enum.Enum):
    RETRIABLE = "retriable"
    ABORTABLE = "abortable"
    FATAL = "fatal"


class Fault(enum.Enum):
    """Whose fault an error is (h11-style): the caller's or the server's side."""

    CALLER = "caller"
    SERVER = "server"


@dataclass(frozen=True)
class Reason:
    name: str
    code: grpc.StatusCode
    outcome: Outcome
    fault: Fault
    meaning: str


def _r(name: str, code: grpc.StatusCode, outcome: Outcome, fault: Fault, meaning: str) -> Reason:
    return Reason(name, code, outcome, fault, meaning)


C, S = Fault.CALLER, Fault.SERVER
RETRY, ABORT, FATAL = Outcome.RETRIABLE, Outcome.ABORTABLE, Outcome.FATAL
SC = grpc.StatusCode

REASONS: dict[str, Reason] = {r.name: r for r in [
    # Request validation.
    _r("INVALID_ARGUMENT", SC.INVALID_ARGUMENT, FATAL, C,
       "A field is missing, out of range or malformed; the message names it."),
    _r("INVALID_TOPIC_NAME", SC.INVALID_ARGUMENT, FATAL, C,
       "Topic names are 1-249 characters of [a-zA-Z0-9._-], not '.' or '..'; "
       "'__' starts internal topics only."),
    _r("INVALID_PARTITION_COUNT", SC.INVALID_ARGUMENT, FATAL, C,
       "A topic needs between 1 and topics.max_partitions partitions."),
    _r("INVALID_TOPIC_CONFIG", SC.INVALID_ARGUMENT, FATAL, C,
       "An unknown topic setting, or a value out of its range."),
    _r("INVALID_REPLICATION_FACTOR", SC.INVALID_ARGUMENT, FATAL, C,
       "A replication factor must be 1-7 and at most the number of partition servers."),
    _r("INVALID_REPLICA_ASSIGNMENT", SC.INVALID_ARGUMENT, FATAL, C,
       "A partition's new replica list names an unregistered server, a server twice, or "
       "fewer servers than min.insync.replicas; or the topic keeps a single copy without "
       "replication state. Nothing was changed."),
    _r("TOPIC_ALREADY_EXISTS", SC.ALREADY_EXISTS, FATAL, C,
       "A topic with this name exists; nothing was changed."),
    _r("UNKNOWN_TOPIC_OR_PARTITION", SC.NOT_FOUND, RETRY, C,
       "No such topic or partition; retry after a metadata refresh if it was just created."),
    _r("CORRUPT_BATCH", SC.INVALID_ARGUMENT, FATAL, C,
       "A record batch is truncated, malformed or fails its CRC32C check; nothing was appended."),
    _r("CRC_MISMATCH", SC.INVALID_ARGUMENT, FATAL, C,
       "A record batch's CRC32C does not match its bytes; nothing was appended."),
    _r("BATCH_TOO_LARGE", SC.INVALID_ARGUMENT, FATAL, C,
       "A record batch exceeds partition.max_batch_bytes; nothing was appended."),
    _r("OFFSET_OUT_OF_RANGE", SC.OUT_OF_RANGE, FATAL, C,
       "The offset is below the log start offset or above the high watermark; seek to a valid one."),
    # Routing and availability.
    _r("NOT_PARTITION_OWNER", SC.FAILED_PRECONDITION, RETRY, C,
       "This server does not own the partition; metadata names the owner. Refresh and retry."),
    _r("NOT_A_REPLICA", SC.FAILED_PRECONDITION, FATAL, C,
       "A replica fetch from a server that holds no replica of the partition."),
    _r("NOT_ENOUGH_REPLICAS", SC.UNAVAILABLE, RETRY, S,
       "Fewer in-sync replicas than min.insync.replicas hold the partition; nothing was "
       "written (a retry of a batch already written is not refused: it is answered as a "
       "duplicate once replicated). Retry once a replica catches up or returns."),
    _r("FENCED_LEADER_EPOCH", SC.FAILED_PRECONDITION, RETRY, S,
       "A replica call carried another leader epoch than this leader's; the caller rereads "
       "the partition's state (internal: between partition servers)."),
    _r("STALE_REPLICA_INCARNATION", SC.FAILED_PRECONDITION, FATAL, S,
       "A replica fetch from an older start of that server than one the leader has seen; the "
       "sender has been replaced by a newer process of its name (internal: between partition "
       "servers)."),
    _r("REPLICATE_SESSION_INVALID", SC.FAILED_PRECONDITION, RETRY, S,
       "An incremental ReplicateMany named a fetch session this leader does not hold (never "
       "opened, replaced, dropped, or the leader restarted) or not the next epoch of it; "
       "nothing was recorded. The follower opens a new session with a full request "
       "(internal: between partition servers)."),
    _r("NO_PARTITION_SERVERS", SC.UNAVAILABLE, RETRY, S,
       "No partition server is registered, so partitions cannot be assigned."),
    _r("ZOOKEEPER_UNAVAILABLE", SC.UNAVAILABLE, RETRY, S,
       "The server has no ZooKeeper session right now; it recovers by itself when ZooKeeper returns."),
    _r("SHUTTING_DOWN", SC.UNAVAILABLE, RETRY, S,
       "The server is draining before it stops; retry elsewhere or later."),
    _r("SERVER_UNAVAILABLE", SC.UNAVAILABLE, RETRY, S,
       "The server could not be reached (connection refused or lost); set by clients for "
       "transport failures that carry no ErrorInfo."),
    _r("REQUEST_TIMED_OUT", SC.DEADLINE_EXCEEDED, RETRY, S,
       "No answer within the call's deadline: the outcome is unknown. Idempotent calls "
       "(produce with a producer id, markers, commits) are safe to retry."),
    _r("RESOURCE_EXHAUSTED", SC.RESOURCE_EXHAUSTED, RETRY, S,
       "A configured limit was hit (queue, table, in-flight requests); metadata names the limit."),
    _r("DATA_LOSS", SC.DATA_LOSS, FATAL, S,
       "The partition found corruption before its log tail and refuses to serve until an operator "
       "acts; metadata names the file and offset."),
    _r("DATA_LOSS_MISMATCH", SC.FAILED_PRECONDITION, FATAL, C,
       "RecoverPartition named a file or offset other than the corruption the partition reports."),
    _r("PARTITION_NOT_IN_DATA_LOSS", SC.FAILED_PRECONDITION, FATAL, C,
       "RecoverPartition was called for a partition that is not refusing to serve."),
    _r("PARTITION_HAS_LEADER", SC.FAILED_PRECONDITION, FATAL, C,
       "ElectLeader was called for a partition that has a leader: only an offline partition "
       "is elected by hand (metadata names the leader and its epoch)."),
    _r("PARTITION_LOADING", SC.UNAVAILABLE, RETRY, S,
       "The partition is recovering its log, producer state or transaction buffer after a start."),
    # Idempotent producers.
    _r("OUT_OF_ORDER_SEQUENCE", SC.FAILED_PRECONDITION, ABORT, C,
       "A batch's sequence leaves a gap after the producer's last batch; the producer must reset."),
    _r("PRODUCER_FENCED", SC.FAILED_PRECONDITION, FATAL, C,
       "A newer epoch of this producer (or transactional id) exists; this instance must stop."),
    _r("UNKNOWN_PRODUCER_ID", SC.FAILED_PRECONDITION, ABORT, C,
       "The partition has no state for this producer and the sequence is not 0."),
    _r("PRODUCER_ID_SPACE_EXHAUSTED", SC.RESOURCE_EXHAUSTED, FATAL, S,
       "The 64-bit producer-id space is used up."),
    _r("ID_ALLOCATION_CONFLICT", SC.ABORTED, RETRY, S,
       "Concurrent allocators kept winning the compare-and-set; no block was issued."),
    _r("PRODUCER_ID_BLOCK_CORRUPT", SC.DATA_LOSS, FATAL, S,
       "The /producer_id_block znode does not hold a valid block record, or went backwards "
       "(deleted or restored by hand); no producer ids are issued until an operator repairs it."),
    # Transactions.
    _r("COORDINATOR_LOADING", SC.UNAVAILABLE, RETRY, S,
       "The TC partition is loading its log after a lease change."),
    _r("NOT_COORDINATOR", SC.FAILED_PRECONDITION, RETRY, C,
       "This coordinator does not hold the TC partition's lease; metadata names the holder."),
    _r("STALE_COORDINATOR_EPOCH", SC.FAILED_PRECONDITION, FATAL, S,
       "A marker or TC log append carried an older coordinator epoch than the partition has seen: "
       "a newer coordinator owns the TC partition and the sender must stop acting for it."),
    _r("CONCURRENT_TRANSACTIONS", SC.UNAVAILABLE, RETRY, C,
       "The transaction (or transactional id) has a state change in progress; retry shortly."),
    _r("INVALID_TRANSACTION_TIMEOUT", SC.INVALID_ARGUMENT, FATAL, C,
       "The transaction timeout is not positive or exceeds transaction.max_timeout_ms."),
    _r("UNKNOWN_TRANSACTION", SC.NOT_FOUND, FATAL, C,
       "No such transaction at its TC partition."),
    _r("TRANSACTION_NOT_OPEN", SC.FAILED_PRECONDITION, ABORT, C,
       "The transaction is not OPEN, so it takes no more partitions, writes or acks."),
    _r("TRANSACTION_ALREADY_COMMITTED", SC.FAILED_PRECONDITION, FATAL, C,
       "Aborting (or preparing) a transaction that was already committed."),
    _r("STREAM_ORDINAL_COMMITTED", SC.FAILED_PRECONDITION, FATAL, C,
       "The transaction's stream (TxnStream) committed this ordinal or a later one already "
       "(metadata `committed_ordinal`, `committed_txn_id`): its work is done, so it is not "
       "opened or committed again. A Spark streaming micro-batch replayed after its commit "
       "writes nothing."),
    _r("TRANSACTION_PREPARED", SC.FAILED_PRECONDITION, FATAL, C,
       "The transaction is PREPARED: only its parent's decision (or an explicit operator abort "
       "with allow_prepared) ends it."),
    _r("PARENT_NOT_OPEN", SC.FAILED_PRECONDITION, ABORT, C,
       "A child transaction was asked for under a parent that is no longer OPEN."),
    _r("CHILD_NOT_PREPARED", SC.FAILED_PRECONDITION, ABORT, C,
       "A parent's commit named a child that is not PREPARED; nothing was decided."),
    _r("TRANSACTION_IS_CHILD", SC.FAILED_PRECONDITION, FATAL, C,
       "A child transaction is ended by its parent's decision, not by EndTxn on the child."),
    _r("TRANSACTION_ABORTED", SC.ABORTED, ABORT, C,
       "The transaction was aborted; committing it is refused. Start a new transaction."),
    _r("TRANSACTION_TIMED_OUT", SC.ABORTED, ABORT, C,
       "The transaction passed its timeout and was aborted. Start a new transaction."),
    _r("EARLIER_COMMIT_FAILED", SC.ABORTED, RETRY, S,
       "CommitTxns: a commit before this one in the same call was refused or did not "
       "stage at its first attempt, so this one did not commit (anything it staged is "
       "aborted): it may not reach a partition before the earlier one. Send it again "
       "(the same idempotency key may be used) once the earlier commit's outcome is "
       "known."),
    _r("TRANSACTION_CONFLICT", SC.ABORTED, ABORT, C,
       "A message is already acknowledged in another open transaction."),
    _r("PARTITION_NOT_IN_TRANSACTION", SC.FAILED_PRECONDITION, ABORT, C,
       "A transactional write or ack reached a partition the coordinator does not list for the "
       "transaction (or the transaction is not open)."),
    _r("UNKNOWN_SUBSCRIPTION", SC.NOT_FOUND, FATAL, C,
       "No such subscription on this topic."),
    # Security.
    _r("UNAUTHENTICATED", SC.UNAUTHENTICATED, FATAL, C,
       "The call carries no usable credentials (auth.mode): no client certificate, no bearer "
       "token, or a token that is unknown, expired, for another issuer or audience, or badly "
       "signed; metadata `failure` says which. Fix the credentials, then retry."),
    _r("PERMISSION_DENIED", SC.PERMISSION_DENIED, FATAL, C,
       "The caller's principal lacks a permission the call needs (auth.authorizer=acl, "
       "docs/security.md); metadata `operation`, `resource_type` and `resource_name` name "
       "it, `principal` the caller. Nothing was changed. Ask an operator for the ACL "
       "(`atomlog acl add`), then retry."),
    # Everything else.
    _r("UNIMPLEMENTED", SC.UNIMPLEMENTED, FATAL, S,
       "This server does not implement the method (yet)."),
    _r("INTERNAL", SC.INTERNAL, FATAL, S,
       "A bug: the server logged the details. Nothing is known to have been applied."),
]}


@dataclass
class AtomlogError(Exception):
    """An error with a reason from REASONS. Raise it from servicers and cores."""

    reason: str
    message: str
    metadata: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.reason not in REASONS:
            raise ValueError(f"unknown error reason {self.reason!r}")
        super().__init__(self.message)
        self.metadata = {str(k): str(v) for k, v in self.metadata.items()}

    def __str__(self) -> str:
        return f"{self.reason}: {self.message}"

    @property
    def code(self) -> grpc.StatusCode:
        return REASONS[self.reason].code

    @property
    def outcome(self) -> Outcome:
        return REASONS[self.reason].outcome

    @property
    def retriable(self) -> bool:
        return self.outcome is Outcome.RETRIABLE

    def to_status_proto(self) -> status_pb2.Status:
        info = error_details_pb2.ErrorInfo(reason=self.reason, domain=DOMAIN,
                                           metadata=self.metadata)
        detail = any_pb2.Any()
        detail.Pack(info)
        return status_pb2.Status(code=self.code.value[0], message=self.message, details=[detail])

    def trailing_metadata(self) -> tuple[tuple[str, bytes], ...]:
        return ((STATUS_DETAILS_KEY, self.to_status_proto().SerializeToString()),)


def unexpected(error: Exception, where: str) -> AtomlogError:
    """The AtomlogError an RPC answers for an exception no handler expected: a lost or
    expired ZooKeeper connection is ZOOKEEPER_UNAVAILABLE (retriable: the session comes
    back or the server is replaced), anything else INTERNAL (a bug; the caller logs it)."""
    from kazoo.exceptions import ConnectionClosedError, ConnectionLoss, SessionExpiredError

    if isinstance(error, (ConnectionLoss, SessionExpiredError, ConnectionClosedError)):
        return AtomlogError("ZOOKEEPER_UNAVAILABLE", f"{where}: ZooKeeper is unreachable "
                            f"({type(error).__name__}); retry", {"retry_after_ms": "500"})
    return AtomlogError("INTERNAL", f"internal error in {where}; see the server log")


def from_item(item) -> AtomlogError:
    """The AtomlogError an ItemError carries (any message with reason, message and
    metadata); a reason this server does not know reads as INTERNAL."""
    reason = item.reason if item.reason in REASONS else "INTERNAL"
    return AtomlogError(reason, item.message, dict(item.metadata))


def from_rpc_error(error: grpc.RpcError) -> AtomlogError:
    """Decode a client-side RpcError into an AtomlogError (best effort for foreign errors)."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = error.details() if hasattr(error, "details") else str(error)
    trailing = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    for key, value in trailing or ():
        if key != STATUS_DETAILS_KEY:
            continue
        status = status_pb2.Status.FromString(value)
        for detail in status.details:
            info = error_details_pb2.ErrorInfo()
            if detail.Unpack(info) and info.domain == DOMAIN and info.reason in REASONS:
                return AtomlogError(info.reason, status.message, dict(info.metadata))
    reason = _REASON_FOR_BARE_CODE.get(code, "INTERNAL")
    return AtomlogError(reason, details or code.name, {"grpc_code": code.name})


# A status without ErrorInfo (transport failures, deadlines) maps to the closest reason.
_REASON_FOR_BARE_CODE = {
    SC.INVALID_ARGUMENT: "INVALID_ARGUMENT",
    SC.UNIMPLEMENTED: "UNIMPLEMENTED",
    SC.RESOURCE_EXHAUSTED: "RESOURCE_EXHAUSTED",
    SC.UNAVAILABLE: "SERVER_UNAVAILABLE",
    SC.DEADLINE_EXCEEDED: "REQUEST_TIMED_OUT",
    SC.UNAUTHENTICATED: "UNAUTHENTICATED",
    SC.PERMISSION_DENIED: "PERMISSION_DENIED",
}


def markdown_table() -> str:
    lines = [
        "# Errors",
        "",
        "Every atomlog RPC that fails answers with a gRPC status whose details carry a",
        "`google.rpc.Status` with one `google.rpc.ErrorInfo`: `domain` is `atomlog.v1`,",
        "`reason` is one of the names below, and `metadata` adds facts (the owner of a",
        "partition, the limit that was hit, the file and offset of corruption).",
        "Nothing is half-applied: a request that fails changed nothing, except where a",
        "batched request reports results per item (Produce, Fetch, markers).",
        "",
        "What the caller does:",
        "- **retriable**: the same request may succeed later; retry with backoff (refresh",
        "  metadata first for routing errors). Retrying is safe.",
        "- **abortable**: the transaction or producer session cannot continue; abort it and",
        "  start a new one.",
        "- **fatal**: the request or the caller's state is wrong; retrying it unchanged fails.",
        "",
        "This file is generated by `python -m services.errors > docs/errors.md` from",
        "`services/errors.py`; a test keeps them in sync.",
        "",
        "| reason | gRPC code | outcome | fault | meaning |",
        "| --- | --- | --- | --- | --- |",
    ]
    for reason in REASONS.values():
        lines.append(f"| `{reason.name}` | {reason.code.name} | {reason.outcome.value} | "
                     f"{reason.fault.value} | {reason.meaning} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    argparse.ArgumentParser(prog="python -m services.errors",
                            description="Print docs/errors.md (the error table).").parse_args()
    print(markdown_table(), end="")


if __name__ == "__main__":
    main()
