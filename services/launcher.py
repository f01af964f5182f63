"""The local cluster: ZooKeeper and every atomlog service as separate OS processes
on loopback, described by DIR/cluster.json.

`up` starts only what is not running (so it also restarts a killed process with the
same name, ports and data directory), then waits until every health check answers
SERVING. `status` probes each process. `down` stops services with SIGTERM (they drain
and unregister), then ZooKeeper; stragglers get SIGKILL after the timeout.

`up(tls=True)`, when it creates the cluster, makes a local CA and a certificate per
process under DIR/tls (services/tls.py LocalCa) and runs every process with mutual TLS
and auth.mode=mtls (each process's certificate has its name as CN, and every process
is a service principal; the client certificate's CN is "atomlog-admin"); cluster.json's
"tls" names the client's files, which status and the CLI use. Such a cluster also runs
auth.authorizer=acl with "atomlog-admin" its super user, and its servers hold the
ZooKeeper digest credential of DIR/tls/zookeeper.digest (zookeeper.digest_file), so only
they (and the CLI, which reads the file) can change its znodes.

`up(prometheus=True)` also runs a Prometheus server (the `prometheus` binary of the
Debian package) that scrapes every process through DIR/prometheus-targets.json and
evaluates deploy/prometheus/rules; it is recorded in cluster.json beside the processes
(key "prometheus", not in "processes"), restarted by later `up`s and stopped by `down`.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services import localzk
from services.config import check_cluster_settings, role_name, role_settings
from services.grpcutil import CAUGHT_UP_SERVICE
from services.tls import channel

CLUSTER_FILE = "cluster.json"
TLS_DIR = "tls"
CLIENT_PRINCIPAL = "atomlog-admin"  # `up --tls`: the CN of the client certificate  # `up --tls`: the local CA, each process's certificate, the client's
PROMETHEUS_TARGETS_FILE = "prometheus-targets.json"
ROLE_PREFIX = {"id_allocator": "ida", "coordinator": "coord", "partition_server": "ps",
               "combined": "node"}
START_ORDER = ("zookeeper", "id_allocator", "coordinator", "partition_server", "combined")
SERVES_PARTITIONS = ("partition_server", "combined")
# The local Prometheus: short intervals, so a rate() has points seconds after `up`.
PROMETHEUS_INTERVAL = "2s"
PROMETHEUS_RETENTION = "2d"
RULES_DIR = Path(__file__).resolve().parent.parent / "deploy" / "prometheus" / "rules"


class LaunchError(RuntimeError):
    pass


@dataclass
class ProcessEntry:
    name: str
    role: str
    grpc_address: str  # for zookeeper: its client address
    metrics_address: str = ""
    pid: int = 0
    data_dir: str = ""
    log_file: str = ""
    # Optional, for fault-injection runs (tests/chaos): the address this process
    # advertises (a proxy in front of grpc_address), the ZooKeeper connect string it
    # uses instead of the cluster's, and extra environment variables.
    advertised_address: str = ""
    zookeeper: str = ""
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class ClusterFile:
    data_dir: str
    zookeeper: str
    chroot: str = "/atomlog"
    settings: dict[str, str] = field(default_factory=dict)
    processes: list[ProcessEntry] = field(default_factory=list)
    # `atomlog up --prometheus`: grpc_address holds its HTTP address.
    prometheus: ProcessEntry | None = None
    # `atomlog up --tls`: what clients need (ca_file, and cert_file/key_file of the
    # cluster's client certificate), client_auth, and the directory of every process's
    # certificate (DIR/tls/<name>.crt, .key). Empty: plaintext.
    tls: dict[str, str] = field(default_factory=dict)

    def client_tls(self):
        """The SDK's TlsConfig for this cluster, or None when it is plaintext."""
        if not self.tls:
            return None
        from services.tls import TlsConfig

        return TlsConfig(self.tls["ca_file"], self.tls.get("cert_file", ""),
                         self.tls.get("key_file", ""))

    def channel_tls(self):
        from services.tls import ChannelTls

        config = self.client_tls()
        return ChannelTls(config) if config is not None else None

    @property
    def bootstrap(self) -> str:
        servers = [p for p in self.processes if p.role in SERVES_PARTITIONS]
        return servers[0].grpc_address if servers else ""

    @property
    def running_bootstrap(self) -> str:
        """The first partition-serving process that runs (the CLI's default address: with
        the first one down, every admin command failed SERVER_UNAVAILABLE, the runbooks'
        for an offline partition included); else `bootstrap`."""
        for process in self.processes:
            if process.role in SERVES_PARTITIONS and \
                    process_alive(process.pid, marker_of(process)):
                return process.grpc_address
        return self.bootstrap

    def to_json(self) -> dict:
        data = {"version": 1, "bootstrap": self.bootstrap, "zookeeper": self.zookeeper,
                "chroot": self.chroot, "data_dir": self.data_dir, "settings": self.settings,
                "processes": [asdict(p) for p in self.processes]}
        if self.prometheus is not None:
            data["prometheus"] = asdict(self.prometheus)
        if self.tls:
            data["tls"] = dict(self.tls)
        return data

    @classmethod
    def load(cls, data_dir: Path) -> "ClusterFile | None":
        path = data_dir / CLUSTER_FILE
        if not path.exists():
            return None
        data = json.loads(path.read_text())
        prometheus = data.get("prometheus")
        return cls(data["data_dir"], data["zookeeper"], data.get("chroot", "/atomlog"),
                   dict(data.get("settings", {})),
                   [ProcessEntry(**p) for p in data["processes"]],
                   ProcessEntry(**prometheus) if prometheus else None,
                   dict(data.get("tls", {})))

    def save(self, data_dir: Path) -> None:
        _write_atomically(data_dir / CLUSTER_FILE, json.dumps(self.to_json(), indent=2) + "\n")
        # Prometheus file-based discovery (deploy/prometheus/prometheus.yml reads it).
        targets = [{"targets": [p.metrics_address], "labels": {"job": "atomlog", "role": p.role,
                                                                "instance_name": p.name}}
                   for p in self.processes if p.metrics_address]
        _write_atomically(data_dir / PROMETHEUS_TARGETS_FILE, json.dumps(targets, indent=2) + "\n")


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


