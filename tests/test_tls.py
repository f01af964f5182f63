"""TLS and mutual TLS (issue 24, item 1) against a real cluster started with
`atomlog up --tls` (one for the module: separate processes, so every server-to-server
call — coordinator to partition servers, partition servers to the coordinator, the
coordinator to the id allocator — crosses a TLS connection), plus the settings'
validation."""

from __future__ import annotations

import json
import shutil
import socket
import ssl
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.config import ConfigError, load_config
from services.tls import LocalCa, TlsConfig, TlsFileError
from spark_client import Client
from spark_client.errors import AtomlogClientError
from tests.conftest import REPO_ROOT, SESSION_TIMEOUT_MS, Cluster, create_online, wait_until

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def tls_cluster(tmp_path_factory):
    cluster = Cluster(tmp_path_factory.mktemp("atomlog-tls"))
    try:
        report = json.loads(cluster.run(
            "up", "--tls", "--output", "json", "--partition-servers", "2", "--coordinators",
            "1", "--id-allocators", "1", "--set", f"zookeeper.session_timeout_ms={SESSION_TIMEOUT_MS}",
            # One copy, as before the product default replicated: not what this tests.
            "--set", "topics.default_replication_factor=1",
            "--set", "tls.metrics=true").stdout)
        assert set(report["started"]) == {p["name"] for p in report["processes"]}
        assert report["tls"]["client_auth"] == "require"
        yield cluster
    finally:
        if (cluster.data_dir / "cluster.json").exists():
            cluster.run("down", check=False)


@pytest.fixture(scope="module")
def orders(tls_cluster) -> str:
    """A topic of two partitions, one on each partition server."""
    with Client(tls_cluster.info["bootstrap"], tls=client_tls(tls_cluster)) as client:
        topic = create_online(client, "tls-orders", 2)
        assert {client.metadata.route(topic, p).server_name for p in (0, 1)} == {"ps-0", "ps-1"}
    return topic


def client_tls(cluster: Cluster, **changes) -> TlsConfig:
    tls = cluster.info["tls"]
    return TlsConfig(**{"ca_file": tls["ca_file"], "cert_file": tls["cert_file"],
                        "key_file": tls["key_file"], **changes})


def refused(address: str, credentials: grpc.ChannelCredentials | None) -> grpc.StatusCode:
    """The status of a health check over `credentials` (None: plaintext); fails the test
    if the server answers."""
    channel = (grpc.insecure_channel(address) if credentials is None
               else grpc.secure_channel(address, credentials))
    with channel:
        with pytest.raises(grpc.RpcError) as caught:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return caught.value.code()


def peer_certificate_serial(address: str, cluster: Cluster) -> int:
    """The serial of the certificate a server presents to a new connection."""
    from cryptography import x509

    tls = cluster.info["tls"]
    context = ssl.create_default_context(cafile=tls["ca_file"])
    context.load_cert_chain(tls["cert_file"], tls["key_file"])
    context.set_alpn_protocols(["h2"])
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as raw, \
            context.wrap_socket(raw, server_hostname=host) as wrapped:
        return x509.load_der_x509_certificate(wrapped.getpeercert(binary_form=True)).serial_number


def test_produce_consume_and_transactions_over_mtls(tls_cluster, orders):
    bootstrap, topic = tls_cluster.info["bootstrap"], orders
    # Streaming transactions (NewTxn, Produce, EndTxn): the partition servers verify with the
    # coordinator and the coordinator sends markers to both partition servers, all over TLS.
    with Client(bootstrap, tls=client_tls(tls_cluster), one_call_max_bytes=0) as client:
        with client.producer() as producer:  # its producer id: coordinator -> id allocator
            producer.send(topic, b"plain", partition=0).result(30)
            with client.transaction(timeout_s=30) as txn:
                producer.send(topic, b"committed-0", partition=0, txn=txn)
                producer.send(topic, b"committed-1", partition=1, txn=txn)
            aborted = client.begin_transaction(timeout_s=30)
            producer.send(topic, b"aborted", partition=1, txn=aborted)
            producer.flush()
            aborted.abort()
    # One-call transactions (CommitTxn: the coordinator stages on the partition servers).
    with Client(bootstrap, tls=client_tls(tls_cluster)) as client:
        with client.producer() as producer, client.transaction(timeout_s=30) as txn:
            producer.send(topic, b"one-call", partition=1, txn=txn)
        assert txn.state() in ("COMMITTING", "COMMITTED")
        seen: list[bytes] = []
        with client.consumer(topic) as consumer:
            wait_until(lambda: seen.extend(m.value for m in consumer.poll(timeout_s=0.2))
                       or len(seen) >= 4, 30, "the committed records")
            time.sleep(0.3)
            seen.extend(m.value for m in consumer.poll(timeout_s=0.2))
        assert sorted(seen) == [b"committed-0", b"committed-1", b"one-call", b"plain"]


