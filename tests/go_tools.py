"""The Go toolchain for the tests and the chaos harness's --go worker: what
scripts/go_tools.sh finds or installs (Go, and the pinned protoc-gen-go,
protoc-gen-go-grpc and grpcurl), and `go build` of the atomlog-go CLI. A failure raises
with the tool's output."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
GO_DIR = REPO_ROOT / "clients" / "go"


def go_tools(timeout_s: float) -> dict[str, str]:
    """{"GO": the go binary, "GO_TOOLS_BIN": the pinned tools' directory}."""
    result = subprocess.run(["bash", str(REPO_ROOT / "scripts" / "go_tools.sh")], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=timeout_s)
    if result.returncode != 0:
        raise RuntimeError(f"scripts/go_tools.sh exited {result.returncode}:\n"
                           f"{result.stdout}\n{result.stderr}")
    return dict(line.split("=", 1) for line in result.stdout.split())


def build_cli(go: str, out: Path, timeout_s: float, env: dict | None = None) -> Path:
    """clients/go/cmd/atomlog-go built into `out`."""
    result = subprocess.run([go, "build", "-o", str(out), "./cmd/atomlog-go"], cwd=GO_DIR,
                            capture_output=True, text=True, timeout=timeout_s, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"go build ./cmd/atomlog-go exited {result.returncode}:\n"
                           f"{result.stdout}\n{result.stderr}")
    return out
