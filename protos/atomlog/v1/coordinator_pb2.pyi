from atomlog.v1 import common_pb2 as _common_pb2
from atomlog.v1 import partition_pb2 as _partition_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TxnState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TXN_STATE_UNSPECIFIED: _ClassVar[TxnState]
    TXN_STATE_OPEN: _ClassVar[TxnState]
    TXN_STATE_PREPARED: _ClassVar[TxnState]
    TXN_STATE_COMMITTING: _ClassVar[TxnState]
    TXN_STATE_ABORTING: _ClassVar[TxnState]
    TXN_STATE_COMMITTED: _ClassVar[TxnState]
    TXN_STATE_ABORTED: _ClassVar[TxnState]

class TxnEndCause(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TXN_END_CAUSE_UNSPECIFIED: _ClassVar[TxnEndCause]
    TXN_END_CAUSE_CLIENT: _ClassVar[TxnEndCause]
    TXN_END_CAUSE_TIMEOUT: _ClassVar[TxnEndCause]
    TXN_END_CAUSE_PREPARED_TIMEOUT: _ClassVar[TxnEndCause]
    TXN_END_CAUSE_PARENT: _ClassVar[TxnEndCause]
    TXN_END_CAUSE_SESSION_FENCED: _ClassVar[TxnEndCause]
    TXN_END_CAUSE_OPERATOR: _ClassVar[TxnEndCause]
TXN_STATE_UNSPECIFIED: TxnState
TXN_STATE_OPEN: TxnState
TXN_STATE_PREPARED: TxnState
TXN_STATE_COMMITTING: TxnState
TXN_STATE_ABORTING: TxnState
TXN_STATE_COMMITTED: TxnState
TXN_STATE_ABORTED: TxnState
TXN_END_CAUSE_UNSPECIFIED: TxnEndCause
TXN_END_CAUSE_CLIENT: TxnEndCause
TXN_END_CAUSE_TIMEOUT: TxnEndCause
TXN_END_CAUSE_PREPARED_TIMEOUT: TxnEndCause
TXN_END_CAUSE_PARENT: TxnEndCause
TXN_END_CAUSE_SESSION_FENCED: TxnEndCause
TXN_END_CAUSE_OPERATOR: TxnEndCause

class TransactionalSession(_message.Message):
    __slots__ = ("transactional_id", "producer_id", "producer_epoch")
    TRANSACTIONAL_ID_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_ID_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    transactional_id: str
    producer_id: int
    producer_epoch: int
    def __init__(self, transactional_id: _Optional[str] = ..., producer_id: _Optional[int] = ..., producer_epoch: _Optional[int] = ...) -> None: ...

class TxnStream(_message.Message):
    __slots__ = ("name", "ordinal")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ORDINAL_FIELD_NUMBER: _ClassVar[int]
    name: str
    ordinal: int
    def __init__(self, name: _Optional[str] = ..., ordinal: _Optional[int] = ...) -> None: ...

class TxnPartitionResult(_message.Message):
    __slots__ = ("topic_partition", "error")
    TOPIC_PARTITION_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    topic_partition: _common_pb2.TopicPartition
    error: _partition_pb2.ItemError
    def __init__(self, topic_partition: _Optional[_Union[_common_pb2.TopicPartition, _Mapping]] = ..., error: _Optional[_Union[_partition_pb2.ItemError, _Mapping]] = ...) -> None: ...

class TxnSubscriptionResult(_message.Message):
    __slots__ = ("subscription_partition", "error")
    SUBSCRIPTION_PARTITION_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    subscription_partition: _common_pb2.SubscriptionPartition
    error: _partition_pb2.ItemError
    def __init__(self, subscription_partition: _Optional[_Union[_common_pb2.SubscriptionPartition, _Mapping]] = ..., error: _Optional[_Union[_partition_pb2.ItemError, _Mapping]] = ...) -> None: ...

class NewTxnRequest(_message.Message):
    __slots__ = ("tc_partition", "timeout_ms", "parent_txn_id", "session", "idempotency_key", "topic_partitions", "subscription_partitions", "stream")
    TC_PARTITION_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    PARENT_TXN_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    TOPIC_PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIPTION_PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    tc_partition: int
    timeout_ms: int
    parent_txn_id: _common_pb2.TxnId
    session: TransactionalSession
    idempotency_key: str
    topic_partitions: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopicPartition]
    subscription_partitions: _containers.RepeatedCompositeFieldContainer[_common_pb2.SubscriptionPartition]
    stream: TxnStream
    def __init__(self, tc_partition: _Optional[int] = ..., timeout_ms: _Optional[int] = ..., parent_txn_id: _Optional[_Union[_common_pb2.TxnId, _Mapping]] = ..., session: _Optional[_Union[TransactionalSession, _Mapping]] = ..., idempotency_key: _Optional[str] = ..., topic_partitions: _Optional[_Iterable[_Union[_common_pb2.TopicPartition, _Mapping]]] = ..., subscription_partitions: _Optional[_Iterable[_Union[_common_pb2.SubscriptionPartition, _Mapping]]] = ..., stream: _Optional[_Union[TxnStream, _Mapping]] = ...) -> None: ...

