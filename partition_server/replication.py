"""Replication of partitions: the rules, as pure functions and small state objects (no I/O,
no asyncio, no ZooKeeper, no clock of their own). docs/replication.md has the protocol the
shells follow; this module decides, they act.

- `assign_replicas` places a topic's replicas (rack aware), `default_replication_factor`
  picks the factor a topic gets when its creator gives none.
- `PartitionState` is what ZooKeeper holds per partition (leader, leader epoch, in-sync
  replicas); it changes only by compare-and-set, through `elect`, `LeaderProgress`'s ISR
  proposals and `with_isr`.
- `LeaderProgress` is the leader's view of its followers: their durable offsets, the high
  watermark (the end of what every in-sync replica holds durably: nothing above it is
  acknowledged or readable), whether writes may be acknowledged (min in-sync replicas),
  and which followers leave or join the ISR.
- `LeaderEpochCache` maps leader epochs to the offset each began at, on every replica, and
  `truncation_step` uses it to cut a follower's log back to the new leader's history
  (leader-epoch truncation, as Kafka's KIP-101/KIP-279 do, not by high watermark alone).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from services.errors import AtomlogError

MAX_REPLICATION_FACTOR = 7
STATE_VERSION = 1
EPOCH_CACHE_VERSION = 1
NO_EPOCH = -1


# ------------------------------------------------------------------ placement

def default_replication_factor(server_count: int) -> int:
    """3 when the cluster has at least 3 partition servers, else every server."""
    return max(1, min(3, server_count))


def validate_replication(factor: int, min_insync: int, server_count: int) -> None:
    if not 1 <= factor <= MAX_REPLICATION_FACTOR:
        raise AtomlogError("INVALID_REPLICATION_FACTOR",
                           f"replication factor {factor}; it must be 1..{MAX_REPLICATION_FACTOR}",
                           {"max": str(MAX_REPLICATION_FACTOR)})
    if factor > server_count:
        raise AtomlogError("INVALID_REPLICATION_FACTOR",
                           f"replication factor {factor} needs {factor} partition servers; "
                           f"{server_count} are registered", {"servers": str(server_count)})
    if not 1 <= min_insync <= factor:
        raise AtomlogError("INVALID_TOPIC_CONFIG",
                           f"min.insync.replicas={min_insync} must be 1..{factor} "
                           "(the replication factor)")


def _rack_interleaved(servers: list[str], racks: Mapping[str, str]) -> list[str]:
    """Servers ordered so that consecutive ones sit on different racks where possible:
    one from each rack in turn (racks by name, servers by name within a rack)."""
    by_rack: dict[str, list[str]] = {}
    for server in sorted(servers):
        by_rack.setdefault(racks.get(server, ""), []).append(server)
    ordered: list[str] = []
    queues = [by_rack[rack] for rack in sorted(by_rack)]
    while any(queues):
        for queue in queues:
            if queue:
                ordered.append(queue.pop(0))
    return ordered


def assign_replicas(partitions: int, servers: Iterable[str], factor: int,
                    racks: Mapping[str, str] | None = None,
                    load: Mapping[str, int] | None = None) -> list[list[str]]:
    """The replicas of each partition, preferred leader first.

    Leaders go round the servers (least loaded first, by `load`: leaderships already held),
    so each server leads partitions//n or one more. Follower i of a partition is the
    (i + shift)-th server after its leader in a rack-interleaved order, where shift grows
    with each full round of leaders: followers of one leader spread over the others
    instead of always landing on its neighbour, and with racks given, a partition's
    replicas take distinct racks while there are racks left (a rack failure takes at most
    one replica of it when there are at least `factor` racks)."""
    servers = sorted(set(servers))
    validate_replication(factor, 1, len(servers))
    racks = racks or {}
    load = load or {}
    ring = _rack_interleaved(servers, racks)
    position = {server: i for i, server in enumerate(ring)}
    leaders_order = sorted(servers, key=lambda s: (load.get(s, 0), position[s]))
    n = len(ring)
    out: list[list[str]] = []
    for p in range(partitions):
        leader = leaders_order[p % n]
        shift = (p // n) % max(1, n - 1)
        replicas = [leader]
        used_racks = {racks.get(leader, "")}
        candidates = [ring[(position[leader] + 1 + (shift + j) % (n - 1)) % n]
                      for j in range(n - 1)] if n > 1 else []
        # Distinct racks first, then anything left (fewer racks than replicas).
        for candidate in candidates:
            if len(replicas) == factor:
                break
            if racks.get(candidate, "") not in used_racks:
                replicas.append(candidate)
                used_racks.add(racks.get(candidate, ""))
        for candidate in candidates:
            if len(replicas) == factor:
                break
            if candidate not in replicas:
                replicas.append(candidate)
        out.append(replicas)
    return out


# ------------------------------------------------------------------ partition state

@dataclass(frozen=True)
class PartitionState:
    """What ZooKeeper stores for one partition. `leader` None: offline (no in-sync replica
    is alive). Every change bumps nothing but what it changes; a new leader always comes
    with a new `leader_epoch`. The znode's version is the compare-and-set token."""

    leader: str | None
    leader_epoch: int
    isr: tuple[str, ...]

    def __post_init__(self):
        if self.leader_epoch < 0:
            raise ValueError(f"leader epoch {self.leader_epoch} < 0")
        if len(set(self.isr)) != len(self.isr):
            raise ValueError(f"in-sync replicas repeat: {self.isr}")
        if self.leader is not None and self.leader not in self.isr:
            raise ValueError(f"leader {self.leader} is not in the ISR {self.isr}")

    def to_json(self) -> bytes:
        return json.dumps({"version": STATE_VERSION, "leader": self.leader,
                           "leader_epoch": self.leader_epoch, "isr": list(self.isr)},
                          separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes, replicas: Iterable[str] | None = None) -> "PartitionState":
        try:
            raw = json.loads(data)
            if raw.get("version") != STATE_VERSION:
                raise ValueError(f"version {raw.get('version')!r}")
            state = cls(raw["leader"], int(raw["leader_epoch"]),
                        tuple(str(r) for r in raw["isr"]))
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise ValueError(f"unreadable partition state {data[:200]!r}: {error}") from None
        if replicas is not None and not set(state.isr) <= set(replicas):
            raise ValueError(f"ISR {state.isr} names servers outside the replicas "
                             f"{list(replicas)}")
        return state

    def with_isr(self, isr: Iterable[str]) -> "PartitionState":
        return PartitionState(self.leader, self.leader_epoch, tuple(isr))


