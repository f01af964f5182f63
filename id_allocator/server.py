"""Producer-id allocator process: what `atomlog serve id-allocator` installs.

A thin adapter: the servicer validates requests and hands them to the process's one
`Allocator` owner task (id_allocator/allocator.py), which drives the pure core
(id_allocator/core.py) against the `/producer_id_block` znode (id_allocator/store.py).
Errors are AtomlogError; the runtime's interceptor turns them into statuses.
"""

from __future__ import annotations

from atomlog.v1 import id_allocator_pb2, id_allocator_pb2_grpc
from id_allocator.allocator import Allocator, AllocatorSettings
from id_allocator.store import ZkBlockStore
from services.grpcutil import service_name


class IdAllocatorServicer(id_allocator_pb2_grpc.IdAllocatorServiceServicer):
    def __init__(self, allocator: Allocator, zk_connected):
        self.allocator = allocator
        self._zk_connected = zk_connected

    async def AllocateProducerIds(self, request, context):
        block = await self.allocator.allocate(request.count, request.requester)
        return id_allocator_pb2.AllocateProducerIdsResponse(first_producer_id=block.first,
                                                            last_producer_id=block.last)

    async def DescribeAllocator(self, request, context):
        snapshot = await self.allocator.describe()
        record = snapshot.record
        settings = self.allocator.settings
        return id_allocator_pb2.DescribeAllocatorResponse(
            allocator_name=self.allocator.name,
            zookeeper_connected=self._zk_connected(),
            last_block_first_producer_id=record.last_block.first if record else 0,
            last_block_last_producer_id=record.last_block.last if record else 0,
            last_block_requester=record.requester if record else "",
            znode_version=snapshot.version,  # ABSENT (-1) when the znode does not exist
            default_block_size=settings.default_block_size,
            max_block_size=settings.max_block_size,
            blocks_issued=self.allocator.blocks_issued,
            compare_and_set_conflicts=self.allocator.conflicts)


async def install(runtime) -> list[str]:
    settings = AllocatorSettings.from_config(runtime.config)
    store = ZkBlockStore(runtime.zk, settings.zookeeper_op_timeout_ms / 1000)
    allocator = Allocator(store, runtime.name, settings)
    allocator.start()
    runtime.stop_hooks.append(allocator.stop)
    servicer = IdAllocatorServicer(allocator, lambda: runtime.zk.connected)
    id_allocator_pb2_grpc.add_IdAllocatorServiceServicer_to_server(servicer, runtime.server)
    name = service_name(id_allocator_pb2, "IdAllocatorService")
    runtime.local_services[name] = servicer  # services/local.py: same-process calls
    return [name]
