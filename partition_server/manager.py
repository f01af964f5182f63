"""All partitions of one server: which it owns (from ZooKeeper), their owners, and the
periodic chores (producer expiry, retention).

Replicated partitions (docs/replication.md) are steered one task per partition at a time:
from the partition's state and the live servers, the replica here becomes the leader (a
PartitionOwner with a LeaderReplication), a follower of the current leader (a Follower),
or runs an election when the leader is gone. Every change of state or membership steers
again; a leadership or a follower whose epoch is past is closed before the next opens."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import re
import shutil
import time
from pathlib import Path

from kazoo.exceptions import ConnectionLoss, NoNodeError

from atomlog.v1 import partition_pb2
from partition_server import metrics as m
from partition_server import copies, partition_states, producer_state, txn_buffer
from partition_server.log import DATA_LOSS_FILE, DataLoss, encode_data_loss
from partition_server.snapshot_files import fsync_directory, make_directory, write_atomically
from partition_server.assignments import Assignments
from partition_server.owner import OwnerSettings, PartitionOwner, State
from partition_server.replica import Follower, LeaderFetcher, LeaderReplication, ReplicaStub
from partition_server.replication import catching_up
from partition_server.wal import WriteAheadLog
from services import failpoints, local
from services.errors import AtomlogError
from services.logs import event
from services.zk import SERVERS_PATH, aio

log = logging.getLogger("atomlog.partition.manager")

OPEN_CONCURRENCY = 4  # partitions recovering at once at start-up
CHORE_INTERVAL_S = 30.0  # storage.retention_check_interval_ms's default
# Topic settings (CreateTopic config) that override the server's storage defaults.
# cleanup.policy=compact needs nothing here: see docs/record-format.md on compaction.
TOPIC_LOG_SETTINGS = {"segment.bytes": "segment_bytes", "segment.ms": "segment_ms",
                      "retention.bytes": "retention_bytes", "retention.ms": "retention_ms"}


PARTITION_SERVICE = partition_pb2.DESCRIPTOR.services_by_name["PartitionService"].full_name
REPLICA_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
]
STEER_RETRY_S = 0.5
OPEN_RETRY_FIRST_S = 0.5
LOST_SUFFIX = ".lost-"  # a lost copy's DATA_LOSS directory while it is built (_mark_lost)
# A copy being deleted (_delete_copy) or a lost one's directory being built (_mark_lost):
# its name, a dot and the time in ns, 19 digits, which no partition's number has.
LEFTOVER = re.compile(r"\.(deleted|lost)-[0-9]{19}$")
OPEN_RETRY_MAX_S = 30.0


@dataclasses.dataclass(frozen=True)
class ReplicationSettings:
    max_lag_ms: int = 10_000
    fetch_wait_ms: int = 2_000
    follower_direct_io: bool = True
    link: bool = True  # followers use their leaders' replication links (copy_link.py)
    fetch_sessions: bool = True  # followers' calls name what changed (replica.LeaderFetcher)

    def __post_init__(self) -> None:
        # An idle follower shows it is caught up once per call: several per max_lag_ms.
        object.__setattr__(self, "fetch_wait_ms", min(self.fetch_wait_ms, self.max_lag_ms // 3))


def forget_owner_snapshots(directory: Path) -> int:
    """A replica that starts following may cut its log back to the leader's history, so
    producer-state and transaction-buffer snapshots it wrote as a leader may describe
    records that will not be there: delete them all (a follower writes none; promoted, it
    rebuilds both from its log). Returns how many went."""
    removed = 0
    if not directory.is_dir():
        return 0
    for path in directory.iterdir():
        if producer_state.parse_snapshot_file_name(path.name) is not None or \
                txn_buffer.parse_snapshot_file_name(path.name) is not None:
            path.unlink()
            removed += 1
    if removed:
        fsync_directory(directory)
    return removed


SERVER_FILE = "server.json"  # the data directory's owner: {"server_name": ...}


def claim_data_directory(data_dir: Path, server_name: str) -> None:
    """The data directory belongs to one server name, recorded at its first start. A
    server started on another server's directory (a host renamed, a container recreated
    without its fixed name, a mistyped name, a volume swapped) took every replicated
    copy in it for one removed by a reassignment and deleted it at start; now it refuses
    to start (`cannot start`, INVALID_ARGUMENT). A directory from before this file
    existed is claimed as it is."""
    path = data_dir / SERVER_FILE
    try:
        recorded = json.loads(path.read_bytes()).get("server_name")
    except FileNotFoundError:
        write_atomically(path, json.dumps({"server_name": server_name,
                                           "claimed_unix_ms": int(time.time() * 1000)},
                                          sort_keys=True).encode())
        return
    except (ValueError, AttributeError) as error:
        raise AtomlogError("INVALID_ARGUMENT", f"{path} is unreadable ({error}): whose data "
                           "directory this is cannot be told; repair or remove the file",
                           {"field": "server.name"}) from None
    if recorded != server_name:
        raise AtomlogError(
            "INVALID_ARGUMENT", f"data directory {data_dir} belongs to server {recorded!r} "
            f"({path}); this server is named {server_name!r}. Started here it would take "
            "that server's copies for its own or delete them: start it with "
            f"server.name={recorded!r}, or give it a data directory of its own",
            {"field": "server.name", "recorded": str(recorded)})


def _delete_copy(directory: Path) -> None:
    """Delete a partition's directory: renamed first (one atomic step, so a crash leaves
    either the whole copy or a `.deleted` directory nobody opens), then removed."""
    doomed = directory.with_name(f"{directory.name}.deleted-{time.time_ns()}")
    directory.rename(doomed)
    fsync_directory(directory.parent)
    shutil.rmtree(doomed, ignore_errors=True)


class NotOwner(Exception):
    def __init__(self, owner: str | None):
        self.owner = owner


class PartitionManager:
    def __init__(self, data_dir: Path, server_name: str, zk, settings: OwnerSettings,
                 coordinator_epochs=None, replication: ReplicationSettings | None = None,
                 wal: WriteAheadLog | None = None,
                 chore_interval_s: float = CHORE_INTERVAL_S):
        self.data_dir = data_dir
        # How often retention and producer expiry run over the partitions here
        # (storage.retention_check_interval_ms).
        self.chore_interval_s = chore_interval_s
        # partition.durability=wal: the server's write-ahead file (partition_server/wal.py),
        # replayed at start before any partition opens
        self.wal = wal
        self.coordinator_epochs = coordinator_epochs
        self.server_name = server_name
        self.zk = zk
        self.settings = settings
        self.owners: dict[tuple[str, int], PartitionOwner] = {}
        # Unregistered by close(): a closed manager's owners are never scraped again (and a
        # manager made and closed within one process, as the tests do, leaves nothing behind).
        self._collectors = [m.register_state_collector(lambda: self.owners.values())]
        self.assignments: Assignments | None = None
        self._opening: set[tuple[str, int]] = set()
        self._semaphore = asyncio.Semaphore(OPEN_CONCURRENCY)
        self._tasks: set[asyncio.Task] = set()
        self._first_attempts: set[asyncio.Future] = set()
        self._chores: asyncio.Task | None = None
        self.replication = replication or ReplicationSettings()
        self.followers: dict[tuple[str, int], Follower] = {}
        # One per leader this server follows partitions of (its address may change on a
        # restart: the key has both): a single ReplicateMany carries them all.
        self.fetchers: dict[tuple[str, str, str], LeaderFetcher] = {}
        self._steering: dict[tuple[str, int], asyncio.Task] = {}
        self._dirty: set[tuple[str, int]] = set()
        self._closing = False
        # Replicated partitions are steered only once this server has left their ISRs at
        # start (else a leadership from its previous life would reopen meanwhile).
        self._isrs_left = False
        self._copies_at_start: set[str] = set()  # partition directories found at start
        self.incarnation = 0  # set at start (`begin_incarnation`), before any follower runs
        self._stubs = local.StubCache(PARTITION_SERVICE, ReplicaStub, REPLICA_CHANNEL_OPTIONS)
        self._collectors.append(m.register_replication_collector(self))

    async def start(self) -> None:
        make_directory(self.data_dir)
        await asyncio.to_thread(claim_data_directory, self.data_dir, self.server_name)
        # The copies this server starts with, before anything here creates one: a replica
        # in an ISR without its directory lost its copy (_leave_isrs).
        self._copies_at_start = set(os.listdir(self.data_dir))
        # What a crash left of _delete_copy and _mark_lost. (By the whole pattern: a glob
        # of "*.deleted-*" also took the copy of a topic named "orders.deleted".)
        for leftover in [path for path in self.data_dir.iterdir()
                         if LEFTOVER.search(path.name)]:
            await asyncio.to_thread(shutil.rmtree, leftover, True)
        if self.wal is not None:
            # Before anything opens: what the frames hold goes back into the partitions'
            # files (a power cut may have left them behind), fsynced; then a new file.
            await asyncio.to_thread(self.wal.recover_all, self.data_dir, self.settings.log)
            await self.wal.start()
        loop = asyncio.get_running_loop()
        self.assignments = Assignments(self.zk, self.server_name, loop, self._reconcile)
        await asyncio.to_thread(self.assignments.start)
        await self.assignments.ready.wait()
        # First of all: this process's incarnation, which every fetch it makes names, so
        # that no fetch of an earlier process of this name (in flight when it died) can
        # bring this one into an ISR (docs/replication.md, "Incarnations").
        # Both ride out a ZooKeeper blip (chaos seed 2806: a combined server started
        # again after a kill lost its session here and exited).
        self.incarnation = await asyncio.to_thread(
            self.zk.patiently, "the server's incarnation", partition_states.begin_incarnation,
            self.zk.client, self.server_name,
            {"pid": os.getpid(), "started_unix_ms": int(time.time() * 1000)})
        event(log, "incarnation", server=self.server_name, incarnation=self.incarnation)
        await asyncio.to_thread(self.zk.patiently, "leaving the ISRs",
                                self._leave_isrs)  # before this server registers
        await asyncio.to_thread(self._sweep_removed_copies)
        self._isrs_left = True
        self._reconcile()  # now its replicated partitions may be steered
        # The first attempt of every open (a failing one goes on retrying in the background).
        await asyncio.gather(*list(self._first_attempts))
        self._chores = asyncio.create_task(self._run_chores(), name="partition chores")

    def _reconcile(self) -> None:
        """Open every newly owned partition (in the background)."""
        for key in self.assignments.owned():
            if key in self.owners or key in self._opening:
                continue
            self._opening.add(key)
            attempted = asyncio.get_running_loop().create_future()
            self._first_attempts.add(attempted)
            attempted.add_done_callback(self._first_attempts.discard)
            task = asyncio.create_task(self._open(*key, attempted),
                                       name=f"open {key[0]}-{key[1]}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            task.add_done_callback(lambda _t, f=attempted: f.done() or f.set_result(None))
        self._apply_topic_settings()
        if not self._isrs_left:
            return
        here = set(self.assignments.replicated_here())
        # ... and replicas a reassignment took away from this server (they go).
        for key in here | self._replicas_held() - here:
            self._steer(key)

    def _apply_topic_settings(self) -> None:
        """Topic settings changed since a partition opened (AlterTopicConfig) reach its
        open owner: its log's retention and segment settings, and a leader's
        min.insync.replicas."""
        configs: dict[str, object] = {}  # each topic's log settings, made once a call
        for (topic, partition), owner in list(self.owners.items()):
            record = self.assignments.topic(topic)
            if record is None:
                continue
            config = configs.get(topic)
            if config is None:
                config = configs[topic] = self._settings_for(topic).log
            if owner.reconfigure_log(config):
                event(log, "topic settings applied", partition=f"{topic}-{partition}",
                      config=record.config)
                # A retention made shorter deletes now, not at the next chores' round.
                task = asyncio.create_task(self._retention_now(owner),
                                           name=f"retention {topic}-{partition}")
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            leading = owner.replication
            if leading is not None and leading.progress.min_insync != record.min_insync_replicas:
                event(log, "min.insync.replicas applied", partition=f"{topic}-{partition}",
                      before=leading.progress.min_insync, after=record.min_insync_replicas)
                leading.progress.min_insync = record.min_insync_replicas

    @staticmethod
    async def _retention_now(owner: PartitionOwner) -> None:
        try:
            await owner.apply_retention()
        except Exception:  # noqa: BLE001 — logged; the chores try again
            log.exception("retention failed on %s", owner.name)

    def _replicas_held(self) -> set[tuple[str, int]]:
        return set(self.followers) | {k for k, o in self.owners.items()
                                      if o.replication is not None}

    def _settings_for(self, topic: str) -> OwnerSettings:
        """Server defaults, overridden by the topic's own settings (CreateTopic config)."""
        record = self.assignments.topic(topic) if self.assignments else None
        overrides = {field: int(record.config[key]) for key, field in TOPIC_LOG_SETTINGS.items()
                     if record is not None and key in record.config}
        if not overrides:
            return self.settings
        return dataclasses.replace(self.settings,
                                   log=dataclasses.replace(self.settings.log, **overrides))

    async def _open(self, topic: str, partition: int, attempted: asyncio.Future) -> None:
        """Open an unreplicated partition assigned here; when that fails (a full disk, an
        unreadable file) try again with backoff while it stays assigned here — a partition
        left LOADING for good would hang every transaction touching it."""
        key, delay = (topic, partition), OPEN_RETRY_FIRST_S
        try:
            while not self._closing:
                try:
                    await self._open_owner(topic, partition)
                    return
                except Exception as error:  # noqa: BLE001 — logged; tried again
                    event(log, "cannot open partition; retrying", logging.ERROR,
                          partition=f"{topic}-{partition}", retry_in_seconds=delay,
                          error=f"{type(error).__name__}: {error}")
                finally:
                    if not attempted.done():
                        attempted.set_result(None)
                await asyncio.sleep(delay)
                delay = min(delay * 2, OPEN_RETRY_MAX_S)
                if key not in self.assignments.owned():
                    return
                failed = self.owners.get(key)
                if failed is None:
                    continue  # it failed before its owner existed (its copy's record)
                if failed.state.value != "LOADING":
                    return
                del self.owners[key]
                try:
                    await failed.close()
                except Exception as error:  # noqa: BLE001 — the next attempt opens anew
                    # (Its log's last fsync or recovery point, on the disk that failed
                    # the open.) Before, this ended the task: the partition stayed
                    # "assigned here, being opened" until some ZooKeeper change
                    # reconciled it, and every transaction touching it waited.
                    event(log, "a partition that failed to open did not close cleanly",
                          logging.WARNING, partition=f"{topic}-{partition}",
                          error=f"{type(error).__name__}: {error}")
        finally:
            self._opening.discard(key)

    async def _open_owner(self, topic: str, partition: int,
                          replication: LeaderReplication | None = None) -> PartitionOwner:
        """Open one partition's owner (visible as LOADING meanwhile); raises if it fails,
        leaving it there LOADING (the caller retries or closes it)."""
        if replication is None:  # one copy: its directory is recorded before it serves
            await asyncio.to_thread(self.zk.patiently, "the partition's copy record",
                                    self._own_copy, topic, partition)
        epochs = self.coordinator_epochs
        # The server's coordinator epochs fence staged batches in the owner's write step
        # (atomic with their append: ResolveStaged's fence cannot be overtaken).
        owner = PartitionOwner(topic, partition, self.data_dir / f"{topic}-{partition}",
                               self._settings_for(topic),
                               coordinator_epoch=epochs.current if epochs else None,
                               wal=self.wal)
        if replication is not None:
            owner.replication = replication
            replication.owner = owner
        self.owners[(topic, partition)] = owner  # visible as LOADING meanwhile
        if epochs is not None:
            # Markers this partition wrote are durable in its log: their epochs fence
            # deposed coordinators even if ZooKeeper's /tc/<k> lags. Learned whenever its
            # transaction buffer is ready (at start, or after a background replay).
            def observe(txns) -> None:
                for tc, epoch in txns.coordinator_epochs().items():
                    epochs.observe(tc, epoch)

            owner.on_txns_ready = observe
        async with self._semaphore:
            await owner.start()
        return owner

    def _own_copy(self, topic: str, partition: int) -> None:
        """Before an unreplicated partition opens (partition_server/copies.py): a new one
        gets its directory, fsynced in its parent, and then its record in ZooKeeper, so
        that it never serves unrecorded; one recorded here whose directory is gone opens
        in DATA_LOSS (`_mark_lost`) instead of empty."""
        record = self.assignments.topic(topic)
        created = record.created_unix_ms if record is not None else 0
        directory = self.data_dir / f"{topic}-{partition}"
        recorded = copies.read(self.zk.client, topic, partition)
        # (Something else in its place is not a lost copy: the open fails, and is retried.)
        verdict = copies.verdict(os.path.lexists(directory), recorded, self.server_name,
                                 created)
        if verdict is copies.Verdict.OPEN:
            return
        if verdict is copies.Verdict.LOST:
            self._mark_lost(directory, recorded)
            return
        if not os.path.lexists(directory):
            make_directory(directory)
        copies.record(self.zk.client, topic, partition, self.server_name, created)

    def _mark_lost(self, directory: Path, recorded: dict) -> None:
        """Make the lost copy's directory holding only a DATA_LOSS marker (at offset 0, naming
        the marker itself), whole or not at all: built aside, then renamed into place."""
        aside = directory.with_name(f"{directory.name}{LOST_SUFFIX}{time.time_ns()}")
        aside.mkdir()
        write_atomically(aside / DATA_LOSS_FILE, encode_data_loss(DataLoss(
            str(directory / DATA_LOSS_FILE), 0, 0, copies.lost_detail(recorded),
            int(time.time() * 1000))))
        aside.rename(directory)
        fsync_directory(self.data_dir)
        event(log, "partition's only copy is lost: its directory was missing when it opened",
              logging.ERROR, partition=directory.name, recorded=recorded)

    # ------------------------------------------------------------------ replicated partitions
    def _steer(self, key: tuple[str, int]) -> None:
        if self._closing:
            return
        if key in self._steering:
            self._dirty.add(key)  # the running task steers once more
            return
        task = asyncio.create_task(self._steer_loop(key), name=f"steer {key[0]}-{key[1]}")
        self._steering[key] = task

    async def _steer_loop(self, key: tuple[str, int]) -> None:
        try:
            while not self._closing:
                self._dirty.discard(key)
                try:
                    await self._steer_once(key)
                except asyncio.CancelledError:
                    raise
                except Exception:  # noqa: BLE001 — ZooKeeper or disk trouble: again soon
                    log.exception("steering %s-%s failed; retrying", *key)
                    self._dirty.add(key)
                    await asyncio.sleep(STEER_RETRY_S)
                if key not in self._dirty:
                    return
        finally:
            self._steering.pop(key, None)

    async def _steer_once(self, key: tuple[str, int]) -> None:
        topic, partition = key
        record = self.assignments.topic(topic)
        known = self.assignments.state(key)
        if record is None or known is None:
            return
        replicas = record.replicas_of(partition)
        me = self.server_name
        if me not in replicas:
            await self._remove_replica(key)
            return
        state = known.state
        live = self.assignments.live()
        target = record.reassigning.get(partition)
        if state.leader != me and (state.leader is None or state.leader not in live):
            # (A leader here whose own registration is missing goes on: it is being
            # re-created after a lost session, or others elect and its state changes.)
            await self._step_down(key)  # a leadership here is over (or never began)
            if me in live:
                election, _now = await asyncio.to_thread(
                    partition_states.try_elect, self.zk.client, topic, partition, replicas,
                    live, unclean_allowed=record.unclean_election)
                if election is not None:
                    m.LEADER_ELECTIONS.labels(str(election.unclean).lower()).inc()
                    event(log, "leader elected", logging.WARNING if election.unclean
                          else logging.INFO, partition=f"{topic}-{partition}",
                          leader=election.state.leader, epoch=election.state.leader_epoch,
                          isr=list(election.state.isr), unclean=election.unclean,
                          previous_leader=state.leader)
            return  # the state's watch steers again
        if state.leader == me:
            owner = self.owners.get(key)
            leading = owner.replication if owner is not None else None
            if leading is not None and leading.epoch == state.leader_epoch \
                    and leading.fenced is None:
                if known.version > leading.known.version:  # e.g. a replica left the ISR
                    leading.known = known
                    leading.isr_changed(known.state.isr)
                    owner.replicated()
                leading.reassigned(replicas, target, record.throttle_of(partition))
                return
            known_hw = 0
            follower = self.followers.pop(key, None)
            if follower is not None:
                known_hw = follower.known_hw
                await follower.close()
            await self._step_down(key)
            replication = LeaderReplication(
                topic, partition, me, known, replicas, record.min_insync_replicas,
                self.replication.max_lag_ms, known_hw,
                self.data_dir / f"{topic}-{partition}", self._write_isr(topic, partition),
                self.assignments.live, self._complete_reassignment(topic, partition),
                self._resign(topic, partition))
            replication.reassigned(replicas, target, record.throttle_of(partition))
            event(log, "leading", partition=f"{topic}-{partition}",
                  epoch=state.leader_epoch, isr=list(state.isr))
            try:
                await self._open_owner(topic, partition, replication)
            except Exception:
                failed = self.owners.pop(key, None)  # steered again (the loop retries)
                await replication.close()
                if failed is not None:
                    await failed.close()
                raise
            replication.start()
            return
        await self._step_down(key)
        follower = self.followers.get(key)
        if follower is not None and follower.leader == state.leader \
                and follower.epoch == state.leader_epoch:
            return
        known_hw = 0
        if follower is not None:
            known_hw = follower.known_hw  # acknowledged under the previous leader
            del self.followers[key]
            await follower.close()
        address, link = await self._addresses_of(state.leader)
        if not address:
            return  # gone meanwhile: the servers' watch steers again
        settings = self._settings_for(topic)
        await asyncio.to_thread(forget_owner_snapshots, self.data_dir / f"{topic}-{partition}")
        follower = Follower(topic, partition, self.data_dir / f"{topic}-{partition}",
                            settings.log, me, state.leader, address, state.leader_epoch,
                            self._fetcher(state.leader, address, link), fsync=settings.fsync,
                            cursor_limits=settings.cursor_limits, known_hw=known_hw,
                            incarnation=self.incarnation,
                            direct_io=self.replication.follower_direct_io)
        self.followers[key] = follower
        try:
            await follower.start()
        except BaseException:
            # Not kept: the retry would find this leader and epoch followed already and
            # leave the partition with a follower that never fetches.
            if self.followers.get(key) is follower:
                del self.followers[key]
            await follower.close()
            raise

    def leaderships_current(self) -> bool:
        """Every leadership this server holds is still the one ZooKeeper's state names
        (this leader, this epoch): read now, synchronously (on a thread). Asked after a
        stall (partition_server/lease.py); False while any is stale, until steering
        has caught up with the state."""
        for (topic, partition), owner in list(self.owners.items()):
            leading = owner.replication
            if leading is None or leading.fenced is not None:
                continue
            known = partition_states.read(self.zk.client, topic, partition)
            if known.state.leader != self.server_name or \
                    known.state.leader_epoch != leading.epoch:
                return False
        return True

    def _fetcher(self, leader: str, address: str, link: str = "") -> LeaderFetcher:
        key = (leader, address, link)
        fetcher = self.fetchers.get(key)
        if fetcher is None:
            # Leaders gone or moved: nothing left to copy. Not one a follower holds that
            # has not added itself yet (its start is under way): it would run beside the
            # next one made for its leader, two fetchers, each opening its fetch session
            # and closing the other's.
            held = {id(follower.fetcher) for follower in self.followers.values()}
            for stale in [k for k, f in self.fetchers.items() if f.idle and id(f) not in held]:
                del self.fetchers[stale]
            fetcher = self.fetchers[key] = LeaderFetcher(
                self.server_name, address, self._stubs, self.replication.fetch_wait_ms,
                link_address=link if self.replication.link else "",
                sessions=self.replication.fetch_sessions)
        return fetcher

    def _leave_isrs(self) -> None:
        """At start, before registering: out of the ISR of every replica here (see
        partition_states.leave_isr); each rejoins once caught up with its leader. A
        replica whose copy is gone (no directory at start) leaves even where it is the last
        in-sync replica (partition_states.leaving, `copy_lost`)."""
        live = self.assignments.live()
        for topic, partition in self.assignments.replicated_here():
            known = self.assignments.state((topic, partition))
            if known is None or self.server_name not in known.state.isr:
                continue
            record = self.assignments.topic(topic)
            lost = f"{topic}-{partition}" not in self._copies_at_start
            written = partition_states.leave_isr(self.zk.client, topic, partition,
                                                 record.replicas_of(partition),
                                                 self.server_name, live, copy_lost=lost)
            if written is not None:
                event(log, "left the ISR at start", logging.WARNING if lost else logging.INFO,
                      partition=f"{topic}-{partition}", leader=written.state.leader,
                      epoch=written.state.leader_epoch, isr=list(written.state.isr),
                      copy_lost=lost)

    async def _remove_replica(self, key: tuple[str, int]) -> None:
        """A finished reassignment left this server out of the partition's replicas: stop
        following (or leading: the leader handed over in the same write) and delete the
        copy. (Only for a topic record that exists and names other replicas: a record
        being unreadable or missing removes nothing.)"""
        follower = self.followers.pop(key, None)
        if follower is not None:
            await follower.close()
        await self._step_down(key)
        directory = self.data_dir / f"{key[0]}-{key[1]}"
        if directory.exists():
            await asyncio.to_thread(_delete_copy, directory)
            event(log, "replica removed by a reassignment", partition=f"{key[0]}-{key[1]}")

    def _same_leadership(self, topic: str, partition: int, known):
        """After a failed compare-and-set on the partition's state (blocking): the stored
        state when it has the same leader and epoch as `known` (only the ISR moved),
        else None."""
        fresh = partition_states.read(self.zk.client, topic, partition)
        same = (fresh.state.leader, fresh.state.leader_epoch) == \
            (known.state.leader, known.state.leader_epoch)
        return fresh if same else None

    def _complete_reassignment(self, topic: str, partition: int):
        def complete_blocking(known, target: list[str], state):
            try:
                return partition_states.complete_reassignment(
                    self.zk.client, topic, partition, known, target, state)
            except partition_states.StaleState:
                # As for an ISR write: a restarted replica may have taken itself out of the
                # ISR meanwhile; the same leadership goes on from the stored state.
                fresh = self._same_leadership(topic, partition, known)
                if fresh is None:
                    raise
                raise partition_states.IsrMoved(fresh) from None

        async def complete(known, target: list[str], state):
            return await asyncio.to_thread(complete_blocking, known, target, state)
        return complete

    def _resign(self, topic: str, partition: int):
        """How a leadership here gives its epoch up (partition_states.resign): after a
        failed write or fsync, instead of resuming an epoch led before, or to a live
        in-sync replica when its log has corruption before its tail (`heir_only`)."""
        async def resign(epoch: int, heir_only: bool = False):
            record = self.assignments.topic(topic)
            if record is None:
                raise AtomlogError("UNKNOWN_TOPIC_OR_PARTITION", f"no topic {topic!r}")
            stored = await asyncio.to_thread(
                partition_states.resign, self.zk.client, topic, partition,
                record.replicas_of(partition), self.server_name, epoch,
                self.assignments.live(), heir_only=heir_only)
            if stored is None:
                return None  # (heir_only: no other live in-sync replica; nothing written)
            m.LEADER_ELECTIONS.labels("false").inc()
            event(log, "leader epoch given up", logging.WARNING,
                  partition=f"{topic}-{partition}", epoch=epoch,
                  leader=stored.state.leader, new_epoch=stored.state.leader_epoch,
                  isr=list(stored.state.isr))
            return stored
        return resign

    def _sweep_removed_copies(self) -> None:
        """At start: delete the copies of replicated partitions whose topic record no
        longer lists this server (a reassignment completed while it was down), as a
        running server does when it sees the record change. A directory whose topic is
        unknown or unreplicated is left alone."""
        held = set(self.assignments.replicated_here()) | set(self.assignments.owned())
        for directory in self.data_dir.iterdir():
            topic, _, number = directory.name.rpartition("-")
            if not directory.is_dir() or not number.isdigit():
                continue
            record = self.assignments.topic(topic)
            if record is None or not record.replicated or int(number) >= record.partitions \
                    or (topic, int(number)) in held:
                continue
            _delete_copy(directory)
            event(log, "replica removed by a reassignment while this server was down",
                  partition=directory.name)

    async def _step_down(self, key: tuple[str, int]) -> None:
        owner = self.owners.get(key)
        if owner is None or owner.replication is None:
            return
        del self.owners[key]
        await owner.replication.close()
        await owner.close()

    def _write_isr(self, topic: str, partition: int):
        def write_blocking(known, isr: list[str], joining: dict[str, int]):
            try:
                return partition_states.change_isr(self.zk.client, topic, partition, known, isr,
                                                   joining)
            except partition_states.StaleState:
                # A restarted replica may have taken itself out of the ISR meanwhile: the
                # leadership goes on with that ISR (the leader recomputes from it); any
                # other change (a new leader or epoch) ends it.
                fresh = self._same_leadership(topic, partition, known)
                if fresh is None:
                    raise
                return fresh

        async def write(known, isr: list[str], joining: dict[str, int]):
            return await asyncio.to_thread(write_blocking, known, isr, joining)
        return write

    async def _addresses_of(self, server: str) -> tuple[str, str]:
        """A server's gRPC address and its replication link's ("" when it has none), as
        registered; ("", "") when it is not registered (any more). Any other failure to
        read it (ZooKeeper's connection lost, the session expired) raises: the caller's
        steering is retried. (Taken for "not registered", it left a follower steered to
        a new leader without a copier, and nothing steered it again while ZooKeeper
        stayed quiet: its copy stopped for good.)"""
        if failpoints.armed(failpoints.STEER_ZOOKEEPER_LOSS):
            raise ConnectionLoss("steer_zookeeper_loss failpoint (a ZooKeeper blip)")
        try:
            data, _ = await aio(self.zk.client.get_async(f"{SERVERS_PATH}/{server}"))
        except NoNodeError:  # not registered (any more)
            return "", ""
        try:
            entry = json.loads(data or b"{}")
            return str(entry.get("grpc_address", "")), str(entry.get("replication_link", ""))
        except (ValueError, AttributeError):
            return "", ""

    def replication_summary(self) -> dict[str, tuple[int, int, int]]:
        """Per topic: (partitions led here that are under-replicated, partitions with a
        replica here and no leader, largest follower lag in offsets over those led here)."""
        rows: dict[str, list[int]] = {}
        if self.assignments is None:
            return {}
        for key in self.assignments.replicated_here():
            row = rows.setdefault(key[0], [0, 0, 0])
            known = self.assignments.state(key)
            if known is not None and known.state.leader is None:
                row[1] += 1
            owner = self.owners.get(key)
            leading = owner.replication if owner is not None else None
            if leading is not None and leading.fenced is None:
                if leading.under_replicated():
                    row[0] += 1
                row[2] = max([row[2], *leading.progress.lag().values()])
        return {topic: tuple(row) for topic, row in rows.items()}

    def catching_up(self) -> list[tuple[str, int]] | None:
        """The partitions this server holds and cannot serve as it should yet: replicated
        ones whose copy here is not in sync (replication.catching_up) and unreplicated
        ones assigned here that are not open (or still loading). None until start-up has
        left the ISRs. Empty: caught up (the health service `atomlog.caught_up` answers
        SERVING)."""
        if self.assignments is None or not self._isrs_left:
            return None
        assignments = self.assignments
        copies = []
        for key in assignments.replicated_here():
            known = assignments.state(key)
            record = assignments.topic(key[0])
            copies.append((key, known.state if known is not None else None,
                           record is not None and key[1] in record.reassigning))
        behind = catching_up(self.server_name, copies, assignments.live())
        for key in assignments.owned():
            owner = self.owners.get(key)
            if owner is None or owner.state is State.LOADING:
                behind.append(key)
        return sorted(behind)

    def owner(self, topic: str, partition: int) -> PartitionOwner:
        """The owner of a partition hosted here; raise NotOwner / UNKNOWN_TOPIC_OR_PARTITION."""
        found = self.owners.get((topic, partition))
        if found is not None:
            return found
        owner_name = self.assignments.owner_of(topic, partition) if self.assignments else None
        if owner_name == "":
            raise AtomlogError("NOT_PARTITION_OWNER",
                               f"partition {topic}-{partition} has no leader here; it may be "
                               "offline (no in-sync replica alive) or led elsewhere",
                               {"owner": "", "retry_after_ms": "200"})
        if owner_name is None:
            record = self.assignments.topic(topic) if self.assignments else None
            detail = (f"topic {topic!r} has {record.partitions} partitions" if record
                      else f"unknown topic {topic!r}")
            raise AtomlogError("UNKNOWN_TOPIC_OR_PARTITION",
                               f"no partition {topic}-{partition}: {detail}",
                               {"topic": topic, "partition": str(partition)})
        if owner_name == self.server_name:  # assigned here, still being opened
            raise AtomlogError("PARTITION_LOADING", f"partition {topic}-{partition} is opening",
                               {"retry_after_ms": "100"})
        raise NotOwner(owner_name)

    async def _run_chores(self) -> None:
        while True:
            await asyncio.sleep(self.chore_interval_s)
            for owner in list(self.owners.values()):
                try:
                    owner.expire_producers()
                    await owner.apply_retention()
                except Exception:  # noqa: BLE001 — logged, retried next round
                    log.exception("chores failed on %s", owner.name)

    async def close(self) -> None:
        self._closing = True
        m.unregister_collectors(self._collectors)
        if self._chores is not None:
            self._chores.cancel()
        for task in [*self._tasks, *self._steering.values()]:
            task.cancel()
        await asyncio.gather(*self._steering.values(), return_exceptions=True)
        await asyncio.gather(*(o.replication.close() for o in self.owners.values()
                               if o.replication is not None), return_exceptions=True)
        await asyncio.gather(*(f.close() for f in self.followers.values()),
                             return_exceptions=True)
        await asyncio.gather(*(f.close() for f in self.fetchers.values()),
                             return_exceptions=True)
        await asyncio.gather(*(o.close() for o in self.owners.values()), return_exceptions=True)
        if self.wal is not None:
            await self.wal.close()
        await self._stubs.close()
