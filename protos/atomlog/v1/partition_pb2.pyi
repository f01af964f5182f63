from atomlog.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TxnDecision(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TXN_DECISION_UNSPECIFIED: _ClassVar[TxnDecision]
    TXN_DECISION_COMMIT: _ClassVar[TxnDecision]
    TXN_DECISION_ABORT: _ClassVar[TxnDecision]

class OffsetSpec(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OFFSET_SPEC_UNSPECIFIED: _ClassVar[OffsetSpec]
    OFFSET_SPEC_EARLIEST: _ClassVar[OffsetSpec]
    OFFSET_SPEC_LATEST: _ClassVar[OffsetSpec]
    OFFSET_SPEC_MAX_READ_POSITION: _ClassVar[OffsetSpec]
    OFFSET_SPEC_BY_TIMESTAMP: _ClassVar[OffsetSpec]

class SubscriptionInitialPosition(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SUBSCRIPTION_INITIAL_POSITION_UNSPECIFIED: _ClassVar[SubscriptionInitialPosition]
    SUBSCRIPTION_INITIAL_POSITION_EARLIEST: _ClassVar[SubscriptionInitialPosition]
    SUBSCRIPTION_INITIAL_POSITION_LATEST: _ClassVar[SubscriptionInitialPosition]
    SUBSCRIPTION_INITIAL_POSITION_OFFSET: _ClassVar[SubscriptionInitialPosition]
    SUBSCRIPTION_INITIAL_POSITION_TIMESTAMP: _ClassVar[SubscriptionInitialPosition]

class PartitionState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PARTITION_STATE_UNSPECIFIED: _ClassVar[PartitionState]
    PARTITION_STATE_LOADING: _ClassVar[PartitionState]
    PARTITION_STATE_ONLINE: _ClassVar[PartitionState]
    PARTITION_STATE_DATA_LOSS: _ClassVar[PartitionState]
TXN_DECISION_UNSPECIFIED: TxnDecision
TXN_DECISION_COMMIT: TxnDecision
TXN_DECISION_ABORT: TxnDecision
OFFSET_SPEC_UNSPECIFIED: OffsetSpec
OFFSET_SPEC_EARLIEST: OffsetSpec
OFFSET_SPEC_LATEST: OffsetSpec
OFFSET_SPEC_MAX_READ_POSITION: OffsetSpec
OFFSET_SPEC_BY_TIMESTAMP: OffsetSpec
SUBSCRIPTION_INITIAL_POSITION_UNSPECIFIED: SubscriptionInitialPosition
SUBSCRIPTION_INITIAL_POSITION_EARLIEST: SubscriptionInitialPosition
SUBSCRIPTION_INITIAL_POSITION_LATEST: SubscriptionInitialPosition
SUBSCRIPTION_INITIAL_POSITION_OFFSET: SubscriptionInitialPosition
SUBSCRIPTION_INITIAL_POSITION_TIMESTAMP: SubscriptionInitialPosition
PARTITION_STATE_UNSPECIFIED: PartitionState
PARTITION_STATE_LOADING: PartitionState
PARTITION_STATE_ONLINE: PartitionState
PARTITION_STATE_DATA_LOSS: PartitionState

class ItemError(_message.Message):
    __slots__ = ("reason", "message", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    reason: str
    message: str
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, reason: _Optional[str] = ..., message: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class OffsetRange(_message.Message):
    __slots__ = ("start_offset", "end_offset")
    START_OFFSET_FIELD_NUMBER: _ClassVar[int]
    END_OFFSET_FIELD_NUMBER: _ClassVar[int]
    start_offset: int
    end_offset: int
    def __init__(self, start_offset: _Optional[int] = ..., end_offset: _Optional[int] = ...) -> None: ...

class ProduceRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ProduceItem]
    def __init__(self, items: _Optional[_Iterable[_Union[ProduceItem, _Mapping]]] = ...) -> None: ...

class ProduceItem(_message.Message):
    __slots__ = ("topic_partition", "record_batch")
    TOPIC_PARTITION_FIELD_NUMBER: _ClassVar[int]
    RECORD_BATCH_FIELD_NUMBER: _ClassVar[int]
    topic_partition: _common_pb2.TopicPartition
    record_batch: bytes
    def __init__(self, topic_partition: _Optional[_Union[_common_pb2.TopicPartition, _Mapping]] = ..., record_batch: _Optional[bytes] = ...) -> None: ...

class ProduceResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ProduceResult]
    def __init__(self, results: _Optional[_Iterable[_Union[ProduceResult, _Mapping]]] = ...) -> None: ...

class ProduceResult(_message.Message):
    __slots__ = ("topic_partition", "error", "base_offset", "last_offset", "log_append_time_unix_ms", "log_start_offset", "duplicate")
    TOPIC_PARTITION_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    BASE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    LAST_OFFSET_FIELD_NUMBER: _ClassVar[int]
    LOG_APPEND_TIME_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    LOG_START_OFFSET_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    topic_partition: _common_pb2.TopicPartition
    error: ItemError
    base_offset: int
    last_offset: int
    log_append_time_unix_ms: int
    log_start_offset: int
    duplicate: bool
    def __init__(self, topic_partition: _Optional[_Union[_common_pb2.TopicPartition, _Mapping]] = ..., error: _Optional[_Union[ItemError, _Mapping]] = ..., base_offset: _Optional[int] = ..., last_offset: _Optional[int] = ..., log_append_time_unix_ms: _Optional[int] = ..., log_start_offset: _Optional[int] = ..., duplicate: _Optional[bool] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("items", "isolation_level", "max_wait_ms", "min_bytes", "max_bytes", "include_control_batches")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    ISOLATION_LEVEL_FIELD_NUMBER: _ClassVar[int]
    MAX_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    MIN_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_CONTROL_BATCHES_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[FetchItem]
    isolation_level: _common_pb2.IsolationLevel
    max_wait_ms: int
    min_bytes: int
    max_bytes: int
    include_control_batches: bool
    def __init__(self, items: _Optional[_Iterable[_Union[FetchItem, _Mapping]]] = ..., isolation_level: _Optional[_Union[_common_pb2.IsolationLevel, str]] = ..., max_wait_ms: _Optional[int] = ..., min_bytes: _Optional[int] = ..., max_bytes: _Optional[int] = ..., include_control_batches: _Optional[bool] = ...) -> None: ...

class FetchItem(_message.Message):
    __slots__ = ("topic_partition", "fetch_offset", "max_bytes")
    TOPIC_PARTITION_FIELD_NUMBER: _ClassVar[int]
    FETCH_OFFSET_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    topic_partition: _common_pb2.TopicPartition
    fetch_offset: int
    max_bytes: int
    def __init__(self, topic_partition: _Optional[_Union[_common_pb2.TopicPartition, _Mapping]] = ..., fetch_offset: _Optional[int] = ..., max_bytes: _Optional[int] = ...) -> None: ...

class FetchResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[FetchResult]
    def __init__(self, results: _Optional[_Iterable[_Union[FetchResult, _Mapping]]] = ...) -> None: ...

class FetchResult(_message.Message):
    __slots__ = ("topic_partition", "error", "record_batches", "next_fetch_offset", "log_start_offset", "high_watermark", "max_read_position", "last_data_offset", "aborted_transactions")
    TOPIC_PARTITION_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    RECORD_BATCHES_FIELD_NUMBER: _ClassVar[int]
    NEXT_FETCH_OFFSET_FIELD_NUMBER: _ClassVar[int]
    LOG_START_OFFSET_FIELD_NUMBER: _ClassVar[int]
    HIGH_WATERMARK_FIELD_NUMBER: _ClassVar[int]
    MAX_READ_POSITION_FIELD_NUMBER: _ClassVar[int]
    LAST_DATA_OFFSET_FIELD_NUMBER: _ClassVar[int]
    ABORTED_TRANSACTIONS_FIELD_NUMBER: _ClassVar[int]
    topic_partition: _common_pb2.TopicPartition
    error: ItemError
    record_batches: bytes
    next_fetch_offset: int
    log_start_offset: int
    high_watermark: int
    max_read_position: int
    last_data_offset: int
    aborted_transactions: _containers.RepeatedCompositeFieldContainer[AbortedTransaction]
    def __init__(self, topic_partition: _Optional[_Union[_common_pb2.TopicPartition, _Mapping]] = ..., error: _Optional[_Union[ItemError, _Mapping]] = ..., record_batches: _Optional[bytes] = ..., next_fetch_offset: _Optional[int] = ..., log_start_offset: _Optional[int] = ..., high_watermark: _Optional[int] = ..., max_read_position: _Optional[int] = ..., last_data_offset: _Optional[int] = ..., aborted_transactions: _Optional[_Iterable[_Union[AbortedTransaction, _Mapping]]] = ...) -> None: ...

class AbortedTransaction(_message.Message):
    __slots__ = ("txn_id", "first_offset", "marker_offset")
    TXN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_OFFSET_FIELD_NUMBER: _ClassVar[int]
    MARKER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    txn_id: _common_pb2.TxnId
    first_offset: int
    marker_offset: int
    def __init__(self, txn_id: _Optional[_Union[_common_pb2.TxnId, _Mapping]] = ..., first_offset: _Optional[int] = ..., marker_offset: _Optional[int] = ...) -> None: ...

class ListOffsetsRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ListOffsetsItem]
    def __init__(self, items: _Optional[_Iterable[_Union[ListOffsetsItem, _Mapping]]] = ...) -> None: ...

class ListOffsetsItem(_message.Message):
    __slots__ = ("topic_partition", "spec", "timestamp_unix_ms")
    TOPIC_PARTITION_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    topic_partition: _common_pb2.TopicPartition
    spec: OffsetSpec
    timestamp_unix_ms: int
    def __init__(self, topic_partition: _Optional[_Union[_common_pb2.TopicPartition, _Mapping]] = ..., spec: _Optional[_Union[OffsetSpec, str]] = ..., timestamp_unix_ms: _Optional[int] = ...) -> None: ...

class ListOffsetsResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ListOffsetsResult]
    def __init__(self, results: _Optional[_Iterable[_Union[ListOffsetsResult, _Mapping]]] = ...) -> None: ...

class ListOffsetsResult(_message.Message):
    __slots__ = ("topic_partition", "error", "offset", "timestamp_unix_ms", "log_start_offset", "high_watermark", "max_read_position", "last_data_offset")
    TOPIC_PARTITION_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    LOG_START_OFFSET_FIELD_NUMBER: _ClassVar[int]
    HIGH_WATERMARK_FIELD_NUMBER: _ClassVar[int]
    MAX_READ_POSITION_FIELD_NUMBER: _ClassVar[int]
    LAST_DATA_OFFSET_FIELD_NUMBER: _ClassVar[int]
    topic_partition: _common_pb2.TopicPartition
    error: ItemError
    offset: int
    timestamp_unix_ms: int
    log_start_offset: int
    high_watermark: int
    max_read_position: int
    last_data_offset: int
    def __init__(self, topic_partition: _Optional[_Union[_common_pb2.TopicPartition, _Mapping]] = ..., error: _Optional[_Union[ItemError, _Mapping]] = ..., offset: _Optional[int] = ..., timestamp_unix_ms: _Optional[int] = ..., log_start_offset: _Optional[int] = ..., high_watermark: _Optional[int] = ..., max_read_position: _Optional[int] = ..., last_data_offset: _Optional[int] = ...) -> None: ...

class DeleteRecordsRequest(_message.Message):
    __slots__ = ("items", "timeout_ms")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[DeleteRecordsItem]
    timeout_ms: int
    def __init__(self, items: _Optional[_Iterable[_Union[DeleteRecordsItem, _Mapping]]] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class DeleteRecordsItem(_message.Message):
    __slots__ = ("topic", "partition", "before_offset")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    BEFORE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    topic: str
    partition: int
    before_offset: int
    def __init__(self, topic: _Optional[str] = ..., partition: _Optional[int] = ..., before_offset: _Optional[int] = ...) -> None: ...

class DeleteRecordsResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[DeleteRecordsResult]
    def __init__(self, results: _Optional[_Iterable[_Union[DeleteRecordsResult, _Mapping]]] = ...) -> None: ...

class DeleteRecordsResult(_message.Message):
    __slots__ = ("topic", "partition", "error", "log_start_offset")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    LOG_START_OFFSET_FIELD_NUMBER: _ClassVar[int]
    topic: str
    partition: int
    error: ItemError
    log_start_offset: int
    def __init__(self, topic: _Optional[str] = ..., partition: _Optional[int] = ..., error: _Optional[_Union[ItemError, _Mapping]] = ..., log_start_offset: _Optional[int] = ...) -> None: ...

class CreateSubscriptionRequest(_message.Message):
    __slots__ = ("subscription_partitions", "initial_position", "start_offset", "timestamp_unix_ms")
    SUBSCRIPTION_PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    INITIAL_POSITION_FIELD_NUMBER: _ClassVar[int]
    START_OFFSET_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    subscription_partitions: _containers.RepeatedCompositeFieldContainer[_common_pb2.SubscriptionPartition]
    initial_position: SubscriptionInitialPosition
    start_offset: int
    timestamp_unix_ms: int
    def __init__(self, subscription_partitions: _Optional[_Iterable[_Union[_common_pb2.SubscriptionPartition, _Mapping]]] = ..., initial_position: _Optional[_Union[SubscriptionInitialPosition, str]] = ..., start_offset: _Optional[int] = ..., timestamp_unix_ms: _Optional[int] = ...) -> None: ...

class CreateSubscriptionResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[CreateSubscriptionResult]
    def __init__(self, results: _Optional[_Iterable[_Union[CreateSubscriptionResult, _Mapping]]] = ...) -> None: ...

class CreateSubscriptionResult(_message.Message):
    __slots__ = ("subscription_partition", "error", "created", "cumulative_end_offset")
    SUBSCRIPTION_PARTITION_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    CUMULATIVE_END_OFFSET_FIELD_NUMBER: _ClassVar[int]
    subscription_partition: _common_pb2.SubscriptionPartition
    error: ItemError
    created: bool
    cumulative_end_offset: int
    def __init__(self, subscription_partition: _Optional[_Union[_common_pb2.SubscriptionPartition, _Mapping]] = ..., error: _Optional[_Union[ItemError, _Mapping]] = ..., created: _Optional[bool] = ..., cumulative_end_offset: _Optional[int] = ...) -> None: ...

class DeleteSubscriptionRequest(_message.Message):
    __slots__ = ("subscription_partitions",)
    SUBSCRIPTION_PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    subscription_partitions: _containers.RepeatedCompositeFieldContainer[_common_pb2.SubscriptionPartition]
    def __init__(self, subscription_partitions: _Optional[_Iterable[_Union[_common_pb2.SubscriptionPartition, _Mapping]]] = ...) -> None: ...

class DeleteSubscriptionResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[DeleteSubscriptionResult]
    def __init__(self, results: _Optional[_Iterable[_Union[DeleteSubscriptionResult, _Mapping]]] = ...) -> None: ...

class DeleteSubscriptionResult(_message.Message):
    __slots__ = ("subscription_partition", "error")
    SUBSCRIPTION_PARTITION_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    subscription_partition: _common_pb2.SubscriptionPartition
    error: ItemError
    def __init__(self, subscription_partition: _Optional[_Union[_common_pb2.SubscriptionPartition, _Mapping]] = ..., error: _Optional[_Union[ItemError, _Mapping]] = ...) -> None: ...

class ResetSubscriptionRequest(_message.Message):
    __slots__ = ("subscription_partitions", "position", "offset", "timestamp_unix_ms")
    SUBSCRIPTION_PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    subscription_partitions: _containers.RepeatedCompositeFieldContainer[_common_pb2.SubscriptionPartition]
    position: SubscriptionInitialPosition
    offset: int
    timestamp_unix_ms: int
    def __init__(self, subscription_partitions: _Optional[_Iterable[_Union[_common_pb2.SubscriptionPartition, _Mapping]]] = ..., position: _Optional[_Union[SubscriptionInitialPosition, str]] = ..., offset: _Optional[int] = ..., timestamp_unix_ms: _Optional[int] = ...) -> None: ...

class ResetSubscriptionResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ResetSubscriptionResult]
    def __init__(self, results: _Optional[_Iterable[_Union[ResetSubscriptionResult, _Mapping]]] = ...) -> None: ...

class ResetSubscriptionResult(_message.Message):
    __slots__ = ("subscription_partition", "error", "cumulative_end_offset")
    SUBSCRIPTION_PARTITION_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CUMULATIVE_END_OFFSET_FIELD_NUMBER: _ClassVar[int]
    subscription_partition: _common_pb2.SubscriptionPartition
    error: ItemError
    cumulative_end_offset: int
    def __init__(self, subscription_partition: _Optional[_Union[_common_pb2.SubscriptionPartition, _Mapping]] = ..., error: _Optional[_Union[ItemError, _Mapping]] = ..., cumulative_end_offset: _Optional[int] = ...) -> None: ...

class ReceiveRequest(_message.Message):
    __slots__ = ("consumer_id", "subscription_partitions", "isolation_level", "max_wait_ms", "max_bytes", "ack_timeout_ms", "max_messages")
    CONSUMER_ID_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIPTION_PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    ISOLATION_LEVEL_FIELD_NUMBER: _ClassVar[int]
    MAX_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    ACK_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    consumer_id: str
    subscription_partitions: _containers.RepeatedCompositeFieldContainer[_common_pb2.SubscriptionPartition]
    isolation_level: _common_pb2.IsolationLevel
    max_wait_ms: int
    max_bytes: int
    ack_timeout_ms: int
    max_messages: int
    def __init__(self, consumer_id: _Optional[str] = ..., subscription_partitions: _Optional[_Iterable[_Union[_common_pb2.SubscriptionPartition, _Mapping]]] = ..., isolation_level: _Optional[_Union[_common_pb2.IsolationLevel, str]] = ..., max_wait_ms: _Optional[int] = ..., max_bytes: _Optional[int] = ..., ack_timeout_ms: _Optional[int] = ..., max_messages: _Optional[int] = ...) -> None: ...

class ReceiveResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ReceiveResult]
    def __init__(self, results: _Optional[_Iterable[_Union[ReceiveResult, _Mapping]]] = ...) -> None: ...

