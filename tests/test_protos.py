"""API contracts: buf lint (STANDARD) is clean and generated code matches the protos."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO_ROOT


def test_buf_lint_standard_rules_pass():
    buf = shutil.which("buf") or str(Path(sys.executable).parent / "buf")
    result = subprocess.run([buf, "lint"], cwd=REPO_ROOT / "protos", capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_generated_code_is_in_sync_with_protos():
    result = subprocess.run([sys.executable, "-m", "services.protogen", "--check"],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_generated_package_imports_cleanly():
    from atomlog.v1 import (coordinator_pb2_grpc, id_allocator_pb2_grpc, metadata_pb2_grpc,
                            partition_pb2_grpc)

    assert metadata_pb2_grpc.MetadataServiceStub
    assert partition_pb2_grpc.PartitionServiceStub
    assert coordinator_pb2_grpc.CoordinatorServiceStub
    assert id_allocator_pb2_grpc.IdAllocatorServiceStub
