"""Configuration: precedence, validation, and inconsistent limits refusing to start."""

from __future__ import annotations

import pytest

from services.config import ConfigError, describe, load_config, parse_assignments, settings_for
from tests.conftest import atomlog


def test_defaults_are_valid_for_every_role():
    for role in ("coordinator", "id_allocator"):
        config = load_config(role, env={})
        assert config["cluster.tc_partitions"] == 0  # the cluster's, or by role at creation
        assert config.sources["zookeeper.hosts"] == "default"
    config = load_config("partition_server", env={}, overrides={"server.data_dir": "/tmp/x"})
    assert config["partition.max_batch_bytes"] == 1024 * 1024


def test_precedence_file_then_environment_then_flags(tmp_path):
    file = tmp_path / "atomlog.toml"
    file.write_text('[zookeeper]\nhosts = "10.0.0.1:2181"\nsession_timeout_ms = 5000\n'
                    '[server]\nname = "from-file"\n')
    env = {"ATOMLOG_ZOOKEEPER_SESSION_TIMEOUT_MS": "7000", "ATOMLOG_SERVER_NAME": "from-env"}
    config = load_config("coordinator", file, env, {"server.name": "from-flag"})
    assert config["zookeeper.hosts"] == "10.0.0.1:2181"
    assert config.sources["zookeeper.hosts"] == f"file {file}"
    assert config["zookeeper.session_timeout_ms"] == 7000
    assert config.sources["zookeeper.session_timeout_ms"] == "ATOMLOG_ZOOKEEPER_SESSION_TIMEOUT_MS"
    assert config["server.name"] == "from-flag" and config.sources["server.name"] == "flags"


def test_parallel_commits_takes_a_mode_and_reads_the_old_booleans_as_on_and_off(tmp_path):
    """coordinator.parallel_commits was a boolean before `auto` (the default now):
    true/false from flags, the environment or a TOML boolean keep meaning on/off."""
    assert load_config("coordinator", env={})["coordinator.parallel_commits"] == "auto"
    for raw, mode in (("auto", "auto"), ("on", "on"), ("off", "off"), ("true", "on"),
                      ("False", "off"), ("1", "on"), (True, "on"), (False, "off")):
        config = load_config("coordinator", env={},
                             overrides={"coordinator.parallel_commits": raw})
        assert config["coordinator.parallel_commits"] == mode, raw
    file = tmp_path / "atomlog.toml"
    file.write_text("[coordinator]\nparallel_commits = false\n")
    assert load_config("coordinator", file, {})["coordinator.parallel_commits"] == "off"
    with pytest.raises(ConfigError) as refused:
        load_config("coordinator", env={"ATOMLOG_COORDINATOR_PARALLEL_COMMITS": "sometimes"})
    assert "not one of ['auto', 'on', 'off']" in str(refused.value)


def test_every_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as raised:
        load_config("coordinator", env={"ATOMLOG_GRPC_MAX_MESSAGE_BYTES": "lots"},
                    overrides={"zookeeper.session_timeout_ms": "10", "server.listen": "nohost",
                               "zookeper.hosts": "x:1"})
    text = str(raised.value)
    assert len(raised.value.problems) == 4, raised.value.problems
    assert "is not an integer" in text and "below the minimum 1000" in text
    assert "expected host:port" in text
    assert "did you mean 'zookeeper.hosts'" in text


@pytest.mark.parametrize("role, overrides, message", [
    ("partition_server", {"server.data_dir": "/d", "partition.max_batch_bytes": 16 << 20,
                          "grpc.max_message_bytes": 8 << 20}, "must fit in grpc.max_message_bytes"),
    ("coordinator", {"transaction.default_timeout_ms": 120_000,
                     "transaction.max_timeout_ms": 60_000}, "exceeds transaction.max_timeout_ms"),
    ("coordinator", {"transaction.default_prepared_timeout_ms": 1_000}, "must be at least"),
    ("coordinator", {"transaction.max_finished": 500_000},
     "exceeds transaction.max_finished_held"),
    ("partition_server", {}, "server.data_dir is required"),
    # The active segment counts: at or below it, the file refused every write for good
    # (no write to roll it, and the active segment is never deleted).
    ("partition_server", {"server.data_dir": "/d", "partition.wal_segment_bytes": 64 << 20,
                          "partition.wal_max_bytes": 32 << 20}, "at least twice"),
    ("combined", {"server.data_dir": "/d", "partition.wal_segment_bytes": 16 << 20,
                  "partition.wal_max_bytes": 16 << 20}, "at least twice"),
])
def test_inconsistent_limits_refuse(role, overrides, message):
    with pytest.raises(ConfigError) as raised:
        load_config(role, env={}, overrides=overrides)
    assert message in str(raised.value)


def test_unreadable_file_and_bad_assignment(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[zookeeper\n")
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config("coordinator", bad, env={})
    with pytest.raises(ConfigError, match="expects name=value"):
        parse_assignments(["novalue"])


def test_describe_lists_every_setting_with_its_environment_name():
    text = describe("coordinator")
    for setting in settings_for("coordinator"):
        assert setting.name in text and setting.env_name in text


def test_serve_refuses_to_start_with_inconsistent_limits():
    result = atomlog("serve", "partition-server", "--data-dir", "/tmp/never",
                     "--set", "partition.max_batch_bytes=33554432", check=False, timeout=60)
    assert result.returncode == 2
    assert "partition.max_batch_bytes (33554432)" in result.stderr


def test_up_refuses_an_unknown_setting_before_starting_anything(tmp_path):
    result = atomlog("up", "--data-dir", str(tmp_path), "--set", "no.such=1", check=False)
    assert result.returncode == 2 and "unknown setting 'no.such'" in result.stderr
    assert not (tmp_path / "cluster.json").exists()