_HANDED_OUT: set[int] = set()  # ports this process gave out (not yet bound, maybe)
LOWEST_PORT = 10_000
# Ports any process on this machine gave out lately: a file per port, made with O_EXCL.
# Two processes drawing ports at once (the test suite's two workers, a benchmark beside
# a test run) could otherwise both draw a port neither has bound yet; the one whose
# server then failed to bind it could find the other's server there instead.
PORT_CLAIMS = Path(os.environ.get("TMPDIR", "/tmp")) / "atomlog-port-claims"
PORT_CLAIM_S = 600  # a claim older than this is stale: its server bound the port long ago
BIND_CONFLICT = ("Address already in use", "Failed to bind")  # in a start-up log: retry


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32_768, 60_999  # Linux's default


def free_port() -> int:
    """A loopback port nothing listens on, for a server to bind a little later.

    Taken below the kernel's ephemeral range when there is room, so that the outgoing
    connections made meanwhile (which get ephemeral ports) cannot take it first (a port
    from bind(0) is ephemeral: a ZooKeeper or gRPC client connecting before the server
    starts could be given it, and the server then fails with "Address already in use").
    Never the same port twice in one process, nor one another process on this machine
    was given in the last PORT_CLAIM_S seconds (`_claim`)."""
    low, _high = _ephemeral_range()
    if low - LOWEST_PORT >= 1_000:
        for _ in range(500):
            port = random.randrange(LOWEST_PORT, low)
            if port not in _HANDED_OUT and _bindable(port) and _claim(port):
                _HANDED_OUT.add(port)
                return port
    while True:  # no room below the ephemeral range: what the kernel offers
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in _HANDED_OUT and _claim(port):
            _HANDED_OUT.add(port)
            return port


def _claim(port: int, now: float | None = None) -> bool:
    """Claim `port` for this process among every process on the machine: False if another
    claimed it less than PORT_CLAIM_S ago. A directory that cannot be written claims
    nothing and refuses nothing (the bind checks stay)."""
    path = PORT_CLAIMS / str(port)
    now = time.time() if now is None else now
    try:
        PORT_CLAIMS.mkdir(mode=0o777, exist_ok=True)
        for _ in range(2):
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
                return True
            except FileExistsError:
                try:
                    if now - path.stat().st_mtime < PORT_CLAIM_S:
                        return False
                    path.unlink()  # stale: claimed again below
                except FileNotFoundError:
                    pass  # another process cleared it meanwhile: try again
        return False
    except OSError:
        return True


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


# The exit codes of children process_alive reaped, by pid (a negative one: the signal
# that ended it), for whoever asks why one ended (the chaos harness's "exited by itself").
REAPED: dict[int, int] = {}