class NewTxnResponse(_message.Message):
    __slots__ = ("txn_id", "state", "existing", "timeout_ms", "topic_partition_results", "subscription_partition_results")
    TXN_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    EXISTING_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    TOPIC_PARTITION_RESULTS_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIPTION_PARTITION_RESULTS_FIELD_NUMBER: _ClassVar[int]
    txn_id: _common_pb2.TxnId
    state: TxnState
    existing: bool
    timeout_ms: int
    topic_partition_results: _containers.RepeatedCompositeFieldContainer[TxnPartitionResult]
    subscription_partition_results: _containers.RepeatedCompositeFieldContainer[TxnSubscriptionResult]
    def __init__(self, txn_id: _Optional[_Union[_common_pb2.TxnId, _Mapping]] = ..., state: _Optional[_Union[TxnState, str]] = ..., existing: _Optional[bool] = ..., timeout_ms: _Optional[int] = ..., topic_partition_results: _Optional[_Iterable[_Union[TxnPartitionResult, _Mapping]]] = ..., subscription_partition_results: _Optional[_Iterable[_Union[TxnSubscriptionResult, _Mapping]]] = ...) -> None: ...

class AddPartitionToTxnRequest(_message.Message):
    __slots__ = ("txn_id", "topic_partitions", "session")
    TXN_ID_FIELD_NUMBER: _ClassVar[int]
    TOPIC_PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    txn_id: _common_pb2.TxnId
    topic_partitions: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopicPartition]
    session: TransactionalSession
    def __init__(self, txn_id: _Optional[_Union[_common_pb2.TxnId, _Mapping]] = ..., topic_partitions: _Optional[_Iterable[_Union[_common_pb2.TopicPartition, _Mapping]]] = ..., session: _Optional[_Union[TransactionalSession, _Mapping]] = ...) -> None: ...

class AddPartitionToTxnResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[TxnPartitionResult]
    def __init__(self, results: _Optional[_Iterable[_Union[TxnPartitionResult, _Mapping]]] = ...) -> None: ...

class AddSubscriptionToTxnRequest(_message.Message):
    __slots__ = ("txn_id", "subscription_partitions", "session")
    TXN_ID_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIPTION_PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    txn_id: _common_pb2.TxnId
    subscription_partitions: _containers.RepeatedCompositeFieldContainer[_common_pb2.SubscriptionPartition]
    session: TransactionalSession
    def __init__(self, txn_id: _Optional[_Union[_common_pb2.TxnId, _Mapping]] = ..., subscription_partitions: _Optional[_Iterable[_Union[_common_pb2.SubscriptionPartition, _Mapping]]] = ..., session: _Optional[_Union[TransactionalSession, _Mapping]] = ...) -> None: ...

class AddSubscriptionToTxnResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[TxnSubscriptionResult]
    def __init__(self, results: _Optional[_Iterable[_Union[TxnSubscriptionResult, _Mapping]]] = ...) -> None: ...

class PrepareTxnRequest(_message.Message):
    __slots__ = ("txn_id", "prepared_timeout_ms", "session")
    TXN_ID_FIELD_NUMBER: _ClassVar[int]
    PREPARED_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    txn_id: _common_pb2.TxnId
    prepared_timeout_ms: int
    session: TransactionalSession
    def __init__(self, txn_id: _Optional[_Union[_common_pb2.TxnId, _Mapping]] = ..., prepared_timeout_ms: _Optional[int] = ..., session: _Optional[_Union[TransactionalSession, _Mapping]] = ...) -> None: ...

class PrepareTxnResponse(_message.Message):
    __slots__ = ("state", "prepared_timeout_ms")
    STATE_FIELD_NUMBER: _ClassVar[int]
    PREPARED_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    state: TxnState
    prepared_timeout_ms: int
    def __init__(self, state: _Optional[_Union[TxnState, str]] = ..., prepared_timeout_ms: _Optional[int] = ...) -> None: ...

