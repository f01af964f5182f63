"""The local cluster with real processes: health, reflection, metrics, metadata,
membership after kill -9, graceful SIGTERM, and topics surviving down/up.
Tests run in file order against one cluster; later ones restart processes."""

from __future__ import annotations

import json
import os
import signal
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from atomlog.v1 import metadata_pb2, metadata_pb2_grpc
from services.errors import from_rpc_error
from tests.conftest import SESSION_TIMEOUT_MS, wait_until

ROLE_SERVICE = {
    "partition_server": "atomlog.v1.PartitionService",
    "coordinator": "atomlog.v1.CoordinatorService",
    "id_allocator": "atomlog.v1.IdAllocatorService",
}

pytestmark = pytest.mark.cluster


def metadata_stub(address: str) -> metadata_pb2_grpc.MetadataServiceStub:
    return metadata_pb2_grpc.MetadataServiceStub(grpc.insecure_channel(address))



def test_up_reaches_all_serving_and_writes_cluster_file(cluster):
    info = cluster.info
    roles = sorted(p["role"] for p in info["processes"])
    assert roles == sorted(["zookeeper", "id_allocator", "coordinator", "coordinator",
                            "partition_server", "partition_server", "partition_server"])
    assert info["bootstrap"] == cluster.process("ps-0")["grpc_address"]
    for p in info["processes"]:
        assert p["pid"] > 0 and p["grpc_address"].startswith("127.0.0.1:")
    # Healthy, or soon: the module before on this worker may have just restarted a server
    # (its partitions load), and on a loaded machine a status probe can time out
    # (`offline_partitions` then says "cannot list partitions"); seen once in CI.
    statuses = []

    def healthy() -> bool:
        statuses.append(cluster.status())
        # ... and its partition servers caught up (their replicas in sync), the others
        # not asked.
        return statuses[-1]["healthy"] and all(
            p["caught_up"] is (True if p["role"] == "partition_server" else None)
            for p in statuses[-1]["processes"] if p["role"] != "zookeeper")

    try:
        wait_until(healthy, 30, "a healthy status")
    except AssertionError:
        raise AssertionError(json.dumps(statuses[-1], indent=1)) from None
    # Running `up` again starts nothing.
    again = cluster.up()
    assert again["started"] == [] and len(again["already_running"]) == 7


def test_every_service_answers_health_per_service_and_reflection(cluster):
    for process in cluster.services():
        channel = grpc.insecure_channel(process["grpc_address"])
        health = health_pb2_grpc.HealthStub(channel)
        expected = ["", "atomlog.v1.MetadataService", ROLE_SERVICE[process["role"]]]
        for service in expected:
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, (process, service)
        # A partition server is ready once caught up: every replica back in its ISR, its
        # own partitions open (Kubernetes' readiness probe asks this).
        caught_up = health_pb2.HealthCheckRequest(service="atomlog.caught_up")
        if process["role"] == "partition_server":
            wait_until(lambda: health.Check(caught_up, timeout=5).status
                       == health_pb2.HealthCheckResponse.SERVING, 30, f"{process} caught up")
        else:
            with pytest.raises(grpc.RpcError) as unknown:
                health.Check(caught_up, timeout=5)
            assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as unknown:
            health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND

        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = reflection.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
        names = {s.name for r in responses for s in r.list_services_response.service}
        assert {*expected[1:], "grpc.health.v1.Health"} <= names, names
        # The role's contract is described by reflection (file descriptors included).
        responses = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
            file_containing_symbol=ROLE_SERVICE[process["role"]])]), timeout=5)
        assert any(r.file_descriptor_response.file_descriptor_proto for r in responses)
        channel.close()