def initial_state(replicas: list[str], live: Iterable[str]) -> PartitionState:
    """A new partition: every replica is in sync (all logs are empty); the first live
    replica leads in epoch 0 (offline if none is live)."""
    live = set(live)
    leader = next((r for r in replicas if r in live), None)
    return PartitionState(leader, 0, tuple(replicas))


def catching_up(me: str, copies: Iterable[tuple[object, "PartitionState | None", bool]],
                live: Iterable[str]) -> list:
    """The keys of `copies` ((key, its state or None when not read yet, whether a
    reassignment runs) of the replicated partitions holding a copy on server `me`) whose
    copy here is not yet in sync: `me` is not in the ISR while a live leader serves the
    partition, or its state is not known yet. Not counted: a partition without a live
    leader (there is nothing to copy from: a server waiting for it would wait for ever,
    and an offline partition has its own alert), and one under reassignment (its copies
    come and go at the pace the operator chose). A restarted server leaves its ISRs
    first, so this lists what it still has to copy before it is ready
    (docs/operations.md, "Rolling restarts and upgrades")."""
    live = set(live)
    behind = []
    for key, state, reassigning in copies:
        if reassigning:
            continue
        if state is None:
            behind.append(key)
        elif me not in state.isr and state.leader is not None and state.leader in live \
                and state.leader != me:
            behind.append(key)
    return behind


@dataclass(frozen=True)
class Election:
    state: PartitionState
    unclean: bool  # the leader came from outside the ISR: acknowledged writes may be lost


def elect(state: PartitionState, replicas: list[str], live: Iterable[str], *,
          unclean_allowed: bool = False) -> Election | None:
    """A new leader for a partition whose leader is gone (not in `live`), or None when the
    current leader is alive or no replica may lead.

    Clean: the first live in-sync replica in replica order (the preferred leader when it
    is in sync); the ISR keeps its live members (a dead one rejoins by catching up). With
    no live in-sync replica the partition goes offline (leader None, same epoch bumped, so
    a returning old leader cannot take over without an election) — unless unclean election
    is allowed for the topic: then the first live replica leads alone, and everything
    acknowledged that it lacks is lost (the caller must say so)."""
    live = set(live)
    if state.leader is not None and state.leader in live:
        return None
    in_sync_live = [r for r in replicas if r in state.isr and r in live]
    if in_sync_live:
        leader = in_sync_live[0]
        return Election(PartitionState(leader, state.leader_epoch + 1, tuple(in_sync_live)),
                        False)
    if unclean_allowed:
        leader = next((r for r in replicas if r in live), None)
        if leader is not None:
            return Election(PartitionState(leader, state.leader_epoch + 1, (leader,)), True)
    if state.leader is None:
        return None  # offline already
    # Keep the ISR (the replicas that hold everything acknowledged): the first of them to
    # come back leads. An empty ISR would forget which replicas may lead cleanly.
    remaining = tuple(r for r in state.isr if r != state.leader) or (state.leader,)
    return Election(PartitionState(None, state.leader_epoch + 1, remaining), False)


