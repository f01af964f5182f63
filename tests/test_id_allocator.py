"""The producer-id allocator with real processes: a real ZooKeeper and two allocator
processes of this module's own local cluster (not the shared `cluster` fixture, whose
tests restart processes). Scenarios from issue 4: 8 clients x 2 allocators x 10,000
blocks; kill -9 and restart of an allocator; ZooKeeper stopped and restarted; an
allocator SIGSTOPped past its session timeout; 200 concurrent pool users. Every block
any test receives is kept, and all of them must be pairwise disjoint.

The "200 producers through the SDK" scenario waits for the SDK (spark_client); until
then 200 concurrent ProducerIdPool users stand in for it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from kazoo.client import KazooClient
from prometheus_client.parser import text_string_to_metric_families

from atomlog.v1 import id_allocator_pb2 as pb
from atomlog.v1 import id_allocator_pb2_grpc as pb_grpc
from id_allocator.allocator import Allocator, AllocatorSettings
from id_allocator.client import AsyncProducerIdPool, ProducerIdPool, RetryPolicy
from id_allocator.core import Allocation, Block, Done, Read, Request, Snapshot, Write
from id_allocator.store import WriteConflict, WriteOk, ZkBlockStore
from services import launcher, localzk
from tests.conftest import wait_until
from services.errors import AtomlogError, from_rpc_error
from services.zk import ZkSession

pytestmark = pytest.mark.cluster

SESSION_TIMEOUT_MS = 2_000
CALL_TIMEOUT_S = 5.0
# A restarted server is found again within half a second (gRPC's default backoff grows to 120 s).
CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", 500)]
ISSUED: list[tuple[Block, str]] = []  # every block any test of this module received
ISSUED_LOCK = threading.Lock()


class Cluster:
    def __init__(self, data_dir: Path):
        self.data_dir = data_dir
        self._channels: dict[str, grpc.Channel] = {}  # kept open: a collected channel cancels its calls

    def up(self) -> launcher.UpReport:
        return launcher.up(self.data_dir, {"id_allocator": 2},
                           {"zookeeper.session_timeout_ms": str(SESSION_TIMEOUT_MS)}, timeout_s=60)

    @property
    def file(self) -> launcher.ClusterFile:
        return launcher.ClusterFile.load(self.data_dir)

    def process(self, name: str) -> launcher.ProcessEntry:
        return next(p for p in self.file.processes if p.name == name)

    def address(self, name: str) -> str:
        return self.process(name).grpc_address

    def channel(self, name: str) -> grpc.Channel:
        if name not in self._channels:
            self._channels[name] = grpc.insecure_channel(self.address(name), CHANNEL_OPTIONS)
        return self._channels[name]

    def stub(self, name: str) -> pb_grpc.IdAllocatorServiceStub:
        return pb_grpc.IdAllocatorServiceStub(self.channel(name))

    def describe(self, name: str) -> pb.DescribeAllocatorResponse:
        return self.stub(name).DescribeAllocator(pb.DescribeAllocatorRequest(), timeout=CALL_TIMEOUT_S)

    def blocks_issued(self, name: str) -> int:
        """Blocks the process has issued since it started; -1 while it cannot answer."""
        try:
            return self.describe(name).blocks_issued
        except grpc.RpcError:
            return -1

    def wait_registered(self, name: str, timeout_s: float = 15) -> None:
        """Until /servers/<name> is the current process's registration (the health check
        answers SERVING before a restarted server has registered)."""
        pid = self.process(name).pid
        zk = self.kazoo()
        try:
            def registered() -> bool:
                found = zk.exists(f"/servers/{name}")
                return bool(found) and json.loads(zk.get(f"/servers/{name}")[0])["pid"] == pid
            wait_until(registered, timeout_s, f"{name} (pid {pid}) to register")
        finally:
            zk.stop()

    def kazoo(self) -> KazooClient:
        client = KazooClient(hosts=self.file.zookeeper + self.file.chroot)
        client.start(timeout=10)
        return client


@pytest.fixture(scope="module")
def ida(tmp_path_factory):
    localzk.check_installed()
    cluster = Cluster(tmp_path_factory.mktemp("atomlog-id-allocator"))
    try:
        cluster.up()
        yield cluster
    finally:
        if (cluster.data_dir / launcher.CLUSTER_FILE).exists():
            launcher.down(cluster.data_dir, timeout_s=10)


def record(blocks: list[Block], who: str) -> None:
    with ISSUED_LOCK:
        ISSUED.extend((b, who) for b in blocks)


def assert_disjoint() -> None:
    with ISSUED_LOCK:
        issued = sorted(ISSUED)
    for (b1, w1), (b2, w2) in zip(issued, issued[1:]):
        assert b1.last < b2.first, f"block {b1} ({w1}) overlaps {b2} ({w2})"


def assert_increasing(blocks: list[Block], who: str) -> None:
    for earlier, later in zip(blocks, blocks[1:]):
        assert earlier.last < later.first, f"{who}: {earlier} then {later}"



class Client(threading.Thread):
    """Allocates blocks one after another (sequentially, so its blocks must increase),
    moving to its next allocator after a retriable error (or after every call, with
    rotate); stops after `blocks` blocks or when `stop` is set. Fatal errors fail the test."""

    def __init__(self, name: str, addresses: list[str], *, blocks: int | None = None,
                 stop: threading.Event | None = None, count: int = 10,
                 call_timeout_s: float = CALL_TIMEOUT_S, rotate: bool = False):
        super().__init__(name=name, daemon=True)
        self.addresses = addresses
        self.target = blocks
        self.stop_event = stop or threading.Event()
        self.count = count
        self.call_timeout_s = call_timeout_s
        self.rotate = rotate
        self.blocks: list[Block] = []
        self.errors: dict[str, int] = {}
        self.fatal: AtomlogError | None = None

    def run(self) -> None:
        channels = [grpc.insecure_channel(a, CHANNEL_OPTIONS) for a in self.addresses]
        stubs = [pb_grpc.IdAllocatorServiceStub(c) for c in channels]
        try:
            self._loop(stubs)
        finally:
            for channel in channels:
                channel.close()

    def _loop(self, stubs: list[pb_grpc.IdAllocatorServiceStub]) -> None:
        turn = 0
        while not self.stop_event.is_set() and (self.target is None or len(self.blocks) < self.target):
            try:
                reply = stubs[turn % len(stubs)].AllocateProducerIds(
                    pb.AllocateProducerIdsRequest(count=self.count, requester=self.name),
                    timeout=self.call_timeout_s)
                self.blocks.append(Block(reply.first_producer_id, reply.last_producer_id))
                turn += self.rotate
            except grpc.RpcError as rpc_error:
                error = from_rpc_error(rpc_error)
                self.errors[error.reason] = self.errors.get(error.reason, 0) + 1
                if rpc_error.code() not in (grpc.StatusCode.UNAVAILABLE,
                                            grpc.StatusCode.DEADLINE_EXCEEDED) and not error.retriable:
                    self.fatal = error
                    return
                turn += 1
                time.sleep(0.02)

    def finish(self) -> list[Block]:
        self.join(timeout=60)
        assert not self.is_alive(), f"{self.name} did not stop"
        assert self.fatal is None, f"{self.name}: fatal {self.fatal}"
        assert all(b.size == self.count for b in self.blocks)
        assert_increasing(self.blocks, self.name)
        record(self.blocks, self.name)
        return self.blocks


def run_clients(clients: list[Client]) -> None:
    for client in clients:
        client.start()


def metrics(address: str) -> dict[str, float]:
    body = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    return {s.name + (str(sorted(s.labels.items())) if s.labels else ""): s.value
            for f in text_string_to_metric_families(body) for s in f.samples}


# ------------------------------------------------------------------ basic contract
def test_default_block_validation_and_describe(ida):
    stub = ida.stub("ida-0")
    first = stub.AllocateProducerIds(pb.AllocateProducerIdsRequest(requester="t"), timeout=5)
    assert first.last_producer_id - first.first_producer_id + 1 == 1000  # count 0: default
    assert first.first_producer_id >= 1
    before = ida.describe("ida-1")  # any allocator sees the shared znode
    assert before.last_block_last_producer_id == first.last_producer_id
    assert before.last_block_requester == "t" and before.zookeeper_connected
    assert before.default_block_size == 1000 and before.max_block_size == 1_000_000
    assert before.znode_version >= 0 and before.allocator_name == "ida-1"

    raw = ida.channel("ida-0").unary_unary(
        "/atomlog.v1.IdAllocatorService/AllocateProducerIds",
        request_serializer=lambda b: b, response_deserializer=pb.AllocateProducerIdsResponse.FromString)
    negative_count = b"\x08" + b"\xff" * 9 + b"\x01"  # field 1 = -1 as a 64-bit varint
    too_many = pb.AllocateProducerIdsRequest(count=1_000_001)
    long_name = pb.AllocateProducerIdsRequest(count=1, requester="r" * 129)
    for call in (lambda: stub.AllocateProducerIds(too_many, timeout=5),
                 lambda: stub.AllocateProducerIds(long_name, timeout=5),
                 lambda: raw(negative_count, timeout=5)):
        with pytest.raises(grpc.RpcError) as raised:
            call()
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert from_rpc_error(raised.value).reason == "INVALID_ARGUMENT"
    assert ida.describe("ida-0").znode_version == before.znode_version  # nothing written
    record([Block(first.first_producer_id, first.last_producer_id)], "basic")


# ------------------------------------------------------------------ 8 clients, 10,000 blocks
def test_eight_clients_two_allocators_ten_thousand_blocks(ida):
    addresses = [ida.address("ida-0"), ida.address("ida-1")]
    before = {n: ida.describe(n) for n in ("ida-0", "ida-1")}
    # Each client sticks to one allocator (4 per allocator) so both serve and contend.
    clients = [Client(f"c{i}", [addresses[i % 2]], blocks=1_250) for i in range(8)]
    began = time.monotonic()
    run_clients(clients)
    blocks = [b for c in clients for b in c.finish()]
    seconds = time.monotonic() - began
    assert len(blocks) == 10_000
    assert_disjoint()
    after = {n: ida.describe(n) for n in ("ida-0", "ida-1")}
    issued = {n: after[n].blocks_issued - before[n].blocks_issued for n in after}
    assert issued["ida-0"] >= 5_000 and issued["ida-1"] >= 5_000, issued
    conflicts = sum(after[n].compare_and_set_conflicts - before[n].compare_and_set_conflicts
                    for n in after)
    print(f"\n10,000 blocks by 8 clients via 2 allocators in {seconds:.1f} s "
          f"({10_000 / seconds:.0f} blocks/s), {conflicts} CAS conflicts, errors "
          f"{[c.errors for c in clients if c.errors]}")
    samples = metrics(ida.process("ida-0").metrics_address)
    assert samples["atomlog_id_allocator_blocks_allocated_total"] >= 5_000
    assert "atomlog_id_allocator_cas_conflicts_total" in samples
    assert samples["atomlog_id_allocator_allocation_latency_seconds_count"] >= 5_000
    assert samples["atomlog_zookeeper_connected"] == 1


# ------------------------------------------------------------------ kill -9 and restart
def test_kill_9_allocator_mid_stream_and_restart(ida):
    addresses = [ida.address("ida-0"), ida.address("ida-1")]
    stop = threading.Event()
    clients = [Client(f"k{i}", addresses[i % 2:] + addresses[:i % 2], stop=stop, rotate=True)
               for i in range(4)]
    run_clients(clients)
    time.sleep(1.0)
    victim = ida.process("ida-1")
    os.kill(victim.pid, signal.SIGKILL)
    wait_until(lambda: not launcher.process_alive(victim.pid, launcher.marker_of(victim)), 5,
               "ida-1 to die")
    time.sleep(0.5)
    report = ida.up()  # restarts ida-1 (same name and port)
    assert report.started == ["ida-1"]
    ida.wait_registered("ida-1")  # its start-up ends once the old session expired
    served_before = sum(len(c.blocks) for c in clients)
    wait_until(lambda: ida.blocks_issued("ida-1") > 20, 10, "the restarted ida-1 to serve clients")
    stop.set()
    for client in clients:
        client.finish()
    assert sum(len(c.blocks) for c in clients) > served_before
    assert_disjoint()


# ------------------------------------------------------------------ ZooKeeper outage
def test_zookeeper_stop_and_restart_mid_stream(ida):
    addresses = [ida.address("ida-0"), ida.address("ida-1")]
    stop = threading.Event()
    clients = [Client(f"z{i}", addresses, stop=stop, call_timeout_s=2.0) for i in range(4)]
    run_clients(clients)
    time.sleep(0.8)
    zk = ida.process("zookeeper")
    os.kill(zk.pid, signal.SIGTERM)
    wait_until(lambda: not launcher.process_alive(zk.pid, launcher.marker_of(zk)), 15,
               "ZooKeeper to stop")
    with ISSUED_LOCK:
        highest_before = max(b.last for c in clients for b in c.blocks)
    # During the outage: a quick, retriable UNAVAILABLE, never a hang or a timeout.
    for name in ("ida-0", "ida-1"):
        for _ in range(3):
            began = time.monotonic()
            with pytest.raises(grpc.RpcError) as raised:
                ida.stub(name).AllocateProducerIds(pb.AllocateProducerIdsRequest(count=10),
                                                   timeout=CALL_TIMEOUT_S)
            assert time.monotonic() - began < 2.0  # answered at once, not at the deadline
            assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
            error = from_rpc_error(raised.value)
            assert error.reason == "ZOOKEEPER_UNAVAILABLE" and error.retriable, (name, _, error)
        with pytest.raises(grpc.RpcError) as raised:
            ida.describe(name)
        assert from_rpc_error(raised.value).reason == "ZOOKEEPER_UNAVAILABLE"
    samples = metrics(ida.process("ida-0").metrics_address)
    assert samples["atomlog_zookeeper_connected"] == 0
    time.sleep(1.0)
    outage_blocks = sum(len(c.blocks) for c in clients)

    report = ida.up()
    assert report.started == ["zookeeper"]
    wait_until(lambda: sum(len(c.blocks) for c in clients) > outage_blocks + 50, 30,
               "allocation to resume after ZooKeeper returned")
    for name in ("ida-0", "ida-1"):  # both recover by themselves (kazoo retries every <= 2 s)
        recovered: list[Block] = []

        def allocates(name: str = name) -> bool:
            try:
                reply = ida.stub(name).AllocateProducerIds(pb.AllocateProducerIdsRequest(count=10),
                                                           timeout=CALL_TIMEOUT_S)
            except grpc.RpcError as rpc_error:
                assert from_rpc_error(rpc_error).reason == "ZOOKEEPER_UNAVAILABLE"
                return False
            recovered.append(Block(reply.first_producer_id, reply.last_producer_id))
            return True

        wait_until(allocates, 10, f"{name} to allocate again")
        assert recovered[0].first > highest_before
        record(recovered, f"after-zk-{name}")
    stop.set()
    for client in clients:
        client.finish()
        assert client.errors.get("ZOOKEEPER_UNAVAILABLE", 0) > 0, client.errors
    assert_disjoint()


# ------------------------------------------------------------------ SIGSTOP past the session
def test_sigstop_past_session_timeout_never_issues_anothers_block(ida):
    paused, other = ida.process("ida-0"), ida.process("ida-1")
    stop = threading.Event()
    # Keep ida-0 busy so that it is stopped in the middle of a read or a compare-and-set.
    on_paused = [Client(f"p{i}", [paused.grpc_address], stop=stop, count=7, call_timeout_s=1.0)
                 for i in range(4)]
    on_other = [Client(f"o{i}", [other.grpc_address], stop=stop, count=7) for i in range(2)]
    run_clients(on_paused + on_other)
    time.sleep(1.0)
    zk = ida.kazoo()
    try:
        os.kill(paused.pid, signal.SIGSTOP)
        try:
            during = sum(len(c.blocks) for c in on_other)
            # Past its session timeout: ZooKeeper expires the session and drops its
            # ephemeral registration, while ida-1 keeps allocating.
            wait_until(lambda: not zk.exists("/servers/ida-0"), SESSION_TIMEOUT_MS / 1000 + 10,
                       "ida-0's session to expire")
            time.sleep(0.5)
            assert sum(len(c.blocks) for c in on_other) > during + 20
        finally:
            os.kill(paused.pid, signal.SIGCONT)
        resumed = sum(len(c.blocks) for c in on_paused)
        wait_until(lambda: sum(len(c.blocks) for c in on_paused) > resumed + 20, 20,
                   "ida-0 to serve again after SIGCONT")
        wait_until(lambda: zk.exists("/servers/ida-0"), 10, "ida-0 to register again")
    finally:
        zk.stop()
        stop.set()
    for client in on_paused + on_other:
        client.finish()
    assert_disjoint()
    log = Path(paused.log_file).read_text()
    print("\nida-0 after SIGCONT:", ida.describe("ida-0"),
          "lost-reply resolutions:", log.count("lost write reply resolved"))


def test_paused_write_fails_the_cas_after_session_expiry_real_zookeeper(ida):
    """Deterministic version of the SIGSTOP scenario, in-process on the real ZooKeeper:
    allocator A reads the znode, A's session expires, B allocates, A's write (planned
    from the old version) must fail its compare-and-set, and A's next block is fresh."""

    async def scenario():
        hosts, chroot = ida.file.zookeeper, "/atomlog-paused-write"
        sessions = [ZkSession(hosts, chroot, SESSION_TIMEOUT_MS, 10_000) for _ in range(2)]
        for session in sessions:
            await asyncio.to_thread(session.start)
        store_a, store_b = (ZkBlockStore(s, 5.0) for s in sessions)
        b = Allocator(store_b, "b", AllocatorSettings.defaults())
        b.start()
        try:
            first = await b.allocate(10, "b")
            machine = Allocation((Request(10, "a"),), "a", 16)
            assert isinstance(machine.start(), Read)
            stale = machine.on_read(Snapshot.parse(*await store_a.read()), "nonce-a-1")
            assert isinstance(stale, Write) and stale.results == (Block(first.last + 1, first.last + 10),)

            old_session = sessions[0].session_id
            thief = KazooClient(hosts=hosts + chroot, client_id=sessions[0].client.client_id)
            await asyncio.to_thread(thief.start, 10)
            await asyncio.to_thread(thief.stop)  # closing the stolen session expires A's
            thief.close()
            taken = [await b.allocate(10, "b") for _ in range(3)]
            await asyncio.to_thread(wait_until, lambda: sessions[0].connected
                                    and sessions[0].session_id != old_session, 15,
                                    "A to get a new session")

            result = await store_a.write(stale.expected_version, stale.data)
            assert isinstance(result, WriteConflict), result  # the version moved on
            action = machine.on_write_conflict()
            while not isinstance(action, Done):
                if isinstance(action, Read):
                    action = machine.on_read(Snapshot.parse(*await store_a.read()), "nonce-a-2")
                else:
                    outcome = await store_a.write(action.expected_version, action.data)
                    assert isinstance(outcome, WriteOk), outcome
                    action = machine.on_write_ok(outcome.version)
            mine = action.results[0]
            assert stale.results[0] == taken[0]  # what A planned went to B, legitimately
            assert not any(mine.overlaps(t) for t in [first, *taken]) and mine.first > taken[-1].last
        finally:
            await b.stop()
            for session in sessions:
                await asyncio.to_thread(session.stop)

    asyncio.run(scenario())