class ReceiveResult(_message.Message):
    __slots__ = ("subscription_partition", "error", "record_batches", "delivered_ranges", "redelivered_ranges", "cumulative_end_offset", "high_watermark", "max_read_position")
    SUBSCRIPTION_PARTITION_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    RECORD_BATCHES_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_RANGES_FIELD_NUMBER: _ClassVar[int]
    REDELIVERED_RANGES_FIELD_NUMBER: _ClassVar[int]
    CUMULATIVE_END_OFFSET_FIELD_NUMBER: _ClassVar[int]
    HIGH_WATERMARK_FIELD_NUMBER: _ClassVar[int]
    MAX_READ_POSITION_FIELD_NUMBER: _ClassVar[int]
    subscription_partition: _common_pb2.SubscriptionPartition
    error: ItemError
    record_batches: bytes
    delivered_ranges: _containers.RepeatedCompositeFieldContainer[OffsetRange]
    redelivered_ranges: _containers.RepeatedCompositeFieldContainer[OffsetRange]
    cumulative_end_offset: int
    high_watermark: int
    max_read_position: int
    def __init__(self, subscription_partition: _Optional[_Union[_common_pb2.SubscriptionPartition, _Mapping]] = ..., error: _Optional[_Union[ItemError, _Mapping]] = ..., record_batches: _Optional[bytes] = ..., delivered_ranges: _Optional[_Iterable[_Union[OffsetRange, _Mapping]]] = ..., redelivered_ranges: _Optional[_Iterable[_Union[OffsetRange, _Mapping]]] = ..., cumulative_end_offset: _Optional[int] = ..., high_watermark: _Optional[int] = ..., max_read_position: _Optional[int] = ...) -> None: ...

class AckRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[AckItem]
    def __init__(self, items: _Optional[_Iterable[_Union[AckItem, _Mapping]]] = ...) -> None: ...

class AckItem(_message.Message):
    __slots__ = ("subscription_partition", "cumulative_end_offset", "individual_ranges", "txn_id")
    SUBSCRIPTION_PARTITION_FIELD_NUMBER: _ClassVar[int]
    CUMULATIVE_END_OFFSET_FIELD_NUMBER: _ClassVar[int]
    INDIVIDUAL_RANGES_FIELD_NUMBER: _ClassVar[int]
    TXN_ID_FIELD_NUMBER: _ClassVar[int]
    subscription_partition: _common_pb2.SubscriptionPartition
    cumulative_end_offset: int
    individual_ranges: _containers.RepeatedCompositeFieldContainer[OffsetRange]
    txn_id: _common_pb2.TxnId
    def __init__(self, subscription_partition: _Optional[_Union[_common_pb2.SubscriptionPartition, _Mapping]] = ..., cumulative_end_offset: _Optional[int] = ..., individual_ranges: _Optional[_Iterable[_Union[OffsetRange, _Mapping]]] = ..., txn_id: _Optional[_Union[_common_pb2.TxnId, _Mapping]] = ...) -> None: ...

class AckResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[AckResult]
    def __init__(self, results: _Optional[_Iterable[_Union[AckResult, _Mapping]]] = ...) -> None: ...

class AckResult(_message.Message):
    __slots__ = ("subscription_partition", "error", "cumulative_end_offset")
    SUBSCRIPTION_PARTITION_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CUMULATIVE_END_OFFSET_FIELD_NUMBER: _ClassVar[int]
    subscription_partition: _common_pb2.SubscriptionPartition
    error: ItemError
    cumulative_end_offset: int
    def __init__(self, subscription_partition: _Optional[_Union[_common_pb2.SubscriptionPartition, _Mapping]] = ..., error: _Optional[_Union[ItemError, _Mapping]] = ..., cumulative_end_offset: _Optional[int] = ...) -> None: ...