def elect_offline(state: PartitionState, replicas: list[str], live: Iterable[str]) -> Election | None:
    """An offline partition (leader None) whose in-sync replica came back: it leads."""
    if state.leader is not None:
        return None
    live = set(live)
    back = [r for r in replicas if r in state.isr and r in live]
    if not back:
        return None
    return Election(PartitionState(back[0], state.leader_epoch + 1, tuple(back)), False)


def elect_chosen(state: PartitionState, replicas: list[str], live: Iterable[str],
                 chosen: str, accept_data_loss: bool) -> Election:
    """An operator's election of `chosen` to lead an offline partition
    (MetadataService.ElectLeader; docs/operations.md, AtomlogPartitionsOffline): the way
    back when no in-sync replica can return, or none is left (a replica that lost its
    copy left the ISR even as its last member: partition_states.leaving). `chosen` leads
    alone in a new epoch; the others follow it and cut what it lacks. Pure; refusals are
    AtomlogErrors and nothing is to be written: a partition that has a leader
    (PARTITION_HAS_LEADER: the election is automatic while one is live), a server that is
    not a replica or not live (INVALID_ARGUMENT), and an out-of-sync replica without
    `accept_data_loss` (INVALID_ARGUMENT: what it lacks of the acknowledged records is
    lost)."""
    if chosen not in replicas:
        raise AtomlogError("INVALID_ARGUMENT", f"{chosen!r} is not a replica of the "
                           f"partition (replicas {list(replicas)})",
                           {"replica": chosen, "replicas": ",".join(replicas)})
    if state.leader is not None:
        raise AtomlogError("PARTITION_HAS_LEADER", f"the partition has a leader, {state.leader} "
                           f"(epoch {state.leader_epoch}): only an offline partition is "
                           "elected by hand", {"leader": state.leader,
                                               "leader_epoch": str(state.leader_epoch)})
    if chosen not in set(live):
        raise AtomlogError("INVALID_ARGUMENT", f"{chosen!r} is not a live partition server: "
                           "start it first", {"replica": chosen})
    unclean = chosen not in state.isr
    if unclean and not accept_data_loss:
        raise AtomlogError("INVALID_ARGUMENT", f"{chosen!r} is not in the ISR "
                           f"({list(state.isr) or 'empty'}): the acknowledged records it "
                           "lacks would be lost; elect it with accept_data_loss",
                           {"replica": chosen, "isr": ",".join(state.isr)})
    return Election(PartitionState(chosen, state.leader_epoch + 1, (chosen,)), unclean)


# ------------------------------------------------------------------ reassignment

def validate_reassignment(target: list[str], partition_servers: Iterable[str],
                          min_insync: int) -> list[str]:
    """Check a partition's new replica list (docs/replication.md, "Reassignment"); return
    it. Every target must be a registered partition server, named once; the list must be
    able to hold min.insync.replicas in-sync copies."""
    registered = set(partition_servers)
    if not target:
        raise AtomlogError("INVALID_REPLICA_ASSIGNMENT", "the new replica list is empty")
    if len(set(target)) != len(target):
        raise AtomlogError("INVALID_REPLICA_ASSIGNMENT",
                           f"the new replica list {target} names a server twice")
    if len(target) > MAX_REPLICATION_FACTOR:
        raise AtomlogError("INVALID_REPLICA_ASSIGNMENT",
                           f"{len(target)} replicas; at most {MAX_REPLICATION_FACTOR}")
    unknown = [r for r in target if r not in registered]
    if unknown:
        raise AtomlogError("INVALID_REPLICA_ASSIGNMENT",
                           f"{unknown} are not registered partition servers (registered: "
                           f"{sorted(registered)})", {"unknown": ",".join(unknown)})
    if len(target) < min_insync:
        raise AtomlogError("INVALID_REPLICA_ASSIGNMENT",
                           f"{len(target)} replicas cannot hold min.insync.replicas="
                           f"{min_insync} in-sync copies")
    return list(target)


