"""One chaos run: a real local cluster behind fault proxies, workload clients as their
own processes, a seeded fault schedule, healing, quiescence, final reads, and the
checker's verdict. Everything lands in the run directory:

    seed.txt  schedule.json  workload.json  events-*.jsonl  history.jsonl
    report.json  report.txt  logs/<client>.log  cluster-logs/<server>.log
    cluster/ (the servers' data: removed unless --keep-cluster)
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from partition_server.record_batch import BatchHeader, parse_header
from partition_server.snapshot_files import fsync_directory
from services import launcher
from services.errors import AtomlogError
from services.failpoints import ENVIRONMENT_VARIABLE as FAILPOINTS_VARIABLE, FSYNC

# What a disk sync failed by the harness's fsync failpoint says (services/failpoints.py).
HARNESS_FSYNC = "fsync failpoint armed by the fault harness"
from tests import go_tools
from tests.chaos import checker, disks, history, nemesis
from tests.chaos.history import EventLog
from tests.chaos.proxy import FaultProxy
from tests.conftest import create_online

PARTITION_DIRECTORY = re.compile(r"^.+-[0-9]+$")  # <topic>-<partition>, in `partitions`

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
COUNTS = {"id_allocator": 1, "coordinator": 2, "partition_server": 3}
COMBINED_COUNTS = {"combined": 1}  # --combined: every role in one process (node-0)
PARALLEL_MODES = ("auto", "on", "off")  # coordinator.parallel_commits, by seed (Run.__init__)
SESSION_TIMEOUT_MS = 3_000
REPLICA_MAX_LAG_MS = 3_000
SETTINGS = {"zookeeper.session_timeout_ms": str(SESSION_TIMEOUT_MS),
            "coordinator.log_segment_bytes": "65536",
            # Small segments: data partitions roll, and retention and cuts delete
            # segments (renamed, then unlinked on a worker thread), under the faults too;
            # a kill or a failing disk may land mid-roll. A segment holds at least one
            # batch of the largest size: the SDK's default.
            "storage.segment_bytes": str(256 << 10),
            "partition.max_batch_bytes": str(256 << 10),
            "coordinator.snapshot_every_records": "200",
            "replication.max_lag_ms": str(REPLICA_MAX_LAG_MS),
            # The scrubber always at work (a pass every 2 s): it must find the damage the
            # corrupt nemesis leaves unread, and never call a whole copy damaged while
            # kills, cuts, wipes and full disks move the logs under it.
            "partition.scrub_interval_ms": "2000",
            "partition.scrub_bytes_per_s": str(32 << 20),
            # Coordinators forget finished transactions all run long (a few hundred past
            # their callers' retries: 5 s timeouts, 10 s grace), snapshots and loads
            # included: a key forgotten while its commit may still be retried, or
            # settled by abort(), would show as a commit applied twice or an abort
            # reported for a commit.
            "transaction.max_finished": "200",
            "transaction.finished_grace_ms": "10000"}
CORRUPT_KINDS = ("leader, read", "follower, scrubbed", "leader, scrubbed")
TXN_TIMEOUT_S = 5.0
ACK_TIMEOUT_S = 5.0
DISK_BYTES = 768 << 20          # the small filesystem of the disk nemesis's server
POWER_DISK_BYTES = 4 << 30      # the power nemesis's disks (sparse images)
CLIENT_STOP_S = 30.0            # SIGTERM to SIGKILL for a workload client
DRAIN_S = 90.0                  # ctp: how long the workers may take to finish the input
TC_LEASES_S = 30.0              # after healing: until every TC partition has a coordinator
QUIESCENCE_S = 60.0             # after healing: until no transaction is open anywhere
                                # (longer than every timeout below)
REPLICAS_AGREE_S = 30.0         # then: until every workload partition's copies agree
LOG_TOPICS = {"chaos-a": 4, "chaos-b": 2}
# The log workload's trimmer (tests/chaos/client.py) writes this topic and deletes below
# its own acknowledged offsets; no other client reads it (a reader below a moved log start
# only fails), the final trim read reads it from its log start.
TRIM_TOPIC = {"name": "chaos-trim", "partitions": 2}
TRIM_SEGMENT_BYTES = 65_536  # the smallest allowed: the trimmer's ~2 KB values roll it
CTP_TOPICS = {"ctp-in": 4, "ctp-out": 3}
WORKLOADS = {
    "log": ["producer-0", "producer-1", "txn-0", "txn-1", "session-0",
            "reader-0:read_committed", "reader-1:read_uncommitted", "trimmer-0"],
    "ctp": ["feeder-0", "ctp-0", "ctp-1", "ctp-2", "cursors-0", "reader-0:read_committed"],
    "spark-lite": ["driver-0", "driver-1", "reader-0:read_committed",
                   "reader-1:read_uncommitted"],
}
# spark-lite: a job's parent, its children, and how long a prepared child waits for its
# parent's decision (the Spark writer's three timeouts, scaled down).
PARENT_TIMEOUT_S = 8.0
CHILD_TIMEOUT_S = 8.0
PREPARED_TIMEOUT_S = 12.0
KILLABLE_CLIENTS = ("ctp-", "driver-")
# --go (ctp): one more worker, the Go client's (clients/go/cmd/atomlog-go chaos-ctp).
GO_CTP_WORKER = "ctp-go"
GO_BUILD_TIMEOUT_S = 1800.0  # a fresh machine downloads Go and the client's modules


@dataclass
class Options:
    workload: str
    minutes: float
    seed: int
    nemeses: list[str]
    run_dir: Path
    keep_cluster: bool = False
    quiet: bool = False
    combined: bool = False
    replication: int = 1  # topics.default_replication_factor: every topic, __txn_log too
    # --tls: the cluster `atomlog up --tls` makes (local CA, mTLS on every port,
    # auth.mode=mtls, auth.authorizer=acl, ZooKeeper digest); the workload clients and the
    # final reads use its client certificate (atomlog-admin, a super user).
    tls: bool = False
    # --go (ctp only): a fourth worker runs the Go client, built from clients/go.
    go: bool = False


@dataclass
class ClientProcess:
    name: str
    role: str
    isolation: str
    incarnation: int = 0
    process: subprocess.Popen | None = None
    crashes: list[str] = field(default_factory=list)


class Run:
    def __init__(self, options: Options):
        if options.workload not in WORKLOADS:
            raise ValueError(f"unknown workload {options.workload!r}: {', '.join(WORKLOADS)}")
        self.options = options
        self.run_dir = options.run_dir.resolve()
        self.data_dir = self.run_dir / "cluster"
        self.log = None
        self.names: dict[int, str] = {os.getpid(): "runner"}
        self.proxy = FaultProxy(self.names.get)
        self.clients: dict[str, ClientProcess] = {}
        self.cluster: launcher.ClusterFile | None = None
        self.mounted: str | None = None
        self.disks: dict[str, disks.LoopDisk] = {}  # the power nemesis's, by server
        self.images: Path | None = None  # where their images are
        self.notes: list[str] = []
        self.corrupts = 0  # corrupt faults so far (each takes the next of CORRUPT_KINDS)
        self.stalls: list[str] = []  # liveness failures after healing: the run is not valid
        # Servers that exited by themselves (watch_servers): a problem of the run when the
        # exit was a crash or a start given up on ZooKeeper (every ZooKeeper fault here is
        # far shorter than zookeeper.connect_timeout_ms), else a note.
        self.server_exits: list[str] = []
        self.down: set[str] = set()  # processes a fault holds down (killed, not restarted yet)
        self.log_marks: dict[str, int] = {}  # a process's log size at its last start
        self.servers_watched = 0.0
        self.topics = CTP_TOPICS if options.workload == "ctp" else LOG_TOPICS
        self.counts = COMBINED_COUNTS if options.combined else COUNTS
        self.duration_s = options.minutes * 60
        self.go_cli: Path | None = None  # --go: the built atomlog-go
        # coordinator.parallel_commits: auto (the default), on or off, a third of the runs
        # each, picked by the seed (crc32, as below: the same seed picks the same in every
        # run; seeds before 2830 ran on a rule of on or off by halves).
        self.parallel_commits = PARALLEL_MODES[
            zlib.crc32(f"parallel-{options.seed}".encode()) % len(PARALLEL_MODES)]
        self.settings = {**SETTINGS,
                         "topics.default_replication_factor": str(options.replication),
                         "coordinator.parallel_commits": self.parallel_commits}

    def say(self, text: str) -> None:
        if not self.options.quiet:
            print(f"[chaos {time.strftime('%H:%M:%S')}] {text}", flush=True)

    # ------------------------------------------------------------------ the run
    def execute(self) -> dict:
        options = self.options
        print(f"seed {options.seed}", flush=True)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "seed.txt").write_text(
            f"{options.seed}\npython -m tests.chaos --workload {options.workload} "
            f"--minutes {options.minutes:g} --seed {options.seed} "
            f"--nemesis {','.join(options.nemeses) or 'none'}"
            f"{' --combined' if options.combined else ''}"
            f"{f' --replication {options.replication}' if options.replication > 1 else ''}"
            f"{' --tls' if options.tls else ''}{' --go' if options.go else ''}\n")
        self.log = EventLog(self.run_dir, "nemesis")
        final_log = EventLog(self.run_dir, "final")
        self.go_cli = self.build_go_cli() if options.go else None
        self.proxy.start()
        try:
            self.start_cluster()
            topology = self.topology()
            faults = nemesis.schedule(options.seed, options.nemeses, self.duration_s, topology)
            (self.run_dir / "schedule.json").write_text(
                json.dumps([f.to_json() for f in faults], indent=1) + "\n")
            self.say(f"{len(faults)} faults scheduled over {self.duration_s:.0f} s "
                     f"({', '.join(options.nemeses) or 'no nemesis'}); parallel commits "
                     f"{self.parallel_commits}")
            self.prepare_workload(final_log)
            for client in self.clients.values():
                self.spawn(client)
            began = time.monotonic()
            for fault in faults:
                self.wait_until(began + fault.at_s)
                self.inject(fault)
            self.wait_until(began + self.duration_s)
            self.heal_all()
            self.check_tc_leases()
            self.finish_workload()
            self.quiesce_and_read(final_log)
            self.final_replicas(final_log)
        finally:
            self.stop_clients(list(self.clients.values()))
            self.log.close()
            final_log.close()
            self.teardown()
        operations = history.merge(self.run_dir)
        history.write_history(self.run_dir, operations)
        report = checker.check(operations)
        report["run"] = {"workload": options.workload, "seed": options.seed,
                         "combined": options.combined, "replication": options.replication,
                         "tls": options.tls, "go": options.go,
                         "parallel_commits": self.parallel_commits,
                         "minutes": options.minutes, "nemeses": options.nemeses,
                         "notes": self.notes,
                         "client_crashes": {c.name: c.crashes for c in self.clients.values()
                                            if c.crashes}}
        if any(c.crashes for c in self.clients.values()):
            report["valid"] = False
            report.setdefault("problems", []).append("a workload client crashed (see logs/)")
        if self.server_exits:
            report["run"]["server_exits"] = self.server_exits
            report["valid"] = False
            report.setdefault("problems", []).extend(self.server_exits)
        if self.stalls:  # liveness: what healing did not bring back
            report["valid"] = False
            report.setdefault("problems", []).extend(self.stalls)
        (self.run_dir / "report.json").write_text(json.dumps(report, indent=1) + "\n")
        text = checker.format_report(report)
        (self.run_dir / "report.txt").write_text(text + "\n")
        print(text, flush=True)
        return report

    def workload_clients(self) -> list[str]:
        """The workload's client processes ("name" or "name:isolation")."""
        names = list(WORKLOADS[self.options.workload])
        if self.options.go:
            names.append(GO_CTP_WORKER)
        return names

    def build_go_cli(self) -> Path:
        """atomlog-go, built into the run directory (tests/go_tools.py, as the Go client's
        tests build it)."""
        self.say("building the Go client's worker (clients/go/cmd/atomlog-go)")
        go = go_tools.go_tools(GO_BUILD_TIMEOUT_S)["GO"]
        return go_tools.build_cli(go, self.run_dir / "atomlog-go", GO_BUILD_TIMEOUT_S)

    def wait_until(self, moment: float) -> None:
        while True:
            self.watch_clients()
            self.watch_servers()
            left = moment - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(0.2, left))

    # ------------------------------------------------------------------ cluster
    def start_cluster(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        # Every certificate carries 127.0.0.1 (launcher.issue_certificates): the proxied
        # addresses the servers advertise are 127.0.0.1:<proxy port>, so TLS passes through.
        cluster = launcher.plan(self.data_dir, self.counts, self.settings, tls=self.options.tls)
        zookeeper = self.entry(cluster, "zookeeper")
        zookeeper_proxy = self.proxy.add_route("zookeeper", zookeeper.grpc_address,
                                               int(launcher.free_port()))
        for entry in cluster.processes:
            if entry.role == "zookeeper":
                continue
            entry.advertised_address = self.proxy.add_route(entry.name, entry.grpc_address,
                                                            int(launcher.free_port()))
            entry.zookeeper = zookeeper_proxy
            if entry.role in launcher.SERVES_PARTITIONS:
                failpoints = self.run_dir / "failpoints" / entry.name
                failpoints.mkdir(parents=True, exist_ok=True)
                # Its replication link on a port of its own, advertised through the proxy
                # under the process's name: net faults cut followers' copies too.
                link = f"127.0.0.1:{launcher.free_port()}"
                link_proxy = self.proxy.add_route(f"{entry.name}/link", link,
                                                  int(launcher.free_port()),
                                                  faults_as=entry.name)
                entry.env = {FAILPOINTS_VARIABLE: str(failpoints),
                             "ATOMLOG_REPLICATION_LINK_LISTEN": link,
                             "ATOMLOG_REPLICATION_LINK_ADVERTISED_PORT":
                                 link_proxy.rsplit(":", 1)[1]}
            elif entry.role == "coordinator":
                # Its link (clients' transaction calls, partition servers' verifications)
                # likewise: net faults cut them too.
                link = f"127.0.0.1:{launcher.free_port()}"
                link_proxy = self.proxy.add_route(f"{entry.name}/link", link,
                                                  int(launcher.free_port()),
                                                  faults_as=entry.name)
                entry.env = {"ATOMLOG_COORDINATOR_LINK_LISTEN": link,
                             "ATOMLOG_COORDINATOR_LINK_ADVERTISED_PORT":
                                 link_proxy.rsplit(":", 1)[1]}
        if "power" in self.options.nemeses:
            self.mount_power_disks(cluster)
        if "disk" in self.options.nemeses:
            self.mount_small_disk(self.disk_server(cluster))
        cluster.save(self.data_dir)
        self.say(f"starting a cluster in {self.data_dir}")
        report = launcher.up(self.data_dir, self.counts, self.settings, timeout_s=120,
                             tls=self.options.tls)
        self.cluster = report.cluster
        self.refresh_names()
        self.mark_logs()
        self.say(f"cluster up in {report.seconds:.1f} s")

    @staticmethod
    def disk_server(cluster: launcher.ClusterFile) -> launcher.ProcessEntry:
        """The partition server whose data lives on the small filesystem (the last one)."""
        return [p for p in cluster.processes if p.role in launcher.SERVES_PARTITIONS][-1]

    @staticmethod
    def entry(cluster: launcher.ClusterFile, name: str) -> launcher.ProcessEntry:
        return next(p for p in cluster.processes if p.name == name)

    def mount_power_disks(self, cluster: launcher.ClusterFile) -> None:
        """A disk that can lose power (tests/chaos/disks.py) for every server that holds
        partitions; the disk nemesis's server gets a small one, to fill up."""
        why = disks.available()
        if why is not None:
            self.notes.append(f"power skipped: {why}")
            return
        images = self.images = disks.images_dir(self.run_dir.name, self.run_dir)
        small = self.disk_server(cluster).name if "disk" in self.options.nemeses else ""
        try:
            for entry in cluster.processes:
                if entry.role in launcher.SERVES_PARTITIONS:
                    disk = disks.LoopDisk(images / f"{entry.name}.img", Path(entry.data_dir),
                                          DISK_BYTES if entry.name == small else
                                          POWER_DISK_BYTES)
                    disk.create()
                    self.disks[entry.name] = disk
        except OSError as error:
            self.notes.append(f"power skipped: {error}")
            self.remove_power_disks()
        else:
            self.say(f"disks that lose power: {', '.join(self.disks)} (images in {images})")

    def remove_power_disks(self) -> None:
        if self.disks and self.options.keep_cluster:
            self.notes.append(f"--keep-cluster: the power disks' images (ext4) are in "
                              f"{self.images}")
        for disk in self.disks.values():
            if self.options.keep_cluster:
                disk.detach()  # (the images stay: mount one to look at a server's data)
            else:
                disk.remove()
        if self.images is not None and not self.options.keep_cluster:
            shutil.rmtree(self.images, ignore_errors=True)
        self.disks.clear()

    def mount_small_disk(self, entry: launcher.ProcessEntry) -> None:
        """A small filesystem of its own for one partition server, to fill up."""
        path = Path(entry.data_dir)
        path.mkdir(parents=True, exist_ok=True)
        if entry.name in self.disks:  # (already one, of DISK_BYTES: mount_power_disks)
            self.mounted = str(path)
            return
        if os.geteuid() != 0:
            self.notes.append("disk-full skipped: mounting a small filesystem needs root")
            return
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_BYTES}",
                                 "atomlog-chaos", str(path)], capture_output=True, text=True)
        if result.returncode != 0:
            self.notes.append(f"disk-full skipped: mount failed: {result.stderr.strip()}")
            return
        self.mounted = str(path)

    def refresh_names(self) -> None:
        for entry in self.cluster.processes:
            if entry.pid:
                self.names[entry.pid] = entry.name

    def topology(self) -> nemesis.Topology:
        names = {role: tuple(p.name for p in self.cluster.processes if p.role == role)
                 for role in launcher.START_ORDER}
        clients = tuple(n for n in self.workload_clients() if n.startswith(KILLABLE_CLIENTS))
        return nemesis.Topology(names["partition_server"] + names["combined"], names["coordinator"],
                                names["id_allocator"], clients,
                                self.disk_server(self.cluster).name if self.mounted else "",
                                SESSION_TIMEOUT_MS / 1000,
                                tuple(f"{topic}/{p}" for topic, count in self.topics.items()
                                      for p in range(count)),
                                REPLICA_MAX_LAG_MS / 1000)

    def restart(self, name: str) -> None:
        entry = self.entry(self.cluster, name)
        if not launcher.process_alive(entry.pid, launcher.marker_of(entry)):
            self.mark_logs([entry])
            entry.pid = (launcher.start_zookeeper(entry) if entry.role == "zookeeper"
                         else launcher.start_service(self.cluster, entry))
            self.names[entry.pid] = name
            self.cluster.save(self.data_dir)
        self.down.discard(name)  # (a start that raised: still down, the final heal's)

    def mark_logs(self, entries=None) -> None:
        """Where each process's log ends before it (re)starts: what it logs from there on
        is its own incarnation's (exit_reason)."""
        for entry in entries if entries is not None else self.cluster.processes:
            try:
                self.log_marks[entry.name] = os.path.getsize(entry.log_file)
            except OSError:
                self.log_marks[entry.name] = 0

    def exit_reason(self, entry: launcher.ProcessEntry) -> tuple[str, bool]:
        """What a server that exited by itself last logged of its start (its "cannot
        start" event), and whether that exit is a problem of the run: a start given up
        on ZooKeeper, or no such event at all (a crash, or killed by something else)."""
        try:
            with open(entry.log_file, "rb") as log_file:
                log_file.seek(self.log_marks.get(entry.name, 0))
                tail = log_file.read()[-(256 << 10):].decode("utf-8", "replace")
        except OSError as error:
            return f"its log unreadable: {error!r}", True
        for line in reversed(tail.splitlines()):
            if '"stopping: the write-ahead file failed' in line:
                # A failed round under the commit lane's fatal frames stops the server
                # (WalTap.fatal) and the supervisor's restart repairs it: a note when the
                # harness's disk-fsync fault failed it, a problem when the disk did.
                return line[:400], HARNESS_FSYNC not in line
            if '"cannot start' in line:
                try:
                    event = json.loads(line)
                except ValueError:
                    return line[:400], True
                said = " ".join(str(event.get(k, "")) for k in ("msg", "reason", "error", "at"))
                return said.strip(), ("ZooKeeper" in said or "ZOOKEEPER" in said)
        lines = [line for line in tail.splitlines() if line.strip()]
        return f"no start-up failure logged; last line: {lines[-1][:400] if lines else '-'}", True

    def watch_servers(self) -> None:
        """A server (or ZooKeeper) that exits when no fault holds it down exited by
        itself: recorded (a problem, see exit_reason) and started again, as a supervisor
        would. Looked at every 0.5 s."""
        if self.cluster is None or time.monotonic() - self.servers_watched < 0.5:
            return
        self.servers_watched = time.monotonic()
        for entry in self.cluster.processes:
            if entry.name in self.down or not entry.pid or \
                    launcher.process_alive(entry.pid, launcher.marker_of(entry)):
                continue
            self.server_exited(entry)
            self.restart(entry.name)

    def server_exited(self, entry: launcher.ProcessEntry) -> None:
        reason, problem = self.exit_reason(entry)
        code = launcher.REAPED.get(entry.pid)
        if code is not None:  # (a negative code: the signal that ended it)
            reason += f" (exit status {code})" if code >= 0 else f" (signal {-code})"
        text = f"{entry.name} exited by itself: {reason}"
        self.say(text + ": starting it again")
        (self.server_exits if problem else self.notes).append(text)

    def teardown(self) -> None:
        self.proxy.heal_all()
        if self.cluster is not None:
            for entry in self.cluster.processes:
                if entry.pid:
                    try:
                        os.kill(entry.pid, signal.SIGCONT)
                    except ProcessLookupError:
                        pass
            try:
                launcher.down(self.data_dir, timeout_s=15)
            except launcher.LaunchError as error:
                self.notes.append(f"down: {error}")
        self.proxy.stop()
        if self.mounted and self.mounted not in {str(d.mount) for d in self.disks.values()}:
            subprocess.run(["umount", "-l", self.mounted], capture_output=True)
        self.remove_power_disks()
        if not self.options.keep_cluster:  # the servers' logs stay, in cluster-logs/
            if (self.data_dir / "logs").is_dir():
                shutil.move(self.data_dir / "logs", self.run_dir / "cluster-logs")
            shutil.rmtree(self.data_dir, ignore_errors=True)

    # ------------------------------------------------------------------ faults
    def inject(self, fault: nemesis.Fault) -> None:
        op = self.log.invoke("nemesis", fault=fault.fault, target=fault.target,
                             detail=fault.to_json())
        self.say(f"fault {fault.fault} {fault.target} for {fault.duration_s:.1f} s")
        heal = self.apply(fault)
        self.wait_until(time.monotonic() + fault.duration_s)
        try:
            heal()
            self.log.complete(op, "ok")
        except Exception as error:  # noqa: BLE001 — recorded; the final heal retries
            self.log.complete(op, "fail", error=repr(error))
            self.notes.append(f"healing {fault.fault} {fault.target} failed: {error!r}")

    def replicas_of(self, partition: str) -> tuple[list[str], str | None]:
        """The replicas and current leader of "topic/p", from its topic record and state in
        ZooKeeper (read directly, not through the fault proxy); ([], None) if unreadable."""
        from kazoo.client import KazooClient

        from partition_server.partition_states import path_of
        from partition_server.replication import PartitionState
        from services.topics import TopicRecord

        topic, number = partition.rsplit("/", 1)
        zookeeper = self.entry(self.cluster, "zookeeper").grpc_address
        client = KazooClient(hosts=zookeeper + self.cluster.chroot, timeout=5)
        try:
            client.start(timeout=5)
            record = TopicRecord.from_json(topic, json.loads(client.get(f"/topics/{topic}")[0]))
            data, _ = client.get(path_of(topic, int(number)))
            return record.replicas_of(int(number)), PartitionState.from_json(data).leader
        except Exception as error:  # noqa: BLE001 — an unreplicated topic, ZooKeeper away
            self.notes.append(f"replicas of {partition} unknown ({error!r})")
            return [], None
        finally:
            client.stop()
            client.close()

    def leader_of(self, partition: str) -> str:
        """The current leader of "topic/p" (replicas_of); a partition server chosen from
        the name if it cannot be read."""
        _replicas, leader = self.replicas_of(partition)
        servers = [p.name for p in self.cluster.processes
                   if p.role in launcher.SERVES_PARTITIONS]
        # (crc32, not hash(): a seed must pick the same server in every run)
        fallback = servers[zlib.crc32(partition.encode()) % len(servers)]
        return leader if leader in servers else fallback

    def reassign(self, partition: str, replicas: list[str]) -> None:
        """`partition reassign` of "topic/p" to `replicas` (the RPC, through the SDK with the
        run's client certificate), retried for up to 30 s while servers are away — a
        server named that is restarting is not registered yet (INVALID_REPLICA_ASSIGNMENT
        until it is)."""
        from atomlog.v1 import metadata_pb2
        from spark_client import Client, errors

        topic, number = partition.rsplit("/", 1)
        request = metadata_pb2.ReassignPartitionRequest(topic=topic, partition=int(number),
                                                        replicas=replicas)
        deadline = time.monotonic() + 30
        with Client(self.spec["bootstrap"], request_timeout_s=10.0,
                    tls=self.client_tls()) as client:
            while True:
                try:
                    client.metadata.call("ReassignPartition", request)
                    return
                except errors.AtomlogClientError as error:
                    again = error.retriable or error.reason == "INVALID_REPLICA_ASSIGNMENT"
                    if not again or time.monotonic() > deadline:
                        raise
                    time.sleep(0.5)

    def wait_in_sync(self, timeout_s: float) -> bool:
        """Until every replicated partition's ISR holds all its replicas, with the same
        leaders for longer than a ZooKeeper session (out_of_sync); False after
        timeout_s."""
        return self.out_of_sync(timeout_s, SESSION_TIMEOUT_MS / 1000 + 1.0) == []

    def out_of_sync(self, timeout_s: float, stable_s: float = 0.0) -> list[str] | None:
        """Wait until every replicated partition's ISR holds all its replicas (read from
        ZooKeeper directly), with the same leaders and epochs for `stable_s`: [] then,
        else after timeout_s the partitions ("topic/p") whose ISR still does not, or None
        when ZooKeeper could not be read. (A state read just after servers died still
        shows them leading and in sync until their sessions expire: a wipe that trusted
        it right after a power cut of every server wiped the last in-sync copy of
        partitions whose other replicas had left their ISRs when they restarted, seed
        2900.)"""
        from kazoo.client import KazooClient

        from partition_server.partition_states import path_of
        from partition_server.replication import PartitionState
        from services.topics import TopicRecord

        zookeeper = self.entry(self.cluster, "zookeeper").grpc_address
        client = KazooClient(hosts=zookeeper + self.cluster.chroot, timeout=5)
        deadline = time.monotonic() + timeout_s
        whole: tuple[float, dict] | None = None  # since when, and the leaderships then
        try:
            client.start(timeout=5)
            while True:
                self.watch_clients()
                lagging, leaderships = [], {}
                for name in client.get_children("/topics"):
                    record = TopicRecord.from_json(name, json.loads(client.get(f"/topics/{name}")[0]))
                    for p in range(record.partitions if record.replicated else 0):
                        state = PartitionState.from_json(client.get(path_of(name, p))[0])
                        leaderships[f"{name}/{p}"] = (state.leader, state.leader_epoch)
                        if state.leader is None or \
                                sorted(state.isr) != sorted(record.replicas_of(p)):
                            lagging.append(f"{name}/{p}")
                now = time.monotonic()
                if lagging or whole is None or whole[1] != leaderships:
                    whole = None if lagging else (now, leaderships)
                if whole is not None and now - whole[0] >= stable_s:
                    return []
                if now >= deadline:  # (in sync, but not for stable_s: say which moved)
                    return lagging or sorted(leaderships)
                time.sleep(0.2)
        except Exception as error:  # noqa: BLE001 — ZooKeeper away: not in sync
            self.notes.append(f"in-sync check failed: {error!r}")
            return None
        finally:
            client.stop()
            client.close()

    def apply(self, fault: nemesis.Fault):
        kind, target = fault.fault, fault.target
        if kind.startswith("leader-"):
            leader = self.leader_of(target)
            self.log.record("nemesis-target", fault=kind, partition=target, leader=leader)
            self.say(f"  leader of {target}: {leader}")
            if kind == "leader-kill":
                return self.apply(nemesis.Fault(fault.at_s, "kill", leader, fault.duration_s))
            if kind == "leader-pause":
                return self.apply(nemesis.Fault(fault.at_s, "pause", leader, fault.duration_s))
            if kind == "leader-zk-cut":
                self.proxy.set_fault(leader, "zookeeper", "drop")
                self.proxy.set_fault("zookeeper", leader, "drop")
                return lambda: (self.proxy.heal(leader, "zookeeper"),
                                self.proxy.heal("zookeeper", leader))
            followers = [p.name for p in self.cluster.processes
                         if p.role in launcher.SERVES_PARTITIONS and p.name != leader]
            for follower in followers:
                self.proxy.set_fault(leader, follower, "drop")
                self.proxy.set_fault(follower, leader, "drop")
            return lambda: [(self.proxy.heal(leader, f), self.proxy.heal(f, leader))
                            for f in followers]
        if kind.startswith("reassign-"):
            replicas, leader = self.replicas_of(target)
            if len(replicas) < 2:
                self.notes.append(f"{kind} of {target} skipped: replicas {replicas}")
                return lambda: None
            if kind == "reassign-leader" and leader in replicas:
                dropped = leader
            else:
                followers = [r for r in replicas if r != leader] or replicas
                dropped = followers[zlib.crc32(target.encode()) % len(followers)]
            smaller = [r for r in replicas if r != dropped]
            self.log.record("nemesis-target", fault=kind, partition=target, leader=leader,
                            replicas=replicas, target=smaller)
            self.say(f"  {target}: replicas {','.join(replicas)} -> {','.join(smaller)}")
            try:
                self.reassign(target, smaller)
            except Exception as error:  # noqa: BLE001 — a fault not injected, not a verdict
                self.notes.append(f"{kind} of {target} not begun: {error!r}")
                return lambda: None
            return lambda: self.reassign(target, replicas)
        if kind == "wipe":
            # One lost disk at a time, repaired before the next: with every partition's
            # replicas back in sync (else three quick wipes erase every copy).
            if not self.wait_in_sync(60.0):
                self.notes.append(f"wipe of {target} skipped: replicas not in sync for 60 s")
                return lambda: None
            self.kill(target)
            partitions = Path(self.entry(self.cluster, target).data_dir) / "partitions"
            for child in (partitions.iterdir() if partitions.is_dir() else ()):
                shutil.rmtree(child, ignore_errors=True)
            return lambda: self.restart(target)
        if kind == "corrupt":
            # Only with every copy in sync: the damaged leader must have an heir (with
            # none it waits in DATA_LOSS for an operator, which a run does not play).
            if not self.wait_in_sync(60.0):
                self.notes.append(f"corrupt of {target} skipped: replicas not in sync for 60 s")
                return lambda: None
            self.corrupt(target)
            return lambda: None
        if kind in ("power", "power-all"):
            return self.power_cut(fault)
        if kind == "misplace":
            return self.misplace(fault)
        if kind == "kill":
            self.kill(target)
            return lambda: self.restart(target)
        if kind == "restart-zk-blip":
            # Killed, started again after down_s, and delay_s into that start cut off from
            # ZooKeeper for the fault's duration (longer than its session): whichever
            # start-up step is talking to ZooKeeper then must wait for it to come back.
            self.kill(target)
            self.wait_until(time.monotonic() + fault.down_s)
            self.restart(target)
            self.wait_until(time.monotonic() + fault.delay_s)
            self.proxy.set_fault(target, "zookeeper", "drop")
            self.proxy.set_fault("zookeeper", target, "drop")
            return lambda: (self.proxy.heal(target, "zookeeper"),
                            self.proxy.heal("zookeeper", target))
        if kind == "client-kill":
            client = self.clients[target]
            if client.process is not None:
                client.process.kill()
                client.process.wait()
                client.process = None  # not a crash: restarted when healed
            return lambda: self.spawn(client, again=True)
        if kind == "pause":
            pid = self.entry(self.cluster, target).pid
            self.signal(pid, signal.SIGSTOP)
            return lambda: self.signal(pid, signal.SIGCONT)
        if kind == "net-isolate":
            self.proxy.set_fault(target, "*", "drop")
            self.proxy.set_fault("*", target, "drop")
            return lambda: (self.proxy.heal(target, "*"), self.proxy.heal("*", target))
        if kind.startswith("net-"):
            source, destination = target.split("->")
            mode = {"net-drop": "drop", "net-oneway": "oneway", "net-delay": "delay",
                    "net-reset": "reset"}[kind]
            self.proxy.set_fault(source, destination, mode, fault.delay_s)
            return lambda: self.proxy.heal(source, destination)
        if kind == "disk-fsync":
            armed = self.run_dir / "failpoints" / target / FSYNC
            armed.touch()
            return lambda: armed.unlink(missing_ok=True)
        if kind == "disk-full":
            filler = Path(self.mounted) / "filler"
            fill(filler)
            return lambda: filler.unlink(missing_ok=True)
        raise AssertionError(kind)

    def corrupt(self, partition: str) -> None:
        """Flip a byte near the end of the middle batch of the oldest segment of a copy of
        "topic/p". The run's corrupt faults take turns (CORRUPT_KINDS): the leader's
        copy, then that batch fetched from the leader, so that its read finds the damage
        (reads of the workload are at the end of the log); a follower's copy, which no
        read touches, left to the scrubber; the leader's copy, left to the scrubber."""
        from atomlog.v1 import common_pb2, partition_pb2, partition_pb2_grpc
        from spark_client import Client

        kind = CORRUPT_KINDS[self.corrupts % len(CORRUPT_KINDS)]
        self.corrupts += 1
        replicas, _leader = self.replicas_of(partition)
        leader = self.leader_of(partition)  # (or its fallback)
        followers = [r for r in replicas if r != leader]
        damaged = followers[0] if kind.startswith("follower") and followers else leader
        topic, number = partition.rsplit("/", 1)
        directory = Path(self.entry(self.cluster, damaged).data_dir) / "partitions" / \
            f"{topic}-{number}"
        segments = sorted(directory.glob("*.log"))
        if not segments:
            self.notes.append(f"corrupt of {partition} skipped: no segment on {damaged}")
            return
        data = segments[0].read_bytes()
        batches = list(batch_spans(data))
        if not batches:
            self.notes.append(f"corrupt of {partition} skipped: no batch on {damaged}")
            return
        at, header = batches[len(batches) // 2]
        offset, flipped = header.base_offset, at + header.size - 5
        fd = os.open(segments[0], os.O_RDWR)
        try:
            os.pwrite(fd, bytes([data[flipped] ^ 0xFF]), flipped)
        finally:
            os.close(fd)
        self.log.record("nemesis-target", fault="corrupt", partition=partition, leader=leader,
                        damaged=damaged, kind=kind, segment=segments[0].name, offset=offset,
                        position=flipped)
        self.say(f"  {partition}: byte {flipped} of {damaged}'s {segments[0].name} "
                 f"(batch at offset {offset}) flipped ({kind})")
        if kind != "leader, read":
            return
        request = partition_pb2.FetchRequest(items=[partition_pb2.FetchItem(
            topic_partition=common_pb2.TopicPartition(topic=topic, partition=int(number)),
            fetch_offset=offset)])
        try:
            with Client(self.spec["bootstrap"], request_timeout_s=10.0,
                        tls=self.client_tls()) as client:
                address = next(p.grpc_address for p in self.cluster.processes
                               if p.name == leader)
                stub = partition_pb2_grpc.PartitionServiceStub(client.channels.get(address))
                reply = stub.Fetch(request, timeout=10)
                self.say(f"  the leader's read: {reply.results[0].error.reason or 'served'}")
        except Exception as error:  # noqa: BLE001 — the damage stays for a later read
            self.notes.append(f"corrupt of {partition}: the read failed ({error!r})")

    def power_cut(self, fault: nemesis.Fault):
        """Power lost: the target's (power) or every server's (power-all; ZooKeeper stays
        up) process killed with SIGKILL, then each dead server's disk reverted to what its
        device held (disks.LoopDisk.cut): its unsynced writes are gone, and some of the
        tails they left may be torn (drawn from the seed). Healed by starting them
        again."""
        kind, target = fault.fault, fault.target
        if not self.disks:
            self.notes.append(f"{kind} skipped: no disks that lose power")
            return lambda: None
        victims = ([p.name for p in self.cluster.processes if p.role != "zookeeper"]
                   if kind == "power-all" else [target])
        for name in victims:
            self.kill(name)
        cut = [name for name in victims if name in self.disks]
        copies = {name: self.disks[name].snapshot() for name in cut}  # all at one moment
        checks = {}
        for name in cut:
            try:
                tear = random.Random(f"power/{self.options.seed}/{fault.at_s}/{name}")
                checks[name] = self.disks[name].cut(copies[name], tear)
            except OSError as error:  # its disk cannot be mounted again: a problem
                checks[name] = f"failed: {error}"
                self.stalls.append(f"{kind}: {name}'s disk after the cut: {error}")
        self.log.record("nemesis-target", fault=kind, killed=victims, disks=checks)
        self.say(f"  power lost: {', '.join(victims)}; disks: "
                 f"{', '.join(f'{n} {c}' for n, c in checks.items())}")
        return lambda: [self.restart(name) for name in victims]

    def misplace(self, fault: nemesis.Fault):
        """A server started on an empty disk by mistake, or without some of its
        directories: killed with SIGKILL, every partition directory it holds (half of the
        faults, by a draw from the seed) or a part of them moved aside (into
        `partitions/misplaced`, on the same filesystem), started again after down_s. Each
        moved partition must open in DATA_LOSS, not empty at offset 0, and none of the
        others in DATA_LOSS: checked before the heal (a problem of the run otherwise).
        Healed by a kill, the directories put back and a start."""
        target = fault.target
        self.kill(target)
        partitions = Path(self.entry(self.cluster, target).data_dir) / "partitions"
        aside = partitions / "misplaced"
        held = sorted(child.name for child in partitions.iterdir()
                      if child.is_dir() and PARTITION_DIRECTORY.match(child.name))
        # (A draw of its own: the schedule, and so every seed's faults, stay as they were.)
        draw = random.Random(f"misplace/{self.options.seed}/{fault.at_s}/{target}")
        moved = held
        if len(held) > 1 and draw.random() < 0.5:
            moved = sorted(draw.sample(held, draw.randint(1, len(held) - 1)))
        kept = sorted(set(held) - set(moved))
        aside.mkdir(exist_ok=True)
        for name in moved:
            (partitions / name).rename(aside / name)
        fsync_directory(aside)  # a swapped disk stays swapped over a power cut
        fsync_directory(partitions)
        self.log.record("nemesis-target", fault="misplace", server=target, moved=moved,
                        kept=kept)
        self.say(f"  {target}: {len(moved)} of {len(held)} partition directories moved aside")
        self.wait_until(time.monotonic() + fault.down_s)
        self.restart(target)

        def heal() -> None:
            self.check_lost_copies(target, moved, kept)
            self.kill(target)
            for name in moved:
                shutil.rmtree(partitions / name, ignore_errors=True)  # its DATA_LOSS copy
                (aside / name).rename(partitions / name)
            aside.rmdir()
            # (Durable, as the right disk put back: a power cut after the heal must not
            # bring the DATA_LOSS copies back. Found by seed 2919.)
            fsync_directory(partitions)
            self.restart(target)
        return heal

    def check_lost_copies(self, server: str, moved: list[str], kept: list[str]) -> None:
        """The partitions whose directories `server` lost: each must be in DATA_LOSS there
        (LOADING or not answering yet is not a verdict; ONLINE is a problem of the run: a
        lost copy served empty). The ones it kept must not be (a copy taken for lost)."""
        from atomlog.v1 import partition_pb2, partition_pb2_grpc
        from spark_client import Client

        address = self.entry(self.cluster, server).grpc_address
        deadline, reply = time.monotonic() + 15, None
        with Client(self.spec["bootstrap"], request_timeout_s=10.0,
                    tls=self.client_tls()) as client:
            stub = partition_pb2_grpc.PartitionServiceStub(client.channels.get(address))
            while reply is None:
                try:
                    reply = stub.ListPartitions(
                        partition_pb2.ListPartitionsRequest(include_internal=True), timeout=5)
                except Exception as error:  # noqa: BLE001 — still starting: ask again
                    if time.monotonic() > deadline:
                        self.notes.append(f"misplace of {server}: its partitions not read "
                                          f"({error!r})")
                        return
                    self.wait_until(time.monotonic() + 0.5)
        states = {f"{p.topic_partition.topic}-{p.topic_partition.partition}":
                  partition_pb2.PartitionState.Name(p.state).removeprefix("PARTITION_STATE_")
                  for p in reply.partitions}
        served = sorted(name for name in moved if states.get(name) == "ONLINE")
        counts = {state: sum(1 for name in moved if states.get(name, "?") == state)
                  for state in sorted({states.get(name, "?") for name in moved})}
        mistaken = sorted(name for name in kept if states.get(name) == "DATA_LOSS")
        self.log.record("nemesis-target", fault="misplace-check", server=server, states=counts,
                        kept=len(kept), kept_in_data_loss=mistaken)
        self.say(f"  {server}'s lost copies: {counts}; of {len(kept)} kept, "
                 f"{len(mistaken)} in DATA_LOSS")
        if served:
            self.stalls.append(f"misplace: {server} served lost copies empty: {served}")
        if mistaken:
            self.stalls.append(f"misplace: {server} took kept copies for lost: {mistaken}")

    def kill(self, name: str) -> None:
        """kill -9 of a cluster process, held down until a heal restarts it; returns once
        it is gone (a signal is delivered asynchronously: a restart at once would find
        it still alive and start nothing, and watch_servers would then see it die)."""
        entry = self.entry(self.cluster, name)
        self.down.add(name)
        self.signal(entry.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while launcher.process_alive(entry.pid, launcher.marker_of(entry)) and \
                time.monotonic() < deadline:
            time.sleep(0.01)

    @staticmethod
    def signal(pid: int, which: int) -> None:
        try:
            os.kill(pid, which)
        except ProcessLookupError:
            pass

    def heal_all(self) -> None:
        """Every fault undone, every process running and SERVING."""
        self.say("healing everything")
        self.proxy.heal_all()
        for armed in (self.run_dir / "failpoints").glob(f"*/{FSYNC}"):
            armed.unlink()
        if self.mounted:
            (Path(self.mounted) / "filler").unlink(missing_ok=True)
        for entry in self.cluster.processes:
            self.signal(entry.pid, signal.SIGCONT)
        self.down.clear()
        self.servers_watched = 0.0
        self.watch_servers()  # (one that exited since the last look is recorded)
        report = launcher.up(self.data_dir, self.counts, self.settings, timeout_s=120,
                             tls=self.options.tls)
        self.cluster = report.cluster
        self.refresh_names()
        if report.started:
            self.notes.append(f"restarted while healing: {', '.join(report.started)}")

    def check_tc_leases(self) -> None:
        """Liveness after healing: every TC partition has a coordinator that has loaded it
        (it answers ListTransactions for it) within TC_LEASES_S. (A combined server paused
        during its start once never took a lease: every transaction of its TC partitions
        answered NOT_COORDINATOR until the end, and the inputs their acks held were
        refused TRANSACTION_CONFLICT to every other worker; exactly once held, so only
        this check sees it. And a TC partition once held a lease and stayed loading,
        its __txn_log partition broken by a failed recovery-point write: seed 2791.)"""
        from atomlog.v1 import coordinator_pb2
        from services.cli import list_transactions_everywhere
        from spark_client import Client

        missing: dict[int, str] = {}

        def all_loaded() -> bool:
            with Client(self.spec["bootstrap"], request_timeout_s=5,
                        tls=self.client_tls()) as client:
                client.metadata.refresh()  # the TC partitions' count and routes
                listing = list_transactions_everywhere(
                    client, coordinator_pb2.ListTransactionsRequest(limit=1), rounds=1)
            missing.clear()
            missing.update(listing.missing)
            return listing.count > 0 and len(listing.searched) == listing.count

        if not self.wait_for(all_loaded, TC_LEASES_S):
            self.stalls.append(f"TC partitions without a coordinator that loaded them "
                               f"{TC_LEASES_S:.0f} s after healing: "
                               f"{missing or 'metadata unreadable'}")

    # ------------------------------------------------------------------ workload
    def prepare_workload(self, final_log: EventLog) -> None:
        from spark_client import Client

        bootstrap = [p.advertised_address for p in self.cluster.processes
                     if p.role in launcher.SERVES_PARTITIONS]
        spec = {"bootstrap": bootstrap, "topics": self.topics, "txn_timeout_s": TXN_TIMEOUT_S,
                "ack_timeout_s": ACK_TIMEOUT_S, "incarnations": {},
                "parent_timeout_s": PARENT_TIMEOUT_S, "child_timeout_s": CHILD_TIMEOUT_S,
                "prepared_timeout_s": PREPARED_TIMEOUT_S,
                "deadline": time.time() + self.duration_s + DRAIN_S + 600,
                "data_topics": list(LOG_TOPICS),
                # --tls: the client certificate's files (TlsConfig fields), else empty.
                "tls": self.client_tls_files()}
        if self.options.workload == "ctp":
            spec.update(input_topic="ctp-in", output_topic="ctp-out", subscription="chaos",
                        data_topics=[])
        if self.options.workload == "log":
            spec.update(trim_topic=TRIM_TOPIC)
        self.spec = spec
        self.write_spec()
        final_log.record("workload", workload=self.options.workload, seed=self.options.seed,
                         topics=self.topics, txn_timeout_s=TXN_TIMEOUT_S,
                         nemeses=self.options.nemeses,
                         **{k: spec[k] for k in ("input_topic", "output_topic", "subscription",
                                                 "trim_topic") if k in spec},
                         **({"transform": "out:"} if self.options.workload == "ctp" else {}))
        with Client(bootstrap, tls=self.client_tls()) as client:
            for topic, partitions in self.topics.items():
                create_online(client, topic, partitions)
            if "trim_topic" in spec:
                create_online(client, TRIM_TOPIC["name"], TRIM_TOPIC["partitions"],
                              config={"segment.bytes": str(TRIM_SEGMENT_BYTES)})
        for spec_name in self.workload_clients():
            name, _, isolation = spec_name.partition(":")
            self.clients[name] = ClientProcess(name, name.split("-")[0],
                                               isolation or "read_committed")

    def client_tls_files(self) -> dict[str, str]:
        tls = self.cluster.tls if self.cluster is not None else {}
        return {k: tls[k] for k in ("ca_file", "cert_file", "key_file")} if tls else {}

    def client_tls(self):
        """The admin client certificate of a --tls run (a TlsConfig), else None."""
        return self.cluster.client_tls() if self.cluster is not None else None

    def write_spec(self) -> None:
        path = self.run_dir / "workload.json"
        path.with_suffix(".tmp").write_text(json.dumps(self.spec, indent=1))
        os.replace(path.with_suffix(".tmp"), path)

    def spawn(self, client: ClientProcess, again: bool = False) -> None:
        if again:
            client.incarnation += 1
            self.spec["incarnations"][client.name] = client.incarnation
            self.write_spec()
        logs = self.run_dir / "logs"
        logs.mkdir(exist_ok=True)
        seed = str(self.options.seed + client.incarnation)
        if client.name == GO_CTP_WORKER:
            command = [str(self.go_cli), "chaos-ctp", "-run-dir", str(self.run_dir),
                       "-name", client.name, "-seed", seed]
        else:
            command = [sys.executable, "-m", "tests.chaos.client", client.role,
                       "--run-dir", str(self.run_dir), "--name", client.name,
                       "--seed", seed, "--isolation", client.isolation]
        with open(logs / f"{client.name}.log", "ab") as output:
            client.process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=output,
                                              stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL)
        self.names[client.process.pid] = client.name

    def watch_clients(self) -> None:
        """A client that exits by itself before it is told to has crashed: noted, restarted."""
        for client in self.clients.values():
            process = client.process
            if process is not None and process.poll() is not None:
                client.crashes.append(f"incarnation {client.incarnation} exited "
                                      f"{process.returncode}")
                self.say(f"client {client.name} exited {process.returncode}: restarting it")
                self.spawn(client, again=True)

    def stop_clients(self, clients: list[ClientProcess]) -> None:
        live = [c for c in clients if c.process is not None and c.process.poll() is None]
        for client in live:
            client.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + CLIENT_STOP_S
        for client in live:
            try:
                client.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                client.process.kill()
                client.process.wait()
                self.notes.append(f"client {client.name} did not stop in {CLIENT_STOP_S:.0f} s")
        for client in clients:
            client.process = None

    def finish_workload(self) -> None:
        """Writers stop; ctp workers first drain the input (bounded)."""
        writers = [c for c in self.clients.values() if c.role in ("producer", "txn", "session",
                                                                   "feeder")]
        self.stop_clients(writers)
        if self.options.workload == "ctp":
            self.say("ctp: waiting for the workers to finish the input")
            if not self.wait_for(self.input_consumed, DRAIN_S):
                self.stalls.append(f"ctp: the workers did not consume the input within "
                                   f"{DRAIN_S:.0f} s of healing")
        self.stop_clients(list(self.clients.values()))

    def wait_for(self, predicate, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.watch_clients()
            try:
                if predicate():
                    return True
            except Exception:  # noqa: BLE001 — not yet answerable (a server recovering)
                pass
            time.sleep(0.5)
        return False

    def input_consumed(self) -> bool:
        from spark_client import Client

        with Client(self.spec["bootstrap"], request_timeout_s=5, tls=self.client_tls()) \
                as client:
            with client.consumer(self.spec["input_topic"], isolation="read_uncommitted") as reader:
                ends = reader.end_offsets()
            with client.consumer(self.spec["input_topic"], subscription=self.spec["subscription"]) \
                    as consumer:
                cursors = consumer.describe()
        for cursor in cursors:
            end = ends[(self.spec["input_topic"], cursor.subscription_partition.partition)]
            # The input is written without transactions: no markers, so a partition is
            # consumed when its cursor reached the high watermark.
            if cursor.pending_acks or cursor.cumulative_end_offset < end:
                return False
        return True

    # ------------------------------------------------------------------ the end
    def quiesce_and_read(self, final_log: EventLog) -> None:
        from spark_client import Client

        self.say("waiting for quiescence (no open transaction anywhere)")
        with Client(self.spec["bootstrap"], request_timeout_s=10, tls=self.client_tls()) \
                as client:
            deadline = time.monotonic() + QUIESCENCE_S
            while True:
                positions = self.positions(client)
                settled = positions is not None and all(
                    p["max_read_position"] == p["high_watermark"] and not p["open_txns"]
                    for p in positions)
                if settled or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            if positions is not None:
                final_log.record("final-positions", partitions=positions)
            for isolation in ("read_committed", "read_uncommitted"):
                self.final_read(client, isolation, final_log)
            if "trim_topic" in self.spec:
                self.final_trim_read(client, final_log)
            if self.options.workload == "ctp":
                self.final_cursors(client, final_log)

    def final_replicas(self, final_log: EventLog) -> None:
        """Replicated runs, once quiet, for the checker's diverged-replicas: the
        partitions (every replicated topic's, the TC log's too) whose ISR is still not
        whole QUIESCENCE_S after healing, and every copy of each workload partition, read
        from its replica's files (where its segments start, its log end and a digest of
        its whole batches). Read again until the copies agree or REPLICAS_AGREE_S passed,
        so a follower still copying the last markers is not a divergence; one that never
        agrees is."""
        if self.options.replication < 2:
            return
        self.say("waiting for every ISR to be whole, then comparing the replicas' files")
        op = final_log.invoke("replicas")
        lagging = self.out_of_sync(QUIESCENCE_S)
        if lagging is None:
            final_log.complete(op, "fail", partitions=[], out_of_sync=[])
            return
        topics = dict(self.topics)
        if "trim_topic" in self.spec:  # its followers delete what their leader deleted
            topics[TRIM_TOPIC["name"]] = TRIM_TOPIC["partitions"]
        names = [f"{topic}/{p}" for topic, count in topics.items() for p in range(count)]
        replicas = {name: self.replicas_of(name)[0] for name in names}
        deadline = time.monotonic() + REPLICAS_AGREE_S
        while True:
            rows = [{"topic": name.rsplit("/", 1)[0], "partition": int(name.rsplit("/", 1)[1]),
                     "copies": [self.copy_of(server, name) for server in replicas[name]]}
                    for name in names]
            if all(len({(c["bases"], c["end"], c["digest"]) for c in row["copies"]}) <= 1
                   for row in rows) or time.monotonic() > deadline:
                break
            time.sleep(1)
        final_log.complete(op, "ok", out_of_sync=lagging, partitions=[
            {**row, "copies": [{**c, "bases": list(c["bases"])} for c in row["copies"]]}
            for row in rows])

    def copy_of(self, server: str, partition: str) -> dict:
        """One replica's copy of "topic/p" as its files hold it: where its segments start,
        the offset after its last whole batch, and a digest of its whole batches."""
        topic, number = partition.rsplit("/", 1)
        directory = Path(self.entry(self.cluster, server).data_dir) / "partitions" / \
            f"{topic}-{number}"
        digest, bases, end = hashlib.sha256(), [], None
        for path in sorted(directory.glob("*.log"), key=lambda p: int(p.stem)):
            bases.append(int(path.stem))
            for header_end, data in whole_batches(path):
                digest.update(data)
                end = header_end
        return {"server": server, "bases": tuple(bases), "end": end,
                "digest": digest.hexdigest()}

    def positions(self, client) -> list[dict] | None:
        rows = []
        try:
            for topic, count in self.topics.items():
                for partition in range(count):
                    reply = client.describe_partition(topic, partition)
                    rows.append({"topic": topic, "partition": partition,
                                 "high_watermark": reply.high_watermark,
                                 "max_read_position": reply.max_read_position,
                                 "open_txns": [f"{t.txn_id.tc_partition}:{t.txn_id.sequence}"
                                               for t in reply.open_transactions]})
        except Exception as error:  # noqa: BLE001 — retried until the deadline
            self.say(f"positions not readable yet: {error}")
            return None
        return rows

    def final_read(self, client, isolation: str, final_log: EventLog) -> None:
        op = final_log.invoke("final-read", isolation=isolation)
        for attempt in range(10):
            try:
                with client.consumer(list(self.topics), isolation=isolation) as reader:
                    ends = reader.end_offsets()
                    records = [[m.topic, m.partition, m.offset,
                                (m.value or b"").decode(errors="replace")]
                               for messages in reader.read_until(ends, idle_timeout_s=20)
                               for m in messages]
                final_log.complete(op, "ok", records=records,
                                   ends=[[t, p, e] for (t, p), e in sorted(ends.items())])
                return
            except Exception as error:  # noqa: BLE001 — retried; the checker says if absent
                self.say(f"final read ({isolation}) attempt {attempt + 1} failed: {error}")
                time.sleep(1)
        final_log.complete(op, "fail", records=[], ends=[])

    def final_trim_read(self, client, final_log: EventLog) -> None:
        """The trim topic read whole, from each partition's log start (where a consumer
        begins), with those starts: the checker's resurrected-delete and the trimmer's
        lost writes."""
        from tests.chaos.client import trim_value

        topic, count = TRIM_TOPIC["name"], TRIM_TOPIC["partitions"]
        op = final_log.invoke("final-trim-read", topic=topic)
        for attempt in range(10):
            try:
                starts = [[p, client.describe_partition(topic, p).log_start_offset]
                          for p in range(count)]
                with client.consumer([topic]) as reader:
                    ends = reader.end_offsets()
                    records = [[m.partition, m.offset, trim_value(m.value or b"")]
                               for messages in reader.read_until(ends, idle_timeout_s=20)
                               for m in messages]
                final_log.complete(op, "ok", records=records, starts=starts,
                                   ends=[[p, e] for (_t, p), e in sorted(ends.items())])
                return
            except Exception as error:  # noqa: BLE001 — retried; the checker says if absent
                self.say(f"final trim read attempt {attempt + 1} failed: {error}")
                time.sleep(1)
        final_log.complete(op, "fail", records=[], starts=[], ends=[])

    def final_cursors(self, client, final_log: EventLog) -> None:
        op = final_log.invoke("cursor", subscription=self.spec["subscription"],
                              topic=self.spec["input_topic"])
        try:
            with client.consumer(self.spec["input_topic"],
                                 subscription=self.spec["subscription"]) as consumer:
                results = consumer.describe()
            final_log.complete(op, "ok", positions=[
                [r.subscription_partition.partition, r.cumulative_end_offset,
                 [[i.start_offset, i.end_offset] for i in r.individual_ranges]] for r in results])
        except Exception as error:  # noqa: BLE001
            final_log.complete(op, "fail", positions=[], error=repr(error))


def whole_batches(path: Path) -> Iterator[tuple[int, bytes]]:
    """(the offset after it, its bytes) of each whole batch at the start of a segment
    file (`batch_spans`)."""
    data = path.read_bytes()
    for position, header in batch_spans(data):
        yield header.next_offset, data[position:position + header.size]


def batch_spans(data: bytes) -> Iterator[tuple[int, BatchHeader]]:
    """(position, header) of each whole batch at the start of a segment file's bytes, up
    to the first that is not whole: a follower writes its active segment around the page
    cache in 4 KiB blocks, so it may end in zeros past its last batch
    (partition_server/direct_io.py)."""
    position = 0
    while True:
        try:
            header = parse_header(data, position)
        except AtomlogError:
            return
        if position + header.size > len(data):
            return
        yield position, header
        position += header.size


def fill(path: Path) -> None:
    """Write zeros to path until the filesystem is full (ENOSPC)."""
    block = b"\0" * (1 << 20)
    with open(path, "wb", buffering=0) as handle:
        try:
            while True:
                handle.write(block)
        except OSError:
            pass
    try:  # the last partial block
        with open(path, "ab", buffering=0) as handle:
            while True:
                handle.write(b"\0" * 4096)
    except OSError:
        pass
