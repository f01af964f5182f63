"""The server bootstrap every atomlog service runs on.

Start-up, in order: logging; the authenticator (auth.*: services/auth.py); the TLS files
(tls.enabled: services/tls.py) and the service token; the /metrics
endpoint; the ZooKeeper session (and the
fixed cluster settings check); the grpc.aio server with the error/metrics interceptor,
the standard health service, the MetadataService, the role's own services and server
reflection; the ephemeral registration; then health SERVING.

Shutdown on SIGTERM or SIGINT, in order: health NOT_SERVING (load balancers and
probes stop sending), the registration is deleted (clients stop routing here),
in-flight calls drain for up to server.shutdown_grace_ms, the role's own stop hooks
run, then the ZooKeeper session and the metrics endpoint close.
"""

from __future__ import annotations

import asyncio
import faulthandler
import gc
import importlib
import logging
import os
import signal
import socket
import time
import traceback
from pathlib import Path
from typing import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from kazoo.exceptions import ConnectionLoss, KazooException

from atomlog.v1 import metadata_pb2, metadata_pb2_grpc
from partition_server import native
from services import __version__, acl, allocator, auth, failpoints, local, logs, metrics, tls
from services.config import (COMBINED, COMBINED_SUFFIX_MAX, Config, hosted_roles, role_name,
                             tc_partitions_created_by)
from services.errors import AtomlogError
from services.interceptors import ErrorsAndMetricsInterceptor
from services.logs import event
from services.metadata import MetadataServicer, MetadataStore
from services.zk import Registration, ZkSession, ensure_cluster

log = logging.getLogger("atomlog.runtime")

# Where each role's `install(runtime) -> list[str]` lives (full service names returned).
ROLE_MODULES = {
    "partition_server": "partition_server.server",
    "coordinator": "coordinator.server",
    "id_allocator": "id_allocator.server",
}

StopHook = Callable[[], Awaitable[None]]


def default_name(role: str) -> str:
    host = socket.gethostname().split(".")[0].lower()
    longest = 63 - COMBINED_SUFFIX_MAX if role == COMBINED else 63  # room for its roles' names
    return f"{role.replace('_', '-')}-{host}"[:longest].rstrip("-")


def session_timeout_ms(config: Config) -> int:
    """The ZooKeeper session timeout of this process: a coordinator's own (its TC
    partitions move that long after it dies), else zookeeper.session_timeout_ms."""
    if config.role == "coordinator" and config["coordinator.zookeeper_session_timeout_ms"]:
        return config["coordinator.zookeeper_session_timeout_ms"]
    return config["zookeeper.session_timeout_ms"]