def reassigning_replicas(current: list[str], target: list[str]) -> list[str]:
    """The replica list while a reassignment runs: the target (its first the preferred
    leader) and then the current replicas that leave once it completes. Every one of them
    follows the leader; elections consider them all."""
    return list(target) + [r for r in current if r not in target]


def complete_reassignment(state: PartitionState, target: list[str],
                          live: Iterable[str]) -> PartitionState | None:
    """The partition state that ends a reassignment, or None while it cannot end: every
    target replica must be in the ISR (so each holds everything acknowledged). The ISR
    keeps the targets only; a leader outside the target hands over, in a new epoch, to the
    first live target (it is in sync, so the election is clean)."""
    if state.leader is None or not set(target) <= set(state.isr):
        return None
    isr = tuple(r for r in target if r in state.isr)
    if state.leader in target:
        return PartitionState(state.leader, state.leader_epoch, isr)
    heirs = [r for r in target if r in set(live)]
    if not heirs:
        return None
    return PartitionState(heirs[0], state.leader_epoch + 1, isr)


# ------------------------------------------------------------------ giving up an epoch

class CopyThrottle:
    """A running reassignment's throttle (docs/replication.md, "Reassignment"): each new
    replica (one not in the ISR yet) may be sent `rate` bytes per second of records, with
    a burst of one second's worth; a token bucket per replica. A copy may overdraw (a
    first batch goes whole): the replica then waits until the bucket is positive again.
    Times are seconds of the caller's monotonic clock."""

    def __init__(self, rate: int):
        if rate <= 0:
            raise ValueError("a throttle's rate must be positive")
        self.rate = rate
        self._buckets: dict[str, tuple[float, float]] = {}  # replica -> (tokens, at)

    def _tokens(self, replica: str, now: float) -> float:
        tokens, at = self._buckets.get(replica, (float(self.rate), now))
        return min(float(self.rate), tokens + (now - at) * self.rate)

    def allowance(self, replica: str, now: float) -> int:
        """Bytes `replica` may be sent now (0 or less: none)."""
        return int(self._tokens(replica, now))

    def spent(self, replica: str, size: int, now: float) -> None:
        self._buckets[replica] = (self._tokens(replica, now) - size, now)

    def wait_s(self, replica: str, now: float) -> float:
        """Seconds until `replica` may be sent something again (0: now)."""
        tokens = self._tokens(replica, now)
        return 0.0 if tokens >= 1 else (1 - tokens) / self.rate


def resumes_epoch(cache: "LeaderEpochCache", epoch: int) -> bool:
    """Whether a leadership of `epoch` that is about to begin on a replica whose
    leader-epoch file is `cache` would resume an epoch this replica led (or copied)
    before: after a restart, or a reopen of its leadership. It must not: it may have lost
    records of that epoch that followers copied (they copy before the leader's fsync),
    and other records written at those offsets in the same epoch could not be told
    apart by truncation. It gives the epoch up instead (`resign`)."""
    return cache.latest_epoch() >= epoch


def resign(state: PartitionState, replicas: list[str], me: str,
           live: Iterable[str], heir_only: bool = False) -> PartitionState | None:
    """The state a leader writes (compare-and-set) to give up its leader epoch: after a
    failed write or fsync (its log is cut back to what it made durable, and followers may
    hold more of the epoch), or when it would resume an epoch it led before
    (`resumes_epoch`). Never the same epoch again: the first other live in-sync replica
    leads in epoch + 1, without `me` in the ISR (as `partition_states.leaving`: `me`
    rejoins once caught up); with none, `me` leads again in epoch + 1 with the same ISR.
    Either way every replica then cuts what it holds of the old epoch to the new
    leader's history by leader epoch, and nothing acknowledged is lost: the high
    watermark never passed the failed leader's durable end, which it keeps, nor any
    in-sync replica's. `heir_only` (a leader whose log has corruption before its tail,
    which leading again would not mend): None instead of `me` leading again."""
    if state.leader != me:
        raise ValueError(f"{me} does not lead ({state})")
    live = set(live) - {me}
    rest = tuple(r for r in state.isr if r != me)
    heirs = [r for r in replicas if r in rest and r in live]
    if heirs:
        return PartitionState(heirs[0], state.leader_epoch + 1, rest)
    if heir_only:
        return None
    return PartitionState(me, state.leader_epoch + 1, state.isr)


