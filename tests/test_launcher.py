"""The local-cluster launcher's ports: planned outside the kernel's ephemeral range, and a
process whose port was taken before it could bind is restarted on a new one."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services import launcher, localzk
from services.config import ConfigError


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    low, _high = launcher._ephemeral_range()
    ports = [launcher.free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    if low - launcher.LOWEST_PORT >= 1_000:
        assert all(launcher.LOWEST_PORT <= port < low for port in ports), ports
    for port in ports[:20]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))


def test_free_ports_handed_out_in_two_processes_at_once_are_distinct(tmp_path, monkeypatch):
    """The test suite's two workers draw ports at the same time: the claims keep them apart
    (400 ports each among about 22,000 would overlap somewhere almost surely without)."""
    monkeypatch.setattr(launcher, "PORT_CLAIMS", tmp_path / "atomlog-port-claims")
    child = subprocess.Popen(
        [sys.executable, "-c", "import json; from services import launcher; "
         "print(json.dumps([launcher.free_port() for _ in range(400)]))"],
        stdout=subprocess.PIPE, env={**os.environ, "TMPDIR": str(tmp_path)},
        cwd=Path(__file__).resolve().parent.parent)
    mine = [launcher.free_port() for _ in range(400)]
    theirs = json.loads(child.communicate(timeout=60)[0])
    assert child.returncode == 0
    assert len(theirs) == 400 and not set(mine) & set(theirs)


def test_a_claim_is_refused_while_fresh_and_taken_over_once_stale(tmp_path, monkeypatch):
    monkeypatch.setattr(launcher, "PORT_CLAIMS", tmp_path / "claims")
    assert launcher._claim(20_001)
    assert not launcher._claim(20_001)
    assert not launcher._claim(20_001, now=time.time() + launcher.PORT_CLAIM_S - 5)
    assert launcher._claim(20_001, now=time.time() + launcher.PORT_CLAIM_S + 5)
    assert launcher._claim(20_002)
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setattr(launcher, "PORT_CLAIMS", blocked)  # no directory can be made there
    assert launcher._claim(20_001) and launcher._claim(20_001)  # claims nothing, refuses nothing


@pytest.mark.parametrize("settings, problem", [
    ({"partition.fsync": "false"}, "unknown setting 'partition.fsync'"),
    ({"partition.durability": "sometimes"}, "partition.durability"),
])
def test_up_refuses_a_setting_no_role_takes_before_anything_starts(tmp_path, settings, problem):
    """Each process gets only the settings its role knows, so an unknown name used to be
    dropped without a word: a benchmark's `--set partition.fsync=false` ran on the
    defaults. `up` (and `plan`, which every caller goes through) refuses it first."""
    with pytest.raises(ConfigError, match=problem):
        launcher.up(tmp_path, {"id_allocator": 1}, settings, timeout_s=5)
    assert not (tmp_path / launcher.CLUSTER_FILE).exists()
    assert launcher.plan(tmp_path, {"id_allocator": 1}, {"partition.durability": "wal"})


def squat(address: str) -> socket.socket:
    """A listening socket on `address` (host:port): the port is taken."""
    host, port = address.rsplit(":", 1)
    squatter = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    squatter.bind((host, int(port)))
    squatter.listen()
    return squatter


@pytest.mark.cluster
def test_a_process_whose_port_is_taken_restarts_on_a_new_one(tmp_path):
    localzk.check_installed()
    planned = launcher.plan(tmp_path, {"id_allocator": 1}, {})
    planned.save(tmp_path)
    entry = next(p for p in planned.processes if p.name == "ida-0")
    squatter = squat(entry.grpc_address)
    messages: list[str] = []
    try:
        report = launcher.up(tmp_path, {"id_allocator": 1}, timeout_s=60,
                             progress=messages.append)
        moved = next(p for p in report.cluster.processes if p.name == "ida-0")
        assert moved.grpc_address != entry.grpc_address
        assert moved.metrics_address != entry.metrics_address
        assert launcher.health_status(moved.grpc_address) == "SERVING"
        saved = next(p for p in launcher.ClusterFile.load(tmp_path).processes
                     if p.name == "ida-0")
        assert (saved.grpc_address, saved.pid) == (moved.grpc_address, moved.pid)
        assert any(f"could not bind {entry.grpc_address}" in m for m in messages), messages
    finally:
        squatter.close()
        launcher.down(tmp_path, timeout_s=10)


@pytest.mark.cluster
def test_a_zookeeper_whose_port_is_taken_restarts_on_a_new_one(tmp_path):
    """ZooKeeper exits when its planned port was taken before it could bind (another
    program's free_port may hand out the same port): `up` moves it, and the services
    then started use the new address."""
    localzk.check_installed()
    planned = launcher.plan(tmp_path, {"id_allocator": 1}, {})
    planned.save(tmp_path)
    squatter = squat(planned.zookeeper)
    messages: list[str] = []
    try:
        report = launcher.up(tmp_path, {"id_allocator": 1}, timeout_s=60,
                             progress=messages.append)
        zk = next(p for p in report.cluster.processes if p.role == "zookeeper")
        assert report.cluster.zookeeper == zk.grpc_address != planned.zookeeper
        assert localzk.is_serving(zk.grpc_address)
        assert launcher.ClusterFile.load(tmp_path).zookeeper == zk.grpc_address
        ida = next(p for p in report.cluster.processes if p.name == "ida-0")
        assert launcher.health_status(ida.grpc_address) == "SERVING"
        assert any(f"zookeeper could not bind {planned.zookeeper}" in m for m in messages), messages
    finally:
        squatter.close()
        launcher.down(tmp_path, timeout_s=10)


@pytest.mark.cluster
def test_a_process_that_ends_its_start_on_a_zookeeper_blip_is_started_again(tmp_path):
    """A server ends its start-up on a ZooKeeper error (fail fast); `up` starts it again
    as a supervisor would, so a blip while it loads does not fail `up` (a CI run lost
    ps-0 so: it missed its ZooKeeper pings while it loaded its partitions)."""
    localzk.check_installed()
    failpoint_dir = tmp_path / "failpoints"
    failpoint_dir.mkdir()
    (failpoint_dir / "start_zookeeper_loss").touch()
    planned = launcher.plan(tmp_path, {"id_allocator": 1}, {})
    entry = next(p for p in planned.processes if p.name == "ida-0")
    entry.env = {"ATOMLOG_FAILPOINTS": str(failpoint_dir)}
    planned.save(tmp_path)
    messages: list[str] = []
    try:
        report = launcher.up(tmp_path, {"id_allocator": 1}, timeout_s=60,
                             progress=messages.append)
        ida = next(p for p in report.cluster.processes if p.name == "ida-0")
        assert launcher.health_status(ida.grpc_address) == "SERVING"
        assert not (failpoint_dir / "start_zookeeper_loss").exists()  # it fired, once
        assert any("ida-0 ended its start-up on a ZooKeeper error" in m for m in messages), \
            messages
        assert "ConnectionLoss" in Path(ida.log_file).read_text()
    finally:
        launcher.down(tmp_path, timeout_s=10)


@pytest.mark.cluster
def test_a_process_that_fails_for_another_reason_is_not_restarted(tmp_path):
    """A setting `up` is given is checked before anything starts (the test above); one
    from the process's own environment is read only by the process, which refuses it."""
    localzk.check_installed()
    planned = launcher.plan(tmp_path, {"id_allocator": 1}, {})
    entry = next(p for p in planned.processes if p.name == "ida-0")
    entry.env = {"ATOMLOG_ZOOKEEPER_SESSION_TIMEOUT_MS": "5"}
    planned.save(tmp_path)
    with pytest.raises(launcher.LaunchError, match="exited during start-up"):
        try:
            launcher.up(tmp_path, {"id_allocator": 1}, timeout_s=60)
        finally:
            launcher.down(tmp_path, timeout_s=10)


@pytest.mark.cluster
def test_a_process_advertises_its_own_address_and_gets_its_own_environment(tmp_path):
    """What the chaos harness relies on: a service started with an advertised address
    registers that address (others reach it there, e.g. through a proxy) while the launcher
    still checks its health on the address it listens on; and it gets the extra
    environment its entry names."""
    import json

    from kazoo.client import KazooClient

    localzk.check_installed()
    planned = launcher.plan(tmp_path, {"id_allocator": 1}, {})
    entry = next(p for p in planned.processes if p.name == "ida-0")
    entry.advertised_address = f"127.0.0.1:{launcher.free_port()}"
    entry.env = {"ATOMLOG_TEST_MARK": "advertised"}
    planned.save(tmp_path)
    try:
        report = launcher.up(tmp_path, {"id_allocator": 1}, timeout_s=60)
        started = next(p for p in report.cluster.processes if p.name == "ida-0")
        assert started.advertised_address == entry.advertised_address
        assert launcher.health_status(started.grpc_address) == "SERVING"
        with open(f"/proc/{started.pid}/environ", "rb") as handle:
            assert b"ATOMLOG_TEST_MARK=advertised" in handle.read().split(b"\0")
        zookeeper = KazooClient(hosts=report.cluster.zookeeper + report.cluster.chroot)
        zookeeper.start(timeout=10)
        try:
            data, _ = zookeeper.get("/servers/ida-0")
        finally:
            zookeeper.stop()
        assert json.loads(data)["grpc_address"] == entry.advertised_address
    finally:
        launcher.down(tmp_path, timeout_s=10)


@pytest.mark.cluster
def test_the_server_that_creates_a_cluster_picks_its_tc_partitions_and_later_ones_take_them(
        tmp_path):
    """cluster.tc_partitions unset (0): the server that creates the cluster picks the count
    by its role, 1 for a combined server (`atomlog up --combined` and `atomlog serve
    combined` alike) and 16 for any other; every later server takes the cluster's count,
    whatever its role. One configured with another count refuses to start and changes
    nothing."""
    from kazoo.client import KazooClient

    localzk.check_installed()

    def created_with(cluster: launcher.ClusterFile) -> int:
        zookeeper = KazooClient(hosts=cluster.zookeeper + cluster.chroot)
        zookeeper.start(timeout=10)
        try:
            return json.loads(zookeeper.get("/cluster")[0])["tc_partitions"]
        finally:
            zookeeper.stop()

    def leased(data_dir: Path, wanted: int) -> launcher.ClusterStatus:
        deadline = time.monotonic() + 30
        while True:
            report = launcher.status(data_dir)
            owned = sorted(k for p in report.processes for k in p.tc_partitions)
            if owned == list(range(wanted)) or time.monotonic() > deadline:
                return report
            time.sleep(0.2)

    single, roles = tmp_path / "single", tmp_path / "roles"
    single.mkdir()
    roles.mkdir()
    try:
        report = launcher.up(single, {"combined": 1}, timeout_s=90)
        assert "cluster.tc_partitions" not in report.cluster.settings
        assert created_with(report.cluster) == 1
        status = leased(single, 1)
        assert status.tc_partitions == 1
        assert [p.tc_partitions for p in status.processes if p.role == "combined"] == [[0]]
        # A coordinator joins it: the cluster's one TC partition, not 16 of its own.
        report = launcher.up(single, {"combined": 1, "coordinator": 1}, timeout_s=90)
        status = leased(single, 1)
        assert status.tc_partitions == 1
        assert sorted(k for p in status.processes for k in p.tc_partitions) == [0]
        # One told 16 refuses; the cluster keeps its count.
        planned = launcher.plan(single, {"combined": 1, "coordinator": 2}, {})
        entry = next(p for p in planned.processes if p.name == "coord-1")
        entry.env = {"ATOMLOG_CLUSTER_TC_PARTITIONS": "16"}
        planned.save(single)
        with pytest.raises(launcher.LaunchError, match="exited during start-up"):
            launcher.up(single, {"combined": 1, "coordinator": 2}, timeout_s=90)
        assert "cluster.tc_partitions=16 but this cluster was created with 1 TC partitions" \
            in Path(entry.log_file).read_text()
        assert created_with(report.cluster) == 1
        assert leased(single, 1).tc_partitions == 1
        # A cluster whose first server has another role: 16.
        report = launcher.up(roles, {"id_allocator": 1}, timeout_s=60)
        assert created_with(report.cluster) == 16
    finally:
        launcher.down(single, timeout_s=10)
        launcher.down(roles, timeout_s=10)

def test_a_combined_cluster_is_not_grown_into_separate_roles_or_the_reverse(tmp_path):
    """`atomlog up` (its default counts) on a combined cluster added a partition server,
    coordinator and id allocator beside the combined server for good, and `up
    --combined` on a cluster of separate roles added a combined server to it. The CLI
    now starts a combined cluster as combined when no counts are given, and the plan
    refuses a shape other than the cluster's."""
    from click.testing import CliRunner

    from services import cli

    (tmp_path / "c").mkdir()
    (tmp_path / "s").mkdir()
    combined = launcher.plan(tmp_path / "c", {"combined": 1}, {})
    combined.save(tmp_path / "c")
    with pytest.raises(launcher.LaunchError) as refused:
        launcher.plan(tmp_path / "c", {"partition_server": 3, "coordinator": 2,
                                       "id_allocator": 1}, {})
    assert "--combined" in str(refused.value)
    separate = launcher.plan(tmp_path / "s", {"id_allocator": 1}, {})
    separate.save(tmp_path / "s")
    with pytest.raises(launcher.LaunchError):
        launcher.plan(tmp_path / "s", {"combined": 1}, {})
    assert [p.role for p in launcher.plan(tmp_path / "c", {"combined": 1}, {}).processes] == \
        ["zookeeper", "combined"]
    seen = {}

    def up(data_dir, counts, *args, **kwargs):
        seen["counts"] = counts
        raise launcher.LaunchError("stop here")

    original = launcher.up
    launcher.up = up
    try:
        CliRunner().invoke(cli.cli, ["up", "--data-dir", str(tmp_path / "c")])
    finally:
        launcher.up = original
    assert seen["counts"] == {"combined": 1}


def test_process_alive_keeps_the_exit_code_of_a_child_it_reaps():
    """launcher.REAPED: how a child ended (its exit status, or minus the signal), for the
    chaos harness's "exited by itself" (a server that left no word in its log said
    nothing of how it ended)."""
    import signal

    exits = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    killed.send_signal(signal.SIGKILL)
    for child, code in ((exits, 3), (killed, -signal.SIGKILL)):
        deadline = time.monotonic() + 10
        while launcher.process_alive(child.pid, "") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert launcher.REAPED.get(child.pid) == code
