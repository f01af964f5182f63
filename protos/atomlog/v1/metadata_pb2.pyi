from atomlog.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ServerInfo(_message.Message):
    __slots__ = ("name", "role", "grpc_address", "metrics_address", "version", "registered_unix_ms", "link_address")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    GRPC_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    LINK_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    name: str
    role: _common_pb2.ServerRole
    grpc_address: str
    metrics_address: str
    version: str
    registered_unix_ms: int
    link_address: str
    def __init__(self, name: _Optional[str] = ..., role: _Optional[_Union[_common_pb2.ServerRole, str]] = ..., grpc_address: _Optional[str] = ..., metrics_address: _Optional[str] = ..., version: _Optional[str] = ..., registered_unix_ms: _Optional[int] = ..., link_address: _Optional[str] = ...) -> None: ...

class PartitionMetadata(_message.Message):
    __slots__ = ("partition", "server_name", "server_address", "available", "replicas", "isr", "leader_epoch", "reassigning_to", "reassignment_throttle_bytes_per_s")
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    SERVER_NAME_FIELD_NUMBER: _ClassVar[int]
    SERVER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    ISR_FIELD_NUMBER: _ClassVar[int]
    LEADER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    REASSIGNING_TO_FIELD_NUMBER: _ClassVar[int]
    REASSIGNMENT_THROTTLE_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    partition: int
    server_name: str
    server_address: str
    available: bool
    replicas: _containers.RepeatedScalarFieldContainer[str]
    isr: _containers.RepeatedScalarFieldContainer[str]
    leader_epoch: int
    reassigning_to: _containers.RepeatedScalarFieldContainer[str]
    reassignment_throttle_bytes_per_s: int
    def __init__(self, partition: _Optional[int] = ..., server_name: _Optional[str] = ..., server_address: _Optional[str] = ..., available: _Optional[bool] = ..., replicas: _Optional[_Iterable[str]] = ..., isr: _Optional[_Iterable[str]] = ..., leader_epoch: _Optional[int] = ..., reassigning_to: _Optional[_Iterable[str]] = ..., reassignment_throttle_bytes_per_s: _Optional[int] = ...) -> None: ...

class TopicMetadata(_message.Message):
    __slots__ = ("name", "partitions", "config", "internal", "created_unix_ms")
    class ConfigEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    INTERNAL_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    name: str
    partitions: _containers.RepeatedCompositeFieldContainer[PartitionMetadata]
    config: _containers.ScalarMap[str, str]
    internal: bool
    created_unix_ms: int
    def __init__(self, name: _Optional[str] = ..., partitions: _Optional[_Iterable[_Union[PartitionMetadata, _Mapping]]] = ..., config: _Optional[_Mapping[str, str]] = ..., internal: _Optional[bool] = ..., created_unix_ms: _Optional[int] = ...) -> None: ...

class TcPartitionMetadata(_message.Message):
    __slots__ = ("tc_partition", "coordinator_name", "coordinator_address", "coordinator_epoch")
    TC_PARTITION_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_NAME_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_EPOCH_FIELD_NUMBER: _ClassVar[int]
    tc_partition: int
    coordinator_name: str
    coordinator_address: str
    coordinator_epoch: int
    def __init__(self, tc_partition: _Optional[int] = ..., coordinator_name: _Optional[str] = ..., coordinator_address: _Optional[str] = ..., coordinator_epoch: _Optional[int] = ...) -> None: ...

class GetMetadataRequest(_message.Message):
    __slots__ = ("topics",)
    TOPICS_FIELD_NUMBER: _ClassVar[int]
    topics: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, topics: _Optional[_Iterable[str]] = ...) -> None: ...

class GetMetadataResponse(_message.Message):
    __slots__ = ("servers", "topics", "tc_partitions", "tc_partition_count", "answered_by")
    SERVERS_FIELD_NUMBER: _ClassVar[int]
    TOPICS_FIELD_NUMBER: _ClassVar[int]
    TC_PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    TC_PARTITION_COUNT_FIELD_NUMBER: _ClassVar[int]
    ANSWERED_BY_FIELD_NUMBER: _ClassVar[int]
    servers: _containers.RepeatedCompositeFieldContainer[ServerInfo]
    topics: _containers.RepeatedCompositeFieldContainer[TopicMetadata]
    tc_partitions: _containers.RepeatedCompositeFieldContainer[TcPartitionMetadata]
    tc_partition_count: int
    answered_by: str
    def __init__(self, servers: _Optional[_Iterable[_Union[ServerInfo, _Mapping]]] = ..., topics: _Optional[_Iterable[_Union[TopicMetadata, _Mapping]]] = ..., tc_partitions: _Optional[_Iterable[_Union[TcPartitionMetadata, _Mapping]]] = ..., tc_partition_count: _Optional[int] = ..., answered_by: _Optional[str] = ...) -> None: ...

