"""Producer-id allocator process: what `atomlog serve id-allocator` installs.

Today it registers, serves health, metrics and metadata, and exposes the
IdAllocatorService contract; block allocation on ZooKeeper (issue 4) fills it in.
"""

from __future__ import annotations

from atomlog.v1 import id_allocator_pb2, id_allocator_pb2_grpc
from services.grpcutil import service_name


class IdAllocatorServicer(id_allocator_pb2_grpc.IdAllocatorServiceServicer):
    """Every RPC answers UNIMPLEMENTED (with an ErrorInfo) until issue 4 lands."""


async def install(runtime) -> list[str]:
    id_allocator_pb2_grpc.add_IdAllocatorServiceServicer_to_server(IdAllocatorServicer(),
                                                                   runtime.server)
    return [service_name(id_allocator_pb2, "IdAllocatorService")]