class Runtime:
    """One server process: what a role's install() may use and extend."""

    def __init__(self, config: Config):
        self.config = config
        self.role = config.role
        self.name = config["server.name"] or default_name(self.role)
        self.zk = ZkSession(config["zookeeper.hosts"], config["zookeeper.chroot"],
                            session_timeout_ms(config), config["zookeeper.connect_timeout_ms"],
                            config["zookeeper.digest_file"])
        max_message = config["grpc.max_message_bytes"]
        # Its authenticator is made by start() (reading auth.* files can fail).
        self.interceptor = ErrorsAndMetricsInterceptor()
        self.server = grpc.aio.server(
            interceptors=[self.interceptor],
            options=[("grpc.max_send_message_length", max_message),
                     ("grpc.max_receive_message_length", max_message),
                     ("grpc.so_reuseport", 0)],
            maximum_concurrent_rpcs=config["grpc.max_concurrent_rpcs"])
        self.health = health.aio.HealthServicer()
        # The TC partition count is the cluster's (/cluster): known once start() read it.
        self.tc_partitions = 0
        self.metadata = MetadataStore(self.zk, self.tc_partitions,
                                      config["topics.max_partitions"],
                                      config["topics.default_replication_factor"],
                                      config["topics.max_topics"])
        self.service_names: list[str] = []
        self.stop_hooks: list[StopHook] = []
        # Run once the server is registered and SERVING (e.g. taking TC partition leases).
        self.start_hooks: list[StopHook] = []
        self.grpc_address = ""
        self.server_tls: tls.ServerTls | None = None
        self.health_server: grpc.aio.Server | None = None  # server.health_listen
        self.metrics_endpoint: metrics.MetricsEndpoint | None = None
        self.registrations: list[Registration] = []
        # Servicers by full service name, for calls from this same process (services/local.py).
        self.local_services: dict[str, object] = {}
        # Fields a role adds to its registration (the partition server: its replication link).
        self.registration_extra: dict[str, dict] = {}
        # This process's link (partition_server/copy_link.serve_on_link): one per process,
        # opened by the first role that serves on it ("server", "address").
        self.link_state: dict = {}
        self._stopping = asyncio.Event()

    def role_name(self, role: str) -> str:
        return role_name(self.name, self.role, role)

    def view(self, role: str) -> "Runtime | RoleView":
        return self if self.role != COMBINED else RoleView(self, role, self.role_name(role))

    async def start(self) -> None:
        config = self.config
        try:
            self.interceptor.authenticator = auth.Authenticator.from_config(config)
        except auth.AuthFileError as error:  # changed since the configuration was checked
            raise AtomlogError("INVALID_ARGUMENT", f"authentication: {error}") from None
        if config["tls.enabled"]:
            try:
                self.server_tls = tls.ServerTls(
                    config["tls.cert_file"], config["tls.key_file"], config["tls.ca_file"],
                    require_client_cert=config["tls.client_auth"] == "require")
                # Calls to other servers: the same CA, this server's certificate as client
                # certificate (so they pass the others' tls.client_auth=require).
                local.set_channel_tls(tls.ChannelTls(tls.TlsConfig(
                    config["tls.ca_file"], config["tls.cert_file"], config["tls.key_file"],
                    server_name=config["tls.server_name"])))
            except tls.TlsFileError as error:
                raise AtomlogError("INVALID_ARGUMENT", f"TLS: {error}") from None
        if config["auth.service_token_file"]:
            try:
                local.set_channel_token(auth.TokenSource(
                    token_file=config["auth.service_token_file"]))
            except auth.AuthFileError as error:
                raise AtomlogError("INVALID_ARGUMENT", f"authentication: {error}") from None
        host, port = config["server.metrics_listen"].rsplit(":", 1)
        self.metrics_endpoint = metrics.MetricsEndpoint(
            host, int(port), self.server_tls if config["tls.metrics"] else None)
        metrics.BUILD_INFO.info({"version": __version__, "role": self.role, "name": self.name,
                                 "core": native.status().split(" ")[0]})

        await asyncio.to_thread(self.zk.start)
        if failpoints.take(failpoints.START_ZOOKEEPER_LOSS):
            raise ConnectionLoss("start_zookeeper_loss failpoint (a ZooKeeper blip)")
        cluster = await asyncio.to_thread(ensure_cluster, self.zk, config["cluster.tc_partitions"],
                                          tc_partitions_created_by(
                                              self.role,
                                              config.get("coordinator.expected_partition_servers", 0)))
        # The cluster's count, fixed at its creation: what every role of this process uses.
        self.tc_partitions = self.metadata.tc_partitions = cluster["tc_partitions"]
        # auth.authorizer=acl: the ACL znode, watched, before any call is served.
        self.interceptor.authorizer = await asyncio.to_thread(
            acl.Authorizer.from_config, config, self.zk.client)

        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        metadata_pb2_grpc.add_MetadataServiceServicer_to_server(
            MetadataServicer(self.metadata, self.name), self.server)
        self.service_names.append(metadata_pb2.DESCRIPTOR.services_by_name["MetadataService"].full_name)
        for role in hosted_roles(self.role):
            module = importlib.import_module(ROLE_MODULES[role])
            self.service_names += await module.install(self.view(role))
        reflection.enable_server_reflection(
            [*self.service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME], self.server)

        listen = config["server.listen"]
        try:
            if self.server_tls is not None:
                bound = self.server.add_secure_port(listen, self.server_tls.credentials())
            else:
                bound = self.server.add_insecure_port(listen)
        except RuntimeError as error:
            raise AtomlogError("INVALID_ARGUMENT", f"cannot listen on {listen}: {error}") from None
        if bound == 0:
            raise AtomlogError("INVALID_ARGUMENT", f"cannot listen on {listen}")
        advertised = config["server.advertised_host"] or listen.rsplit(":", 1)[0]
        self.grpc_address = f"{advertised}:{config['server.advertised_port'] or bound}"
        # grpc_health answers SERVING for "" by default: not until we are registered.
        for service in ["", *self.service_names]:
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.start()
        if config["server.health_listen"]:
            await self._start_health_port(config["server.health_listen"])

        for service, servicer in self.local_services.items():
            local.register(self.grpc_address, service, servicer)
        # One registration per hosted role, under the name that role goes by (a combined
        # server is, to everyone else, a partition server, a coordinator and an id
        # allocator that share an address).
        self.registrations = [Registration(self.zk, self.role_name(role), {
            "role": role, "grpc_address": self.grpc_address,
            "metrics_address": self.metrics_endpoint.address, "pid": os.getpid(),
            "version": __version__, "registered_unix_ms": int(time.time() * 1000),
            **({"rack": config["server.rack"]} if role == "partition_server" else {}),
            **self.registration_extra.get(role, {}),
        }, wait_ms=int(session_timeout_ms(config) * 1.5) + 2_000)
            for role in hosted_roles(self.role)]
        await asyncio.gather(*(asyncio.to_thread(r.register) for r in self.registrations))

        for service in ["", *self.service_names]:
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        metrics.SERVING.set(1)
        for hook in self.start_hooks:
            await hook()
        event(log, "serving", grpc_address=self.grpc_address,
              metrics_address=self.metrics_endpoint.address, services=self.service_names,
              tls=("mtls" if self.server_tls.require_client_cert else "tls")
              if self.server_tls else "off", auth=config["auth.mode"],
              authorizer=config["auth.authorizer"], core=native.status())

    async def _start_health_port(self, listen: str) -> None:
        """server.health_listen: the health service alone, in plaintext (Kubernetes' gRPC
        probes speak no TLS); the same statuses as the main port's health service."""
        self.health_server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
        try:
            bound = self.health_server.add_insecure_port(listen)
        except RuntimeError as error:
            raise AtomlogError("INVALID_ARGUMENT", f"cannot listen on {listen}: {error}") from None
        if bound == 0:
            raise AtomlogError("INVALID_ARGUMENT", f"cannot listen on {listen}")
        await self.health_server.start()

    def request_stop(self) -> None:
        self._stopping.set()

    async def wait_stopped(self) -> None:
        await self._stopping.wait()

    async def stop(self) -> None:
        grace_s = self.config["server.shutdown_grace_ms"] / 1000
        event(log, "stopping", grace_s=grace_s)
        metrics.SERVING.set(0)
        await self.health.enter_graceful_shutdown()
        if self.registrations:
            try:  # bounded: with ZooKeeper down the session's expiry removes it anyway
                await asyncio.wait_for(asyncio.gather(
                    *(asyncio.to_thread(r.unregister) for r in self.registrations)), 2.0)
            except asyncio.TimeoutError:
                log.warning("could not unregister within 2 s; the session expiry will")
        await self.server.stop(grace_s)
        if self.health_server is not None:
            await self.health_server.stop(0)
        if self.grpc_address:
            local.unregister(self.grpc_address)
        if self.server_tls is not None:
            local.set_channel_tls(None)
        local.set_channel_token(None)
        for hook in reversed(self.stop_hooks):
            try:
                await hook()
            except Exception:  # noqa: BLE001 — keep stopping the rest
                log.exception("stop hook failed")
        await asyncio.to_thread(self.zk.stop)
        if self.metrics_endpoint is not None:
            self.metrics_endpoint.stop()
        event(log, "stopped")


