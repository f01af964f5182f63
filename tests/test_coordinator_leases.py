"""TC partition leases (coordinator/leases.py) against a real ZooKeeper, no mocks.

This module starts its own ZooKeeper (services/localzk.py) in a temporary directory
(not the shared `cluster` fixture) and runs several LeaseManagers in-process, each
with its own ZkSession (2 s sessions) and its own registration under /servers, each
test under its own chroot. One test pauses a coordinator in another process with
SIGSTOP. Every on_acquired/on_lost call is written to a journal, and the journal is
checked: per TC partition the ownership intervals of different coordinators never
overlap across planned hand-overs, epochs strictly increase, and the log producer id
is allocated once and never changes. `Balancer` (the pure rule) is also simulated.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
from kazoo.client import KazooClient
from kazoo.security import OPEN_ACL_UNSAFE, make_acl
from prometheus_client import REGISTRY

from coordinator.leases import (
    MAX_EPOCH,
    STOP_WAIT_S,
    Balancer,
    Lease,
    LeaseManager,
    fair_share,
    owner_path,
    tc_path,
)
from partition_server.coordinator_epochs import CoordinatorEpochs
from services import launcher, localzk
from services.acl import ACLS_PATH, Acl, AclSet, Authorizer
from services.errors import AtomlogError
from services.metadata import MetadataStore
from services.zk import Registration, ZkSession

pytestmark = pytest.mark.cluster

REPO_ROOT = Path(__file__).resolve().parent.parent
N = 16
SESSION_TIMEOUT_MS = 2_000
INTERVAL_MS = 200
LOAD_S = 0.02  # each on_acquired/on_lost takes a little while, as a real load would


# ---- the pure balancing rule, simulated ---------------------------------------------------

def simulate(balancers: dict[str, Balancer], owners: dict[int, str], live: set[str],
             start: float, seconds: float, rng: random.Random, inert: frozenset = frozenset()
             ) -> tuple[float, int]:
    """Step every live balancer (in random order) every interval/4 over `seconds`;
    acquisitions succeed only on free partitions. Returns (end time, moves)."""
    step = next(iter(balancers.values())).interval_s / 4
    now, moves = start, 0
    while now < start + seconds:
        for name in rng.sample(sorted(live), len(live)):
            if name in inert:
                continue
            plan = balancers[name].plan(now, live, owners)
            if plan.release is not None:
                assert owners.pop(plan.release) == name
            for k in plan.acquire:
                if k in owners:
                    break
                owners[k] = name
                moves += 1
                if plan.stranded:
                    balancers[name].took_stranded(now)
        now += step
    return now, moves


def assert_fair(owners: dict[int, str], live: set[str]) -> None:
    floor, ceil = fair_share(N, len(live))
    counts = Counter(owners.values())
    assert len(owners) == N and set(counts) <= live, owners
    assert all(floor <= counts[c] <= ceil for c in live), counts


def test_balancer_converges_without_flapping():
    rng = random.Random(7)
    for _ in range(20):
        balancers = {f"c{i}": Balancer(f"c{i}", N, 1.0) for i in range(6)}
        owners: dict[int, str] = {}
        live: set[str] = set()
        now = 0.0
        for joined in rng.sample(sorted(balancers), 6):
            live.add(joined)
            now, _ = simulate(balancers, owners, live, now, 30, rng)
            assert_fair(owners, live)
            now, moves = simulate(balancers, owners, live, now, 30, rng)
            assert moves == 0, "a balanced cluster must not move partitions"
        for left in rng.sample(sorted(live), 5):
            live.discard(left)
            freed = [k for k, c in owners.items() if c == left]
            for k in freed:
                del owners[k]
            now, moves = simulate(balancers, owners, live, now, 2, rng)
            assert_fair(owners, live)  # the orphans are taken within 2 intervals...
            assert moves == len(freed)  # ...and nothing else moves


def test_balancer_with_an_inert_peer_keeps_every_partition_owned():
    """A registered coordinator that never takes partitions: everything still gets an
    owner, and the hand-over attempts back off instead of burning epochs."""
    rng = random.Random(3)
    balancers = {n: Balancer(n, N, 1.0) for n in ("a", "b", "dud")}
    owners: dict[int, str] = {}
    _, moves = simulate(balancers, owners, {"a", "b", "dud"}, 0.0, 3600, rng,
                        inert=frozenset({"dud"}))
    assert len(owners) == N and "dud" not in owners.values()
    assert moves < 200, f"{moves} lease changes in an hour: hand-overs must back off"


# ---- a real ZooKeeper ---------------------------------------------------------------------

@contextlib.contextmanager
def own_zookeeper(directory: Path):
    """A ZooKeeper server of its own in `directory`: (address, process)."""
    localzk.check_installed()
    port = launcher.free_port()
    command = localzk.prepare(directory, port)
    with open(directory / "zookeeper.log", "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                   cwd=directory, start_new_session=True)
    address = f"127.0.0.1:{port}"
    try:
        if not localzk.wait_serving(address, 30, lambda: process.poll() is None):
            raise AssertionError("ZooKeeper did not start:\n"
                                 + (directory / "zookeeper.log").read_text()[-3000:])
        yield address, process
    finally:
        if process.poll() is None:
            process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def pause(process: subprocess.Popen) -> None:
    """SIGSTOP a server's process group, and return once every thread of the process is
    stopped: a signal is delivered asynchronously, and on a loaded machine a thread of
    the JVM could still answer a request sent just after killpg (a CI run once saw the
    ACL read below answered by a ZooKeeper it had stopped)."""
    os.killpg(process.pid, signal.SIGSTOP)
    tasks = Path(f"/proc/{process.pid}/task")
    deadline = time.monotonic() + 10
    while True:
        states = []
        for task in tasks.iterdir():
            try:  # the state follows the command's ")" (a command may hold spaces)
                states.append((task / "stat").read_text().rpartition(")")[2].split()[0])
            except (OSError, IndexError):
                pass  # a thread that ended meanwhile
        if states and all(state in ("T", "t") for state in states):
            return
        assert time.monotonic() < deadline, f"ZooKeeper's threads not stopped: {states}"
        time.sleep(0.005)


def test_a_registration_rides_out_a_zookeeper_blip_while_it_waits(tmp_path):
    """A server started again after kill -9 waits for its previous registration to
    expire; ZooKeeper paused meanwhile (the connection drops: ConnectionLoss, maybe the
    session expires) must not end the start-up (chaos seed 2800: the combined server
    exited there, and nothing started it again for 33 s). It registers once ZooKeeper
    is back and the previous registration is gone."""
    with own_zookeeper(tmp_path) as (address, process):
        root = KazooClient(hosts=address)
        root.start(timeout=10)
        root.ensure_path("/blip")
        previous = KazooClient(hosts=address + "/blip", timeout=3)
        previous.start(timeout=10)
        previous.create("/servers/coord-9", b"{}", ephemeral=True, makepath=True)
        zk = ZkSession(address, "/blip", 3_000, 20_000)
        zk.start()
        registration = Registration(zk, "coord-9", {"role": "coordinator", "pid": 1},
                                    wait_ms=30_000)
        failures: list[BaseException] = []

        def register() -> None:
            try:
                registration.register()
            except BaseException as error:  # noqa: BLE001 — the test's verdict
                failures.append(error)

        thread = threading.Thread(target=register)
        try:
            thread.start()
            time.sleep(1.0)  # waiting for the previous registration
            assert thread.is_alive() and not registration.active
            pause(process)
            time.sleep(4.5)  # past the clients' ping timeout: their connections drop
            os.killpg(process.pid, signal.SIGCONT)
            previous.stop()
            previous.close()
            thread.join(40)
            assert not thread.is_alive()
            assert failures == []
            assert registration.active
            _, stat = root.get("/blip/servers/coord-9")
            assert stat.ephemeralOwner == zk.session_id
        finally:
            os.killpg(process.pid, signal.SIGCONT)
            zk.stop()
            root.stop()
            root.close()


def test_a_server_started_by_hand_rides_out_a_zookeeper_blip_as_it_connects(tmp_path):
    """`atomlog serve` with no supervisor: ZooKeeper paused the moment the server's
    session is made (past the session's ping timeout, so the connection drops under the
    start-up's first calls) must not end the process. Before 2026-12-02 the znodes
    ZkSession.start makes (the chroot, /servers, /topics, /tc) were one call each: a
    ConnectionLoss there ended the start in 5 of 6 tries. Two tries here."""
    with own_zookeeper(tmp_path) as (address, zookeeper_process):
        for attempt in range(2):
            port, metrics_port = launcher.free_port(), launcher.free_port()
            log_file = tmp_path / f"coordinator-{attempt}.log"
            pid = launcher.spawn(
                [sys.executable, "-m", "services", "serve", "coordinator",
                 "--name", f"blip-{attempt}", "--listen", f"127.0.0.1:{port}",
                 "--metrics-listen", f"127.0.0.1:{metrics_port}",
                 "--data-dir", str(tmp_path / f"data-{attempt}"), "--zookeeper", address,
                 "--set", f"zookeeper.chroot=/blip-{attempt}",
                 "--set", "zookeeper.session_timeout_ms=3000",
                 "--set", "coordinator.expected_partition_servers=0"],
                str(log_file))
            try:
                deadline = time.monotonic() + 30
                while '"state":"CONNECTED"' not in (
                        log_file.read_text() if log_file.exists() else ""):
                    assert time.monotonic() < deadline, log_file.read_text()
                    time.sleep(0.002)
                pause(zookeeper_process)
                try:
                    time.sleep(4.5)  # past the ping timeout (2/3 of 3 s): the connection drops
                finally:
                    os.killpg(zookeeper_process.pid, signal.SIGCONT)
                deadline = time.monotonic() + 40
                while launcher.health_status(f"127.0.0.1:{port}") != "SERVING":
                    assert launcher.process_alive(pid, "blip-"), log_file.read_text()[-3000:]
                    assert time.monotonic() < deadline, log_file.read_text()[-3000:]
                    time.sleep(0.2)
                assert "cannot start" not in log_file.read_text()
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)


def test_a_watch_asked_for_during_a_zookeeper_blip_is_made_once_it_is_back(tmp_path):
    """A start-up step that watches children (`CoordinatorEpochs.start`, the
    assignments' /servers and /topics) made the watch's first read with kazoo's command
    retry, three tries: ZooKeeper paused as it was asked for ended the start (found
    2026-12-02, a combined server started by hand with ZooKeeper paused 0.1 s after it
    connected: "cannot start ... at partition_server/coordinator_epochs.py:62"). Now the
    watch is made once ZooKeeper is back, the epochs already there are known when start
    returns, and the watches that failed meanwhile call back nobody: one change, one
    call."""
    with own_zookeeper(tmp_path) as (address, process):
        # One try a call (kazoo's command retry): a blip that outlasts all three tries of
        # a server's client, as in the run that found it, without waiting for its timing.
        zk = ZkSession(address, "/watch-blip", 3_000, 20_000, command_tries=1)
        zk.start()
        zk.client.create("/tc/3", json.dumps({"epoch": 7}).encode())
        epochs = CoordinatorEpochs(zk, 16)
        calls: list[list[str]] = []
        failures: list[BaseException] = []

        def during_the_blip(step) -> threading.Thread:
            def run() -> None:
                try:
                    step()
                except BaseException as error:  # noqa: BLE001 — the test's verdict
                    failures.append(error)

            thread = threading.Thread(target=run)
            thread.start()
            return thread

        threads = []
        try:
            pause(process)
            threads.append(during_the_blip(epochs.start))
            threads.append(during_the_blip(lambda: zk.watch_children(
                "watching /tc", "/tc", lambda names: calls.append(sorted(names)))))
            time.sleep(4.5)  # past the ping timeout (2/3 of 3 s): the connection drops
            os.killpg(process.pid, signal.SIGCONT)
            for thread in threads:
                thread.join(40)
                assert not thread.is_alive()
            assert failures == []
            assert epochs.current(3) == 7
            # (kazoo itself may repeat a listing once around a reconnection: its watch's
            # first read and its session listener's re-read can both deliver it.)
            assert calls and all(names == ["3"] for names in calls), calls
            zk.client.create("/tc/4", json.dumps({"epoch": 2}).encode())
            deadline = time.monotonic() + 10
            while epochs.current(4) != 2 or ["3", "4"] not in calls:
                assert time.monotonic() < deadline, (epochs.snapshot(), calls)
                time.sleep(0.05)
            time.sleep(1.0)  # a stray watch's call would come now
            # One change, one call: the watches that failed during the blip, re-armed by
            # kazoo at the reconnection, stopped at their first call back.
            assert calls.count(["3", "4"]) == 1, calls
        finally:
            os.killpg(process.pid, signal.SIGCONT)
            zk.stop()


def test_the_acls_first_read_gives_up_when_zookeeper_stays_away_and_loads_once_it_is_back(
        tmp_path):
    """auth.authorizer=acl reads the ACL znode before anything is served. kazoo's
    DataWatch retries that first read without a limit, so a ZooKeeper gone at that step
    held the start for ever; every other start-up step gives up after
    zookeeper.connect_timeout_ms (ZOOKEEPER_UNAVAILABLE) and a supervisor starts the
    process again. Now the authorizer does too, and with ZooKeeper there it loads the
    ACLs and follows their changes."""
    entry = Acl("alice", "topic", "orders", "write")
    with own_zookeeper(tmp_path) as (address, process):
        client = KazooClient(hosts=address, timeout=3)
        client.start(timeout=10)
        client.create(ACLS_PATH, AclSet([entry]).encode())
        try:
            pause(process)
            started = time.monotonic()
            try:
                with pytest.raises(AtomlogError) as refused:
                    Authorizer(client, frozenset(), load_timeout_s=3)
                waited = time.monotonic() - started
            finally:
                os.killpg(process.pid, signal.SIGCONT)
            assert refused.value.reason == "ZOOKEEPER_UNAVAILABLE"
            assert 3 <= waited < 6, waited
            authorizer = Authorizer(client, frozenset(), load_timeout_s=20)
            assert authorizer.acls.acls == (entry,)
            more = Acl("bob", "topic", "orders", "read")
            client.set(ACLS_PATH, AclSet([entry, more]).encode())
            deadline = time.monotonic() + 10
            while authorizer.acls.acls != (entry, more):
                assert time.monotonic() < deadline, authorizer.acls.acls
                time.sleep(0.05)
            authorizer.close()
        finally:
            os.killpg(process.pid, signal.SIGCONT)
            client.stop()
            client.close()


@pytest.fixture(scope="module")
def zookeeper(tmp_path_factory):
    with own_zookeeper(tmp_path_factory.mktemp("leases-zookeeper")) as (address, _):
        yield address


@pytest.fixture
def chroot():
    return f"/leases-test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def kazoo(zookeeper, chroot):
    root = KazooClient(hosts=zookeeper)
    root.start(timeout=10)
    root.ensure_path(chroot)
    root.stop()
    root.close()
    client = KazooClient(hosts=zookeeper + chroot)
    client.start(timeout=10)
    yield client
    client.stop()
    client.close()


class Allocator:
    """Stands in for the id allocators: ids from one counter, every one handed out kept."""

    def __init__(self, first: int = 1000):
        self._ids = itertools.count(first)
        self.issued: list[int] = []

    async def __call__(self) -> int:
        await asyncio.sleep(0.001)
        taken = next(self._ids)
        self.issued.append(taken)
        return taken


class Journal:
    """Every callback of every coordinator, in the order they happened (one loop)."""

    def __init__(self):
        self.entries: list[tuple[str, str, int, int, int]] = []  # kind, name, k, epoch, pid

    def check(self, *, no_overlap: bool = True) -> None:
        holder: dict[int, str | None] = {}
        epochs: dict[int, list[int]] = {}
        pids: dict[int, set[int]] = {}
        held_by: dict[tuple[str, int], bool] = {}
        for kind, name, k, epoch, pid in self.entries:
            if kind == "acq":
                assert not held_by.get((name, k)), f"{name} got on_acquired({k}) twice in a row"
                held_by[name, k] = True
                if no_overlap:
                    assert holder.get(k) is None, \
                        f"TC partition {k}: {name} acquired while {holder[k]} still held it"
                holder[k] = name
                epochs.setdefault(k, []).append(epoch)
                pids.setdefault(k, set()).add(pid)
            else:
                assert held_by.get((name, k)), f"{name} got on_lost({k}) without on_acquired"
                held_by[name, k] = False
                if holder.get(k) == name:
                    holder[k] = None
        for k, seen in epochs.items():
            assert seen == sorted(set(seen)), f"TC partition {k}: epochs {seen} not increasing"
        for k, seen in pids.items():
            assert len(seen) == 1, f"TC partition {k}: log producer ids {seen}"
        all_pids = [next(iter(p)) for p in pids.values()]
        assert len(all_pids) == len(set(all_pids)), "two TC partitions share a log producer id"

    def acquisitions(self, name: str | None = None) -> list[tuple[str, int, int]]:
        return [(n, k, e) for kind, n, k, e, _ in self.entries
                if kind == "acq" and name in (None, n)]


class Coordinator:
    """One LeaseManager with its own ZooKeeper session and registration."""

    def __init__(self, hosts: str, chroot: str, name: str, journal: Journal,
                 allocator: Allocator, interval_ms: int = INTERVAL_MS):
        self.name = name
        self.journal = journal
        self.zk = ZkSession(hosts, chroot, SESSION_TIMEOUT_MS, 10_000)
        self.registration = Registration(
            self.zk, name, {"role": "coordinator", "grpc_address": "", "pid": os.getpid(),
                            "registered_unix_ms": int(time.time() * 1000)}, wait_ms=15_000)
        self.holding: dict[int, Lease] = {}
        self.manager = LeaseManager(self.zk, name, N, on_acquired=self._acquired,
                                    on_lost=self._lost, new_log_producer_id=allocator,
                                    rebalance_interval_ms=interval_ms)
        self.stopped = False

    async def _acquired(self, lease: Lease) -> None:
        assert lease.tc_partition not in self.holding
        self.holding[lease.tc_partition] = lease
        self.journal.entries.append(("acq", self.name, lease.tc_partition, lease.epoch,
                                     lease.log_producer_id))
        await asyncio.sleep(LOAD_S)

    async def _lost(self, k: int) -> None:
        await asyncio.sleep(LOAD_S)  # stopping takes a while; nobody may start meanwhile
        lease = self.holding.pop(k)
        self.journal.entries.append(("lost", self.name, k, lease.epoch, lease.log_producer_id))

    async def connect(self) -> None:
        await asyncio.to_thread(self.zk.start)
        await asyncio.to_thread(self.registration.register)

    async def start(self) -> Coordinator:
        await self.connect()
        await self.manager.start()
        return self

    async def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        await self.manager.stop()
        await asyncio.to_thread(self.registration.unregister)
        await asyncio.to_thread(self.zk.stop)


async def eventually(predicate, timeout_s: float, what: str) -> float:
    began = time.monotonic()
    while not predicate():
        if time.monotonic() - began > timeout_s:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.02)
    return time.monotonic() - began


def counts(*coordinators: Coordinator) -> list[int]:
    return sorted((len(c.manager.owned()) for c in coordinators), reverse=True)


def settled(*coordinators: Coordinator, expected: list[int]) -> bool:
    """Every manager holds its expected share and its callbacks agree with it."""
    return (counts(*coordinators) == expected
            and all(c.manager.owned() == c.holding for c in coordinators))


def zk_state(kazoo: KazooClient) -> dict[int, tuple[dict, dict | None, int | None]]:
    """k -> (/tc/<k> data, /tc/<k>/owner data or None, owner's session or None)."""
    state = {}
    for k in range(N):
        record = json.loads(kazoo.get(tc_path(k))[0])
        owner = kazoo.exists(owner_path(k))
        data = json.loads(kazoo.get(owner_path(k))[0]) if owner else None
        state[k] = (record, data, owner.ephemeralOwner if owner else None)
    return state


def assert_zk_matches(kazoo: KazooClient, *coordinators: Coordinator) -> None:
    state = zk_state(kazoo)
    for c in coordinators:
        for k, lease in c.manager.owned().items():
            record, owner, session = state[k]
            assert owner is not None and owner["coordinator_name"] == c.name
            assert session == c.zk.session_id
            assert owner["epoch"] == record["epoch"] == lease.epoch
            assert record["log_producer_id"] == lease.log_producer_id


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def stop_all(*coordinators: Coordinator) -> None:
    for c in coordinators:
        try:
            await asyncio.wait_for(c.stop(), 15)
        except Exception as error:  # noqa: BLE001 — teardown: stop the others anyway
            print(f"stopping {c.name} failed: {error!r}")


# ---- scenarios on a real ZooKeeper -------------------------------------------------------

def test_one_coordinator_takes_every_partition(zookeeper, chroot, kazoo):
    async def scenario():
        journal, allocator = Journal(), Allocator()
        acquired_before = metric("atomlog_coordinator_lease_acquired_total")
        a = Coordinator(zookeeper, chroot, "coord-a", journal, allocator)
        try:
            await a.start()
            await eventually(lambda: settled(a, expected=[N]), 10, "coord-a to hold all 16")
            assert {lease.epoch for lease in a.manager.owned().values()} == {1}
            assert sorted(lease.log_producer_id for lease in a.manager.owned().values()) \
                == sorted(allocator.issued)
            assert_zk_matches(kazoo, a)
            assert metric("atomlog_coordinator_lease_acquired_total") - acquired_before == N
            # GetMetadata's view of the leases.
            leases = await MetadataStore(a.zk, N, 100).tc_leases()
            assert leases == {k: {"coordinator_name": "coord-a", "epoch": 1} for k in range(N)}
            await asyncio.sleep(3 * INTERVAL_MS / 1000)
            assert journal.acquisitions() == journal.acquisitions()[:N]  # nothing moved
            await a.stop()
            assert all(owner is None for _, owner, _ in zk_state(kazoo).values())
            assert await_nothing(a) and len(journal.entries) == 2 * N
            journal.check()
        finally:
            await stop_all(a)

    asyncio.run(scenario())


def await_nothing(c: Coordinator) -> bool:
    return not c.manager.owned() and not c.holding


def test_partitions_a_first_pass_cannot_create_are_created_by_a_later_one(zookeeper, chroot,
                                                                          kazoo):
    """The TC partitions' znodes are created by the balancing passes, not by start(): a
    coordinator that could not create them at its start (ZooKeeper unreachable, its
    session expired under a pause, as a chaos run found: the server then never owned a
    TC partition and answered NOT_COORDINATOR until restarted) keeps trying. Here /tc
    refuses creates (its ACL: read and admin only) until the test opens it."""
    async def scenario():
        journal, allocator = Journal(), Allocator()
        acquired_before = metric("atomlog_coordinator_lease_acquired_total")
        kazoo.create("/tc", acl=[make_acl("world", "anyone", read=True, admin=True)])
        a = Coordinator(zookeeper, chroot, "coord-a", journal, allocator)
        try:
            await asyncio.wait_for(a.start(), 10)  # returns: the refusal is the passes'
            await asyncio.sleep(4 * INTERVAL_MS / 1000)  # passes that fail
            assert not a.manager.owned() and not kazoo.get_children("/tc")
            kazoo.set_acls("/tc", OPEN_ACL_UNSAFE)
            await eventually(lambda: settled(a, expected=[N]), 10, "coord-a to hold all 16")
            assert_zk_matches(kazoo, a)
            assert metric("atomlog_coordinator_lease_acquired_total") - acquired_before == N
            await a.stop()
            journal.check()
        finally:
            await stop_all(a)

    asyncio.run(scenario())


def test_join_rebalance_stop_and_release(zookeeper, chroot, kazoo):
    async def scenario():
        journal, allocator = Journal(), Allocator()
        released_before = metric("atomlog_coordinator_lease_lost_total", reason="released")
        a = Coordinator(zookeeper, chroot, "coord-a", journal, allocator)
        b = Coordinator(zookeeper, chroot, "coord-b", journal, allocator)
        c = Coordinator(zookeeper, chroot, "coord-c", journal, allocator)
        try:
            await a.start()
            await eventually(lambda: settled(a, expected=[N]), 10, "coord-a to hold all 16")

            await b.start()
            took = await eventually(lambda: settled(a, b, expected=[8, 8]), 15, "8/8")
            print(f"\nsecond coordinator joined: 16/0 -> 8/8 in {took:.2f} s")
            moved = b.manager.owned()
            assert all(lease.epoch == 2 for lease in moved.values()), moved
            assert all(lease.epoch == 1 for lease in a.manager.owned().values())

            await c.start()
            took = await eventually(lambda: settled(a, b, c, expected=[6, 5, 5]), 15, "6/5/5")
            print(f"third coordinator joined: 8/8 -> 6/5/5 in {took:.2f} s")
            assert_zk_matches(kazoo, a, b, c)
            await asyncio.sleep(5 * INTERVAL_MS / 1000)
            before = len(journal.entries)
            await asyncio.sleep(5 * INTERVAL_MS / 1000)
            assert len(journal.entries) == before, "a balanced cluster must not move partitions"

            began = time.monotonic()
            await b.stop()
            took = await eventually(lambda: settled(a, c, expected=[8, 8]), 10, "8/8 after stop")
            print(f"coord-b stopped: its partitions moved to the others in "
                  f"{time.monotonic() - began:.2f} s (stop() included; {took:.2f} s after it)")
            assert_zk_matches(kazoo, a, c)

            fenced_before = metric("atomlog_coordinator_lease_lost_total", reason="fenced")
            k, old = next(iter(a.manager.owned().items()))
            await a.manager.release(k)
            assert k not in a.manager.owned() and k not in a.holding
            await eventually(lambda: any(k in x.manager.owned() for x in (a, c)), 5,
                             f"TC partition {k} to be taken again")
            new = (a.manager.owned() | c.manager.owned())[k]
            assert new.epoch > old.epoch and new.log_producer_id == old.log_producer_id
            assert metric("atomlog_coordinator_lease_lost_total", reason="fenced") \
                - fenced_before == 1
            await eventually(lambda: settled(a, c, expected=[8, 8]), 10, "8/8 again")

            assert_zk_matches(kazoo, a, c)
            for k, (record, owner, _) in zk_state(kazoo).items():
                assert record["epoch"] == max(e for _, kk, e in journal.acquisitions() if kk == k)
            assert len(allocator.issued) >= N
            assert metric("atomlog_coordinator_lease_lost_total", reason="released") \
                - released_before >= 8 + 3 + 5
            journal.check()
        finally:
            await stop_all(a, b, c)
        journal.check()
        assert all(owner is None for _, owner, _ in zk_state(kazoo).values())

    asyncio.run(scenario())


def test_racing_acquirers_exactly_one_wins_and_stale_versions_fail(zookeeper, chroot, kazoo):
    async def scenario():
        journal, allocator = Journal(), Allocator()
        racers = [Coordinator(zookeeper, chroot, f"racer-{i}", journal, allocator)
                  for i in range(4)]
        try:
            for racer in racers:  # sessions and registrations, but no balancing
                await racer.connect()
            await racers[0].manager._ensure_partitions()

            results = await asyncio.gather(*(r.manager._try_acquire(3) for r in racers))
            winners = [(r, lease) for r, lease in zip(racers, results) if lease is not None]
            assert len(winners) == 1, results
            winner, lease = winners[0]
            assert lease.epoch == 1
            record, owner, session = zk_state(kazoo)[3]
            assert owner["coordinator_name"] == winner.name and session == winner.zk.session_id
            assert record == {"epoch": 1, "log_producer_id": lease.log_producer_id}
            assert all(r.manager._lost_race for r in racers if r is not winner)

            # A stale read: racer-0 reads /tc/5 and waits for its producer id; meanwhile
            # racer-1 takes TC partition 5 and gives it back (the owner node is gone
            # again, only the version moved). racer-0's transaction must fail whole.
            entered, go = asyncio.Event(), asyncio.Event()

            async def slow_id() -> int:
                entered.set()
                await go.wait()
                return 999_999

            racers[0].manager.new_log_producer_id = slow_id
            slow = asyncio.create_task(racers[0].manager._try_acquire(5))
            await entered.wait()
            taken = await racers[1].manager._try_acquire(5)
            assert taken is not None and taken.epoch == 1
            await racers[1].manager.release(5)
            _, stat_before = kazoo.get(tc_path(5))
            go.set()
            assert await slow is None and racers[0].manager._lost_race
            data, stat_after = kazoo.get(tc_path(5))
            assert stat_after.version == stat_before.version
            assert json.loads(data) == {"epoch": 1, "log_producer_id": taken.log_producer_id}
            assert kazoo.exists(owner_path(5)) is None
            assert 5 not in racers[0].manager.owned()

            # The epoch limit: refuse, fail closed, change nothing.
            kazoo.set(tc_path(7), json.dumps({"epoch": MAX_EPOCH, "log_producer_id": 5}).encode())
            assert await racers[2].manager._try_acquire(7) is None
            assert kazoo.exists(owner_path(7)) is None
            assert json.loads(kazoo.get(tc_path(7))[0])["epoch"] == MAX_EPOCH
            assert 7 in racers[2].manager._refused
            await asyncio.sleep(0.1)  # let the callbacks run
            journal.check()
        finally:
            await stop_all(*racers)

    asyncio.run(scenario())


def test_session_expiry_drops_every_lease_and_others_take_over(zookeeper, chroot, kazoo):
    """coord-b's client learns at once that its session is gone (kazoo's own test hook
    for an expired session); ZooKeeper still holds the old session, and with it the
    owner nodes, until the session timeout: then the partitions move."""
    from kazoo.protocol.connection import _SESSION_EXPIRED

    async def scenario():
        journal, allocator = Journal(), Allocator()
        a = Coordinator(zookeeper, chroot, "coord-a", journal, allocator)
        b = Coordinator(zookeeper, chroot, "coord-b", journal, allocator)
        try:
            await a.start()
            await eventually(lambda: settled(a, expected=[N]), 10, "coord-a to hold all")
            await b.start()
            await eventually(lambda: settled(a, b, expected=[8, 8]), 15, "8/8")
            lost_before = metric("atomlog_coordinator_lease_lost_total", reason="session_lost")
            b_held = dict(b.manager.owned())
            old_session = b.zk.session_id

            began = time.monotonic()
            b.zk.client._call(_SESSION_EXPIRED, None)
            await eventually(lambda: not b.manager.owned() and not b.holding, 5,
                             "coord-b to drop its leases")
            dropped = time.monotonic() - began
            assert metric("atomlog_coordinator_lease_lost_total", reason="session_lost") \
                - lost_before == 8
            await eventually(lambda: all(k in (a.manager.owned() | b.manager.owned())
                                         for k in b_held), 15, "the partitions to be taken")
            failover = time.monotonic() - began
            print(f"\nsession lost (client side): leases dropped in {dropped * 1000:.0f} ms; "
                  f"old owner nodes expired and partitions re-taken {failover:.2f} s later "
                  f"(session timeout {SESSION_TIMEOUT_MS} ms)")
            assert failover >= SESSION_TIMEOUT_MS / 1000 * 0.5  # the old nodes held them
            assert b.zk.session_id != old_session
            await eventually(lambda: settled(a, b, expected=[8, 8]), 15, "8/8 again")
            for k, lease in (a.manager.owned() | b.manager.owned()).items():
                if k in b_held:
                    assert lease.epoch > b_held[k].epoch
            assert_zk_matches(kazoo, a, b)
            journal.check()  # b stopped acting before the nodes expired: no overlap
        finally:
            await stop_all(a, b)

    asyncio.run(scenario())


# ---- a coordinator paused past its session, in another process -----------------------------

def child_main(hosts: str, chroot: str, name: str) -> None:
    """Runs in the child process: one LeaseManager; every callback printed as JSON."""

    def say(**fields) -> None:
        print(json.dumps({**fields, "t": time.time()}), flush=True)

    async def run() -> None:
        zk = ZkSession(hosts, chroot, SESSION_TIMEOUT_MS, 10_000)
        await asyncio.to_thread(zk.start)
        registration = Registration(zk, name, {"role": "coordinator", "pid": os.getpid()},
                                    wait_ms=15_000)
        await asyncio.to_thread(registration.register)

        async def acquired(lease: Lease) -> None:
            say(kind="acq", k=lease.tc_partition, epoch=lease.epoch,
                pid=lease.log_producer_id, session=zk.session_id)

        async def lost(k: int) -> None:
            say(kind="lost", k=k)

        async def no_ids() -> int:
            raise RuntimeError("the child never allocates: every partition has its id")

        manager = LeaseManager(zk, name, N, on_acquired=acquired, on_lost=lost,
                               new_log_producer_id=no_ids, rebalance_interval_ms=INTERVAL_MS)
        await manager.start()
        say(kind="started")
        await asyncio.Event().wait()

    asyncio.run(run())


def test_paused_coordinator_fails_over_after_its_session_timeout(zookeeper, chroot, kazoo):
    async def scenario():
        journal, allocator = Journal(), Allocator()
        a = Coordinator(zookeeper, chroot, "coord-a", journal, allocator)
        child = None
        lines: list[dict] = []
        try:
            await a.start()
            await eventually(lambda: settled(a, expected=[N]), 10, "coord-a to hold all")
            child = await asyncio.to_thread(
                subprocess.Popen, [sys.executable, "-m", "tests.test_coordinator_leases", "child", zookeeper,
                 chroot, "coord-p"], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL, text=True)

            def read() -> None:
                for line in child.stdout:
                    lines.append(json.loads(line))

            threading.Thread(target=read, daemon=True).start()

            def child_holds() -> dict[int, int]:
                held: dict[int, int] = {}
                for entry in lines:  # appended to by the reader thread
                    if entry["kind"] == "acq":
                        held[entry["k"]] = entry["epoch"]
                    elif entry["kind"] == "lost":
                        held.pop(entry["k"], None)
                return held

            await eventually(lambda: len(child_holds()) == 8 and len(a.manager.owned()) == 8,
                             20, "8/8 with the child")
            paused_held = child_holds()

            os.kill(child.pid, signal.SIGSTOP)
            began = time.monotonic()
            await eventually(lambda: len(a.manager.owned()) == N, 15,
                             "coord-a to take over the paused coordinator's partitions")
            failover = time.monotonic() - began
            print(f"\ncoordinator paused (SIGSTOP): all its {len(paused_held)} partitions "
                  f"owned elsewhere after {failover:.2f} s (session timeout "
                  f"{SESSION_TIMEOUT_MS} ms, rebalance interval {INTERVAL_MS} ms)")
            assert failover >= SESSION_TIMEOUT_MS / 1000 * 0.5
            for k, epoch in paused_held.items():
                assert a.manager.owned()[k].epoch > epoch

            resumed_at = len(lines)
            os.kill(child.pid, signal.SIGCONT)
            # The child learns its session is gone: on_lost for everything it held, at once.
            await eventually(lambda: {e["k"] for e in lines[resumed_at:] if e["kind"] == "lost"}
                             >= set(paused_held), 10, "the resumed child to drop its leases")
            first_new = next((i for i, e in enumerate(lines[resumed_at:])
                              if e["kind"] == "acq"), None)
            last_lost = max(i for i, e in enumerate(lines[resumed_at:]) if e["kind"] == "lost")
            assert first_new is None or first_new > last_lost
            # ...and then joins again on a new session.
            await eventually(lambda: len(child_holds()) == 8 and len(a.manager.owned()) == 8,
                             20, "8/8 again after the child came back")
            assert not set(child_holds()) & set(a.manager.owned())
            epochs: dict[int, list[int]] = {}
            for entry in lines:
                if entry["kind"] == "acq":
                    epochs.setdefault(entry["k"], []).append(entry["epoch"])
            for _, k, epoch in journal.acquisitions():
                epochs.setdefault(k, []).append(epoch)
            state = zk_state(kazoo)
            for k, seen in epochs.items():
                assert len(seen) == len(set(seen)), f"TC partition {k}: an epoch reused {seen}"
                assert state[k][0]["epoch"] == max(seen)
            assert {e["pid"] for e in lines if e["kind"] == "acq"} <= set(allocator.issued)
            journal.check()
        finally:
            if child is not None:
                child.kill()
                child.wait()
            await stop_all(a)

    asyncio.run(scenario())


if __name__ == "__main__" and sys.argv[1:2] == ["child"]:
    child_main(*sys.argv[2:5])


def test_stop_is_bounded_when_zookeeper_is_gone(tmp_path):
    """A coordinator told to stop while ZooKeeper is unreachable gives its partitions up
    and returns: the client retries the connection for ever, so a ZooKeeper call made
    while stopping would never answer (a SIGTERMed coordinator once hung like this)."""
    with own_zookeeper(tmp_path) as (address, process):
        async def scenario():
            journal, allocator = Journal(), Allocator()
            a = Coordinator(address, "/gone", "coord-a", journal, allocator)
            await a.start()
            await eventually(lambda: settled(a, expected=[N]), 10, "coord-a to hold all 16")
            process.kill()
            process.wait()
            await eventually(lambda: not a.zk.connected, 10, "the client to notice")
            began = time.monotonic()
            await asyncio.wait_for(a.manager.stop(), 4 * STOP_WAIT_S)
            took = time.monotonic() - began
            assert not a.holding and not a.manager.owned()  # every on_lost ran
            assert took <= 3 * STOP_WAIT_S + 2
            a.stopped = True
            await asyncio.to_thread(a.zk.stop)

        asyncio.run(scenario())
