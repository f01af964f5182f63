"""Coordinator process: what `atomlog serve coordinator` installs.

Today it registers, serves health, metrics and metadata, and exposes the
CoordinatorService contract; TC partition leases and the transaction state machine
(issue 5) fill in the RPCs, which answer UNIMPLEMENTED until then.
"""

from __future__ import annotations

from atomlog.v1 import coordinator_pb2, coordinator_pb2_grpc
from services.grpcutil import service_name


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServiceServicer):
    """Every RPC answers UNIMPLEMENTED (with an ErrorInfo) until issue 5 lands."""


async def install(runtime) -> list[str]:
    coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server(CoordinatorServicer(),
                                                                  runtime.server)
    return [service_name(coordinator_pb2, "CoordinatorService")]
