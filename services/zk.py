"""The ZooKeeper session every server holds, and membership (registration).

With zookeeper.digest_file (`user:password`) the session authenticates with that digest
credential and every znode it creates under the chroot gets `ZNODE ACL`: all permissions
for that credential, read for everyone (docs/security.md). At start-up a chroot whose own
ACL is not that yet (made before the setting was on) is walked once and every znode's
ACL set, so a client without the credential can change nothing (NoAuth).

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
from kazoo.exceptions import (ConnectionLoss, NodeExistsError, NoAuthError, NoNodeError,
                              OperationTimeoutError, SessionExpiredError)
from kazoo.security import ACL, Id, Permissions, make_digest_acl
from kazoo.handlers.threading import KazooTimeoutError
from kazoo.retry import KazooRetry, RetryFailedError

from services import metrics
from services.errors import AtomlogError
from services.logs import event

log = logging.getLogger("atomlog.zookeeper")

SERVERS_PATH = "/servers"
TOPICS_PATH = "/topics"
TC_PATH = "/tc"
CLUSTER_PATH = "/cluster"


class DigestFileError(ValueError):
    """The ZooKeeper digest file is missing or malformed (a full sentence)."""


def read_digest(path: str) -> tuple[str, str]:
    """(user, password) of a digest file: one line `user:password`."""
    try:
        text = open(path, encoding="utf-8").read().strip()
    except OSError as error:
        raise DigestFileError(f"cannot read {path}: {error.strerror or error}") from None
    user, sep, password = text.partition(":")
    if not sep or not user or len(password) < 16 or any(c.isspace() for c in text):
        raise DigestFileError(f"{path} must hold one line `user:password` (a password of at "
                              "least 16 characters, no spaces)")
    return user, password


def znode_acl(user: str, password: str) -> list[ACL]:
    """Every permission for the cluster's credential; read for everyone."""
    return [make_digest_acl(user, password, all=True),
            ACL(Permissions.READ, Id("world", "anyone"))]


def kazoo_client(hosts: str, digest_file: str = "", **options) -> KazooClient:
    """A KazooClient (`hosts` may end in a chroot) that, with a digest file, authenticates
    with it and creates znodes with `znode_acl`."""
    if digest_file:
        user, password = read_digest(digest_file)
        options.update(auth_data=[("digest", f"{user}:{password}")],
                       default_acl=znode_acl(user, password))
    return KazooClient(hosts=hosts, **options)