class NackRequest(_message.Message):
    __slots__ = ("consumer_id", "items", "redelivery_delay_ms")
    CONSUMER_ID_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    REDELIVERY_DELAY_MS_FIELD_NUMBER: _ClassVar[int]
    consumer_id: str
    items: _containers.RepeatedCompositeFieldContainer[NackItem]
    redelivery_delay_ms: int
    def __init__(self, consumer_id: _Optional[str] = ..., items: _Optional[_Iterable[_Union[NackItem, _Mapping]]] = ..., redelivery_delay_ms: _Optional[int] = ...) -> None: ...

class NackItem(_message.Message):
    __slots__ = ("subscription_partition", "ranges")
    SUBSCRIPTION_PARTITION_FIELD_NUMBER: _ClassVar[int]
    RANGES_FIELD_NUMBER: _ClassVar[int]
    subscription_partition: _common_pb2.SubscriptionPartition
    ranges: _containers.RepeatedCompositeFieldContainer[OffsetRange]
    def __init__(self, subscription_partition: _Optional[_Union[_common_pb2.SubscriptionPartition, _Mapping]] = ..., ranges: _Optional[_Iterable[_Union[OffsetRange, _Mapping]]] = ...) -> None: ...

class NackResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[NackResult]
    def __init__(self, results: _Optional[_Iterable[_Union[NackResult, _Mapping]]] = ...) -> None: ...

class NackResult(_message.Message):
    __slots__ = ("subscription_partition", "error")
    SUBSCRIPTION_PARTITION_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    subscription_partition: _common_pb2.SubscriptionPartition
    error: ItemError
    def __init__(self, subscription_partition: _Optional[_Union[_common_pb2.SubscriptionPartition, _Mapping]] = ..., error: _Optional[_Union[ItemError, _Mapping]] = ...) -> None: ...

class DescribeSubscriptionRequest(_message.Message):
    __slots__ = ("subscription_partitions",)
    SUBSCRIPTION_PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    subscription_partitions: _containers.RepeatedCompositeFieldContainer[_common_pb2.SubscriptionPartition]
    def __init__(self, subscription_partitions: _Optional[_Iterable[_Union[_common_pb2.SubscriptionPartition, _Mapping]]] = ...) -> None: ...

class DescribeSubscriptionResponse(_message.Message):
    __slots__ = ("cursors",)
    CURSORS_FIELD_NUMBER: _ClassVar[int]
    cursors: _containers.RepeatedCompositeFieldContainer[SubscriptionCursor]
    def __init__(self, cursors: _Optional[_Iterable[_Union[SubscriptionCursor, _Mapping]]] = ...) -> None: ...

class SubscriptionCursor(_message.Message):
    __slots__ = ("subscription_partition", "error", "cumulative_end_offset", "individual_ranges", "pending_acks", "delivered_unacknowledged_count", "redelivery_backlog_count", "backlog_records")
    SUBSCRIPTION_PARTITION_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CUMULATIVE_END_OFFSET_FIELD_NUMBER: _ClassVar[int]
    INDIVIDUAL_RANGES_FIELD_NUMBER: _ClassVar[int]
    PENDING_ACKS_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_UNACKNOWLEDGED_COUNT_FIELD_NUMBER: _ClassVar[int]
    REDELIVERY_BACKLOG_COUNT_FIELD_NUMBER: _ClassVar[int]
    BACKLOG_RECORDS_FIELD_NUMBER: _ClassVar[int]
    subscription_partition: _common_pb2.SubscriptionPartition
    error: ItemError
    cumulative_end_offset: int
    individual_ranges: _containers.RepeatedCompositeFieldContainer[OffsetRange]
    pending_acks: _containers.RepeatedCompositeFieldContainer[PendingAck]
    delivered_unacknowledged_count: int
    redelivery_backlog_count: int
    backlog_records: int
    def __init__(self, subscription_partition: _Optional[_Union[_common_pb2.SubscriptionPartition, _Mapping]] = ..., error: _Optional[_Union[ItemError, _Mapping]] = ..., cumulative_end_offset: _Optional[int] = ..., individual_ranges: _Optional[_Iterable[_Union[OffsetRange, _Mapping]]] = ..., pending_acks: _Optional[_Iterable[_Union[PendingAck, _Mapping]]] = ..., delivered_unacknowledged_count: _Optional[int] = ..., redelivery_backlog_count: _Optional[int] = ..., backlog_records: _Optional[int] = ...) -> None: ...

class PendingAck(_message.Message):
    __slots__ = ("txn_id", "cumulative_end_offset", "individual_ranges")
    TXN_ID_FIELD_NUMBER: _ClassVar[int]
    CUMULATIVE_END_OFFSET_FIELD_NUMBER: _ClassVar[int]
    INDIVIDUAL_RANGES_FIELD_NUMBER: _ClassVar[int]
    txn_id: _common_pb2.TxnId
    cumulative_end_offset: int
    individual_ranges: _containers.RepeatedCompositeFieldContainer[OffsetRange]
    def __init__(self, txn_id: _Optional[_Union[_common_pb2.TxnId, _Mapping]] = ..., cumulative_end_offset: _Optional[int] = ..., individual_ranges: _Optional[_Iterable[_Union[OffsetRange, _Mapping]]] = ...) -> None: ...

class EndTxnOnPartitionRequest(_message.Message):
    __slots__ = ("markers",)
    MARKERS_FIELD_NUMBER: _ClassVar[int]
    markers: _containers.RepeatedCompositeFieldContainer[TxnMarker]
    def __init__(self, markers: _Optional[_Iterable[_Union[TxnMarker, _Mapping]]] = ...) -> None: ...

class TxnMarker(_message.Message):
    __slots__ = ("txn_id", "decision", "coordinator_epoch", "topic_partitions", "subscription_partitions")
    TXN_ID_FIELD_NUMBER: _ClassVar[int]
    DECISION_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_EPOCH_FIELD_NUMBER: _ClassVar[int]
    TOPIC_PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIPTION_PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    txn_id: _common_pb2.TxnId
    decision: TxnDecision
    coordinator_epoch: int
    topic_partitions: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopicPartition]
    subscription_partitions: _containers.RepeatedCompositeFieldContainer[_common_pb2.SubscriptionPartition]
    def __init__(self, txn_id: _Optional[_Union[_common_pb2.TxnId, _Mapping]] = ..., decision: _Optional[_Union[TxnDecision, str]] = ..., coordinator_epoch: _Optional[int] = ..., topic_partitions: _Optional[_Iterable[_Union[_common_pb2.TopicPartition, _Mapping]]] = ..., subscription_partitions: _Optional[_Iterable[_Union[_common_pb2.SubscriptionPartition, _Mapping]]] = ...) -> None: ...

class EndTxnOnPartitionResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[TxnMarkerResult]
    def __init__(self, results: _Optional[_Iterable[_Union[TxnMarkerResult, _Mapping]]] = ...) -> None: ...

