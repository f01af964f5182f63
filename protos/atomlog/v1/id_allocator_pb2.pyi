from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class AllocateProducerIdsRequest(_message.Message):
    __slots__ = ("count", "requester")
    COUNT_FIELD_NUMBER: _ClassVar[int]
    REQUESTER_FIELD_NUMBER: _ClassVar[int]
    count: int
    requester: str
    def __init__(self, count: _Optional[int] = ..., requester: _Optional[str] = ...) -> None: ...

class AllocateProducerIdsResponse(_message.Message):
    __slots__ = ("first_producer_id", "last_producer_id")
    FIRST_PRODUCER_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_PRODUCER_ID_FIELD_NUMBER: _ClassVar[int]
    first_producer_id: int
    last_producer_id: int
    def __init__(self, first_producer_id: _Optional[int] = ..., last_producer_id: _Optional[int] = ...) -> None: ...

class DescribeAllocatorRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeAllocatorResponse(_message.Message):
    __slots__ = ("allocator_name", "zookeeper_connected", "last_block_first_producer_id", "last_block_last_producer_id", "last_block_requester", "znode_version", "default_block_size", "max_block_size", "blocks_issued", "compare_and_set_conflicts")
    ALLOCATOR_NAME_FIELD_NUMBER: _ClassVar[int]
    ZOOKEEPER_CONNECTED_FIELD_NUMBER: _ClassVar[int]
    LAST_BLOCK_FIRST_PRODUCER_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_BLOCK_LAST_PRODUCER_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_BLOCK_REQUESTER_FIELD_NUMBER: _ClassVar[int]
    ZNODE_VERSION_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_ISSUED_FIELD_NUMBER: _ClassVar[int]
    COMPARE_AND_SET_CONFLICTS_FIELD_NUMBER: _ClassVar[int]
    allocator_name: str
    zookeeper_connected: bool
    last_block_first_producer_id: int
    last_block_last_producer_id: int
    last_block_requester: str
    znode_version: int
    default_block_size: int
    max_block_size: int
    blocks_issued: int
    compare_and_set_conflicts: int
    def __init__(self, allocator_name: _Optional[str] = ..., zookeeper_connected: _Optional[bool] = ..., last_block_first_producer_id: _Optional[int] = ..., last_block_last_producer_id: _Optional[int] = ..., last_block_requester: _Optional[str] = ..., znode_version: _Optional[int] = ..., default_block_size: _Optional[int] = ..., max_block_size: _Optional[int] = ..., blocks_issued: _Optional[int] = ..., compare_and_set_conflicts: _Optional[int] = ...) -> None: ...
