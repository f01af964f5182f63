"""Partition states in ZooKeeper (docs/replication.md): `/partitions/<topic>/<partition>`
holds a `replication.PartitionState` (leader, leader epoch, ISR) and changes only by
compare-and-set on the znode's version. This module is the only writer; the rules of what
to write are replication.py's. Calls are synchronous kazoo calls: callers on an event loop
run them on a thread.

- `create_all` writes the first state of every partition of a new topic in one ZooKeeper
  transaction (all or nothing).
- `read` returns a state with its version.
- `try_elect` is what every live replica runs when its partition's leader is gone (or the
  partition is offline and one of its in-sync replicas is back): each computes the same
  election from what it read and writes it against the version it read, so exactly one
  write succeeds however many race; the others learn the winner from the znode.
- `change_isr` is the leader's ISR shrink or expand, against the version it last read; a
  newer state (another leader, another epoch) makes it fail with StaleState, and the
  leader must stop acknowledging and reread. A replica joins only in a ZooKeeper
  transaction that also checks its incarnation node is still the one its fetches named
  (StaleIncarnation otherwise): a fetch from a server's previous process can never bring
  its next one into the ISR.
- `begin_incarnation` is the first thing a partition server writes when it starts, before
  it leaves its ISRs: `/incarnations/<name>`, whose zxid then names this process in every
  fetch it makes (docs/replication.md, "Incarnations").
- `leave_isr` is what a partition server does for each of its replicas when it starts,
  before it registers: it takes itself out of the ISR (and out of leadership, to another
  live in-sync replica), because it cannot know that its log is still whole — its disk may
  have been wiped or replaced while it was down, and an in-sync replica with an empty log
  that won an election would erase what the others hold. It rejoins the ISR the normal way,
  once its leader sees it caught up.
- `resign` is what a leader writes to give up its leader epoch (after a failed write or
  fsync of its log, or instead of resuming an epoch it led before a restart): another
  live in-sync replica, or itself, leads in epoch + 1 (`replication.resign`).
- `complete_reassignment` is what the leader of a partition being reassigned writes once
  its target replicas are all in sync: the topic record's final replica list and the
  partition's state, in one ZooKeeper transaction.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterable

from kazoo.exceptions import BadVersionError, NodeExistsError, NoNodeError, RolledBackError

from partition_server.replication import (Election, PartitionState, elect, elect_offline,
                                          initial_state)
from partition_server import replication
from services.errors import AtomlogError
from services.topics import TopicRecord
from services.zk import TOPICS_PATH

PARTITIONS_PATH = "/partitions"
INCARNATIONS_PATH = "/incarnations"


class StaleState(Exception):
    """The partition's state changed since it was read: reread it."""


class IsrMoved(StaleState):
    """The partition's state changed since it was read, but only its ISR (a restarted
    replica took itself out): the same leadership goes on from `fresh`."""

    def __init__(self, fresh):
        super().__init__(f"the ISR changed meanwhile: {list(fresh.state.isr)}")
        self.fresh = fresh


class StaleIncarnation(Exception):
    """Replicas that were to join the ISR on fetches of an incarnation that is no longer
    their server's latest: `current` maps each to its latest incarnation (0: none)."""

    def __init__(self, current: dict[str, int]):
        super().__init__(f"not the latest incarnation of {sorted(current)}")
        self.current = current


def incarnation_path(server: str) -> str:
    return f"{INCARNATIONS_PATH}/{server}"


def begin_incarnation(client, server: str, info: dict) -> int:
    """Write `server`'s incarnation node (persistent: it outlives the process, so a
    leader can always tell an old process's fetch from a new one's) and return its zxid,
    the new incarnation: larger than any earlier one, as every later ZooKeeper write is."""
    path = incarnation_path(server)
    client.ensure_path(path)
    stat = client.set(path, json.dumps(info).encode())
    return stat.mzxid


def _latest_incarnations(client, servers: Iterable[str]) -> dict[str, tuple[int, int]]:
    """Each server's latest incarnation and its node's version ((0, -1): none)."""
    latest = {}
    for server in servers:
        try:
            _, stat = client.get(incarnation_path(server))
        except NoNodeError:
            latest[server] = (0, -1)
            continue
        latest[server] = (stat.mzxid, stat.version)
    return latest


