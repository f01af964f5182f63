"""The ZooKeeper session every server holds, and membership (registration).

Kazoo runs its own thread; `await aio(client.get_async(path))` bridges its async
results into asyncio without blocking the event loop. A session that expires is
replaced automatically by kazoo; `on_new_session` callbacks (for example to re-create
ephemeral registrations) run on a worker thread each time a new session begins.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from typing import Any, Callable

from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import NodeExistsError, NoNodeError
from kazoo.handlers.threading import KazooTimeoutError
from kazoo.retry import KazooRetry

from services import metrics
from services.errors import AtomlogError
from services.logs import event

log = logging.getLogger("atomlog.zookeeper")

SERVERS_PATH = "/servers"
TOPICS_PATH = "/topics"
TC_PATH = "/tc"
CLUSTER_PATH = "/cluster"


def aio(async_result) -> "asyncio.Future[Any]":
    """Turn a kazoo IAsyncResult into an asyncio future on the running loop."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def done(result) -> None:
        def settle() -> None:
            if future.cancelled():
                return
            try:
                future.set_result(result.get_nowait())
            except Exception as error:  # noqa: BLE001 — forwarded to the awaiting task
                future.set_exception(error)

        loop.call_soon_threadsafe(settle)

    async_result.rawlink(done)
    return future


class ZkSession:
    """One kazoo client under the cluster's chroot, reconnecting for ever."""

    def __init__(self, hosts: str, chroot: str, session_timeout_ms: int,
                 connect_timeout_ms: int):
        self.hosts = hosts
        self.chroot = chroot
        self.session_timeout_ms = session_timeout_ms
        self.connect_timeout_ms = connect_timeout_ms
        self.client = KazooClient(
            hosts=hosts + chroot,
            timeout=session_timeout_ms / 1000,
            connection_retry=KazooRetry(max_tries=-1, delay=0.1, max_delay=2.0),
            command_retry=KazooRetry(max_tries=3, delay=0.1, max_delay=1.0),
        )
        self._session_callbacks: list[Callable[[], None]] = []
        self._session_id: int | None = None
        self._lock = threading.Lock()
        self.client.add_listener(self._on_state)

    def start(self) -> None:
        """Connect (creating the chroot if needed); raise ZOOKEEPER_UNAVAILABLE on timeout."""
        timeout_s = self.connect_timeout_ms / 1000
        root = KazooClient(hosts=self.hosts, timeout=self.session_timeout_ms / 1000)
        try:
            root.start(timeout=timeout_s)
            root.ensure_path(self.chroot)
        except KazooTimeoutError:
            raise AtomlogError("ZOOKEEPER_UNAVAILABLE",
                               f"no ZooKeeper at {self.hosts} within {timeout_s:.0f} s") from None
        finally:
            root.stop()
            root.close()
        try:
            self.client.start(timeout=timeout_s)
        except KazooTimeoutError:
            raise AtomlogError("ZOOKEEPER_UNAVAILABLE",
                               f"no ZooKeeper at {self.hosts} within {timeout_s:.0f} s") from None
        for path in (SERVERS_PATH, TOPICS_PATH, TC_PATH):
            self.client.ensure_path(path)

    def stop(self) -> None:
        self.client.stop()
        self.client.close()
        metrics.ZOOKEEPER_CONNECTED.set(0)

    @property
    def connected(self) -> bool:
        return self.client.state == KazooState.CONNECTED

    @property
    def session_id(self) -> int | None:
        client_id = self.client.client_id
        return client_id[0] if client_id else None

    def on_new_session(self, callback: Callable[[], None]) -> None:
        """Run callback (on a worker thread) whenever a session replaces an expired one."""
        self._session_callbacks.append(callback)

    def _on_state(self, state: str) -> None:
        # Called on kazoo's thread: must not block.
        metrics.ZOOKEEPER_CONNECTED.set(1 if state == KazooState.CONNECTED else 0)
        event(log, "zookeeper session state", state=str(state))
        if state != KazooState.CONNECTED:
            return
        self.client.handler.spawn(self._check_new_session)

    def _check_new_session(self) -> None:
        session = self.session_id
        with self._lock:
            previous, self._session_id = self._session_id, session
        if session is None or session == previous:
            return
        metrics.ZOOKEEPER_SESSIONS.inc()
        if previous is None:
            return  # the first session: start-up registers itself
        event(log, "new zookeeper session; re-running session callbacks",
              session=hex(session))
        for callback in self._session_callbacks:
            try:
                callback()
            except Exception:  # noqa: BLE001 — logged; the next session retries
                log.exception("session callback failed")


def ensure_cluster(zk: ZkSession, tc_partitions: int) -> dict[str, Any]:
    """Create /cluster on first start; refuse a server whose fixed settings differ."""
    wanted = {"tc_partitions": tc_partitions, "created_unix_ms": int(time.time() * 1000)}
    try:
        zk.client.create(CLUSTER_PATH, json.dumps(wanted).encode())
    except NodeExistsError:
        pass
    data, _ = zk.client.get(CLUSTER_PATH)
    cluster = json.loads(data)
    if cluster["tc_partitions"] != tc_partitions:
        raise AtomlogError(
            "INVALID_ARGUMENT",
            f"cluster.tc_partitions={tc_partitions} but this cluster was created with "
            f"{cluster['tc_partitions']} TC partitions; the count is fixed at creation")
    return cluster


class Registration:
    """The ephemeral znode /servers/<name> that says this server is alive."""

    def __init__(self, zk: ZkSession, name: str, info: dict[str, Any], wait_ms: int):
        self.zk = zk
        self.name = name
        self.info = info
        self.wait_ms = wait_ms
        self.path = f"{SERVERS_PATH}/{name}"
        self.active = False
        zk.on_new_session(self._reregister)

    def register(self) -> None:
        """Create the node; if a previous process of the same name still holds it (its
        session has not expired yet, e.g. after kill -9), wait for it up to wait_ms."""
        deadline = time.monotonic() + self.wait_ms / 1000
        payload = json.dumps(self.info).encode()
        while True:
            try:
                self.zk.client.create(self.path, payload, ephemeral=True, makepath=True)
                self.active = True
                event(log, "registered", path=self.path)
                return
            except NodeExistsError:
                try:
                    data, stat = self.zk.client.get(self.path)
                except NoNodeError:
                    continue
                if stat.ephemeralOwner == self.zk.session_id:
                    self.zk.client.set(self.path, payload)  # our own create, reply lost
                    self.active = True
                    return
                if time.monotonic() > deadline:
                    other = json.loads(data or b"{}")
                    raise AtomlogError(
                        "INVALID_ARGUMENT",
                        f"another live server is registered as {self.name!r} "
                        f"(pid {other.get('pid')}, {other.get('grpc_address')}); "
                        "server names must be unique")
                event(log, "waiting for the previous registration to expire", path=self.path)
                time.sleep(0.2)

    def unregister(self) -> None:
        if not self.active:
            return
        self.active = False
        try:
            _, stat = self.zk.client.get(self.path)
            if stat.ephemeralOwner == self.zk.session_id:
                self.zk.client.delete(self.path, version=stat.version)
        except Exception:  # noqa: BLE001 — the session's end removes it anyway
            log.warning("could not delete registration %s", self.path, exc_info=True)

    def _reregister(self) -> None:
        if self.active:
            self.register()
