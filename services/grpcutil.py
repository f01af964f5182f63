"""Small helpers shared by servicers and channels."""

from __future__ import annotations

from types import ModuleType

# Reconnect backoff at most 0.5 s, for every channel a server or the SDK opens. gRPC's
# default grows to 120 s while a server is down (1 s, 1.6 s, 2.6 s, ...), and until its next
# attempt every call on the channel fails at once with the old "connection refused": a
# server back after a restart (maybe the new leader of a partition, or the coordinator that
# verifies a transaction) stayed unreachable for seconds. The connect timeout stays 20 s.
RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
]

# The health service name a partition server answers SERVING once caught up (its replicas
# back in their ISRs, its own partitions open): partition_server/server.py CaughtUpWatch.
CAUGHT_UP_SERVICE = "atomlog.caught_up"


def service_name(pb2_module: ModuleType, service: str) -> str:
    """Full name ("atomlog.v1.PartitionService") of a service in a generated module."""
    return pb2_module.DESCRIPTOR.services_by_name[service].full_name