def process_alive(pid: int, marker: str) -> bool:
    """True if pid runs and its command line contains marker (guards against pid reuse)."""
    if pid <= 0:
        return False
    try:
        reaped, status = os.waitpid(pid, os.WNOHANG)
        if reaped == pid:
            if len(REAPED) >= 1_000:
                REAPED.clear()
            REAPED[pid] = os.waitstatus_to_exitcode(status)
            return False  # our own child, just reaped
    except ChildProcessError:
        pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            fields = handle.read().rsplit(b")", 1)[1].split()
        if fields[0] in (b"Z", b"X"):
            return False
        if int(fields[1]) == os.getpid():
            # Our own child, not reaped: its pid cannot have been reused, and just after
            # the spawn its command line may not be readable yet (read in the middle of
            # its exec, it came back empty once, under load, and a live Prometheus was
            # reported as "exited during start-up").
            return True
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            cmdline = handle.read().replace(b"\0", b" ").decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
        return False
    return marker in cmdline


def marker_of(entry: ProcessEntry) -> str:
    if entry.role == "prometheus":
        return f"--storage.tsdb.path={entry.data_dir} "
    return f"QuorumPeerMain {entry.data_dir}" if entry.role == "zookeeper" else f"--name {entry.name} "


def plan(data_dir: Path, counts: dict[str, int], settings: dict[str, str],
         tls: bool = False) -> ClusterFile:
    """The existing cluster file, extended with any processes the counts add (and, for a
    TLS cluster, their certificates). Raises ConfigError (services/config.py) for a
    setting no role knows or one a role that knows it refuses, before anything is
    written or started: each process is given only the settings its role knows, so an
    unknown one would otherwise be dropped without a word (a benchmark's `--set
    partition.fsync=false` ran on the defaults, 2026-12-02)."""
    cluster = ClusterFile.load(data_dir)
    if settings:
        check_cluster_settings(settings, tls=tls or bool(cluster is not None and cluster.tls))
    if cluster is not None:
        shape = "combined" if any(p.role == "combined" for p in cluster.processes) else (
            "separate" if any(p.role in ROLE_PREFIX and p.role != "combined"
                              for p in cluster.processes) else "")
        asked = "combined" if counts.get("combined") else "separate"
        if shape and asked != shape and any(counts.values()):
            # (Before, `up` on a combined cluster added a partition server, coordinator
            # and id allocator beside it for good, and `up --combined` on a cluster of
            # separate roles added a combined server to it.)
            raise LaunchError(f"the cluster in {data_dir} is "
                              + ("a combined server: start it with `atomlog up --combined`"
                                 if shape == "combined" else
                                 "of separate processes: start it without --combined"))
    if cluster is not None and tls and not cluster.tls:
        raise LaunchError(f"the cluster in {data_dir} was created without --tls; TLS is "
                          "chosen when a cluster is created (`atomlog down`, then `up --tls` "
                          "in a new --data-dir)")
    if cluster is None:
        zk_port = free_port()
        cluster = ClusterFile(str(data_dir), f"127.0.0.1:{zk_port}")
        if tls:
            tls_dir = data_dir / TLS_DIR
            cluster.tls = {"ca_file": str(tls_dir / "ca.crt"),
                           "cert_file": str(tls_dir / "client.crt"),
                           "key_file": str(tls_dir / "client.key"),
                           "client_auth": "require", "auth": "mtls", "dir": str(tls_dir),
                           # ACLs on (the client certificate's principal a super user) and
                           # ZooKeeper's znodes writable only with the servers' digest.
                           "authorizer": "acl",
                           "zookeeper_digest_file": str(tls_dir / "zookeeper.digest")}
        cluster.processes.append(ProcessEntry(
            "zookeeper", "zookeeper", f"127.0.0.1:{zk_port}",
            data_dir=str(data_dir / "zookeeper"), log_file=str(data_dir / "logs" / "zookeeper.log")))
    cluster.settings.update(settings)
    for role in START_ORDER[1:]:
        existing = [p for p in cluster.processes if p.role == role]
        for index in range(len(existing), counts.get(role, 0)):
            name = f"{ROLE_PREFIX[role]}-{index}"
            cluster.processes.append(ProcessEntry(
                name, role, f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}",
                data_dir=str(data_dir / name), log_file=str(data_dir / "logs" / f"{name}.log")))
    if cluster.tls:
        issue_certificates(cluster)
    return cluster