class RoleView:
    """What one role's install() sees in a combined server: the whole runtime, but under
    that role's own name (its leases, registration and requests carry it)."""

    def __init__(self, runtime: Runtime, role: str, name: str):
        self._runtime = runtime
        self.role = role
        self.name = name

    def __getattr__(self, attribute: str):
        return getattr(self._runtime, attribute)


def tune_allocator() -> None:
    """Big blocks stay on the heap (services/allocator.py): without this a fresh server
    pays ~1M page faults per GB fetched (fetch 180-210 MB/s before, 380-505 MB/s after)."""
    allocator.tune(64 << 20, 256 << 20)


_gc_watched = False


def watch_gc_pauses() -> None:
    """Time every garbage collection into atomlog_gc_pause_seconds{generation}. A full
    collection scans every object the collector tracks that is not frozen: long-held
    tables of tuples made it hold the event loop for hundreds of ms (the partitions' and
    TC partitions' tables are now kept in forms it does not track)."""
    global _gc_watched
    if _gc_watched:
        return
    _gc_watched = True
    children = [metrics.GC_PAUSES.labels(str(generation)) for generation in range(3)]
    started = [0.0]

    def timed(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            children[info["generation"]].observe(time.perf_counter() - started[0])

    gc.callbacks.append(timed)


def freeze_startup_heap() -> int:
    """Move what start-up made (modules, protobuf descriptors, gRPC, the loaded state) to
    the collector's permanent generation (gc.freeze): a full collection then scans only
    what was made since. Measured on the combined server under small transactions: its
    full collections, every 3-4 s, paused the event loop 17-26 ms each, at the times of
    the slowest commits; frozen, 1.4-11 ms (what the partitions made since grows). The
    price: a cycle among the frozen objects that becomes garbage later is never freed
    (start-up objects live as long as the server). Returns how many objects were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


_REPO = str(Path(__file__).resolve().parent.parent)


def _our_frame(error: BaseException) -> str:
    """Where in atomlog's code `error` came out of ("services/zk.py:154 in start"): the
    start-up step that failed, for the operator (kazoo's own frames are below it)."""
    ours = [frame for frame in traceback.extract_tb(error.__traceback__)
            if frame.filename.startswith(_REPO) and "/.venv/" not in frame.filename]
    if not ours:
        return ""
    frame = ours[-1]
    return f"{os.path.relpath(frame.filename, _REPO)}:{frame.lineno} in {frame.name}"


async def serve(config: Config) -> int:
    """Run one server until SIGTERM/SIGINT; return the process exit code."""
    # A fatal signal (a crash in the native core or an extension: SIGSEGV, SIGABRT,
    # SIGBUS, SIGFPE, SIGILL) writes every thread's Python stack to stderr, the server's
    # log, instead of ending the process without a word.
    faulthandler.enable()
    tune_allocator()
    watch_gc_pauses()
    logs.setup(config["log.level"], config["log.format"],
               server=config["server.name"] or default_name(config.role), role=config.role)
    runtime = Runtime(config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, runtime.request_stop)
    try:
        await runtime.start()
    except AtomlogError as error:
        event(log, "cannot start", logging.ERROR, reason=error.reason, error=error.message)
        await runtime.stop()
        return 2
    except KazooException as error:
        event(log, "cannot start: ZooKeeper failed during start-up", logging.ERROR,
              error=repr(error), at=_our_frame(error))
        await runtime.stop()
        return 2
    except OSError as error:
        # Its storage (a full disk, a data directory it cannot make or write): said as
        # such, not as a crash's traceback; its supervisor starts it again.
        event(log, "cannot start", logging.ERROR, reason="STORAGE_ERROR",
              error=f"{type(error).__name__}: {error}", at=_our_frame(error))
        await runtime.stop()
        return 2
    event(log, "start-up heap frozen", objects=freeze_startup_heap())
    await runtime.wait_stopped()
    await runtime.stop()
    return 0