def test_mtls_principals(tls_cluster, orders):
    """`up --tls` runs auth.mode=mtls: the client certificate's CN is the caller's principal
    (atomlog-admin), and the servers' own certificates make them service principals."""
    assert tls_cluster.info["tls"]["auth"] == "mtls"
    with Client(tls_cluster.info["bootstrap"], tls=client_tls(tls_cluster),
                one_call_max_bytes=0) as client:
        with client.producer() as producer, client.transaction(timeout_s=30) as txn:
            producer.send(orders, b"principals-0", partition=0, txn=txn)
            producer.send(orders, b"principals-1", partition=1, txn=txn)

    def principals(name: str) -> dict[str, dict]:
        lines = Path(tls_cluster.process(name)["log_file"]).read_text(errors="replace")
        return {e["principal"]: e for e in map(json.loads, [
            line for line in lines.splitlines() if '"principal authenticated"' in line])}

    seen = principals("ps-0")
    assert seen["atomlog-admin"]["mechanism"] == "mtls" and not seen["atomlog-admin"]["service"]
    assert seen["coord-0"]["service"] is True  # markers and staging from the coordinator
    assert principals("coord-0")["ps-0"]["service"] is True  # verification from ps-0


def test_plaintext_client_is_refused(tls_cluster):
    for process in tls_cluster.services():
        assert refused(process["grpc_address"], None) == grpc.StatusCode.UNAVAILABLE
    with Client(tls_cluster.info["bootstrap"], request_timeout_s=5) as client:
        with pytest.raises(AtomlogClientError) as caught:
            client.list_topics()
    assert caught.value.reason == "SERVER_UNAVAILABLE"


def test_tls_client_without_certificate_is_refused(tls_cluster):
    ca = Path(tls_cluster.info["tls"]["ca_file"]).read_bytes()
    for process in tls_cluster.services():
        assert refused(process["grpc_address"], grpc.ssl_channel_credentials(ca)) \
            == grpc.StatusCode.UNAVAILABLE
    with Client(tls_cluster.info["bootstrap"], request_timeout_s=5,
                tls=client_tls(tls_cluster, cert_file="", key_file="")) as client:
        with pytest.raises(AtomlogClientError):
            client.list_topics()
    # The server says why, in its log (grpc's handshake failure, with OpenSSL's reason).
    log = Path(tls_cluster.process("ps-0")["log_file"])
    wait_until(lambda: "PEER_DID_NOT_RETURN_A_CERTIFICATE" in log.read_text(errors="replace"),
               5, "the refusal in ps-0's log")


def test_certificates_of_another_ca_are_refused(tls_cluster, tmp_path):
    stranger = LocalCa(tmp_path / "other-ca", "another CA")
    stranger.issue(tmp_path / "c.crt", tmp_path / "c.key", "intruder", server=False)
    ca = Path(tls_cluster.info["tls"]["ca_file"]).read_bytes()
    key, cert = (tmp_path / "c.key").read_bytes(), (tmp_path / "c.crt").read_bytes()
    address = tls_cluster.info["bootstrap"]
    # A client certificate the cluster's CA did not sign.
    assert refused(address, grpc.ssl_channel_credentials(ca, key, cert)) \
        == grpc.StatusCode.UNAVAILABLE
    # And the other way round: a client trusting only the other CA refuses the server.
    assert refused(address, grpc.ssl_channel_credentials(
        stranger.ca_file.read_bytes(), key, cert)) == grpc.StatusCode.UNAVAILABLE
    # The right files work (the refusals above are about the certificates).
    with Client(address, tls=client_tls(tls_cluster)) as client:
        client.list_topics()  # raises if refused