class TxnMarkerResult(_message.Message):
    __slots__ = ("txn_id", "topic_partition_results", "subscription_partition_results")
    TXN_ID_FIELD_NUMBER: _ClassVar[int]
    TOPIC_PARTITION_RESULTS_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIPTION_PARTITION_RESULTS_FIELD_NUMBER: _ClassVar[int]
    txn_id: _common_pb2.TxnId
    topic_partition_results: _containers.RepeatedCompositeFieldContainer[TxnMarkerPartitionResult]
    subscription_partition_results: _containers.RepeatedCompositeFieldContainer[TxnMarkerSubscriptionResult]
    def __init__(self, txn_id: _Optional[_Union[_common_pb2.TxnId, _Mapping]] = ..., topic_partition_results: _Optional[_Iterable[_Union[TxnMarkerPartitionResult, _Mapping]]] = ..., subscription_partition_results: _Optional[_Iterable[_Union[TxnMarkerSubscriptionResult, _Mapping]]] = ...) -> None: ...

class TxnMarkerPartitionResult(_message.Message):
    __slots__ = ("topic_partition", "error", "marker_offset", "already_ended")
    TOPIC_PARTITION_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    MARKER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    ALREADY_ENDED_FIELD_NUMBER: _ClassVar[int]
    topic_partition: _common_pb2.TopicPartition
    error: ItemError
    marker_offset: int
    already_ended: bool
    def __init__(self, topic_partition: _Optional[_Union[_common_pb2.TopicPartition, _Mapping]] = ..., error: _Optional[_Union[ItemError, _Mapping]] = ..., marker_offset: _Optional[int] = ..., already_ended: _Optional[bool] = ...) -> None: ...

class TxnMarkerSubscriptionResult(_message.Message):
    __slots__ = ("subscription_partition", "error", "already_ended")
    SUBSCRIPTION_PARTITION_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ALREADY_ENDED_FIELD_NUMBER: _ClassVar[int]
    subscription_partition: _common_pb2.SubscriptionPartition
    error: ItemError
    already_ended: bool
    def __init__(self, subscription_partition: _Optional[_Union[_common_pb2.SubscriptionPartition, _Mapping]] = ..., error: _Optional[_Union[ItemError, _Mapping]] = ..., already_ended: _Optional[bool] = ...) -> None: ...

class DataLossInfo(_message.Message):
    __slots__ = ("file", "offset", "file_position_bytes", "detail", "detected_unix_ms")
    FILE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    FILE_POSITION_BYTES_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    DETECTED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    file: str
    offset: int
    file_position_bytes: int
    detail: str
    detected_unix_ms: int
    def __init__(self, file: _Optional[str] = ..., offset: _Optional[int] = ..., file_position_bytes: _Optional[int] = ..., detail: _Optional[str] = ..., detected_unix_ms: _Optional[int] = ...) -> None: ...

class DescribePartitionRequest(_message.Message):
    __slots__ = ("topic_partition", "max_producers")
    TOPIC_PARTITION_FIELD_NUMBER: _ClassVar[int]
    MAX_PRODUCERS_FIELD_NUMBER: _ClassVar[int]
    topic_partition: _common_pb2.TopicPartition
    max_producers: int
    def __init__(self, topic_partition: _Optional[_Union[_common_pb2.TopicPartition, _Mapping]] = ..., max_producers: _Optional[int] = ...) -> None: ...

class DescribePartitionResponse(_message.Message):
    __slots__ = ("topic_partition", "state", "data_loss", "log_start_offset", "high_watermark", "max_read_position", "last_data_offset", "segment_count", "size_bytes", "transaction_buffer_ready", "open_transactions", "aborted_transaction_count", "producers", "producer_count", "subscriptions", "producer_snapshot_offset", "transaction_buffer_snapshot_offset", "coordinator_epochs", "replication", "withheld")
    class CoordinatorEpochsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    TOPIC_PARTITION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DATA_LOSS_FIELD_NUMBER: _ClassVar[int]
    LOG_START_OFFSET_FIELD_NUMBER: _ClassVar[int]
    HIGH_WATERMARK_FIELD_NUMBER: _ClassVar[int]
    MAX_READ_POSITION_FIELD_NUMBER: _ClassVar[int]
    LAST_DATA_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_COUNT_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSACTION_BUFFER_READY_FIELD_NUMBER: _ClassVar[int]
    OPEN_TRANSACTIONS_FIELD_NUMBER: _ClassVar[int]
    ABORTED_TRANSACTION_COUNT_FIELD_NUMBER: _ClassVar[int]
    PRODUCERS_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_COUNT_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIPTIONS_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_SNAPSHOT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    TRANSACTION_BUFFER_SNAPSHOT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_EPOCHS_FIELD_NUMBER: _ClassVar[int]
    REPLICATION_FIELD_NUMBER: _ClassVar[int]
    WITHHELD_FIELD_NUMBER: _ClassVar[int]
    topic_partition: _common_pb2.TopicPartition
    state: PartitionState
    data_loss: DataLossInfo
    log_start_offset: int
    high_watermark: int
    max_read_position: int
    last_data_offset: int
    segment_count: int
    size_bytes: int
    transaction_buffer_ready: bool
    open_transactions: _containers.RepeatedCompositeFieldContainer[OpenTransaction]
    aborted_transaction_count: int
    producers: _containers.RepeatedCompositeFieldContainer[ProducerState]
    producer_count: int
    subscriptions: _containers.RepeatedCompositeFieldContainer[SubscriptionCursor]
    producer_snapshot_offset: int
    transaction_buffer_snapshot_offset: int
    coordinator_epochs: _containers.ScalarMap[int, int]
    replication: ReplicationStatus
    withheld: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, topic_partition: _Optional[_Union[_common_pb2.TopicPartition, _Mapping]] = ..., state: _Optional[_Union[PartitionState, str]] = ..., data_loss: _Optional[_Union[DataLossInfo, _Mapping]] = ..., log_start_offset: _Optional[int] = ..., high_watermark: _Optional[int] = ..., max_read_position: _Optional[int] = ..., last_data_offset: _Optional[int] = ..., segment_count: _Optional[int] = ..., size_bytes: _Optional[int] = ..., transaction_buffer_ready: _Optional[bool] = ..., open_transactions: _Optional[_Iterable[_Union[OpenTransaction, _Mapping]]] = ..., aborted_transaction_count: _Optional[int] = ..., producers: _Optional[_Iterable[_Union[ProducerState, _Mapping]]] = ..., producer_count: _Optional[int] = ..., subscriptions: _Optional[_Iterable[_Union[SubscriptionCursor, _Mapping]]] = ..., producer_snapshot_offset: _Optional[int] = ..., transaction_buffer_snapshot_offset: _Optional[int] = ..., coordinator_epochs: _Optional[_Mapping[int, int]] = ..., replication: _Optional[_Union[ReplicationStatus, _Mapping]] = ..., withheld: _Optional[_Iterable[str]] = ...) -> None: ...