def test_bad_subscription_requests_answer_with_error_info(cluster):
    """Subscription RPCs validate their fields and answer with a reason, not a crash."""
    from atomlog.v1 import common_pb2, partition_pb2, partition_pb2_grpc

    address = cluster.process("ps-0")["grpc_address"]
    with grpc.insecure_channel(address) as channel:
        stub = partition_pb2_grpc.PartitionServiceStub(channel)
        with pytest.raises(grpc.RpcError) as raised:
            stub.Receive(partition_pb2.ReceiveRequest(), timeout=5)
        with pytest.raises(grpc.RpcError) as empty_ack:
            stub.Ack(partition_pb2.AckRequest(), timeout=5)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    error = from_rpc_error(raised.value)
    assert error.reason == "INVALID_ARGUMENT" and "consumer_id" in error.message
    assert from_rpc_error(empty_ack.value).reason == "INVALID_ARGUMENT"
    # 200 characters, 400 bytes of UTF-8: consumer ids are counted in bytes (at most 256),
    # refused whole before any partition is read (before, per item, after reading).
    with grpc.insecure_channel(address) as channel:
        stub = partition_pb2_grpc.PartitionServiceStub(channel)
        with pytest.raises(grpc.RpcError) as long_id:
            stub.Receive(partition_pb2.ReceiveRequest(
                consumer_id="é" * 200, subscription_partitions=[common_pb2.SubscriptionPartition(
                    topic="no-such-topic", partition=0, subscription="s")]), timeout=5)
    error = from_rpc_error(long_id.value)
    assert error.reason == "INVALID_ARGUMENT" and error.metadata["field"] == "consumer_id"


def test_a_request_that_does_not_parse_answers_invalid_argument_with_error_info(cluster):
    """Bytes that are not the method's request (here bad UTF-8 in a string field): before,
    gRPC parsed them before the interceptor and answered UNKNOWN with no ErrorInfo (the
    link answered INVALID_ARGUMENT); now both answer INVALID_ARGUMENT with one."""
    from atomlog.v1 import coordinator_pb2, partition_pb2

    cases = [
        ("ps-0", "/atomlog.v1.PartitionService/Receive",
         partition_pb2.ReceiveRequest(consumer_id="zz").SerializeToString()),
        ("coord-0", "/atomlog.v1.CoordinatorService/InitProducerId",
         coordinator_pb2.InitProducerIdRequest(transactional_id="zz").SerializeToString()),
    ]
    for name, method, good in cases:
        bad = good.replace(b"zz", b"\xff\xfe")
        with grpc.insecure_channel(cluster.process(name)["grpc_address"]) as channel:
            call = channel.unary_unary(method)  # raw bytes both ways
            with pytest.raises(grpc.RpcError) as raised:
                call(bad, timeout=5)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, raised.value)
        error = from_rpc_error(raised.value)
        assert error.reason == "INVALID_ARGUMENT" and "does not parse" in error.message


def test_metrics_endpoint_parses_as_prometheus_text(cluster):
    for process in cluster.services():
        body = urllib.request.urlopen(f"http://{process['metrics_address']}/metrics",
                                      timeout=5).read().decode()
        families = {f.name: f for f in text_string_to_metric_families(body)}
        assert "atomlog_build_info" in families, sorted(families)
        info = families["atomlog_build_info"].samples[0].labels
        assert info["name"] == process["name"] and info["role"] == process["role"]
        assert info["core"] == "native"  # the suite runs with ATOMLOG_NATIVE=require
        assert families["atomlog_zookeeper_connected"].samples[0].value == 1
        assert families["atomlog_serving"].samples[0].value == 1
        # Every process has collected (start-up alone does) and timed it by generation.
        counts = {sample.labels["generation"]: sample.value
                  for sample in families["atomlog_gc_pause_seconds"].samples
                  if sample.name == "atomlog_gc_pause_seconds_count"}
        assert set(counts) == {"0", "1", "2"} and counts["0"] > 0 and counts["2"] >= 1, counts
        for name in families:
            assert name.startswith(("atomlog_", "python_", "process_")), name