class EndTxnRequest(_message.Message):
    __slots__ = ("txn_id", "decision", "children_to_keep", "session", "wait_for_markers", "stream")
    TXN_ID_FIELD_NUMBER: _ClassVar[int]
    DECISION_FIELD_NUMBER: _ClassVar[int]
    CHILDREN_TO_KEEP_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    WAIT_FOR_MARKERS_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    txn_id: _common_pb2.TxnId
    decision: _partition_pb2.TxnDecision
    children_to_keep: _containers.RepeatedCompositeFieldContainer[_common_pb2.TxnId]
    session: TransactionalSession
    wait_for_markers: bool
    stream: TxnStream
    def __init__(self, txn_id: _Optional[_Union[_common_pb2.TxnId, _Mapping]] = ..., decision: _Optional[_Union[_partition_pb2.TxnDecision, str]] = ..., children_to_keep: _Optional[_Iterable[_Union[_common_pb2.TxnId, _Mapping]]] = ..., session: _Optional[_Union[TransactionalSession, _Mapping]] = ..., wait_for_markers: _Optional[bool] = ..., stream: _Optional[_Union[TxnStream, _Mapping]] = ...) -> None: ...

class EndTxnResponse(_message.Message):
    __slots__ = ("state", "already_ended", "kept_child_txn_ids", "aborted_child_txn_ids")
    STATE_FIELD_NUMBER: _ClassVar[int]
    ALREADY_ENDED_FIELD_NUMBER: _ClassVar[int]
    KEPT_CHILD_TXN_IDS_FIELD_NUMBER: _ClassVar[int]
    ABORTED_CHILD_TXN_IDS_FIELD_NUMBER: _ClassVar[int]
    state: TxnState
    already_ended: bool
    kept_child_txn_ids: _containers.RepeatedCompositeFieldContainer[_common_pb2.TxnId]
    aborted_child_txn_ids: _containers.RepeatedCompositeFieldContainer[_common_pb2.TxnId]
    def __init__(self, state: _Optional[_Union[TxnState, str]] = ..., already_ended: _Optional[bool] = ..., kept_child_txn_ids: _Optional[_Iterable[_Union[_common_pb2.TxnId, _Mapping]]] = ..., aborted_child_txn_ids: _Optional[_Iterable[_Union[_common_pb2.TxnId, _Mapping]]] = ...) -> None: ...

class CommitTxnRequest(_message.Message):
    __slots__ = ("tc_partition", "idempotency_key", "timeout_ms", "session", "batches", "acks", "wait_for_markers", "abort")
    TC_PARTITION_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    ACKS_FIELD_NUMBER: _ClassVar[int]
    WAIT_FOR_MARKERS_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    tc_partition: int
    idempotency_key: str
    timeout_ms: int
    session: TransactionalSession
    batches: _containers.RepeatedCompositeFieldContainer[_partition_pb2.ProduceItem]
    acks: _containers.RepeatedCompositeFieldContainer[_partition_pb2.AckItem]
    wait_for_markers: bool
    abort: bool
    def __init__(self, tc_partition: _Optional[int] = ..., idempotency_key: _Optional[str] = ..., timeout_ms: _Optional[int] = ..., session: _Optional[_Union[TransactionalSession, _Mapping]] = ..., batches: _Optional[_Iterable[_Union[_partition_pb2.ProduceItem, _Mapping]]] = ..., acks: _Optional[_Iterable[_Union[_partition_pb2.AckItem, _Mapping]]] = ..., wait_for_markers: _Optional[bool] = ..., abort: _Optional[bool] = ...) -> None: ...

class CommitTxnResponse(_message.Message):
    __slots__ = ("txn_id", "state", "already_ended", "batch_results")
    TXN_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ALREADY_ENDED_FIELD_NUMBER: _ClassVar[int]
    BATCH_RESULTS_FIELD_NUMBER: _ClassVar[int]
    txn_id: _common_pb2.TxnId
    state: TxnState
    already_ended: bool
    batch_results: _containers.RepeatedCompositeFieldContainer[_partition_pb2.ProduceResult]
    def __init__(self, txn_id: _Optional[_Union[_common_pb2.TxnId, _Mapping]] = ..., state: _Optional[_Union[TxnState, str]] = ..., already_ended: _Optional[bool] = ..., batch_results: _Optional[_Iterable[_Union[_partition_pb2.ProduceResult, _Mapping]]] = ...) -> None: ...