# ------------------------------------------------------------------ the leader's view

@dataclass
class _Follower:
    durable_end: int = 0  # every offset below is durable on the follower
    caught_up_ms: int = 0  # last time it had everything the leader had when it asked
    last_fetch_end: int = -1  # the leader's log end when this follower last fetched
    last_fetch_ms: int = 0  # ... and when


@dataclass
class LeaderProgress:
    """The leader's view of its followers, for one leadership (one leader epoch).

    A follower's fetch from offset F says: everything below F is durable on it (a follower
    fsyncs what it appended before it asks for more). Followers copy up to the leader's
    log end, not only what the leader made durable, so a follower's durable end may pass
    the leader's. The high watermark is the smallest durable end over the ISR, the
    leader's own included (`leader_durable_end`: its fsyncs only, never its log end);
    writes below it are acknowledged and readable. Writes are acknowledged only while
    the ISR has `min_insync` members; below that, produce requests fail with
    NOT_ENOUGH_REPLICAS (nothing is written)."""

    leader: str
    replicas: list[str]
    isr: set[str]
    min_insync: int
    max_lag_ms: int
    now_ms: int
    leader_durable_end: int = 0
    followers: dict[str, _Follower] = field(default_factory=dict)
    # Followers an ISR write under way adds: they count for the high watermark from the
    # write's start (Kafka's maximal ISR, KIP-497), else what the old ISR acknowledged
    # meanwhile would be missing from an in-sync replica once the write is stored.
    joining: set[str] = field(default_factory=set)
    # In-sync followers that fetched from below the high watermark: their copy lost
    # acknowledged records (cut at damage, wiped), so they leave the ISR at the next ISR
    # round, not after max_lag_ms, during which an election could pick them.
    lost: set[str] = field(default_factory=set)
    _high_watermark: int = 0

    def __post_init__(self):
        if self.leader not in self.isr:
            raise ValueError(f"leader {self.leader} not in ISR {sorted(self.isr)}")
        for replica in self.replicas:
            if replica != self.leader:
                # A follower counts as caught up when the leadership begins: it gets
                # max_lag_ms to show it can keep up.
                self.followers.setdefault(replica, _Follower(0, self.now_ms))

    def start(self, leader_end: int, high_watermark: int) -> None:
        """The leadership begins with the leader's log ending at `leader_end` (all durable)
        and the high watermark it knew (at most leader_end)."""
        self.leader_durable_end = leader_end
        self._high_watermark = min(high_watermark, leader_end)

    def fetched(self, replica: str, fetch_offset: int, leader_end: int, now_ms: int) -> None:
        """A fetch of `replica` from `fetch_offset`, while the leader's log ended at
        `leader_end` (its log end: whole batches appended, durable or not). A fetch offset
        never goes back within one leadership, except after the follower truncates (its
        log end moved back: it is simply lower).

        Caught up (Kafka's rule): now, when it fetches from the leader's end; else as of
        its previous fetch, when it fetches from at least the leader's end as of that
        fetch. The leader's end moves with every append, so under a steady stream no
        fetch finds it unmoved: the second rule is what keeps a follower that copies
        everything it is sent in the ISR."""
        if replica not in self.followers:
            raise AtomlogError("NOT_A_REPLICA", f"{replica} is not a replica of this partition")
        if fetch_offset > leader_end:
            raise AtomlogError("OFFSET_OUT_OF_RANGE",
                               f"follower {replica} fetches from {fetch_offset}, past the "
                               f"leader's end {leader_end}")
        follower = self.followers[replica]
        follower.durable_end = fetch_offset
        if replica in self.isr and fetch_offset < self._high_watermark:
            self.lost.add(replica)
        if fetch_offset >= leader_end:
            follower.caught_up_ms = max(follower.caught_up_ms, now_ms)
        elif 0 <= follower.last_fetch_end <= fetch_offset:
            follower.caught_up_ms = max(follower.caught_up_ms, follower.last_fetch_ms)
        follower.last_fetch_end, follower.last_fetch_ms = leader_end, now_ms
        self.now_ms = max(self.now_ms, now_ms)

    def leader_durable(self, end: int) -> None:
        self.leader_durable_end = max(self.leader_durable_end, end)

    @property
    def high_watermark(self) -> int:
        """Moves forward only: the smallest durable end over the ISR (a follower that joins
        the ISR is at least at the high watermark, so this never goes back)."""
        ends = [self.leader_durable_end] + [self.followers[r].durable_end
                                            for r in self.counted() if r != self.leader]
        self._high_watermark = max(self._high_watermark, min(ends))
        return self._high_watermark

    def counted(self) -> set[str]:
        """The replicas whose copies bound the high watermarks: the ISR and its joiners."""
        return self.isr | self.joining if self.joining else self.isr

    def may_acknowledge(self) -> bool:
        return len(self.isr) >= self.min_insync

    def shrink(self, now_ms: int) -> set[str] | None:
        """The ISR without the followers that have not been caught up for max_lag_ms or
        that lost acknowledged records (`lost`), or None when nothing changes. The leader writes it (compare-and-set) and calls
        `isr_changed` once it is stored; until then the old ISR holds the high watermark."""
        lagging = {r for r in self.isr if r != self.leader
                   and (now_ms - self.followers[r].caught_up_ms > self.max_lag_ms
                        or r in self.lost)}
        return self.isr - lagging if lagging else None

    def expand(self, leader_epoch_start: int) -> set[str] | None:
        """The ISR with the followers that hold everything up to the high watermark and
        everything of this leadership's first offset (so they truncated to this leader's
        history), or None when nothing changes."""
        hw = self.high_watermark
        joining = {r for r, f in self.followers.items() if r not in self.isr
                   and f.durable_end >= hw and f.durable_end >= leader_epoch_start}
        return self.isr | joining if joining else None

    def isr_changed(self, isr: Iterable[str]) -> None:
        """The ISR as stored now. A follower that left it forgets what it had shown: it
        may have left because it restarted with less (a wiped or lost disk: a server
        leaves the ISR of its partitions at start), and the position its previous
        incarnation reached must not carry it back in. It rejoins on fetches made after
        it left (`expand`), as Kafka's leader only takes fetches of the registered broker
        epoch (KIP-903)."""
        isr = set(isr)
        if self.leader not in isr:
            raise ValueError("the leader cannot leave its own ISR")
        self.forget(self.isr - isr)
        self.isr = isr

    def forget(self, replicas: Iterable[str]) -> None:
        """What these followers (out of the ISR: gone from it, or from ZooKeeper) showed so
        far no longer counts: only fetches made from now on can bring them into the ISR."""
        for replica in replicas:
            self.lost.discard(replica)
            follower = self.followers.get(replica)
            if follower is not None:
                follower.durable_end = 0
                follower.last_fetch_end = -1

    def replicas_changed(self, replicas: Iterable[str], now_ms: int) -> None:
        """A reassignment changed the replica list: a new replica is a follower that has
        nothing yet (it joins the ISR once caught up); a replica that left is forgotten
        (it left the ISR in the same write)."""
        self.replicas = list(replicas)
        for replica in self.replicas:
            if replica != self.leader:
                self.followers.setdefault(replica, _Follower(0, now_ms))
        for gone in set(self.followers) - set(self.replicas) - self.isr:
            del self.followers[gone]

    def lag(self) -> dict[str, int]:
        """Offsets each follower is behind the leader's durable end."""
        return {r: max(0, self.leader_durable_end - f.durable_end)
                for r, f in self.followers.items()}