def test_create_topic_assigns_evenly_and_every_server_answers_metadata(cluster):
    bootstrap = cluster.info["bootstrap"]
    reply = metadata_stub(bootstrap).CreateTopic(
        metadata_pb2.CreateTopicRequest(name="orders", partitions=8,
                                        config={"retention.ms": "3600000"}), timeout=10)
    owners = [p.server_name for p in reply.topic.partitions]
    counts = {name: owners.count(name) for name in ("ps-0", "ps-1", "ps-2")}
    assert sorted(counts.values()) == [2, 3, 3], counts
    assert all(owners[i] != owners[i + 1] for i in range(len(owners) - 1))
    addresses = {p["name"]: p["grpc_address"] for p in cluster.services()}
    for p in reply.topic.partitions:
        assert p.available and p.server_address == addresses[p.server_name]

    for process in cluster.services():
        seen = metadata_stub(process["grpc_address"]).GetMetadata(
            metadata_pb2.GetMetadataRequest(topics=["orders"]), timeout=10)
        assert seen.answered_by == process["name"]
        assert [p.server_name for p in seen.topics[0].partitions] == owners
        assert dict(seen.topics[0].config) == {"retention.ms": "3600000"}
        assert {s.name for s in seen.servers} == set(addresses)
        assert seen.tc_partition_count == 16 and len(seen.tc_partitions) == 16


