"""Typed exceptions of the atomlog SDK, one per reason in docs/errors.md.

Every exception derives from `AtomlogClientError` and says whether retrying helps:
`retriable` (the same call may succeed later; the SDK already retried it within its
timeout), `abortable` (abort the transaction or producer session and start again), or
neither (fatal: fix the request or stop). Example:

    try:
        txn.commit()
    except errors.TransactionAborted:
        ...  # start a new transaction
    except errors.AtomlogClientError as error:
        if error.retriable: ...
"""

from __future__ import annotations

import grpc

from services.errors import REASONS, AtomlogError, Outcome, from_rpc_error


class AtomlogClientError(Exception):
    """Base of every SDK error. `reason` is the ErrorInfo reason (docs/errors.md)."""

    reason = "INTERNAL"

    def __init__(self, message: str, metadata: dict[str, str] | None = None):
        super().__init__(f"{self.reason}: {message}")
        self.message = message
        self.metadata = dict(metadata or {})

    @property
    def outcome(self) -> Outcome:
        return REASONS[self.reason].outcome

    @property
    def retriable(self) -> bool:
        return self.outcome is Outcome.RETRIABLE

    @property
    def abortable(self) -> bool:
        return self.outcome is Outcome.ABORTABLE


def _class_name(reason: str) -> str:
    return "".join(part.capitalize() for part in reason.split("_"))


_BY_REASON: dict[str, type[AtomlogClientError]] = {}
for _reason in REASONS:
    _cls = type(_class_name(_reason), (AtomlogClientError,), {
        "reason": _reason, "__doc__": REASONS[_reason].meaning,
        "__module__": __name__})
    _BY_REASON[_reason] = _cls
    globals()[_cls.__name__] = _cls

# Names most callers use, spelled out for readers and type checkers.
ProducerFenced: type[AtomlogClientError] = _BY_REASON["PRODUCER_FENCED"]
OutOfOrderSequence: type[AtomlogClientError] = _BY_REASON["OUT_OF_ORDER_SEQUENCE"]
UnknownProducerId: type[AtomlogClientError] = _BY_REASON["UNKNOWN_PRODUCER_ID"]
TransactionAborted: type[AtomlogClientError] = _BY_REASON["TRANSACTION_ABORTED"]
TransactionTimedOut: type[AtomlogClientError] = _BY_REASON["TRANSACTION_TIMED_OUT"]
TransactionConflict: type[AtomlogClientError] = _BY_REASON["TRANSACTION_CONFLICT"]
TopicAlreadyExists: type[AtomlogClientError] = _BY_REASON["TOPIC_ALREADY_EXISTS"]
UnknownTopicOrPartition: type[AtomlogClientError] = _BY_REASON["UNKNOWN_TOPIC_OR_PARTITION"]
NotPartitionOwner: type[AtomlogClientError] = _BY_REASON["NOT_PARTITION_OWNER"]
DataLoss: type[AtomlogClientError] = _BY_REASON["DATA_LOSS"]
BatchTooLarge: type[AtomlogClientError] = _BY_REASON["BATCH_TOO_LARGE"]
Internal: type[AtomlogClientError] = _BY_REASON["INTERNAL"]
Unauthenticated: type[AtomlogClientError] = _BY_REASON["UNAUTHENTICATED"]


class DeliveryTimeout(AtomlogClientError):
    """A record was not acknowledged within the producer's delivery timeout: it may or
    may not have been written. The last error seen is in `__cause__`. Retriable."""

    reason = "REQUEST_TIMED_OUT"


def error_for(reason: str, message: str, metadata: dict[str, str] | None = None) -> AtomlogClientError:
    return _BY_REASON.get(reason, Internal)(message, metadata)


def from_server_error(error: AtomlogError) -> AtomlogClientError:
    return error_for(error.reason, error.message, error.metadata)


def from_grpc(error: grpc.RpcError) -> AtomlogClientError:
    """The typed exception for a failed call; transport failures without an ErrorInfo
    become SERVER_UNAVAILABLE or REQUEST_TIMED_OUT (both retriable)."""
    return from_server_error(from_rpc_error(error))