class ReplicationStatus(_message.Message):
    __slots__ = ("leader_epoch", "replicas", "isr", "replicated_high_watermark", "followers", "reassigning_to", "reassignment_throttle_bytes_per_s")
    LEADER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    ISR_FIELD_NUMBER: _ClassVar[int]
    REPLICATED_HIGH_WATERMARK_FIELD_NUMBER: _ClassVar[int]
    FOLLOWERS_FIELD_NUMBER: _ClassVar[int]
    REASSIGNING_TO_FIELD_NUMBER: _ClassVar[int]
    REASSIGNMENT_THROTTLE_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    leader_epoch: int
    replicas: _containers.RepeatedScalarFieldContainer[str]
    isr: _containers.RepeatedScalarFieldContainer[str]
    replicated_high_watermark: int
    followers: _containers.RepeatedCompositeFieldContainer[FollowerStatus]
    reassigning_to: _containers.RepeatedScalarFieldContainer[str]
    reassignment_throttle_bytes_per_s: int
    def __init__(self, leader_epoch: _Optional[int] = ..., replicas: _Optional[_Iterable[str]] = ..., isr: _Optional[_Iterable[str]] = ..., replicated_high_watermark: _Optional[int] = ..., followers: _Optional[_Iterable[_Union[FollowerStatus, _Mapping]]] = ..., reassigning_to: _Optional[_Iterable[str]] = ..., reassignment_throttle_bytes_per_s: _Optional[int] = ...) -> None: ...

class FollowerStatus(_message.Message):
    __slots__ = ("replica", "in_sync", "durable_end_offset", "lag_offsets", "caught_up_ms_ago")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    IN_SYNC_FIELD_NUMBER: _ClassVar[int]
    DURABLE_END_OFFSET_FIELD_NUMBER: _ClassVar[int]
    LAG_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    CAUGHT_UP_MS_AGO_FIELD_NUMBER: _ClassVar[int]
    replica: str
    in_sync: bool
    durable_end_offset: int
    lag_offsets: int
    caught_up_ms_ago: int
    def __init__(self, replica: _Optional[str] = ..., in_sync: _Optional[bool] = ..., durable_end_offset: _Optional[int] = ..., lag_offsets: _Optional[int] = ..., caught_up_ms_ago: _Optional[int] = ...) -> None: ...

class OpenTransaction(_message.Message):
    __slots__ = ("txn_id", "first_offset", "last_offset", "producer_id", "producer_epoch", "first_append_unix_ms", "age_ms")
    TXN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_OFFSET_FIELD_NUMBER: _ClassVar[int]
    LAST_OFFSET_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_ID_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    FIRST_APPEND_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    AGE_MS_FIELD_NUMBER: _ClassVar[int]
    txn_id: _common_pb2.TxnId
    first_offset: int
    last_offset: int
    producer_id: int
    producer_epoch: int
    first_append_unix_ms: int
    age_ms: int
    def __init__(self, txn_id: _Optional[_Union[_common_pb2.TxnId, _Mapping]] = ..., first_offset: _Optional[int] = ..., last_offset: _Optional[int] = ..., producer_id: _Optional[int] = ..., producer_epoch: _Optional[int] = ..., first_append_unix_ms: _Optional[int] = ..., age_ms: _Optional[int] = ...) -> None: ...

class ProducerState(_message.Message):
    __slots__ = ("producer_id", "producer_epoch", "last_sequence", "last_offset", "last_append_unix_ms", "current_txn_id", "cached_batch_count")
    PRODUCER_ID_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    LAST_OFFSET_FIELD_NUMBER: _ClassVar[int]
    LAST_APPEND_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    CURRENT_TXN_ID_FIELD_NUMBER: _ClassVar[int]
    CACHED_BATCH_COUNT_FIELD_NUMBER: _ClassVar[int]
    producer_id: int
    producer_epoch: int
    last_sequence: int
    last_offset: int
    last_append_unix_ms: int
    current_txn_id: _common_pb2.TxnId
    cached_batch_count: int
    def __init__(self, producer_id: _Optional[int] = ..., producer_epoch: _Optional[int] = ..., last_sequence: _Optional[int] = ..., last_offset: _Optional[int] = ..., last_append_unix_ms: _Optional[int] = ..., current_txn_id: _Optional[_Union[_common_pb2.TxnId, _Mapping]] = ..., cached_batch_count: _Optional[int] = ...) -> None: ...

class ListPartitionsRequest(_message.Message):
    __slots__ = ("include_internal",)
    INCLUDE_INTERNAL_FIELD_NUMBER: _ClassVar[int]
    include_internal: bool
    def __init__(self, include_internal: _Optional[bool] = ...) -> None: ...

class ListPartitionsResponse(_message.Message):
    __slots__ = ("partitions",)
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    partitions: _containers.RepeatedCompositeFieldContainer[PartitionSummary]
    def __init__(self, partitions: _Optional[_Iterable[_Union[PartitionSummary, _Mapping]]] = ...) -> None: ...

class PartitionSummary(_message.Message):
    __slots__ = ("topic_partition", "state", "data_loss", "log_start_offset", "high_watermark", "max_read_position", "size_bytes", "open_transaction_count")
    TOPIC_PARTITION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DATA_LOSS_FIELD_NUMBER: _ClassVar[int]
    LOG_START_OFFSET_FIELD_NUMBER: _ClassVar[int]
    HIGH_WATERMARK_FIELD_NUMBER: _ClassVar[int]
    MAX_READ_POSITION_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    OPEN_TRANSACTION_COUNT_FIELD_NUMBER: _ClassVar[int]
    topic_partition: _common_pb2.TopicPartition
    state: PartitionState
    data_loss: DataLossInfo
    log_start_offset: int
    high_watermark: int
    max_read_position: int
    size_bytes: int
    open_transaction_count: int
    def __init__(self, topic_partition: _Optional[_Union[_common_pb2.TopicPartition, _Mapping]] = ..., state: _Optional[_Union[PartitionState, str]] = ..., data_loss: _Optional[_Union[DataLossInfo, _Mapping]] = ..., log_start_offset: _Optional[int] = ..., high_watermark: _Optional[int] = ..., max_read_position: _Optional[int] = ..., size_bytes: _Optional[int] = ..., open_transaction_count: _Optional[int] = ...) -> None: ...

class RecoverPartitionRequest(_message.Message):
    __slots__ = ("topic_partition", "expected_file", "expected_offset", "accept_data_loss")
    TOPIC_PARTITION_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FILE_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_OFFSET_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_DATA_LOSS_FIELD_NUMBER: _ClassVar[int]
    topic_partition: _common_pb2.TopicPartition
    expected_file: str
    expected_offset: int
    accept_data_loss: bool
    def __init__(self, topic_partition: _Optional[_Union[_common_pb2.TopicPartition, _Mapping]] = ..., expected_file: _Optional[str] = ..., expected_offset: _Optional[int] = ..., accept_data_loss: _Optional[bool] = ...) -> None: ...

class RecoverPartitionResponse(_message.Message):
    __slots__ = ("state", "truncated_at_offset", "removed_bytes", "high_watermark")
    STATE_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_AT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    REMOVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    HIGH_WATERMARK_FIELD_NUMBER: _ClassVar[int]
    state: PartitionState
    truncated_at_offset: int
    removed_bytes: int
    high_watermark: int
    def __init__(self, state: _Optional[_Union[PartitionState, str]] = ..., truncated_at_offset: _Optional[int] = ..., removed_bytes: _Optional[int] = ..., high_watermark: _Optional[int] = ...) -> None: ...

class DescribeCopyRequest(_message.Message):
    __slots__ = ("topic_partition",)
    TOPIC_PARTITION_FIELD_NUMBER: _ClassVar[int]
    topic_partition: _common_pb2.TopicPartition
    def __init__(self, topic_partition: _Optional[_Union[_common_pb2.TopicPartition, _Mapping]] = ...) -> None: ...

