"""Faults: a seeded schedule (pure: seed in, list of faults out, so a seed replays the
same faults at the same moments of the run) and the actions that inject and heal them
on a running local cluster.

Nemeses and their faults:
  kill   kill -9 of one process (partition server, coordinator, id allocator, ZooKeeper,
         and for ctp a worker), restarted after 0-4 s with the same ports and data
  pause  SIGSTOP of one server for longer than the ZooKeeper session timeout (its
         session expires: others take over while it still believes it owns things),
         then SIGCONT
  net    through the fault proxy on every link: a process cut off from everything
         (drop), one link dropped both ways or one way, delayed links, and resets
  disk   the fsync failpoint of one partition server armed (EIO from every fsync), and
         its small filesystem filled up (ENOSPC)
  leader (replicated runs, docs/replication.md) the current leader of a random workload
         partition, looked up in ZooKeeper when the fault begins: killed with SIGKILL,
         paused past its session, cut off from ZooKeeper past its session, or cut off
         from its followers (links dropped both ways) longer than replication.max_lag_ms
  wipe   (replicated runs) kill -9 of one partition server, its partition directories
         deleted, restarted after 0-4 s: it must rebuild every replica from the leaders
  restart kill -9 of one server, restarted after 0-2 s, and 0-3 s into its start cut off
         from ZooKeeper (both ways) for longer than the session timeout: every start-up
         step must ride out a ZooKeeper blip shorter than zookeeper.connect_timeout_ms
         (a server that exits instead is a problem of the run, runner.watch_servers)
  corrupt (replicated runs) with every ISR whole, a byte flipped in a batch in the middle
         of the oldest segment of a copy of a random workload partition, by turns: the
         current leader's copy, then that batch read from the leader (a Fetch), whose
         read finds the damage; a follower's copy, which no read touches; the leader's
         copy, not read. The scrubber (a pass every 2 s in these runs) finds the last
         two. A damaged leader must hand the partition to an in-sync replica and mend its
         own copy from it (docs/replication.md, "Corruption found on a leader"), a
         damaged follower cut its copy at the damage and fetch the rest, with nothing
         acknowledged lost
  power  (root and loop devices, else skipped: tests/chaos/disks.py) a power cut: one partition
         server (or the combined server) killed with SIGKILL and its disk reverted to
         what its device held (every fsync's data; nothing the page cache alone held),
         or every server at once, each partition-serving one's disk reverted (a machine
         room losing power; ZooKeeper stays up); started again after 0-4 s. Nothing
         acknowledged may be lost, with one copy as with three
  misplace (one-copy runs) kill -9 of one partition server (or the combined server),
         every partition directory it holds moved aside (a disk swapped for an empty one
         by mistake), started again after 0-2 s: each of those partitions must open in
         DATA_LOSS, never empty at offset 0 (the runner checks it through the server's
         ListPartitions); healed by a kill -9, the directories moved back and a start, as
         an operator putting the right disk back. Nothing acknowledged may be lost
  reassign (replicated runs) `partition reassign` of a random workload partition to its
         replicas less one — its current leader (a handover in a new epoch) or a follower
         — whose copy is then deleted; healed by reassigning it back to every replica
         (the dropped server rebuilds its copy from the leader, a reassignment that may
         still be running when the next fault begins)
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

NEMESES = ("kill", "pause", "net", "disk", "restart", "leader", "wipe", "reassign", "corrupt",
           "power", "misplace")
# wipe, corrupt: would destroy acknowledged data with one copy
REPLICATED_ONLY = ("wipe", "reassign", "corrupt")
# misplace: a replica without its copy leaves the ISR for good (an operator's election
# brings its partition back), which a run does not play
ONE_COPY_ONLY = ("misplace",)
QUIET_S = (1.0, 4.0)  # between two faults


@dataclass(frozen=True)
class Fault:
    at_s: float          # seconds after the fault phase began
    fault: str           # kill, pause, net-drop, net-oneway, net-delay, net-reset, net-isolate,
                         # disk-fsync, disk-full, client-kill, restart-zk-blip, power,
                         # power-all
    target: str          # a process name, "a->b" for a link, "*" for every server
    duration_s: float    # how long until healed (kill: until restarted; restart-zk-blip:
                         # the ZooKeeper cut)
    delay_s: float = 0.0  # net-delay; restart-zk-blip: from the restart to the cut
    down_s: float = 0.0   # restart-zk-blip, misplace: from the kill to the restart

    def to_json(self) -> dict:
        return asdict(self)

    @property
    def span_s(self) -> float:
        """From the fault's start until it is healed (a restart-zk-blip's kill and start
        come before its cut)."""
        if self.fault == "restart-zk-blip":
            return self.down_s + self.delay_s + self.duration_s
        return self.duration_s


@dataclass(frozen=True)
class Topology:
    """What faults can hit: process names by role."""

    partition_servers: tuple[str, ...]
    coordinators: tuple[str, ...]
    id_allocators: tuple[str, ...]
    clients: tuple[str, ...] = ()           # killable workload clients (ctp workers)
    disk_server: str = ""                   # the partition server on a small filesystem
    session_timeout_s: float = 3.0
    partitions: tuple[str, ...] = ()        # "topic/p" of the workload (leader nemesis)
    max_lag_s: float = 3.0                  # replication.max_lag_ms of the cluster

    @property
    def servers(self) -> tuple[str, ...]:
        return self.partition_servers + self.coordinators + self.id_allocators


def schedule(seed: int, nemeses: list[str], duration_s: float, topology: Topology) -> list[Fault]:
    """The faults of a run, one at a time with quiet gaps, none past duration_s."""
    for name in nemeses:
        if name not in NEMESES:
            raise ValueError(f"unknown nemesis {name!r}; choose from {', '.join(NEMESES)}")
    rng = random.Random(f"nemesis/{seed}")
    faults: list[Fault] = []
    now = rng.uniform(*QUIET_S)
    while nemeses:
        fault = _one(rng, rng.choice(nemeses), now, topology)
        if fault.at_s + fault.span_s > duration_s:
            break
        faults.append(fault)
        now = fault.at_s + fault.span_s + rng.uniform(*QUIET_S)
    return faults


def _one(rng: random.Random, nemesis: str, at_s: float, topology: Topology) -> Fault:
    if nemesis == "kill":
        targets = (*topology.servers, "zookeeper", *topology.clients)
        target = rng.choice(targets)
        fault = "client-kill" if target in topology.clients else "kill"
        return Fault(at_s, fault, target, rng.uniform(0.0, 4.0))
    if nemesis == "restart":
        return Fault(at_s, "restart-zk-blip", rng.choice(topology.servers),
                     topology.session_timeout_s + rng.uniform(1.0, 4.0),
                     delay_s=rng.uniform(0.0, 3.0), down_s=rng.uniform(0.0, 2.0))
    if nemesis == "pause":
        target = rng.choice(topology.servers)
        return Fault(at_s, "pause", target, topology.session_timeout_s + rng.uniform(1.0, 4.0))
    if nemesis == "net":
        kind = rng.choice(("net-isolate", "net-drop", "net-oneway", "net-delay", "net-reset"))
        duration = rng.uniform(2.0, 8.0)
        if kind == "net-isolate":
            return Fault(at_s, kind, rng.choice((*topology.servers, "zookeeper")), duration)
        source, destination = rng.sample((*topology.servers, "zookeeper"), 2)
        if kind == "net-delay":
            return Fault(at_s, kind, f"*->{destination}", duration, rng.uniform(0.05, 0.5))
        return Fault(at_s, kind, f"{source}->{destination}", duration)
    if nemesis == "leader":
        kind = rng.choice(("leader-kill", "leader-pause", "leader-zk-cut", "leader-cut"))
        target = rng.choice(topology.partitions)
        if kind == "leader-kill":
            return Fault(at_s, kind, target, rng.uniform(0.0, 4.0))
        if kind in ("leader-pause", "leader-zk-cut"):
            return Fault(at_s, kind, target, topology.session_timeout_s + rng.uniform(1.0, 4.0))
        return Fault(at_s, kind, target, topology.max_lag_s + rng.uniform(1.0, 5.0))
    if nemesis == "power":
        if rng.random() < 0.5:
            return Fault(at_s, "power-all", "*", rng.uniform(0.0, 4.0))
        return Fault(at_s, "power", rng.choice(topology.partition_servers), rng.uniform(0.0, 4.0))
    if nemesis == "wipe":
        return Fault(at_s, "wipe", rng.choice(topology.partition_servers), rng.uniform(0.0, 4.0))
    if nemesis == "misplace":
        return Fault(at_s, "misplace", rng.choice(topology.partition_servers),
                     rng.uniform(4.0, 8.0), down_s=rng.uniform(0.0, 2.0))
    if nemesis == "corrupt":
        return Fault(at_s, "corrupt", rng.choice(topology.partitions), rng.uniform(3.0, 8.0))
    if nemesis == "reassign":
        kind = rng.choice(("reassign-leader", "reassign-follower"))
        return Fault(at_s, kind, rng.choice(topology.partitions), rng.uniform(3.0, 10.0))
    assert nemesis == "disk", nemesis
    kind = rng.choice(("disk-fsync", "disk-full")) if topology.disk_server else "disk-fsync"
    target = topology.disk_server if kind == "disk-full" else rng.choice(topology.partition_servers)
    return Fault(at_s, kind, target, rng.uniform(2.0, 6.0))