@dataclass(frozen=True)
class Versioned:
    state: PartitionState
    version: int  # the znode's version: the compare-and-set token


def path_of(topic: str, partition: int) -> str:
    return f"{PARTITIONS_PATH}/{topic}/{partition}"


def create_all(client, topic: str, replicas: list[list[str]], live: Iterable[str]) -> None:
    """The first state of every partition of `topic` (its replica lists, preferred leader
    first), written at once: the topic's node and all of its partitions, or nothing
    (TOPIC_ALREADY_EXISTS when the topic's node exists)."""
    live = set(live)
    client.ensure_path(PARTITIONS_PATH)
    transaction = client.transaction()
    transaction.create(f"{PARTITIONS_PATH}/{topic}", b"")
    for partition, partition_replicas in enumerate(replicas):
        transaction.create(path_of(topic, partition),
                           initial_state(partition_replicas, live).to_json())
    results = transaction.commit()
    failures = [r for r in results if isinstance(r, Exception)]
    if any(isinstance(r, NodeExistsError) for r in failures):
        raise AtomlogError("TOPIC_ALREADY_EXISTS",
                           f"partition states of topic {topic!r} exist already")
    if failures:
        raise failures[0]


def read(client, topic: str, partition: int,
         replicas: Iterable[str] | None = None) -> Versioned:
    """The state and its version; UNKNOWN_TOPIC_OR_PARTITION when there is none, INTERNAL
    when the znode cannot be read as a state (never guessed at)."""
    try:
        data, stat = client.get(path_of(topic, partition))
    except NoNodeError:
        raise AtomlogError("UNKNOWN_TOPIC_OR_PARTITION",
                           f"no partition state for {topic}-{partition}") from None
    try:
        return Versioned(PartitionState.from_json(data, replicas), stat.version)
    except ValueError as error:
        raise AtomlogError("INTERNAL", f"partition state of {topic}-{partition}: {error}") from None


def _write(client, topic: str, partition: int, state: PartitionState, version: int) -> Versioned:
    try:
        stat = client.set(path_of(topic, partition), state.to_json(), version=version)
    except BadVersionError:
        raise StaleState(f"{topic}-{partition} changed since version {version}") from None
    except NoNodeError:
        raise AtomlogError("UNKNOWN_TOPIC_OR_PARTITION",
                           f"no partition state for {topic}-{partition}") from None
    return Versioned(state, stat.version)


def try_elect(client, topic: str, partition: int, replicas: list[str], live: Iterable[str], *,
              unclean_allowed: bool = False) -> tuple[Election | None, Versioned]:
    """Elect a leader if one is needed (the leader is not live, or the partition is
    offline and an in-sync replica is live). Returns (the election this call wrote, or None
    when none was needed or another candidate's write came first; the state now)."""
    live = set(live)
    current = read(client, topic, partition, replicas)
    if current.state.leader is None:
        # An in-sync replica back leads; else, when the topic allows it (perhaps only
        # since the partition went offline: the runbook's way out), any live replica.
        election = elect_offline(current.state, replicas, live) or (
            elect(current.state, replicas, live, unclean_allowed=True)
            if unclean_allowed else None)
    else:
        election = elect(current.state, replicas, live, unclean_allowed=unclean_allowed)
    if election is None:
        return None, current
    try:
        return election, _write(client, topic, partition, election.state, current.version)
    except StaleState:
        return None, read(client, topic, partition, replicas)


def elect_chosen(client, topic: str, partition: int, replicas: list[str],
                 live: Iterable[str], chosen: str, accept_data_loss: bool,
                 attempts: int = 20) -> tuple[Election, Versioned]:
    """An operator's election (replication.elect_chosen) written by compare-and-set
    against the state as read now, rereading on conflicts; returns it and the state
    written. Refusals raise (nothing written)."""
    live = set(live)
    elections: list[Election] = []  # the one written is the last

    def electing(state: PartitionState) -> PartitionState:
        elections.append(replication.elect_chosen(state, replicas, live, chosen,
                                                  accept_data_loss))
        return elections[-1].state

    written = _rewrite(client, topic, partition, replicas, electing, attempts,
                       f"{chosen} was elected")
    return elections[-1], written