def secure_tree(client: KazooClient, acl: list[ACL], root: str = "/") -> int:
    """Set `acl` on every znode below `root` that has another one, then on `root` itself
    (last: a root that has it says the whole tree was done, so a walk cut short, by a
    ZooKeeper blip or a crash, is made again at the next start; until 2026-12-06 the root
    came first, and the rest stayed writable by everyone for good); the number of znodes
    changed. Raises NoAuthError when a znode is not ours to change."""
    changed, pending = 0, [root]
    root_stat = None
    while pending:
        path = pending.pop()
        try:
            current, stat = client.get_acls(path)
            if list(current) != list(acl):
                if path == root:
                    root_stat = stat
                else:
                    client.set_acls(path, acl, version=stat.aversion)
                    changed += 1
            pending.extend(f"{path.rstrip('/')}/{child}" for child in client.get_children(path))
        except NoNodeError:
            continue  # deleted meanwhile (an ephemeral registration)
    if root_stat is not None:
        client.set_acls(root, acl, version=root_stat.aversion)
        changed += 1
    return changed


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
                 connect_timeout_ms: int, digest_file: str = "", command_tries: int = 3):
        self.hosts = hosts
        self.chroot = chroot
        self.session_timeout_ms = session_timeout_ms
        self.connect_timeout_ms = connect_timeout_ms
        self.digest_file = digest_file
        self.client = kazoo_client(
            hosts + chroot, digest_file,
            timeout=session_timeout_ms / 1000,
            connection_retry=KazooRetry(max_tries=-1, delay=0.1, max_delay=2.0),
            # Each kazoo call, and the first read of a kazoo watch: `command_tries` tries
            # (fewer in tests, which stand for the unlucky timing of a blip).
            command_retry=KazooRetry(max_tries=command_tries, delay=0.1, max_delay=1.0),
        )
        self._session_callbacks: list[Callable[[], None]] = []
        self._session_id: int | None = None
        self._lock = threading.Lock()
        self.client.add_listener(self._on_state)

    def start(self) -> None:
        """Connect (creating the chroot if needed); raise ZOOKEEPER_UNAVAILABLE on timeout.
        Each step rides out a ZooKeeper blip (`patiently`): a connection that drops just
        after it was made must not end the start-up."""
        timeout_s = self.connect_timeout_ms / 1000
        root = kazoo_client(self.hosts, self.digest_file, timeout=self.session_timeout_ms / 1000,
                            connection_retry=KazooRetry(max_tries=-1, delay=0.1, max_delay=2.0))
        try:
            root.start(timeout=timeout_s)
            self.patiently(f"creating {self.chroot}", root.ensure_path, self.chroot)
            if self.digest_file:
                self.patiently(f"the ACLs under {self.chroot}", self._secure, root)
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
        except (ConnectionLoss, OperationTimeoutError, SessionExpiredError):
            # Connected, then kazoo's start checks the chroot with one call: the client
            # stays started (it reconnects), and the patient calls below wait for it.
            pass
        for path in (SERVERS_PATH, TOPICS_PATH, TC_PATH):
            self.patiently(f"creating {path}", self.client.ensure_path, path)

    def _secure(self, root: KazooClient) -> None:
        """A chroot made before zookeeper.digest_file was set: give it and everything
        under it the cluster's znode ACL (once; later znodes are created with it)."""
        acl = znode_acl(*read_digest(self.digest_file))
        if list(root.get_acls(self.chroot)[0]) == acl:
            return
        try:
            changed = secure_tree(root, acl, self.chroot)
        except NoAuthError:
            raise AtomlogError(
                "INVALID_ARGUMENT", f"the znodes under {self.chroot} are protected by another "
                "ZooKeeper credential than zookeeper.digest_file's") from None
        event(log, "znode ACLs set: only this cluster's credential may change them",
              chroot=self.chroot, znodes=changed)

    def patiently(self, what: str, func: Callable[..., Any], *args, **kwargs) -> Any:
        """`func(*args, **kwargs)` (a kazoo call), retried through connection losses,
        operation timeouts and a session's expiry (kazoo reconnects meanwhile) for up to
        zookeeper.connect_timeout_ms, as start-up waits for a first connection: a step of
        a server's start must ride out a ZooKeeper blip instead of ending the process
        (chaos seed 2800: a combined server killed and started again lost its ZooKeeper
        connection for a few seconds while it waited for its previous registration to expire; it
        exited, and nothing started it again for 33 s). Past that: ZOOKEEPER_UNAVAILABLE."""
        timeout_s = self.connect_timeout_ms / 1000
        retry = KazooRetry(max_tries=-1, delay=0.1, max_delay=1.0, ignore_expire=True,
                           deadline=timeout_s)
        try:
            return retry(func, *args, **kwargs)
        except RetryFailedError:
            raise AtomlogError("ZOOKEEPER_UNAVAILABLE", f"ZooKeeper at {self.hosts} did not "
                               f"answer {what} within {timeout_s:.0f} s") from None

    def watch_children(self, what: str, path: str, func: Callable[[list[str]], Any]) -> None:
        """A kazoo ChildrenWatch of `path` calling `func` with the children now and at
        every change, made patiently: kazoo makes the watch's first read with the client's
        command retry (three tries), and a blip there raised out of a server's start
        (found 2026-12-02: a combined server started by hand, ZooKeeper paused 4.5 s just
        after it connected, exited in `CoordinatorEpochs.start`). A watch whose first read
        failed is retried with a new one; the failed one, which kazoo would otherwise
        re-arm at the next reconnection, stops the first time it would call back (a
        watch function that returns False ends its watch), so `func` hears one watch."""

        def attempt() -> None:
            live = True

            def call(children: list[str]) -> Any:
                if not live:
                    return False
                func(children)
                return None

            try:
                self.client.ChildrenWatch(path, call)
            except BaseException as error:
                live = False
                if isinstance(error, RetryFailedError):  # the command retry's tries ran out
                    raise ConnectionLoss(f"{what}: {error}") from error
                raise

        self.patiently(what, attempt)

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


def ensure_cluster(zk: ZkSession, tc_partitions: int, create_with: int | None = None
                   ) -> dict[str, Any]:
    """Create /cluster on first start; refuse a server whose fixed settings differ.
    `tc_partitions` 0 (cluster.tc_partitions unset) takes the cluster's count, and a cluster
    this call creates gets `create_with`. Returns /cluster's contents."""
    if not tc_partitions and not create_with:
        raise ValueError("ensure_cluster needs a TC partition count or one to create with")
    wanted = {"tc_partitions": tc_partitions or create_with,
              "created_unix_ms": int(time.time() * 1000)}
    try:
        zk.patiently("creating /cluster", zk.client.create, CLUSTER_PATH,
                     json.dumps(wanted).encode())
    except NodeExistsError:  # (also our own create, its answer lost to a reconnection)
        pass
    data, _ = zk.patiently("reading /cluster", zk.client.get, CLUSTER_PATH)
    cluster = json.loads(data)
    if tc_partitions and cluster["tc_partitions"] != tc_partitions:
        raise AtomlogError(
            "INVALID_ARGUMENT",
            f"cluster.tc_partitions={tc_partitions} but this cluster was created with "
            f"{cluster['tc_partitions']} TC partitions; the count is fixed at creation "
            "(leave cluster.tc_partitions unset, 0, to take the cluster's)")
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
        session has not expired yet, e.g. after kill -9), wait for it up to wait_ms. Each
        call rides out a ZooKeeper blip (`ZkSession.patiently`)."""
        deadline = time.monotonic() + self.wait_ms / 1000
        payload = json.dumps(self.info).encode()
        zk = self.zk
        while True:
            try:
                zk.patiently("a registration", zk.client.create, self.path, payload,
                             ephemeral=True, makepath=True)
                self.active = True
                event(log, "registered", path=self.path)
                return
            except NodeExistsError:
                try:
                    data, stat = zk.patiently("a registration", zk.client.get, self.path)
                except NoNodeError:
                    continue
                if stat.ephemeralOwner == zk.session_id:
                    # our own create, its answer lost to a reconnection
                    zk.patiently("a registration", zk.client.set, self.path, payload)
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
