"""Partition server process: what `atomlog serve partition-server` installs.

Today it registers, serves health, metrics and metadata, and exposes the
PartitionService contract; the storage engine (issue 3) and transaction buffer
(issue 6) fill in the RPCs, which answer UNIMPLEMENTED until then.
"""

from __future__ import annotations

from atomlog.v1 import partition_pb2, partition_pb2_grpc
from services.grpcutil import service_name


class PartitionServicer(partition_pb2_grpc.PartitionServiceServicer):
    """Every RPC answers UNIMPLEMENTED (with an ErrorInfo) until the storage engine lands."""


async def install(runtime) -> list[str]:
    partition_pb2_grpc.add_PartitionServiceServicer_to_server(PartitionServicer(), runtime.server)
    return [service_name(partition_pb2, "PartitionService")]