def test_server_certificate_reloaded_without_restart(tls_cluster, orders):
    ps0 = tls_cluster.process("ps-0")
    address, pid = ps0["grpc_address"], ps0["pid"]
    tls_dir = Path(tls_cluster.info["tls"]["ca_file"]).parent
    cert, key = tls_dir / "ps-0.crt", tls_dir / "ps-0.key"
    before = peer_certificate_serial(address, tls_cluster)
    assert before == _serial(cert)

    # Rotate: a new certificate from the same CA (new key, new serial).
    serial = LocalCa(tls_dir).issue(cert, key, "ps-0", ["127.0.0.1", "localhost", "ps-0"])
    assert serial != before
    wait_until(lambda: peer_certificate_serial(address, tls_cluster) == serial, 10,
               "ps-0 to present its new certificate")
    # /metrics (tls.metrics=true) and the link follow the same files.
    assert _metrics_serial(ps0["metrics_address"], tls_cluster) == serial
    assert _link_serial(tls_cluster, "ps-0") == serial

    # A half-done rotation (a key that is not the certificate's) is not taken: the server
    # keeps presenting the last good pair, and serves.
    good_key = key.read_bytes()
    shutil.copyfile(tls_dir / "ps-1.key", key)
    try:
        assert peer_certificate_serial(address, tls_cluster) == serial
        with Client(address, tls=client_tls(tls_cluster)) as client:
            client.describe_partition(orders, 0)
    finally:
        key.write_bytes(good_key)
    assert peer_certificate_serial(address, tls_cluster) == serial

    # No restart, and new clients (and the other servers) still get through.
    assert tls_cluster.process("ps-0")["pid"] == pid
    with Client(tls_cluster.info["bootstrap"], tls=client_tls(tls_cluster)) as client:
        with client.producer() as producer, client.transaction(timeout_s=30) as txn:
            producer.send(orders, b"after-rotation", partition=0, txn=txn)
    log = Path(ps0["log_file"]).read_text()
    assert "TLS certificate reloaded" in log and "cannot be used yet" in log


