"""The error model: the reason table, docs/errors.md, and status round trips."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2

from services.errors import DOMAIN, REASONS, AtomlogError, Outcome, from_rpc_error, markdown_table

DOCS = Path(__file__).resolve().parent.parent / "docs" / "errors.md"


def test_docs_errors_md_is_generated_from_the_table():
    assert DOCS.read_text() == markdown_table(), "run: python -m services.errors > docs/errors.md"


def test_issue_reasons_exist_with_sensible_codes():
    for name in ("OUT_OF_ORDER_SEQUENCE", "PRODUCER_FENCED", "UNKNOWN_PRODUCER_ID",
                 "COORDINATOR_LOADING", "INVALID_TRANSACTION_TIMEOUT", "TRANSACTION_CONFLICT",
                 "DATA_LOSS", "NOT_PARTITION_OWNER", "RESOURCE_EXHAUSTED"):
        assert name in REASONS
    assert REASONS["COORDINATOR_LOADING"].outcome is Outcome.RETRIABLE
    assert REASONS["PRODUCER_FENCED"].outcome is Outcome.FATAL
    assert REASONS["TRANSACTION_ABORTED"].outcome is Outcome.ABORTABLE
    assert REASONS["DATA_LOSS"].code is grpc.StatusCode.DATA_LOSS


def test_unknown_reason_is_a_programming_error():
    with pytest.raises(ValueError):
        AtomlogError("NO_SUCH_REASON", "x")


class _FakeRpcError(grpc.RpcError):
    """Only the three accessors a client-side RpcError has; built from a real status."""

    def __init__(self, error: AtomlogError):
        self._error = error

    def code(self):
        return self._error.code

    def details(self):
        return self._error.message

    def trailing_metadata(self):
        return self._error.trailing_metadata()


def test_status_round_trip_keeps_reason_message_and_metadata():
    original = AtomlogError("NOT_PARTITION_OWNER", "ps-2 owns orders-3", {"owner": "ps-2"})
    status = original.to_status_proto()
    assert status.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    decoded = from_rpc_error(_FakeRpcError(original))
    assert (decoded.reason, decoded.message, decoded.metadata) == (
        "NOT_PARTITION_OWNER", "ps-2 owns orders-3", {"owner": "ps-2"})
    assert decoded.retriable
    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info) and info.domain == DOMAIN == "atomlog.v1"