# ------------------------------------------------------------------ cursor journals

NOT_SYNCED = -1  # a follower's cursor position before it took this leader's snapshot


@dataclass
class CursorProgress:
    """The leader's view of its followers' copies of the partition's subscription-cursor
    journal, for one leadership (docs/replication.md, "Cursors"). Positions are journal
    sequence numbers: a follower's Replicate carries the sequence below which it holds
    every frame durably (NOT_SYNCED until it installed this leader's snapshot), as a log
    fetch carries its offset. The cursor high watermark is the smallest durable position
    over the ISR (LeaderProgress's ISR), the leader's own included; a cursor change is
    acknowledged once it passes the change's frame. It only moves forward: a follower that
    restarts holds what it held (its store is on disk) until it installs the leader's
    snapshot, which holds more."""

    leader: str
    replicas: list[str]
    now_ms: int = 0  # when the leadership began: every follower gets max_lag_ms from it
    leader_durable_end: int = 0
    positions: dict[str, int] = field(default_factory=dict)
    caught_up_ms: dict[str, int] = field(default_factory=dict)
    _last_fetch: dict[str, tuple[int, int]] = field(default_factory=dict)  # (end, ms)
    _high_watermark: int = 0

    def __post_init__(self):
        for replica in self.replicas:
            if replica != self.leader:
                self.positions.setdefault(replica, NOT_SYNCED)
                self.caught_up_ms.setdefault(replica, self.now_ms)

    def fetched(self, replica: str, position: int, now_ms: int) -> int:
        """A follower's Replicate reports `position` (at `now_ms`); returns the position
        recorded: NOT_SYNCED when it claims frames the leader does not hold durably (it
        copied another history: it must start over from the snapshot). A follower is
        caught up now when it reports the leader's durable end, and was caught up at its
        previous call when it reports at least the durable end as of that call (Kafka's
        rule: under a steady stream of changes no call finds the leader's end unmoved)."""
        if replica not in self.positions:
            raise AtomlogError("NOT_A_REPLICA", f"{replica} is not a replica of this partition")
        if position < NOT_SYNCED:
            raise AtomlogError("INVALID_ARGUMENT", f"cursor_sequence {position} < -1")
        if position > self.leader_durable_end:
            position = NOT_SYNCED
        self.positions[replica] = position
        if position == self.leader_durable_end:
            self.caught_up_ms[replica] = max(self.caught_up_ms[replica], now_ms)
        elif replica in self._last_fetch and position >= self._last_fetch[replica][0]:
            self.caught_up_ms[replica] = max(self.caught_up_ms[replica],
                                             self._last_fetch[replica][1])
        self._last_fetch[replica] = (self.leader_durable_end, now_ms)
        return position

    def lagging(self, isr: Iterable[str], now_ms: int, max_lag_ms: int) -> set[str]:
        """The in-sync followers whose cursors have not been caught up for max_lag_ms:
        they leave the ISR as log laggards do (else cursor changes would wait on them)."""
        return {r for r in isr if r != self.leader and r in self.caught_up_ms
                and now_ms - self.caught_up_ms[r] > max_lag_ms}

    def leader_durable(self, end: int) -> None:
        self.leader_durable_end = max(self.leader_durable_end, end)

    def high_watermark(self, isr: Iterable[str]) -> int:
        ends = [self.leader_durable_end] + [self.positions[r] for r in isr
                                            if r != self.leader and r in self.positions]
        self._high_watermark = max(self._high_watermark, min(ends))
        return self._high_watermark

    def holds(self, replica: str, isr: Iterable[str]) -> bool:
        """Whether `replica` may join the ISR as far as cursors go: it holds every frame
        the in-sync replicas hold (an ISR member must never lack an acknowledged change)."""
        position = self.positions.get(replica, NOT_SYNCED)
        return position != NOT_SYNCED and position >= self.high_watermark(isr)

    def lag(self) -> dict[str, int]:
        """Frames each follower is behind the leader's durable end (-1: not synced)."""
        return {r: (-1 if p == NOT_SYNCED else max(0, self.leader_durable_end - p))
                for r, p in self.positions.items()}

    def left_isr(self, replicas: Iterable[str]) -> None:
        """As LeaderProgress.isr_changed: followers that left the ISR are not synced until
        a call made after it says where they are."""
        for replica in replicas:
            if replica in self.positions:
                self.positions[replica] = NOT_SYNCED
            self._last_fetch.pop(replica, None)

    def replicas_changed(self, replicas: Iterable[str], isr: Iterable[str], now_ms: int) -> None:
        """As LeaderProgress.replicas_changed: a new replica starts not synced."""
        self.replicas = list(replicas)
        for replica in self.replicas:
            if replica != self.leader:
                self.positions.setdefault(replica, NOT_SYNCED)
                self.caught_up_ms.setdefault(replica, now_ms)
        for gone in set(self.positions) - set(self.replicas) - set(isr):
            self.positions.pop(gone, None)
            self.caught_up_ms.pop(gone, None)
            self._last_fetch.pop(gone, None)


