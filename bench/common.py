"""What every benchmark prints about the machine it ran on."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import grpc


def machine(load: float, *, with_java: bool = False) -> str:
    """CPUs and model, Python and grpcio versions (and Java's), and the load average."""
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    java = ""
    if with_java:
        lines = subprocess.run(["java", "-version"], capture_output=True,
                               text=True).stderr.splitlines()
        java = f", {lines[0] if lines else 'java ?'}"
    return (f"{os.cpu_count()} CPUs ({cpu}), Python {platform.python_version()}, "
            f"grpcio {grpc.__version__}{java}; load average {load:.1f} when it started")