class DescribeCopyResponse(_message.Message):
    __slots__ = ("server_name", "role", "present", "log_start_offset", "log_end_offset", "tail_detail", "latest_leader_epoch", "latest_epoch_start_offset", "segment_count", "size_bytes", "data_loss_detail")
    SERVER_NAME_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    LOG_START_OFFSET_FIELD_NUMBER: _ClassVar[int]
    LOG_END_OFFSET_FIELD_NUMBER: _ClassVar[int]
    TAIL_DETAIL_FIELD_NUMBER: _ClassVar[int]
    LATEST_LEADER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    LATEST_EPOCH_START_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_COUNT_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_LOSS_DETAIL_FIELD_NUMBER: _ClassVar[int]
    server_name: str
    role: str
    present: bool
    log_start_offset: int
    log_end_offset: int
    tail_detail: str
    latest_leader_epoch: int
    latest_epoch_start_offset: int
    segment_count: int
    size_bytes: int
    data_loss_detail: str
    def __init__(self, server_name: _Optional[str] = ..., role: _Optional[str] = ..., present: _Optional[bool] = ..., log_start_offset: _Optional[int] = ..., log_end_offset: _Optional[int] = ..., tail_detail: _Optional[str] = ..., latest_leader_epoch: _Optional[int] = ..., latest_epoch_start_offset: _Optional[int] = ..., segment_count: _Optional[int] = ..., size_bytes: _Optional[int] = ..., data_loss_detail: _Optional[str] = ...) -> None: ...

class ScrubPartitionRequest(_message.Message):
    __slots__ = ("topic_partition",)
    TOPIC_PARTITION_FIELD_NUMBER: _ClassVar[int]
    topic_partition: _common_pb2.TopicPartition
    def __init__(self, topic_partition: _Optional[_Union[_common_pb2.TopicPartition, _Mapping]] = ...) -> None: ...

class ScrubPartitionResponse(_message.Message):
    __slots__ = ("role", "segments_checked", "bytes_checked", "damage")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_CHECKED_FIELD_NUMBER: _ClassVar[int]
    BYTES_CHECKED_FIELD_NUMBER: _ClassVar[int]
    DAMAGE_FIELD_NUMBER: _ClassVar[int]
    role: str
    segments_checked: int
    bytes_checked: int
    damage: ScrubDamage
    def __init__(self, role: _Optional[str] = ..., segments_checked: _Optional[int] = ..., bytes_checked: _Optional[int] = ..., damage: _Optional[_Union[ScrubDamage, _Mapping]] = ...) -> None: ...

class ScrubDamage(_message.Message):
    __slots__ = ("file", "position", "offset", "detail", "acted_on")
    FILE_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    ACTED_ON_FIELD_NUMBER: _ClassVar[int]
    file: str
    position: int
    offset: int
    detail: str
    acted_on: bool
    def __init__(self, file: _Optional[str] = ..., position: _Optional[int] = ..., offset: _Optional[int] = ..., detail: _Optional[str] = ..., acted_on: _Optional[bool] = ...) -> None: ...

class StageTxnRequest(_message.Message):
    __slots__ = ("items", "markers", "appends")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    MARKERS_FIELD_NUMBER: _ClassVar[int]
    APPENDS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[StageTxnItem]
    markers: EndTxnOnPartitionRequest
    appends: ProduceRequest
    def __init__(self, items: _Optional[_Iterable[_Union[StageTxnItem, _Mapping]]] = ..., markers: _Optional[_Union[EndTxnOnPartitionRequest, _Mapping]] = ..., appends: _Optional[_Union[ProduceRequest, _Mapping]] = ...) -> None: ...

class StageTxnItem(_message.Message):
    __slots__ = ("txn_id", "coordinator_epoch", "batches", "acks")
    TXN_ID_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_EPOCH_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    ACKS_FIELD_NUMBER: _ClassVar[int]
    txn_id: _common_pb2.TxnId
    coordinator_epoch: int
    batches: _containers.RepeatedCompositeFieldContainer[ProduceItem]
    acks: _containers.RepeatedCompositeFieldContainer[AckItem]
    def __init__(self, txn_id: _Optional[_Union[_common_pb2.TxnId, _Mapping]] = ..., coordinator_epoch: _Optional[int] = ..., batches: _Optional[_Iterable[_Union[ProduceItem, _Mapping]]] = ..., acks: _Optional[_Iterable[_Union[AckItem, _Mapping]]] = ...) -> None: ...

class StageTxnResponse(_message.Message):
    __slots__ = ("results", "markers", "appends")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    MARKERS_FIELD_NUMBER: _ClassVar[int]
    APPENDS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[StageTxnResult]
    markers: EndTxnOnPartitionResponse
    appends: ProduceResponse
    def __init__(self, results: _Optional[_Iterable[_Union[StageTxnResult, _Mapping]]] = ..., markers: _Optional[_Union[EndTxnOnPartitionResponse, _Mapping]] = ..., appends: _Optional[_Union[ProduceResponse, _Mapping]] = ...) -> None: ...

class StageTxnResult(_message.Message):
    __slots__ = ("txn_id", "batch_results", "ack_results")
    TXN_ID_FIELD_NUMBER: _ClassVar[int]
    BATCH_RESULTS_FIELD_NUMBER: _ClassVar[int]
    ACK_RESULTS_FIELD_NUMBER: _ClassVar[int]
    txn_id: _common_pb2.TxnId
    batch_results: _containers.RepeatedCompositeFieldContainer[ProduceResult]
    ack_results: _containers.RepeatedCompositeFieldContainer[AckResult]
    def __init__(self, txn_id: _Optional[_Union[_common_pb2.TxnId, _Mapping]] = ..., batch_results: _Optional[_Iterable[_Union[ProduceResult, _Mapping]]] = ..., ack_results: _Optional[_Iterable[_Union[AckResult, _Mapping]]] = ...) -> None: ...

class ResolveStagedRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ResolveStagedItem]
    def __init__(self, items: _Optional[_Iterable[_Union[ResolveStagedItem, _Mapping]]] = ...) -> None: ...

class ResolveStagedItem(_message.Message):
    __slots__ = ("txn_id", "coordinator_epoch", "topic_partitions", "subscription_partitions")
    TXN_ID_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_EPOCH_FIELD_NUMBER: _ClassVar[int]
    TOPIC_PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIPTION_PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    txn_id: _common_pb2.TxnId
    coordinator_epoch: int
    topic_partitions: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopicPartition]
    subscription_partitions: _containers.RepeatedCompositeFieldContainer[_common_pb2.SubscriptionPartition]
    def __init__(self, txn_id: _Optional[_Union[_common_pb2.TxnId, _Mapping]] = ..., coordinator_epoch: _Optional[int] = ..., topic_partitions: _Optional[_Iterable[_Union[_common_pb2.TopicPartition, _Mapping]]] = ..., subscription_partitions: _Optional[_Iterable[_Union[_common_pb2.SubscriptionPartition, _Mapping]]] = ...) -> None: ...

class ResolveStagedResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ResolveStagedResult]
    def __init__(self, results: _Optional[_Iterable[_Union[ResolveStagedResult, _Mapping]]] = ...) -> None: ...