def issue_certificates(cluster: ClusterFile) -> list[str]:
    """Make the local CA of a TLS cluster and the certificates it lacks: one per process
    (SANs 127.0.0.1, localhost and its name; for servers and, as servers call each other,
    clients) and the client certificate of the CLI and tests. Returns the names issued."""
    from services.tls import LocalCa

    tls_dir = Path(cluster.tls["dir"])
    # A certificate's CN holds at most 64 characters: long data directories are cut.
    ca = LocalCa(tls_dir, f"atomlog local CA ({cluster.data_dir})"[:64])
    issued = []
    for entry in cluster.processes:
        if entry.role == "zookeeper":
            continue
        cert, key = tls_dir / f"{entry.name}.crt", tls_dir / f"{entry.name}.key"
        if not (cert.exists() and key.exists()):
            ca.issue(cert, key, entry.name, ["127.0.0.1", "localhost", entry.name])
            issued.append(entry.name)
    if not (Path(cluster.tls["cert_file"]).exists() and Path(cluster.tls["key_file"]).exists()):
        # The principal of the CLI and tests under auth.mode=mtls (clusters made before
        # authentication have an "atomlog-client" certificate and no "auth").
        ca.issue(Path(cluster.tls["cert_file"]), Path(cluster.tls["key_file"]),
                 CLIENT_PRINCIPAL if cluster.tls.get("auth") else "atomlog-client", server=False)
        issued.append("client")
    digest = cluster.tls.get("zookeeper_digest_file")
    if digest and not Path(digest).exists():
        import secrets

        Path(digest).touch(mode=0o600)
        Path(digest).write_text(f"atomlog:{secrets.token_urlsafe(24)}\n")
        issued.append("zookeeper digest")
    return issued


def tls_settings(cluster: ClusterFile, entry: ProcessEntry) -> dict[str, str]:
    """The tls.* settings of one process of a TLS cluster (none for a plaintext one), and
    its auth.* ones: auth.mode=mtls, every process of the cluster a service principal (the
    CN of its certificate is its name)."""
    if not cluster.tls:
        return {}
    tls_dir = Path(cluster.tls["dir"])
    settings = {"tls.enabled": "true", "tls.cert_file": str(tls_dir / f"{entry.name}.crt"),
                "tls.key_file": str(tls_dir / f"{entry.name}.key"),
                "tls.ca_file": cluster.tls["ca_file"],
                "tls.client_auth": cluster.tls.get("client_auth", "require")}
    if cluster.tls.get("auth"):
        settings["auth.mode"] = cluster.tls["auth"]
        settings["auth.service_principals"] = ",".join(
            p.name for p in cluster.processes if p.role != "zookeeper")
    if cluster.tls.get("authorizer"):
        settings["auth.authorizer"] = cluster.tls["authorizer"]
        settings["auth.super_users"] = CLIENT_PRINCIPAL
    if cluster.tls.get("zookeeper_digest_file"):
        settings["zookeeper.digest_file"] = cluster.tls["zookeeper_digest_file"]
    return settings


def service_command(cluster: ClusterFile, entry: ProcessEntry) -> list[str]:
    command = [sys.executable, "-m", "services", "serve", entry.role.replace("_", "-"),
               "--name", entry.name, "--listen", entry.grpc_address,
               "--metrics-listen", entry.metrics_address, "--data-dir", entry.data_dir,
               "--zookeeper", entry.zookeeper or cluster.zookeeper]
    if entry.advertised_address:
        host, port = entry.advertised_address.rsplit(":", 1)
        command += ["--set", f"server.advertised_host={host}", "--set", f"server.advertised_port={port}"]
    # --set settings come last: they may change a TLS default (e.g. tls.metrics=true).
    settings = {**tls_settings(cluster, entry), **role_settings(cluster.settings, entry.role)}
    if entry.role in ("coordinator", "combined"):
        # __txn_log waits for every partition server started here (it spreads over them).
        settings.setdefault("coordinator.expected_partition_servers", str(sum(
            1 for p in cluster.processes if p.role in SERVES_PARTITIONS)))
    for key, value in sorted(settings.items()):
        command += ["--set", f"{key}={value}"]
    return command


def spawn(command: list[str], log_file: str, cwd: str | None = None,
          extra_env: dict[str, str] | None = None) -> int:
    Path(log_file).parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **(extra_env or {})}
    repo_root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = repo_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    with open(log_file, "ab") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True,
                                   cwd=cwd, env=env)
    return process.pid