@pytest.mark.parametrize("request_fields, code, reason", [
    ({"name": "", "partitions": 1}, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_TOPIC_NAME"),
    ({"name": "bad name", "partitions": 1}, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_TOPIC_NAME"),
    ({"name": "x" * 250, "partitions": 1}, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_TOPIC_NAME"),
    ({"name": "..", "partitions": 1}, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_TOPIC_NAME"),
    ({"name": "__txn_log-0", "partitions": 1}, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_TOPIC_NAME"),
    ({"name": "zero", "partitions": 0}, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_PARTITION_COUNT"),
    ({"name": "huge", "partitions": 1_000_000}, grpc.StatusCode.INVALID_ARGUMENT,
     "INVALID_PARTITION_COUNT"),
    ({"name": "cfg", "partitions": 1, "config": {"no.such": "1"}}, grpc.StatusCode.INVALID_ARGUMENT,
     "INVALID_TOPIC_CONFIG"),
    ({"name": "cfg", "partitions": 1, "config": {"retention.ms": "soon"}},
     grpc.StatusCode.INVALID_ARGUMENT, "INVALID_TOPIC_CONFIG"),
    ({"name": "orders", "partitions": 3}, grpc.StatusCode.ALREADY_EXISTS, "TOPIC_ALREADY_EXISTS"),
])
def test_create_topic_refuses_bad_input_and_writes_nothing(cluster, request_fields, code, reason):
    stub = metadata_stub(cluster.info["bootstrap"])

    def topics() -> dict:
        """Each topic's partition count and config: what CreateTopic writes. (Not leaders,
        ISRs and epochs, which move by themselves while a server restarted by another
        module rejoins the ISRs of its replicated topics.)"""
        reply = stub.GetMetadata(metadata_pb2.GetMetadataRequest(), timeout=10)
        return {t.name: (len(t.partitions), dict(t.config)) for t in reply.topics}

    before = topics()
    with pytest.raises(grpc.RpcError) as raised:
        stub.CreateTopic(metadata_pb2.CreateTopicRequest(**request_fields), timeout=10)
    assert raised.value.code() == code
    error = from_rpc_error(raised.value)
    assert error.reason == reason and error.message
    assert topics() == before


def test_metadata_for_unknown_topic_is_not_found(cluster):
    with pytest.raises(grpc.RpcError) as raised:
        metadata_stub(cluster.info["bootstrap"]).GetMetadata(
            metadata_pb2.GetMetadataRequest(topics=["missing-topic"]), timeout=10)
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND
    assert from_rpc_error(raised.value).reason == "UNKNOWN_TOPIC_OR_PARTITION"


def test_cli_topic_commands(cluster):
    created = cluster.run("topic", "create", "cli-topic", "--partitions", "3", "-o", "json")
    assert '"partition": 2' in created.stdout
    listed = cluster.run("topic", "list", "-o", "json").stdout
    assert "cli-topic" in listed and "orders" in listed
    refused = cluster.run("topic", "create", "cli-topic", "--partitions", "3", check=False)
    assert refused.returncode == 1 and "TOPIC_ALREADY_EXISTS" in refused.stderr


@pytest.mark.parametrize("request_fields, code, reason", [
    ({"topic": "missing-topic", "set": {"retention.ms": "60000"}}, grpc.StatusCode.NOT_FOUND,
     "UNKNOWN_TOPIC_OR_PARTITION"),
    ({"topic": "bad name", "set": {"retention.ms": "60000"}}, grpc.StatusCode.INVALID_ARGUMENT,
     "INVALID_TOPIC_NAME"),
    ({"topic": "altered", "set": {"no.such": "1"}}, grpc.StatusCode.INVALID_ARGUMENT,
     "INVALID_TOPIC_CONFIG"),
    ({"topic": "altered", "set": {"retention.ms": "soon"}}, grpc.StatusCode.INVALID_ARGUMENT,
     "INVALID_TOPIC_CONFIG"),
    ({"topic": "altered", "delete": ["no.such"]}, grpc.StatusCode.INVALID_ARGUMENT,
     "INVALID_TOPIC_CONFIG"),
    ({"topic": "altered", "set": {"retention.ms": "60000"}, "delete": ["retention.ms"]},
     grpc.StatusCode.INVALID_ARGUMENT, "INVALID_TOPIC_CONFIG"),
    # (several keys: the good one is not written either)
    ({"topic": "altered", "set": {"retention.ms": "60000", "min.insync.replicas": "1"}},
     grpc.StatusCode.INVALID_ARGUMENT, "INVALID_TOPIC_CONFIG"),
])
def test_alter_topic_config_refuses_bad_input_and_writes_nothing(cluster, request_fields, code,
                                                                reason):
    stub = metadata_stub(cluster.info["bootstrap"])
    try:
        stub.CreateTopic(metadata_pb2.CreateTopicRequest(
            name="altered", partitions=2, replication_factor=1,
            config={"retention.ms": "3600000"}), timeout=10)
    except grpc.RpcError as error:
        assert from_rpc_error(error).reason == "TOPIC_ALREADY_EXISTS"
    before = stub.GetMetadata(metadata_pb2.GetMetadataRequest(), timeout=10)
    with pytest.raises(grpc.RpcError) as raised:
        stub.AlterTopicConfig(metadata_pb2.AlterTopicConfigRequest(**request_fields),
                              timeout=10)
    assert raised.value.code() == code
    error = from_rpc_error(raised.value)
    assert error.reason == reason and error.message
    after = stub.GetMetadata(metadata_pb2.GetMetadataRequest(), timeout=10)
    assert {t.name: dict(t.config) for t in after.topics} == \
        {t.name: dict(t.config) for t in before.topics}


def test_topic_alter_changes_settings_and_the_servers_apply_them_at_once(cluster):
    """`atomlog topic alter`: --validate-only writes nothing, a change is written once (a
    repeat changes nothing), and a shorter retention deletes old segments on the
    partition's server without a restart or a wait for its chores' round."""
    from spark_client import Client

    client = Client(cluster.info["bootstrap"])
    client.create_topic("shrinking", partitions=1, replication_factor=1,
                        config={"segment.bytes": "65536"})
    with client.producer(linger_ms=1) as producer:
        for i in range(2_500):
            producer.send("shrinking", b"x" * 1000, partition=0)
        producer.flush()
    assert client.describe_partition("shrinking", 0).log_start_offset == 0

    def config() -> dict:
        return json.loads(cluster.run("topic", "describe", "shrinking", "-o", "json").stdout
                          )[0]["config"]

    tried = json.loads(cluster.run("topic", "alter", "shrinking", "--set",
                                   "retention.bytes=1048576", "--validate-only",
                                   "-o", "json").stdout)
    assert tried == {"topic": "shrinking", "changed": True, "validate_only": True,
                     "config": {"retention.bytes": "1048576", "segment.bytes": "65536"}}
    assert config() == {"segment.bytes": "65536"}
    done = cluster.run("topic", "alter", "shrinking", "--set", "retention.bytes=1048576")
    assert "settings are now retention.bytes=1048576, segment.bytes=65536" in done.stdout
    again = cluster.run("topic", "alter", "shrinking", "--set", "retention.bytes=1048576")
    assert "were already" in again.stdout
    assert config() == {"retention.bytes": "1048576", "segment.bytes": "65536"}

    def trimmed() -> bool:
        return client.describe_partition("shrinking", 0).log_start_offset > 0

    wait_until(trimmed, 15, "the shorter retention to delete old segments")
    kept = client.describe_partition("shrinking", 0)
    assert kept.high_watermark == 2_500
    # whole old segments went; at least retention.bytes of the log is kept (its bytes, not
    # its values': a batch's header and each record's framing count too, so how many
    # records that is depends on how the producer batched them)
    assert kept.size_bytes >= 1_048_576
    assert kept.size_bytes < (kept.high_watermark - kept.log_start_offset) * 1_200
    from spark_client import errors

    with pytest.raises(errors.InvalidTopicConfig):  # the SDK's call, refused
        client.alter_topic_config("shrinking", set={"segment.bytes": "1"})
    after = client.alter_topic_config("shrinking", delete=["retention.bytes"])
    assert dict(after.config) == config() == {"segment.bytes": "65536"}
    nothing = cluster.run("topic", "alter", "shrinking", check=False)
    assert nothing.returncode == 2 and "nothing to change" in nothing.stderr
    client.close()


def test_kill_9_partition_server_unregisters_and_up_restores_it(cluster):
    victim = cluster.process("ps-1")
    zk = cluster.zookeeper()
    try:
        assert zk.exists("/servers/ps-1")
        os.kill(victim["pid"], signal.SIGKILL)
        gone_after = wait_until(lambda: not zk.exists("/servers/ps-1"),
                                SESSION_TIMEOUT_MS / 1000 + 5, "the registration to expire")
        assert gone_after < SESSION_TIMEOUT_MS / 1000 + 5
        status = cluster.status()
        assert not status["healthy"]
        row = next(p for p in status["processes"] if p["name"] == "ps-1")
        assert row["health"] == "DOWN" and not row["running"]
        assert cluster.run("status", check=False).returncode == 1
        meta = metadata_stub(cluster.info["bootstrap"]).GetMetadata(
            metadata_pb2.GetMetadataRequest(topics=["orders"]), timeout=10)
        owned = [p for p in meta.topics[0].partitions if p.server_name == "ps-1"]
        assert owned and not any(p.available for p in owned)
        owners_before = [p.server_name for p in meta.topics[0].partitions]

        report = cluster.up()
        assert report["started"] == ["ps-1"]
        assert zk.exists("/servers/ps-1")
        assert cluster.status()["healthy"]
        meta = metadata_stub(cluster.info["bootstrap"]).GetMetadata(
            metadata_pb2.GetMetadataRequest(topics=["orders"]), timeout=10)
        assert [p.server_name for p in meta.topics[0].partitions] == owners_before
        assert all(p.available for p in meta.topics[0].partitions)
    finally:
        zk.stop()


def test_sigterm_drains_and_unregisters_at_once(cluster):
    victim = cluster.process("coord-1")
    zk = cluster.zookeeper()
    try:
        os.kill(victim["pid"], signal.SIGTERM)
        # A clean stop deletes the registration itself, well before a session would expire.
        wait_until(lambda: not zk.exists("/servers/coord-1"), SESSION_TIMEOUT_MS / 1000 / 2,
                   "the registration to be deleted")
        wait_until(lambda: not os.path.exists(f"/proc/{victim['pid']}/cmdline")
                   or b"coord-1" not in open(f"/proc/{victim['pid']}/cmdline", "rb").read(),
                   15, "the process to exit")
        log = open(victim["log_file"]).read()
        assert '"msg":"stopped"' in log
        assert cluster.up()["started"] == ["coord-1"]
    finally:
        zk.stop()


def test_topics_survive_full_down_and_up(cluster):
    before = metadata_stub(cluster.info["bootstrap"]).GetMetadata(
        metadata_pb2.GetMetadataRequest(topics=["orders", "cli-topic"]), timeout=10)
    cluster.run("down")
    status = cluster.status()
    assert all(p["health"] == "DOWN" for p in status["processes"])
    report = cluster.up()
    assert len(report["started"]) == 7
    after = metadata_stub(cluster.info["bootstrap"]).GetMetadata(
        metadata_pb2.GetMetadataRequest(topics=["orders", "cli-topic"]), timeout=10)
    strip = lambda ts: [(t.name, [(p.partition, p.server_name) for p in t.partitions],  # noqa: E731
                         dict(t.config), t.created_unix_ms) for t in ts]
    assert strip(after.topics) == strip(before.topics)
    assert all(p.available for t in after.topics for p in t.partitions)