class ResolveStagedResult(_message.Message):
    __slots__ = ("txn_id", "partitions", "subscription_partitions")
    TXN_ID_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIPTION_PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    txn_id: _common_pb2.TxnId
    partitions: _containers.RepeatedCompositeFieldContainer[StagedPartition]
    subscription_partitions: _containers.RepeatedCompositeFieldContainer[StagedSubscriptionPartition]
    def __init__(self, txn_id: _Optional[_Union[_common_pb2.TxnId, _Mapping]] = ..., partitions: _Optional[_Iterable[_Union[StagedPartition, _Mapping]]] = ..., subscription_partitions: _Optional[_Iterable[_Union[StagedSubscriptionPartition, _Mapping]]] = ...) -> None: ...

class StagedPartition(_message.Message):
    __slots__ = ("topic_partition", "error", "staged")
    TOPIC_PARTITION_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STAGED_FIELD_NUMBER: _ClassVar[int]
    topic_partition: _common_pb2.TopicPartition
    error: ItemError
    staged: bool
    def __init__(self, topic_partition: _Optional[_Union[_common_pb2.TopicPartition, _Mapping]] = ..., error: _Optional[_Union[ItemError, _Mapping]] = ..., staged: _Optional[bool] = ...) -> None: ...

class StagedSubscriptionPartition(_message.Message):
    __slots__ = ("subscription_partition", "error", "staged")
    SUBSCRIPTION_PARTITION_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STAGED_FIELD_NUMBER: _ClassVar[int]
    subscription_partition: _common_pb2.SubscriptionPartition
    error: ItemError
    staged: bool
    def __init__(self, subscription_partition: _Optional[_Union[_common_pb2.SubscriptionPartition, _Mapping]] = ..., error: _Optional[_Union[ItemError, _Mapping]] = ..., staged: _Optional[bool] = ...) -> None: ...

class ReplicateRequest(_message.Message):
    __slots__ = ("topic_partition", "replica", "leader_epoch", "fetch_offset", "last_fetched_epoch", "max_bytes", "max_wait_ms", "cursor_sequence", "replica_incarnation", "log_start_offset")
    TOPIC_PARTITION_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    LEADER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    FETCH_OFFSET_FIELD_NUMBER: _ClassVar[int]
    LAST_FETCHED_EPOCH_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    CURSOR_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    LOG_START_OFFSET_FIELD_NUMBER: _ClassVar[int]
    topic_partition: _common_pb2.TopicPartition
    replica: str
    leader_epoch: int
    fetch_offset: int
    last_fetched_epoch: int
    max_bytes: int
    max_wait_ms: int
    cursor_sequence: int
    replica_incarnation: int
    log_start_offset: int
    def __init__(self, topic_partition: _Optional[_Union[_common_pb2.TopicPartition, _Mapping]] = ..., replica: _Optional[str] = ..., leader_epoch: _Optional[int] = ..., fetch_offset: _Optional[int] = ..., last_fetched_epoch: _Optional[int] = ..., max_bytes: _Optional[int] = ..., max_wait_ms: _Optional[int] = ..., cursor_sequence: _Optional[int] = ..., replica_incarnation: _Optional[int] = ..., log_start_offset: _Optional[int] = ...) -> None: ...

class ReplicateManyRequest(_message.Message):
    __slots__ = ("replica", "max_wait_ms", "max_bytes", "partitions", "session_id", "session_epoch", "forgotten")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    MAX_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_EPOCH_FIELD_NUMBER: _ClassVar[int]
    FORGOTTEN_FIELD_NUMBER: _ClassVar[int]
    replica: str
    max_wait_ms: int
    max_bytes: int
    partitions: _containers.RepeatedCompositeFieldContainer[ReplicateRequest]
    session_id: int
    session_epoch: int
    forgotten: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopicPartition]
    def __init__(self, replica: _Optional[str] = ..., max_wait_ms: _Optional[int] = ..., max_bytes: _Optional[int] = ..., partitions: _Optional[_Iterable[_Union[ReplicateRequest, _Mapping]]] = ..., session_id: _Optional[int] = ..., session_epoch: _Optional[int] = ..., forgotten: _Optional[_Iterable[_Union[_common_pb2.TopicPartition, _Mapping]]] = ...) -> None: ...

class ReplicateManyResponse(_message.Message):
    __slots__ = ("results", "session_id")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ReplicateResult]
    session_id: int
    def __init__(self, results: _Optional[_Iterable[_Union[ReplicateResult, _Mapping]]] = ..., session_id: _Optional[int] = ...) -> None: ...

class ReplicateResult(_message.Message):
    __slots__ = ("topic_partition", "error", "response")
    TOPIC_PARTITION_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    topic_partition: _common_pb2.TopicPartition
    error: ItemError
    response: ReplicateResponse
    def __init__(self, topic_partition: _Optional[_Union[_common_pb2.TopicPartition, _Mapping]] = ..., error: _Optional[_Union[ItemError, _Mapping]] = ..., response: _Optional[_Union[ReplicateResponse, _Mapping]] = ...) -> None: ...

class LeaderEpochEntry(_message.Message):
    __slots__ = ("epoch", "start_offset")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    START_OFFSET_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    start_offset: int
    def __init__(self, epoch: _Optional[int] = ..., start_offset: _Optional[int] = ...) -> None: ...

class ReplicateResponse(_message.Message):
    __slots__ = ("records", "high_watermark", "log_start_offset", "log_end_offset", "epochs", "diverging", "diverging_epoch", "diverging_end_offset", "cursors_available", "cursor_snapshot", "cursor_first_sequence", "cursor_frames", "cursor_durable_end", "segment_bases")
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    HIGH_WATERMARK_FIELD_NUMBER: _ClassVar[int]
    LOG_START_OFFSET_FIELD_NUMBER: _ClassVar[int]
    LOG_END_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EPOCHS_FIELD_NUMBER: _ClassVar[int]
    DIVERGING_FIELD_NUMBER: _ClassVar[int]
    DIVERGING_EPOCH_FIELD_NUMBER: _ClassVar[int]
    DIVERGING_END_OFFSET_FIELD_NUMBER: _ClassVar[int]
    CURSORS_AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    CURSOR_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIRST_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FRAMES_FIELD_NUMBER: _ClassVar[int]
    CURSOR_DURABLE_END_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_BASES_FIELD_NUMBER: _ClassVar[int]
    records: bytes
    high_watermark: int
    log_start_offset: int
    log_end_offset: int
    epochs: _containers.RepeatedCompositeFieldContainer[LeaderEpochEntry]
    diverging: bool
    diverging_epoch: int
    diverging_end_offset: int
    cursors_available: bool
    cursor_snapshot: bytes
    cursor_first_sequence: int
    cursor_frames: bytes
    cursor_durable_end: int
    segment_bases: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, records: _Optional[bytes] = ..., high_watermark: _Optional[int] = ..., log_start_offset: _Optional[int] = ..., log_end_offset: _Optional[int] = ..., epochs: _Optional[_Iterable[_Union[LeaderEpochEntry, _Mapping]]] = ..., diverging: _Optional[bool] = ..., diverging_epoch: _Optional[int] = ..., diverging_end_offset: _Optional[int] = ..., cursors_available: _Optional[bool] = ..., cursor_snapshot: _Optional[bytes] = ..., cursor_first_sequence: _Optional[int] = ..., cursor_frames: _Optional[bytes] = ..., cursor_durable_end: _Optional[int] = ..., segment_bases: _Optional[_Iterable[int]] = ...) -> None: ...