def start_service(cluster: ClusterFile, entry: ProcessEntry) -> int:
    """Spawn one service process as `up` does (its data directory made); returns its pid.
    The caller saves the cluster file."""
    Path(entry.data_dir).mkdir(parents=True, exist_ok=True)
    return spawn(service_command(cluster, entry), entry.log_file, extra_env=entry.env)


def start_zookeeper(entry: ProcessEntry) -> int:
    """Spawn the local ZooKeeper server of a cluster (its configuration prepared)."""
    port = int(entry.grpc_address.rsplit(":", 1)[1])
    command = localzk.prepare(Path(entry.data_dir), port)
    return spawn(command, entry.log_file, cwd=entry.data_dir)


def health_status(address: str, timeout_s: float = 1.0, tls=None, service: str = "") -> str:
    """SERVING, NOT_SERVING, ... or UNREACHABLE, for the health `service` ("": the
    server's). `tls`: a services.tls.ChannelTls."""
    try:
        with channel(address, tls) as channel_:
            reply = health_pb2_grpc.HealthStub(channel_).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    except grpc.RpcError:
        return "UNREACHABLE"


def offline_partitions(address: str, timeout_s: float = 2.0, tls=None,
                       token=None) -> list[str]:
    """Partitions of a partition server that refuse to serve (DATA_LOSS), with where.
    `token`: a services.auth.TokenSource (clusters with auth.mode=token)."""
    from atomlog.v1 import partition_pb2, partition_pb2_grpc
    from services.auth import bearer_channel

    try:
        with channel(address, tls) as channel_:
            reply = partition_pb2_grpc.PartitionServiceStub(
                bearer_channel(channel_, token)).ListPartitions(
                partition_pb2.ListPartitionsRequest(include_internal=True), timeout=timeout_s)
    except grpc.RpcError as error:
        hint = ("; give a token (--token-file, ATOMLOG_TOKEN_FILE)"
                if error.code() == grpc.StatusCode.UNAUTHENTICATED else "")
        return [f"(cannot list partitions: {error.code().name}{hint})"]
    return [f"{p.topic_partition.topic}-{p.topic_partition.partition} "
            f"({p.data_loss.file} at offset {p.data_loss.offset})"
            for p in reply.partitions if p.state == partition_pb2.PARTITION_STATE_DATA_LOSS]


MAX_REBINDS = 3  # per up(): restarts of a process whose port was taken meanwhile
# per up(): restarts of a process that ended its start on a ZooKeeper error, as a
# supervisor (Kubernetes) would start it again (a blip: chaos seed 2800, and a CI run
# whose ps-0 missed its ZooKeeper pings while it loaded its partitions)
MAX_ZOOKEEPER_RESTARTS = 3
ZOOKEEPER_FAILED_AT_START = "cannot start: ZooKeeper failed during start-up"


def _file_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _bind_conflict(log_file: str, since: int | None) -> bool:
    """Did the process whose log this is fail to bind its port (log written since `since`)?"""
    return _logged_since(log_file, since, BIND_CONFLICT)


def _zookeeper_blip(log_file: str, since: int | None) -> bool:
    """Did the process end its start-up on a ZooKeeper error (a lost connection, an
    expired session: services/runtime.py) in its log written since `since`?"""
    return _logged_since(log_file, since, (ZOOKEEPER_FAILED_AT_START,))


def _logged_since(log_file: str, since: int | None, markers) -> bool:
    if since is None:
        return False
    try:
        with open(log_file, "rb") as handle:
            handle.seek(since)
            text = handle.read(1 << 20).decode(errors="replace")
    except OSError:
        return False
    return any(marker in text for marker in markers)


def _zookeeper_movable(cluster: ClusterFile) -> bool:
    """May the cluster's ZooKeeper move to another port? Not while a service of it runs
    (it holds the old connect string), nor when a process reaches ZooKeeper at an address
    of its own (e.g. the chaos harness's proxy, routed to the planned port)."""
    return not any(p.zookeeper or process_alive(p.pid, marker_of(p))
                   for p in cluster.processes if p.role != "zookeeper")


def tail(path: str, lines: int = 15) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@dataclass
class UpReport:
    cluster: ClusterFile
    started: list[str]
    already_running: list[str]
    seconds: float


