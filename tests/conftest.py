"""Shared fixtures. `cluster` is one real local cluster per test run: a real
ZooKeeper and every service as its own process on loopback, started and stopped
through the `atomlog` CLI exactly as a user would."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from kazoo.client import KazooClient

import services  # noqa: F401 — first, before any test module imports grpc: fork handlers off

REPO_ROOT = Path(__file__).resolve().parent.parent
# Short sessions so a killed server disappears quickly; ZooKeeper here allows >= 1 s.
SESSION_TIMEOUT_MS = 3_000
# Small TC log segments and frequent snapshots, so the tests exercise snapshot loads and
# log trimming with a few hundred transactions.
TC_SNAPSHOT_EVERY_RECORDS = 200
CLUSTER_SETTINGS = ("--set", f"zookeeper.session_timeout_ms={SESSION_TIMEOUT_MS}",
                    # One copy (the product default replicates): the shared cluster stays fast;
                    # replication has its own tests and the chaos harness's --replication.
                    "--set", "topics.default_replication_factor=1",
                    "--set", "coordinator.log_segment_bytes=65536",
                    # No background scrubbing (ScrubPartition still answers): a pass
                    # would race the tests that damage a copy and read it. The scrubber
                    # runs in tests/test_scrub.py's cluster and in the chaos harness.
                    "--set", "partition.scrub_bytes_per_s=0",
                    "--set", f"coordinator.snapshot_every_records={TC_SNAPSHOT_EVERY_RECORDS}")


# scripts/test.sh runs the suite on pytest-xdist workers. Each module runs whole on one
# worker, so its module-scoped clusters start once; the modules below share one group
# because they share a session fixture that must exist once per run: the SparkSession
# (one JVM per run) and the TLS + ACL cluster. (A scheduler of our own: xdist 3.8's
# `--dist loadgroup` marks do not take with pytest 9, whose node ids it cannot rewrite.)
# The Go client's module and the native prototype's build the same Go modules (grpc-go,
# arrow-go): one after the other, the second finds them in Go's build cache; on two
# workers at once, a fresh machine compiled them twice side by side (the prototype's
# build took 123 s of a CI run, 57 s alone).
SHARED_GROUPS = {"test_spark": "spark-acl", "test_acl_spark": "spark-acl",
                 "test_acl": "spark-acl", "test_acl_go": "spark-acl",
                 "test_go_client": "go-builds", "test_native_core_bench": "go-builds"}


def module_group(nodeid: str) -> str:
    """The work unit of a test: its module's name, or the group its module shares."""
    module = nodeid.split("::", 1)[0].rsplit("/", 1)[-1].removesuffix(".py")
    return SHARED_GROUPS.get(module, module)


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, when it is installed
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ModuleGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return module_group(nodeid)

    return ModuleGroups(config, log)