def _rewrite(client, topic: str, partition: int, replicas: list[str], change,
             attempts: int, what: str) -> Versioned | None:
    """Write `change(state)` by compare-and-set against the state as read now, rereading
    and changing again on conflicts; None when `change` gives None (nothing to write).
    What `change` raises goes to the caller, nothing written."""
    for _ in range(attempts):
        current = read(client, topic, partition, replicas)
        wanted = change(current.state)
        if wanted is None:
            return None
        try:
            return _write(client, topic, partition, wanted, current.version)
        except StaleState:
            continue
    raise StaleState(f"{topic}-{partition} kept changing while {what}")


def change_isr(client, topic: str, partition: int, known: Versioned,
               isr: Iterable[str], joining: dict[str, int] | None = None) -> Versioned:
    """The leader of `known` (the state and version it last read) changes the ISR; the
    leader and epoch stay. StaleState when anything changed the znode since.

    `joining` names each replica the change adds with the incarnation its fetches came
    from (every replica added must be named). The write is one ZooKeeper transaction that
    also checks each one's incarnation node is unchanged since it was read here, and read
    as that incarnation; StaleIncarnation (nothing written) when one is not."""
    state = known.state
    if state.leader is None:
        raise ValueError("an offline partition has no leader to change its ISR")
    new = PartitionState(state.leader, state.leader_epoch, tuple(isr))  # checks leader in ISR
    joining = dict(joining or {})
    added = set(new.isr) - set(state.isr)
    if added - set(joining):
        raise ValueError(f"replicas {sorted(added - set(joining))} join without an incarnation")
    joining = {r: i for r, i in joining.items() if r in added}
    if not joining:
        return _write(client, topic, partition, new, known.version)
    latest = _latest_incarnations(client, joining)
    stale = {r: latest[r][0] for r, incarnation in joining.items()
             if latest[r][0] != incarnation}
    if stale:
        raise StaleIncarnation(stale)
    transaction = client.transaction()
    for replica in sorted(joining):
        transaction.check(incarnation_path(replica), latest[replica][1])
    transaction.set_data(path_of(topic, partition), new.to_json(), version=known.version)
    results = transaction.commit()
    *checks, state_result = results
    if not any(isinstance(r, Exception) for r in results):
        return Versioned(new, state_result.version)
    if isinstance(state_result, BadVersionError):
        raise StaleState(f"{topic}-{partition} changed since version {known.version}")
    if isinstance(state_result, NoNodeError):
        raise AtomlogError("UNKNOWN_TOPIC_OR_PARTITION",
                           f"no partition state for {topic}-{partition}")
    failed = [r for r, result in zip(sorted(joining), checks)
              if isinstance(result, (BadVersionError, NoNodeError))]
    if failed:  # a new incarnation began between the read and the transaction
        now = _latest_incarnations(client, failed)
        raise StaleIncarnation({r: now[r][0] for r in failed})
    raise next(r for r in results if isinstance(r, Exception)
               and not isinstance(r, RolledBackError))


def leaving(state: PartitionState, replicas: list[str], me: str,
            live: Iterable[str], copy_lost: bool = False) -> PartitionState | None:
    """The state with `me` out of the ISR (pure), or None when there is nothing to do: `me`
    is not in it, or `me` leads and no other in-sync replica is live, or the partition is
    offline with `me` its last in-sync replica (then `me` is the only copy with everything
    acknowledged: it keeps it, and leads from the log it has).

    Unless `copy_lost`: `me` started without its copy of the partition (its directory was
    gone: a wiped or replaced disk, an empty volume). Then it holds nothing, and leading
    from it would make every other replica cut its log to nothing, though they may hold
    every acknowledged record (only out of the ISR because they restarted too, after a
    power failure of the whole cluster: chaos seed 2900). So it leaves even as the last
    in-sync replica of an offline partition, whose ISR is then empty: no replica may lead
    cleanly, and an operator chooses (an unclean election, docs/operations.md,
    AtomlogPartitionsOffline); and a leader whose in-sync replicas are all down gives its
    leadership up, the partition offline until one of them is back."""
    if me not in state.isr:
        return None
    rest = tuple(r for r in state.isr if r != me)
    if state.leader is None:
        # Offline: the ISR lists who may lead when back. Leave it to the others when
        # there are others; the last one stays (no other replica holds everything).
        return PartitionState(None, state.leader_epoch, rest) if rest or copy_lost else None
    if state.leader != me:
        return PartitionState(state.leader, state.leader_epoch, rest)
    live = set(live) - {me}
    heirs = [r for r in replicas if r in rest and r in live]
    if not heirs:
        return PartitionState(None, state.leader_epoch + 1, rest) if copy_lost else None
    return PartitionState(heirs[0], state.leader_epoch + 1, rest)