def up(data_dir: Path, counts: dict[str, int], settings: dict[str, str] | None = None,
       timeout_s: float = 90.0, progress: Callable[[str], None] = lambda _m: None,
       prometheus: bool = False, tls: bool = False) -> UpReport:
    """`tls`: a new cluster serves mutual TLS on every gRPC port, with a local CA and
    certificates under DIR/tls (an existing cluster keeps what it was created with)."""
    began = time.monotonic()
    data_dir = data_dir.resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    cluster = plan(data_dir, counts, settings or {}, tls)
    cluster.save(data_dir)
    client_tls = cluster.channel_tls()
    started, running = [], []

    services = [p for p in cluster.processes if p.role != "zookeeper"]
    rebinds = zookeeper_restarts = 0
    zk = next(p for p in cluster.processes if p.role == "zookeeper")
    zk_mark: int | None = None
    if process_alive(zk.pid, marker_of(zk)):
        running.append(zk.name)
    else:
        progress("starting zookeeper")
        zk_mark = _file_size(zk.log_file)
        zk.pid = start_zookeeper(zk)
        started.append(zk.name)
        cluster.save(data_dir)
    while not localzk.wait_serving(zk.grpc_address, max(0.0, began + timeout_s - time.monotonic()),
                                   lambda: process_alive(zk.pid, marker_of(zk))):
        if (rebinds < MAX_REBINDS and not process_alive(zk.pid, marker_of(zk))
                and _bind_conflict(zk.log_file, zk_mark) and _zookeeper_movable(cluster)):
            # Its port was taken between planning and binding (ZooKeeper exits then): a new
            # port, saved (cluster.zookeeper too) before the services that use it start.
            rebinds += 1
            old_address = zk.grpc_address
            zk.grpc_address = cluster.zookeeper = f"127.0.0.1:{free_port()}"
            progress(f"zookeeper could not bind {old_address}: restarting it on "
                     f"{zk.grpc_address}")
            zk_mark = _file_size(zk.log_file)
            zk.pid = start_zookeeper(zk)
            cluster.save(data_dir)
            continue
        raise LaunchError(f"zookeeper at {zk.grpc_address} did not start; log {zk.log_file}:\n"
                          + tail(zk.log_file))

    log_marks: dict[str, int] = {}  # where each started process's log began

    def start(entry: ProcessEntry) -> None:
        log_marks[entry.name] = _file_size(entry.log_file)
        entry.pid = start_service(cluster, entry)
        progress(f"started {entry.name} (pid {entry.pid})")

    for entry in services:
        if process_alive(entry.pid, marker_of(entry)):
            running.append(entry.name)
            continue
        start(entry)
        started.append(entry.name)
    cluster.save(data_dir)
    if settings and running:
        # (Before, `up --set` on a running cluster said nothing: the setting reached only
        # the processes started later, and the cluster ran on mixed settings.)
        progress(f"the settings {sorted(settings)} are recorded for processes started from "
                 f"now on; already running without them: {', '.join(sorted(running))} "
                 "(`atomlog down` and `up` to apply them everywhere)")

    deadline = began + timeout_s
    pending = {e.name: e for e in services}
    while pending:
        with ThreadPoolExecutor(max_workers=len(pending)) as pool:
            states = dict(zip(pending, pool.map(
                lambda e: health_status(e.grpc_address, tls=client_tls), pending.values())))
        for name, state in states.items():
            entry = pending[name]
            if state == "SERVING":
                del pending[name]
                progress(f"{name} SERVING at {entry.grpc_address}")
            elif not process_alive(entry.pid, marker_of(entry)):
                if rebinds < MAX_REBINDS and _bind_conflict(entry.log_file, log_marks.get(name)):
                    # Its port was taken between planning and binding (by another program):
                    # new ports, saved before the restart so status and clients see them.
                    rebinds += 1
                    old_address = entry.grpc_address
                    entry.grpc_address = f"127.0.0.1:{free_port()}"
                    entry.metrics_address = f"127.0.0.1:{free_port()}"
                    progress(f"{name} could not bind {old_address}: restarting it on "
                             f"{entry.grpc_address}")
                    start(entry)
                    cluster.save(data_dir)
                    continue
                if zookeeper_restarts < MAX_ZOOKEEPER_RESTARTS and _zookeeper_blip(
                        entry.log_file, log_marks.get(name)):
                    zookeeper_restarts += 1
                    progress(f"{name} ended its start-up on a ZooKeeper error: starting "
                             "it again")
                    start(entry)
                    cluster.save(data_dir)
                    continue
                raise LaunchError(f"{name} exited during start-up; log {entry.log_file}:\n"
                                  + tail(entry.log_file))
        if pending and time.monotonic() > deadline:
            raise LaunchError(f"not SERVING after {timeout_s:.0f} s: {', '.join(sorted(pending))}")
        if pending:
            time.sleep(0.1)
    if prometheus or cluster.prometheus is not None:
        (started if ensure_prometheus(cluster, data_dir, deadline, progress) else running).append(
            "prometheus")
    return UpReport(cluster, started, running, time.monotonic() - began)


