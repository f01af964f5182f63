"""Coordinator process: what `atomlog serve coordinator` installs.

Today: InitProducerId for idempotent producers (a producer id from the coordinator's
block, epoch 0). TC partition leases, the transaction state machine and the other
CoordinatorService RPCs (issue 5) answer UNIMPLEMENTED until then.
"""

from __future__ import annotations

from atomlog.v1 import coordinator_pb2, coordinator_pb2_grpc
from coordinator.producer_ids import ProducerIds
from services.errors import AtomlogError
from services.grpcutil import service_name


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServiceServicer):
    def __init__(self, producer_ids: ProducerIds):
        self.producer_ids = producer_ids

    async def InitProducerId(self, request, context):
        if request.transactional_id:
            raise AtomlogError("UNIMPLEMENTED", "transactional ids are not supported by this "
                               "coordinator version; omit transactional_id for an idempotent "
                               "producer")
        if request.producer_id < 0:
            raise AtomlogError("INVALID_ARGUMENT", f"producer_id {request.producer_id} is negative")
        # An idempotent producer (re)starting gets a fresh id: sequences begin at 0 with it.
        return coordinator_pb2.InitProducerIdResponse(
            producer_id=await self.producer_ids.next_id(), producer_epoch=0)


async def install(runtime) -> list[str]:
    producer_ids = ProducerIds(runtime.metadata, requester=runtime.name)
    runtime.stop_hooks.append(producer_ids.close)
    coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server(
        CoordinatorServicer(producer_ids), runtime.server)
    return [service_name(coordinator_pb2, "CoordinatorService")]
