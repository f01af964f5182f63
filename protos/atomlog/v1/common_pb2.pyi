from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class IsolationLevel(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ISOLATION_LEVEL_UNSPECIFIED: _ClassVar[IsolationLevel]
    ISOLATION_LEVEL_READ_COMMITTED: _ClassVar[IsolationLevel]
    ISOLATION_LEVEL_READ_UNCOMMITTED: _ClassVar[IsolationLevel]

class ServerRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SERVER_ROLE_UNSPECIFIED: _ClassVar[ServerRole]
    SERVER_ROLE_PARTITION_SERVER: _ClassVar[ServerRole]
    SERVER_ROLE_COORDINATOR: _ClassVar[ServerRole]
    SERVER_ROLE_ID_ALLOCATOR: _ClassVar[ServerRole]
ISOLATION_LEVEL_UNSPECIFIED: IsolationLevel
ISOLATION_LEVEL_READ_COMMITTED: IsolationLevel
ISOLATION_LEVEL_READ_UNCOMMITTED: IsolationLevel
SERVER_ROLE_UNSPECIFIED: ServerRole
SERVER_ROLE_PARTITION_SERVER: ServerRole
SERVER_ROLE_COORDINATOR: ServerRole
SERVER_ROLE_ID_ALLOCATOR: ServerRole

class TxnId(_message.Message):
    __slots__ = ("tc_partition", "sequence")
    TC_PARTITION_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    tc_partition: int
    sequence: int
    def __init__(self, tc_partition: _Optional[int] = ..., sequence: _Optional[int] = ...) -> None: ...

class TopicPartition(_message.Message):
    __slots__ = ("topic", "partition")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    topic: str
    partition: int
    def __init__(self, topic: _Optional[str] = ..., partition: _Optional[int] = ...) -> None: ...

class SubscriptionPartition(_message.Message):
    __slots__ = ("topic", "partition", "subscription")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIPTION_FIELD_NUMBER: _ClassVar[int]
    topic: str
    partition: int
    subscription: str
    def __init__(self, topic: _Optional[str] = ..., partition: _Optional[int] = ..., subscription: _Optional[str] = ...) -> None: ...
