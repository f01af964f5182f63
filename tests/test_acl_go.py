"""The Go client's TLS and bearer-token options (clients/go/atomlog/security.go) against a
real cluster: `atomlog up --tls` with auth.mode=mtls_or_token (static tokens) and ACLs;
`go test -tags secured` (clients/go/atomlog/secured_test.go) sends as a principal allowed
to write (a token over mutual TLS), one that is not (a token file), the certificate's own
principal, and over plaintext, and checks Dial's validation of the options."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from services.acl import Acl
from spark_client import Client
from tests.conftest import REPO_ROOT, SESSION_TIMEOUT_MS, Cluster, create_online
from tests.test_acl import store as acl_store  # noqa: F401 — the module's ACL store
from tests.test_acl import tls_of

pytestmark = pytest.mark.timeout(900)  # a cold Go build takes minutes

TOPIC = "acl-go"
BOB_TOKEN, DAVE_TOKEN = "bob-go-0123456789abcdef", "dave-go-0123456789abcdef"


@pytest.fixture(scope="module")
def acl_cluster(tmp_path_factory):
    where = tmp_path_factory.mktemp("atomlog-acl-go")
    tokens = where / "tokens"
    tokens.write_text(f"bob {BOB_TOKEN}\ndave {DAVE_TOKEN}\n")
    cluster = Cluster(where / "cluster")
    try:
        json.loads(cluster.run(
            "up", "--tls", "--output", "json", "--partition-servers", "1", "--coordinators",
            "1", "--id-allocators", "1", "--set", "auth.mode=mtls_or_token",
            "--set", f"auth.static_tokens_file={tokens}",
            "--set", f"zookeeper.session_timeout_ms={SESSION_TIMEOUT_MS}").stdout)
        with Client(cluster.info["bootstrap"], tls=tls_of(cluster, "admin")) as admin:
            create_online(admin, TOPIC, 1)
        yield cluster
    finally:
        if (cluster.data_dir / "cluster.json").exists():
            cluster.run("down", check=False)


def test_go_client_tls_and_bearer_tokens_under_acls(acl_cluster, acl_store, tmp_path):
    acl_store.change(lambda acls: acls.added([Acl("bob", "topic", TOPIC, "write")]))
    tools = subprocess.run(["bash", str(REPO_ROOT / "scripts" / "go_tools.sh")], cwd=REPO_ROOT,
                           capture_output=True, text=True, timeout=900)
    assert tools.returncode == 0, tools.stdout + tools.stderr
    go = dict(line.split("=", 1) for line in tools.stdout.split())["GO"]
    token_file = tmp_path / "dave.token"
    token_file.write_text(DAVE_TOKEN + "\n")
    tls = tls_of(acl_cluster, "go-client")  # a certificate whose principal has no ACL
    env = {**os.environ, "PATH": f"{Path(go).parent}:{os.environ['PATH']}",
           "ATOMLOG_BOOTSTRAP": acl_cluster.info["bootstrap"], "ATOMLOG_TOPIC": TOPIC,
           "ATOMLOG_TLS_CA": tls.ca_file, "ATOMLOG_TLS_CERT": tls.cert_file,
           "ATOMLOG_TLS_KEY": tls.key_file, "ATOMLOG_TOKEN_ALLOWED": BOB_TOKEN,
           "ATOMLOG_TOKEN_FILE_DENIED": str(token_file)}
    result = subprocess.run([go, "test", "-count=1", "-v", "-tags", "secured", "-run",
                             "TestSecured", "./atomlog/"], cwd=REPO_ROOT / "clients" / "go",
                            capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    passed = {line.split()[2] for line in result.stdout.splitlines() if line.startswith("--- PASS")}
    assert passed == {"TestSecuredTokenOverMutualTLS", "TestSecuredTokenFileWithoutPermission",
                      "TestSecuredCertificatePrincipalWithoutToken",
                      "TestSecuredPlaintextAndBadOptionsAreRefused"}, result.stdout
    log = Path(acl_cluster.process("ps-0")["log_file"]).read_text()
    denied = [json.loads(line) for line in log.splitlines() if '"permission denied"' in line]
    assert {"dave", "go-client"} <= {entry["principal"] for entry in denied}