# ------------------------------------------------------------------ 200 concurrent users
def test_two_hundred_concurrent_pool_users_get_distinct_ids(ida):
    addresses = [ida.address("ida-0"), ida.address("ida-1")]
    barrier = threading.Barrier(200)
    taken: list[list[int]] = [[] for _ in range(200)]
    failures: list[BaseException] = []

    def producer(index: int) -> None:
        try:
            with ProducerIdPool(addresses, block_size=5, requester=f"u{index}",
                                policy=RetryPolicy(call_timeout_s=10)) as pool:
                barrier.wait(timeout=30)
                taken[index] = [pool.next_id() for _ in range(7)]  # crosses a block boundary
                assert pool.blocks_fetched == 2
        except BaseException as error:  # noqa: BLE001 — reported below
            failures.append(error)

    threads = [threading.Thread(target=producer, args=(i,)) for i in range(200)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not failures, failures[:3]
    ids = [i for t in taken for i in t]
    assert len(ids) == 1_400 and len(set(ids)) == 1_400 and min(ids) >= 1
    for t in taken:
        assert t == sorted(t)

    async def async_users() -> list[int]:
        async def user(index: int) -> list[int]:
            pool = AsyncProducerIdPool(addresses, block_size=3, requester=f"a{index}")
            try:
                return [await pool.next_id() for _ in range(4)]
            finally:
                await pool.close()

        results = await asyncio.gather(*(user(i) for i in range(200)))
        return [i for r in results for i in r]

    async_ids = asyncio.run(async_users())
    assert len(set(async_ids)) == 800 and not set(async_ids) & set(ids)


# ------------------------------------------------------------------ the shell, in-process
def in_process(ida, chroot: str, scenario, **changes: int) -> None:
    """Run scenario(allocator, session) against the real ZooKeeper under its own chroot."""

    async def run():
        session = ZkSession(ida.file.zookeeper, chroot, SESSION_TIMEOUT_MS, 10_000)
        await asyncio.to_thread(session.start)
        allocator = Allocator(ZkBlockStore(session, 5.0), "local", AllocatorSettings.defaults(**changes))
        allocator.start()
        try:
            await scenario(allocator, session)
        finally:
            await allocator.stop()
            await asyncio.to_thread(session.stop)

    asyncio.run(run())


def test_queue_bound_batching_and_stop(ida):
    async def scenario(allocator: Allocator, session: ZkSession):
        results = await asyncio.gather(*(allocator.allocate(5, f"r{i}") for i in range(12)),
                                       return_exceptions=True)
        refused = [r for r in results if isinstance(r, AtomlogError)]
        blocks = sorted(r for r in results if isinstance(r, Block))
        assert len(blocks) == 8 and len(refused) == 4  # the queue holds 8
        assert {e.reason for e in refused} == {"RESOURCE_EXHAUSTED"}
        assert refused[0].metadata["limit"] == "id_allocator.max_pending_requests"
        assert blocks == [Block(1 + 5 * i, 5 + 5 * i) for i in range(8)]
        snapshot = await allocator.describe()
        assert snapshot.version == 1 and snapshot.record.blocks == 4  # create + set, 4 requests each
        assert Snapshot.parse(*await allocator.store.read(sync=True)) == snapshot
        assert allocator.blocks_issued == 8
        await allocator.stop()
        with pytest.raises(AtomlogError) as raised:
            await allocator.allocate(1)
        assert raised.value.reason == "SHUTTING_DOWN"

    in_process(ida, "/atomlog-queue", scenario, max_pending_requests=8, max_requests_per_write=4)


def test_corrupt_or_exhausted_znode_fails_closed_and_is_left_alone(ida):
    async def scenario(allocator: Allocator, session: ZkSession):
        client = session.client
        await asyncio.to_thread(client.create, "/producer_id_block", b"not json")
        with pytest.raises(AtomlogError) as raised:
            await allocator.allocate(1)
        assert raised.value.reason == "PRODUCER_ID_BLOCK_CORRUPT"
        assert (await asyncio.to_thread(client.get, "/producer_id_block"))[0] == b"not json"

        near_end = Snapshot.parse(b'{"version":1,"last_block":{"first":1,"last":%d},"blocks":1,'
                                  b'"owner":"x","requester":"","nonce":"n"}' % (2**63 - 11), 0)
        await asyncio.to_thread(client.set, "/producer_id_block", near_end.record.to_bytes())
        assert await allocator.allocate(10) == Block(2**63 - 10, 2**63 - 1)
        with pytest.raises(AtomlogError) as raised:
            await allocator.allocate(1)
        assert raised.value.reason == "PRODUCER_ID_SPACE_EXHAUSTED" and not raised.value.retriable

        await asyncio.to_thread(client.delete, "/producer_id_block")  # an operator's mistake
        with pytest.raises(AtomlogError) as raised:
            await allocator.allocate(1)
        assert raised.value.reason == "PRODUCER_ID_BLOCK_CORRUPT"
        assert "went backwards" in raised.value.message
        assert not await asyncio.to_thread(client.exists, "/producer_id_block")

    in_process(ida, "/atomlog-corrupt", scenario)


def test_pool_fails_over_a_dead_allocator_and_raises_fatal_errors_at_once(ida):
    live = ida.address("ida-0")
    policy = RetryPolicy(max_attempts=4, call_timeout_s=2, backoff_initial_s=0.01)
    with ProducerIdPool(["127.0.0.1:1", live], block_size=3, policy=policy) as pool:
        ids = [pool.next_id() for _ in range(10)]
    assert len(set(ids)) == 10 and ids == sorted(ids)
    with ProducerIdPool([live], block_size=2_000_000, policy=policy) as pool:
        began = time.monotonic()
        with pytest.raises(AtomlogError) as raised:
            pool.next_id()
        assert raised.value.reason == "INVALID_ARGUMENT" and time.monotonic() - began < 1