class CommitTxnsRequest(_message.Message):
    __slots__ = ("commits",)
    COMMITS_FIELD_NUMBER: _ClassVar[int]
    commits: _containers.RepeatedCompositeFieldContainer[CommitTxnRequest]
    def __init__(self, commits: _Optional[_Iterable[_Union[CommitTxnRequest, _Mapping]]] = ...) -> None: ...

class CommitTxnsResult(_message.Message):
    __slots__ = ("response", "error")
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    response: CommitTxnResponse
    error: _partition_pb2.ItemError
    def __init__(self, response: _Optional[_Union[CommitTxnResponse, _Mapping]] = ..., error: _Optional[_Union[_partition_pb2.ItemError, _Mapping]] = ...) -> None: ...

class CommitTxnsResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[CommitTxnsResult]
    def __init__(self, results: _Optional[_Iterable[_Union[CommitTxnsResult, _Mapping]]] = ...) -> None: ...

class GetTxnStatusRequest(_message.Message):
    __slots__ = ("txn_id",)
    TXN_ID_FIELD_NUMBER: _ClassVar[int]
    txn_id: _common_pb2.TxnId
    def __init__(self, txn_id: _Optional[_Union[_common_pb2.TxnId, _Mapping]] = ...) -> None: ...

class GetTxnStatusResponse(_message.Message):
    __slots__ = ("state", "end_cause", "parent_txn_id", "remaining_ms")
    STATE_FIELD_NUMBER: _ClassVar[int]
    END_CAUSE_FIELD_NUMBER: _ClassVar[int]
    PARENT_TXN_ID_FIELD_NUMBER: _ClassVar[int]
    REMAINING_MS_FIELD_NUMBER: _ClassVar[int]
    state: TxnState
    end_cause: TxnEndCause
    parent_txn_id: _common_pb2.TxnId
    remaining_ms: int
    def __init__(self, state: _Optional[_Union[TxnState, str]] = ..., end_cause: _Optional[_Union[TxnEndCause, str]] = ..., parent_txn_id: _Optional[_Union[_common_pb2.TxnId, _Mapping]] = ..., remaining_ms: _Optional[int] = ...) -> None: ...

class InitProducerIdRequest(_message.Message):
    __slots__ = ("transactional_id", "transaction_timeout_ms", "producer_id", "producer_epoch")
    TRANSACTIONAL_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSACTION_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_ID_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    transactional_id: str
    transaction_timeout_ms: int
    producer_id: int
    producer_epoch: int
    def __init__(self, transactional_id: _Optional[str] = ..., transaction_timeout_ms: _Optional[int] = ..., producer_id: _Optional[int] = ..., producer_epoch: _Optional[int] = ...) -> None: ...

class InitProducerIdResponse(_message.Message):
    __slots__ = ("producer_id", "producer_epoch", "tc_partition", "aborted_txn_id", "transaction_timeout_ms")
    PRODUCER_ID_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    TC_PARTITION_FIELD_NUMBER: _ClassVar[int]
    ABORTED_TXN_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSACTION_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    producer_id: int
    producer_epoch: int
    tc_partition: int
    aborted_txn_id: _common_pb2.TxnId
    transaction_timeout_ms: int
    def __init__(self, producer_id: _Optional[int] = ..., producer_epoch: _Optional[int] = ..., tc_partition: _Optional[int] = ..., aborted_txn_id: _Optional[_Union[_common_pb2.TxnId, _Mapping]] = ..., transaction_timeout_ms: _Optional[int] = ...) -> None: ...

class VerifyTxnPartitionsRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[VerifyTxnPartitionsItem]
    def __init__(self, items: _Optional[_Iterable[_Union[VerifyTxnPartitionsItem, _Mapping]]] = ...) -> None: ...

class VerifyTxnPartitionsItem(_message.Message):
    __slots__ = ("txn_id", "topic_partition", "subscription_partition")
    TXN_ID_FIELD_NUMBER: _ClassVar[int]
    TOPIC_PARTITION_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIPTION_PARTITION_FIELD_NUMBER: _ClassVar[int]
    txn_id: _common_pb2.TxnId
    topic_partition: _common_pb2.TopicPartition
    subscription_partition: _common_pb2.SubscriptionPartition
    def __init__(self, txn_id: _Optional[_Union[_common_pb2.TxnId, _Mapping]] = ..., topic_partition: _Optional[_Union[_common_pb2.TopicPartition, _Mapping]] = ..., subscription_partition: _Optional[_Union[_common_pb2.SubscriptionPartition, _Mapping]] = ...) -> None: ...

class VerifyTxnPartitionsResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[VerifyTxnPartitionsResult]
    def __init__(self, results: _Optional[_Iterable[_Union[VerifyTxnPartitionsResult, _Mapping]]] = ...) -> None: ...

class VerifyTxnPartitionsResult(_message.Message):
    __slots__ = ("txn_id", "error", "state", "included", "session", "coordinator_epoch", "opener")
    TXN_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    INCLUDED_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_EPOCH_FIELD_NUMBER: _ClassVar[int]
    OPENER_FIELD_NUMBER: _ClassVar[int]
    txn_id: _common_pb2.TxnId
    error: _partition_pb2.ItemError
    state: TxnState
    included: bool
    session: TransactionalSession
    coordinator_epoch: int
    opener: str
    def __init__(self, txn_id: _Optional[_Union[_common_pb2.TxnId, _Mapping]] = ..., error: _Optional[_Union[_partition_pb2.ItemError, _Mapping]] = ..., state: _Optional[_Union[TxnState, str]] = ..., included: _Optional[bool] = ..., session: _Optional[_Union[TransactionalSession, _Mapping]] = ..., coordinator_epoch: _Optional[int] = ..., opener: _Optional[str] = ...) -> None: ...

class TransactionSummary(_message.Message):
    __slots__ = ("txn_id", "state", "end_cause", "parent_txn_id", "transactional_id", "producer_id", "producer_epoch", "start_unix_ms", "age_ms", "timeout_ms", "topic_partition_count", "subscription_partition_count", "child_count")
    TXN_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    END_CAUSE_FIELD_NUMBER: _ClassVar[int]
    PARENT_TXN_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSACTIONAL_ID_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_ID_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    START_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    AGE_MS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    TOPIC_PARTITION_COUNT_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIPTION_PARTITION_COUNT_FIELD_NUMBER: _ClassVar[int]
    CHILD_COUNT_FIELD_NUMBER: _ClassVar[int]
    txn_id: _common_pb2.TxnId
    state: TxnState
    end_cause: TxnEndCause
    parent_txn_id: _common_pb2.TxnId
    transactional_id: str
    producer_id: int
    producer_epoch: int
    start_unix_ms: int
    age_ms: int
    timeout_ms: int
    topic_partition_count: int
    subscription_partition_count: int
    child_count: int
    def __init__(self, txn_id: _Optional[_Union[_common_pb2.TxnId, _Mapping]] = ..., state: _Optional[_Union[TxnState, str]] = ..., end_cause: _Optional[_Union[TxnEndCause, str]] = ..., parent_txn_id: _Optional[_Union[_common_pb2.TxnId, _Mapping]] = ..., transactional_id: _Optional[str] = ..., producer_id: _Optional[int] = ..., producer_epoch: _Optional[int] = ..., start_unix_ms: _Optional[int] = ..., age_ms: _Optional[int] = ..., timeout_ms: _Optional[int] = ..., topic_partition_count: _Optional[int] = ..., subscription_partition_count: _Optional[int] = ..., child_count: _Optional[int] = ...) -> None: ...

class ListTransactionsRequest(_message.Message):
    __slots__ = ("states", "min_age_ms", "tc_partitions", "limit")
    STATES_FIELD_NUMBER: _ClassVar[int]
    MIN_AGE_MS_FIELD_NUMBER: _ClassVar[int]
    TC_PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    states: _containers.RepeatedScalarFieldContainer[TxnState]
    min_age_ms: int
    tc_partitions: _containers.RepeatedScalarFieldContainer[int]
    limit: int
    def __init__(self, states: _Optional[_Iterable[_Union[TxnState, str]]] = ..., min_age_ms: _Optional[int] = ..., tc_partitions: _Optional[_Iterable[int]] = ..., limit: _Optional[int] = ...) -> None: ...

class ListTransactionsResponse(_message.Message):
    __slots__ = ("transactions", "tc_partitions", "not_owned_tc_partitions", "truncated")
    TRANSACTIONS_FIELD_NUMBER: _ClassVar[int]
    TC_PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    NOT_OWNED_TC_PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    transactions: _containers.RepeatedCompositeFieldContainer[TransactionSummary]
    tc_partitions: _containers.RepeatedScalarFieldContainer[int]
    not_owned_tc_partitions: _containers.RepeatedScalarFieldContainer[int]
    truncated: bool
    def __init__(self, transactions: _Optional[_Iterable[_Union[TransactionSummary, _Mapping]]] = ..., tc_partitions: _Optional[_Iterable[int]] = ..., not_owned_tc_partitions: _Optional[_Iterable[int]] = ..., truncated: _Optional[bool] = ...) -> None: ...

