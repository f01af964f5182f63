"""Small helpers shared by servicers."""

from __future__ import annotations

from types import ModuleType


def service_name(pb2_module: ModuleType, service: str) -> str:
    """Full name ("atomlog.v1.PartitionService") of a service in a generated module."""
    return pb2_module.DESCRIPTOR.services_by_name[service].full_name