def leave_isr(client, topic: str, partition: int, replicas: list[str], me: str,
              live: Iterable[str], attempts: int = 20,
              copy_lost: bool = False) -> Versioned | None:
    """Take `me` out of the partition's ISR by compare-and-set (`leaving`), rereading on
    conflicts; returns the state written, or None when nothing was to be done."""
    live = set(live)
    return _rewrite(client, topic, partition, replicas,
                    lambda state: leaving(state, replicas, me, live, copy_lost), attempts,
                    f"{me} left its ISR")


def resign(client, topic: str, partition: int, replicas: list[str], me: str, epoch: int,
           live: Iterable[str], attempts: int = 20, heir_only: bool = False
           ) -> Versioned | None:
    """`me`, leading in `epoch`, gives that epoch up (`replication.resign`): written by
    compare-and-set against the state as read now, rereading when only the ISR changed
    meanwhile (a restarted replica left it). StaleState when `me` no longer leads in
    `epoch` (another leadership began: the epoch is given up already). With `heir_only`,
    None (nothing written) while no other live replica of the ISR can lead."""
    live = set(live)

    def giving_up(state: PartitionState) -> PartitionState | None:
        if (state.leader, state.leader_epoch) != (me, epoch):
            raise StaleState(f"{topic}-{partition} is led by {state.leader} in epoch "
                             f"{state.leader_epoch}, not by {me} in {epoch}")
        return replication.resign(state, replicas, me, live, heir_only)

    return _rewrite(client, topic, partition, replicas, giving_up, attempts,
                    f"{me} gave up epoch {epoch}")


def complete_reassignment(client, topic: str, partition: int, known: Versioned,
                          target: list[str], state: PartitionState,
                          attempts: int = 20) -> Versioned | None:
    """End `partition`'s reassignment to `target` (docs/replication.md, "Reassignment"):
    the topic record's replicas become the target and the partition state becomes `state`
    (replication.complete_reassignment), in one ZooKeeper transaction, each write against
    the version it was read at. Returns the state written; None when the record no longer
    reassigns the partition to `target` (another target replaced it: nothing written);
    StaleState when the partition state changed since `known` (the leader rereads)."""
    path = f"{TOPICS_PATH}/{topic}"
    for _ in range(attempts):
        data, stat = client.get(path)
        record = TopicRecord.from_json(topic, json.loads(data))
        if record.reassigning.get(partition) != list(target):
            return None
        done = record.reassignment_done(partition)
        transaction = client.transaction()
        transaction.set_data(path, json.dumps(done.to_json()).encode(), version=stat.version)
        transaction.set_data(path_of(topic, partition), state.to_json(), version=known.version)
        results = transaction.commit()
        record_result, state_result = results
        if not isinstance(record_result, Exception) and not isinstance(state_result, Exception):
            return Versioned(state, state_result.version)
        if isinstance(state_result, BadVersionError):
            raise StaleState(f"{topic}-{partition} changed since version {known.version}")
        if isinstance(state_result, NoNodeError) or isinstance(record_result, NoNodeError):
            raise AtomlogError("UNKNOWN_TOPIC_OR_PARTITION",
                               f"no topic record or partition state for {topic}-{partition}")
        if isinstance(record_result, BadVersionError) and isinstance(state_result,
                                                                     RolledBackError):
            continue  # another partition's reassignment changed the record: reread
        raise next(r for r in results if isinstance(r, Exception)
                   and not isinstance(r, RolledBackError))
    raise StaleState(f"topic {topic!r} kept changing while {topic}-{partition}'s "
                     "reassignment completed")