class DescribeTransactionRequest(_message.Message):
    __slots__ = ("txn_id",)
    TXN_ID_FIELD_NUMBER: _ClassVar[int]
    txn_id: _common_pb2.TxnId
    def __init__(self, txn_id: _Optional[_Union[_common_pb2.TxnId, _Mapping]] = ...) -> None: ...

class DescribeTransactionResponse(_message.Message):
    __slots__ = ("summary", "topic_partitions", "subscription_partitions", "children", "marker_pending_topic_partitions", "marker_pending_subscription_partitions", "marker_retry_count", "prepared_timeout_ms", "prepared_unix_ms", "decided_unix_ms", "completed_unix_ms", "idempotency_key", "coordinator_epoch")
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    TOPIC_PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIPTION_PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    CHILDREN_FIELD_NUMBER: _ClassVar[int]
    MARKER_PENDING_TOPIC_PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    MARKER_PENDING_SUBSCRIPTION_PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    MARKER_RETRY_COUNT_FIELD_NUMBER: _ClassVar[int]
    PREPARED_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    PREPARED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    DECIDED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_EPOCH_FIELD_NUMBER: _ClassVar[int]
    summary: TransactionSummary
    topic_partitions: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopicPartition]
    subscription_partitions: _containers.RepeatedCompositeFieldContainer[_common_pb2.SubscriptionPartition]
    children: _containers.RepeatedCompositeFieldContainer[TransactionSummary]
    marker_pending_topic_partitions: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopicPartition]
    marker_pending_subscription_partitions: _containers.RepeatedCompositeFieldContainer[_common_pb2.SubscriptionPartition]
    marker_retry_count: int
    prepared_timeout_ms: int
    prepared_unix_ms: int
    decided_unix_ms: int
    completed_unix_ms: int
    idempotency_key: str
    coordinator_epoch: int
    def __init__(self, summary: _Optional[_Union[TransactionSummary, _Mapping]] = ..., topic_partitions: _Optional[_Iterable[_Union[_common_pb2.TopicPartition, _Mapping]]] = ..., subscription_partitions: _Optional[_Iterable[_Union[_common_pb2.SubscriptionPartition, _Mapping]]] = ..., children: _Optional[_Iterable[_Union[TransactionSummary, _Mapping]]] = ..., marker_pending_topic_partitions: _Optional[_Iterable[_Union[_common_pb2.TopicPartition, _Mapping]]] = ..., marker_pending_subscription_partitions: _Optional[_Iterable[_Union[_common_pb2.SubscriptionPartition, _Mapping]]] = ..., marker_retry_count: _Optional[int] = ..., prepared_timeout_ms: _Optional[int] = ..., prepared_unix_ms: _Optional[int] = ..., decided_unix_ms: _Optional[int] = ..., completed_unix_ms: _Optional[int] = ..., idempotency_key: _Optional[str] = ..., coordinator_epoch: _Optional[int] = ...) -> None: ...

class AbortTransactionRequest(_message.Message):
    __slots__ = ("txn_id", "reason", "allow_prepared")
    TXN_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ALLOW_PREPARED_FIELD_NUMBER: _ClassVar[int]
    txn_id: _common_pb2.TxnId
    reason: str
    allow_prepared: bool
    def __init__(self, txn_id: _Optional[_Union[_common_pb2.TxnId, _Mapping]] = ..., reason: _Optional[str] = ..., allow_prepared: _Optional[bool] = ...) -> None: ...

class AbortTransactionResponse(_message.Message):
    __slots__ = ("state", "already_ended", "aborted_child_txn_ids")
    STATE_FIELD_NUMBER: _ClassVar[int]
    ALREADY_ENDED_FIELD_NUMBER: _ClassVar[int]
    ABORTED_CHILD_TXN_IDS_FIELD_NUMBER: _ClassVar[int]
    state: TxnState
    already_ended: bool
    aborted_child_txn_ids: _containers.RepeatedCompositeFieldContainer[_common_pb2.TxnId]
    def __init__(self, state: _Optional[_Union[TxnState, str]] = ..., already_ended: _Optional[bool] = ..., aborted_child_txn_ids: _Optional[_Iterable[_Union[_common_pb2.TxnId, _Mapping]]] = ...) -> None: ...
