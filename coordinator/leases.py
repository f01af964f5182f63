"""Leases of TC partitions (transaction-coordinator partitions) through ZooKeeper.

Every coordinator process runs one `LeaseManager`. Between them they hold a lease on
each TC partition 0..N-1 (N = cluster.tc_partitions, fixed in /cluster), spread
evenly over the live coordinators, and a partition moves within seconds when its
holder stops, dies or is paused past its ZooKeeper session.

ZooKeeper layout (under the cluster's chroot):
  /tc/<k>         persistent, {"epoch": E, "log_producer_id": P}
                  E = the last coordinator epoch issued for TC partition k (0 when the
                  znode is created; the first lease gets 1). P = the producer id the
                  holder writes __txn_log-k with: allocated by the first lease, kept for
                  ever (null until then).
  /tc/<k>/owner   ephemeral, {"coordinator_name", "epoch", "acquired_unix_ms"}: the
                  current lease; it dies with its holder's ZooKeeper session.

Acquiring k is ONE multi-op transaction: create the ephemeral /tc/<k>/owner AND set
/tc/<k> to epoch+1 with `version=` the version just read. A concurrent acquirer (the
owner node exists) or a stale read (the version moved) makes the whole transaction
fail: nothing changes. So epochs never go backwards and are never reused, and two
leases of one k never carry the same epoch.

Epoch limit (fail closed): coordinator epochs become the uint16 producer epoch of the
TC log's writes, so the largest epoch issued is 65534 (MAX_EPOCH). A partition whose
epoch has reached it is never leased again: acquiring it is refused and logged as an
error, and the partition stays without an owner until an operator moves the cluster
on. Each lease change costs one epoch: at one change per second that is 18 hours of
continuous flapping, in normal operation many years. The balancer is built not to
flap (below).

Release: the holder calls (and awaits) `on_lost(k)` first, then deletes its owner node
in a transaction that also checks /tc/<k> still has the version its own acquisition
wrote, and only if the node's ephemeralOwner is its session. A new holder can only
begin after the node is gone, so across a planned hand-over the old holder has stopped
before the new one starts. After a session loss or a pause that cannot be promised:
the old holder learns of it late, and fencing by epoch at the log keeps it harmless.

Balancing (every coordinator decides for itself; `Balancer` is the pure core):
- live coordinators L = children of /servers whose data says "role": "coordinator"
  (this one counts even before it has registered); fair share floor(N/L)..ceil(N/L).
- Below floor: take free partitions (no owner node) at once, up to floor.
- From floor to below ceil: take one free partition only after it has been waiting
  for a whole rebalance interval, so a peer below floor gets it first.
- Above ceil: release the highest-numbered partition, one per interval. Above floor
  while a live peer is below floor and nothing is free: the peer holding the most
  (ties to the lowest name) releases one per interval.
- Safety valve against unowned partitions and endless hand-over loops: a partition
  free for `stranded_intervals` intervals while this coordinator is at ceil or above
  (a registered peer that does not take partitions) is taken anyway, and releasing to
  peers then pauses for 30 s, doubling up to an hour, until the live set changes.
Re-evaluated on a watch of /servers, on a watch of every owner node, after every
session change and every `rebalance_interval_ms`.

Sessions: SUSPENDED (connection lost, session maybe alive) changes nothing but stops
acquiring and releasing; LOST (the session expired, every ephemeral node is gone)
calls on_lost for every lease at once; a new session rebalances from scratch.

Callbacks: `on_acquired(lease)` and `on_lost(k)` run as tasks, for one k strictly
alternating (on_acquired, on_lost, on_acquired, ...), for different k concurrently.
If on_acquired raises, the error is logged and the lease is kept: call release(k).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import zlib
from collections import Counter as Tally
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kazoo.client import KazooState
from kazoo.exceptions import BadVersionError, NodeExistsError, NoNodeError
from prometheus_client import Gauge

from services.fastmetrics import Counter
from services.logs import event
from services.zk import SERVERS_PATH, TC_PATH, ZkSession, aio

log = logging.getLogger("atomlog.coordinator.leases")

# Coordinator epochs are written as uint16 producer epochs; 65535 stays unused.
MAX_EPOCH = 65534
REASONS = ("released", "session_lost", "fenced")
# Partitions free this many intervals while we are at our ceiling are taken anyway.
STRANDED_INTERVALS = 3
# After such a take-over, releasing to peers pauses this long (doubling to the max).
SHED_BACKOFF_S = (30.0, 3600.0)
# A balancing pass that takes longer than this is cancelled (and the next one runs).
PASS_TIMEOUT_S = 60.0
# How long stop() waits for a running pass before cancelling it.
STOP_WAIT_S = 5.0

TC_PARTITIONS_OWNED = Gauge("atomlog_coordinator_tc_partitions_owned",
                            "TC partitions this coordinator holds the lease of.")
TC_PARTITIONS = Gauge("atomlog_coordinator_tc_partitions",
                      "The cluster's TC partitions (cluster.tc_partitions, fixed when it was "
                      "created): what the coordinators' owned ones should add up to.")
LEASE_ACQUIRED = Counter("atomlog_coordinator_lease_acquired_total",
                         "TC partition leases acquired.")
LEASE_LOST = Counter("atomlog_coordinator_lease_lost_total",
                     "TC partition leases given up, by reason (released: balancing or stop; "
                     "session_lost: the ZooKeeper session expired; fenced: the holder found "
                     "itself replaced or gave the lease up because it was fenced).",
                     ["reason"])
for _reason in REASONS:
    LEASE_LOST.labels(_reason)


def tc_path(k: int) -> str:
    return f"{TC_PATH}/{k}"


def owner_path(k: int) -> str:
    return f"{TC_PATH}/{k}/owner"


@dataclass(frozen=True)
class Lease:
    tc_partition: int
    epoch: int
    log_producer_id: int


@dataclass(frozen=True)
class Plan:
    """What one coordinator does next: try to take `acquire` (in order), or release one."""

    acquire: tuple[int, ...] = ()
    release: int | None = None
    stranded: bool = False  # the acquisitions are beyond the fair share (safety valve)


def fair_share(partitions: int, coordinators: int) -> tuple[int, int]:
    """(floor, ceil) of partitions per coordinator."""
    return partitions // coordinators, -(-partitions // coordinators)


class Balancer:
    """The balancing rule of one coordinator: observations in, a Plan out. No I/O and no
    clock (`now` is passed in, in seconds), so it can be simulated."""

    def __init__(self, me: str, partitions: int, interval_s: float, *,
                 stranded_intervals: int = STRANDED_INTERVALS,
                 shed_backoff_s: tuple[float, float] = SHED_BACKOFF_S):
        if partitions < 1 or interval_s <= 0:
            raise ValueError("partitions must be >= 1 and interval_s > 0")
        self.me = me
        self.partitions = partitions
        self.interval_s = interval_s
        self.stranded_after_s = stranded_intervals * interval_s
        self.shed_backoff_s = shed_backoff_s
        start = zlib.crc32(me.encode()) % partitions
        # Each coordinator tries free partitions in its own rotation: fewer collisions.
        self.order = [(start + i) % partitions for i in range(partitions)]
        self._membership: frozenset[str] = frozenset()
        self._extra_since: float | None = None
        self._next_release_at = 0.0
        self._shed_paused_until = 0.0
        self._backoff_s = shed_backoff_s[0]
        self._free_since: dict[int, float] = {}

    def plan(self, now: float, live: Iterable[str], owners: Mapping[int, str],
             unavailable: Iterable[int] = ()) -> Plan:
        """live: live coordinator names; owners: k -> holder name for every k with an
        owner node (this coordinator's current leases under `me`, anything else under
        another name); unavailable: partitions this coordinator must not try."""
        members = frozenset(live) | {self.me}
        if members != self._membership:
            self._membership = members
            self._shed_paused_until = 0.0
            self._backoff_s = self.shed_backoff_s[0]
        floor, ceil = fair_share(self.partitions, len(members))
        mine = sorted(k for k, holder in owners.items() if holder == self.me)
        held = len(mine)
        skip = set(unavailable)
        free = [k for k in self.order if k not in owners and k not in skip]
        for k in list(self._free_since):
            if k in owners or k in skip:
                del self._free_since[k]
        for k in free:
            self._free_since.setdefault(k, now)

        if free and held < floor:
            self._extra_since = None
            return Plan(acquire=tuple(free[:floor - held]))
        if free and held < ceil:
            if self._extra_since is None:
                self._extra_since = now
            if now - self._extra_since >= self.interval_s:
                self._extra_since = None
                return Plan(acquire=(free[0],))
            return Plan()
        self._extra_since = None
        stranded = [k for k in free if now - self._free_since[k] >= self.stranded_after_s]
        if stranded:
            return Plan(acquire=(stranded[0],), stranded=True)
        if now < self._next_release_at or now < self._shed_paused_until:
            return Plan()
        counts = Tally(holder for holder in owners.values() if holder in members)
        counts[self.me] = held
        starving = any(counts[c] < floor for c in members if c != self.me)
        top = min(members, key=lambda c: (-counts[c], c))
        if held > ceil or (held > floor and not free and starving and top == self.me):
            self._next_release_at = now + self.interval_s
            return Plan(release=mine[-1])
        return Plan()

    def took_stranded(self, now: float) -> None:
        """A stranded partition was taken: peers do not take what we give; pause releasing."""
        self._shed_paused_until = now + self._backoff_s
        self._backoff_s = min(self._backoff_s * 2, self.shed_backoff_s[1])


@dataclass(frozen=True)
class _Held:
    lease: Lease
    session_id: int
    tc_version: int  # the version of /tc/<k> our acquisition wrote


class LeaseManager:
    """Holds this coordinator's share of the TC partition leases (asyncio; every kazoo
    call is bridged with services.zk.aio, the loop never blocks)."""

    def __init__(self, zk: ZkSession, name: str, tc_partitions: int, *,
                 on_acquired: Callable[[Lease], Awaitable[None]],
                 on_lost: Callable[[int], Awaitable[None]],
                 new_log_producer_id: Callable[[], Awaitable[int]],
                 rebalance_interval_ms: int = 1000):
        if tc_partitions < 1:
            raise ValueError(f"tc_partitions must be >= 1, got {tc_partitions}")
        if rebalance_interval_ms < 1:
            raise ValueError(f"rebalance_interval_ms must be >= 1, got {rebalance_interval_ms}")
        self.zk = zk
        self.name = name
        self.tc_partitions = tc_partitions
        TC_PARTITIONS.set(tc_partitions)
        self.on_acquired = on_acquired
        self.on_lost = on_lost
        self.new_log_producer_id = new_log_producer_id
        self.interval_s = rebalance_interval_ms / 1000
        self.balancer = Balancer(name, tc_partitions, self.interval_s)
        self._held: dict[int, _Held] = {}
        self._releasing: set[int] = set()
        self._refused: set[int] = set()  # epoch limit reached or unreadable: never tried again
        self._chains: dict[int, asyncio.Task] = {}  # the last callback task of each k
        self._tasks: set[asyncio.Task] = set()
        self._generation = 0  # bumped on every session loss
        self._loop: asyncio.AbstractEventLoop | None = None
        self._kicked: asyncio.Event | None = None
        self._runner: asyncio.Task | None = None
        self._stopping = False
        self._lost_race = False
        self._partitions_ready = False  # /tc/<k> for every k, created by the first pass

    # ---- public API ------------------------------------------------------------------

    async def start(self) -> None:
        """Begin balancing in the background; its first pass creates /tc/<k> for every k
        (if missing), and a pass that cannot (ZooKeeper unreachable, the session lost,
        a create refused) fails, is logged, and the next one tries again. start() itself
        touches no znode: a failure there would leave the server without a lease for good."""
        self._loop = asyncio.get_running_loop()
        self._kicked = asyncio.Event()
        self.zk.client.add_listener(self._on_state)
        self._runner = self._loop.create_task(self._run(), name=f"tc-leases-{self.name}")
        self._kick()
        event(log, "tc lease manager started", coordinator=self.name,
              tc_partitions=self.tc_partitions, rebalance_interval_ms=int(self.interval_s * 1000))

    async def stop(self) -> None:
        """on_lost for every lease held, then delete our owner nodes."""
        if self._stopping:
            return
        self._stopping = True
        self.zk.client.remove_listener(self._on_state)
        if self._runner is not None:
            self._kick()
            done, _ = await asyncio.wait([self._runner], timeout=STOP_WAIT_S)
            if not done:
                self._runner.cancel()
                await asyncio.wait([self._runner])
        held = list(self._held.items())
        self._held.clear()
        for k, _ in held:
            self._count_lost("released")
        await asyncio.gather(*(self._lost_callback(k) for k, _ in held))
        # ZooKeeper steps are bounded: with ZooKeeper unreachable the client retries for
        # ever and its calls never answer; our owner nodes are ephemeral, so the session's
        # expiry removes whatever is left.
        cleanup = [asyncio.ensure_future(self._delete_owner(k, h)) for k, h in held]
        if self._tasks:
            cleanup += list(self._tasks)
        if cleanup:
            done, pending = await asyncio.wait(cleanup, timeout=STOP_WAIT_S)
            for task in done:
                if not task.cancelled() and task.exception() is not None:
                    log.warning("a ZooKeeper cleanup failed at stop: %r", task.exception())
            if pending:
                log.warning("%d ZooKeeper cleanups did not finish within %.0f s (ZooKeeper "
                            "unreachable?); the session's expiry removes our owner nodes",
                            len(pending), STOP_WAIT_S)
        try:
            await asyncio.wait_for(self._sweep_orphans(), STOP_WAIT_S)
        except asyncio.TimeoutError:
            log.warning("could not sweep owner nodes within %.0f s (ZooKeeper unreachable?); "
                        "the session's expiry removes them", STOP_WAIT_S)
        if self._chains:
            await asyncio.wait(list(self._chains.values()), timeout=STOP_WAIT_S)
        event(log, "tc lease manager stopped", coordinator=self.name, released=len(held))

    def owned(self) -> dict[int, Lease]:
        return {k: h.lease for k, h in sorted(self._held.items())}

    async def release(self, k: int, *, reason: str = "fenced") -> None:
        """Give k up now: on_lost(k), then delete our owner node if it is still ours.
        reason: "fenced" (the default: the holder found itself fenced) or "released"."""
        if reason not in ("released", "fenced"):
            raise ValueError(f"reason must be 'released' or 'fenced', got {reason!r}")
        await self._give_up(k, reason)

    # ---- balancing -------------------------------------------------------------------

    def _kick(self) -> None:
        if self._kicked is not None:
            self._kicked.set()

    def _kick_threadsafe(self, *_args: Any) -> None:
        loop = self._loop
        if loop is None or loop.is_closed() or self._stopping:
            return
        try:
            loop.call_soon_threadsafe(self._kick)
        except RuntimeError:
            pass  # the loop closed meanwhile

    async def _run(self) -> None:
        assert self._kicked is not None
        while not self._stopping:
            try:
                await asyncio.wait_for(self._kicked.wait(), timeout=self.interval_s)
            except TimeoutError:
                pass
            self._kicked.clear()
            if self._stopping:
                return
            try:
                await asyncio.wait_for(self._pass(), timeout=PASS_TIMEOUT_S)
            except asyncio.CancelledError:
                if self._stopping:
                    return
                raise
            except Exception as error:  # noqa: BLE001 — logged; the next pass retries
                event(log, "tc lease balancing pass failed", logging.WARNING,
                      coordinator=self.name, error=repr(error))

    def _connected(self) -> bool:
        return self.zk.client.state == KazooState.CONNECTED

    async def _pass(self) -> None:
        if not self._connected():
            return  # SUSPENDED or LOST: never acquire or release without a session
        if not self._partitions_ready:
            await self._ensure_partitions()  # raises: this pass fails, the next retries
            self._partitions_ready = True
        generation, session = self._generation, self.zk.session_id
        live, owners = await self._observe(session)
        if self._generation != generation or self.zk.session_id != session or self._stopping:
            return
        plan = self.balancer.plan(time.monotonic(), live, owners, self._refused)
        if plan.release is not None:
            self._spawn(self._give_up(plan.release, "released"))
        self._lost_race = False
        for k in plan.acquire:
            lease = await self._try_acquire(k)
            if lease is None:
                if self._lost_race:
                    self._kick()  # the view was stale: look again now
                break
            if plan.stranded:
                self.balancer.took_stranded(time.monotonic())
                event(log, "took a TC partition no peer took; pausing releases to peers",
                      logging.WARNING, coordinator=self.name, tc_partition=k)

    async def _observe(self, session: int | None) -> tuple[set[str], dict[int, str]]:
        """Live coordinators and the holder of every owned k; our leases that are gone
        are dropped (fenced) and our owner nodes nobody knows of are deleted."""
        client = self.zk.client
        servers = await aio(client.get_children_async(SERVERS_PATH, watch=self._kick_threadsafe))
        reads = await asyncio.gather(
            *(aio(client.get_async(f"{SERVERS_PATH}/{n}")) for n in servers),
            *(aio(client.get_async(owner_path(k), watch=self._kick_threadsafe))
              for k in range(self.tc_partitions)),
            return_exceptions=True)
        live = set()
        for name, result in zip(servers, reads[:len(servers)]):
            if isinstance(result, NoNodeError):
                continue
            if isinstance(result, BaseException):
                raise result
            try:
                if json.loads(result[0] or b"{}").get("role") == "coordinator":
                    live.add(name)
            except (ValueError, AttributeError):
                continue  # not a registration this code can read
        owners: dict[int, str] = {}
        for k, result in enumerate(reads[len(servers):]):
            if isinstance(result, NoNodeError):
                continue
            if isinstance(result, BaseException):
                raise result
            data, stat = result
            held = self._held.get(k)
            if stat.ephemeralOwner == session and session is not None:
                if held is not None and held.session_id == session:
                    owners[k] = self.name
                elif k not in self._releasing:
                    owners[k] = ""  # an acquisition whose answer was lost: give it back
                    self._spawn(self._delete_orphan(k, stat.version))
                else:
                    owners[k] = ""
                continue
            try:
                holder = str(json.loads(data or b"{}").get("coordinator_name", ""))
            except (ValueError, AttributeError):
                holder = ""
            # A holder of our name on another session is a previous incarnation of us.
            owners[k] = holder if holder != self.name else f"{holder} (previous session)"
        for k in list(self._held):
            if owners.get(k) != self.name and k not in self._releasing:
                event(log, "tc lease lost: our owner node is gone or not ours", logging.WARNING,
                      coordinator=self.name, tc_partition=k, epoch=self._held[k].lease.epoch)
                self._drop(k, "fenced")
        return live, owners

    # ---- acquiring and releasing -------------------------------------------------------

    async def _ensure_partitions(self) -> None:
        initial = json.dumps({"epoch": 0, "log_producer_id": None}).encode()
        results = await asyncio.gather(
            *(aio(self.zk.client.create_async(tc_path(k), initial))
              for k in range(self.tc_partitions)),
            return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, NodeExistsError):
                raise result

    def _refuse(self, k: int, message: str, **fields: Any) -> None:
        if k not in self._refused:
            self._refused.add(k)
            event(log, message, logging.ERROR, coordinator=self.name, tc_partition=k, **fields)

    async def _try_acquire(self, k: int) -> Lease | None:
        """One attempt to take k with one transaction; None when it is not ours (lost a
        race: self._lost_race is set; or refused, or an error: logged)."""
        client = self.zk.client
        generation, session = self._generation, self.zk.session_id
        if not self._connected() or session is None or self._stopping:
            return None
        try:
            data, stat = await aio(client.get_async(tc_path(k)))
        except NoNodeError:
            self._refuse(k, "refusing TC partition: its znode is missing", path=tc_path(k))
            return None
        try:
            record = json.loads(data)
            epoch = record["epoch"]
            log_producer_id = record.get("log_producer_id")
            if (not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0
                    or not (log_producer_id is None or isinstance(log_producer_id, int))):
                raise ValueError(f"bad epoch {epoch!r} or log_producer_id {log_producer_id!r}")
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            self._refuse(k, "refusing TC partition: its znode is unreadable",
                         path=tc_path(k), error=str(error))
            return None
        if epoch + 1 > MAX_EPOCH:
            self._refuse(k, "refusing TC partition: its coordinator epoch is exhausted "
                         f"(the limit is {MAX_EPOCH}, a uint16 producer epoch)", epoch=epoch)
            return None
        if log_producer_id is None:
            try:
                log_producer_id = await self.new_log_producer_id()
            except Exception as error:  # noqa: BLE001 — logged; the next pass retries
                event(log, "no producer id for a TC log; not acquiring", logging.WARNING,
                      coordinator=self.name, tc_partition=k, error=repr(error))
                return None
            if not isinstance(log_producer_id, int) or log_producer_id < 0:
                event(log, "new_log_producer_id returned a bad id; not acquiring", logging.ERROR,
                      coordinator=self.name, tc_partition=k, log_producer_id=log_producer_id)
                return None
        if (self._generation != generation or self.zk.session_id != session
                or not self._connected() or self._stopping):
            return None
        new_epoch = epoch + 1
        owner = {"coordinator_name": self.name, "epoch": new_epoch,
                 "acquired_unix_ms": int(time.time() * 1000)}
        transaction = client.transaction()
        transaction.create(owner_path(k), json.dumps(owner).encode(), ephemeral=True)
        transaction.set_data(tc_path(k), json.dumps(
            {**record, "epoch": new_epoch, "log_producer_id": log_producer_id}).encode(),
            version=stat.version)
        results = await aio(transaction.commit_async())
        failures = [r for r in results if isinstance(r, Exception)]
        if failures:
            if any(isinstance(r, (NodeExistsError, BadVersionError)) for r in failures):
                self._lost_race = True
            else:
                event(log, "tc lease transaction failed", logging.WARNING, coordinator=self.name,
                      tc_partition=k, errors=[repr(r) for r in failures])
            return None
        if self._generation != generation or self.zk.session_id != session:
            return None  # the session died meanwhile, and the owner node with it
        lease = Lease(k, new_epoch, log_producer_id)
        self._held[k] = _Held(lease, session, results[1].version)
        TC_PARTITIONS_OWNED.inc()
        LEASE_ACQUIRED.inc()
        event(log, "tc lease acquired", coordinator=self.name, tc_partition=k, epoch=new_epoch,
              log_producer_id=log_producer_id)
        self._chain(k, lambda: self.on_acquired(lease), "on_acquired")
        return lease

    def _count_lost(self, reason: str) -> None:
        TC_PARTITIONS_OWNED.dec()
        LEASE_LOST.labels(reason).inc()

    def _drop(self, k: int, reason: str) -> asyncio.Task | None:
        """Forget lease k (no ZooKeeper call) and run on_lost(k) after its earlier callbacks."""
        held = self._held.pop(k, None)
        if held is None:
            return None
        self._count_lost(reason)
        event(log, "tc lease lost", coordinator=self.name, tc_partition=k,
              epoch=held.lease.epoch, reason=reason)
        return self._chain(k, lambda: self.on_lost(k), "on_lost")

    async def _give_up(self, k: int, reason: str) -> None:
        held = self._held.get(k)
        if held is None:
            return
        self._releasing.add(k)
        try:
            task = self._drop(k, reason)
            if task is not None:
                await asyncio.wait([task])
            try:
                await self._delete_owner(k, held)
            except Exception as error:  # noqa: BLE001 — a later pass deletes it (an orphan)
                event(log, "could not delete our owner node", logging.WARNING,
                      coordinator=self.name, tc_partition=k, error=repr(error))
        finally:
            self._releasing.discard(k)
            self._kick()

    async def _lost_callback(self, k: int) -> None:
        await asyncio.wait([self._chain(k, lambda: self.on_lost(k), "on_lost")])
        event(log, "tc lease released", coordinator=self.name, tc_partition=k)

    async def _delete_owner(self, k: int, held: _Held) -> None:
        """Delete /tc/<k>/owner if it is ours: our session, and /tc/<k> unchanged since
        our acquisition (checked in the same transaction as the delete)."""
        client = self.zk.client
        try:
            _, stat = await aio(client.get_async(owner_path(k)))
        except NoNodeError:
            return
        if stat.ephemeralOwner != held.session_id or self.zk.session_id != held.session_id:
            return
        transaction = client.transaction()
        transaction.check(tc_path(k), held.tc_version)
        transaction.delete(owner_path(k), version=stat.version)
        results = await aio(transaction.commit_async())
        if any(isinstance(r, Exception) for r in results):
            event(log, "owner node not deleted: no longer ours", logging.WARNING,
                  coordinator=self.name, tc_partition=k, errors=[repr(r) for r in results])

    async def _delete_orphan(self, k: int, version: int) -> None:
        event(log, "deleting an owner node of ours that holds no lease", logging.WARNING,
              coordinator=self.name, tc_partition=k)
        try:
            await aio(self.zk.client.delete_async(owner_path(k), version=version))
        except (NoNodeError, BadVersionError):
            pass

    async def _sweep_orphans(self) -> None:
        """Delete every owner node of our session (after stop(): none should be left)."""
        session = self.zk.session_id
        if session is None or not self._connected():
            return
        client = self.zk.client
        reads = await asyncio.gather(
            *(aio(client.exists_async(owner_path(k))) for k in range(self.tc_partitions)),
            return_exceptions=True)
        for k, stat in enumerate(reads):
            if stat is not None and not isinstance(stat, BaseException) \
                    and stat.ephemeralOwner == session:
                try:
                    await self._delete_orphan(k, stat.version)
                except Exception:  # the session's end removes it anyway
                    log.warning("could not delete %s", owner_path(k), exc_info=True)

    # ---- callbacks, tasks, sessions ----------------------------------------------------

    def _chain(self, k: int, call: Callable[[], Awaitable[None]], what: str) -> asyncio.Task:
        """Run call() after every earlier callback of k has finished."""
        previous = self._chains.get(k)
        loop = self._loop or asyncio.get_running_loop()

        async def run() -> None:
            if previous is not None and not previous.done():
                await asyncio.wait([previous])
            try:
                await call()
            except Exception:  # the owner's bug: logged, the ordering is kept
                log.exception("%s(%d) failed in %s", what, k, self.name)

        task = loop.create_task(run(), name=f"tc-lease-{what}-{k}")
        self._chains[k] = task
        return task

    def _spawn(self, coroutine: Awaitable[None]) -> None:
        loop = self._loop or asyncio.get_running_loop()
        task = loop.create_task(coroutine)
        self._tasks.add(task)

        def finished(done: asyncio.Task) -> None:
            self._tasks.discard(done)
            if not done.cancelled() and done.exception() is not None:
                event(log, "tc lease task failed", logging.WARNING, coordinator=self.name,
                      error=repr(done.exception()))

        task.add_done_callback(finished)

    def _on_state(self, state: str) -> None:
        # On kazoo's thread: hop to the loop, never block here.
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._state_changed, state)
        except RuntimeError:
            pass

    def _state_changed(self, state: str) -> None:
        if state == KazooState.LOST:
            self._generation += 1
            if self._held:
                event(log, "zookeeper session lost: every tc lease is gone", logging.WARNING,
                      coordinator=self.name, leases=sorted(self._held))
            for k in list(self._held):
                self._drop(k, "session_lost")
        elif state == KazooState.CONNECTED:
            self._kick()