class CreateTopicRequest(_message.Message):
    __slots__ = ("name", "partitions", "config", "replication_factor")
    class ConfigEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    REPLICATION_FACTOR_FIELD_NUMBER: _ClassVar[int]
    name: str
    partitions: int
    config: _containers.ScalarMap[str, str]
    replication_factor: int
    def __init__(self, name: _Optional[str] = ..., partitions: _Optional[int] = ..., config: _Optional[_Mapping[str, str]] = ..., replication_factor: _Optional[int] = ...) -> None: ...

class CreateTopicResponse(_message.Message):
    __slots__ = ("topic",)
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    topic: TopicMetadata
    def __init__(self, topic: _Optional[_Union[TopicMetadata, _Mapping]] = ...) -> None: ...

class ReassignPartitionRequest(_message.Message):
    __slots__ = ("topic", "partition", "replicas", "throttle_bytes_per_s")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    THROTTLE_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    topic: str
    partition: int
    replicas: _containers.RepeatedScalarFieldContainer[str]
    throttle_bytes_per_s: int
    def __init__(self, topic: _Optional[str] = ..., partition: _Optional[int] = ..., replicas: _Optional[_Iterable[str]] = ..., throttle_bytes_per_s: _Optional[int] = ...) -> None: ...

class ReassignPartitionResponse(_message.Message):
    __slots__ = ("partition", "started")
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    partition: PartitionMetadata
    started: bool
    def __init__(self, partition: _Optional[_Union[PartitionMetadata, _Mapping]] = ..., started: _Optional[bool] = ...) -> None: ...

class ElectLeaderRequest(_message.Message):
    __slots__ = ("topic", "partition", "replica", "accept_data_loss")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_DATA_LOSS_FIELD_NUMBER: _ClassVar[int]
    topic: str
    partition: int
    replica: str
    accept_data_loss: bool
    def __init__(self, topic: _Optional[str] = ..., partition: _Optional[int] = ..., replica: _Optional[str] = ..., accept_data_loss: _Optional[bool] = ...) -> None: ...

class ElectLeaderResponse(_message.Message):
    __slots__ = ("partition",)
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    partition: PartitionMetadata
    def __init__(self, partition: _Optional[_Union[PartitionMetadata, _Mapping]] = ...) -> None: ...

class AlterTopicConfigRequest(_message.Message):
    __slots__ = ("topic", "set", "delete", "validate_only")
    class SetEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    SET_FIELD_NUMBER: _ClassVar[int]
    DELETE_FIELD_NUMBER: _ClassVar[int]
    VALIDATE_ONLY_FIELD_NUMBER: _ClassVar[int]
    topic: str
    set: _containers.ScalarMap[str, str]
    delete: _containers.RepeatedScalarFieldContainer[str]
    validate_only: bool
    def __init__(self, topic: _Optional[str] = ..., set: _Optional[_Mapping[str, str]] = ..., delete: _Optional[_Iterable[str]] = ..., validate_only: _Optional[bool] = ...) -> None: ...

class AlterTopicConfigResponse(_message.Message):
    __slots__ = ("topic", "changed")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    topic: TopicMetadata
    changed: bool
    def __init__(self, topic: _Optional[_Union[TopicMetadata, _Mapping]] = ..., changed: _Optional[bool] = ...) -> None: ...

class ListTopicsRequest(_message.Message):
    __slots__ = ("include_internal",)
    INCLUDE_INTERNAL_FIELD_NUMBER: _ClassVar[int]
    include_internal: bool
    def __init__(self, include_internal: _Optional[bool] = ...) -> None: ...

class ListTopicsResponse(_message.Message):
    __slots__ = ("names",)
    NAMES_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, names: _Optional[_Iterable[str]] = ...) -> None: ...