# ------------------------------------------------------------------ leader epochs

class LeaderEpochCache:
    """(leader epoch, first offset written in it), in increasing order of both, on every
    replica. A leader adds its epoch when it begins leading (at its log end); a follower
    adds the epochs the leader reports for the offsets it copies. After a truncation the
    entries past the new end go; after retention the first entry starts at the new log
    start."""

    def __init__(self, entries: Iterable[tuple[int, int]] = ()):
        self.entries: list[tuple[int, int]] = []
        for epoch, start in entries:
            self.assign(epoch, start)

    def latest_epoch(self) -> int:
        return self.entries[-1][0] if self.entries else NO_EPOCH

    def assign(self, epoch: int, start: int) -> None:
        if epoch < 0 or start < 0:
            raise ValueError(f"epoch {epoch} at {start}")
        if self.entries:
            last_epoch, last_start = self.entries[-1]
            if epoch == last_epoch:
                return  # already known (its first offset does not move)
            if epoch < last_epoch:
                raise ValueError(f"epoch {epoch} after epoch {last_epoch}: epochs only grow")
            if start < last_start:
                raise ValueError(f"epoch {epoch} starts at {start}, before epoch {last_epoch} "
                                 f"at {last_start}: truncate first")
            if start == last_start:
                self.entries.pop()  # the last epoch wrote nothing: the new one replaces it
        self.entries.append((epoch, start))

    def end_offset_for(self, epoch: int, log_end: int) -> tuple[int, int]:
        """What a leader answers a follower whose latest epoch is `epoch`: the largest epoch
        it knows that is at most `epoch`, and the offset where that epoch ended on this
        replica (the next epoch's first offset, or `log_end` for the latest). (NO_EPOCH,
        log start) when it knows no such epoch."""
        chosen = None
        for i, (known, _start) in enumerate(self.entries):
            if known > epoch:
                break
            chosen = i
        if chosen is None:
            return NO_EPOCH, self.entries[0][1] if self.entries else 0
        end = self.entries[chosen + 1][1] if chosen + 1 < len(self.entries) else log_end
        return self.entries[chosen][0], end

    def truncate_from_end(self, end: int) -> None:
        """The log was cut back to `end`: epochs that began at or past it never happened."""
        self.entries = [(e, s) for e, s in self.entries if s < end]

    def truncate_from_start(self, log_start: int) -> None:
        """Offsets below `log_start` are gone: the epoch covering it now begins there."""
        kept = [(e, s) for e, s in self.entries if s >= log_start]
        covering = [(e, s) for e, s in self.entries if s < log_start]
        if covering and (not kept or kept[0][1] > log_start):
            kept.insert(0, (covering[-1][0], log_start))
        self.entries = kept

    def encode(self) -> bytes:
        lines = [str(EPOCH_CACHE_VERSION), str(len(self.entries))]
        lines += [f"{epoch} {start}" for epoch, start in self.entries]
        return ("\n".join(lines) + "\n").encode()

    @classmethod
    def decode(cls, data: bytes) -> "LeaderEpochCache":
        try:
            lines = data.decode().splitlines()
            if int(lines[0]) != EPOCH_CACHE_VERSION:
                raise ValueError(f"version {lines[0]}")
            count = int(lines[1])
            if len(lines) != count + 2:
                raise ValueError(f"{len(lines) - 2} entries, header says {count}")
            entries = []
            for line in lines[2:]:
                epoch, start = line.split(" ")
                entries.append((int(epoch), int(start)))
            return cls(entries)
        except (ValueError, IndexError, UnicodeDecodeError) as error:
            raise ValueError(f"unreadable leader-epoch file: {error}") from None