def test_links_speak_tls_and_take_the_client_certificate(tls_cluster):
    """Under TLS the servers' links (partition_server/copy_link.py) speak TLS with the gRPC
    port's certificate, CA and client-certificate rule: followers copy and the
    coordinator stages, logs and marks over the partition servers' links, and the SDK
    commits over the coordinator's and produces over a partition server's (pipelined),
    none falling back to gRPC. A plaintext
    client, a TLS client without a certificate and one with another CA's certificate get
    no frame answered; with the cluster's certificate, the certificate is the principal
    (the admin, not a service, is refused the service-only StageTxn)."""
    from atomlog.v1 import metadata_pb2, partition_pb2
    from partition_server.copy_link import CALL_NUMBERS, KIND_CALL, KIND_ERROR, MAGIC
    from tests.link_tools import HEAD, closed_by_peer, link_address, read_frame

    servers = ("ps-0", "ps-1")
    before = {name: _link_counts(tls_cluster, name) for name in servers}
    with Client(tls_cluster.info["bootstrap"], tls=client_tls(tls_cluster)) as client:
        topic = create_online(client, "tls-linked", 2, replication_factor=2)

        def partitions():
            return client.metadata.call("GetMetadata", metadata_pb2.GetMetadataRequest(
                topics=[topic])).topics[0].partitions

        wait_until(lambda: all(len(p.isr) == 2 for p in partitions()), 30,
                   "both copies of each partition in sync")
        with client.producer(linger_ms=0) as producer:
            producer.send(topic, b"copied", partition=0).result(timeout=30)
            for i in range(4):
                with client.transaction(timeout_s=30) as txn:
                    producer.send(topic, b"linked-%d" % i, partition=i % 2, txn=txn)
        leaders = {p.server_name for p in partitions()}
        # The commits went on the coordinator's link, over TLS with the client's
        # certificate (spark_client/link.py), none over gRPC; the producer's batch on
        # a pipelined connection to its partition server's link.
        assert client.links.calls >= 5 and client.links.fallbacks == 0
        pipelines = list(client.links._pipelines.values())
        assert len(pipelines) == 1 and pipelines[0].connects == 1
        # A subscription consumer's Receive and Ack went on the partitions' leaders'
        # links, over TLS too.
        commits = client.links.calls
        taken: list[bytes] = []
        with client.consumer(topic, subscription="tls-linked-sub") as consumer:
            def take():
                messages = consumer.poll(timeout_s=0.5)
                consumer.ack(messages)
                taken.extend(m.value for m in messages)
                return len(taken) >= 5
            wait_until(take, 30, "the topic's 5 values received and acked")
        assert sorted(taken) == [b"copied"] + [b"linked-%d" % i for i in range(4)]
        assert client.links.calls >= commits + 2 and client.links.fallbacks == 0
        partition_links = set(client.metadata.partition_links.values())
        assert partition_links & {link.address for link in client.links._links.values()}
        # One TLS connection per coordinator, kept (the session tickets TLS 1.3 sends
        # after the handshake do not make it look closed).
        assert all(link.connects == 1 for link in client.links._links.values())
    after = {name: _link_counts(tls_cluster, name) for name in servers}
    # Each partition's leader answered its follower's copies on its link and took the
    # coordinator's staging there; nobody copied over gRPC.
    for name in leaders:
        assert after[name]["copies"] > before[name]["copies"], (name, before, after)
        assert after[name]["staged"] > before[name]["staged"], (name, before, after)
    for name in servers:
        assert after[name]["copies_over_grpc"] == before[name]["copies_over_grpc"]
    coordinator = tls_cluster.process("coord-0")["metrics_address"]
    assert _https_metric_sum(tls_cluster, coordinator, "atomlog_link_call_fallbacks_total") == 0
    assert _https_metric_sum(tls_cluster, coordinator, 'atomlog_link_calls_total{method='
                             '"/atomlog.v1.CoordinatorService/CommitTxn"}') >= 4

    address = link_address(tls_cluster, "ps-0")
    host, _, port = address.rpartition(":")
    tls = tls_cluster.info["tls"]
    stage = partition_pb2.StageTxnRequest().SerializeToString()
    call = struct.pack(">BIH", CALL_NUMBERS["PartitionService", "StageTxn"], 10_000, 0) + stage
    frame = HEAD.pack(len(call) + 1, KIND_CALL) + call

    # Plaintext: the server's handshake reads MAGIC as a broken ClientHello and closes.
    with socket.create_connection((host, int(port)), timeout=10) as plain:
        plain.sendall(MAGIC + frame)
        assert closed_by_peer(plain)

    def unanswered(context: ssl.SSLContext) -> None:
        with socket.create_connection((host, int(port)), timeout=10) as raw:
            try:
                with context.wrap_socket(raw, server_hostname=host) as wrapped:
                    wrapped.sendall(MAGIC + frame)
                    assert read_frame(wrapped) is None
            except (ssl.SSLError, ConnectionError):
                pass  # refused in the handshake (or at the first read, under TLS 1.3)

    unanswered(ssl.create_default_context(cafile=tls["ca_file"]))  # no certificate
    stranger = LocalCa(Path(tls["ca_file"]).parent.parent / "link-stranger", "another CA")
    stranger.issue(stranger.ca_file.parent / "c.crt", stranger.ca_file.parent / "c.key",
                   "intruder", server=False)
    foreign = ssl.create_default_context(cafile=tls["ca_file"])
    foreign.load_cert_chain(stranger.ca_file.parent / "c.crt", stranger.ca_file.parent / "c.key")
    unanswered(foreign)

    # The cluster's client certificate: answered, as the admin it names (a super user, but
    # StageTxn is for services only: docs/security.md).
    admin = ssl.create_default_context(cafile=tls["ca_file"])
    admin.load_cert_chain(tls["cert_file"], tls["key_file"])
    with socket.create_connection((host, int(port)), timeout=10) as raw, \
            admin.wrap_socket(raw, server_hostname=host) as wrapped:
        wrapped.sendall(MAGIC + frame)
        kind, payload = read_frame(wrapped)
    error = partition_pb2.ItemError.FromString(payload)
    assert (kind, error.reason, error.metadata["principal"]) == (
        KIND_ERROR, "PERMISSION_DENIED", "atomlog-admin"), error