def atomlog(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run the CLI as a separate process, as a user would."""
    result = subprocess.run([sys.executable, "-m", "services", *args], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"atomlog {' '.join(args)} exited {result.returncode}\n"
                             f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}")
    return result


def wait_until(predicate, timeout_s: float, what: str) -> float:
    """Poll predicate every 50 ms; return the seconds it took, or fail after timeout_s."""
    began = time.monotonic()
    while not predicate():
        if time.monotonic() - began > timeout_s:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)
    return time.monotonic() - began


def metric_sum(address: str, line_start: str | tuple[str, ...]) -> float:
    """The sum of a server's /metrics samples whose line starts with `line_start` (a
    metric name, with labels up to where they should match; or a tuple of those)."""
    import urllib.request

    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(line_start))


def create_online(client, name: str, partitions: int, **options) -> str:
    """Create a topic through the SDK and wait until every partition serves: its owner
    opens it after CreateTopic answers, and until then requests get the retriable
    PARTITION_LOADING, which raw-RPC tests would otherwise see."""
    from atomlog.v1.partition_pb2 import PARTITION_STATE_ONLINE
    from spark_client import errors

    client.create_topic(name, partitions=partitions, **options)

    def online() -> bool:
        try:
            return all(client.describe_partition(name, p).state == PARTITION_STATE_ONLINE
                       for p in range(partitions))
        except errors.AtomlogClientError:  # the owner has not seen the assignment yet
            return False

    wait_until(online, 30, f"topic {name} to come online")
    return name


@dataclass
class Cluster:
    data_dir: Path
    combined: bool = False  # one process hosting every role (`atomlog up --combined`)

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return atomlog(*args, "--data-dir", str(self.data_dir), check=check)

    @property
    def info(self) -> dict:
        return json.loads((self.data_dir / "cluster.json").read_text())

    def process(self, name: str) -> dict:
        return next(p for p in self.info["processes"] if p["name"] == name)

    def services(self) -> list[dict]:
        return [p for p in self.info["processes"] if p["role"] != "zookeeper"]

    def status(self) -> dict:
        return json.loads(self.run("status", "--output", "json", check=False).stdout)

    def up(self) -> dict:
        shape = ("--combined",) if self.combined else ()
        return json.loads(self.run("up", "--output", "json", *shape, *CLUSTER_SETTINGS).stdout)

    def zookeeper(self) -> KazooClient:
        info = self.info
        client = KazooClient(hosts=info["zookeeper"] + info["chroot"])
        client.start(timeout=10)
        return client


def _running(cluster: Cluster):
    try:
        report = cluster.up()
        assert set(report["started"]) == {p["name"] for p in report["processes"]}
        yield cluster
    finally:
        if (cluster.data_dir / "cluster.json").exists():
            cluster.run("down", check=False)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory) -> Cluster:
    yield from _running(Cluster(tmp_path_factory.mktemp("atomlog-cluster")))


@pytest.fixture(scope="session")
def combined(tmp_path_factory) -> Cluster:
    """The combined server (every role in one process, node-0) with its own ZooKeeper."""
    yield from _running(Cluster(tmp_path_factory.mktemp("atomlog-combined"), combined=True))


@pytest.fixture(scope="session")
def spark():
    """One local SparkSession (`local[2,4]`, so a failed task is retried) for every test
    that runs Spark in this process (test_acl_spark, test_spark): its JVM starts and its
    Python workers warm up once per run, not once per module."""
    pytest.importorskip("pyspark")
    from spark_client.spark import local_session

    session = local_session("atomlog-tests", **{
        # Small Arrow batches, so a task sends records before a later row fails it
        # (test_spark); the other modules' checks do not depend on the batch size.
        "spark.sql.execution.arrow.maxRecordsPerBatch": "50"})
    yield session
    session.stop()


# Static bearer tokens of the secured cluster (auth.static_tokens_file), for test_acl_go.
ACL_TOKENS = {"bob": "bob-go-0123456789abcdef", "dave": "dave-go-0123456789abcdef"}


@pytest.fixture(scope="session")
def acl_secured(tmp_path_factory) -> Cluster:
    """One `atomlog up --tls` cluster shared by test_acl, test_acl_go and test_acl_spark
    (started once, not once per module): mTLS, auth.authorizer=acl (atomlog-admin a super
    user), ZooKeeper digest; one partition server, one coordinator, one id allocator as
    separate processes, so every internal call crosses gRPC as a service principal.
    auth.mode=mtls_or_token with ACL_TOKENS: a call without a token is authenticated by its
    certificate exactly as with auth.mode=mtls. Each module creates its own topics and
    removes the ACL entries it adds."""
    where = tmp_path_factory.mktemp("atomlog-acl")
    tokens = where / "tokens"
    tokens.write_text("".join(f"{name} {token}\n" for name, token in ACL_TOKENS.items()))
    cluster = Cluster(where / "cluster")
    try:
        report = json.loads(cluster.run(
            "up", "--tls", "--output", "json", "--partition-servers", "1", "--coordinators",
            "1", "--id-allocators", "1", "--set", "auth.mode=mtls_or_token",
            "--set", f"auth.static_tokens_file={tokens}",
            "--set", f"zookeeper.session_timeout_ms={SESSION_TIMEOUT_MS}").stdout)
        assert report["tls"]["authorizer"] == "acl"
        yield cluster
    finally:
        if (cluster.data_dir / "cluster.json").exists():
            cluster.run("down", check=False)


SERVER_SHAPES = ("cluster", "combined")  # parametrize a module's servers over both
# Transaction paths of the SDK: one-call (the default: kept by the client, one CommitTxn)
# and streaming (NewTxn, Produce, EndTxn; Client(one_call_max_bytes=0)).
TXN_PATHS = {"one-call": 1 << 20, "streaming": 0}
SHAPES_AND_PATHS = [(shape, path) for shape in SERVER_SHAPES for path in TXN_PATHS]
