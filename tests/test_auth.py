"""Authentication (issue 24, item 2) against a real cluster with auth.mode=token (one for
the module, every role its own process, so server-to-server calls carry the service
token over gRPC): JWTs accepted and refused (expired, wrong issuer, wrong audience, bad
signature, none), static tokens and their revocation by editing the file, health without
credentials, a transaction across two partition servers, the SDK, the Spark option and
the CLI with a token, the failures in the log and /metrics; plus the settings' validation
and the mTLS principal rules (without a cluster). The mTLS cluster of `atomlog up --tls`
is tested in tests/test_tls.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from grpc_health.v1 import health_pb2, health_pb2_grpc

from atomlog.v1 import metadata_pb2, metadata_pb2_grpc
from services import auth
from services.config import ConfigError, load_config
from services.errors import from_rpc_error
from services.tls import LocalCa
from spark_client import Client
from spark_client.errors import AtomlogClientError
from tests.conftest import (REPO_ROOT, SESSION_TIMEOUT_MS, Cluster, create_online,
                            metric_sum, wait_until)

pytestmark = pytest.mark.timeout(180)

ISSUER, AUDIENCE = "https://issuer.test", "atomlog-test"
SERVICE_TOKEN = "svc-0123456789abcdef0123"
ALICE_TOKEN, BOB_TOKEN = "alice-0123456789abcdef", "bob-0123456789abcdef01"


def _pem_public(key) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.PEM,
                                         serialization.PublicFormat.SubjectPublicKeyInfo)


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict:
    where = tmp_path_factory.mktemp("atomlog-auth-keys")
    signing, stranger = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    (where / "jwt.pub").write_bytes(_pem_public(signing))
    (where / "tokens").write_text(f"# principal token\natomlog-service {SERVICE_TOKEN}\n"
                                  f"alice {ALICE_TOKEN}\nbob {BOB_TOKEN}\n")
    (where / "service.token").write_text(SERVICE_TOKEN + "\n")
    return {"dir": where, "signing": signing, "stranger": stranger,
            "settings": {"auth.mode": "token", "auth.jwt_issuer": ISSUER,
                         "auth.jwt_audience": AUDIENCE, "auth.jwt_key_file": str(where / "jwt.pub"),
                         "auth.static_tokens_file": str(where / "tokens"),
                         "auth.service_token_file": str(where / "service.token"),
                         "auth.service_principals": "atomlog-service"}}


def make_jwt(keys: dict, subject: str = "carol", *, key=None, expires_in: float = 300,
             **claims) -> str:
    now = int(time.time())
    body = {"sub": subject, "iss": ISSUER, "aud": AUDIENCE, "iat": now,
            "exp": now + int(expires_in), **claims}
    return jwt.encode(body, key or keys["signing"], algorithm="ES256")


@pytest.fixture(scope="module")
def token_cluster(tmp_path_factory, keys):
    cluster = Cluster(tmp_path_factory.mktemp("atomlog-auth"))
    settings = [arg for name, value in keys["settings"].items()
                for arg in ("--set", f"{name}={value}")]
    try:
        report = json.loads(cluster.run(
            "up", "--output", "json", "--partition-servers", "2", "--coordinators", "1",
            "--id-allocators", "1", "--set", f"zookeeper.session_timeout_ms={SESSION_TIMEOUT_MS}",
            # One copy, as before the product default replicated: not what this tests.
            "--set", "topics.default_replication_factor=1", *settings).stdout)
        assert set(report["started"]) == {p["name"] for p in report["processes"]}
        yield cluster
    finally:
        if (cluster.data_dir / "cluster.json").exists():
            cluster.run("down", check=False)


def list_topics(address: str, token: str | None):
    """ListTopics with `token` (None: no authorization metadata); the reply or the
    decoded AtomlogError."""
    metadata = (("authorization", f"Bearer {token}"),) if token is not None else None
    with grpc.insecure_channel(address) as channel:
        try:
            return metadata_pb2_grpc.MetadataServiceStub(channel).ListTopics(
                metadata_pb2.ListTopicsRequest(), metadata=metadata, timeout=10)
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED, error
            return from_rpc_error(error)


def test_jwts_accepted_and_refused_with_the_reason(token_cluster, keys):
    ps0 = token_cluster.process("ps-0")
    address = ps0["grpc_address"]
    failures = 'atomlog_authentication_failures_total{reason="%s"}'
    before = {r: metric_sum(ps0["metrics_address"], failures % r)
              for r in ("expired", "wrong_issuer", "wrong_audience", "bad_signature",
                        "missing_credentials", "unknown_token")}
    assert isinstance(list_topics(address, make_jwt(keys)), metadata_pb2.ListTopicsResponse)
    cases = {
        "expired": make_jwt(keys, expires_in=-120),  # past the 30 s leeway
        "wrong_issuer": make_jwt(keys, iss="https://elsewhere.test"),
        "wrong_audience": make_jwt(keys, aud="another-service"),
        "bad_signature": make_jwt(keys, key=keys["stranger"]),
        "missing_credentials": None,
        "unknown_token": "not-a-known-token-at-all",
    }
    for failure, token in cases.items():
        error = list_topics(address, token)
        assert error.reason == "UNAUTHENTICATED", (failure, error)
        assert error.metadata["failure"] == failure, (failure, error)
    for failure in cases:
        assert metric_sum(ps0["metrics_address"], failures % failure) == before[failure] + 1, failure
    # Logged, without the token.
    log = Path(ps0["log_file"]).read_text(errors="replace")
    refusals = [json.loads(line) for line in log.splitlines()
                if '"authentication failed"' in line]
    assert {r["failure"] for r in refusals} >= set(cases)
    assert all(cases["bad_signature"] not in line and "not-a-known-token" not in line
               for line in log.splitlines())
    assert any(entry.get("principal") == "carol" and entry.get("mechanism") == "jwt"
               for entry in map(json.loads, [l for l in log.splitlines()
                                             if '"principal authenticated"' in l]))


def test_health_and_reflection_need_no_credentials(token_cluster):
    for process in token_cluster.services():
        with grpc.insecure_channel(process["grpc_address"]) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                              timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(token_cluster.info["bootstrap"]) as channel:
        replies = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
        names = {s.name for reply in replies for s in reply.list_services_response.service}
    assert "atomlog.v1.MetadataService" in names


def test_sdk_transaction_across_servers_with_a_token(token_cluster, keys, tmp_path):
    bootstrap = token_cluster.info["bootstrap"]
    with Client(bootstrap, request_timeout_s=5) as anonymous:
        with pytest.raises(AtomlogClientError) as refused:
            anonymous.list_topics()
        assert refused.value.reason == "UNAUTHENTICATED"
    token_file = tmp_path / "jwt"
    token_file.write_text(make_jwt(keys, "writer"))
    # Streaming path: partition servers verify with the coordinator, the coordinator sends
    # markers to both, the producer id comes from the id allocator: all with the service
    # token. Then the one-call path (the coordinator stages on the partition servers).
    with Client(bootstrap, token_file=str(token_file), one_call_max_bytes=0) as client:
        topic = create_online(client, "auth-orders", 2)
        assert {client.metadata.route(topic, p).server_name for p in (0, 1)} == {"ps-0", "ps-1"}
        with client.producer() as producer:
            with client.transaction(timeout_s=30) as txn:
                producer.send(topic, b"streaming-0", partition=0, txn=txn)
                producer.send(topic, b"streaming-1", partition=1, txn=txn)
    with Client(bootstrap, token=BOB_TOKEN) as client:
        with client.producer() as producer, client.transaction(timeout_s=30) as txn:
            producer.send(topic, b"one-call-0", partition=0, txn=txn)
            producer.send(topic, b"one-call-1", partition=1, txn=txn)
        seen: list[bytes] = []
        with client.consumer(topic) as consumer:
            wait_until(lambda: seen.extend(m.value for m in consumer.poll(timeout_s=0.2))
                       or len(seen) >= 4, 30, "the committed records")
        assert sorted(seen) == [b"one-call-0", b"one-call-1", b"streaming-0", b"streaming-1"]
    # Server-to-server calls were authenticated as the service principal.
    log = Path(token_cluster.process("ps-0")["log_file"]).read_text(errors="replace")
    service = [json.loads(l) for l in log.splitlines() if '"principal authenticated"' in l
               and '"atomlog-service"' in l]
    assert service and service[0]["service"] is True and service[0]["mechanism"] == "static"
    # A token file replaced on disk is used from then on (re-read, at most once a second).
    with Client(bootstrap, token_file=str(token_file), request_timeout_s=5) as client:
        assert topic in client.list_topics()
        token_file.write_text(make_jwt(keys, "writer", expires_in=-120))
        time.sleep(1.1)
        with pytest.raises(AtomlogClientError) as expired:
            client.list_topics()
        assert expired.value.reason == "UNAUTHENTICATED"
        assert expired.value.metadata["failure"] == "expired"


def test_static_token_revoked_by_editing_the_file(token_cluster, keys):
    address = token_cluster.process("coord-0")["grpc_address"]
    tokens = keys["dir"] / "tokens"
    assert isinstance(list_topics(address, ALICE_TOKEN), metadata_pb2.ListTopicsResponse)
    original = tokens.read_text()
    try:
        tokens.write_text(original.replace(f"alice {ALICE_TOKEN}\n", ""))
        wait_until(lambda: not isinstance(list_topics(address, ALICE_TOKEN),
                                          metadata_pb2.ListTopicsResponse), 10,
                   "alice's token to be refused")
        error = list_topics(address, ALICE_TOKEN)
        assert (error.reason, error.metadata["failure"]) == ("UNAUTHENTICATED", "unknown_token")
        assert isinstance(list_topics(address, BOB_TOKEN), metadata_pb2.ListTopicsResponse)
        # A half-edited file that does not parse keeps the last good tokens.
        tokens.write_text(original + "broken-line-without-a-token\n")
        time.sleep(1.2)
        assert isinstance(list_topics(address, BOB_TOKEN), metadata_pb2.ListTopicsResponse)
    finally:
        tokens.write_text(original)
    wait_until(lambda: isinstance(list_topics(address, ALICE_TOKEN),
                                  metadata_pb2.ListTopicsResponse), 10, "alice's token back")


def test_deleting_the_tokens_file_revokes_them(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text(f"alice {ALICE_TOKEN}\n")
    authenticator = auth.Authenticator("token", static_tokens_file=str(tokens))
    authenticator._static._interval = 0
    header = [("authorization", f"Bearer {ALICE_TOKEN}")]
    assert authenticator.authenticate(header, {}).name == "alice"
    tokens.unlink()
    with pytest.raises(auth.AuthFailure):
        authenticator.authenticate(header, {})
    tokens.write_text(f"alice {ALICE_TOKEN}\n")
    assert authenticator.authenticate(header, {}).name == "alice"


def test_cli_with_a_token_file(token_cluster, keys, tmp_path):
    bootstrap = token_cluster.info["bootstrap"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATOMLOG_")}
    refused = subprocess.run([sys.executable, "-m", "services", "topic", "list", "-b", bootstrap],
                             cwd=REPO_ROOT, capture_output=True, text=True, env=env, timeout=60)
    assert refused.returncode != 0 and "UNAUTHENTICATED" in refused.stderr
    token = tmp_path / "token"
    token.write_text(BOB_TOKEN)
    by_flag = subprocess.run([sys.executable, "-m", "services", "topic", "create", "auth-cli",
                              "--partitions", "1", "-b", bootstrap, "--token-file", str(token)],
                             cwd=REPO_ROOT, capture_output=True, text=True, env=env, timeout=60)
    assert by_flag.returncode == 0, by_flag.stderr
    by_env = subprocess.run([sys.executable, "-m", "services", "topic", "list", "-b", bootstrap],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
                            env={**env, "ATOMLOG_TOKEN_FILE": str(token)})
    assert by_env.returncode == 0 and "auth-cli" in by_env.stdout, by_env.stderr


def test_status_with_a_token(token_cluster, tmp_path):
    without = json.loads(token_cluster.run("status", "--output", "json", check=False).stdout)
    assert not without["healthy"]
    assert any("UNAUTHENTICATED" in p for r in without["processes"]
               for p in r.get("offline_partitions", []))
    token = tmp_path / "token"
    token.write_text(BOB_TOKEN)
    with_token = json.loads(token_cluster.run("status", "--output", "json", "--token-file",
                                              str(token)).stdout)
    assert with_token["healthy"], with_token


def test_spark_option_auth_token_file(tmp_path, keys):
    from spark_client.spark import OptionError, Options

    token = tmp_path / "token"
    token.write_text(BOB_TOKEN)
    options = Options.parse({"bootstrap": "h:1", "topic": "t", "auth.tokenFile": str(token)})
    assert options.token_file == str(token)
    with pytest.raises(OptionError, match="auth.tokenFile"):
        Options.parse({"bootstrap": "h:1", "topic": "t", "auth.tokenFile": str(tmp_path / "no")})
    (tmp_path / "empty").write_text("")
    with pytest.raises(OptionError, match="holds nothing"):
        Options.parse({"bootstrap": "h:1", "topic": "t", "auth.tokenFile": str(tmp_path / "empty")})


# ------------------------------------------------------------------ without a cluster
def _problem(keys: dict | None = None, role: str = "coordinator", **settings) -> str:
    with pytest.raises(ConfigError) as caught:
        load_config(role, env={}, overrides=settings)
    return "\n".join(caught.value.problems)


def test_settings_validation(keys, tmp_path):
    good = keys["settings"]
    assert load_config("partition_server", env={}, overrides={
        **good, "server.data_dir": str(tmp_path)})["auth.mode"] == "token"
    assert load_config("coordinator", env={})["auth.mode"] == "none"
    assert "auth.mode='tokens'" in _problem(**{"auth.mode": "tokens"})
    assert "auth.mode=mtls needs tls.enabled=true and tls.client_auth=require" in _problem(
        **{"auth.mode": "mtls"})
    assert "auth.mode=token needs auth.jwt_key_file, auth.jwt_secret_file or " \
           "auth.static_tokens_file" in _problem(**{"auth.mode": "token",
                                                   "auth.service_token_file": "x"})
    assert "auth.mode=token needs auth.service_token_file" in _problem(
        **{**good, "auth.service_token_file": ""})
    assert "auth.jwt_issuer is needed" in _problem(**{**good, "auth.jwt_issuer": ""})
    assert "auth.jwt_audience is needed" in _problem(**{**good, "auth.jwt_audience": ""})
    assert "reads no tokens" in _problem(**{"auth.static_tokens_file": good["auth.static_tokens_file"]})
    assert "auth.service_principals set, but auth.mode=none" in _problem(
        **{"auth.service_principals": "x"})
    problem = _problem(**{**good, "auth.jwt_key_file": str(tmp_path / "missing.pem")})
    assert problem.startswith("auth.jwt_key_file: cannot read") and "missing.pem" in problem
    (tmp_path / "junk.pem").write_text("not a key")
    assert _problem(**{**good, "auth.jwt_key_file": str(tmp_path / "junk.pem")}).startswith(
        "auth.jwt_key_file:")
    (tmp_path / "short").write_text("too-short")
    assert "at least 32 bytes" in _problem(**{**good, "auth.jwt_secret_file": str(tmp_path / "short")})
    (tmp_path / "tokens").write_text(f"alice {ALICE_TOKEN}\nalias {ALICE_TOKEN}\n")
    assert "auth.static_tokens_file:" in _problem(
        **{**good, "auth.static_tokens_file": str(tmp_path / "tokens")})
    (tmp_path / "tokens").write_text("alice\n")
    assert "line 1: expected `principal token`" in _problem(
        **{**good, "auth.static_tokens_file": str(tmp_path / "tokens")})


def test_hs256_and_certificate_principal_rules(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("s" * 40)
    authenticator = auth.Authenticator("token", jwt_issuer=ISSUER, jwt_audience=AUDIENCE,
                                       jwt_secret_file=str(secret), service_principals=["svc-*"])
    now = int(time.time())
    token = jwt.encode({"sub": "svc-ps-0", "iss": ISSUER, "aud": AUDIENCE, "exp": now + 60},
                       "s" * 40, algorithm="HS256")
    assert authenticator.authenticate([("authorization", f"Bearer {token}")], {}) == \
        auth.Principal("svc-ps-0", "jwt", service=True)
    # A token signed with the right secret but without exp is refused.
    no_exp = jwt.encode({"sub": "x", "iss": ISSUER, "aud": AUDIENCE}, "s" * 40, algorithm="HS256")
    with pytest.raises(auth.AuthFailure) as caught:
        authenticator.authenticate([("authorization", f"Bearer {no_exp}")], {})
    assert caught.value.failure == "missing_claim"
    with pytest.raises(auth.AuthFailure) as caught:  # "none" is never an algorithm
        authenticator.authenticate([("authorization", "Bearer " + jwt.encode(
            {"sub": "x", "iss": ISSUER, "aud": AUDIENCE, "exp": now + 60}, None,
            algorithm="none"))], {})
    assert caught.value.failure == "bad_algorithm"
    # A header PyJWT refuses as a whole (a kid that is no string, a crit it does not know)
    # is a malformed token, not an exception out of authentication (it answered UNKNOWN
    # on gRPC, and on a pipelined link connection it stopped the answers).
    import base64
    import json

    def part(value) -> str:
        return base64.urlsafe_b64encode(json.dumps(value).encode()).rstrip(b"=").decode()

    for header in ({"alg": "HS256", "kid": 1}, {"alg": "HS256", "crit": ["unknown"]}):
        weird = ".".join((part(header), part({"sub": "x"}), "c2ln"))  # (PyJWT writes neither)
        with pytest.raises(auth.AuthFailure) as caught:
            authenticator.authenticate([("authorization", f"Bearer {weird}")], {})
        assert caught.value.failure == "malformed_token", header
    # mTLS: the CN, or the first DNS / URI SAN.
    ca = LocalCa(tmp_path / "ca")
    ca.issue(tmp_path / "c.crt", tmp_path / "c.key", "client-cn", ["client.example"],
             server=False)
    pem = (tmp_path / "c.crt").read_bytes()
    context = {"x509_common_name": [b"client-cn"], "x509_pem_cert": [pem]}
    assert auth.Authenticator("mtls").authenticate([], context).name == "client-cn"
    assert auth.Authenticator("mtls", mtls_principal="san_dns").authenticate(
        [], context).name == "client.example"
    with pytest.raises(auth.AuthFailure) as caught:
        auth.Authenticator("mtls", mtls_principal="san_uri").authenticate([], context)
    assert caught.value.failure == "no_principal_in_certificate"
    with pytest.raises(auth.AuthFailure) as caught:
        auth.Authenticator("mtls").authenticate([], {})
    assert caught.value.failure == "missing_credentials"


def test_mtls_or_token_prefers_the_token(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text(f"alice {ALICE_TOKEN}\n")
    either = auth.Authenticator("mtls_or_token", static_tokens_file=str(tokens),
                                service_principals=["ps-*"])
    ca = LocalCa(tmp_path / "ca")
    ca.issue(tmp_path / "s.crt", tmp_path / "s.key", "ps-0", ["127.0.0.1"])
    context = {"x509_common_name": [b"ps-0"], "x509_pem_cert": [(tmp_path / "s.crt").read_bytes()]}
    assert either.authenticate([], context) == auth.Principal("ps-0", "mtls", service=True)
    assert either.authenticate([("authorization", f"Bearer {ALICE_TOKEN}")], context) == \
        auth.Principal("alice", "static", service=False)
    with pytest.raises(auth.AuthFailure) as caught:  # a bad token is not excused by the cert
        either.authenticate([("authorization", "Bearer wrong-token-0123456789")], context)
    assert caught.value.failure == "unknown_token"
    with pytest.raises(auth.AuthFailure) as caught:
        either.authenticate([("authorization", "Basic YWxpY2U6cHc=")], context)
    assert caught.value.failure == "malformed_authorization"


def test_in_process_calls_are_the_server_s_own():
    """A call between two roles of one process (the combined server) is the server's own,
    not the client's whose call led to it; the client's principal is back afterwards."""
    import asyncio

    from services.local import LocalStub

    class Servicer:
        async def Verify(self, request, context):
            return auth.current()

    async def scenario():
        auth.set_current(auth.Principal("alice", "static"))
        seen = await LocalStub(Servicer(), "atomlog.v1.Test").Verify(None, timeout=5)
        return seen, auth.current()

    seen, after = asyncio.run(scenario())
    assert seen == auth.IN_PROCESS and seen.service
    assert after == auth.Principal("alice", "static")


def test_followers_copy_over_the_replication_link_with_the_service_token(token_cluster, keys):
    """The replication link authenticates each request as gRPC authenticates each call: the
    partition servers' followers copy over it with the service token, and a request with
    no token or a wrong one is refused UNAUTHENTICATED (partition_server/copy_link.py)."""
    from atomlog.v1 import common_pb2, partition_pb2
    from partition_server.copy_link import KIND_ERROR
    from tests.link_tools import connect, link_address, read_frame, request_frame

    with Client(token_cluster.info["bootstrap"], token=BOB_TOKEN) as client:
        client.create_topic("auth-link", partitions=1, replication_factor=2)

        def partition():
            return client.metadata.call("GetMetadata", metadata_pb2.GetMetadataRequest(
                topics=["auth-link"])).topics[0].partitions[0]

        wait_until(lambda: partition().server_name and len(partition().isr) == 2, 30,
                   "auth-link's two replicas in sync")
        with client.producer(linger_ms=0) as producer:  # acknowledged: the follower copied
            producer.send("auth-link", b"replicated", partition=0).result(timeout=30)
        part = partition()
    leader = token_cluster.process(part.server_name)
    assert metric_sum(leader["metrics_address"],
                  'atomlog_replication_link_requests_total{outcome="ok"}') > 0
    follower = next(r for r in part.replicas if r != part.server_name)
    request = partition_pb2.ReplicateManyRequest(replica=follower, max_wait_ms=0, partitions=[
        partition_pb2.ReplicateRequest(
            topic_partition=common_pb2.TopicPartition(topic="auth-link", partition=0),
            replica=follower, leader_epoch=part.leader_epoch, replica_incarnation=1)])
    with connect(link_address(token_cluster, part.server_name)) as sock:
        for token, failure in (("", "missing_credentials"), ("not-a-known-token", "unknown_token"),
                               (make_jwt(keys, "writer", expires_in=-120), "expired")):
            sock.sendall(request_frame(request.SerializeToString(), token))
            kind, payload = read_frame(sock)
            error = partition_pb2.ItemError.FromString(payload)
            assert (kind, error.reason, error.metadata["failure"]) == (
                KIND_ERROR, "UNAUTHENTICATED", failure)
    assert metric_sum(leader["metrics_address"],
                  'atomlog_replication_link_requests_total{outcome="UNAUTHENTICATED"}') == 3


def test_coordinators_call_over_the_partition_link_with_the_service_token(token_cluster, keys):
    """The coordinator's staging, TC-log appends and markers cross to the partition
    servers on their links with the service token (none falls back to gRPC), and a call
    frame with no token or a wrong one is refused UNAUTHENTICATED before anything runs
    (partition_server/copy_link.py, LinkServer._call)."""
    import struct

    from atomlog.v1 import common_pb2, partition_pb2
    from partition_server.copy_link import CALL_NUMBERS, KIND_CALL, KIND_ERROR
    from partition_server.record_batch import Record, encode_batch
    from tests.link_tools import HEAD, connect, link_address, read_frame

    servers = [p for p in token_cluster.info["processes"] if p["role"] == "partition_server"]
    coordinator = next(p for p in token_cluster.info["processes"] if p["role"] == "coordinator")

    def on_link(method: str) -> float:
        return sum(metric_sum(p["metrics_address"], "atomlog_link_calls_total{method="
                              f'"/atomlog.v1.PartitionService/{method}"}}') for p in servers)

    def rode() -> float:  # TC-log appends inside StageTxn calls (coordinator/staging.py)
        return metric_sum(coordinator["metrics_address"],
                          "atomlog_coordinator_riding_appends_total")

    staged, appended, riding = on_link("StageTxn"), on_link("Produce"), rode()
    with Client(token_cluster.info["bootstrap"], token=BOB_TOKEN) as client:
        client.create_topic("auth-link-calls", partitions=2)
        wait_until(lambda: all(p.server_name for p in client.metadata.call(
            "GetMetadata", metadata_pb2.GetMetadataRequest(topics=["auth-link-calls"]))
            .topics[0].partitions), 30, "auth-link-calls online")
        with client.producer(linger_ms=0) as producer:
            for i in range(3):
                txn = client.begin_transaction(timeout_s=30)
                producer.send("auth-link-calls", b"v%d" % i, partition=i % 2, txn=txn)
                txn.commit()
        owner = client.metadata.route("auth-link-calls", 0).server_name
    assert on_link("StageTxn") >= staged + 3
    assert on_link("Produce") > appended or rode() > riding
    assert metric_sum(coordinator["metrics_address"], "atomlog_link_call_fallbacks_total") == 0
    produce = partition_pb2.ProduceRequest(items=[partition_pb2.ProduceItem(
        topic_partition=common_pb2.TopicPartition(topic="auth-link-calls", partition=0),
        record_batch=encode_batch([Record(key=None, value=b"nobody")]))]).SerializeToString()
    leader = token_cluster.process(owner)["metrics_address"]
    refused_before = metric_sum(leader, "atomlog_authentication_failures_total")
    with connect(link_address(token_cluster, owner)) as sock:
        for token, failure in (("", "missing_credentials"), ("not-a-known-token", "unknown_token"),
                               (make_jwt(keys, "writer", expires_in=-120), "expired")):
            body = struct.pack(">BIH", CALL_NUMBERS["PartitionService", "Produce"], 10_000,
                               len(token)) + token.encode() + produce
            sock.sendall(HEAD.pack(len(body) + 1, KIND_CALL) + body)
            kind, payload = read_frame(sock)
            error = partition_pb2.ItemError.FromString(payload)
            assert (kind, error.reason, error.metadata["failure"]) == (
                KIND_ERROR, "UNAUTHENTICATED", failure)
    # Counted as gRPC counts a refused caller (an authentication failure), and nothing ran.
    assert metric_sum(leader, "atomlog_authentication_failures_total") == refused_before + 3
    with Client(token_cluster.info["bootstrap"], token=BOB_TOKEN) as client, \
            client.consumer(["auth-link-calls"], isolation="read_uncommitted",
                            start="earliest") as consumer:
        assert sorted(m.value for chunk in consumer.read_until() for m in chunk) == \
            [b"v0", b"v1", b"v2"]


def test_sdk_commits_on_the_coordinator_link_with_its_token(token_cluster, keys):
    """The SDK's one-call commits go on the coordinator's link (spark_client/link.py) with
    the client's token, and the link refuses a commit without a good token
    UNAUTHENTICATED, counted as gRPC counts it, as gRPC would refuse the same call."""
    from atomlog.v1 import coordinator_pb2
    from services.auth import TokenSource
    from spark_client.link import Links

    coordinator = next(p for p in token_cluster.info["processes"] if p["role"] == "coordinator")
    commits = 'atomlog_link_calls_total{method="/atomlog.v1.CoordinatorService/CommitTxn"}'
    before = metric_sum(coordinator["metrics_address"], commits)
    with Client(token_cluster.info["bootstrap"], token=BOB_TOKEN) as client:
        topic = create_online(client, "auth-commit-link", 1)
        with client.producer(linger_ms=0) as producer:
            for i in range(3):
                with client.transaction(timeout_s=30) as txn:
                    producer.send(topic, b"c%d" % i, partition=0, txn=txn)
        assert (client.links.calls, client.links.fallbacks) == (3, 0)
        address = coordinator["grpc_address"]
        link_address = client.metadata.coordinator_links[address]
    assert metric_sum(coordinator["metrics_address"], commits) == before + 3
    refused_before = metric_sum(coordinator["metrics_address"],
                                "atomlog_authentication_failures_total")
    request = coordinator_pb2.CommitTxnRequest(idempotency_key="k", abort=True)
    for token in (None, TokenSource("not-a-known-token")):
        links = Links(token=token)
        try:
            with pytest.raises(grpc.RpcError) as refused:
                links.get(address, link_address).call("CommitTxn", request, 10)
        finally:
            links.close()
        assert from_rpc_error(refused.value).reason == "UNAUTHENTICATED"
    assert metric_sum(coordinator["metrics_address"],
                      "atomlog_authentication_failures_total") == refused_before + 2