def _link_serial(cluster: Cluster, server: str) -> int:
    """The serial of the certificate a server's link presents to a new connection."""
    from cryptography import x509

    from tests.link_tools import link_address

    tls = cluster.info["tls"]
    context = ssl.create_default_context(cafile=tls["ca_file"])
    context.load_cert_chain(tls["cert_file"], tls["key_file"])
    host, _, port = link_address(cluster, server).rpartition(":")
    with socket.create_connection((host, int(port)), timeout=5) as raw, \
            context.wrap_socket(raw, server_hostname=host) as wrapped:
        return x509.load_der_x509_certificate(wrapped.getpeercert(binary_form=True)).serial_number


def _https_metric_sum(cluster: Cluster, address: str, line_start: str) -> float:
    tls = cluster.info["tls"]
    context = ssl.create_default_context(cafile=tls["ca_file"])
    context.load_cert_chain(tls["cert_file"], tls["key_file"])
    with urllib.request.urlopen(f"https://{address}/metrics", context=context,
                                timeout=10) as reply:
        text = reply.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(line_start))


def _link_counts(cluster: Cluster, name: str) -> dict[str, float]:
    address = cluster.process(name)["metrics_address"]
    return {
        "copies": _https_metric_sum(cluster, address,
                                    'atomlog_replication_link_requests_total{outcome="ok"}'),
        "staged": _https_metric_sum(
            cluster, address,
            'atomlog_link_calls_total{method="/atomlog.v1.PartitionService/StageTxn"}'),
        "copies_over_grpc": _https_metric_sum(cluster, address,
                                              "atomlog_replication_link_fallbacks_total")}


def test_metrics_over_https(tls_cluster):
    tls = tls_cluster.info["tls"]
    address = tls_cluster.process("coord-0")["metrics_address"]
    context = ssl.create_default_context(cafile=tls["ca_file"])
    context.load_cert_chain(tls["cert_file"], tls["key_file"])
    with urllib.request.urlopen(f"https://{address}/metrics", context=context, timeout=5) as reply:
        assert b"atomlog_rpc_handled_total" in reply.read()
    with pytest.raises((urllib.error.URLError, ConnectionError, ssl.SSLError)):
        urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read()
    no_certificate = ssl.create_default_context(cafile=tls["ca_file"])
    with pytest.raises((urllib.error.URLError, ConnectionError, ssl.SSLError)):
        urllib.request.urlopen(f"https://{address}/metrics", context=no_certificate,
                               timeout=5).read()


def test_cli_against_the_tls_cluster(tls_cluster, tmp_path):
    status = tls_cluster.status()
    assert status["healthy"], status
    assert status["tls"]["ca_file"] == tls_cluster.info["tls"]["ca_file"]
    # From the cluster's data dir: the CLI finds the client certificate in cluster.json.
    tls_cluster.run("topic", "create", "tls-cli", "--partitions", "1")
    assert "tls-cli" in json.loads(tls_cluster.run("topic", "list", "-o", "json").stdout)
    assert json.loads(tls_cluster.run("txn", "list", "-o", "json").stdout) is not None
    # From anywhere, with the files named by environment variables.
    tls = tls_cluster.info["tls"]
    elsewhere = [sys.executable, "-m", "services", "topic", "list", "-o", "json",
                 "--data-dir", str(tmp_path / "none"), "--bootstrap", tls_cluster.info["bootstrap"]]
    env = {**_env(), "ATOMLOG_TLS_CA": tls["ca_file"], "ATOMLOG_TLS_CERT": tls["cert_file"],
           "ATOMLOG_TLS_KEY": tls["key_file"]}
    ok = subprocess.run(elsewhere, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
                        env=env)
    assert ok.returncode == 0 and "tls-cli" in json.loads(ok.stdout), ok.stderr
    # Without them the call fails, and says where.
    plain = subprocess.run(elsewhere, cwd=REPO_ROOT, capture_output=True, text=True,
                           timeout=60, env=_env())
    assert plain.returncode == 1 and "SERVER_UNAVAILABLE" in plain.stderr, plain.stderr
    bad = subprocess.run([*elsewhere, "--tls-ca", str(tmp_path / "missing.crt")], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=60, env=_env())
    assert bad.returncode == 2 and "missing.crt" in bad.stderr, bad.stderr


