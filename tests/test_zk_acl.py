"""ZooKeeper protected (issue 24, item 4): a cluster made by `atomlog up --tls` (the
combined server) holds the ZooKeeper digest credential of DIR/tls/zookeeper.digest and
every znode under its chroot allows changes to that credential only; anyone may read.
An unauthenticated (or wrongly authenticated) kazoo client's writes are refused with
NoAuth and change nothing; the CLI cannot change ACLs without the credential; a chroot
made before the setting was on is secured at start-up, and one secured by another
credential is refused. Plus the settings' validation, and the plaintext health-only port
(server.health_listen) that Kubernetes probes use on a TLS cluster."""

from __future__ import annotations

import json
import time
import uuid

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kazoo.client import KazooClient
from kazoo.exceptions import NoAuthError
from kazoo.security import OPEN_ACL_UNSAFE

from services.config import ConfigError, load_config
from services.errors import AtomlogError
from services.launcher import free_port
from services.zk import ZkSession, kazoo_client, read_digest, znode_acl
from tests.conftest import SESSION_TIMEOUT_MS, Cluster

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    cluster = Cluster(tmp_path_factory.mktemp("atomlog-zk-acl"), combined=True)
    cluster.health_port = free_port()
    try:
        report = json.loads(cluster.run(
            "up", "--tls", "--combined", "--output", "json",
            "--set", f"server.health_listen=127.0.0.1:{cluster.health_port}",
            "--set", f"zookeeper.session_timeout_ms={SESSION_TIMEOUT_MS}").stdout)
        assert report["tls"]["zookeeper_digest_file"]
        cluster.run("topic", "create", "zk-orders", "--partitions", "1")
        yield cluster
    finally:
        if (cluster.data_dir / "cluster.json").exists():
            cluster.run("down", check=False)


def snapshot(client: KazooClient, root: str = "/") -> dict[str, bytes]:
    """Every znode's path and data under root (ephemeral registrations included)."""
    found, pending = {}, [root]
    while pending:
        path = pending.pop()
        data, _ = client.get(path)
        found[path] = data
        pending.extend(f"{path.rstrip('/')}/{child}" for child in client.get_children(path))
    return found


def settled_snapshot(client: KazooClient, timeout_s: float = 30) -> dict[str, bytes]:
    """A snapshot that stayed the same for a second: the coordinator may still be taking
    up its TC partitions just after `up` (each one's epoch and log producer id are written
    after its lease; CI once saw /tc/10 change between a test's two snapshots)."""
    deadline = time.monotonic() + timeout_s
    last = snapshot(client)
    while True:
        time.sleep(1.0)
        now = snapshot(client)
        if now == last or time.monotonic() > deadline:
            return now
        last = now


def test_unauthenticated_writes_are_refused_and_change_nothing(secured, tmp_path):
    info = secured.info
    wrong = tmp_path / "wrong.digest"
    wrong.write_text("atomlog:not-the-password-at-all\n")
    strangers = [KazooClient(hosts=info["zookeeper"] + info["chroot"]),
                 kazoo_client(info["zookeeper"] + info["chroot"], str(wrong))]
    for stranger in strangers:
        stranger.start(timeout=10)
    try:
        before = settled_snapshot(strangers[0])  # everyone may read
        assert "/topics/zk-orders" in before and "/cluster" in before
        registration = next(p for p in before if p.startswith("/servers/"))
        attempts = {
            "create a topic": lambda c: c.create("/topics/evil", b"{}"),
            "create at the root": lambda c: c.create("/evil", b"x"),
            "change the cluster": lambda c: c.set("/cluster", b'{"tc_partitions": 1}'),
            "delete a topic": lambda c: c.delete("/topics/zk-orders", recursive=True),
            "delete a registration": lambda c: c.delete(registration),
            "write ACLs": lambda c: c.create("/acls", b'{"version":1,"acls":[]}'),
            "open the znode ACL": lambda c: c.set_acls("/topics", OPEN_ACL_UNSAFE),
        }
        for stranger in strangers:
            for what, attempt in attempts.items():
                with pytest.raises(NoAuthError):
                    attempt(stranger)
                    pytest.fail(f"{what} was allowed")
        assert snapshot(strangers[0]) == before
    finally:
        for stranger in strangers:
            stranger.stop()
    # The servers' credential may (what the servers themselves use).
    digest = info["tls"]["zookeeper_digest_file"]
    owner = kazoo_client(info["zookeeper"] + info["chroot"], digest)
    owner.start(timeout=10)
    try:
        assert owner.get_acls("/topics/zk-orders")[0] == znode_acl(*read_digest(digest))
    finally:
        owner.stop()


def test_the_cli_cannot_change_acls_without_the_credential(secured, tmp_path):
    info = secured.info
    connection = ("--zookeeper", info["zookeeper"], "--chroot", info["chroot"])
    refused = secured.run("acl", "add", *connection, "-p", "eve", "-t", "topic",
                          "--operation", "write", check=False)
    assert refused.returncode == 1 and "NoAuth" in refused.stderr
    # Reading needs nothing; eve is not there.
    assert json.loads(secured.run("acl", "list", *connection, "-o", "json").stdout) == []
    allowed = secured.run("acl", "add", *connection, "--zookeeper-digest-file",
                          info["tls"]["zookeeper_digest_file"], "-p", "eve", "-t", "topic",
                          "--operation", "read", "-o", "json")
    assert json.loads(allowed.stdout)[0]["principal"] == "eve"