def prometheus_config(data_dir: Path) -> dict:
    """The local Prometheus's configuration (JSON is YAML): the targets file `save`
    writes, and the rules of deploy/prometheus when this is a checkout that has them."""
    return {"global": {"scrape_interval": PROMETHEUS_INTERVAL,
                       "evaluation_interval": PROMETHEUS_INTERVAL},
            "rule_files": [str(p) for p in sorted(RULES_DIR.glob("*.yml"))],
            "scrape_configs": [{"job_name": "atomlog", "file_sd_configs": [{
                "files": [str(data_dir / PROMETHEUS_TARGETS_FILE)], "refresh_interval": "5s"}]}]}


def prometheus_ready(address: str, timeout_s: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(f"http://{address}/-/ready", timeout=timeout_s) as reply:
            return reply.status == 200
    except (urllib.error.URLError, OSError):
        return False


def ensure_prometheus(cluster: ClusterFile, data_dir: Path, deadline: float,
                      progress: Callable[[str], None] = lambda _m: None) -> bool:
    """Start the local Prometheus unless it runs; wait until it is ready. True if started."""
    entry = cluster.prometheus
    if entry is None:
        entry = cluster.prometheus = ProcessEntry(
            "prometheus", "prometheus", f"127.0.0.1:{free_port()}",
            data_dir=str(data_dir / "prometheus" / "data"),
            log_file=str(data_dir / "logs" / "prometheus.log"))
    started = False
    if not process_alive(entry.pid, marker_of(entry)):
        binary = shutil.which("prometheus")
        if binary is None:
            raise LaunchError("prometheus not found: install the Debian package `prometheus` "
                              "(scripts/bootstrap.sh does)")
        config = data_dir / "prometheus" / "prometheus.yml"
        Path(entry.data_dir).mkdir(parents=True, exist_ok=True)
        _write_atomically(config, json.dumps(prometheus_config(data_dir), indent=2) + "\n")
        entry.pid = spawn([binary, f"--config.file={config}",
                           f"--storage.tsdb.path={entry.data_dir}",
                           f"--storage.tsdb.retention.time={PROMETHEUS_RETENTION}",
                           f"--web.listen-address={entry.grpc_address}"], entry.log_file)
        cluster.save(data_dir)
        progress(f"started prometheus (pid {entry.pid})")
        started = True
    while not prometheus_ready(entry.grpc_address):
        if not process_alive(entry.pid, marker_of(entry)):
            raise LaunchError(f"prometheus exited during start-up; log {entry.log_file}:\n"
                              + tail(entry.log_file))
        if time.monotonic() > deadline:
            raise LaunchError(f"prometheus not ready at {entry.grpc_address}")
        time.sleep(0.1)
    progress(f"prometheus ready at http://{entry.grpc_address}")
    return started


@dataclass
class ProcessStatus:
    name: str
    role: str
    pid: int
    running: bool
    grpc_address: str
    metrics_address: str
    health: str
    log_file: str
    offline_partitions: list[str] = field(default_factory=list)  # DATA_LOSS: operator needed
    tc_partitions: list[int] = field(default_factory=list)  # leased (coordinators)
    # Serving partitions: whether it has caught up (health service atomlog.caught_up:
    # every replica here in its ISR, its own partitions open); None for other roles.
    caught_up: bool | None = None


@dataclass
class ClusterStatus:
    processes: list[ProcessStatus]
    # The cluster's TC partitions (fixed in ZooKeeper when it was created), as a serving
    # process answered; else as cluster.json sets them; 0 when neither says.
    tc_partitions: int


def status(data_dir: Path, token=None) -> ClusterStatus:
    """`token`: a services.auth.TokenSource for a cluster with auth.mode=token (health
    checks need none; listing partitions and TC leases do)."""
    cluster = ClusterFile.load(data_dir.resolve())
    if cluster is None:
        raise LaunchError(f"no cluster in {data_dir} (no {CLUSTER_FILE}); run `atomlog up`")

    client_tls = cluster.channel_tls()

    def probe(entry: ProcessEntry) -> ProcessStatus:
        alive = process_alive(entry.pid, marker_of(entry))
        if entry.role == "zookeeper":
            health = "SERVING" if alive and localzk.is_serving(entry.grpc_address) else (
                "NOT_SERVING" if alive else "DOWN")
        else:
            health = health_status(entry.grpc_address, tls=client_tls) if alive else "DOWN"
        partitions = entry.role in SERVES_PARTITIONS and health == "SERVING"
        offline = (offline_partitions(entry.grpc_address, tls=client_tls, token=token)
                   if partitions else [])
        caught_up = health_status(entry.grpc_address, tls=client_tls,
                                  service=CAUGHT_UP_SERVICE) == "SERVING" if partitions else None
        return ProcessStatus(entry.name, entry.role, entry.pid if alive else 0, alive,
                             entry.grpc_address, entry.metrics_address, health, entry.log_file,
                             offline, caught_up=caught_up)

    with ThreadPoolExecutor(max_workers=max(1, len(cluster.processes))) as pool:
        rows = list(pool.map(probe, cluster.processes))
    serving = [r for r in rows if r.role != "zookeeper" and r.health == "SERVING"]
    count, leases = (tc_leases(serving[0].grpc_address, tls=client_tls, token=token)
                     if serving else (0, {}))
    for row in rows:  # a combined server's coordinator has a name of its own
        coordinator = role_name(row.name, row.role, "coordinator")
        row.tc_partitions = sorted(k for k, owner in leases.items() if owner == coordinator)
    return ClusterStatus(rows, count or int(cluster.settings.get("cluster.tc_partitions") or 0))


def prometheus_status(data_dir: Path) -> dict | None:
    """The local Prometheus of `up --prometheus`: its URL, pid and health (None if the
    cluster has none)."""
    cluster = ClusterFile.load(data_dir.resolve())
    entry = cluster.prometheus if cluster else None
    if entry is None:
        return None
    alive = process_alive(entry.pid, marker_of(entry))
    health = ("SERVING" if prometheus_ready(entry.grpc_address) else "NOT_SERVING") if alive else "DOWN"
    return {"url": f"http://{entry.grpc_address}", "pid": entry.pid if alive else 0,
            "health": health, "log_file": entry.log_file}


def tc_leases(address: str, timeout_s: float = 2.0, tls=None, token=None
              ) -> tuple[int, dict[int, str]]:
    """The cluster's TC partition count, and TC partition -> the coordinator holding its
    lease (unowned ones left out); (0, {}) when `address` does not answer."""
    from atomlog.v1 import metadata_pb2, metadata_pb2_grpc
    from services.auth import bearer_channel

    try:
        with channel(address, tls) as channel_:
            reply = metadata_pb2_grpc.MetadataServiceStub(
                bearer_channel(channel_, token)).GetMetadata(
                metadata_pb2.GetMetadataRequest(), timeout=timeout_s)
    except grpc.RpcError:
        return 0, {}
    return reply.tc_partition_count, {tc.tc_partition: tc.coordinator_name
                                      for tc in reply.tc_partitions if tc.coordinator_name}


def _stop(entries: list[ProcessEntry], timeout_s: float) -> tuple[list[str], list[str]]:
    """SIGTERM, wait, SIGKILL. Returns (stopped cleanly, killed)."""
    live = [e for e in entries if process_alive(e.pid, marker_of(e))]
    for entry in live:
        try:
            os.kill(entry.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(process_alive(e.pid, marker_of(e)) for e in live):
        time.sleep(0.05)
    killed = []
    for entry in live:
        if process_alive(entry.pid, marker_of(entry)):
            os.kill(entry.pid, signal.SIGKILL)
            killed.append(entry.name)
    return [e.name for e in live if e.name not in killed], killed


def down(data_dir: Path, timeout_s: float = 20.0) -> tuple[list[str], list[str]]:
    data_dir = data_dir.resolve()
    cluster = ClusterFile.load(data_dir)
    if cluster is None:
        raise LaunchError(f"no cluster in {data_dir} (no {CLUSTER_FILE})")
    services = [p for p in cluster.processes if p.role != "zookeeper"]
    if cluster.prometheus is not None:
        services.append(cluster.prometheus)
    stopped, killed = _stop(services, timeout_s)
    zk_stopped, zk_killed = _stop([p for p in cluster.processes if p.role == "zookeeper"], timeout_s)
    for entry in cluster.processes + ([cluster.prometheus] if cluster.prometheus else []):
        entry.pid = 0
    cluster.save(data_dir)
    return stopped + zk_stopped, killed + zk_killed