def truncation_step(cache: LeaderEpochCache, log_end: int, leader_epoch: int,
                    leader_end: int) -> tuple[int, int | None]:
    """One round of a follower finding where its log leaves the leader's history. It asked
    the leader about an epoch (first its latest); the leader answered `leader_epoch`, the
    largest epoch it knows at most that one, and `leader_end`, where that epoch ended on
    the leader. Returns (the offset to cut the log to, the epoch to ask about next, or None
    when that cut is the last).

    - Both replicas know `leader_epoch`: one leader wrote both copies of it, so they agree
      up to the smaller of its two ends; the follower's records past that are not in the
      leader's history.
    - The follower does not know `leader_epoch`: nothing it has past `leader_end` can be
      the leader's, nor anything past the end of its own largest epoch below
      `leader_epoch` (`own_end`): its later epochs all lie between `leader_epoch` and the
      one it asked about, and the leader knows none of them, so wrote none of their
      records. Cut there, the follower's latest epoch is that one, where the two
      histories may part: it is asked about next (the follower asks about its latest
      epoch each round, so the cut alone makes it ask about the right one).
    - NO_EPOCH (the leader knows no epoch that old): the follower keeps nothing past
      `leader_end`, the leader's log start."""
    if leader_epoch == NO_EPOCH:
        return min(log_end, leader_end), None
    own_epoch, own_end = cache.end_offset_for(leader_epoch, log_end)
    if own_epoch == leader_epoch or own_epoch == NO_EPOCH:
        return min(log_end, leader_end, own_end), None
    return min(log_end, leader_end, own_end), own_epoch
