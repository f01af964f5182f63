"""The Dockerfile, without a container engine: the files its build stage copies build the
native core (its own build_native.sh command, with this machine's cargo instead of the
Debian packages it installs) and the wheel (its own `pip wheel` command, the native core
in it), its own `RUN` line installs that wheel into a fresh
virtualenv, and its ENTRYPOINT, with the arguments, settings file and environment the
Kubernetes dev overlay gives a partition server, starts a server against a real
ZooKeeper that answers SERVING on the gRPC health service, serves /metrics, and stops
cleanly on SIGTERM within the pod's grace period.

Differences from `docker build`, each for time on a 2-core machine: the wheel is built
with --no-build-isolation (the project's setuptools instead of a fresh one: the same
files go in), and pip may use its cache (PIP_NO_CACHE_DIR is dropped)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import tomllib
import urllib.request
import zipfile
from fnmatch import fnmatch
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services import __version__
from services.launcher import free_port
from tests.conftest import REPO_ROOT
from tests.test_deploy_kubernetes import (atomlog_workloads, container, mounted_file, pod_env)

DOCKERFILE = REPO_ROOT / "Dockerfile"


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n", " ", "\n".join(line for line in text.splitlines()
                                            if not line.lstrip().startswith("#")))
    return [(m.group(1).upper(), m.group(2).strip())
            for m in re.finditer(r"^\s*(\w+)\s+(.*)$", joined, re.M)]


def stages() -> list[list[tuple[str, str]]]:
    found: list[list[tuple[str, str]]] = []
    for name, args in instructions(DOCKERFILE.read_text()):
        if name == "FROM":
            found.append([])
        if found:
            found[-1].append((name, args))
    return found


def env_of(stage) -> dict[str, str]:
    env: dict[str, str] = {}
    for name, args in stage:
        if name == "ENV":
            for key, value in re.findall(r"(\w+)=(\S+)", args):
                env[key] = value
    return env


def test_the_dockerfile_is_multi_stage_pinned_and_unprivileged():
    text = DOCKERFILE.read_text()
    base = re.search(r"^ARG PYTHON_IMAGE=(\S+)$", text, re.M).group(1)
    # An exact Python release (or a digest), never a floating tag such as 3.11-slim.
    match = re.fullmatch(r"python:(\d+)\.(\d+)\.(\d+)-slim-\w+(@sha256:[0-9a-f]{64})?", base)
    assert match, base
    requires = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert (int(match.group(1)), int(match.group(2))) >= tuple(
        int(x) for x in requires.removeprefix(">=").split("."))
    build, runtime = stages()
    assert build[0] == ("FROM", "${PYTHON_IMAGE} AS build") and runtime[0] == ("FROM", "${PYTHON_IMAGE}")
    user = [args for name, args in runtime if name == "USER"]
    assert user == ["10001:10001"], "numeric, so runAsNonRoot can check it"
    pod = atomlog_workloads("production")["partition-server"]["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsUser"] == 10001
    copied = [args for name, args in runtime if name == "COPY"]
    assert copied == ["--from=build /opt/atomlog /opt/atomlog"], "only the virtualenv"
    ports = {int(p) for name, args in runtime if name == "EXPOSE" for p in args.split()}
    assert ports == {p["containerPort"] for p in container(
        atomlog_workloads("production")["partition-server"])["ports"]}
    assert "pyspark" not in text.lower().replace("no spark", "")


def test_the_wheel_carries_the_native_core(built):
    with zipfile.ZipFile(built["wheel"]) as archive:
        names = archive.namelist()
    assert "partition_server/_native.abi3.so" in names
    assert not any("/rust/" in name for name in names), "the crate's sources stay out"
    # A platform wheel (setup.py): pip installs it only where the module loads.
    platform = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    assert built["wheel"].name == f"atomlog-{__version__}-cp311-abi3-{platform}.whl"


def test_the_wheel_needs_no_spark(built):
    wheel = built["wheel"]
    with zipfile.ZipFile(wheel) as archive:
        metadata = archive.read(next(n for n in archive.namelist()
                                     if n.endswith(".dist-info/METADATA"))).decode()
    requires = re.findall(r"^Requires-Dist: (.+)$", metadata, re.M)
    core = [r for r in requires if "extra ==" not in r]
    assert core and not any(r.lower().startswith(("pyspark", "confluent-kafka", "pytest"))
                            for r in core), core
    assert any(r.startswith("pyspark") and 'extra == "spark"' in r for r in requires)
    python = built["venv"] / "bin" / "python"
    probe = subprocess.run([str(python), "-c",
                            "import importlib.util, json, services, coordinator, partition_server;"
                            "print(json.dumps([services.__file__,"
                            " importlib.util.find_spec('pyspark') is not None]))"],
                           capture_output=True, text=True, cwd=built["venv"], check=True)
    location, has_spark = json.loads(probe.stdout)
    assert location.startswith(str(built["venv"])), "runs from the installed wheel"
    assert has_spark is False
    assert not (built["venv"] / "bin" / "pip").exists(), "no pip in the runtime virtualenv"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The wheel and the virtualenv, made by the Dockerfile's own commands."""
    root = tmp_path_factory.mktemp("image")
    build, runtime = stages()
    context = root / "context"
    context.mkdir()
    ignored = [line.strip() for line in (REPO_ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]

    def ignore(directory, names):
        relative = Path(directory).relative_to(REPO_ROOT)
        return [n for n in names if any(fnmatch(str(relative / n), pattern.removeprefix("**/"))
                                        or fnmatch(n, pattern.removeprefix("**/"))
                                        for pattern in ignored)]

    for name, args in build:
        if name != "COPY":
            continue
        *sources, target = args.split()
        for source in sources:
            path = REPO_ROOT / source
            assert path.exists(), f"COPY {source}: missing"
            destination = context / (path.name if target in ("./", ".") else target)
            destination.parent.mkdir(parents=True, exist_ok=True)
            if path.is_dir():
                shutil.copytree(path, destination, ignore=ignore)
            else:
                shutil.copy2(path, destination)
    runs = [args for name, args in build if name == "RUN"]
    assert len(runs) == 4, runs
    # Debian's cargo and rustc (not run here: this machine has a cargo), then the native
    # core built by the image's own command, with this machine's cargo, into the context.
    # Its build directory is the one scripts/build_native.sh keeps for this user (which
    # the suite's set-up filled): the crates it depends on are not compiled again (a
    # fresh directory cost this test 40-60 s of the suite's time); the crate itself is,
    # from the context's copy.
    assert "apt-get install -y --no-install-recommends cargo rustc" in runs[0], runs[0]
    shared = os.environ.get("ATOMLOG_NATIVE_TARGET") or str(Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "atomlog" / "native-target")
    native = runs[1].replace("/tmp/native-target", shared)
    assert native.endswith("bash scripts/build_native.sh"), native
    result = subprocess.run(["bash", "-c", native], cwd=context, capture_output=True,
                            text=True, timeout=600,
                            env={**os.environ, "PATH": f"{Path(sys.executable).parent}:"
                                 f"{os.environ['PATH']}"})
    assert result.returncode == 0, result.stdout + result.stderr
    runs = runs[2:]
    virtual_env = env_of(build)["VIRTUAL_ENV"]
    assert env_of(runtime)["VIRTUAL_ENV"] == virtual_env
    wheels, venv = root / "wheels", root / "venv"
    env = {**os.environ, **{k: v for k, v in env_of(build).items() if k != "PIP_NO_CACHE_DIR"},
           "VIRTUAL_ENV": str(venv), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    wheel_command = runs[0].replace("/wheels", str(wheels))
    assert wheel_command.startswith("python -m pip wheel --no-deps ")
    subprocess.run(["bash", "-c", wheel_command.replace(" --no-deps ", " --no-deps --no-build-isolation -q ")],
                   cwd=context, env=env, check=True, capture_output=True, timeout=120)
    install = runs[1].replace("/wheels", str(wheels))
    result = subprocess.run(["bash", "-c", install + " -q"], cwd=context, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    wheel = next(wheels.glob("atomlog-*.whl"))
    return {"wheel": wheel, "venv": venv, "virtual_env": virtual_env, "runtime": runtime}


def test_the_entrypoint_starts_a_server_as_kubernetes_runs_the_image(built, cluster, tmp_path):
    runtime, virtual_env, venv = built["runtime"], built["virtual_env"], built["venv"]
    entrypoint = json.loads(next(args for name, args in runtime if name == "ENTRYPOINT"))
    cmd = json.loads(next(args for name, args in runtime if name == "CMD"))
    assert entrypoint[0].startswith(virtual_env + "/bin/") and cmd == ["partition-server"]
    workload = atomlog_workloads("dev")["partition-server"]
    args = container(workload)["args"]  # Kubernetes args replace CMD
    settings = tmp_path / "partition-server.toml"
    settings.write_text(mounted_file("dev", workload, args[2]))
    command = [entrypoint[0].replace(virtual_env, str(venv)), *entrypoint[1:],
               *[a.replace(args[2], str(settings)) for a in args]]
    grpc_port, metrics_port = free_port(), free_port()
    env = {k: v.replace(virtual_env, str(venv)) for k, v in env_of(runtime).items()}
    env.update({k: v for k, v in pod_env("dev", workload).items()
                if k in ("ATOMLOG_SERVER_NAME",)})
    env.update({
        # What differs from a pod: loopback ports, this test's ZooKeeper (own chroot), a
        # temporary volume, and an advertised host that resolves here.
        "ATOMLOG_SERVER_LISTEN": f"127.0.0.1:{grpc_port}",
        "ATOMLOG_SERVER_METRICS_LISTEN": f"127.0.0.1:{metrics_port}",
        "ATOMLOG_SERVER_ADVERTISED_HOST": "127.0.0.1",
        "ATOMLOG_ZOOKEEPER_HOSTS": cluster.info["zookeeper"],
        "ATOMLOG_ZOOKEEPER_CHROOT": f"/image-test-{os.getpid()}",
        "ATOMLOG_SERVER_DATA_DIR": str(tmp_path / "data"),
        "HOME": str(tmp_path),
    })
    (tmp_path / "data").mkdir()
    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        server = subprocess.Popen(command, env=env, cwd=tmp_path, stdout=out,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 45
        status = ""
        while status != "SERVING":
            assert server.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, f"not SERVING: {status}\n{log.read_text()[-4000:]}"
            try:
                with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
                    reply = health_pb2_grpc.HealthStub(channel).Check(
                        health_pb2.HealthCheckRequest(service=""), timeout=1)
                status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.RpcError:
                time.sleep(0.2)
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as page:
            metrics = page.read().decode()
        assert re.search(r"^atomlog_serving 1\.0$", metrics, re.M)
        info = [line for line in metrics.splitlines() if line.startswith("atomlog_build_info{")]
        assert len(info) == 1 and 'name="atomlog-partition-server-0"' in info[0], info
        assert 'core="native"' in info[0], info  # the wheel carries the native core
        started = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
        assert any(e.get("msg") == "serving" for e in started), log.read_text()[-2000:]
        # SIGTERM (after the preStop sleep): drain and exit 0 within the rest of the grace.
        spec = workload["spec"]["template"]["spec"]
        budget = (spec["terminationGracePeriodSeconds"]
                  - container(workload)["lifecycle"]["preStop"]["sleep"]["seconds"])
        began = time.monotonic()
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=budget) == 0, log.read_text()[-3000:]
        assert time.monotonic() - began < budget
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def test_the_build_command_is_documented():
    docs = (REPO_ROOT / "docs" / "operations.md").read_text()
    assert "docker build -t atomlog:0.1.0 ." in docs
    assert shlex.split("docker build -t atomlog:0.1.0 .")[-1] == "."