def test_up_tls_refuses_an_existing_plaintext_cluster(tmp_path):
    from services import launcher

    launcher.plan(tmp_path, {"partition_server": 1}, {}).save(tmp_path)
    with pytest.raises(launcher.LaunchError, match="created without --tls"):
        launcher.plan(tmp_path, {"partition_server": 1}, {}, tls=True)


# ---------------------------------------------------------------------- settings
@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    where = tmp_path_factory.mktemp("tls-files")
    ca = LocalCa(where / "ca")
    ca.issue(where / "s.crt", where / "s.key", "server", ["127.0.0.1"])
    ca.issue(where / "t.crt", where / "t.key", "other", ["127.0.0.1"])
    (where / "garbage.pem").write_text("not a certificate\n")
    return {"ca": ca.ca_file, "cert": where / "s.crt", "key": where / "s.key",
            "other_key": where / "t.key", "garbage": where / "garbage.pem",
            "missing": where / "missing.pem"}


def _load(**tls) -> object:
    overrides = {f"tls.{k}": str(v) for k, v in tls.items()}
    return load_config("coordinator", env={}, overrides=overrides)


def _problem(**tls) -> str:
    with pytest.raises(ConfigError) as caught:
        _load(**tls)
    assert len(caught.value.problems) == 1, caught.value.problems
    return caught.value.problems[0]


def test_settings_default_to_plaintext_and_accept_good_files(files):
    default = load_config("partition_server", env={}, overrides={"server.data_dir": "/tmp"})
    assert default["tls.enabled"] is False and default["tls.client_auth"] == "none"
    config = _load(enabled="true", cert_file=files["cert"], key_file=files["key"],
                   ca_file=files["ca"], client_auth="require", metrics="true")
    assert config["tls.enabled"] and config["tls.client_auth"] == "require"
    env = {"ATOMLOG_TLS_ENABLED": "1", "ATOMLOG_TLS_CERT_FILE": str(files["cert"]),
           "ATOMLOG_TLS_KEY_FILE": str(files["key"]), "ATOMLOG_TLS_CA_FILE": str(files["ca"])}
    assert load_config("id_allocator", env=env)["tls.cert_file"] == str(files["cert"])


def test_settings_validation_names_the_setting(files):
    good = {"cert_file": files["cert"], "key_file": files["key"], "ca_file": files["ca"]}
    assert "tls.enabled=true needs tls.cert_file, tls.key_file, tls.ca_file" in _problem(
        enabled="true")
    assert "needs tls.ca_file" in _problem(enabled="true", cert_file=files["cert"],
                                           key_file=files["key"])
    problem = _problem(enabled="true", **{**good, "cert_file": files["missing"]})
    assert problem.startswith("tls.cert_file:") and "missing.pem" in problem
    problem = _problem(enabled="true", **{**good, "ca_file": files["garbage"]})
    assert problem.startswith("tls.ca_file:") and "not a PEM certificate" in problem
    problem = _problem(enabled="true", **{**good, "key_file": files["other_key"]})
    assert problem.startswith("tls.key_file:") and "not the private key" in problem
    problem = _problem(enabled="true", **{**good, "key_file": files["garbage"]})
    assert problem.startswith("tls.key_file:")
    assert "tls.client_auth='require' needs tls.enabled=true" in _problem(client_auth="require")
    assert "tls.metrics=True needs tls.enabled=true" in _problem(metrics="true")
    assert "is not one of ['none', 'require']" in _problem(client_auth="optional")


def test_sdk_checks_its_files(files):
    with pytest.raises(TlsFileError, match="missing.pem"):
        Client("127.0.0.1:1", tls=TlsConfig(str(files["missing"])))
    with pytest.raises(TlsFileError, match="not the private key"):
        Client("127.0.0.1:1", tls=TlsConfig(str(files["ca"]), str(files["cert"]),
                                            str(files["other_key"])))