def test_an_open_chroot_is_secured_at_start_and_another_credential_refused(secured, tmp_path):
    info = secured.info
    chroot = f"/legacy-{uuid.uuid4().hex[:8]}"
    plain = KazooClient(hosts=info["zookeeper"])
    plain.start(timeout=10)
    try:
        plain.create(f"{chroot}/topics/old", b"{}", makepath=True)  # made before the setting
        digest = info["tls"]["zookeeper_digest_file"]
        session = ZkSession(info["zookeeper"], chroot, SESSION_TIMEOUT_MS, 10_000, digest)
        session.start()
        session.stop()
        for path in (chroot, f"{chroot}/topics", f"{chroot}/topics/old"):
            with pytest.raises(NoAuthError):
                plain.set(path, b"changed")
        assert plain.get(f"{chroot}/topics/old")[0] == b"{}"
        other = tmp_path / "other.digest"
        other.write_text("intruder:0123456789abcdef0123\n")
        with pytest.raises(AtomlogError) as caught:
            ZkSession(info["zookeeper"], chroot, SESSION_TIMEOUT_MS, 10_000, str(other)).start()
        assert "another ZooKeeper credential" in caught.value.message
    finally:
        plain.stop()


def test_the_health_port_answers_in_plaintext_and_only_health(secured):
    with grpc.insecure_channel(f"127.0.0.1:{secured.health_port}") as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                          timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        from atomlog.v1 import metadata_pb2, metadata_pb2_grpc

        with pytest.raises(grpc.RpcError) as caught:  # nothing else is served there
            metadata_pb2_grpc.MetadataServiceStub(channel).ListTopics(
                metadata_pb2.ListTopicsRequest(), timeout=5)
        assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
    with grpc.insecure_channel(secured.info["bootstrap"]) as channel:  # the main port: TLS
        with pytest.raises(grpc.RpcError) as caught:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_securing_walk_cut_short_is_made_again_at_the_next_start(tmp_path):
    """The securing walk set the chroot's ACL first, and a start that finds the chroot
    secured skips the walk: a ZooKeeper blip (or a crash) in the middle left the rest of
    the tree, the ACLs znode among it, writable by everyone for good. The chroot's ACL
    now comes last."""
    from kazoo.exceptions import ConnectionLoss

    from services import zk

    open_acl = ["world-open"]

    class Stat:
        aversion = 0

    class Fake:  # a kazoo client's ACL calls over a small tree
        def __init__(self):
            self.acls = {p: open_acl for p in ("/c", "/c/acls", "/c/topics", "/c/topics/t")}
            self.fail_once = True

        def get_acls(self, path):
            return list(self.acls[path]), Stat()

        def set_acls(self, path, acl, version):
            if path != "/c" and self.fail_once:
                self.fail_once = False
                raise ConnectionLoss()
            self.acls[path] = list(acl)

        def get_children(self, path):
            return [k[len(path) + 1:] for k in self.acls
                    if k.startswith(path + "/") and "/" not in k[len(path) + 1:]]

    digest = tmp_path / "digest"
    digest.write_text("atomlog:" + "x" * 24 + "\n")
    session = ZkSession.__new__(ZkSession)
    session.digest_file, session.chroot = str(digest), "/c"
    session.connect_timeout_ms, session.hosts = 5_000, "fake"
    fake = Fake()
    session.patiently("the ACLs", session._secure, fake)  # the blip is retried
    acl = znode_acl(*zk.read_digest(str(digest)))
    assert {path: found == acl for path, found in fake.acls.items()} == dict.fromkeys(
        fake.acls, True)


def test_settings_validation(tmp_path):
    good = tmp_path / "good.digest"
    good.write_text("atomlog:0123456789abcdef0123\n")
    base = {"server.data_dir": str(tmp_path)}
    load_config("coordinator", env={}, overrides={**base, "zookeeper.digest_file": str(good)})
    problems = {
        "zookeeper.digest_file": ("short", "must hold one line `user:password`"),
        "auth.authorizer": ("acl", "auth.authorizer=acl needs auth.mode"),
        "auth.super_users": ("root", "auth.super_users set, but auth.authorizer is not acl"),
    }
    (tmp_path / "short").write_text("atomlog:short\n")
    for name, (value, message) in problems.items():
        value = str(tmp_path / value) if name == "zookeeper.digest_file" else value
        with pytest.raises(ConfigError) as caught:
            load_config("coordinator", env={}, overrides={**base, name: value})
        assert message in str(caught.value), name
    for name, value in (("auth.authorizer", "opa"), ("server.health_listen", "nowhere"),
                        ("tls.server_name", "atomlog-server")):  # the last needs tls.enabled
        with pytest.raises(ConfigError):
            load_config("coordinator", env={}, overrides={**base, name: value})