def test_serve_refuses_unusable_tls_files(files):
    result = subprocess.run(
        [sys.executable, "-m", "services", "serve", "id-allocator", "--set", "tls.enabled=true",
         "--set", f"tls.cert_file={files['cert']}", "--set", f"tls.key_file={files['key']}",
         "--set", f"tls.ca_file={files['missing']}"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, env=_env())
    assert result.returncode == 2
    assert "tls.ca_file" in result.stderr and "missing.pem" in result.stderr


def _serial(path: Path) -> int:
    from services.tls import certificate_serial

    return certificate_serial(path.read_bytes())


def _metrics_serial(address: str, cluster: Cluster) -> int:
    from cryptography import x509

    tls = cluster.info["tls"]
    context = ssl.create_default_context(cafile=tls["ca_file"])
    context.load_cert_chain(tls["cert_file"], tls["key_file"])
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as raw, \
            context.wrap_socket(raw, server_hostname=host) as wrapped:
        return x509.load_der_x509_certificate(wrapped.getpeercert(binary_form=True)).serial_number


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items()
            if not k.startswith(("ATOMLOG_TLS_", "ATOMLOG_BOOTSTRAP", "ATOMLOG_DATA_DIR"))}


def test_spark_options_carry_tls_to_every_client(tls_cluster, orders, files):
    """The data source's tls.* options: parsed on the driver, pickled to the executors
    with the rest of the options, and every client they make (options.client()) uses them."""
    import pickle

    from spark_client.spark import Options, OptionError

    tls = tls_cluster.info["tls"]
    options = Options.parse({"bootstrap": tls_cluster.info["bootstrap"], "topic": orders,
                             "tls.ca": tls["ca_file"], "tls.cert": tls["cert_file"],
                             "TLS.key": tls["key_file"]})
    on_executor = pickle.loads(pickle.dumps(options))
    assert on_executor.tls == client_tls(tls_cluster)
    with on_executor.client() as client:
        assert client.partitions_for(orders) == 2
    with pytest.raises(OptionError, match="need tls.ca"):
        Options.parse({"bootstrap": "h:1", "topic": "t", "tls.cert": tls["cert_file"]})
    with pytest.raises(OptionError, match="missing.pem"):
        Options.parse({"bootstrap": "h:1", "topic": "t", "tls.ca": str(files["missing"])})
    assert Options.parse({"bootstrap": "h:1", "topic": "t"}).tls is None


def test_the_cli_checks_servers_against_tls_server_name(tmp_path, monkeypatch):
    """The Kubernetes production overlay's servers share one certificate (SAN
    atomlog-server) and advertise pod IPs: the CLI, which checked each server against
    the host it dialed, could reach none of them, and no flag set the name (every
    runbook step run "in any server pod" failed). --tls-server-name (or
    ATOMLOG_TLS_SERVER_NAME, set in those pods) names it."""
    from click.testing import CliRunner

    from services import cli

    ca = LocalCa(tmp_path / "ca")
    ca.issue(tmp_path / "c.crt", tmp_path / "c.key", "ops", server=False)
    monkeypatch.setattr(cli, "_client", lambda *a, **k: (_ for _ in ()).throw(SystemExit(0)))
    for how in ("flag", "environment"):
        args = ["topic", "list", "--bootstrap", "10.0.0.7:7070", "--tls-ca",
                str(ca.ca_file), "--tls-cert", str(tmp_path / "c.crt"), "--tls-key",
                str(tmp_path / "c.key"), "--data-dir", str(tmp_path / "none")]
        env = {}
        if how == "flag":
            args += ["--tls-server-name", "atomlog-server"]
        else:
            env["ATOMLOG_TLS_SERVER_NAME"] = "atomlog-server"
        cli._TLS = None
        CliRunner().invoke(cli.cli, args, env=env)
        assert cli._TLS is not None and cli._TLS.server_name == "atomlog-server", how
        assert cli._TLS.channel_options() == [("grpc.ssl_target_name_override",
                                               "atomlog-server")]
